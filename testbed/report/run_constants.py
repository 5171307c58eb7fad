"""The constants a run is judged with: the calibration's, on the topology's declared hosts, with the
per-message cost the run measured itself (the probe's burst of small all_reduces) when it did."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from testbed.jobs import rundir
from testbed.report.analyze import LATENCY_OP
from testbed.report.instances import instances, recording_ranks, relative_ci95


LATENCY_WARMUP = 2             # the burst's first ones pay for connections and first touches: not counted


def run_alpha(topo: Any, plan: Any, ranks: list[str], burst: list[dict[str, Any]], constants: Any, s: float,
              backend: str) -> tuple[float, float, str] | None:
    """(alpha, its relative uncertainty, where it comes from) measured in the run itself: the probe's
    small all_reduces after init_process_group, less what the model gives them without a per-message
    cost, per message. None when the run has too few of them (no probe burst: a replay, an older
    probe, nccl): the calibration's alpha then stands. With phantoms the burst is mirrored like the
    job's collectives, and pays the same announcement delay they do.

    Why: what one message costs here depends on the run's own conditions (ranks per core, dilation,
    the machine's load). On the 2-core machine a 16-rank fat-tree at s=15.9 paid 0.69 ms per message
    while calibrations of the same boot said 0.6-1.2 ms (docs/fidelity.md)."""
    from testbed.topology.reference import ModelError, cost_terms, predict, with_alpha

    xs = sorted(burst, key=lambda i: i["start"])[LATENCY_WARMUP:]
    if len(xs) < 3 or backend != "gloo":
        return None
    times = [(i["end"] - i["start"]) / s for i in xs]
    nbytes = LATENCY_BYTES
    try:
        bare = predict(topo, plan, "all_reduce", nbytes, ranks, with_alpha(constants, 0.0, 0.0, ""), backend=backend,
                       placements=1)
    except ModelError:
        return None
    messages = cost_terms("all_reduce", nbytes, len(ranks), backend)[0]
    t = statistics.median(times)
    if messages <= 0 or not t > bare.time_s:
        return None
    alpha = (t - bare.time_s) / messages
    spread = relative_ci95(times) * t / (t - bare.time_s)
    return alpha, spread, f"{RUN_ALPHA} ({len(times)} all_reduce of {nbytes} B after init_process_group)"


LATENCY_BYTES = 4096   # the burst's size (_testbed_probe.LATENCY_BYTES)


RUN_ALPHA = "measured in this run"   # in the constants' description when run_alpha gave the alpha


def run_constants(run: str | Path, machine: Any, topo: Any, ranks: list[str]) -> Any:
    """The constants a run is judged with on its topology's declared hosts: the calibration's,
    with the per-message cost the run measured itself when it did (run_alpha)."""
    from testbed.report.analyze import load_probe
    from testbed.topology.plan import plan_network
    from testbed.topology.reference import for_hosts, with_alpha

    run = Path(run)
    summary = rundir.read_json(run / "summary.json", {}) or {}
    probe = load_probe(run)
    world = int(summary.get("world_size") or len(ranks))
    s = float((summary.get("time_dilation") or {}).get("factor") or 1.0)
    burst = [i for k, xs in instances(probe, world, recording_ranks(summary, world)).items() if k[0] == LATENCY_OP
             for i in xs]
    constants = for_hosts(machine, topo.host_rate)
    backends = {str(r.get("be")) for recs in probe.values() for r in recs if r.get("ev") == "coll" and r.get("be")}
    measured = run_alpha(topo, plan_network(topo), ranks, burst, constants, s,
                         "nccl" if backends == {"nccl"} else "gloo")
    return with_alpha(constants, *measured) if measured is not None else constants


RANK_CORES_MAX = 1000.0


def recorded_rank_cores(summary: dict[str, Any]) -> float:
    """The cores of this machine each rank had in emulated time (dilation.Choice.rank_cores), as the
    run's summary recorded it: 1 when it did not, or when the record is not a sane number (it comes
    from disk)."""
    dil = summary.get("time_dilation")
    v = dil.get("rank_cores") if isinstance(dil, dict) else None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 1 <= v <= RANK_CORES_MAX
    return float(v) if ok else 1.0
