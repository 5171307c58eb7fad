#!/usr/bin/env python3
"""Dilated vs dedicated: does a 2-rank job see the same emulated iteration time when 14 other ranks
share the machine under calibrated dilation as when it has the machine to itself?

1. Reference: a 2-worker star (10 Gbit/s, 2 us) at calibrated `auto` (1 here: 2 ranks, 2 cores),
   examples/train_ddp.py with the main job's MLP (~23 MiB of gradients, one DDP bucket) on both
   workers, alone on the machine.
2. Dilated: a k=4 fat-tree (16 workers) at calibrated `auto` (8 here). Job B, the same script on
   w2..w15 (14 ranks), runs for the whole measurement; job A, the 2-rank job, runs on w0 and w1
   (one edge switch: two host links, as on the star) while B trains.
3. Prints both jobs' iteration p50 (emulated time, from the probe) and the ratio, and the verdicts.

    sudo .venv/bin/python bench/dilation_isolation.py [--steps 20]

Target (issue: fidelity): the dilated p50 within 5% of the reference. Writes
bench/results/dilation_isolation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["--model", "mlp", "--hidden", "1536", "--layers", "3", "--bucket-cap-mb", "64", "--batch-size", "32"]


def _train(steps: int) -> list[str]:
    return [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", str(steps), "--log-every",
            str(steps), *MODEL]


def _p50(run_dir: Path) -> float:
    from testbed.report import report

    _text, a, _ = report(run_dir, plots=False)
    p50s = [r["iter_p50_s"] for r in a["ranks"] if r.get("iter_p50_s")]
    return statistics.median(p50s), a["verdict"].status


def _steps_done(run_dir: Path) -> int:
    try:
        return (run_dir / "probe" / "rank-0.jsonl").read_bytes().count(b'"ev":"step"')
    except OSError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (namespaces, tc)", file=sys.stderr)
        return 2
    from testbed import lifecycle
    from testbed.jobs import calibration
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology, load_topology_text

    machine = calibration.get(progress=print).constants()
    base = Path("/var/tmp/testbed-bench")
    out: dict = {"steps": args.steps}

    name = f"di{uuid.uuid4().hex[:5]}"
    star = load_topology_text(f"name: {name}\ngenerator: star\nparams: {{n: 2}}\ntiers:\n"
                              "  host: {bandwidth: 10gbit, delay: 2us}\n", "<bench>")
    with lifecycle.running(star, name, time_dilation="auto", machine=machine):
        cl = cluster_from_state(name)
        res = run(cl, _train(args.steps), echo=False, machine=machine, base_dir=str(base), workdir=str(REPO))
        out["reference"] = {"factor": cl.time_dilation, "rc": res.rc, "run_dir": str(res.run_dir)}
        out["reference"]["p50_s"], out["reference"]["verdict"] = _p50(res.run_dir)
    print(f"reference: 2 ranks alone, s={out['reference']['factor']:g}: iteration p50 "
          f"{out['reference']['p50_s'] * 1e3:.1f} ms ({out['reference']['verdict']})", flush=True)

    name = f"di{uuid.uuid4().hex[:5]}"
    ft = load_topology("fat-tree")
    with lifecycle.running(ft, name, time_dilation="auto", machine=machine):
        cl = cluster_from_state(name)
        stop_b = threading.Event()
        box: dict = {}

        def job_b() -> None:
            box["b"] = run(cl, _train(100000), workers=cl.workers[2:], echo=False, machine=machine,
                           base_dir=str(base), workdir=str(REPO), stop=stop_b,
                           on_start=lambda rd, _probe: box.__setitem__("b_dir", rd))

        tb = threading.Thread(target=job_b)
        tb.start()
        deadline = time.monotonic() + 300
        while not ("b_dir" in box and _steps_done(box["b_dir"]) >= 2) and time.monotonic() < deadline:
            time.sleep(0.5)   # B is training: A starts into a busy machine
        try:
            res = run(cl, _train(args.steps), workers=cl.workers[:2], echo=False, machine=machine,
                      base_dir=str(base), workdir=str(REPO))
        finally:
            stop_b.set()
            tb.join()
        out["dilated"] = {"factor": cl.time_dilation, "rc": res.rc, "run_dir": str(res.run_dir),
                          "other_job_steps": _steps_done(box["b_dir"])}
        out["dilated"]["p50_s"], out["dilated"]["verdict"] = _p50(res.run_dir)
    ratio = out["dilated"]["p50_s"] / out["reference"]["p50_s"]
    out["ratio"] = ratio
    print(f"dilated: the same 2 ranks beside 14 others, s={out['dilated']['factor']:g}: iteration p50 "
          f"{out['dilated']['p50_s'] * 1e3:.1f} ms ({out['dilated']['verdict']}); the other job made "
          f"{out['dilated']['other_job_steps']} steps meanwhile")
    print(f"dilated / reference = {ratio:.3f} ({100 * (ratio - 1):+.1f}%; target within 5%: "
          f"{'met' if abs(ratio - 1) <= 0.05 else 'MISSED'})")
    (REPO / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (REPO / "bench" / "results" / "dilation_isolation.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
