"""The address plan and the routing plan: pure functions of a topology.

Layout (DESIGN.md, data-plane decisions): a switch that serves workers holds
one subnet and its gateway address on a bridge; workers get addresses in it
and a default route to it. Links between switches are routed /31s. Workers
never forward.

Addresses are laid out so that routes can be summarised like a real fabric's:
switches that serve workers and have the same neighbouring switches (a
fat-tree pod's edge switches, a leaf-spine's leaves) form a group, and each
group's subnets sit in one block aligned to its size rounded up to a power of
two, so one prefix covers the group. When the padding does not fit the pool,
subnets are packed one after another (still correct, just less summarised).

Routes (`NetworkPlan.switch_routes`, the one place they are computed, also for
a fabric with links down): a switch's exact table is, for every worker subnet
it does not serve, the set of equal-cost next hops over all shortest switch
paths (static ECMP, no control plane); empty when the subnet is out of reach.
Its installed table says the same in fewer routes: the most common next-hop
set becomes the route for the whole worker pool (not a default route: an
address outside the pool fails at once rather than circling the fabric), and
a walk down a binary trie of the pool emits one route where all the subnets
below a prefix share a set other than the pool route's. A subnet out of reach
gets an `unreachable` route (never the pool route's hops), so senders get an
error at once. Longest-prefix match over the
installed table gives exactly the exact table's next hops (tests/test_plan.py
checks it); a k=16 fat-tree needs 2,304 routes instead of 40,832.
"""

from __future__ import annotations

import functools
import ipaddress
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Iterable

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
    nexthops: tuple[NextHop, ...]  # () on a switch: the network is out of reach (an `unreachable` route)


@dataclass
class NetworkPlan:
    links: list[LinkPlan]
    subnets: dict[str, Subnet]                 # switch -> the subnet it serves
    routes: dict[str, list[Route]]             # node -> its routes
    _ports: dict[str, list[Port]] = field(default_factory=dict, repr=False)
    _switch_adj: dict[str, list[str]] = field(default_factory=dict, repr=False)
    _subnet_of_worker: dict[str, str] = field(default_factory=dict, repr=False)
    _fabric_hops: dict[str, list[tuple[int, str, NextHop]]] = field(default_factory=dict, repr=False)
    _pool: str = field(default=DEFAULT_POOL, repr=False)   # the worker pool: the root of the route trie
    _tables: dict[frozenset[int], dict[str, list[Route]]] = field(default_factory=dict, repr=False)

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

    def next_hops(self, down: Collection[int] = frozenset()) -> dict[str, dict[str, tuple[NextHop, ...]]]:
        """The exact tables: switch -> {every worker subnet it does not serve: its ECMP next hops over all
        shortest switch paths of the fabric without the links (indices) in `down`; () if out of reach}."""
        adj = {sw: [peer for i, peer, _ in hops if i not in down] for sw, hops in self._fabric_hops.items()}
        out: dict[str, dict[str, tuple[NextHop, ...]]] = {sw: {} for sw in adj}
        for owner, subnet in self.subnets.items():
            dist = hop_distances(adj, [owner])
            for sw, table in out.items():
                if sw == owner:
                    continue
                d = dist.get(sw)
                table[subnet.network] = () if d is None else tuple(
                    h for i, peer, h in self._fabric_hops[sw] if i not in down and dist.get(peer) == d - 1)
        return out

    def switch_routes(self, down: Collection[int] = frozenset()) -> dict[str, list[Route]]:
        """Every switch's installed routing table with the links in `down` down (nothing down: the
        plan's): its exact table summarised (module docstring). Kept per down-set: a fault compares
        the tables before and after, and the plan itself was built with nothing down."""
        key = frozenset(down)
        if key not in self._tables:
            self._tables[key] = {sw: summarise(table, self._pool) for sw, table in self.next_hops(key).items()}
        return self._tables[key]

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

    # One subnet per serving switch, sized for its workers (at least a /24, easy to read), laid out
    # by groups (module docstring); packed as before when the padded groups do not fit.
    prefixes = {sw: min(24, 32 - math.ceil(math.log2(len(served[sw]) + 3)))  # + network, gateway, broadcast
                for sw in topo.switches if sw in served}
    neighbour_switches: dict[str, set[str]] = {sw: set() for sw in prefixes}
    for link in topo.links:
        if nodes[link.a].is_switch and nodes[link.b].is_switch:
            for sw, peer in ((link.a, link.b), (link.b, link.a)):
                if sw in neighbour_switches:
                    neighbour_switches[sw].add(peer)
    groups: dict[frozenset[str], list[str]] = {}
    for sw in prefixes:
        groups.setdefault(frozenset(neighbour_switches[sw]), []).append(sw)
    networks = _lay_out(list(groups.values()), prefixes, pool_net)
    if networks is None:   # the padding does not fit: one subnet after the other
        networks = _lay_out([[sw] for sw in prefixes], prefixes, pool_net)
    if networks is None:
        raise TopologyError("the address pool is too small for the worker subnets", file=topo.source,
                            path="addressing.pool", value=str(pool_net))
    subnets: dict[str, Subnet] = {}
    host_addr: dict[int, str] = {}  # link index -> the worker's CIDR on it
    for sw in prefixes:   # in switch order, as before
        net = networks[sw]
        subnets[sw] = Subnet(sw, str(net), f"{net.network_address + 1}/{net.prefixlen}")
        for n, (link_index, _w) in enumerate(served[sw]):
            host_addr[link_index] = f"{net.network_address + 2 + n}/{net.prefixlen}"

    # Ports, link by link; fabric and direct links get /31s from the fabric pool.
    fab_cursor = int(fabric_net.network_address)
    fab_end = int(fabric_net.broadcast_address)
    counters: dict[str, int] = {n: 0 for n in nodes}
    ports: dict[str, list[Port]] = {n: [] for n in nodes}
    plans: list[LinkPlan] = []
    switch_adj: dict[str, list[str]] = {s: [] for s in topo.switches}
    fabric_hops: dict[str, list[tuple[int, str, NextHop]]] = {s: [] for s in topo.switches}
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
                fabric_hops[link.a].append((i, link.b, NextHop(str(ab), ifa)))
                fabric_hops[link.b].append((i, link.a, NextHop(str(aa), ifb)))
        plans.append(LinkPlan(i, pa, pb, kind))
        ports[link.a].append(pa)
        ports[link.b].append(pb)

    # Routes. Workers: a default route to the switch of their first access link; switches: their tables.
    routes: dict[str, list[Route]] = {n: [] for n in nodes}
    for w in topo.workers:
        sw = subnet_of_worker.get(w)
        if sw is None:
            continue
        wport = next(p for lp in plans if lp.kind == "access" for p in (lp.a, lp.b)
                     if p.node == w and lp.port(sw).node == sw)
        routes[w].append(Route("default", (NextHop(subnets[sw].gateway.split("/")[0], wport.ifname),)))
    plan = NetworkPlan(plans, subnets, routes, ports, switch_adj, subnet_of_worker, fabric_hops, str(pool_net))
    routes.update(plan.switch_routes())
    return plan


def _lay_out(groups: list[list[str]], prefixes: dict[str, int], pool: ipaddress.IPv4Network
             ) -> dict[str, ipaddress.IPv4Network] | None:
    """Subnets for the serving switches, group after group, each subnet aligned to its size and each
    group in a block of its own aligned to its size rounded up to a power of two (one prefix covers
    it). None when the pool is too small."""
    cursor, end = int(pool.network_address), int(pool.broadcast_address) + 1
    out: dict[str, ipaddress.IPv4Network] = {}
    for group in groups:
        span = 0   # the group's extent from an aligned start
        for sw in group:
            span = _align(span, 2 ** (32 - prefixes[sw])) + 2 ** (32 - prefixes[sw])
        block = 1 << (span - 1).bit_length()
        start = _align(cursor, block)
        if start + block > end:
            return None
        cursor = start
        for sw in group:
            cursor = _align(cursor, 2 ** (32 - prefixes[sw]))
            out[sw] = ipaddress.IPv4Network((cursor, prefixes[sw]))
            cursor += 2 ** (32 - prefixes[sw])
        cursor = start + block
    return out


def _align(n: int, size: int) -> int:
    return (n + size - 1) // size * size


def summarise(table: dict[str, tuple[NextHop, ...]], pool: str) -> list[Route]:
    """A switch's exact table (subnet -> next hops, its own subnet left out) as few routes as say the
    same under longest-prefix match: the most common reachable next-hop set as the route for the
    whole worker `pool` (when it serves at least 2 subnets), then, walking down a binary trie of
    `pool`, a route at the top-most prefix whose subnets all share one set, none where that set is
    the pool route's. The pool route, not a default route: an address outside the pool (a fabric
    /31, anything else) has no route on any switch and fails at once instead of circling the
    fabric until its TTL runs out."""
    entries = sorted(((_span(net), hops) for net, hops in table.items()), key=lambda e: e[0])   # ((first, last), hops)
    counts = Counter(hops for _span_, hops in entries if hops)
    default = None
    if counts:
        hops, n = counts.most_common(1)[0]   # ties: the set met first in address order
        if n >= 2:
            default = hops
    root = ipaddress.IPv4Network(pool)
    routes = [Route(str(root), default)] if default is not None else []

    def walk(first: int, prefixlen: int, below: list[tuple[tuple[int, int], tuple[NextHop, ...]]]) -> None:
        if not below:
            return   # no subnet here: whatever covers it is fine
        sets = {hops for _span_, hops in below}
        if len(sets) == 1:
            (hops,) = sets
            if hops != default:
                routes.append(Route(str(ipaddress.IPv4Network((first, prefixlen))), hops))
            return
        middle = first + 2 ** (31 - prefixlen)   # more than one subnet below: prefixlen < 32
        walk(first, prefixlen + 1, [e for e in below if e[0][1] < middle])
        walk(middle, prefixlen + 1, [e for e in below if e[0][0] >= middle])

    walk(int(root.network_address), root.prefixlen, entries)
    return routes


@functools.lru_cache(maxsize=4096)   # every switch's table names the same subnets: parse each once
def _span(network: str) -> tuple[int, int]:
    net = ipaddress.IPv4Network(network)
    return int(net.network_address), int(net.broadcast_address)


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
