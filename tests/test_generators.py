"""Generators: fixed node names, counts, wiring, parameter errors."""

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from testbed.errors import TopologyError
from testbed.topology.generators import GENERATORS
from testbed.topology.model import LinkProfile, Topology


def build(name, params=None, tiers=None, worker=None) -> Topology:
    nodes, links = GENERATORS[name].generate(params, tiers, worker)
    return Topology(name=name, nodes=nodes, links=links, generator=name).validate()


def test_registry():
    assert set(GENERATORS) == {"fat-tree", "leaf-spine", "dumbbell", "star"}
    assert GENERATORS["fat-tree"].tiers == ("host", "edge-agg", "agg-core")
    assert GENERATORS["leaf-spine"].tiers == ("host", "leaf-spine")
    assert GENERATORS["dumbbell"].tiers == ("host", "core")
    assert GENERATORS["star"].tiers == ("host",)
    for spec in GENERATORS.values():
        assert set(spec.tier_defaults) == set(spec.tiers)
        build(spec.name)  # defaults alone give a valid topology


def test_fat_tree_k4_names_and_wiring():
    t = build("fat-tree", {"k": 4})
    assert (len(t.workers), len(t.switches), len(t.links)) == (16, 20, 48)
    assert t.workers == [f"w{i}" for i in range(16)]
    assert t.switches[:4] == ["edge0-0", "edge0-1", "edge1-0", "edge1-1"]
    assert {f"agg{p}-{i}" for p in range(4) for i in range(2)} <= set(t.switches)
    assert {f"core{i}" for i in range(4)} <= set(t.switches)
    # workers numbered pod by pod, edge by edge
    assert t.neighbors("w0") == ["edge0-0"] and t.neighbors("w1") == ["edge0-0"]
    assert t.neighbors("w2") == ["edge0-1"] and t.neighbors("w4") == ["edge1-0"]
    # Al-Fares: core i joins agg{p}-{i // (k/2)} in every pod
    for i in range(4):
        assert sorted(t.neighbors(f"core{i}")) == sorted(f"agg{p}-{i // 2}" for p in range(4))
    assert sorted(t.neighbors("edge2-1")) == ["agg2-0", "agg2-1", "w10", "w11"]
    assert t.tiers() == ["host", "edge-agg", "agg-core"]
    assert all(link.ab == LinkProfile(bandwidth_bps=10**10, delay_s=2e-6) for link in t.links)


@settings(deadline=None, max_examples=8)
@given(st.integers(min_value=1, max_value=8).map(lambda h: 2 * h))
def test_fat_tree_counts_every_even_k(k):
    t = build("fat-tree", {"k": k})
    assert len(t.workers) == k**3 // 4
    assert len(t.switches) == 5 * k**2 // 4
    assert len(t.links) == 3 * k**3 // 4
    g = t.graph()
    assert nx.is_connected(g)
    # every switch port count is k (edge/agg/core), every worker has one link
    for s in t.switches:
        assert g.degree(s) == k
    assert all(g.degree(w) == 1 for w in t.workers)


@pytest.mark.parametrize("k", [2, 4, 6, 8, 10, 12, 14, 16])
def test_fat_tree_exhaustive_counts(k):
    t = build("fat-tree", {"k": k})
    assert (len(t.workers), len(t.switches), len(t.links)) == (k**3 // 4, 5 * k**2 // 4, 3 * k**3 // 4)


@pytest.mark.parametrize("params,path,value", [
    ({"k": 3}, "params.k", 3), ({"k": 0}, "params.k", 0), ({"k": -2}, "params.k", -2),
    ({"k": "4"}, "params.k", "4"), ({"k": 4.0}, "params.k", 4.0), ({"k": True}, "params.k", True),
    ({"pods": 4}, "params.pods", "pods"),
])
def test_fat_tree_bad_params(params, path, value):
    with pytest.raises(TopologyError) as e:
        build("fat-tree", params)
    assert e.value.path == path and e.value.value == value
    assert e.value.exit_code == 2


def test_leaf_spine_defaults():
    t = build("leaf-spine")
    assert t.workers == [f"w{i}" for i in range(16)]
    assert t.switches == [f"leaf{i}" for i in range(4)] + ["spine0", "spine1"]
    assert len(t.links) == 16 + 8
    assert t.neighbors("w5") == ["leaf1"]
    assert sorted(t.neighbors("spine1")) == [f"leaf{i}" for i in range(4)]


@settings(deadline=None)
@given(leaves=st.integers(1, 6), spines=st.integers(1, 4), hpl=st.integers(1, 8),
       ratio=st.floats(min_value=0.25, max_value=16), host_gbit=st.integers(1, 100))
def test_leaf_spine_oversubscription(leaves, spines, hpl, ratio, host_gbit):
    host = LinkProfile(bandwidth_bps=host_gbit * 10**9, delay_s=2e-6)
    t = build("leaf-spine", {"leaves": leaves, "spines": spines, "hosts_per_leaf": hpl, "oversubscription": ratio},
              tiers={"host": host})
    assert len(t.workers) == leaves * hpl and len(t.links) == leaves * hpl + leaves * spines
    for link in t.iter_links("leaf-spine"):
        for prof in (link.ab, link.ba):
            assert hpl * host.bandwidth_bps / (spines * prof.bandwidth_bps) == pytest.approx(ratio, rel=1e-6)
    assert nx.is_connected(t.graph())


@pytest.mark.parametrize("bad", [0, -1, "4", True, float("inf")])
def test_leaf_spine_bad_oversubscription(bad):
    with pytest.raises(TopologyError) as e:
        build("leaf-spine", {"oversubscription": bad})
    assert e.value.path == "params.oversubscription"


def test_leaf_spine_oversubscription_needs_host_bandwidth():
    with pytest.raises(TopologyError, match="host tier bandwidth"):
        build("leaf-spine", {"oversubscription": 2}, tiers={"host": LinkProfile()})


def test_dumbbell():
    t = build("dumbbell", {"left": 3, "right": 2})
    assert t.workers == ["w0", "w1", "w2", "w3", "w4"] and t.switches == ["s0", "s1"]
    assert [t.neighbors(w)[0] for w in t.workers] == ["s0", "s0", "s0", "s1", "s1"]
    core = t.link_between("s0", "s1")
    assert core.tier == "core" and core.ab.bandwidth_bps == 10**9
    assert len(t.links) == 6


def test_dumbbell_asymmetric_tier():
    up, down = LinkProfile(bandwidth_bps=10**9), LinkProfile(bandwidth_bps=10**8)
    t = build("dumbbell", tiers={"core": (up, down)})
    core = t.link_between("s0", "s1")
    assert (core.a, core.b) == ("s0", "s1") and core.ab == up and core.ba == down


def test_star_and_worker_defaults():
    t = build("star", {"n": 3}, worker={"gpus": 1, "cpus": 2, "memory_bytes": 2**30})
    assert t.workers == ["w0", "w1", "w2"] and t.switches == ["s0"]
    assert all(t.nodes[w].gpus == 1 and t.nodes[w].memory_bytes == 2**30 for w in t.workers)
    assert t.nodes["s0"].gpus == 0


@pytest.mark.parametrize("name,params,path", [
    ("star", {"n": 0}, "params.n"), ("star", {"k": 4}, "params.k"), ("dumbbell", {"left": 0}, "params.left"),
    ("leaf-spine", {"spines": 1.5}, "params.spines"), ("leaf-spine", {"hosts": 2}, "params.hosts"),
])
def test_bad_params(name, params, path):
    with pytest.raises(TopologyError) as e:
        build(name, params)
    assert e.value.path == path


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(["star", "dumbbell", "leaf-spine", "fat-tree"]), st.integers(1, 5), st.integers(1, 5))
def test_every_worker_reachable(name, x, y):
    params = {"star": {"n": x}, "dumbbell": {"left": x, "right": y},
              "leaf-spine": {"leaves": x, "spines": y, "hosts_per_leaf": x},
              "fat-tree": {"k": 2 * min(x, 3)}}[name]
    t = build(name, params)
    g = t.graph()
    w0 = t.workers[0]
    assert all(nx.has_path(g, w0, w) for w in t.workers)
    # names are unique and workers are w0..wN-1 in order
    assert t.workers == [f"w{i}" for i in range(len(t.workers))]
