"""One host's part of a testbed over several hosts (testbed.cluster.part): pure, no host needed."""

from __future__ import annotations

import pytest

from testbed.cluster.part import Part, cut_link_indices, make_parts
from testbed.cluster.hosts import load_hosts_text
from testbed.topology.loader import load_topology
from testbed.cluster.placement import place
from testbed.topology.plan import plan_network

HOSTS = """
hosts:
  - {name: a, ssh: root@198.18.9.1, key: /k, underlay: 198.18.9.1, capacity: {cores: 8}}
  - {name: b, ssh: root@198.18.9.2, key: /k, underlay: 198.18.9.2, capacity: {cores: 8}}
"""


@pytest.fixture(scope="module")
def fat_tree():
    topo = load_topology("fat-tree")
    hosts = load_hosts_text(HOSTS, "<hosts>")
    placement = place(topo, hosts)
    plan = plan_network(topo)
    parts = make_parts("tb1", topo, plan, placement.assignment, {"a": "198.18.9.1", "b": "198.18.9.2"},
                       {frozenset(("a", "b")): 40e-6})
    return topo, plan, placement, parts


def test_every_node_is_in_exactly_one_part(fat_tree):
    topo, _plan, _placement, parts = fat_tree
    assert set(parts) == {"a", "b"}
    assert parts["a"].nodes | parts["b"].nodes == set(topo.nodes)
    assert not parts["a"].nodes & parts["b"].nodes


def test_each_cut_link_has_one_end_per_host_that_agree(fat_tree):
    topo, plan, placement, parts = fat_tree
    cuts = cut_link_indices(topo, placement.assignment)
    assert cuts and sorted(cuts) == sorted(c.index for c in placement.cut_links)
    for i in cuts:
        ea, eb = parts["a"].tunnel(i), parts["b"].tunnel(i)
        assert ea is not None and eb is not None
        assert ea.vni == eb.vni and ea.local == eb.remote and eb.local == ea.remote
        assert {ea.node, eb.node} == set(topo.links[i].endpoints)
        assert parts["a"].local(ea.node) and parts["b"].local(eb.node)
        assert {ea.ifname, eb.ifname} == {plan.links[i].a.ifname, plan.links[i].b.ifname}
        assert parts["a"].underlay_s[i] == parts["b"].underlay_s[i] == 40e-6
    # links inside one host get no tunnel
    for i in set(range(len(topo.links))) - set(cuts):
        assert parts["a"].tunnel(i) is None and parts["b"].tunnel(i) is None


def test_parts_check_against_their_topology_and_round_trip(fat_tree):
    topo, plan, _placement, parts = fat_tree
    for part in parts.values():
        part.check_against(topo, plan, "tb1")
        again = Part.from_json(part.to_json())
        assert again == part
    with pytest.raises(ValueError, match="expected"):   # another testbed's name: other MACs and VNIs
        parts["a"].check_against(topo, plan, "tb2")


def test_a_part_missing_a_tunnel_is_refused(fat_tree):
    topo, plan, _placement, parts = fat_tree
    a = parts["a"]
    short = Part(a.host, a.nodes, a.tunnels[1:], a.underlay_s)
    with pytest.raises(ValueError, match=r"part.tunnels: link .* expected"):
        short.check_against(topo, plan, "tb1")
    with pytest.raises(ValueError, match="not a node of the topology"):
        Part(a.host, a.nodes | {"nosuch"}, a.tunnels).check_against(topo, plan, "tb1")


@pytest.mark.parametrize("data, field", [
    ([], "part: expected a mapping"),
    ({"host": "a", "nodes": [], "extra": 1}, "unknown field 'extra'"),
    ({"host": "", "nodes": []}, "part.host"),
    ({"host": "a", "nodes": "w0"}, "part.nodes"),
    ({"host": "a", "nodes": ["w0"], "tunnels": [{"link": "x"}]}, r"part.tunnels\[0\]"),
    ({"host": "a", "nodes": ["w0"], "underlay_s": {"3": -1}}, r"part.underlay_s\['3'\]"),
    ({"host": "a", "nodes": ["w0"], "underlay_s": {"x": 0.1}}, r"part.underlay_s\['x'\]"),
])
def test_from_json_names_the_bad_field(data, field):
    with pytest.raises(ValueError, match=field):
        Part.from_json(data)
