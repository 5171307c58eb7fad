"""Placement: which host of a hosts file each node of a topology runs on. Pure: no I/O.

`place(topo, hosts, pins)` assigns every node (workers and switches) to a host so that

- the workers fit: on each host the workers' cores (a worker's `cpus`, or 1), GPUs (its `gpus`)
  and memory (its `memory`, if it declares one; a host that declares none is not limited) stay
  within the host's `capacity`; switches take no capacity (their forwarding is not modelled);
- pins (node -> host, given by the user) are kept;
- the bandwidth of the cut links (links whose ends are on different hosts; both directions'
  bandwidth added) is as small as the search finds, and among cuts of equal bandwidth the one
  that cuts links farther from the workers (core before aggregation before access links), so
  racks and pods stay whole;
- every switch sits on a host that holds at least as much of its link bandwidth as any other
  (ties go to the host with fewer switches).

If the hosts cannot hold the workers, TopologyError says which resource is short and by how much.

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

`place(..., method="round-robin")` is the naive baseline (workers dealt to hosts in turn, as
far as capacity allows; switches dealt in turn), kept for comparison.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from testbed.cluster.hosts import Hosts
from testbed.errors import TopologyError
from testbed.topology.model import Topology

__all__ = ["CutLink", "HostLoad", "Placement", "place", "parse_pins", "METHODS"]

METHODS = ("partition", "round-robin")
RESOURCES = ("cores", "gpus", "memory")
_EPS = 1e-9

Vec = tuple[float, int, float]   # cores, GPUs, memory bytes (inf: not limited)
_ZERO: Vec = (0.0, 0, 0)


# -- results ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CutLink:
    """A link whose ends are on different hosts: a tunnel once multi-host `up` exists."""

    index: int                     # in topo.links
    a: str
    b: str
    tier: str
    host_a: str
    host_b: str
    ab_bps: int | None             # None: unshaped
    ba_bps: int | None

    @property
    def bandwidth_bps(self) -> int | None:
        """Both directions added; None when either is unshaped."""
        if self.ab_bps is None or self.ba_bps is None:
            return None
        return self.ab_bps + self.ba_bps

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "endpoints": [self.a, self.b], "tier": self.tier,
                "hosts": [self.host_a, self.host_b], "ab_bps": self.ab_bps, "ba_bps": self.ba_bps,
                "bandwidth_bps": self.bandwidth_bps}


@dataclass(frozen=True)
class HostLoad:
    """What one host carries, against what it has."""

    host: str
    workers: tuple[str, ...]
    switches: tuple[str, ...]
    cores_used: float
    cores: int
    gpus_used: int
    gpus: int
    memory_used: int               # bytes of the workers that declare memory
    memory: int | None             # None: the host declares none (not limited)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "workers": list(self.workers), "switches": list(self.switches),
                "cores_used": self.cores_used, "cores": self.cores, "gpus_used": self.gpus_used,
                "gpus": self.gpus, "memory_used": self.memory_used, "memory": self.memory}


@dataclass(frozen=True)
class Placement:
    assignment: dict[str, str]     # node -> host, in the topology's node order
    cut_links: tuple[CutLink, ...]
    loads: tuple[HostLoad, ...]    # in the hosts file's order
    method: str                    # "partition" | "round-robin"
    start: str | None = None       # the starting partition that won (partition only)
    pins: dict[str, str] = field(default_factory=dict)

    def host_of(self, node: str) -> str:
        return self.assignment[node]

    def nodes_on(self, host: str) -> list[str]:
        return [n for n, h in self.assignment.items() if h == host]

    @property
    def cut_bps(self) -> int:
        """Total bandwidth of the cut links (both directions), unshaped directions not counted."""
        return sum(bw for link in self.cut_links for bw in (link.ab_bps, link.ba_bps) if bw is not None)

    @property
    def unshaped_cut(self) -> int:
        """How many cut links have an unshaped direction (not in cut_bps)."""
        return sum(1 for link in self.cut_links if link.bandwidth_bps is None)

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "start": self.start, "pins": dict(self.pins),
                "nodes": dict(self.assignment), "hosts": [load.to_json() for load in self.loads],
                "cut_links": [link.to_json() for link in self.cut_links], "cut_bps": self.cut_bps,
                "unshaped_cut_links": self.unshaped_cut}


# -- pins ------------------------------------------------------------------------------------------------


def parse_pins(texts: Iterable[str]) -> dict[str, str]:
    """["NODE=HOST", ...] (the CLI's --pin) -> {node: host}; a malformed or repeated pin is refused."""
    pins: dict[str, str] = {}
    for text in texts:
        node, sep, host = text.partition("=")
        node, host = node.strip(), host.strip()
        if not sep or not node or not host:
            raise TopologyError("expected NODE=HOST, e.g. --pin w0=gpu-a", path="--pin", value=text)
        if node in pins and pins[node] != host:
            raise TopologyError(f"{node} is pinned twice ({pins[node]} and {host})", path="--pin", value=text)
        pins[node] = host
    return pins


# -- the problem -----------------------------------------------------------------------------------------


def _fits(used: Vec, demand: Vec, cap: Vec) -> bool:
    return (used[0] + demand[0] <= cap[0] + _EPS and used[1] + demand[1] <= cap[1]
            and used[2] + demand[2] <= cap[2])


def _add(a: Vec, b: Vec) -> Vec:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _sub(a: Vec, b: Vec) -> Vec:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


def _demand(topo: Topology, node: str) -> Vec:
    """What a node takes of a host: a worker its cpus (or 1 core), GPUs and declared memory; a switch nothing."""
    n = topo.nodes[node]
    if not n.is_worker:
        return _ZERO
    return (float(n.cpus if n.cpus is not None else 1), n.gpus, n.memory_bytes or 0)


def _link_weights(topo: Topology) -> list[int]:
    """Per link: bandwidth of both directions, then (lexicographically, never outweighing one bit/s
    of bandwidth) a preference for cutting links farther from the workers. An unshaped direction
    weighs as the fastest shaped one (1 bit/s if none is shaped)."""
    from testbed.topology.analysis import switch_layers

    shaped = [p.bandwidth_bps for link in topo.links for p in (link.ab, link.ba) if p.bandwidth_bps]
    unshaped = max(shaped) if shaped else 1
    layer = switch_layers(topo)
    top = max(layer.values(), default=0) + 1
    depth = [top + 1 - max(layer.get(link.a, top), layer.get(link.b, top)) for link in topo.links]
    scale = sum(depth) + 1
    return [((link.ab.bandwidth_bps or unshaped) + (link.ba.bandwidth_bps or unshaped)) * scale + d
            for link, d in zip(topo.links, depth)]


@dataclass
class _Unit:
    nodes: tuple[str, ...]
    demand: Vec
    pin: int | None


class _Problem:
    """Units (racks or single nodes), their demands, pins and the weighted graph between them."""

    def __init__(self, topo: Topology, caps: Sequence[Vec], demand: Mapping[str, Vec], pins: Mapping[str, int],
                 weights: Sequence[int], racks: bool, split: frozenset[str] = frozenset()):
        self.topo = topo
        self.caps = list(caps)
        self.units: list[_Unit] = []
        owner: dict[str, int] = {}
        if racks:
            ends: dict[str, list[str]] = {n: [] for n in topo.nodes}
            for link in topo.links:
                ends[link.a].append(link.b)
                ends[link.b].append(link.a)
            members: dict[str, list[str]] = {}
            for w in topo.workers:
                if len(ends[w]) == 1 and topo.nodes[ends[w][0]].is_switch:
                    members.setdefault(ends[w][0], []).append(w)
            for sw, workers in members.items():
                if sw in split:
                    continue
                nodes = (sw, *workers)
                need = _ZERO
                for n in nodes:
                    need = _add(need, demand[n])
                hosts = {pins[n] for n in nodes if n in pins}
                if len(hosts) > 1:
                    continue
                pin = next(iter(hosts), None)
                where = [pin] if pin is not None else range(len(caps))
                if not any(_fits(_ZERO, need, caps[h]) for h in where):
                    continue
                for n in nodes:
                    owner[n] = len(self.units)
                self.units.append(_Unit(nodes, need, pin))
        for n in topo.nodes:
            if n not in owner:
                owner[n] = len(self.units)
                self.units.append(_Unit((n,), demand[n], pins.get(n)))
        self.owner = owner
        self.adj: list[dict[int, int]] = [{} for _ in self.units]
        for link, w in zip(topo.links, weights):
            a, b = owner[link.a], owner[link.b]
            if a != b:
                self.adj[a][b] = self.adj[a].get(b, 0) + w
                self.adj[b][a] = self.adj[b].get(a, 0) + w

    @property
    def hosts(self) -> range:
        return range(len(self.caps))

    def cut(self, assign: Sequence[int]) -> int:
        return sum(w for u, nbrs in enumerate(self.adj) for v, w in nbrs.items() if u < v and assign[u] != assign[v])

    def used(self, assign: Sequence[int]) -> list[Vec]:
        used = [_ZERO for _ in self.caps]
        for u, h in enumerate(assign):
            used[h] = _add(used[h], self.units[u].demand)
        return used

    def feasible(self, assign: Sequence[int]) -> bool:
        return all(_fits(_ZERO, u, c) for u, c in zip(self.used(assign), self.caps))

    def links_to(self, assign: Sequence[int | None], u: int) -> list[int]:
        """Weight from unit u to each host (units not yet placed count nowhere)."""
        out = [0] * len(self.caps)
        for v, w in self.adj[u].items():
            if assign[v] is not None:
                out[assign[v]] += w
        return out

    def graph(self):
        import networkx as nx

        g = nx.Graph()
        g.add_nodes_from(range(len(self.units)))
        g.add_weighted_edges_from((u, v, w) for u, nbrs in enumerate(self.adj) for v, w in nbrs.items() if u < v)
        return g

    def to_nodes(self, assign: Sequence[int]) -> dict[str, int]:
        return {n: assign[u] for u, unit in enumerate(self.units) for n in unit.nodes}

    def from_nodes(self, by_node: Mapping[str, int]) -> list[int]:
        return [by_node[unit.nodes[0]] for unit in self.units]


# -- starting partitions ---------------------------------------------------------------------------------


def _place_switchless(p: _Problem, assign: list[int | None]) -> list[int]:
    """Unpinned units without demand (switches) go where most of their bandwidth is: placed in order,
    then looked at twice more, now that their neighbours are placed."""
    free = [u for u, unit in enumerate(p.units) if unit.pin is None and not any(unit.demand)]
    for _ in range(3):
        for u in free:
            conn = p.links_to(assign, u)
            assign[u] = max(p.hosts, key=lambda h: (conn[h], -h))
    return [0 if h is None else h for h in assign]


def _sequential(p: _Problem) -> list[int] | None:
    """Units with demand in the topology's order, filling hosts in file order; then the rest."""
    assign: list[int | None] = [u.pin for u in p.units]
    used = [_ZERO for _ in p.caps]
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            used[unit.pin] = _add(used[unit.pin], unit.demand)
    current = 0
    for u, unit in enumerate(p.units):
        if assign[u] is not None or not any(unit.demand):
            continue
        order = [(current + i) % len(p.caps) for i in range(len(p.caps))]
        host = next((h for h in order if _fits(used[h], unit.demand, p.caps[h])), None)
        if host is None:
            return None
        assign[u], current = host, host
        used[host] = _add(used[host], unit.demand)
    return _place_switchless(p, assign)


def _kernighan_lin(p: _Problem, order: Sequence[int]) -> list[int]:
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


def _breadth_first(p: _Problem) -> list[int]:
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


def _bfs(p: _Problem, start: int) -> list[int]:
    order, seen = [start], {start}
    i = 0
    while i < len(order):
        for v in sorted(p.adj[order[i]]):
            if v not in seen:
                seen.add(v)
                order.append(v)
        i += 1
    return order


def _shuffled(p: _Problem, seed: int) -> list[int]:
    order = list(range(len(p.units)))
    random.Random(seed).shuffle(order)
    return order


def _louvain(p: _Problem, seed: int) -> list[int] | None:
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
    used = [_ZERO for _ in p.caps]
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            used[unit.pin] = _add(used[unit.pin], unit.demand)
    total = [sum(c[i] for c in p.caps) or 1 for i in range(3)]

    def need(c: frozenset) -> Vec:
        d = _ZERO
        for u in c:
            if assign[u] is None:
                d = _add(d, p.units[u].demand)
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
            if _fits(used[h], d, p.caps[h]):
                affinity = sum(w for u in free for v, w in p.adj[u].items() if assign[v] == h)
                score = (affinity, p.caps[h][0] - used[h][0], -h)
                if best is None or score > best[0]:
                    best = (score, h)
        if best is not None:
            for u in free:
                assign[u] = best[1]
            used[best[1]] = _add(used[best[1]], d)
        elif children[c] is None:
            return None
        else:
            queue = sorted(children[c], key=key) + queue
    return [0 if h is None else h for h in assign]


def _first_fit_decreasing(p: _Problem) -> list[int] | None:
    """The last resort: units by decreasing dominant demand, each to the host with most bandwidth to it
    among those it fits."""
    assign: list[int | None] = [u.pin for u in p.units]
    used = [_ZERO for _ in p.caps]
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            used[unit.pin] = _add(used[unit.pin], unit.demand)
    total = [sum(c[i] for c in p.caps) or 1 for i in range(3)]
    order = sorted((u for u, unit in enumerate(p.units) if unit.pin is None and any(unit.demand)),
                   key=lambda u: (-max(p.units[u].demand[i] / total[i] if total[i] != math.inf else 0
                                       for i in range(3)), u))
    for u in order:
        conn = p.links_to(assign, u)
        fit = [h for h in p.hosts if _fits(used[h], p.units[u].demand, p.caps[h])]
        if not fit:
            return None
        h = max(fit, key=lambda h: (conn[h], p.caps[h][0] - used[h][0], -h))
        assign[u] = h
        used[h] = _add(used[h], p.units[u].demand)
    return _place_switchless(p, assign)


# -- making a start fit, improving it --------------------------------------------------------------------


def _repair(p: _Problem, assign: list[int]) -> list[int] | None:
    """Move units off over-full hosts (each time the move that loses least) until all fit; None if stuck."""
    assign = list(assign)
    for u, unit in enumerate(p.units):
        if unit.pin is not None:
            assign[u] = unit.pin
    used = p.used(assign)
    for _ in range(4 * len(p.units) + 4):
        over = {h for h in p.hosts if not _fits(_ZERO, used[h], p.caps[h])}
        if not over:
            return assign
        best = None
        for u, unit in enumerate(p.units):
            if assign[u] not in over or unit.pin is not None or not any(unit.demand):
                continue
            conn = p.links_to(assign, u)
            for h in p.hosts:
                if h != assign[u] and _fits(used[h], unit.demand, p.caps[h]):
                    gain = conn[h] - conn[assign[u]]
                    if best is None or gain > best[0]:
                        best = (gain, u, h)
        if best is None:
            return None
        _, u, h = best
        used[assign[u]] = _sub(used[assign[u]], p.units[u].demand)
        used[h] = _add(used[h], p.units[u].demand)
        assign[u] = h
    return None


def _improve(p: _Problem, assign: list[int], swaps: bool) -> list[int]:
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
                        and _fits(used[h], p.units[u].demand, p.caps[h]):
                    best = (gain, u, h)
        if best is not None:
            _, u, h = best
            used[assign[u]] = _sub(used[assign[u]], p.units[u].demand)
            used[h] = _add(used[h], p.units[u].demand)
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
                    if _fits(_sub(used[hu], du), dv, p.caps[hu]) and _fits(_sub(used[hv], dv), du, p.caps[hv]):
                        best = (gain, u, v)
        if best is None:
            return assign
        _, u, v = best
        hu, hv = assign[u], assign[v]
        du, dv = p.units[u].demand, p.units[v].demand
        used[hu] = _add(_sub(used[hu], du), dv)
        used[hv] = _add(_sub(used[hv], dv), du)
        assign[u], assign[v] = hv, hu


def _spread_switches(p: _Problem, assign: list[int]) -> list[int]:
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


# -- place -----------------------------------------------------------------------------------------------


def _capacities(hosts: Hosts) -> list[Vec]:
    return [(float(h.capacity.cores), h.capacity.gpus,
             float(h.capacity.memory) if h.capacity.memory is not None else math.inf) for h in hosts]


def _fmt(resource: str, x: float) -> str:
    if resource == "memory":
        from testbed.topology.units import format_size

        return format_size(x)
    return f"{x:g} {resource}" if resource == "cores" else f"{x:g} GPUs"


def _check_capacity(topo: Topology, hosts: Hosts, caps: list[Vec], demand: Mapping[str, Vec],
                    pins: Mapping[str, int]) -> None:
    """Refuse, naming the shortfall, what no placement can do."""
    src = hosts.source
    for i, res in enumerate(RESOURCES):
        need = sum(demand[w][i] for w in topo.workers)
        have = sum(c[i] for c in caps)
        if need > have + _EPS:
            raise TopologyError(f"the hosts cannot hold the workers: they need {_fmt(res, need)}, the hosts have "
                                f"{_fmt(res, have)} in all ({_fmt(res, need - have)} short)", file=src,
                                path=f"hosts[*].capacity.{res}")
        for w in topo.workers:
            biggest = max(range(len(caps)), key=lambda h: caps[h][i])
            if demand[w][i] > caps[biggest][i] + _EPS:
                raise TopologyError(f"worker {w} needs {_fmt(res, demand[w][i])}, more than any host has (the most: "
                                    f"{_fmt(res, caps[biggest][i])} on {hosts.hosts[biggest].name})", file=src,
                                    path=f"hosts[*].capacity.{res}")
        for h, host in enumerate(hosts):
            pinned = sum(demand[w][i] for w in topo.workers if pins.get(w) == h)
            if pinned > caps[h][i] + _EPS:
                raise TopologyError(f"the workers pinned to {host.name} need {_fmt(res, pinned)}, it has "
                                    f"{_fmt(res, caps[h][i])}", path="--pin",
                                    value=sorted(w for w in topo.workers if pins.get(w) == h))


def _starts(p: _Problem) -> list[tuple[str, Callable[[], list[int] | None]]]:
    return [
        ("topology order", lambda: _sequential(p)),
        ("kernighan-lin, topology order", lambda: _kernighan_lin(p, range(len(p.units)))),
        ("kernighan-lin, breadth-first", lambda: _kernighan_lin(p, _breadth_first(p))),
        *((f"kernighan-lin, shuffle {s}", (lambda s=s: _kernighan_lin(p, _shuffled(p, s)))) for s in (1, 2)),
        *((f"louvain, seed {s}", (lambda s=s: _louvain(p, s))) for s in (0, 1, 2)),
    ]


def _unpackable_racks(p: _Problem) -> frozenset[str]:
    """The racks (by switch) that first-fit decreasing cannot place whole: the ones to split."""
    used = [_ZERO for _ in p.caps]
    for unit in p.units:
        if unit.pin is not None:
            used[unit.pin] = _add(used[unit.pin], unit.demand)
    out = set()
    for u in sorted((u for u, unit in enumerate(p.units) if unit.pin is None and any(unit.demand)),
                    key=lambda u: (-p.units[u].demand[0], -p.units[u].demand[1], u)):
        unit = p.units[u]
        fit = [h for h in p.hosts if _fits(used[h], unit.demand, p.caps[h])]
        if fit:
            h = min(fit, key=lambda h: (p.caps[h][0] - used[h][0], h))   # best fit: keep big holes
            used[h] = _add(used[h], unit.demand)
        elif len(unit.nodes) > 1:
            out.add(unit.nodes[0])
    return frozenset(out)


def _search(topo: Topology, caps: list[Vec], demand: Mapping[str, Vec], pins: Mapping[str, int],
            weights: Sequence[int]) -> tuple[dict[str, int], str] | None:
    """The best placement found (node -> host index) and the start it came from; None if none fits.

    Racks whole first; if no start fits them, the racks first-fit decreasing cannot place are split;
    then node by node, with first-fit decreasing as a last start."""
    nodes = _Problem(topo, caps, demand, pins, weights, racks=False)
    whole = _Problem(topo, caps, demand, pins, weights, racks=True)
    tries: list[tuple[Callable[[], _Problem], str]] = [
        (lambda: whole, ""),
        (lambda: _Problem(topo, caps, demand, pins, weights, racks=True, split=_unpackable_racks(whole)),
         ", {split} racks split"),
        (lambda: nodes, ", node by node"),
    ]
    best: tuple[int, dict[str, int], str] | None = None
    for make, suffix in tries:
        p = make()
        if p is not whole and p is not nodes and len(p.units) in (len(whole.units), len(nodes.units)):
            continue  # splitting changed nothing, or everything: the other tries cover it
        starts = _starts(p) + ([("first-fit decreasing", lambda p=p: _first_fit_decreasing(p))] if p is nodes else [])
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


def _round_robin(topo: Topology, caps: list[Vec], demand: Mapping[str, Vec],
                 pins: Mapping[str, int]) -> dict[str, int] | None:
    used = [_ZERO for _ in caps]
    for n, h in pins.items():
        used[h] = _add(used[h], demand[n])
    out: dict[str, int] = dict(pins)
    next_worker = next_switch = 0
    for name, node in topo.nodes.items():
        if name in pins:
            continue
        if node.is_worker:
            order = [(next_worker + i) % len(caps) for i in range(len(caps))]
            host = next((h for h in order if _fits(used[h], demand[name], caps[h])), None)
            if host is None:
                return None
            used[host] = _add(used[host], demand[name])
            next_worker = host + 1
        else:
            host = next_switch % len(caps)
            next_switch += 1
        out[name] = host
    return out


def place(topo: Topology, hosts: Hosts, pins: Mapping[str, str] | None = None, *,
          method: str = "partition") -> Placement:
    """Assign every node of `topo` to a host of `hosts` (see the module's doc). `pins`: node -> host name.

    TopologyError when a pin names an unknown node or host, or the hosts cannot hold the workers.
    """
    if method not in METHODS:
        raise TopologyError(f"unknown placement method; known: {', '.join(METHODS)}", value=method)
    pins = dict(pins or {})
    index = {h.name: i for i, h in enumerate(hosts)}
    for node, host in pins.items():
        if node not in topo.nodes:
            raise TopologyError(f"no node {node!r} in topology {topo.name}", path="--pin", value=f"{node}={host}")
        if host not in index:
            raise TopologyError(f"no host {host!r} in the hosts file (hosts: {', '.join(index)})", file=hosts.source,
                                path="--pin", value=f"{node}={host}")
    pin_index = {node: index[host] for node, host in pins.items()}
    caps = _capacities(hosts)
    demand = {n: _demand(topo, n) for n in topo.nodes}
    _check_capacity(topo, hosts, caps, demand, pin_index)

    start = None
    if method == "round-robin":
        by_node = _round_robin(topo, caps, demand, pin_index)
    else:
        found = _search(topo, caps, demand, pin_index, _link_weights(topo))
        by_node, start = found if found is not None else (None, None)
    if by_node is None:
        room = ", ".join(f"{h.name}: {h.capacity.cores} cores, {h.capacity.gpus} GPUs" for h in hosts)
        raise TopologyError(f"the workers do not pack onto the hosts (each worker whole on one host; hosts: {room})",
                            file=hosts.source, path="hosts[*].capacity")
    return _result(topo, hosts, caps, demand, by_node, method, start, pins)


def _result(topo: Topology, hosts: Hosts, caps: list[Vec], demand: Mapping[str, Vec], by_node: Mapping[str, int],
            method: str, start: str | None, pins: dict[str, str]) -> Placement:
    names = [h.name for h in hosts]
    assignment = {n: names[by_node[n]] for n in topo.nodes}
    cut = tuple(CutLink(i, link.a, link.b, link.tier, assignment[link.a], assignment[link.b],
                        link.ab.bandwidth_bps, link.ba.bandwidth_bps)
                for i, link in enumerate(topo.links) if assignment[link.a] != assignment[link.b])
    loads = []
    for h, host in enumerate(hosts):
        mine = [n for n in topo.nodes if by_node[n] == h]
        workers = tuple(n for n in mine if topo.nodes[n].is_worker)
        used = _ZERO
        for w in workers:
            used = _add(used, demand[w])
        loads.append(HostLoad(host.name, workers, tuple(n for n in mine if topo.nodes[n].is_switch),
                              round(used[0], 6), host.capacity.cores, used[1], host.capacity.gpus, int(used[2]),
                              host.capacity.memory))
    return Placement(assignment, cut, tuple(loads), method, start, pins)
