#!/usr/bin/env python3
"""Phantom ranks against real ones: does 1 real rank + N-1 phantoms see the iteration time the
all-real job sees, and does a job too big for this machine become faithful with phantoms?

Agreement: a 4-worker star and a 2x2 leaf-spine (10 Gbit/s host links, 2 us), brought up at
calibrated `auto` dilation for 4 ranks; examples/train_ddp.py with the main job's MLP (~23 MiB
of gradients, one DDP bucket) on all 4 workers, then with w0 real and w1..w3 phantoms
(`testbed run --real w0`). For each: iteration p50 (emulated, from the real ranks' probe),
the expected iteration (the slowest real rank's own compute + the reference model's all_reduce) and
the verdict.

Scale (--scale): a 64-worker leaf-spine (8 leaves x 8 workers), w0 real and 63 phantoms, at
`auto` dilation with one computing rank (up --real-ranks 1: phantoms compute nothing, the
traffic of all 64 counts), the same MLP; time, memory per phantom, verdict.

    sudo .venv/bin/python bench/phantom_agreement.py [--steps 20] [--scale] [--scale-only] [--engine-spin-us US]

Targets (issue: phantom ranks): phantom vs all-real within 5%, both within 10% of the model;
the 64-rank job faithful. Writes bench/results/phantom_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["--model", "mlp", "--hidden", "1536", "--layers", "3", "--bucket-cap-mb", "64", "--batch-size", "32"]
TOPOLOGIES = {
    "star-4": "name: star4\ngenerator: star\nparams: {n: 4}\ntiers:\n  host: {bandwidth: 10gbit, delay: 2us}\n",
    "leaf-spine-2x2": ("name: ls22\ngenerator: leaf-spine\nparams: {leaves: 2, spines: 2, hosts_per_leaf: 2}\n"
                       "tiers:\n  host: {bandwidth: 10gbit, delay: 2us}\n  leaf-spine: {bandwidth: 10gbit, delay: 2us}\n"),
    "leaf-spine-8x8": ("name: ls88\ngenerator: leaf-spine\nparams: {leaves: 8, spines: 4, hosts_per_leaf: 8}\n"
                       "tiers:\n  host: {bandwidth: 10gbit, delay: 2us}\n  leaf-spine: {bandwidth: 40gbit, delay: 2us}\n"),
}


def _train(steps: int) -> list[str]:
    return [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", str(steps), "--log-every",
            str(steps), "--no-check", *MODEL]


def _judge(run_dir: Path, expected: float | None) -> dict:
    from testbed.report import report

    _text, a, _ = report(run_dir, plots=False, expected_iteration_s=expected)
    p50s = [r["iter_p50_s"] for r in a["ranks"] if r.get("iter_p50_s")]
    v = a["verdict"]
    return {"iter_p50_s": statistics.median(p50s) if p50s else None, "verdict": v.status,
            "reasons": list(v.reasons)[:4],
            "classes": [{"op": c.op, "bytes": c.nbytes, "count": c.count, "measured_s": c.measured_s,
                         "model_s": c.model_s, "error": c.error} for c in v.classes]}


def _rss_mb_of_phantoms(run_id: str) -> float | None:
    from testbed import procs

    try:
        import psutil
    except ImportError:
        return None
    rss = []
    for pid in procs.pids_with_env("TESTBED_RUN_ID", run_id):
        env = procs.environ(pid) or []
        if any(e.startswith(b"TESTBED_PHANTOM_IN=") for e in env):
            try:
                p = psutil.Process(pid)
                if "phantom" in " ".join(p.cmdline()):
                    rss.append(p.memory_info().rss / 2 ** 20)
            except psutil.Error:
                pass
    return statistics.median(rss) if rss else None


def case(key: str, steps: int, machine, scale: bool = False, dilation: str = "auto") -> dict:
    from testbed import lifecycle
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.mainjob import expected_iteration, step_compute
    from testbed.topology.loader import load_topology_text
    from testbed.topology.plan import plan_network
    from testbed.topology.reference import predict

    name = f"pa{uuid.uuid4().hex[:5]}"
    topo = load_topology_text(TOPOLOGIES[key], f"<{key}>")
    out: dict = {"topology": key if dilation == "auto" else f"{key} (fixed s={dilation})",
                 "workers": len(topo.workers), "steps": steps}
    t0 = time.time()
    with lifecycle.running(topo, name, time_dilation=dilation, machine=machine,
                           real_ranks=1 if scale else None):
        st = lifecycle.load(name)
        out["dilation"] = st.get("time_dilation")
        out["up_s"] = time.time() - t0
        cl = cluster_from_state(name)
        modes = [("phantoms", ["w0"])] if scale else [("all-real", None), ("phantoms", ["w0"])]
        for mode, real in modes:
            print(f"  {key}: {mode} ...", flush=True)
            peak: dict = {}

            def sample(rd: Path, _probe: Path) -> None:
                import threading

                def later() -> None:
                    time.sleep(20 if scale else 5)
                    summary = json.loads((rd / "summary.json").read_text())
                    peak["rss_mb"] = _rss_mb_of_phantoms(summary["run_id"])

                threading.Thread(target=later, daemon=True).start()

            t = time.time()
            res = run(cl, _train(steps), echo=False, machine=machine, real=real, workdir=str(REPO),
                      base_dir="/var/tmp/testbed-bench", timeout=1800, on_start=sample if real else None)
            wall = time.time() - t
            compute = step_compute(res.run_dir, float(st.get("time_dilation") or 1.0)) if res.rc == 0 else None
            exp = expected_iteration(res.run_dir, cl, compute["compute_s"], machine, predict, plan_network) \
                if compute else None
            out.setdefault("compute_s", {})[mode] = compute["compute_s"] if compute else None
            row = {"rc": res.rc, "wall_s": wall, "run_dir": str(res.run_dir),
                   "expected_iter_s": exp["iteration_s"] if exp else None}
            if res.rc == 0:
                row.update(_judge(res.run_dir, row["expected_iter_s"]))
                # what `testbed run` itself says (no expected iteration: the collectives, CPUs, phantoms)
                row["run_verdict"] = _judge(res.run_dir, None)["verdict"]
            if real:
                row["phantom_rss_mb"] = peak.get("rss_mb")
                row["announce_late_p50_s"] = (res.summary.get("phantoms") or {}).get("announce_late_p50_s")
            out[mode] = row
            print(f"    rc {res.rc}, {wall:.0f} s, iteration p50 "
                  f"{(row.get('iter_p50_s') or 0) * 1e3:.1f} ms (expected {(row['expected_iter_s'] or 0) * 1e3:.1f}),"
                  f" {row.get('verdict')}", flush=True)
    a, p = out.get("all-real", {}), out.get("phantoms", {})
    if a.get("iter_p50_s") and p.get("iter_p50_s"):
        out["phantom_vs_real"] = p["iter_p50_s"] / a["iter_p50_s"] - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scale", action="store_true", help="also the 64-worker job with one real rank")
    ap.add_argument("--scale-only", action="store_true")
    ap.add_argument("--scale-dilation", default="auto", help="the scale case's --time-dilation (default auto)")
    ap.add_argument("--engine-spin-us", type=float, default=None,
                    help="how early the delay-line engines' timer fires, in us (default: the engine's own)")
    args = ap.parse_args()
    if args.engine_spin_us is not None:
        from testbed.net import delayline

        delayline.ENGINE_SPIN_S = args.engine_spin_us * 1e-6
    from testbed.jobs import calibration

    machine = calibration.get().constants()
    rows = []
    if not args.scale_only:
        for key in ("star-4", "leaf-spine-2x2"):
            rows.append(case(key, args.steps, machine))
    if args.scale or args.scale_only:
        rows.append(case("leaf-spine-8x8", max(5, args.steps // 2), machine, scale=True,
                         dilation=args.scale_dilation))
    print()
    print(f"{'topology':<16} {'s':>4} {'all-real ms':>12} {'phantoms ms':>12} {'diff':>7} {'model ms':>9} "
          f"{'verdicts':<28}")
    for r in rows:
        a, p = r.get("all-real", {}), r.get("phantoms", {})
        d = r.get("phantom_vs_real")
        print(f"{r['topology']:<16} {r.get('dilation') or 0:>4g} {(a.get('iter_p50_s') or 0) * 1e3:>12.1f} "
              f"{(p.get('iter_p50_s') or 0) * 1e3:>12.1f} {'' if d is None else f'{100 * d:+.1f}%':>7} "
              f"{(p.get('expected_iter_s') or 0) * 1e3:>9.1f} {a.get('verdict', '-')} / {p.get('verdict', '-')}")
    out = REPO / "bench" / "results" / "phantom_agreement.json"
    out.parent.mkdir(exist_ok=True)
    kept = []   # rows of the topologies this run did not measure stay (--scale-only keeps the agreement)
    if out.exists():
        try:
            kept = [r for r in json.loads(out.read_text()).get("rows", [])
                    if r.get("topology") not in {x["topology"] for x in rows}]
        except (OSError, ValueError, AttributeError):
            kept = []
    for r in rows:
        r["when"] = time.strftime("%Y-%m-%d %H:%M")
    out.write_text(json.dumps({"steps": args.steps, "rows": kept + rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
