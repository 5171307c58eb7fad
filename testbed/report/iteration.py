"""The iteration a job would have had on the emulated cluster: its steps as measured, with each
collective taking the reference model's time instead of its own.

A step is what passed between two of a rank's optimizer steps. A blocking collective holds the
rank for its whole time, so the model's step is shorter by what it took beyond the model. The
collectives a step launched asynchronously (DDP's buckets, while backward goes on) are waited for
together before the optimizer steps: the step goes on at the last one's end, and in the model at
the model's last end, which comes after the last launch (backward's end). So the model's step is
the measured one less those differences: the compute stays as measured (what dilation promises),
the communication becomes the model's, and a bucket that ends while backward still computes costs
the step nothing.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Any, Sequence

MIN_STEPS = 3   # steps (two iterations) before an expected iteration says anything


def expected_steps(step_ends: Sequence[float], spans: Sequence[tuple[float, float, float, bool]]) -> list[float]:
    """Each iteration (real seconds) with the model's communication: step_ends are one rank's optimizer
    steps (real time); spans the run's collectives, (start, end, the model's end, launched
    asynchronously), real time."""
    ends = sorted(t for t in step_ends if math.isfinite(t))
    ordered = sorted(sp for sp in spans if all(map(math.isfinite, sp[:3])))
    starts = [sp[0] for sp in ordered]
    out = []
    for a, b in zip(ends, ends[1:]):   # (a, b]: the spans that started in this step
        inside = ordered[bisect.bisect_right(starts, a):bisect.bisect_right(starts, b)]
        late = sum(e - m for _, e, m, launched in inside if not launched)
        waited = [(e, m) for _, e, m, launched in inside if launched]
        if waited:
            late += max(e for e, _ in waited) - max(m for _, m in waited)
        out.append(b - a - late)
    return out


def expected_iteration(step_ends: Sequence[float], spans: Sequence[tuple[float, float, float, bool]],
                       s: float) -> float | None:
    """The median iteration with the model's communication, emulated seconds; None with fewer than
    MIN_STEPS steps or no collective inside them."""
    ends = sorted(step_ends)
    if len(ends) < MIN_STEPS or not any(ends[0] < sp[0] <= ends[-1] for sp in spans):
        return None
    its = [t for t in expected_steps(ends, spans) if t > 0]
    return statistics.median(its) / s if its else None


def step_ends(probe: dict[str, list[dict[str, Any]]]) -> list[float]:
    """The lowest recording rank's optimizer steps (real time); records come from a rank: what is not
    a finite number is left out."""
    ranks = sorted((k for k in probe if k.isdigit()), key=int)
    if not ranks:
        return []
    out = []
    for r in probe[ranks[0]]:
        t = r.get("t") if r.get("ev") == "step" else None
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
            out.append(float(t))
    return sorted(out)
