"""Max-min fair sharing of resources among flows (progressive filling). Pure: the reference model
shares each directed link among the flows that cross it this way."""

from __future__ import annotations

import math
from typing import Any, Sequence


def max_min_rates(paths: Sequence[Sequence[Any]], capacity: dict[Any, float]) -> list[float]:
    """Max-min fair rates of flows over shared resources (progressive filling).

    paths[i]: the resources flow i crosses; capacity: resource -> units/s (inf: no limit).
    A flow that crosses no limited resource gets inf.
    """
    rates = [math.inf] * len(paths)
    users: dict[Any, list[int]] = {}
    for i, p in enumerate(paths):
        for res in set(p):
            if capacity.get(res, math.inf) != math.inf:
                users.setdefault(res, []).append(i)
    left = {res: capacity[res] for res in users}
    active = {res: len(fl) for res, fl in users.items()}
    frozen = [False] * len(paths)
    while active:
        res = min(active, key=lambda r: left[r] / active[r])
        share = left[res] / active[res]
        for i in users[res]:
            if frozen[i]:
                continue
            frozen[i] = True
            rates[i] = share
            for other in set(paths[i]):
                if other in active:
                    left[other] -= share
                    active[other] -= 1
                    if active[other] == 0:
                        del active[other]
        active.pop(res, None)
    return rates
