"""Scenario files: parsing, validation against a topology and planning (pure: no kernel)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed.faults.scenario import ScenarioError, parse_link_changes
from testbed.faults.scenario_loader import load_scenario, scenario_from_data
from testbed.faults.scenario_planner import plan_scenario
from testbed.topology.loader import load_topology
from testbed.topology.plan import NextHop, Route

REPO = Path(__file__).resolve().parent.parent
ISSUE_EXAMPLE = """
name: core-flap
seed: 7
job:
  workers: all
  command: python examples/train_ddp.py --steps 300
events:
  - at: 10s
    link: [agg0-0, core0]
    action: down
    for: 5s
  - at: 20s
    link: [edge1-0, agg1-0]
    action: flap
    every: 2s
    count: 5
  - at: 30s
    link: {tier: agg-core, pick: random}
    set: {loss: 2%}
    for: 10s
  - at: 45s
    node: core1
    action: down
"""


@pytest.fixture(scope="module")
def fat_tree():
    return load_topology("fat-tree")


@pytest.fixture(scope="module")
def star():
    return load_topology("star")


def scen(text_or_data, source="s.yaml"):
    data = yaml.safe_load(text_or_data) if isinstance(text_or_data, str) else text_or_data
    return scenario_from_data(data, source)


def base(*events, **job):
    return {"name": "t", "seed": 1, "job": {"workers": "all", "command": "true", **job}, "events": list(events)}


def plan_of(topo, *events, seed=1, **kw):
    data = base(*events)
    data["seed"] = seed
    return plan_scenario(scen(data), topo, **kw)


# -- the issue's example ---------------------------------------------------------------------------------------


def test_issue_example_plan(fat_tree):
    plan = plan_scenario(scen(ISSUE_EXAMPLE), fat_tree)
    ops = [(s.t, s.op, s.target, s.revert) for s in plan.steps]
    assert ops[0] == (10.0, "link_down", ("agg0-0", "core0"), False)
    assert ops[1] == (15.0, "link_up", ("agg0-0", "core0"), True)
    flap = [o for o in ops if o[2] == ("edge1-0", "agg1-0")]
    assert [o[0] for o in flap] == [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    assert [o[1] for o in flap] == ["link_down", "link_up"] * 5
    sets = [s for s in plan.steps if s.op in ("link_set", "link_restore")]
    assert [s.t for s in sets] == [30.0, 40.0]
    assert sets[0].target == sets[1].target
    assert fat_tree.link_between(*sets[0].target).tier == "agg-core"
    assert dict(sets[0].kwargs["changes"]) == {"loss": 0.02}
    assert sets[1].kwargs["fields"] == ("loss",)
    assert ops[-1] == (45.0, "node_down", ("core1",), False)
    assert plan.workers == fat_tree.workers
    text = plan.format()
    assert "link down agg0-0 core0" in text and "(revert)" in text


def test_plan_is_deterministic(fat_tree):
    texts = {plan_scenario(scen(ISSUE_EXAMPLE), fat_tree).format() for _ in range(5)}
    assert len(texts) == 1
    # ... and across processes (no dependence on hash randomisation)
    code = ("from testbed.faults.scenario_loader import *; from testbed.faults.scenario_planner import *; "
            "import yaml, sys; "
            "from testbed.topology.loader import load_topology; "
            f"print(plan_scenario(scenario_from_data(yaml.safe_load({ISSUE_EXAMPLE!r}), 's.yaml'), "
            "load_topology('fat-tree')).format())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                           env={"PYTHONHASHSEED": str(i), "PATH": "/usr/bin:/bin"}).stdout for i in range(2)}
    assert len(outs) == 1 and texts.pop() in outs.pop()


def test_seed_changes_random_picks(fat_tree):
    ev = {"at": "1s", "link": {"tier": "agg-core", "pick": "random"}, "action": "down"}
    picks = {plan_of(fat_tree, ev, seed=s).steps[0].target for s in range(20)}
    assert len(picks) > 1
    assert all(fat_tree.link_between(*p).tier == "agg-core" for p in picks)


def test_pick_count_and_all(fat_tree):
    p = plan_of(fat_tree, {"at": 0, "link": {"tier": "agg-core", "pick": 3}, "action": "down"})
    assert len({s.target for s in p.steps}) == 3
    p = plan_of(fat_tree, {"at": 0, "link": {"node": "core0", "pick": "all"}, "action": "down"})
    assert {s.target for s in p.steps} == {(l.a, l.b) for l in fat_tree.links_of("core0")}
    p = plan_of(fat_tree, {"at": 0, "node": {"kind": "worker", "pick": "random", "exclude": ["w0"]},
                           "action": "crash"})
    assert p.steps[0].op == "node_crash" and p.steps[0].target[0] != "w0"


def test_dilation_scales_wall_time(star):
    p = plan_of(star, {"at": "2s", "link": ["w0", "s0"], "action": "down", "for": "1s"}, dilation=3)
    assert [p.wall(s) for s in p.steps] == [6.0, 9.0]
    assert "dilation 3" in p.format()


def test_plan_json_roundtrip_shape(fat_tree):
    import json

    data = plan_scenario(scen(ISSUE_EXAMPLE), fat_tree).to_json()
    json.dumps(data)
    assert data["steps"][0]["what"] == "link down agg0-0 core0"


# -- every kind of event ---------------------------------------------------------------------------------------


def test_set_direction_and_restore(star):
    p = plan_of(star, {"at": "1s", "link": ["w1", "s0"], "set": {"bandwidth": "100mbit", "delay": "1ms"},
                       "direction": "B->A", "for": "2s"})
    s, r = p.steps
    assert s.op == "link_set" and s.kwargs["direction"] == "B->A"
    assert dict(s.kwargs["changes"]) == {"bandwidth_bps": 100_000_000, "delay_s": 0.001}
    assert r.op == "link_restore" and r.t == 3.0 and set(r.kwargs["fields"]) == {"bandwidth_bps", "delay_s"}
    assert "bandwidth=100mbit delay=1ms (B->A)" in s.describe()


def test_node_events(star):
    p = plan_of(star,
                {"at": "1s", "node": "w1", "action": "crash"},
                {"at": "2s", "node": "w2", "action": "slow", "cpus": 0.2, "for": "3s"},
                {"at": "3s", "node": "s0", "action": "down", "for": "1s"},
                {"at": "9s", "node": "w1", "action": "up"})
    ops = [(s.t, s.op, s.target) for s in p.steps]
    assert (1.0, "node_crash", ("w1",)) in ops
    assert (2.0, "node_slow", ("w2",)) in ops and (5.0, "node_restore", ("w2",)) in ops
    assert (3.0, "node_down", ("s0",)) in ops and (4.0, "node_up", ("s0",)) in ops
    assert (9.0, "node_up", ("w1",)) in ops


def test_partition_and_heal(star):
    p = plan_of(star, {"at": "1s", "partition": [["w0", "w1"]], "for": "2s"},
                {"at": "5s", "partition": ["w0", "w1,w2"]}, {"at": "6s", "heal": True})
    assert p.steps[0].kwargs["groups"] == (("w0", "w1"), ("w2", "w3"))
    assert p.steps[1].op == "heal" and p.steps[1].revert
    assert p.steps[2].kwargs["groups"] == (("w0",), ("w1", "w2"), ("w3",))
    assert p.steps[3].op == "heal"


def test_partition_switch_expands_to_its_workers(fat_tree):
    p = plan_of(fat_tree, {"at": 0, "partition": [["edge0-0", "edge0-1"]]})
    assert p.steps[0].kwargs["groups"][0] == ("w0", "w1", "w2", "w3")


def test_revert_before_new_event_at_same_time(star):
    p = plan_of(star, {"at": "2s", "link": ["w0", "s0"], "action": "down"},
                {"at": "1s", "link": ["w0", "s0"], "action": "down", "for": "1s"})
    assert [(s.t, s.op) for s in p.steps] == [(1, "link_down"), (2, "link_up"), (2, "link_down")]


def test_job_workers(star):
    assert plan_scenario(scen(base(workers=2)), star).workers == ["w0", "w1"]
    assert plan_scenario(scen(base(workers=["w3", "w1"])), star).workers == ["w3", "w1"]
    assert plan_scenario(scen(base(workers="w0,w2")), star).workers == ["w0", "w2"]


def test_job_phantoms(star):
    """phantoms: true makes the first worker real and the others phantoms; real: names the real ones."""
    p = plan_scenario(scen(base(phantoms=True)), star)
    assert p.job.resolve_real(p.workers) == ["w0"] and "(w0 real, 3 phantom(s))" in p.format()
    p = plan_scenario(scen(base(workers=["w3", "w1", "w2"], phantoms=True)), star)
    assert p.job.resolve_real(p.workers) == ["w3"]
    p = plan_scenario(scen(base(real="w1,w2")), star)
    assert p.job.resolve_real(p.workers) == ["w1", "w2"] and p.to_json()["job"]["phantoms"] is True
    p = plan_scenario(scen(base()), star)
    assert p.job.resolve_real(p.workers) is None and p.to_json()["job"]["phantoms"] is False


@pytest.mark.parametrize("job,path,reason", [
    ({"phantoms": "yes"}, "job.phantoms", "true or false"),
    ({"real": ["w0"], "phantoms": False}, "job.phantoms", "cannot go with phantoms: false"),
    ({"real": []}, "job.real", "empty list"),
    ({"real": ["w0", "w9"]}, "job.real", "not one of the job's workers"),
    ({"workers": 2, "real": ["w2"]}, "job.real", "not one of the job's workers"),
    ({"workers": 2, "real": ["w0", "w1"]}, "job.real", "no phantom is left"),
])
def test_refused_job_phantoms(star, job, path, reason):
    with pytest.raises(ScenarioError, match=reason) as ei:
        plan_scenario(scen(base(**job)), star)
    assert ei.value.path == path


def test_non_overlapping_events_on_one_link_are_fine(star):
    plan_of(star, {"at": "1s", "link": ["w0", "s0"], "action": "down", "for": "1s"},
            {"at": "3s", "link": ["w0", "s0"], "action": "flap", "every": "1s", "count": 2},
            {"at": "3s", "link": ["w0", "s0"], "set": {"delay": "1ms"}, "for": "5s"},
            {"at": "4s", "link": ["w0", "s0"], "set": {"loss": "1%"}, "for": "5s"},
            {"at": "20s", "link": ["w0", "s0"], "action": "reset"})


# -- refused, naming the field ---------------------------------------------------------------------------------


@pytest.mark.parametrize("event,path,reason", [
    ({"at": "1s", "link": ["w0", "nosuch"], "action": "down"}, "events[0].link", "unknown node"),
    ({"at": "1s", "link": ["w0", "w1"], "action": "down"}, "events[0].link", "no such link"),
    ({"at": "1s", "node": "w9", "action": "down"}, "events[0].node", "unknown node"),
    ({"at": "1s", "node": "s0", "action": "crash"}, "events[0].node", "workers only"),
    ({"at": "1s", "link": {"tier": "core"}, "action": "down"}, "events[0].link.tier", "unknown tier"),
    ({"at": "1s", "partition": [["w0", "zz"]]}, "events[0].partition[0][1]", "unknown node"),
    ({"at": "1s", "partition": [["w0"], ["w0", "w1"]]}, "events[0].partition[1][0]", "two groups"),
])
def test_refused_against_topology(star, event, path, reason):
    with pytest.raises(ScenarioError, match=reason) as ei:
        plan_of(star, event)
    assert ei.value.path == path
    assert ei.value.file == "s.yaml"
    assert ei.value.exit_code == 2


@pytest.mark.parametrize("event,path,reason", [
    ({"at": "10 parsecs", "link": ["w0", "s0"], "action": "down"}, "events[0].at", "unknown time unit"),
    ({"link": ["w0", "s0"], "action": "down"}, "events[0].at", "needs a time"),
    ({"at": "1s", "link": ["w0", "s0"], "set": {"loss": "200%"}}, "events[0].set.loss", "between 0% and 100%"),
    ({"at": "1s", "link": ["w0", "s0"], "set": {"bandwidth": "10 gigs"}}, "events[0].set.bandwidth", "unit"),
    ({"at": "1s", "link": ["w0", "s0"], "set": {"delay": "-1ms"}}, "events[0].set.delay", "negative"),
    ({"at": "1s", "link": ["w0", "s0"], "set": {"mtu": 9000}}, "events[0].set.mtu", "unknown field"),
    ({"at": "1s", "link": ["w0", "s0"], "set": {"queue": 0}}, "events[0].set.queue", "positive"),
    ({"at": "1s", "link": ["w0", "s0"], "set": {"loss": "1%"}, "direction": "up"}, "events[0].direction",
     "direction"),
    ({"at": "1s", "link": ["w0", "s0"], "action": "explode"}, "events[0].action", "link action"),
    ({"at": "1s", "link": ["w0", "s0"], "action": "down", "for": "0s"}, "events[0].for", "positive"),
    ({"at": "1s", "link": ["w0", "s0"], "action": "flap", "count": 2}, "events[0].every", "flap needs"),
    ({"at": "1s", "link": ["w0", "s0"], "action": "flap", "every": "1s", "count": 0}, "events[0].count", ">= 1"),
    ({"at": "1s", "link": ["w0", "s0"], "action": "flap", "every": "1s", "count": 2, "down_for": "2s"},
     "events[0].down_for", "shorter"),
    ({"at": "1s", "link": ["w0", "s0"], "action": "down", "cpus": 1}, "events[0].cpus", "does not apply"),
    ({"at": "1s", "link": ["w0"], "action": "down"}, "events[0].link", "[A, B]"),
    ({"at": "1s", "node": "w0", "action": "slow"}, "events[0].cpus", "cpus"),
    ({"at": "1s", "node": "w0", "action": "slow", "cpus": "lots"}, "events[0].cpus", "cpus"),
    ({"at": "1s", "link": ["w0", "s0"], "node": "w0", "action": "down"}, "events[0]", "exactly one"),
    ({"at": "1s", "heal": "yes"}, "events[0].heal", "heal: true"),
    ({"at": "1s", "lnik": ["w0", "s0"]}, "events[0].lnik", "unknown field"),
])
def test_refused_shape(event, path, reason):
    with pytest.raises(ScenarioError, match=reason) as ei:
        scen(base(event))
    assert ei.value.path == path


@pytest.mark.parametrize("data,path", [
    ({"seed": 1, "job": {"command": "x"}}, "name"),
    ({"name": "x", "seed": "seven", "job": {"command": "x"}}, "seed"),
    ({"name": "x", "job": {"workers": "all"}}, "job.command"),
    ({"name": "x"}, "job"),
    ({"name": "x", "job": {"command": "x", "timeout": "soon"}}, "job.timeout"),
    ({"name": "x", "job": {"command": "x", "workers": 0}}, "job.workers"),
    ({"name": "x", "job": {"command": "x"}, "extra": 1}, "extra"),
    ({"name": "x", "job": {"command": "x"}, "events": {"at": 1}}, "events"),
])
def test_refused_top_level(data, path):
    with pytest.raises(ScenarioError) as ei:
        scen(data)
    assert ei.value.path == path


def test_unknown_job_worker(star):
    with pytest.raises(ScenarioError, match="unknown worker") as ei:
        plan_scenario(scen(base(workers=["w0", "w7"])), star)
    assert ei.value.path == "job.workers"
    with pytest.raises(ScenarioError, match="only 4 workers"):
        plan_scenario(scen(base(workers=9)), star)
    with pytest.raises(ScenarioError, match="not a worker"):
        plan_scenario(scen(base(workers=["s0"])), star)


@pytest.mark.parametrize("events,second", [
    # down for 5s, and an up inside that window
    ([{"at": "1s", "link": ["w0", "s0"], "action": "down", "for": "5s"},
      {"at": "3s", "link": ["s0", "w0"], "action": "up"}], "events[1]"),
    # a flap over a down
    ([{"at": "1s", "link": ["w0", "s0"], "action": "flap", "every": "1s", "count": 4},
      {"at": "2s", "link": ["w0", "s0"], "action": "down", "for": "1s"}], "events[1]"),
    # two loss settings at once
    ([{"at": "1s", "link": ["w0", "s0"], "set": {"loss": "1%"}, "for": "5s"},
      {"at": "2s", "link": ["w0", "s0"], "set": {"loss": "2%", "delay": "1ms"}, "for": "1s"}], "events[1]"),
    # a reset inside a set's window
    ([{"at": "1s", "link": ["w0", "s0"], "set": {"delay": "1ms"}, "for": "5s"},
      {"at": "2s", "link": ["w0", "s0"], "action": "reset"}], "events[1]"),
    # a switch down while one of its links is brought up
    ([{"at": "1s", "node": "s0", "action": "down", "for": "5s"},
      {"at": "2s", "link": ["w2", "s0"], "action": "up"}], "events[1]"),
    # two downs of one link at the same instant
    ([{"at": "1s", "link": ["w0", "s0"], "action": "down"},
      {"at": "1s", "link": ["w0", "s0"], "action": "up"}], "events[1]"),
    # overlapping partitions
    ([{"at": "1s", "partition": [["w0"]], "for": "5s"}, {"at": "2s", "partition": [["w1"]]}], "events[1]"),
    ([{"at": "1s", "node": "w1", "action": "slow", "cpus": 0.5, "for": "5s"},
      {"at": "2s", "node": "w1", "action": "slow", "cpus": 0.1}], "events[1]"),
])
def test_refused_contradictions(star, events, second):
    with pytest.raises(ScenarioError, match="contradicts events\\[0\\]") as ei:
        plan_of(star, *events)
    assert ei.value.path == second


def test_compatible_overlaps(star):
    # different fields, or opposite directions, on one link at once: fine
    plan_of(star, {"at": "1s", "link": ["w0", "s0"], "set": {"loss": "1%"}, "for": "5s"},
            {"at": "2s", "link": ["w0", "s0"], "set": {"delay": "1ms"}, "for": "5s"},
            {"at": "2s", "link": ["w0", "s0"], "action": "down", "for": "1s"})
    plan_of(star, {"at": "1s", "link": ["w0", "s0"], "set": {"loss": "1%"}, "direction": "A->B", "for": "5s"},
            {"at": "2s", "link": ["s0", "w0"], "set": {"loss": "2%"}, "direction": "A->B", "for": "5s"})
    with pytest.raises(ScenarioError):  # s0->w0 twice
        plan_of(star, {"at": "1s", "link": ["w0", "s0"], "set": {"loss": "1%"}, "direction": "B->A", "for": "5s"},
                {"at": "2s", "link": ["s0", "w0"], "set": {"loss": "2%"}, "direction": "A->B", "for": "5s"})


def test_parse_link_changes_for_cli():
    assert parse_link_changes({"bandwidth": "1gbit", "loss": "0.5%", "queue": "100"}) == \
        {"bandwidth_bps": 10**9, "loss": 0.005, "queue": 100}
    with pytest.raises(ScenarioError, match="nothing to set"):
        parse_link_changes({})


def test_load_scenario_file_errors(tmp_path):
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nname: y\n")
    with pytest.raises(ScenarioError, match="duplicate key") as ei:
        load_scenario(bad)
    assert ei.value.file == str(bad)


# -- the shipped examples --------------------------------------------------------------------------------------


EXAMPLES = sorted((REPO / "scenarios").glob("*.yaml"))


def test_examples_exist():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_plans(path):
    s = load_scenario(path)
    assert s.topology, "every example names the topology it was written for"
    topo = s.load_topology()
    p1 = plan_scenario(s, topo)
    p2 = plan_scenario(load_scenario(path), topo)
    assert p1.to_json() == p2.to_json()
    assert p1.steps, "an example does something"
    assert p1.end_s <= 30, "examples are short (CI plays them)"
    assert s.job.timeout_s <= 180


# -- reconvergence after link failures (pure part of testbed.faults.control) ----------------------------------


def test_tables_after_link_down_avoid_dead_links(fat_tree):
    from testbed.topology.plan import plan_network

    plan = plan_network(fat_tree)
    base = plan.next_hops(set())
    dead = fat_tree.link_index("agg0-0", "core0")
    after = plan.next_hops({dead})
    pod0 = [plan.subnets[e].network for e in ("edge0-0", "edge0-1")]
    # core0 lost its direct way into pod 0 (it goes round through another pod now) ...
    core0_down = next(lp for lp in plan.links if lp.index == dead).port("core0").ifname
    assert all([h.ifname for h in base["core0"][n]] == [core0_down] for n in pod0)
    assert all(after["core0"][n] and core0_down not in [h.ifname for h in after["core0"][n]] for n in pod0)
    # ... so pod 1's agg0 (agg1-0, joined to core0 and core1) no longer sends pod-0 traffic to core0
    core0_port = next(lp for lp in plan.links
                      if {lp.a.node, lp.b.node} == {"agg1-0", "core0"}).port("agg1-0").ifname
    for n in pod0:
        assert base["agg1-0"][n] and any(h.ifname == core0_port for h in base["agg1-0"][n])
        assert after["agg1-0"][n] and all(h.ifname != core0_port for h in after["agg1-0"][n])
    # every other switch still reaches every subnet (the fat-tree has other paths)
    assert all(hops for s, table in after.items() if s != "core0" for hops in table.values())
    # the installed tables: nothing down is the plan's; after, core0's default takes pod 0 round
    assert plan.switch_routes(set()) == {s: plan.routes[s] for s in fat_tree.switches}
    [default] = [r for r in plan.switch_routes({dead})["core0"] if r.dst == "10.0.0.0/16"]
    assert default.nexthops == after["core0"][pod0[0]]


def test_route_changes_replace_what_differs_and_delete_what_vanished():
    from testbed.faults.link_admin import route_changes

    a, b = NextHop("10.255.0.1", "eth1"), NextHop("10.255.0.3", "eth2")
    old = [Route("default", (a, b)), Route("10.0.2.0/23", (a,)), Route("10.0.4.0/24", ())]
    new = [Route("default", (b,)), Route("10.0.2.0/23", (a,)), Route("10.0.6.0/23", (a,))]
    assert route_changes(old, new) == ([Route("default", (b,)), Route("10.0.6.0/23", (a,))], ["10.0.4.0/24"])
    assert route_changes(new, new) == ([], [])
    assert route_changes([], new) == (new, [])
