"""The address and routing plan (testbed/topology/plan.py) on generated fabrics."""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.errors import TopologyError
from testbed.topology.generators import GENERATORS
from testbed.topology.model import Topology
from testbed.topology.plan import plan_network


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
    subnets = {s.network: sw for sw, s in plan.subnets.items()}
    for sw in topo.switches:
        by_dst = {r.dst: r for r in plan.routes[sw]}
        foreign = {net for net, owner in subnets.items() if owner != sw}
        assert set(by_dst) == foreign, sw  # a route to every foreign worker subnet, nothing else
        for route in by_dst.values():
            assert route.nexthops
            for hop in route.nexthops:
                peer, addr = far[(sw, hop.ifname)]
                assert peer in topo.neighbors(sw) and topo.nodes[peer].is_switch
                assert addr is not None and addr.split("/")[0] == hop.via


def test_k4_fat_tree_paths():
    topo = generated("fat-tree", k=4)
    plan = plan_network(topo)
    assert plan.ecmp_paths("w0", "w1") == 1    # same edge switch
    assert plan.ecmp_paths("w0", "w2") == 2    # same pod, other edge: k/2
    assert plan.ecmp_paths("w0", "w4") == 4    # another pod: (k/2)^2
    assert plan.ecmp_paths("w0", "w15") == 4
    # ECMP routes at an edge switch toward another pod: one next hop per aggregation switch
    edge = topo.neighbors("w0")[0]
    dst_net = plan.subnets[topo.neighbors("w4")[0]].network
    [route] = [r for r in plan.routes[edge] if r.dst == dst_net]
    assert len(route.nexthops) == 2
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
    route = next(r for r in plan.routes["leaf0"] if r.dst == plan.subnets["leaf1"].network)
    assert {h.ifname for h in route.nexthops} == {f"eth{2 + s}" for s in range(spines)}


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
