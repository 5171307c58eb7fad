"""The address plan and the routing plan: pure functions of a topology.

Layout (DESIGN.md, data-plane decisions): a switch that serves workers holds
one subnet and its gateway address on a bridge; workers get addresses in it
and a default route to it. Links between switches are routed /31s. Every
switch has, for every worker subnet it does not own, the set of equal-cost
next hops over all shortest switch paths (static ECMP, no control plane).
Workers never forward.
"""

from __future__ import annotations

import ipaddress
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from testbed.errors import TopologyError
from testbed.topology.model import Topology

DEFAULT_POOL = "10.0.0.0/16"          # worker subnets
DEFAULT_FABRIC_POOL = "10.255.0.0/16"  # point-to-point /31s
BRIDGE = "br0"


def ifname(index: int) -> str:
    """A node's interface for its index-th link (topology link order): eth0, eth1, ..."""
    return f"eth{index}"


@dataclass(frozen=True)
class Port:
    """One end of a link as the data plane builds it."""

    node: str
    ifname: str            # name inside the node's namespace
    address: str | None    # CIDR ("10.0.1.2/24"); None for a switch port on its bridge
    bridged: bool = False  # enslave to the node's bridge (a switch port toward a worker)


@dataclass(frozen=True)
class LinkPlan:
    index: int
    a: Port
    b: Port
    kind: str  # "access" (worker-switch), "fabric" (switch-switch), "direct" (worker-worker)

    def port(self, node: str) -> Port:
        if node == self.a.node:
            return self.a
        if node == self.b.node:
            return self.b
        raise KeyError(node)


@dataclass(frozen=True)
class Subnet:
    switch: str
    network: str   # "10.0.1.0/24"
    gateway: str   # "10.0.1.1/24", on the switch's bridge


@dataclass(frozen=True)
class NextHop:
    via: str      # a plain address
    ifname: str   # out of this interface


@dataclass(frozen=True)
class Route:
    dst: str                    # a network, or "default"
    nexthops: tuple[NextHop, ...]


@dataclass
class NetworkPlan:
    links: list[LinkPlan]
    subnets: dict[str, Subnet]                 # switch -> the subnet it serves
    routes: dict[str, list[Route]]             # node -> its routes
    _ports: dict[str, list[Port]] = field(default_factory=dict, repr=False)
    _switch_adj: dict[str, list[str]] = field(default_factory=dict, repr=False)
    _subnet_of_worker: dict[str, str] = field(default_factory=dict, repr=False)

    def ports(self, node: str) -> list[Port]:
        return self._ports.get(node, [])

    def addresses(self, node: str) -> list[str]:
        out = [p.address for p in self.ports(node) if p.address]
        if node in self.subnets:
            out.insert(0, self.subnets[node].gateway)
        return out

    def worker_address(self, worker: str) -> str:
        """The worker's primary address (no prefix length): what peers use to reach it."""
        for p in self.ports(worker):
            if p.address:
                return p.address.split("/")[0]
        raise KeyError(f"{worker} has no address")

    def hosts(self) -> dict[str, str]:
        """Worker name -> primary address, for /etc/hosts."""
        return {w: self.worker_address(w) for w in self._subnet_of_worker}

    def ecmp_paths(self, src_worker: str, dst_worker: str) -> int:
        """How many equal-cost switch paths join two workers' access switches."""
        s, d = self._subnet_of_worker.get(src_worker), self._subnet_of_worker.get(dst_worker)
        if s is None or d is None:
            return 0
        if s == d:
            return 1
        return _count_shortest_paths(self._switch_adj, s, d)

    def access_switch(self, worker: str) -> str | None:
        """The switch a worker's traffic leaves through (its default route's gateway)."""
        return self._subnet_of_worker.get(worker)

    def paths(self, src_worker: str, dst_worker: str, limit: int = 256) -> list[list[str]]:
        """Every equal-cost path the routes allow from one worker to another, as node names
        (workers at both ends): the ECMP choices a flow's hash picks from. At most `limit`."""
        s, d = self._subnet_of_worker.get(src_worker), self._subnet_of_worker.get(dst_worker)
        if s is None or d is None:
            return []
        to_d = hop_distances(self._switch_adj, [d])
        if s not in to_d:
            return []
        out: list[list[str]] = []

        def walk(path: list[str]) -> None:
            u = path[-1]
            if u == d:
                out.append([src_worker, *path, dst_worker])
                return
            for v in self._switch_adj[u]:
                if len(out) < limit and to_d.get(v) == to_d[u] - 1 and v not in path:
                    walk(path + [v])

        walk([s])
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "links": [asdict(lp) for lp in self.links],
            "subnets": {k: asdict(v) for k, v in self.subnets.items()},
            "routes": {n: [{"dst": r.dst, "nexthops": [asdict(h) for h in r.nexthops]} for r in rs]
                       for n, rs in self.routes.items()},
        }


def plan_network(topo: Topology, pool: str | None = None, fabric_pool: str | None = None) -> NetworkPlan:
    """Addresses for every port and routes for every node."""
    pool_net = _network(pool or topo.address_pool or DEFAULT_POOL, "addressing.pool", topo)
    fabric_net = _network(fabric_pool or topo.fabric_pool or DEFAULT_FABRIC_POOL, "addressing.fabric_pool", topo)
    if pool_net.overlaps(fabric_net):
        raise TopologyError("the worker pool and the fabric pool overlap", file=topo.source,
                            path="addressing", value=[str(pool_net), str(fabric_net)])
    nodes = topo.nodes

    # Which workers each switch serves, in link order (this fixes the addresses).
    served: dict[str, list[tuple[int, str]]] = {}
    for i, link in enumerate(topo.links):
        ka, kb = nodes[link.a].kind, nodes[link.b].kind
        if ka == "switch" and kb == "worker":
            served.setdefault(link.a, []).append((i, link.b))
        elif kb == "switch" and ka == "worker":
            served.setdefault(link.b, []).append((i, link.a))

    # One subnet per serving switch, sized for its workers (at least a /24, easy to read).
    subnets: dict[str, Subnet] = {}
    host_addr: dict[int, str] = {}  # link index -> the worker's CIDR on it
    cursor = int(pool_net.network_address)
    pool_end = int(pool_net.broadcast_address)
    for sw in topo.switches:
        if sw not in served:
            continue
        need = len(served[sw]) + 3  # network, gateway, broadcast
        prefix = min(24, 32 - math.ceil(math.log2(need)))
        size = 2 ** (32 - prefix)
        cursor = (cursor + size - 1) // size * size  # align
        if cursor + size - 1 > pool_end:
            raise TopologyError("the address pool is too small for the worker subnets", file=topo.source,
                                path="addressing.pool", value=str(pool_net))
        net = ipaddress.IPv4Network((cursor, prefix))
        cursor += size
        gw = net.network_address + 1
        subnets[sw] = Subnet(sw, str(net), f"{gw}/{prefix}")
        for n, (link_index, _w) in enumerate(served[sw]):
            host_addr[link_index] = f"{net.network_address + 2 + n}/{prefix}"

    # Ports, link by link; fabric and direct links get /31s from the fabric pool.
    fab_cursor = int(fabric_net.network_address)
    fab_end = int(fabric_net.broadcast_address)
    counters: dict[str, int] = {n: 0 for n in nodes}
    ports: dict[str, list[Port]] = {n: [] for n in nodes}
    plans: list[LinkPlan] = []
    switch_adj: dict[str, list[str]] = {s: [] for s in topo.switches}
    fabric_hops: dict[str, list[tuple[str, NextHop]]] = {s: [] for s in topo.switches}
    subnet_of_worker: dict[str, str] = {}
    for i, link in enumerate(topo.links):
        ifa, ifb = ifname(counters[link.a]), ifname(counters[link.b])
        counters[link.a] += 1
        counters[link.b] += 1
        ka, kb = nodes[link.a].kind, nodes[link.b].kind
        if ka != kb:
            kind = "access"
            worker_is_a = ka == "worker"
            waddr = host_addr[i]
            pa = Port(link.a, ifa, waddr if worker_is_a else None, bridged=not worker_is_a)
            pb = Port(link.b, ifb, None if worker_is_a else waddr, bridged=worker_is_a)
            w, s = (link.a, link.b) if worker_is_a else (link.b, link.a)
            subnet_of_worker.setdefault(w, s)
        else:
            if fab_cursor + 1 > fab_end:
                raise TopologyError("the fabric pool is too small for the point-to-point links",
                                    file=topo.source, path="addressing.fabric_pool", value=str(fabric_net))
            aa, ab = ipaddress.IPv4Address(fab_cursor), ipaddress.IPv4Address(fab_cursor + 1)
            fab_cursor += 2
            pa, pb = Port(link.a, ifa, f"{aa}/31"), Port(link.b, ifb, f"{ab}/31")
            kind = "fabric" if ka == "switch" else "direct"
            if kind == "fabric":
                switch_adj[link.a].append(link.b)
                switch_adj[link.b].append(link.a)
                fabric_hops[link.a].append((link.b, NextHop(str(ab), ifa)))
                fabric_hops[link.b].append((link.a, NextHop(str(aa), ifb)))
        plans.append(LinkPlan(i, pa, pb, kind))
        ports[link.a].append(pa)
        ports[link.b].append(pb)

    # Routes. Switches: ECMP over all shortest switch paths to each foreign subnet.
    routes: dict[str, list[Route]] = {n: [] for n in nodes}
    for owner, subnet in subnets.items():
        dist = hop_distances(switch_adj, [owner])
        for sw in topo.switches:
            if sw == owner or sw not in dist:
                continue
            hops = tuple(h for peer, h in fabric_hops[sw] if dist.get(peer) == dist[sw] - 1)
            if hops:
                routes[sw].append(Route(subnet.network, hops))
    # Workers: a default route to the switch of their first access link.
    for w in topo.workers:
        sw = subnet_of_worker.get(w)
        if sw is None:
            continue
        wport = next(p for lp in plans if lp.kind == "access" for p in (lp.a, lp.b)
                     if p.node == w and lp.port(sw).node == sw)
        routes[w].append(Route("default", (NextHop(subnets[sw].gateway.split("/")[0], wport.ifname),)))

    return NetworkPlan(plans, subnets, routes, ports, switch_adj, subnet_of_worker)


def _network(text: str, path: str, topo: Topology) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise TopologyError(f"not an IPv4 network ({exc})", file=topo.source, path=path, value=text) from None


def hop_distances(adj: dict[str, list[str]], sources: Iterable[str]) -> dict[str, int]:
    """Hops from the nearest of `sources` to every node they reach (breadth-first)."""
    dist = {s: 0 for s in sources}
    queue = deque(dist)
    while queue:
        u = queue.popleft()
        for v in adj[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                queue.append(v)
    return dist


def _count_shortest_paths(adj: dict[str, list[str]], src: str, dst: str) -> int:
    dist = hop_distances(adj, [src])
    if dst not in dist:
        return 0
    count = {src: 1}
    for u in sorted(dist, key=dist.get):
        for v in adj[u]:
            if dist.get(v) == dist[u] + 1:
                count[v] = count.get(v, 0) + count[u]
    return count.get(dst, 0)
