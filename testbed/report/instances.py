"""A run's collectives as instances, read from the ranks' probe records: one instance per collective
(matched by process group and sequence number, or a send with its receive), which ranks ran where,
and the confidence of a class's mean time."""

from __future__ import annotations

import math
import statistics
from typing import Any


MODEL_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "reduce_scatter": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "broadcast": "broadcast", "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
             "barrier": "barrier"}


def instances(probe: dict[str, list[dict[str, Any]]], world: int, recording: int | None = None
              ) -> dict[tuple[str, int, tuple[int, ...]], list[dict[str, Any]]]:
    """(op, bytes, ranks) -> complete instances: {"start", "end", "skew", "group", "async", "ddp"}
    (real seconds; skew: from the first rank's arrival to the last's, the wait that is in the ranks'
    steps but not in `end - start`; group: its process group; async: launched without waiting for
    it; ddp: one of DDP's buckets).

    Collectives on the whole world (ranks = ()), matched by process group and sequence number;
    blocking sends and receives, the k-th send from a to b with the k-th receive at b from a
    (ranks = (a, b), op "send_recv"). recording: how many ranks have probe records (the real
    ones of a run with phantoms; default: all of them); an instance is complete with theirs."""
    recording = world if recording is None else recording
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for label, recs in probe.items():
        start = next((r for r in recs if r.get("ev") == "start"), {})
        me = start.get("rank")
        p2p_count: dict[tuple[int, int], int] = {}
        for r in recs:
            if r.get("ev") != "coll" or "seq" not in r:
                continue
            if r.get("async") and r.get("src") != "ddp" and not r.get("done"):   # a launch without its completion
                continue
            if r.get("op") in ("send", "recv"):
                peer = r.get("peer")
                if not isinstance(me, int) or not isinstance(peer, int):
                    continue
                pair = (me, peer) if r["op"] == "send" else (peer, me)
                p2p_count[pair] = k = p2p_count.get(pair, 0) + 1
                by_key.setdefault(("p2p", pair, k), []).append(r)
            elif r.get("gn") == world and isinstance(r.get("seq"), int):
                by_key.setdefault((str(r.get("g")), r["seq"]), []).append(r)
    out: dict[tuple[str, int, tuple[int, ...]], list[dict[str, Any]]] = {}
    for key, recs in by_key.items():
        if key[0] == "p2p":
            if sorted(r["op"] for r in recs) != ["recv", "send"]:
                continue
            op, ranks = "send_recv", key[1]
        else:
            raw = recs[0].get("op")
            op, ranks = MODEL_OP.get(raw, raw) if isinstance(raw, str) else None, ()   # unmodelled: unjudged later
            if len(recs) != recording or op is None or any(MODEL_OP.get(r.get("op"), r.get("op")) != op for r in recs):
                continue
        try:   # records come from ranks: a malformed one drops its instance, not the report
            start = max(float(r["t"]) for r in recs)
            first = min(float(r["t"]) for r in recs)
            end = max(float(r["t"]) + float(r["dur"]) for r in recs)
            nbytes = int(recs[0].get("bytes") or 0)
        except (KeyError, TypeError, ValueError):
            continue
        if not (math.isfinite(start) and math.isfinite(end)):   # NaN and inf parse as JSON too
            continue
        out.setdefault((op, nbytes, ranks), []).append({
            "start": start, "end": end, "skew": start - first, "group": "p2p" if key[0] == "p2p" else key[0],
            "async": any(r.get("async") is True for r in recs), "ddp": any(r.get("src") == "ddp" for r in recs)})
    return out


def launches_only(probe: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, int], int]:
    """(op, bytes) -> how many asynchronous collectives the lowest rank launched whose completion
    was not recorded (a probe older than completion timing, or a job that never waited on them)."""
    out: dict[tuple[str, int], int] = {}
    first = min(probe, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k), default=None)
    for r in probe.get(first, []) if first is not None else []:
        if r.get("ev") == "coll" and r.get("async") and r.get("src") != "ddp" and not r.get("done"):
            key = (str(r.get("op")), int(r.get("bytes") or 0) if isinstance(r.get("bytes"), int) else 0)
            out[key] = out.get(key, 0) + 1
    return out


def rank_workers(probe: dict[str, list[dict[str, Any]]], world: int,
                  summary: dict[str, Any] | None = None) -> list[str] | None:
    workers: dict[int, str] = {}
    if summary and summary.get("phantoms"):   # phantoms record nothing: the launcher's own table
        for r in summary.get("ranks") or []:
            if isinstance(r, dict) and isinstance(r.get("rank"), int) and isinstance(r.get("worker"), str):
                workers[r["rank"]] = r["worker"]
    for recs in probe.values():
        start = next((r for r in recs if r.get("ev") == "start"), None)
        if start and isinstance(start.get("rank"), int) and start.get("worker"):
            workers[start["rank"]] = str(start["worker"])
    if sorted(workers) != list(range(world)):
        return None
    return [workers[r] for r in range(world)]


def recording_ranks(summary: dict[str, Any], world: int) -> int:
    """How many ranks ran the job (and have probe records): the real ones when there were phantoms
    (they compute nothing; their traffic is the network's to carry, which the model accounts)."""
    ph = summary.get("phantoms")
    if isinstance(ph, dict) and isinstance(ph.get("real_ranks"), list) and (ph["real_ranks"] or summary.get("replay")):
        return len(ph["real_ranks"])   # a replay: none computes
    return world


# Student's t at 97.5% for n - 1 degrees of freedom (n = 2..31); beyond, the normal's 1.96
_T975 = (12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def relative_ci95(times: list[float]) -> float:
    """The 95% confidence interval's half-width of the mean of `times`, relative to the mean
    (0 for one instance: nothing says how it varies)."""
    n = len(times)
    mean = statistics.fmean(times) if times else 0.0
    if n < 2 or mean <= 0:
        return 0.0
    t = _T975[n - 2] if n - 2 < len(_T975) else 1.96
    return t * statistics.stdev(times) / math.sqrt(n) / mean


def active_window(probe: dict[str, list[dict[str, Any]]]) -> tuple[float, float] | None:
    """From the first collective or step to the last one, over all ranks (the job's busy time)."""
    ts = [(float(r["t"]), float(r["t"]) + float(r.get("dur") or 0.0)) for recs in probe.values() for r in recs
          if r.get("ev") in ("coll", "step") and "t" in r]
    if not ts:
        return None
    return min(a for a, _ in ts), max(b for _, b in ts)
