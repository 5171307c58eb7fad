"""The `part` record of a state (one host's part of a testbed over several hosts), as the state
schema checks it without testbed.cluster (tests/test_layers.py: the state layer imports neither
net/, runtime/ nor cluster/): what `up` writes (Part.to_json) validates; a node that is not the
topology's, an empty host, an underlay latency keyed by anything but a link index or out of
[0, 10) s, an unknown field and tunnels that are not a list are refused, the field named. Pure."""

from __future__ import annotations

import copy

import pytest

from test_state_schema import NAME, TOPO, synthetic_state
from testbed.cluster.part import make_parts
from testbed.state_schema import check
from testbed.topology.loader import load_topology_text
from testbed.topology.plan import plan_network


@pytest.fixture(scope="module")
def tbdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("state") / NAME
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def with_part(tbdir) -> dict:
    topo = load_topology_text(TOPO, "<part test>")
    host_of = {"w0": "a", "w1": "a", "s0": "a", "w2": "b"}
    parts = make_parts(NAME, topo, plan_network(topo), host_of, {"a": "198.18.9.1", "b": "198.18.9.2"},
                       {frozenset(("a", "b")): 4e-5})
    st = synthetic_state(tbdir)
    st["part"] = parts["a"].to_json()
    assert st["part"]["tunnels"] and st["part"]["underlay_s"]   # a cut link: w2-s0
    return st


def test_the_part_up_writes_validates(with_part, tbdir):
    assert check(with_part, NAME, tbdir) == []


@pytest.mark.parametrize("change, field", [
    (lambda p: p["nodes"].append("w9"), "part.nodes[3]"),
    (lambda p: p.update(host=""), "part.host"),
    (lambda p: p.update(host=7), "part.host"),
    (lambda p: p.update(nodes="w0"), "part.nodes"),
    (lambda p: p.update(tunnels={}), "part.tunnels"),
    (lambda p: p["tunnels"].append("a tunnel"), "part.tunnels[1]"),
    (lambda p: p.update(underlay_s={"x": 0.1}), "part.underlay_s.x"),
    (lambda p: p.update(underlay_s={"2": 10}), "part.underlay_s.2"),
    (lambda p: p.update(underlay_s={"2": True}), "part.underlay_s.2"),
    (lambda p: p.update(extra=1), "part.extra"),
    (lambda p: p.pop("host"), "part.host"),
])
def test_a_wrong_part_is_refused_by_field(with_part, tbdir, change, field):
    st = copy.deepcopy(with_part)
    change(st["part"])
    found = check(st, NAME, tbdir)
    assert found and found[0][0] == field, found
