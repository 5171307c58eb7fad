"""The iteration a job would have had on the emulated cluster: its steps as measured, with each
collective its rank took part in taking the reference model's time instead of its own.

A step is what passed between two of the rank's optimizer steps. A collective the rank waited for
holds it for its whole time, so the model's step is shorter by what it took beyond the model;
collectives of the rank that overlapped (other groups, pairs) are one wait, which ends at the last
one's end, and in the model at the model's last end. DDP's buckets, launched while backward goes
on, are waited for together before the optimizer steps: the step goes on at the last bucket's end,
and in the model at the model's last end, which comes after the last launch (backward's end), so a
bucket that ends while backward still computes costs the step nothing. The compute stays as
measured (what dilation promises): this shows what the communication's misses cost the steps; it
checks nothing the classes did not.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Any, NamedTuple, Sequence

from testbed.report.analyze import finite

MIN_STEPS = 3   # steps (two iterations) before an expected iteration says anything


class Span(NamedTuple):
    start: float       # real seconds: the last rank's arrival
    end: float         # the last rank's completion
    model_end: float   # start + the model's time (real)
    ddp: bool          # one of DDP's buckets (waited for together with the step's others)
    ranks: tuple[int, ...]   # who took part; () for the whole world


def _waits(spans: Sequence[Span]) -> float:
    """How much later than the model the rank went on after these spans: overlapping ones are one
    wait (the last end against the model's last end), the others each their own."""
    late, group, group_end = 0.0, [], -math.inf
    for sp in sorted(spans):
        if group and sp.start >= group_end:
            late += group_end - max(x.model_end for x in group)
            group = []
        group.append(sp)
        group_end = max(x.end for x in group)
    if group:
        late += group_end - max(x.model_end for x in group)
    return late


def expected_steps(step_ends: Sequence[float], spans: Sequence[Span], rank: int = 0) -> list[float]:
    """Each of `rank`'s iterations (real seconds) with the model's communication: step_ends are its
    optimizer steps (real time), spans the run's modelled collectives; those without the rank and
    those that are not finite numbers are left out."""
    ends = sorted(t for t in step_ends if math.isfinite(t))
    mine = sorted(sp for sp in spans if (not sp.ranks or rank in sp.ranks)
                  and all(math.isfinite(x) for x in (sp.start, sp.end, sp.model_end)))
    starts = [sp.start for sp in mine]
    out = []
    for a, b in zip(ends, ends[1:]):   # (a, b]: the spans that started in this step
        inside = mine[bisect.bisect_right(starts, a):bisect.bisect_right(starts, b)]
        late = _waits([sp for sp in inside if not sp.ddp])
        buckets = [sp for sp in inside if sp.ddp]
        if buckets:
            late += max(sp.end for sp in buckets) - max(sp.model_end for sp in buckets)
        out.append(b - a - late)
    return out


def expected_iteration(step_ends: Sequence[float], spans: Sequence[Span], s: float,
                       rank: int = 0) -> tuple[float, float] | None:
    """(the measured iteration, the expected one), medians in emulated seconds, from `rank`'s steps;
    None with fewer than MIN_STEPS steps, no collective of the rank inside them, or a step the
    model would make no longer than nothing (the records do not hold together)."""
    ends = sorted(step_ends)
    if len(ends) < MIN_STEPS or not any(ends[0] < sp.start <= ends[-1] and (not sp.ranks or rank in sp.ranks)
                                        for sp in spans):
        return None
    its = expected_steps(ends, spans, rank)
    if min(its) <= 0:
        return None
    measured = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(measured) / s, statistics.median(its) / s


def step_ends(probe: dict[str, list[dict[str, Any]]]) -> tuple[int, list[float]] | None:
    """(the lowest recording rank, its optimizer steps in real time); records come from a rank: what
    is not a finite number is left out."""
    ranks = sorted((k for k in probe if k.isdigit()), key=int)
    if not ranks:
        return None
    out = []
    for r in probe[ranks[0]]:
        t = r.get("t") if r.get("ev") == "step" else None
        if finite(t):
            out.append(float(t))
    return int(ranks[0]), sorted(out)
