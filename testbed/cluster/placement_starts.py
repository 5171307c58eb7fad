"""Starting partitions of a placement problem, unit -> host index each (None: the start cannot fit).

Some may overfill a host (the search makes them fit): the topology's order filled host after host,
Kernighan-Lin bisection from several orders, Louvain communities packed onto hosts, and first-fit
decreasing, the last resort. Each is deterministic: seeds are fixed.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

from testbed.cluster.placement_problem import ZERO, Problem, Vec, fits, vec_add

__all__ = ["starting_partitions", "first_fit_decreasing"]


def _place_switchless(p: Problem, assign: list[int | None]) -> list[int]:
    """Unpinned units without demand (switches) go where most of their bandwidth is: placed in order,
    then looked at twice more, now that their neighbours are placed."""
    free = [u for u, unit in enumerate(p.units) if unit.pin is None and not any(unit.demand)]
    for _ in range(3):
        for u in free:
            conn = p.links_to(assign, u)
            assign[u] = max(p.hosts, key=lambda h: (conn[h], -h))
    return [0 if h is None else h for h in assign]


def _sequential(p: Problem) -> list[int] | None:
    """Units with demand in the topology's order, filling hosts in file order; then the rest."""
    assign: list[int | None] = [u.pin for u in p.units]
    used = [ZERO for _ in p.caps]
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            used[unit.pin] = vec_add(used[unit.pin], unit.demand)
    current = 0
    for u, unit in enumerate(p.units):
        if assign[u] is not None or not any(unit.demand):
            continue
        order = [(current + i) % len(p.caps) for i in range(len(p.caps))]
        host = next((h for h in order if fits(used[h], unit.demand, p.caps[h])), None)
        if host is None:
            return None
        assign[u], current = host, host
        used[host] = vec_add(used[host], unit.demand)
    return _place_switchless(p, assign)


def _kernighan_lin(p: Problem, order: Sequence[int]) -> list[int]:
    """Recursive bisection with networkx's Kernighan-Lin: hosts split in halves (file order), units
    split in proportion to the halves' cores, starting from `order`. May overfill a host."""
    import networkx as nx

    g = p.graph()
    rank = {u: i for i, u in enumerate(order)}
    assign = [0] * len(p.units)

    def split(units: list[int], hosts: list[int]) -> None:
        if len(hosts) == 1:
            for u in units:
                assign[u] = hosts[0]
            return
        left, right = hosts[:len(hosts) // 2], hosts[len(hosts) // 2:]
        cl, cr = sum(p.caps[h][0] for h in left), sum(p.caps[h][0] for h in right)
        units = sorted(units, key=rank.__getitem__)
        k = round(len(units) * cl / (cl + cr))
        if 0 < k < len(units):
            a, b = nx.community.kernighan_lin_bisection(g.subgraph(units), partition=(set(units[:k]), set(units[k:])),
                                                        weight="weight")
            a, b = sorted(a, key=rank.__getitem__), sorted(b, key=rank.__getitem__)
        else:
            a, b = units[:k], units[k:]
        split(a, left)
        split(b, right)

    split(list(range(len(p.units))), list(p.hosts))
    return assign


def _breadth_first(p: Problem) -> list[int]:
    """Units in breadth-first order from a far end of the graph (two sweeps), component by component."""
    seen: set[int] = set()
    out: list[int] = []
    for start in range(len(p.units)):
        if start in seen:
            continue
        far = _bfs(p, start)[-1]
        comp = _bfs(p, far)
        seen.update(comp)
        out.extend(comp)
    return out


def _bfs(p: Problem, start: int) -> list[int]:
    order, seen = [start], {start}
    i = 0
    while i < len(order):
        for v in sorted(p.adj[order[i]]):
            if v not in seen:
                seen.add(v)
                order.append(v)
        i += 1
    return order


def _shuffled(p: Problem, seed: int) -> list[int]:
    order = list(range(len(p.units)))
    random.Random(seed).shuffle(order)
    return order


def _louvain(p: Problem, seed: int) -> list[int] | None:
    """networkx's Louvain communities (a dendrogram), packed onto hosts largest first, each to the
    host it has most bandwidth to among those it fits; one that fits nowhere is split into the
    communities of the level below (a unit that fits nowhere fails the start)."""
    import networkx as nx

    levels = [[frozenset(c) for c in level]
              for level in nx.community.louvain_partitions(p.graph(), weight="weight", seed=seed)]
    children: dict[frozenset, list[frozenset] | None] = {}
    below = [frozenset([u]) for u in range(len(p.units))]
    for c in below:
        children[c] = None
    for level in levels:
        for c in level:
            if c not in children:
                children[c] = [q for q in below if q <= c]
        below = level

    assign: list[int | None] = [u.pin for u in p.units]
    used = [ZERO for _ in p.caps]
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            used[unit.pin] = vec_add(used[unit.pin], unit.demand)
    total = [sum(c[i] for c in p.caps) or 1 for i in range(3)]

    def need(c: frozenset) -> Vec:
        d = ZERO
        for u in c:
            if assign[u] is None:
                d = vec_add(d, p.units[u].demand)
        return d

    def key(c: frozenset) -> tuple:
        d = need(c)
        return (-max(d[i] / total[i] if total[i] != math.inf else 0 for i in range(3)), min(c))

    queue = sorted(below, key=key)
    while queue:
        c = queue.pop(0)
        free = sorted(u for u in c if assign[u] is None)
        if not free:
            continue
        d = need(c)
        best = None
        for h in p.hosts:
            if fits(used[h], d, p.caps[h]):
                affinity = sum(w for u in free for v, w in p.adj[u].items() if assign[v] == h)
                score = (affinity, p.caps[h][0] - used[h][0], -h)
                if best is None or score > best[0]:
                    best = (score, h)
        if best is not None:
            for u in free:
                assign[u] = best[1]
            used[best[1]] = vec_add(used[best[1]], d)
        elif children[c] is None:
            return None
        else:
            queue = sorted(children[c], key=key) + queue
    return [0 if h is None else h for h in assign]


def first_fit_decreasing(p: Problem) -> list[int] | None:
    """The last resort: units by decreasing dominant demand, each to the host with most bandwidth to it
    among those it fits."""
    assign: list[int | None] = [u.pin for u in p.units]
    used = [ZERO for _ in p.caps]
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            used[unit.pin] = vec_add(used[unit.pin], unit.demand)
    total = [sum(c[i] for c in p.caps) or 1 for i in range(3)]
    order = sorted((u for u, unit in enumerate(p.units) if unit.pin is None and any(unit.demand)),
                   key=lambda u: (-max(p.units[u].demand[i] / total[i] if total[i] != math.inf else 0
                                       for i in range(3)), u))
    for u in order:
        conn = p.links_to(assign, u)
        fit = [h for h in p.hosts if fits(used[h], p.units[u].demand, p.caps[h])]
        if not fit:
            return None
        h = max(fit, key=lambda h: (conn[h], p.caps[h][0] - used[h][0], -h))
        assign[u] = h
        used[h] = vec_add(used[h], p.units[u].demand)
    return _place_switchless(p, assign)


# in this order: on equal cuts the search keeps the earlier start (the result is deterministic)
def starting_partitions(p: Problem) -> list[tuple[str, Callable[[], list[int] | None]]]:
    return [
        ("topology order", lambda: _sequential(p)),
        ("kernighan-lin, topology order", lambda: _kernighan_lin(p, range(len(p.units)))),
        ("kernighan-lin, breadth-first", lambda: _kernighan_lin(p, _breadth_first(p))),
        *((f"kernighan-lin, shuffle {s}", (lambda s=s: _kernighan_lin(p, _shuffled(p, s)))) for s in (1, 2)),
        *((f"louvain, seed {s}", (lambda s=s: _louvain(p, s))) for s in (0, 1, 2)),
    ]
