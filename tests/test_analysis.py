"""testbed.topology.analysis: counts, tiers, bisection, oversubscription, ECMP."""

from __future__ import annotations

import pytest

from testbed.topology import analysis as A
from testbed.topology.loader import load_topology, load_topology_text
from testbed.topology.plan import plan_network


def test_counts_and_tiers_fat_tree():
    topo = load_topology("fat-tree")
    assert A.counts(topo) == {"workers": 16, "switches": 20, "links": 48, "tiers": 3, "gpus": 0}
    rows = A.tier_rows(topo)
    assert [r.tier for r in rows] == ["host", "edge-agg", "agg-core"]
    assert rows[0].cells() == ["host", "16", "10gbit", "2us", "0s", "0", "auto", "1500"]


def test_tier_rows_show_mixed_values():
    topo = load_topology("two-racks")
    fabric = next(r for r in A.tier_rows(topo) if r.tier == "fabric")
    assert fabric.bandwidth == "40gbit"
    assert fabric.delay == "5us, 10us"
    assert fabric.loss == "0, 0.01%"
    assert fabric.queue == "auto, 2000"


@pytest.mark.parametrize("k", [2, 4, 6, 8])
def test_fat_tree_bisection_formula_and_heuristic_agree(k):
    topo = load_topology("fat-tree", [f"params.k={k}"])
    b = A.bisection(topo)
    assert b.method == "formula" and b.exact
    assert b.bps == k ** 3 / 8 * 10e9
    assert b.per_worker_bps == 10e9  # full bisection
    computed = A.bisection(topo, method="heuristic" if k > 2 else "exhaustive")
    assert computed.bps == b.bps


def test_fat_tree_bisection_slowest_tier():
    topo = load_topology("fat-tree", ["tiers.agg-core.bandwidth=1gbit"])
    assert A.bisection(topo).bps == 8 * 1e9
    assert A.bisection(topo, method="heuristic").bps == 8 * 1e9


@pytest.mark.parametrize("over", [None, 2, 4])
def test_leaf_spine_bisection(over):
    sets = [] if over is None else [f"params.oversubscription={over}"]
    topo = load_topology("leaf-spine", sets)
    b = A.bisection(topo)
    assert b.method == "formula"
    expected = 8 * 10e9 if over is None else 8 * 10e9 / over
    assert b.bps == pytest.approx(expected)
    assert A.bisection(topo, method="heuristic").bps == pytest.approx(expected)


def test_dumbbell_and_star_exhaustive():
    b = A.bisection(load_topology("dumbbell"))
    assert (b.bps, b.method, b.exact) == (1e9, "exhaustive", True)
    assert {frozenset(h) for h in b.halves} == {frozenset({"w0", "w1"}), frozenset({"w2", "w3"})}
    assert A.bisection(load_topology("star")).bps == 2 * 10e9
    odd = load_topology("dumbbell", ["params.left=2", "params.right=3"])
    assert A.bisection(odd).bps == 1e9


def test_unshaped_bisection_is_none():
    topo = load_topology_text("""
name: flat
nodes: {a: {kind: worker}, b: {kind: worker}, s: {kind: switch}}
links: [{endpoints: [a, s]}, {endpoints: [b, s]}]
""")
    assert A.bisection(topo).bps is None


def test_asymmetric_link_counts_its_slower_direction():
    topo = load_topology_text("""
name: asym
nodes: {a: {kind: worker}, b: {kind: worker}, s: {kind: switch}, t: {kind: switch}}
links:
  - {endpoints: [a, s], bandwidth: 10gbit}
  - {endpoints: [b, t], bandwidth: 10gbit}
  - {endpoints: [s, t], bandwidth: 10gbit, reverse: {bandwidth: 1gbit}}
""")
    assert A.bisection(topo).bps == 1e9


def test_oversubscription():
    rows = A.oversubscription(load_topology("fat-tree"))
    assert [(r.layer, len(r.switches), r.ratio) for r in rows] == [(1, 8, 1.0), (2, 8, 1.0), (3, 4, None)]
    assert rows[0].down_tiers == ("host",) and rows[0].up_tiers == ("edge-agg",)
    rows = A.oversubscription(load_topology("leaf-spine", ["params.oversubscription=3"]))
    assert rows[0].ratio == pytest.approx(3.0) and rows[0].max_ratio == pytest.approx(3.0)
    assert rows[1].ratio is None
    rows = A.oversubscription(load_topology("leaf-spine"))
    assert rows[0].ratio == pytest.approx(0.5)   # 4 x 10gbit down, 2 x 40gbit up
    # a dumbbell's bottleneck is a sideways link: 2 x 10gbit over 1gbit
    [row] = A.oversubscription(load_topology("dumbbell"))
    assert row.ratio == pytest.approx(20.0)


def test_ecmp_summary_matches_the_plan():
    for spec in ("fat-tree", "leaf-spine", "dumbbell", "two-racks"):
        topo = load_topology(spec)
        plan = plan_network(topo)
        summary = A.ecmp_summary(topo)
        acc = A.access_switch(topo)
        expected: dict[int, int] = {}
        same = 0
        ws = topo.workers
        for i, a in enumerate(ws):
            for b in ws[i + 1:]:
                if acc[a] == acc[b]:
                    same += 1
                else:
                    n = plan.ecmp_paths(a, b)
                    expected[n] = expected.get(n, 0) + 1
        assert summary.histogram == expected, spec
        assert summary.same_switch_pairs == same
    ft = A.ecmp_summary(load_topology("fat-tree"))
    assert ft.histogram == {2: 16, 4: 96} and (ft.min, ft.max) == (2, 4)


def test_describe_is_json_ready():
    import json

    doc = A.describe(load_topology("fat-tree"))
    json.dumps(doc)
    assert doc["bisection"]["bps"] == 80e9 and doc["ecmp"]["max"] == 4


def test_layers():
    layers = A.switch_layers(load_topology("fat-tree"))
    assert layers["w0"] == 0 and layers["edge0-0"] == 1 and layers["agg0-0"] == 2 and layers["core0"] == 3


def test_heuristic_is_fast_on_a_big_fabric():
    import time

    topo = load_topology("fat-tree", ["params.k=12"])  # 432 workers, 180 switches
    topo.generator = None
    t0 = time.monotonic()
    b = A.bisection(topo)
    assert b.method == "heuristic" and not b.exact
    assert b.bps == 12 ** 3 / 8 * 10e9
    assert time.monotonic() - t0 < 30
