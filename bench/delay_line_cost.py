#!/usr/bin/env python3
"""What a run's delay lines cost and how late they sent: prints one JSON object per run directory.

    .venv/bin/python bench/delay_line_cost.py runs/RUN [runs/RUN ...]

From the run's monitor.json (the delay-line engines' counters at its start and end, and their share
of the CPUs): the bytes and frames the engines carried in that time, the engines' CPU time per frame
and per byte, and how late they sent frames (the engines' log2 histogram, as percentiles).
A kernel without sch_netem carries a link's delay through a delay line (testbed/net/delay_engine.py)
where the delay, dilated, passes the delay threshold; docs/fidelity.md has what this measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BINS = 24   # the engines' histogram: bin i counts frames sent less than 2**i us late


def _num(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def cost(run: Path) -> dict:
    m = json.loads((run / "monitor.json").read_text())
    lines = m.get("delay_lines") or {}
    first, last = lines.get("first") or {}, lines.get("last") or {}
    nbytes = frames = 0.0
    late = [0.0] * BINS
    delays: set[float] = set()
    for link, now in last.items():
        if not isinstance(now, dict) or not now.get("ok"):
            continue
        before = first.get(link) if isinstance(first.get(link), dict) else {}
        for way in ("ab", "ba"):
            a, b = now.get(way) or {}, before.get(way) or {}
            nbytes += _num(a.get("bytes")) - _num(b.get("bytes"))
            frames += _num(a.get("frames")) - _num(b.get("frames"))
            ha, hb = a.get("late_hist_us_log2") or [], b.get("late_hist_us_log2") or []
            for i in range(min(BINS, len(ha))):
                late[i] += _num(ha[i]) - (_num(hb[i]) if i < len(hb) else 0.0)
            delays.add(round(_num(a.get("delay_s")) * 1e6, 1))
    span = _num(m.get("t1")) - _num(m.get("t0"))
    engine_s = _num(m.get("engines_cpu_share")) * _num(m.get("cores")) * span
    total = sum(late)

    def below(q: float) -> float | None:   # the bin's upper edge (us) where the share q of frames is reached
        acc = 0.0
        for i, c in enumerate(late):
            acc += c
            if total and acc >= q * total:
                return float(2 ** i)
        return None

    return {"run": str(run), "seconds": round(span, 1), "frames": int(frames), "gbytes": round(nbytes / 1e9, 2),
            "bytes_per_frame": round(nbytes / frames) if frames else None,
            "engine_cpu_s": round(engine_s, 1),
            "engine_us_per_frame": round(engine_s / frames * 1e6, 1) if frames else None,
            "engine_ns_per_byte": round(engine_s / nbytes * 1e9, 2) if nbytes else None,
            "late_us_below": {"p50": below(0.5), "p90": below(0.9), "p99": below(0.99)},
            "link_delays_us": sorted(delays)[:8]}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for arg in argv:
        print(json.dumps(cost(Path(arg))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
