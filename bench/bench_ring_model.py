#!/usr/bin/env python3
"""Ring all-reduce on the testbed vs the ring model T = 2(n-1)*alpha + 2(n-1)/n * S/B.

Brings up (testbed.lifecycle, default runtime) a star of N workers whose host
links run at B (default 1 Gbit/s: the bottleneck), brought down at the end; runs examples/allreduce_bench.py across them with
`testbed run` machinery, and compares the measured time of a large all_reduce
with the model (alpha ~ 0 here: the links have no added delay) and the
measured busbw with the link rate. Needs root. Prints a table and writes
bench/results/ring_model.json.

    python bench/bench_ring_model.py [--workers 4] [--bandwidth 1gbit] [--size 64M]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def star(name: str = "star", hosts: int = 4, bw: str = "1gbit"):
    from testbed.topology.loader import load_topology_text

    return load_topology_text(f"""
name: {name}
generator: star
params: {{n: {hosts}}}
tiers:
  host: {{bandwidth: {bw}}}
""", "<bench_ring_model>")


def measure(workers: int = 4, bandwidth: str = "1gbit", size: str = "64M", iters: int = 3,
            min_size: str | None = None, base_dir: str | None = None, up=None) -> dict:
    """up: how to bring the testbed up (tests pass their fixture, which brings it down);
    default testbed.lifecycle.up, brought down here at the end."""
    from testbed import lifecycle
    from testbed.jobs.run import cluster_from_state, run
    from testbed.net import state
    from testbed.topology.units import parse_bandwidth

    name = f"rb{uuid.uuid4().hex[:6]}"
    try:
        (up or lifecycle.up)(star(name, workers, bandwidth), name)
        # the results file goes to the state dir: visible inside every worker, same path
        out = state.directory(name) / "allreduce.json"
        cmd = [sys.executable, str(REPO / "examples" / "allreduce_bench.py"), "--min-bytes", min_size or size,
               "--max-bytes", size, "--iters", str(iters), "--warmup", "1", "--json", str(out)]
        res = run(cluster_from_state(name), cmd, echo=False, probe=False, base_dir=base_dir or "/tmp",
                  workdir=str(REPO), timeout=300)
        data = json.loads(out.read_text()) if res.rc == 0 else None
    finally:
        if up is None and state.exists(name):
            lifecycle.down(name)
    if res.rc != 0:
        raise RuntimeError(f"allreduce_bench failed with {res.rc}; logs in {res.run_dir}")
    B = parse_bandwidth(bandwidth) / 8  # bytes/s
    n = workers
    rows = []
    for r in data["results"]:
        model = 2 * (n - 1) / n * r["bytes"] / B
        rows.append({**r, "model_s": model, "time_error": r["time_s"] / model - 1,
                     "busbw_vs_link": r["busbw_Bps"] / B})
    return {"workers": n, "bandwidth_Bps": B, "rows": rows, "run_dir": str(res.run_dir)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--size", default="64M")
    ap.add_argument("--min-size", default="1M")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_ring_model needs root (namespaces, tc)", file=sys.stderr)
        return 2
    t0 = time.time()
    r = measure(args.workers, args.bandwidth, args.size, args.iters, args.min_size)
    print(f"ring all_reduce, {r['workers']} workers, links {args.bandwidth} ({r['bandwidth_Bps'] * 8 / 1e9:g} Gbit/s)")
    print(f"{'size':>12} {'measured s':>11} {'model s':>9} {'error':>8} {'busbw Gbit/s':>13} {'of link':>8}")
    for row in r["rows"]:
        print(f"{row['bytes']:>12} {row['time_s']:>11.4f} {row['model_s']:>9.4f} {100 * row['time_error']:>7.1f}% "
              f"{row['busbw_Bps'] * 8 / 1e9:>13.3f} {100 * row['busbw_vs_link']:>7.1f}%")
    big = r["rows"][-1]
    ok = abs(big["time_error"]) <= 0.10 and abs(big["busbw_vs_link"] - 1) <= 0.10
    print(f"largest message: time error {100 * big['time_error']:+.1f}%, busbw {100 * big['busbw_vs_link']:.1f}% "
          f"of the link rate -> {'within' if ok else 'OUTSIDE'} 10%  ({time.time() - t0:.0f} s)")
    outdir = REPO / "bench" / "results"
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "ring_model.json").write_text(json.dumps(r, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
