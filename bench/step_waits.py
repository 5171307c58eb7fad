#!/usr/bin/env python3
"""Who a DDP job's steps wait for, from the probe records of finished runs (the main job's).

For each run: per step, the rank that reached the all_reduce last and the one that had done the
most work since its previous all_reduce (CPU seconds: the probe's "w" readings); how often they
are the same rank; how far the last one's wall time was from its CPU time (a wait for a CPU);
the slowest and the median rank's work; how many rank-steps had a burst of page faults; and the
all_reduce from the last launch to the last completion against how far apart the ranks arrived.

    .venv/bin/python bench/step_waits.py runs/RUN [runs/RUN ...]

Reads only; prints one paragraph per run and, over all of them, the all_reduce by arrival spread.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.mainjob import own_work, step_compute   # noqa: E402
from testbed.report.analyze import load_probe          # noqa: E402
from testbed.report.instances import instances         # noqa: E402

BURST = 1000   # page faults in one rank's step that count as a burst (the bursts seen: 1,152 and 2,304)
SPREADS_MS = ((0, 5), (5, 10), (10, 20), (20, 40), (40, 1e9))


def dilation(run: Path) -> float:
    d = json.loads((run / "summary.json").read_text())
    return float((d.get("time_dilation") or {}).get("factor") or d.get("dilation") or 1.0)


def arrivals(probe: dict, s: float) -> list[tuple[float, float]]:
    """Per all_reduce of the size of DDP's bucket (the verdict's instances, less the first two: the
    warm-up steps): (how far apart the ranks launched it, from the last launch to the last
    completion), emulated ms."""
    world = len(probe)
    sizes = {int(c.get("bytes") or 0) for recs in probe.values() for c in recs
             if c.get("ev") == "coll" and c.get("src") == "ddp"}
    found = [i for (op, nbytes, ranks), xs in instances(probe, world).items()
             if op == "all_reduce" and nbytes in sizes and ranks == () for i in xs]
    found.sort(key=lambda i: i["start"])
    return [(i["skew"] / s * 1e3, (i["end"] - i["start"]) / s * 1e3) for i in found[2:]]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[2].strip(), file=sys.stderr)
        return 2
    spread_rows: list[tuple[float, float]] = []
    for arg in argv:
        run = Path(arg)
        s = dilation(run)
        probe = load_probe(run)
        work = {k: own_work(v, s) for k, v in probe.items()}
        work = {k: w for k, w in work.items() if w}
        c = step_compute(run, s)
        if not work or c is None:
            print(f"{run.name}: no work readings (a probe older than 2026-12-06?)")
            continue
        steps = sorted(set.intersection(*(set(w) for w in work.values())))
        same, lags, bursts = 0, [], 0
        for n in steps:
            wall = {r: w[n]["wall_s"] for r, w in work.items()}
            cpu = {r: w[n]["cpu_s"] for r, w in work.items()}
            last, most = max(wall, key=wall.get), max(cpu, key=cpu.get)
            same += last == most
            lags.append(wall[last] - cpu[last])
            bursts += sum(1 for w in work.values() if w[n]["faults"] >= BURST)
        slowest = [max(w[n]["cpu_s"] for w in work.values()) * 1e3 for n in steps]
        typical = [statistics.median(w[n]["cpu_s"] for w in work.values()) * 1e3 for n in steps]
        print(f"{run.name} (s = {s:g}, {len(work)} ranks, {len(steps)} steps):\n"
              f"  the last to arrive had done the most work in {same} of {len(steps)} steps; its wall time "
              f"less its CPU time {min(lags) * 1e3:+.1f}..{max(lags) * 1e3:+.1f} ms\n"
              f"  the slowest rank's work per step {min(slowest):.0f}-{max(slowest):.0f} ms (median "
              f"{c['compute_s'] * 1e3:.1f}), the median rank's {min(typical):.0f}-{max(typical):.0f} ms (median "
              f"{c['typical_s'] * 1e3:.1f})\n"
              f"  rank-steps with a burst of >= {BURST} page faults: {bursts} of {len(steps) * len(work)}")
        spread_rows += arrivals(probe, s)
    if len(spread_rows) > 2:
        xs, ys = [x for x, _ in spread_rows], [y for _, y in spread_rows]
        print(f"all_reduce from the last launch to the last completion, by how far apart the ranks launched "
              f"({len(xs)} steps; correlation {statistics.correlation(xs, ys):+.2f}):")
        for lo, hi in SPREADS_MS:
            sel = [y for x, y in spread_rows if lo <= x < hi]
            if sel:
                print(f"  {lo:g}-{hi:g} ms apart: {len(sel)} steps, median {statistics.median(sel):.1f} ms"
                      if hi < 1e9 else f"  {lo:g} ms or more apart: {len(sel)} steps, median "
                      f"{statistics.median(sel):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
