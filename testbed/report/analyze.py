"""Numbers from a run directory: iteration times, throughput, comm share, bytes per tier.

All times are divided by the run's time dilation factor (summary.json
`time_dilation.factor`): they are what the emulated cluster would see.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from testbed import safeio
from testbed.jobs import rundir

PROBE_FILE_MAX_BYTES = 512 << 20
PROBE_LINE_MAX_BYTES = 1 << 20
EVENTS_FILE_MAX_BYTES = 64 << 20   # testbed-events.jsonl of one run: a few KiB; a job may have grown it
LATENCY_OP = "latency_burst"   # the probe's own small all_reduces (_testbed_probe.py): not the job's


def run_events(run: Path) -> list[dict[str, Any]]:
    """The testbed's events of the run's span (testbed-events.jsonl, kept by `testbed run`): link and
    node changes, captures, scenario steps. Lines that are not events are passed over."""
    from testbed import events

    try:   # in the run directory, which a job can reach: never a FIFO waited on, never unbounded
        data = safeio.read_regular(run / "testbed-events.jsonl", EVENTS_FILE_MAX_BYTES)
    except (OSError, safeio.Unsafe):
        return []
    return [e for e in map(events.parse, data.splitlines()) if e is not None]


def load_probe(run: Path) -> dict[str, list[dict[str, Any]]]:
    """rank label -> its records, in file order. RUN/probe is opened without following a link
    (rundir.open_probe): one a job put there, or at the run directory, is safeio.Unsafe naming it."""
    try:
        dfd = rundir.open_probe(Path(run))
    except FileNotFoundError:   # a run without the probe
        return {}
    out = {}
    try:
        for name in sorted(os.listdir(dfd)):
            if not (name.startswith("rank-") and name.endswith(".jsonl")):
                continue
            try:   # written by ranks: no link followed, no FIFO waited on, neither file nor line unbounded
                fd = rundir.open_in(dfd, name)
            except (OSError, safeio.Unsafe):
                continue
            recs = []
            try:
                if os.fstat(fd).st_size > PROBE_FILE_MAX_BYTES:
                    continue
                # (a line cut at the bound is no JSON: passed over)
                for line in safeio.lines_of_fd(fd, PROBE_LINE_MAX_BYTES + 1, max_bytes=PROBE_FILE_MAX_BYTES):
                    if len(line) > PROBE_LINE_MAX_BYTES:
                        continue
                    try:
                        rec = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        continue
                    if isinstance(rec, dict) and _timed(rec):
                        recs.append(rec)
            finally:
                os.close(fd)
            out[name.removeprefix("rank-").removesuffix(".jsonl")] = recs
    finally:
        os.close(dfd)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0, kv[0])))


def finite(v: Any) -> bool:
    """A number read from disk or from a rank: an int or float (not a bool), neither NaN nor infinite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _timed(rec: dict[str, Any]) -> bool:
    """A step or collective record carries its times as numbers (a rank wrote it: one that does not
    is passed over, as a line that is no JSON is, rather than stopping the report)."""
    if rec.get("ev") == "step":
        return finite(rec.get("t"))
    if rec.get("ev") == "coll":
        return finite(rec.get("t")) and finite(rec.get("dur")) and rec["dur"] >= 0
    return True


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyze(run: str | Path) -> dict[str, Any]:
    run = Path(run)
    summary = rundir.read_json(run / "summary.json", {}) or {}
    s = float((summary.get("time_dilation") or {}).get("factor") or 1.0)
    probe = load_probe(run)
    ranks = []
    tot_samples_rate = 0.0
    for label, recs in probe.items():
        start = next((r for r in recs if r.get("ev") == "start"), {})
        steps = [r for r in recs if r.get("ev") == "step"]
        colls = [r for r in recs if r.get("ev") == "coll" and r.get("op") != LATENCY_OP]
        ends = [r["t"] for r in steps]
        iters = [(b - a) / s for a, b in zip(ends, ends[1:])]  # first step: warm-up, no predecessor
        window = (ends[0], ends[-1]) if len(ends) >= 2 else None
        comm = 0.0
        if window:
            iv = [(max(c["t"], window[0]), min(c["t"] + c["dur"], window[1])) for c in colls]
            comm = _union([(a, b) for a, b in iv if b > a]) / s
        span = (window[1] - window[0]) / s if window else 0.0
        samples = [r.get("samples") for r in steps[1:] if r.get("samples")]
        sps = (sum(samples) / span) if samples and span > 0 else None
        if sps:
            tot_samples_rate += sps
        ranks.append({
            "rank": label, "worker": start.get("worker"), "steps": len(steps),
            "iter_p50_s": percentile(iters, 50), "iter_p95_s": percentile(iters, 95),
            "iter_mean_s": sum(iters) / len(iters) if iters else None,
            "samples_per_s": sps, "comm_share": (comm / span) if span > 0 else None,
            "collectives": len(colls), "coll_bytes": sum(c.get("bytes", 0) for c in colls),
            "step_times": [{"t": (b - ends[0]) / s, "dt": d} for b, d in zip(ends[1:], iters)],
        })
    links = summary.get("links") or []
    # Utilisation is over the window the job communicated (first collective's start to the last
    # one's end, over all ranks), not the whole wall time (start-up, imports, rendezvous, teardown
    # would dilute it); without collectives in the probe, over the run's wall time.
    colls = [r for recs in probe.values() for r in recs
             if r.get("ev") == "coll" and "t" in r and r.get("op") != LATENCY_OP]
    if colls:
        w0 = min(c["t"] for c in colls)
        w1 = max(c["t"] + (c.get("dur") or 0.0) for c in colls)
        dur, util_window = max(w1 - w0, 0.0), "comm"
    else:
        dur, util_window = float(summary.get("duration_s") or 0.0), "wall"
    tiers: dict[str, dict[str, float]] = {}
    for l in links:
        t = tiers.setdefault(l["tier"], {"bytes": 0, "links": 0, "max_util": 0.0})
        t["bytes"] += l["bytes_ab"] + l["bytes_ba"]
        t["links"] += 1
        for key, bw in (("bytes_ab", l.get("bandwidth_ab")), ("bytes_ba", l.get("bandwidth_ba"))):
            if bw and dur > 0:
                # the emulated link ran at bw/s for dur seconds of real time (raw, undilated)
                util = l[key] * 8 / dur / (bw / s)
                l.setdefault("util", {})[key] = util
                t["max_util"] = max(t["max_util"], util)
    return {"run": str(run), "summary": summary, "dilation": s, "ranks": ranks, "tiers": tiers, "links": links,
            "samples_per_s": tot_samples_rate or None,
            "util_window": {"kind": util_window, "raw_s": dur, "s": dur / s}}
