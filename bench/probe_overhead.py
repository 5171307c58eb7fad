#!/usr/bin/env python3
"""What the probe (with the emulated clock) costs the main job: the same training with and without it.

Brings up the k=4 fat-tree at calibrated `auto` dilation, then runs the main job's training
(examples/train_ddp.py, 16 ranks, the MLP with ~23 MiB of gradients) --repeat times with the
probe and as many without (alternating, so that drift hits both alike). The figure compared is
the script's own "done: N steps in X s" of rank 0, in real seconds (with the probe the script's
clock is emulated: X times the factor). Prints the medians and the overhead.

    sudo .venv/bin/python bench/probe_overhead.py [--repeat 3] [--steps 20]

Target (issue: fidelity): under 2% of step time; when the runs without the probe spread more than
that among themselves, the result says it cannot tell. Writes bench/results/probe_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DONE = re.compile(r"done: (\d+) steps in ([0-9.]+)s")


TARGET = 0.02
MIN_PAIRS = 3   # fewer runs say nothing about their own spread


def summarize(times: dict[str, list[float]]) -> dict[str, float | str | list[float]]:
    """The overhead by medians and pair by pair (each run with the probe against the run without it
    next to it), and whether the runs' own spread lets a cost of TARGET be told at all: when the runs
    without the probe differ among themselves by more than the target, neither "met" nor "missed"
    is a measurement."""
    on, off = statistics.median(times["probe"]), statistics.median(times["no probe"])
    paired = [a / b - 1 for a, b in zip(times["probe"], times["no probe"], strict=True)]
    spread = max(max(xs) / min(xs) - 1 for xs in times.values())   # the wider of the two arms
    overhead = on / off - 1
    if len(paired) < MIN_PAIRS:
        verdict = f"not resolvable with {len(paired)} pair(s) (at least {MIN_PAIRS})"
    elif spread > TARGET:
        verdict = f"not resolvable at {TARGET:.0%} (the runs' own spread is wider)"
    else:
        verdict = "met" if overhead < TARGET else "MISSED"
    return {"with_s": on, "without_s": off, "overhead": overhead, "paired": paired,
            "paired_median": statistics.median(paired), "spread": spread, "verdict": verdict}


def _pcts(xs: list[float]) -> str:
    return ", ".join(f"{100 * x:+.1f}%" for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.repeat < 1 or args.steps < 1:
        ap.error("--repeat and --steps must be at least 1")
    if os.geteuid() != 0:
        print("needs root (namespaces, tc)", file=sys.stderr)
        return 2
    from testbed import lifecycle
    from testbed.jobs import calibration
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.mainjob import MODEL_ARGS
    from testbed.topology.loader import load_topology

    machine = calibration.get(progress=print).constants()
    name = f"po{uuid.uuid4().hex[:5]}"
    times: dict[str, list[float]] = {"probe": [], "no probe": []}
    with lifecycle.running(load_topology("fat-tree"), name, time_dilation="auto", machine=machine):
        cl = cluster_from_state(name)
        s = cl.time_dilation
        cmd = [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", str(args.steps),
               "--batch-size", "32", "--log-every", str(args.steps), *MODEL_ARGS]
        for i in range(args.repeat):
            for probe in ((True, False) if i % 2 == 0 else (False, True)):   # a drift hits both arms alike
                lines: list[str] = []
                res = run(cl, cmd, echo=lines.append, probe=probe, machine=machine, monitor=False,
                          base_dir="/var/tmp/testbed-bench", workdir=str(REPO))
                m = next((DONE.search(l) for l in lines if l.startswith("[w0:r0]") and DONE.search(l)), None)
                if res.rc != 0 or m is None:
                    raise SystemExit(f"the training failed ({res.rc}); logs in {res.run_dir}")
                seconds = float(m.group(2)) * (s if probe else 1.0)   # real seconds either way
                per_step = seconds / int(m.group(1))
                times["probe" if probe else "no probe"].append(per_step)
                print(f"run {i + 1} {'with' if probe else 'without'} the probe: {per_step * 1e3:.1f} ms per step "
                      "(real time)", flush=True)
    summary = summarize(times)
    print(f"median per step: {summary['with_s'] * 1e3:.1f} ms with the probe, {summary['without_s'] * 1e3:.1f} ms "
          f"without: overhead {100 * summary['overhead']:+.2f}%; pair by pair {_pcts(summary['paired'])}, median "
          f"{100 * summary['paired_median']:+.1f}%; the runs spread {100 * summary['spread']:.1f}% among "
          f"themselves: {summary['verdict']}")
    (REPO / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (REPO / "bench" / "results" / "probe_overhead.json").write_text(json.dumps(
        {"factor": s, "steps": args.steps, "per_step_s": times, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
