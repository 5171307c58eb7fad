"""The partitioning search behind `place(..., method="partition")`: the best placement it finds.

How (docs/multi-host.md has the measurements behind this choice):

1. Racks: a switch and the workers attached to it only are one unit ("keep racks together"),
   unless the rack fits on no host or its pins disagree.
2. Several starting partitions of the units: the topology's own order filled host after host
   (generators number nodes pod by pod); networkx's Kernighan-Lin bisection applied
   recursively over the hosts (split in halves by capacity), started from the topology order,
   a breadth-first order and two seeded shuffles; networkx's Louvain communities (three seeds),
   packed onto hosts community by community, largest first, splitting a community that fits
   nowhere into its sub-communities.
3. Each start is made to fit (units moved off over-full hosts, losing the least bandwidth), then
   improved by single moves and pairwise swaps of units while the cut shrinks and capacity holds,
   then node by node (moves only). The start with the smallest cut wins (ties: the earlier start,
   so the result is deterministic: same input, same output).
4. If no start fits the racks whole, the racks that first-fit decreasing cannot place are split
   and the starts run again; then node by node, with first-fit decreasing as a last start before
   the error.
5. Switches tied between hosts are spread to even the hosts' switch counts (the cut unchanged).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from testbed.cluster.placement_problem import ZERO, Problem, Vec, fits, vec_add, vec_sub
from testbed.cluster.placement_starts import first_fit_decreasing, starting_partitions
from testbed.topology.model import Topology

__all__ = ["search"]


# -- making a start fit, improving it --------------------------------------------------------------------


def _repair(p: Problem, assign: list[int]) -> list[int] | None:
    """Move units off over-full hosts (each time the move that loses least) until all fit; None if stuck."""
    assign = list(assign)
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            assign[u] = unit.pin
    used = p.used(assign)
    for _ in range(4 * len(p.units) + 4):
        over = {h for h in p.hosts if not fits(ZERO, used[h], p.caps[h])}
        if not over:
            return assign
        best = None
        for u, unit in enumerate(p.units):
            if assign[u] not in over or unit.pin is not None or not any(unit.demand):
                continue
            conn = p.links_to(assign, u)
            for h in p.hosts:
                if h != assign[u] and fits(used[h], unit.demand, p.caps[h]):
                    gain = conn[h] - conn[assign[u]]
                    if best is None or gain > best[0]:
                        best = (gain, u, h)
        if best is None:
            return None
        _, u, h = best
        used[assign[u]] = vec_sub(used[assign[u]], p.units[u].demand)
        used[h] = vec_add(used[h], p.units[u].demand)
        assign[u] = h
    return None


def _improve(p: Problem, assign: list[int], swaps: bool) -> list[int]:
    """Best single move (then, if none, best pairwise swap of units with demand) while the cut strictly
    shrinks and every host still fits. Deterministic: ties go to the lowest unit and host."""
    assign = list(assign)
    used = p.used(assign)
    movable = [u for u, unit in enumerate(p.units) if unit.pin is None]
    heavy = [u for u in movable if any(p.units[u].demand)]
    while True:
        conn = {u: p.links_to(assign, u) for u in movable}
        best = None
        for u in movable:
            here = assign[u]
            for h in p.hosts:
                gain = conn[u][h] - conn[u][here]
                if h != here and gain > 0 and (best is None or gain > best[0]) \
                        and fits(used[h], p.units[u].demand, p.caps[h]):
                    best = (gain, u, h)
        if best is not None:
            _, u, h = best
            used[assign[u]] = vec_sub(used[assign[u]], p.units[u].demand)
            used[h] = vec_add(used[h], p.units[u].demand)
            assign[u] = h
            continue
        if not swaps:
            return assign
        # a swap gains at most what each unit alone would gain by going to its best other host: pairs that
        # cannot gain are skipped (the result is the same, found faster)
        alone = {u: max((conn[u][h] for h in p.hosts if h != assign[u]), default=0) - conn[u][assign[u]]
                 for u in heavy}
        most = max(alone.values(), default=0)
        hopeful = [u for u in heavy if alone[u] + most > 0]
        for i, u in enumerate(hopeful):
            hu = assign[u]
            for v in hopeful[i + 1:]:
                hv = assign[v]
                if hu == hv or alone[u] + alone[v] <= 0:
                    continue
                gain = conn[u][hv] - conn[u][hu] + conn[v][hu] - conn[v][hv] - 2 * p.adj[u].get(v, 0)
                if gain > 0 and (best is None or gain > best[0]):
                    du, dv = p.units[u].demand, p.units[v].demand
                    if fits(vec_sub(used[hu], du), dv, p.caps[hu]) and fits(vec_sub(used[hv], dv), du, p.caps[hv]):
                        best = (gain, u, v)
        if best is None:
            return assign
        _, u, v = best
        hu, hv = assign[u], assign[v]
        du, dv = p.units[u].demand, p.units[v].demand
        used[hu] = vec_add(vec_sub(used[hu], du), dv)
        used[hv] = vec_add(vec_sub(used[hv], dv), du)
        assign[u], assign[v] = hv, hu


def _spread_switches(p: Problem, assign: list[int]) -> list[int]:
    """Node level: a switch tied between hosts (equal bandwidth to each) moves to the tied host with
    fewer switches while that evens the counts; the cut does not change."""
    assign = list(assign)
    switches = [u for u, unit in enumerate(p.units)
                if unit.pin is None and p.topo.nodes[unit.nodes[0]].is_switch]
    count = [0] * len(p.caps)
    for u in switches:
        count[assign[u]] += 1
    moved = True
    while moved:
        moved = False
        for u in switches:
            conn = p.links_to(assign, u)
            here = assign[u]
            tied = [h for h in p.hosts if conn[h] == conn[here] and h != here]
            target = min(tied, key=lambda h: (count[h], h), default=None)
            if target is not None and count[target] + 1 < count[here]:
                count[here] -= 1
                count[target] += 1
                assign[u] = target
                moved = True
    return assign


# -- the search ------------------------------------------------------------------------------------------


def _unpackable_racks(p: Problem) -> frozenset[str]:
    """The racks (by switch) that first-fit decreasing cannot place whole: the ones to split."""
    used = [ZERO for _ in p.caps]
    for unit in p.units:
        if unit.pin is not None:
            used[unit.pin] = vec_add(used[unit.pin], unit.demand)
    out = set()
    for u in sorted((u for u, unit in enumerate(p.units) if unit.pin is None and any(unit.demand)),
                    key=lambda u: (-p.units[u].demand[0], -p.units[u].demand[1], u)):
        unit = p.units[u]
        fit = [h for h in p.hosts if fits(used[h], unit.demand, p.caps[h])]
        if fit:
            h = min(fit, key=lambda h: (p.caps[h][0] - used[h][0], h))   # best fit: keep big holes
            used[h] = vec_add(used[h], unit.demand)
        elif len(unit.nodes) > 1:
            out.add(unit.nodes[0])
    return frozenset(out)


def search(topo: Topology, caps: list[Vec], demand: Mapping[str, Vec], pins: Mapping[str, int],
            weights: Sequence[int]) -> tuple[dict[str, int], str] | None:
    """The best placement found (node -> host index) and the start it came from; None if none fits.

    Racks whole first; if no start fits them, the racks first-fit decreasing cannot place are split;
    then node by node, with first-fit decreasing as a last start."""
    nodes = Problem(topo, caps, demand, pins, weights, racks=False)
    whole = Problem(topo, caps, demand, pins, weights, racks=True)
    tries: list[tuple[Callable[[], Problem], str]] = [
        (lambda: whole, ""),
        (lambda: Problem(topo, caps, demand, pins, weights, racks=True, split=_unpackable_racks(whole)),
         ", {split} racks split"),
        (lambda: nodes, ", node by node"),
    ]
    best: tuple[int, dict[str, int], str] | None = None
    for make, suffix in tries:
        p = make()
        if p is not whole and p is not nodes and len(p.units) in (len(whole.units), len(nodes.units)):
            continue  # splitting changed nothing, or everything: the other tries cover it
        starts = starting_partitions(p) + ([("first-fit decreasing", lambda p=p: first_fit_decreasing(p))]
                                           if p is nodes else [])
        for name, start in starts:
            initial = start()
            fitted = _repair(p, initial) if initial is not None else None
            if fitted is None:
                continue
            improved = _improve(p, fitted, swaps=True)
            by_node = nodes.to_nodes(_improve(nodes, nodes.from_nodes(p.to_nodes(improved)), swaps=False))
            cut = nodes.cut(nodes.from_nodes(by_node))
            if best is None or cut < best[0]:
                split = sum(1 for unit in whole.units if len(unit.nodes) > 1) \
                    - sum(1 for unit in p.units if len(unit.nodes) > 1)
                best = (cut, by_node, name + suffix.format(split=split))
        if best is not None:
            break
    if best is None:
        return None
    # spreading switches keeps the cut but can leave a neighbouring switch better off elsewhere: repeat
    assign = nodes.from_nodes(best[1])
    while True:
        spread = _spread_switches(nodes, assign)
        if spread == assign:
            return nodes.to_nodes(assign), best[2]
        assign = _improve(nodes, spread, swaps=False)
