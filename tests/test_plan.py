"""The address and routing plan (testbed/topology/plan.py) on generated fabrics."""

from __future__ import annotations

import ipaddress
import itertools
import statistics
import time

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.errors import TopologyError
from testbed.topology.generators import GENERATORS
from testbed.topology.loader import load_topology
from testbed.topology.model import Link, LinkProfile, Node, Topology
from testbed.topology.plan import NetworkPlan, NextHop, Route, plan_network


def generated(name: str, **params) -> Topology:
    nodes, links = GENERATORS[name].generate(params)
    return Topology(name=name, nodes=nodes, links=links, generator=name, params=params).validate()


def pod_of(topo: Topology, worker: str) -> tuple[int, int]:
    """(pod, edge) of a fat-tree worker, from its edge switch's name edge{p}-{i}."""
    edge = topo.neighbors(worker)[0]
    pod, i = edge[len("edge"):].split("-")
    return int(pod), int(i)


def check_plan(topo: Topology) -> None:
    plan = plan_network(topo)
    # every worker exactly one address, all addresses unique (plain IPs), inside its switch's subnet
    seen: set[str] = set()
    for node in topo.nodes:
        for cidr in plan.addresses(node):
            ip = cidr.split("/")[0]
            assert ip not in seen, f"{ip} used twice"
            seen.add(ip)
    for w in topo.workers:
        addrs = plan.addresses(w)
        assert len(addrs) == 1, (w, addrs)
        sw = topo.neighbors(w)[0]
        assert ipaddress.IPv4Interface(addrs[0]).ip in ipaddress.IPv4Network(plan.subnets[sw].network)
        assert plan.worker_address(w) == addrs[0].split("/")[0]
        [route] = plan.routes[w]
        assert route.dst == "default"
        assert route.nexthops[0].via == plan.subnets[sw].gateway.split("/")[0]
    # next hops: (local interface, address) must be the far end of a link of that node
    far: dict[tuple[str, str], tuple[str, str | None]] = {}
    for lp in plan.links:
        far[(lp.a.node, lp.a.ifname)] = (lp.b.node, lp.b.address)
        far[(lp.b.node, lp.b.ifname)] = (lp.a.node, lp.a.address)
    check_tables(topo, plan, set())


def lookup(routes: list[Route], network: str) -> tuple[NextHop, ...] | None:
    """The next hops longest-prefix match over `routes` picks for the addresses of `network`
    (None: no route matches)."""
    net = ipaddress.IPv4Network(network)
    best: tuple[int, tuple[NextHop, ...]] | None = None
    for r in routes:
        dst = ipaddress.IPv4Network("0.0.0.0/0" if r.dst == "default" else r.dst)
        if net.overlaps(dst):
            assert net.subnet_of(dst), f"{r.dst} splits {network}: its addresses would go different ways"
            if best is None or dst.prefixlen > best[0]:
                best = (dst.prefixlen, r.nexthops)
    return None if best is None else best[1]


def reference_next_hops(topo: Topology, plan: NetworkPlan, down: set[int]) -> dict[str, dict[str, set[str]]]:
    """switch -> {foreign subnet: the neighbours that start its shortest paths}, from networkx."""
    g = nx.Graph()
    g.add_nodes_from(topo.switches)
    g.add_edges_from((lk.a, lk.b) for i, lk in enumerate(topo.links)
                     if i not in down and topo.nodes[lk.a].is_switch and topo.nodes[lk.b].is_switch)
    out: dict[str, dict[str, set[str]]] = {sw: {} for sw in topo.switches}
    for owner, subnet in plan.subnets.items():
        for sw in topo.switches:
            if sw != owner:
                out[sw][subnet.network] = ({path[1] for path in nx.all_shortest_paths(g, sw, owner)}
                                           if nx.has_path(g, sw, owner) else set())
    return out


def check_tables(topo: Topology, plan: NetworkPlan, down: set[int]) -> None:
    """The heart of the routing plan: longest-prefix match over every switch's summarised table gives,
    for every worker subnet, exactly the ECMP next hops of the exact table (and those are the first hops
    of all shortest switch paths), and an unreachable subnet stays unreachable."""
    far: dict[tuple[str, str], tuple[str, str | None, int]] = {}
    for lp in plan.links:
        far[(lp.a.node, lp.a.ifname)] = (lp.b.node, lp.b.address, lp.index)
        far[(lp.b.node, lp.b.ifname)] = (lp.a.node, lp.a.address, lp.index)
    exact = plan.next_hops(down)
    reference = reference_next_hops(topo, plan, down)
    tables = plan.switch_routes(down)
    assert set(exact) == set(tables) == set(topo.switches)
    for sw in topo.switches:
        for net, hops in exact[sw].items():
            peers = []
            for hop in hops:   # (interface, address): the far end of an up link to a switch
                peer, addr, index = far[(sw, hop.ifname)]
                assert topo.nodes[peer].is_switch and index not in down
                assert addr is not None and addr.split("/")[0] == hop.via
                peers.append(peer)
            assert len(peers) == len(set(peers)) and set(peers) == reference[sw][net], (sw, net)
        routes = tables[sw]
        assert len({r.dst for r in routes}) == len(routes), f"{sw}: two routes to one destination"
        for net, hops in exact[sw].items():
            got = lookup(routes, net)
            if hops:
                assert got is not None and set(got) == set(hops), (sw, net, got, hops)
            else:
                assert not got, f"{sw}: unreachable {net} would go to {got}"
        own = plan.subnets.get(sw)
        if own is not None:   # nothing competes with the connected route of its own subnet
            mine = ipaddress.IPv4Network(own.network)
            assert not [r for r in routes if r.dst != "default" and ipaddress.IPv4Network(r.dst).subnet_of(mine)]


def test_k4_fat_tree_paths():
    topo = generated("fat-tree", k=4)
    plan = plan_network(topo)
    assert plan.ecmp_paths("w0", "w1") == 1    # same edge switch
    assert plan.ecmp_paths("w0", "w2") == 2    # same pod, other edge: k/2
    assert plan.ecmp_paths("w0", "w4") == 4    # another pod: (k/2)^2
    assert plan.ecmp_paths("w0", "w15") == 4
    # ECMP at an edge switch toward another pod: one next hop per aggregation switch, all of it
    # the edge's default route
    edge = topo.neighbors("w0")[0]
    dst_net = plan.subnets[topo.neighbors("w4")[0]].network
    assert len(lookup(plan.routes[edge], dst_net)) == 2
    assert [r.dst for r in plan.routes[edge]] == ["10.0.0.0/16"]
    check_plan(topo)


@settings(max_examples=5, deadline=None)
@given(k=st.sampled_from([2, 4, 6, 8, 10]), data=st.data())
def test_fat_tree_plan_properties(k, data):
    topo = generated("fat-tree", k=k)
    plan = plan_network(topo)
    check_plan(topo)
    half = k // 2
    workers = topo.workers
    assert len(workers) == k ** 3 // 4
    a = data.draw(st.sampled_from(workers))
    b = data.draw(st.sampled_from(workers))
    (pa, ea), (pb, eb) = pod_of(topo, a), pod_of(topo, b)
    if pa != pb:
        expected = half * half
    elif ea != eb:
        expected = half
    else:
        expected = 1
    assert plan.ecmp_paths(a, b) == expected
    # and every cross-pod pair of a sample agrees with (k/2)^2
    for x, y in itertools.islice(((x, y) for x in workers[:: max(1, len(workers) // 6)] for y in workers
                                  if pod_of(topo, x)[0] != pod_of(topo, y)[0]), 50):
        assert plan.ecmp_paths(x, y) == half * half


@pytest.mark.parametrize("spines", [1, 2, 3, 5])
def test_leaf_spine_ecmp_is_spines(spines):
    topo = generated("leaf-spine", leaves=3, spines=spines, hosts_per_leaf=2)
    plan = plan_network(topo)
    check_plan(topo)
    assert plan.ecmp_paths("w0", "w2") == spines      # other leaf
    assert plan.ecmp_paths("w0", "w1") == 1           # same leaf
    hops = lookup(plan.routes["leaf0"], plan.subnets["leaf1"].network)
    assert {h.ifname for h in hops} == {f"eth{2 + s}" for s in range(spines)}


def test_star_and_dumbbell():
    check_plan(generated("star", n=5))
    topo = generated("dumbbell", left=2, right=3)
    check_plan(topo)
    assert plan_network(topo).ecmp_paths("w0", "w4") == 1


def test_address_pool_is_configurable():
    topo = generated("fat-tree", k=4)
    topo.address_pool = "172.16.0.0/16"
    plan = plan_network(topo)
    pool = ipaddress.IPv4Network("172.16.0.0/16")
    for w in topo.workers:
        assert ipaddress.IPv4Interface(plan.addresses(w)[0]).ip in pool
    # the argument wins over the topology's field
    plan = plan_network(topo, pool="192.168.0.0/16")
    assert plan.worker_address("w0").startswith("192.168.")


def test_fabric_pool_is_configurable():
    topo = generated("leaf-spine", leaves=2, spines=2, hosts_per_leaf=1)
    topo.fabric_pool = "10.200.0.0/24"
    plan = plan_network(topo)
    fabric = [p.address for lp in plan.links if lp.kind == "fabric" for p in (lp.a, lp.b)]
    assert fabric and all(ipaddress.IPv4Interface(a).ip in ipaddress.IPv4Network("10.200.0.0/24") for a in fabric)


def test_pool_too_small_is_a_topology_error():
    topo = generated("fat-tree", k=4)  # 8 edge switches, one /24 each
    topo.address_pool = "10.0.0.0/22"   # room for 4
    with pytest.raises(TopologyError) as err:
        plan_network(topo)
    assert err.value.path == "addressing.pool" and err.value.value == "10.0.0.0/22"
    topo.address_pool = "10.0.0.0/21"   # exactly 8
    plan_network(topo)


def test_fabric_pool_too_small_and_overlap():
    topo = generated("fat-tree", k=4)   # 32 switch-switch links: a /26
    topo.fabric_pool = "10.255.0.0/27"
    with pytest.raises(TopologyError, match="fabric pool is too small"):
        plan_network(topo)
    topo.fabric_pool = "10.0.0.0/24"
    with pytest.raises(TopologyError, match="overlap"):
        plan_network(topo)
    topo.fabric_pool = None
    with pytest.raises(TopologyError, match="not an IPv4 network"):
        plan_network(topo, pool="10.0.0.1/16")


def test_big_rack_gets_a_bigger_subnet():
    topo = generated("star", n=300)
    plan = plan_network(topo)
    assert plan.subnets["s0"].network == "10.0.0.0/23"
    check_plan(topo)


# -- summarised routing tables ------------------------------------------------------------------------------


def fat_trees() -> st.SearchStrategy[Topology]:
    return st.sampled_from([2, 4, 6, 8]).map(lambda k: generated("fat-tree", k=k))


def leaf_spines() -> st.SearchStrategy[Topology]:
    return st.builds(lambda leaves, spines, hosts: generated("leaf-spine", leaves=leaves, spines=spines,
                                                             hosts_per_leaf=hosts),
                     st.integers(1, 9), st.integers(1, 4), st.integers(1, 3))


@st.composite
def random_fabrics(draw) -> Topology:
    """A connected switch graph of any shape (a random spanning tree plus random extra links), workers on
    random switches, some on two, some switches serving none, links in a random order."""
    n = draw(st.integers(1, 9))
    switches = [f"s{i}" for i in range(n)]
    pairs = {(draw(st.integers(0, i - 1)), i) for i in range(1, n)}
    for a, b in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=12)):
        if a != b:
            pairs.add((min(a, b), max(a, b)))
    links = [Link(switches[a], switches[b], "fabric", FAST, FAST) for a, b in pairs]
    workers = [f"w{i}" for i in range(draw(st.integers(1, 12)))]
    for w in workers:
        homes = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=min(2, n)))
        links += [Link(w, switches[h], "host", FAST, FAST) for h in sorted(homes)]
    links = draw(st.permutations(links))
    nodes = {**{w: Node(w, "worker") for w in workers}, **{s: Node(s, "switch") for s in switches}}
    return Topology(name="random", nodes=nodes, links=list(links)).validate()


FAST = LinkProfile(bandwidth_bps=10**10, delay_s=2e-6)


@settings(max_examples=60, deadline=None)
@given(topo=st.one_of(fat_trees(), leaf_spines(), random_fabrics()), data=st.data())
def test_summarised_tables_route_exactly_like_the_exact_ones(topo, data):
    plan = plan_network(topo)
    assert {s: plan.routes[s] for s in topo.switches} == plan.switch_routes()
    check_tables(topo, plan, set())
    fabric = [lp.index for lp in plan.links if lp.kind == "fabric"]
    for _ in range(3):   # random links down, from one to all of them
        down = data.draw(st.sets(st.sampled_from(fabric), max_size=len(fabric)) if fabric else st.just(set()))
        check_tables(topo, plan, down)


def test_unreachable_stays_unreachable():
    topo = generated("leaf-spine", leaves=4, spines=1, hosts_per_leaf=1)
    plan = plan_network(topo)
    uplink = plan.links[topo.link_index("leaf0", "spine0")]
    to_spine = (NextHop(uplink.b.address.split("/")[0], uplink.a.ifname),)
    assert plan.routes["leaf0"] == [Route("10.0.0.0/16", to_spine)]
    # leaf1 cut off: leaf2 and leaf3 still through the spine (the default), leaf1 (and leaf0's own
    # subnet, which its connected route covers) an unreachable route, not the default
    leaf0 = plan.switch_routes({topo.link_index("leaf1", "spine0")})["leaf0"]
    assert leaf0 == [Route("10.0.0.0/16", to_spine), Route("10.0.0.0/23", ())]
    assert lookup(leaf0, plan.subnets["leaf1"].network) == ()
    # a switch cut off from everything: one unreachable route over the pool, no default
    alone = {topo.link_index(f"leaf{i}", "spine0") for i in range(4)}
    assert plan.switch_routes(alone)["leaf0"] == [Route("10.0.0.0/16", ())]
    check_tables(topo, plan, alone)


def test_disconnected_fabric_plans_unreachable_routes():
    """Two racks with no link between them: each switch's plan says the other is unreachable."""
    nodes = {"w0": Node("w0", "worker"), "w1": Node("w1", "worker"), "s0": Node("s0", "switch"),
             "s1": Node("s1", "switch")}
    topo = Topology(name="apart", nodes=nodes, links=[Link("w0", "s0", "host", FAST, FAST),
                                                      Link("w1", "s1", "host", FAST, FAST)]).validate()
    plan = plan_network(topo)
    assert plan.routes["s0"] == [Route("10.0.0.0/16", ())] and plan.routes["s1"] == plan.routes["s0"]
    assert plan.to_json()["routes"]["s0"] == [{"dst": "10.0.0.0/16", "nexthops": []}]
    check_plan(topo)


def test_route_counts_k16_fat_tree():
    k = 16
    topo = generated("fat-tree", k=k)
    t0 = time.perf_counter()
    plan = plan_network(topo)
    seconds = time.perf_counter() - t0
    per_switch = [len(plan.routes[s]) for s in topo.switches]
    print(f"k={k}: {sum(per_switch)} routes on {len(per_switch)} switches (min {min(per_switch)}, median "
          f"{statistics.median(per_switch)}, max {max(per_switch)}), planned in {seconds:.2f} s")
    assert seconds < 5
    assert sum(per_switch) <= k ** 3
    # an edge switch: its default up; an aggregation switch: its pod's edges and a default up; a core:
    # one route per pod but the default's
    assert [len(plan.routes[s]) for s in ("edge3-1", "agg3-1", "core7")] == [1, k // 2 + 1, k]
    assert plan.ecmp_paths("w0", "w1023") == (k // 2) ** 2


@pytest.mark.parametrize("k", [4, 6, 8])
def test_pods_get_covering_prefixes(k):
    """A pod's edge subnets sit in one block aligned to its size: one prefix covers the pod."""
    topo = generated("fat-tree", k=k)
    plan = plan_network(topo)
    half = k // 2
    block = 1 << (half - 1).bit_length()   # /24s per pod, rounded up to a power of two
    for pod in range(k):
        nets = [ipaddress.IPv4Network(plan.subnets[f"edge{pod}-{i}"].network) for i in range(half)]
        cover = ipaddress.IPv4Network((int(nets[0].network_address), 24 - (block.bit_length() - 1)))
        assert int(cover.network_address) == pod * block * 256 + int(ipaddress.IPv4Address("10.0.0.0"))
        assert all(n.subnet_of(cover) for n in nets)
    check_plan(topo)


def test_addresses_kept_where_already_aligned():
    """Topologies whose subnets were already aligned keep the addresses they had before grouping."""
    def nets(topo):
        return {sw: s.network for sw, s in plan_network(topo).subnets.items()}

    assert nets(generated("fat-tree", k=4)) == {f"edge{p}-{i}": f"10.0.{2 * p + i}.0/24"
                                                 for p in range(4) for i in range(2)}
    assert nets(generated("leaf-spine", leaves=3, spines=2, hosts_per_leaf=2)) == {
        f"leaf{i}": f"10.0.{i}.0/24" for i in range(3)}
    assert nets(generated("leaf-spine")) == {f"leaf{i}": f"10.0.{i}.0/24" for i in range(4)}
    assert nets(generated("star", n=5)) == {"s0": "10.0.0.0/24"}
    assert nets(generated("dumbbell", left=2, right=3)) == {"s0": "10.0.0.0/24", "s1": "10.0.1.0/24"}
    assert nets(load_topology("two-racks")) == {"tor0": "10.0.0.0/24", "tor1": "10.0.1.0/24"}


def test_padding_that_does_not_fit_falls_back_to_packed():
    """Three leaves pad to a block of four /24s; a fourth rack hangs off leaf0. Padded that needs five
    /24s, the /22 pool holds four: the subnets are packed as before, and the tables are still exact."""
    nodes, links = GENERATORS["leaf-spine"].generate({"leaves": 3, "spines": 2, "hosts_per_leaf": 1})
    topo = Topology(name="t", nodes={**nodes, "w9": Node("w9", "worker"), "x": Node("x", "switch")},
                    links=[*links, Link("x", "leaf0", "fabric", FAST, FAST), Link("w9", "x", "host", FAST, FAST)],
                    address_pool="10.0.0.0/22").validate()
    plan = plan_network(topo)
    assert {sw: s.network for sw, s in plan.subnets.items()} == {
        "leaf0": "10.0.0.0/24", "leaf1": "10.0.1.0/24", "leaf2": "10.0.2.0/24", "x": "10.0.3.0/24"}
    check_tables(topo, plan, set())
    topo.address_pool = "10.0.0.0/21"   # room for the padding: x goes after the leaves' block
    assert plan_network(topo).subnets["x"].network == "10.0.4.0/24"


def test_racks_of_different_sizes():
    """A big rack (a /23) among /24s of the same group: each subnet aligned inside the group's block."""
    nodes, links = GENERATORS["leaf-spine"].generate({"leaves": 3, "spines": 2, "hosts_per_leaf": 1})
    extra = {f"x{i}": Node(f"x{i}", "worker") for i in range(300)}
    topo = Topology(name="t", nodes={**nodes, **extra},
                    links=[*links, *(Link(w, "leaf1", "host", FAST, FAST) for w in extra)]).validate()
    plan = plan_network(topo)
    assert {sw: s.network for sw, s in plan.subnets.items()} == {
        "leaf0": "10.0.0.0/24", "leaf1": "10.0.2.0/23", "leaf2": "10.0.4.0/24"}
    check_plan(topo)
    check_tables(topo, plan, {topo.link_index("leaf1", "spine0")})
