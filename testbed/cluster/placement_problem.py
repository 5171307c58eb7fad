"""The placement problem in numbers: what a node takes of a host and what a host has (Vec), what
cutting a link costs, and the units (racks or single nodes) placement moves between hosts. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from testbed.cluster.hosts import Hosts
from testbed.topology.model import Topology

__all__ = ["EPS", "Vec", "ZERO", "fits", "vec_add", "vec_sub", "node_demand", "host_capacities", "link_weights",
           "Problem"]

EPS = 1e-9

Vec = tuple[float, int, float]   # cores, GPUs, memory bytes (inf: not limited)
ZERO: Vec = (0.0, 0, 0)


def fits(used: Vec, demand: Vec, cap: Vec) -> bool:
    return (used[0] + demand[0] <= cap[0] + EPS and used[1] + demand[1] <= cap[1]
            and used[2] + demand[2] <= cap[2])


def vec_add(a: Vec, b: Vec) -> Vec:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def vec_sub(a: Vec, b: Vec) -> Vec:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


def node_demand(topo: Topology, node: str) -> Vec:
    """What a node takes of a host: a worker its cpus (or 1 core), GPUs and declared memory; a switch nothing."""
    n = topo.nodes[node]
    if not n.is_worker:
        return ZERO
    return (float(n.cpus if n.cpus is not None else 1), n.gpus, n.memory_bytes or 0)


def host_capacities(hosts: Hosts) -> list[Vec]:
    return [(float(h.capacity.cores), h.capacity.gpus,
             float(h.capacity.memory) if h.capacity.memory is not None else math.inf) for h in hosts]


def link_weights(topo: Topology) -> list[int]:
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


class Problem:
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
                need = ZERO
                for n in nodes:
                    need = vec_add(need, demand[n])
                hosts = {pins[n] for n in nodes if n in pins}
                if len(hosts) > 1:
                    continue
                pin = next(iter(hosts), None)
                where = [pin] if pin is not None else range(len(caps))
                if not any(fits(ZERO, need, caps[h]) for h in where):
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
        used = [ZERO for _ in self.caps]
        for u, h in enumerate(assign):
            used[h] = vec_add(used[h], self.units[u].demand)
        return used

    def feasible(self, assign: Sequence[int]) -> bool:
        return all(fits(ZERO, u, c) for u, c in zip(self.used(assign), self.caps))

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
