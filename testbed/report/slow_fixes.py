"""What to change when collectives ran slower than the model with no more ranks per core than s:
the fixes the verdict gives, by what the run's dilation and CPU cap left the ranks' bytes.

- Classes that shared the links with collectives in flight beside them (DDP's buckets during
  backward), at auto with the cap: the job's compute took part of the cap from gloo's threads.
- At a fixed dilation with the cap: the cap left each rank a fixed share of a core for its bytes,
  whatever s is; classes whose host work on that share outlasts 1/HOST_MARGIN of the links' time
  are the cap's, the others are not.
- At auto: what is left is the collectives' own CPU work (reductions, gloo's copies), unless the
  CPUs were saturated while they ran (checks.cpu_while_collectives), whose fix is given instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from testbed.jobs import rundir
from testbed.report.run_constants import recorded_rank_cores
from testbed.topology.units import format_size


def slow_fixes(run: Path, summary: dict[str, Any], machine: Any, slow: list[Any], s: float,
               saturated: str | None = None) -> list[str]:
    """The fixes for SLOW (the verdict's classes off the model on the slow side, with a material
    share), on a run with no more ranks per core than s; saturated: the fix of the CPUs' saturation
    while the collectives ran, which replaces "not oversubscribed" where the run says it."""
    fixes = []
    dil = summary.get("time_dilation") or {}
    margin = _host_margin(run) if dil.get("setting") == "auto" and dil.get("cap_cpu") else None
    beside = [r for r in slow if r.shared] if margin is not None else []
    if beside:
        fixes.append(_ran_beside_the_job(beside, margin))
        slow = [r for r in slow if r not in beside]
    if not slow:
        return fixes
    worst = max(r.measured_s / r.model_s for r in slow)
    if dil.get("cap_cpu") and dil.get("setting") == "fixed":
        beta = _beta(summary, machine)
        world = int(summary.get("world_size") or 1)
        by_cap = [r for r in slow if beta is None or _cap_bound(r, world, beta, recorded_rank_cores(summary))]
        if by_cap:
            fixes.append(_fixed_cap(summary, beta, s, max(r.measured_s / r.model_s for r in by_cap)))
        if len(by_cap) < len(slow):
            rest = [r for r in slow if r not in by_cap]
            fixes.append(_not_the_cap(rest, s) if saturated is None else f"{_named(rest)}: {saturated}")
    elif dil.get("cap_cpu") or dil.get("setting") == "auto":
        # auto already hid the host's cost per byte; what is left is CPU work inside the collective
        # (reductions, gloo's copies), which runs at this machine's core speed at any dilation
        # (docs/fidelity.md: all_gather 64 MiB at 1.66x with s=12, 1.83x with s=30)
        fixes.append(f"collectives ran up to {worst:.2f}x the model with the CPUs not oversubscribed: what is "
                     "left is their own CPU work (reductions, gloo's copies of its output), which the emulation "
                     "runs at this machine's core speed whatever the dilation, so a higher --time-dilation does "
                     "not remove it; docs/fidelity.md says which collectives and sizes it touches"
                     if saturated is None else f"collectives ran up to {worst:.2f}x the model: {saturated}")
    else:
        fixes.append(f"the CPUs were not oversubscribed, yet collectives ran up to {worst:.2f}x the model: "
                     "--time-dilation auto chooses a dilation that hides this machine's cost per byte; "
                     "docs/fidelity.md says what the model does not capture"
                     if saturated is None else f"collectives ran up to {worst:.2f}x the model: {saturated}")
    return fixes


def _host_margin(run: Path) -> float | None:
    """auto's margin for the bytes' host work on the run's topology (dilation.HOST_MARGIN for declared
    hosts); None where there is none (hosts "like this machine": the model charges their cost) or
    the snapshot does not say (it comes from disk)."""
    from testbed.topology.dilation import HOST_MARGIN
    from testbed.topology.reference import host_beta

    topo = rundir.read_json(run / "topology.json")
    try:
        declared = host_beta(topo.get("host_rate")) if isinstance(topo, dict) else None
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return HOST_MARGIN if declared is not None else None


def _beta(summary: dict[str, Any], machine: Any) -> float | None:
    """This machine's cost per byte the verdict judged with (the summary's record comes from disk)."""
    recorded = summary.get("machine") if isinstance(summary.get("machine"), dict) else {}
    beta = getattr(machine, "beta_s_per_byte", None) if machine is not None else recorded.get("beta_s_per_byte")
    ok = isinstance(beta, (int, float)) and not isinstance(beta, bool) and math.isfinite(beta) and beta > 0
    return float(beta) if ok else None


def _cap_bound(r: Any, world: int, beta: float, cores: float) -> bool:
    """Whether the cap's cores could have slowed this class: moving a rank's bytes on them takes more
    than 1/HOST_MARGIN of the links' time, the margin auto keeps for declared hosts."""
    from testbed.topology.dilation import HOST_MARGIN
    from testbed.topology.reference import cost_terms

    host_s = cost_terms(r.op, r.nbytes, max(2, world), r.backend)[1] * beta / cores
    return host_s * HOST_MARGIN > r.links_s


def _named(rows: list[Any]) -> str:
    return ", ".join(f"{r.op} {format_size(r.nbytes)} ({r.measured_s / r.model_s:.2f}x)" for r in rows)


def _not_the_cap(rows: list[Any], s: float) -> str:
    return (f"{_named(rows)} ran slow at a fixed --time-dilation {s:g}, though the cores the CPU cap left each rank move "
            "its bytes well within the links' time: not the cap, and not this machine's cost per byte. "
            "docs/fidelity.md says what the emulation and the model do not capture")


def _fixed_cap(summary: dict[str, Any], beta: float | None, s: float, worst: float) -> str:
    """The fix for slow classes at a fixed dilation that capped the workers' CPUs: the cap scales with
    s, so each rank's cores for its bytes (and its rate) stay what they are whatever s is (measured on
    the seed's DDP case at s = 9: 1.8-4.1x, docs/fidelity.md)."""
    cores = recorded_rank_cores(summary)
    rate = f", about {cores * 8 / beta / 1e9:.2f} Gbit/s per rank" if beta is not None else ""
    return (f"collectives ran up to {worst:.2f}x the model at a fixed --time-dilation {s:g}: each worker's CPU was "
            f"capped at 1/{s:g} of its cores so that compute slows by {s:g} too, which left each rank {cores:.3g} "
            f"of this machine's cores in emulated time to move its bytes{rate}, whatever s is. "
            "--time-dilation auto (the default) chooses s and the cap so that the bytes have the cores the "
            "declared hosts need")


def _ran_beside_the_job(rows: list[Any], margin: float) -> str:
    """The fix for slow classes that had collectives in flight beside them, which only what a job
    launches asynchronously does (DDP's buckets during backward): if the job computed meanwhile, that
    compute shared the worker's CPU cap with gloo's threads. Measured on the seed's DDP case in
    docs/fidelity.md ("Buckets in flight together")."""
    return (f"{_named(rows)} ran while the job went on beside it (launched asynchronously, as DDP's buckets are during "
            f"backward): where the job computes meanwhile, its compute and gloo's threads share the worker's CPU "
            f"cap, which GPU servers do not, and auto left the bytes' host work only a {margin:g}x margin on that "
            "whole cap; a fixed --time-dilation slows compute by s as well and does not help. docs/fidelity.md "
            "(\"Buckets in flight together\") has the measurements")
