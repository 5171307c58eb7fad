"""Scenario expectations (testbed.faults.expect): parsing, the facts of a run directory, judging,
JUnit XML, the exit status (pure logic: no kernel, no job)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from testbed.faults import expect as ex
from testbed.faults.expect import EventInfo, ExpectError, RunFacts, StepEnd, Window
from testbed.faults.scenario import ScenarioError
from testbed.faults.scenario_loader import scenario_from_data
from testbed.faults.scenario_planner import plan_scenario
from testbed.topology.loader import load_topology

REPO = Path(__file__).resolve().parent.parent

CONTRACT = """
name: contract
job: {workers: all, command: "true"}
events:
  - name: cut
    at: 10s
    partition: [[w0, w1], [w2, w3]]
    for: 15s
  - at: 40s
    node: w1
    action: crash
expect:
  - outcome: completed
  - recovers: {after: cut, within: 20s}
  - recovers: {after: event 2, within: 1500ms, workers: [w2, w3]}
  - slowdown: {during: cut, at_most: 3}
  - hang_detected: {within: 60s}
"""

EVENTS = [EventInfo("cut", True), EventInfo(None, False), EventInfo("flap", True)]


def parse(items, events=EVENTS):
    return ex.parse_expectations(items, events, file="s.yaml")


# -- parsing ------------------------------------------------------------------------------------------------


def test_the_contract_example_parses():
    s = scenario_from_data(yaml.safe_load(CONTRACT), "contract.yaml")
    e = s.expect
    assert [x.kind for x in e] == ["outcome", "recovers", "recovers", "slowdown", "hang_detected"]
    assert e[0].outcome == "completed"
    assert (e[1].event, e[1].event_label, e[1].within_s, e[1].workers) == (0, "cut", 20.0, None)
    assert (e[2].event, e[2].event_label, e[2].within_s, e[2].workers) == (1, "event 2", 1.5, ("w2", "w3"))
    assert (e[3].event, e[3].at_most, e[3].at_least) == (0, 3.0, None)
    assert e[4].within_s == 60.0
    # the item as written, for the console, scenario.json and JUnit
    assert [x.written for x in e] == ["outcome: completed", "recovers: {after: cut, within: 20s}",
                                      "recovers: {after: event 2, within: 1500ms, workers: [w2, w3]}",
                                      "slowdown: {during: cut, at_most: 3}", "hang_detected: {within: 60s}"]
    assert [x.path for x in e] == [f"expect[{i}]" for i in range(5)]
    assert s.events[0].name == "cut" and s.events[0].label == "cut" and s.events[1].label == "event 2"


def test_no_expect_block_is_no_expectations():
    data = yaml.safe_load(CONTRACT)
    del data["expect"]
    assert scenario_from_data(data).expect == ()
    assert parse(None) == ()


def test_event_n_and_names_resolve():
    e = parse([{"recovers": {"after": "Event  3", "within": "1s"}}, {"slowdown": {"during": "event 1",
                                                                                   "at_least": 2}}])
    assert (e[0].event, e[0].event_label) == (2, "flap")   # a named event is still "event N" too
    assert (e[1].event, e[1].event_label, e[1].at_least, e[1].at_most) == (0, "cut", 2.0, None)
    e = parse([{"slowdown": {"during": "cut", "at_least": 1.5, "at_most": 10, "workers": "w0, w1"}}])
    assert e[0].workers == ("w0", "w1")


@pytest.mark.parametrize("items,path,value", [
    ({"outcome": "completed"}, "expect", {"outcome": "completed"}),
    ([{"outcome": "completed", "recovers": {}}], "expect[0]", {"outcome": "completed", "recovers": {}}),
    (["outcome"], "expect[0]", "outcome"),
    ([{"outcome": "completed"}, {"finishes": True}], "expect[1].finishes", "finishes"),
    ([{"outcome": "finished"}], "expect[0].outcome", "finished"),
    ([{"recovers": "cut"}], "expect[0].recovers", "cut"),
    ([{"recovers": {"after": "cut"}}], "expect[0].recovers.within", None),
    ([{"recovers": {"within": "2s"}}], "expect[0].recovers.after", None),
    ([{"outcome": "hung"}, {"outcome": "hung"}, {"recovers": {"after": "cutt", "within": "2s"}}],
     "expect[2].recovers.after", "cutt"),
    ([{"recovers": {"after": "event 4", "within": "2s"}}], "expect[0].recovers.after", "event 4"),
    ([{"recovers": {"after": "event 0", "within": "2s"}}], "expect[0].recovers.after", "event 0"),
    ([{"recovers": {"after": 1, "within": "2s"}}], "expect[0].recovers.after", 1),
    ([{"recovers": {"after": "cut", "within": "soon"}}], "expect[0].recovers.within", "soon"),
    ([{"recovers": {"after": "cut", "within": "0s"}}], "expect[0].recovers.within", "0s"),
    ([{"recovers": {"after": "cut", "within": "-1s"}}], "expect[0].recovers.within", "-1s"),
    ([{"recovers": {"after": "cut", "within": "2s", "by": "w0"}}], "expect[0].recovers.by", "by"),
    ([{"recovers": {"after": "cut", "within": "2s", "workers": []}}], "expect[0].recovers.workers", []),
    ([{"recovers": {"after": "cut", "within": "2s", "workers": [1]}}], "expect[0].recovers.workers", [1]),
    ([{"slowdown": {"during": "event 2", "at_most": 3}}], "expect[0].slowdown.during", "event 2"),
    ([{"slowdown": {"during": "cut"}}], "expect[0].slowdown.at_most", None),
    ([{"slowdown": {"during": "cut", "at_most": "3x"}}], "expect[0].slowdown.at_most", "3x"),
    ([{"slowdown": {"during": "cut", "at_most": True}}], "expect[0].slowdown.at_most", True),
    ([{"slowdown": {"during": "cut", "at_most": 0}}], "expect[0].slowdown.at_most", 0),
    ([{"slowdown": {"during": "cut", "at_most": float("inf")}}], "expect[0].slowdown.at_most", float("inf")),
    ([{"slowdown": {"during": "cut", "at_most": 2, "at_least": 3}}], "expect[0].slowdown.at_least", 3),
    ([{"hang_detected": {}}], "expect[0].hang_detected.within", None),
    ([{"hang_detected": {"within": "1 fortnight"}}], "expect[0].hang_detected.within", "1 fortnight"),
    ([{"hang_detected": {"within": "9s", "after": "cut"}}], "expect[0].hang_detected.after", "after"),
])
def test_bad_items_are_refused_naming_path_and_value(items, path, value):
    with pytest.raises(ExpectError) as ei:
        parse(items)
    err = ei.value
    assert err.path == path and err.file == "s.yaml" and err.exit_code == 2
    if value is None:
        assert err.value is ExpectError._MISSING
    else:
        assert err.value == value
        assert repr(value) in str(err)
    assert str(err).startswith(f"s.yaml: {path}: ")


def test_an_unknown_event_lists_the_known_ones():
    with pytest.raises(ExpectError, match=r"name one of cut, event 2, flap"):
        parse([{"recovers": {"after": "nope", "within": "1s"}}])
    with pytest.raises(ExpectError, match=r"the file has no events"):
        parse([{"recovers": {"after": "event 1", "within": "1s"}}], events=[])


def _file_error(tmp_path, text):
    from testbed.faults.scenario_loader import load_scenario

    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ScenarioError) as ei:
        load_scenario(f)
    return ei.value, f


def test_a_bad_file_names_file_path_and_value(tmp_path):
    text = CONTRACT.replace("within: 20s}", "within: twenty}")
    err, f = _file_error(tmp_path, text)
    assert (err.file, err.path, err.value) == (str(f), "expect[1].recovers.within", "twenty")
    assert str(err).startswith(f"{f}: expect[1].recovers.within: ") and "'twenty'" in str(err)
    assert err.exit_code == 2


@pytest.mark.parametrize("name,path,why", [
    ("event 2", "events[0].name", "a word"),
    ("event2", "events[0].name", "event N"),
    (7, "events[0].name", "a word"),
    ("a b", "events[0].name", "a word"),
    ("cut\n", "events[0].name", "a word"),   # ($ would let the newline through: \Z does not)
])
def test_bad_event_names(tmp_path, name, path, why):
    data = yaml.safe_load(CONTRACT)
    data["events"][0]["name"] = name
    data["expect"] = []
    with pytest.raises(ScenarioError, match=why) as ei:
        scenario_from_data(data, "s.yaml")
    assert (ei.value.path, ei.value.value) == (path, name)


def test_event_names_are_unique():
    data = yaml.safe_load(CONTRACT)
    data["events"][1]["name"] = "cut"
    with pytest.raises(ScenarioError, match=r"two events are named 'cut' \(the first: events\[0\]\)") as ei:
        scenario_from_data(data, "s.yaml")
    assert ei.value.path == "events[1].name"


def test_a_name_goes_with_every_kind_of_event():
    data = yaml.safe_load(CONTRACT)
    data["events"] += [{"name": "f", "at": "50s", "link": ["edge0-0", "agg0-0"], "action": "flap", "every": "2s",
                        "count": 2},
                       {"name": "h", "at": "60s", "heal": True},
                       {"name": "l", "at": "70s", "link": ["edge0-0", "agg0-0"], "set": {"loss": "1%"}}]
    data["expect"] = [{"slowdown": {"during": "f", "at_most": 2}}]   # a flap lasts (down, then up again)
    s = scenario_from_data(data, "s.yaml")
    assert [e.name for e in s.events] == ["cut", None, "f", "h", "l"]


def test_plan_checks_the_workers_of_an_expectation():
    topo = load_topology("fat-tree")
    data = yaml.safe_load(CONTRACT)
    data["expect"] = [{"recovers": {"after": "cut", "within": "1s", "workers": ["w0", "w99"]}}]
    with pytest.raises(ScenarioError, match="not one of the job's workers") as ei:
        plan_scenario(scenario_from_data(data, "s.yaml"), topo)
    assert (ei.value.path, ei.value.value) == ("expect[0].recovers.workers[1]", "w99")
    data["job"]["phantoms"] = True
    data["expect"] = [{"slowdown": {"during": "cut", "at_most": 2, "workers": ["w1"]}}]
    with pytest.raises(ScenarioError, match="phantoms record no steps") as ei:
        plan_scenario(scenario_from_data(data, "s.yaml"), topo)
    assert ei.value.path == "expect[0].slowdown.workers[0]"
    data["expect"] = [{"slowdown": {"during": "cut", "at_most": 2, "workers": ["w0"]}}]
    plan = plan_scenario(scenario_from_data(data, "s.yaml"), topo)
    assert plan.to_json()["expect"][0] == {"kind": "slowdown", "written": "slowdown: {during: cut, at_most: 2, "
                                           "workers: [w0]}", "event": 0, "event_label": "cut", "at_most": 2.0,
                                           "workers": ["w0"]}
    text = plan.format()
    assert "expectations (1), judged after the run:" in text and "  - slowdown: {during: cut" in text
    assert "partition w0,w1 | w2,w3" in text and "(cut)" in text


def test_every_example_scenario_states_its_expectations():
    from testbed.faults.scenario_loader import load_scenario

    files = sorted((REPO / "scenarios").glob("*.yaml"))
    assert files
    for f in files:
        s = load_scenario(f)
        assert s.expect, f"{f.name} has no expect: block"


# -- judging ------------------------------------------------------------------------------------------------


def steps_every(period, start, end, rank="0", worker="w0"):
    """A rank's steps ending every `period` s in [start, end] (its first has no start)."""
    out, prev, t = [], None, start
    while t <= end + 1e-9:
        out.append(StepEnd(rank, worker, t, prev))
        prev, t = t, t + period
    return out


def facts(steps=(), windows=None, outcome="completed", **kw):
    return RunFacts(outcome=outcome, steps=list(steps), windows=windows or {0: Window(2, 2, 10.0, 25.0)}, **kw)


def one(item, f, events=EVENTS):
    (v,) = ex.judge(parse([item], events), f)
    return v


def test_outcome():
    v = one({"outcome": "completed"}, facts())
    assert (v.ok, v.measured, v.detail) == (True, None, "outcome completed")
    v = one({"outcome": "completed"}, facts(outcome="failed", error="RuntimeError: boom"))
    assert v.ok is False and v.detail == "outcome failed (RuntimeError: boom), not completed"


def test_recovers_met_and_not_met():
    # steps every 0.5 s until the cut (10 s), nothing during it, then from 27.5 s on
    steps = steps_every(0.5, 0, 10) + [StepEnd("0", "w0", 27.5, 10.0)] + steps_every(0.5, 28, 30)[1:]
    v = one({"recovers": {"after": "cut", "within": "3s"}}, facts(steps))
    assert v.ok is True and v.measured == pytest.approx(2.5)
    assert v.detail == "a step completed 2.50s after cut ended at 25.00s (within 3s)"
    v = one({"recovers": {"after": "cut", "within": "2s"}}, facts(steps))
    assert v.ok is False and v.measured == pytest.approx(2.5)


def test_recovers_with_no_step_after_the_event():
    v = one({"recovers": {"after": "cut", "within": "3s"}}, facts(steps_every(0.5, 0, 12), outcome="hung"))
    assert v.ok is False and v.measured is None
    assert v.detail == "no step completed after cut ended at 25.00s (the last at 12.00s; outcome hung)"


def test_recovers_counts_only_the_named_workers():
    steps = steps_every(0.5, 0, 40, "0", "w0") + steps_every(0.5, 0, 10, "1", "w1") + [StepEnd("1", "w1", 31.0, 10.0)]
    v = one({"recovers": {"after": "cut", "within": "3s", "workers": ["w1"]}}, facts(steps))
    assert v.ok is False and v.measured == pytest.approx(6.0) and v.detail.startswith("a step on w1 completed 6.00s")
    v = one({"recovers": {"after": "cut", "within": "3s"}}, facts(steps))
    assert v.ok is True and v.measured == pytest.approx(0.5)
    v = one({"recovers": {"after": "cut", "within": "3s", "workers": ["w7"]}}, facts(steps))
    assert v.ok is None and "no step records of ranks on w7" in v.detail


@pytest.mark.parametrize("window,why", [
    (None, "cut is not in the run's plan"),
    (Window(2, 1, 10.0, 10.0), "the run ended (completed) before cut did (1 of its 2 steps applied)"),
    (Window(2, 0, None, None), "the run ended (completed) before cut did (0 of its 2 steps applied)"),
    (Window(2, 2, 10.0, 25.0, ("no such link",)), "cut could not be applied: no such link"),
])
def test_an_event_that_did_not_happen_cannot_be_judged(window, why):
    f = facts(steps_every(0.5, 0, 40), windows={0: window} if window else {1: Window(1, 1, 3.0, 3.0)})
    for item in ({"recovers": {"after": "cut", "within": "3s"}}, {"slowdown": {"during": "cut", "at_most": 3}}):
        v = one(item, f)
        assert v.ok is None and v.measured is None and v.detail == f"could not be judged: {why}"


def test_slowdown_medians():
    # 0.1 s steps before the cut, 0.4 s during (10-25 s), 0.1 s after
    steps = steps_every(0.1, 0, 10) + steps_every(0.4, 10, 26)[1:] + steps_every(0.1, 26, 30)[1:]
    v = one({"slowdown": {"during": "cut", "at_most": 3}}, facts(steps))
    assert v.ok is False and v.measured == pytest.approx(4.0)
    assert v.detail.startswith("4.00x: median step 400 ms during cut (") and v.detail.endswith("; at most 3")
    v = one({"slowdown": {"during": "cut", "at_most": 5, "at_least": 3.5}}, facts(steps))
    assert v.ok is True and v.detail.endswith("at least 3.5 and at most 5")
    v = one({"slowdown": {"during": "cut", "at_least": 4.5}}, facts(steps))
    assert v.ok is False


def test_slowdown_counts_a_step_stalled_through_the_event():
    # one step spans the whole event (a stall): it is "during" though it ends after
    steps = steps_every(0.1, 0, 10) + [StepEnd("0", "w0", 30.0, 10.0)]
    v = one({"slowdown": {"during": "cut", "at_most": 3}}, facts(steps))
    assert v.measured == pytest.approx(200.0) and v.ok is False and "(1 steps)" in v.detail


def test_slowdown_without_a_baseline_or_steps_during():
    v = one({"slowdown": {"during": "cut", "at_most": 3}}, facts(steps_every(0.5, 11, 40)))
    assert v.ok is None and v.detail == "could not be judged: no step completed before cut began at 10.00s"
    v = one({"slowdown": {"during": "cut", "at_most": 3}}, facts(steps_every(0.5, 0, 8)))
    assert v.ok is None and v.detail == "could not be judged: no step ran during cut (10.00s-25.00s)"


def test_hang_detected():
    hung = dict(outcome="hung", error="no step progress for 6s (after 20 steps)", hang_after_s=6.0)
    v = one({"hang_detected": {"within": "10s"}}, facts(steps_every(0.5, 0, 10), watchdog_s=16.5, **hung))
    assert v.ok is True and v.measured == pytest.approx(6.5)
    assert v.detail == "the watchdog said so 6.50s after the last step (hang_after 6s) (within 10s)"
    v = one({"hang_detected": {"within": "5s"}}, facts(steps_every(0.5, 0, 10), watchdog_s=16.5, **hung))
    assert v.ok is False
    v = one({"hang_detected": {"within": "60s"}}, facts([], watchdog_s=30.0, started_s=-2.0, **hung))
    assert v.ok is True and v.measured == pytest.approx(32.0) and "the job's start (no step at all)" in v.detail
    v = one({"hang_detected": {"within": "60s"}}, facts([], outcome="hung", error="timeout after 120s"))
    assert v.ok is False and v.detail == "hung by the run's timeout, not the watchdog (timeout after 120s)"
    v = one({"hang_detected": {"within": "60s"}}, facts(steps_every(0.5, 0, 10)))
    assert v.ok is False and v.detail == "outcome completed: no hang to detect"


def test_a_judge_that_breaks_reports_not_judged():
    f = facts(steps_every(0.5, 0, 40))
    f.windows = {0: "not a window"}   # what a bug would do: the others are still judged
    vs = ex.judge(parse([{"recovers": {"after": "cut", "within": "3s"}}, {"outcome": "completed"}]), f)
    assert vs[0].ok is None and vs[0].detail.startswith("could not be judged: AttributeError")
    assert vs[1].ok is True
    assert not ex.all_met(vs) and ex.all_met(vs[1:]) and ex.all_met([])


@settings(max_examples=200, deadline=None)
@given(ends=st.lists(st.floats(-5, 100, allow_nan=False), min_size=1, max_size=60),
       start=st.floats(0, 50), length=st.floats(0.01, 30), within=st.floats(0.001, 50))
def test_recovers_is_the_first_step_after_the_end(ends, start, length, within):
    ends = sorted(ends)
    steps = [StepEnd("0", "w0", t, p) for p, t in zip([None] + ends[:-1], ends)]
    item = {"recovers": {"after": "cut", "within": f"{within!r}s"}}
    v = one(item, facts(steps, windows={0: Window(2, 2, start, start + length)}))
    after = [t for t in ends if t > start + length]
    if after:
        took = min(after) - (start + length)
        assert v.measured == took and v.ok is (took <= parse([item])[0].within_s)
    else:
        assert v.ok is False and v.measured is None


@settings(max_examples=200, deadline=None)
@given(durs=st.lists(st.floats(0.001, 10), min_size=4, max_size=60), start=st.floats(0, 40),
       length=st.floats(0.01, 20), scale=st.floats(0.1, 16), shift=st.floats(-100, 100))
def test_slowdown_is_a_ratio_of_medians_whatever_the_clock(durs, start, length, scale, shift):
    ends, t = [], 0.0
    for d in durs:
        t += d
        ends.append(t)
    steps = [StepEnd("0", "w0", e, p) for p, e in zip([None] + ends[:-1], ends)]
    item = {"slowdown": {"during": "cut", "at_most": 2}}
    v = one(item, facts(steps, windows={0: Window(2, 2, start, start + length)}))
    before = [e - p for p, e in zip(ends, ends[1:]) if e <= start]
    during = [e - p for p, e in zip(ends, ends[1:]) if e > start and p < start + length]
    if not before or not during:
        assert v.ok is None and v.measured is None
        return
    want = statistics.median(during) / statistics.median(before)
    assert v.measured == pytest.approx(want) and v.ok is (want <= 2)
    # the same run on another clock (a dilation factor, another origin): the same ratio
    moved = [StepEnd("0", "w0", s.end_s * scale + shift, None if s.start_s is None else s.start_s * scale + shift)
             for s in steps]
    w = one(item, facts(moved, windows={0: Window(2, 2, start * scale + shift, (start + length) * scale + shift)}))
    assert w.measured == pytest.approx(want, rel=1e-6)


# -- the facts of a run directory ---------------------------------------------------------------------------


def _write_rank(probe: Path, rank: int, worker: str, ends: list[float], junk: bool = False) -> None:
    lines = [json.dumps({"ev": "start", "t": ends[0] - 5, "rank": rank, "worker": worker})]
    for i, t in enumerate(ends):
        lines.append(json.dumps({"ev": "step", "t": t, "dur": 0.1, "n": i + 1}))
        if junk:
            lines += ["not json", json.dumps({"ev": "step"}), json.dumps({"ev": "step", "t": "soon"}),
                      json.dumps({"ev": "step", "t": float("nan")}), json.dumps([1, 2]),
                      json.dumps({"ev": "coll", "t": t, "dur": 0.01})]
    lines.append(json.dumps({"ev": "end", "t": ends[-1] + 1}))
    (probe / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n" + '{"ev": "step", "t": 1e12')   # a torn line


def _doc(**kw):
    doc = {"outcome": "completed", "error": None, "dilation": 2.0, "hang_after_s": 6.0, "t0_wall": 1000.0,
           "started_wall": 990.0, "watchdog": None,
           "plan": {"steps": [{"event": 0, "t": 1.0}, {"event": 0, "t": 4.0}, {"event": 1, "t": 6.0}]},
           "events": [{"event": 0, "applied_s": 1.01, "revert": False}, {"event": 0, "applied_s": 4.02,
                                                                          "revert": True}]}
    doc.update(kw)
    return doc


def test_run_facts_reads_the_probe_records_in_the_events_clock(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    _write_rank(probe, 0, "w0", [1000.0 + 0.2 * i for i in range(1, 60)], junk=True)
    _write_rank(probe, 1, "w1", [1000.0 + 0.2 * i for i in range(1, 60)])
    os.symlink(probe / "rank-0.jsonl", probe / "rank-7.jsonl")   # a job's link: never followed
    os.mkfifo(probe / "rank-8.jsonl")                            # a FIFO: never waited on
    f = ex.run_facts(tmp_path, _doc(watchdog={"detected_wall": 1020.0}))
    assert f.workers == {"0": "w0", "1": "w1"}
    assert len(f.steps) == 2 * 59 and {s.rank for s in f.steps} == {"0", "1"}
    r0 = [s for s in f.steps if s.rank == "0"]
    assert r0[0] == StepEnd("0", "w0", pytest.approx(0.1), None)          # (1000.2 - 1000) / 2
    assert r0[1].start_s == pytest.approx(0.1) and r0[1].end_s == pytest.approx(0.2)
    assert f.windows == {0: Window(2, 2, 1.01, 4.02, ()), 1: Window(1, 0, None, None, ())}
    assert f.watchdog_s == pytest.approx(10.0) and f.started_s == pytest.approx(-5.0)
    assert f.dilation == 2.0 and f.hang_after_s == 6.0


def test_run_facts_without_a_first_step_counts_from_the_start(tmp_path):
    f = ex.run_facts(tmp_path, _doc(t0_wall=None, outcome="hung", watchdog={"detected_wall": 1002.0}))
    assert f.steps == [] and f.started_s == 0.0 and f.watchdog_s == pytest.approx(6.0)
    f = ex.run_facts(tmp_path, _doc(t0_wall=None, started_wall=None))
    assert f.steps == [] and f.watchdog_s is None


def test_a_long_probe_file_is_read_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "PROBE_CHUNK", 64)
    monkeypatch.setattr(ex, "PROBE_READ_MAX", 64 * 40)
    probe = tmp_path / "probe"
    probe.mkdir()
    _write_rank(probe, 0, "w0", [1000.0 + i for i in range(1, 200)])
    f = ex.run_facts(tmp_path, _doc(dilation=1.0))
    # every whole line within the first 40 chunks, none torn across a chunk's end lost or garbled
    assert 30 < len(f.steps) < 199
    assert [s.end_s for s in f.steps] == [float(i) for i in range(1, len(f.steps) + 1)]


# -- output -------------------------------------------------------------------------------------------------


def test_verdict_lines_and_json():
    v = ex.Verdict("outcome: completed", False, None, "outcome hung, not completed")
    assert ex.verdict_line(v) == "NOT MET     outcome: completed  ->  outcome hung, not completed"
    assert v.to_json() == {"expect": "outcome: completed", "ok": False, "measured": None,
                           "detail": "outcome hung, not completed"}


def test_junit_xml():
    vs = [ex.Verdict("outcome: completed", True, None, "outcome completed"),
          ex.Verdict("recovers: {after: cut, within: 2s}", False, 2.5, "a step completed 2.50s after cut"),
          ex.Verdict("slowdown: {during: cut, at_most: 3}", None, None, "could not be judged: x\x00y\x1b[31m")]
    root = ET.fromstring(ex.junit_xml("core-flap", vs, time_s=12.5, properties={"run_dir": "/r", "x": None}))
    assert root.tag == "testsuites" and root.get("tests") == "3"
    (suite,) = root
    assert (suite.get("name"), suite.get("tests"), suite.get("failures"), suite.get("errors")) == \
        ("scenario core-flap", "3", "1", "1")
    assert {p.get("name"): p.get("value") for p in suite.find("properties")} == {"run_dir": "/r", "x": ""}
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [v.expect for v in vs]
    assert all(c.get("classname") == "scenario.core-flap" for c in cases)
    assert cases[0].find("failure") is None and cases[0].find("error") is None
    assert cases[1].find("failure").get("message") == "a step completed 2.50s after cut"
    assert "measured: 2.5" in cases[1].find("system-out").text
    assert cases[2].find("error").get("message") == "could not be judged: x\ufffdy\ufffd[31m"


def test_exit_status_follows_the_expectations_when_there_are_any():
    from testbed.faults.player import PlayResult

    met = [ex.Verdict("outcome: hung", True, None, "")]
    assert PlayResult("hung", "x", None).exit_code == 124
    assert PlayResult("hung", "x", None, expectations=met, judged=True).exit_code == 0
    assert PlayResult("completed", None, None, expectations=met + [ex.Verdict("r", None, None, "")],
                      judged=True).exit_code == 1
    assert PlayResult("completed", None, None, expectations=[ex.Verdict("r", False, 1.0, "")],
                      judged=True).exit_code == 1


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_refuses_a_bad_expect_before_anything(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(CONTRACT.replace("after: cut, within: 20s", "after: cutt, within: 20s"))
    for args in (["scenario", "plan", str(f), "--topology", "fat-tree"], ["scenario", "run", str(f), "-n", "nope"]):
        r = _cli(*args)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert f"{f}: expect[1].recovers.after: no such event; name one of cut, event 2 (got 'cutt')" in \
            " ".join(r.stderr.split()), r.stderr


def test_cli_refuses_a_junit_file_it_cannot_write_before_anything(tmp_path):
    r = _cli("scenario", "run", str(REPO / "scenarios" / "straggler.yaml"), "-n", "nope",
             "--junit", str(tmp_path / "no" / "such" / "dir.xml"))
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr
    r = _cli("scenario", "run", str(REPO / "scenarios" / "straggler.yaml"), "-n", "nope", "--junit", str(tmp_path))
    assert r.returncode == 1 and "is a folder" in r.stderr, r.stderr


def test_cli_help_tells_expectations_and_junit():
    r = _cli("scenario", "run", "--help")
    text = " ".join(r.stdout.split())
    assert "--junit" in text and "every expectation is met" in text and "124 hung" in text


def test_cli_judges_a_finished_run_again(tmp_path):
    """`scenario judge FILE RUN_DIR`: the expectations of FILE on a run's directory, nothing run."""
    f = tmp_path / "s.yaml"
    f.write_text(CONTRACT)
    rd = tmp_path / "run"
    (rd / "probe").mkdir(parents=True)
    # steps every 0.5 s from 0 to 10 s (t0 = 1000, no dilation), none during the cut, again from 26 s
    _write_rank(rd / "probe", 0, "w0", [1000.0 + 0.5 * i for i in range(1, 21)] + [1026.0, 1026.5, 1027.0])
    doc = _doc(dilation=1.0, outcome="completed", scenario="contract",
               plan={"steps": [{"event": 0, "t": 10.0}, {"event": 0, "t": 25.0}, {"event": 1, "t": 40.0}]},
               events=[{"event": 0, "applied_s": 10.0}, {"event": 0, "applied_s": 25.0, "revert": True}])
    (rd / "scenario.json").write_text(json.dumps(doc))
    xml = tmp_path / "out.xml"
    r = _cli("scenario", "judge", str(f), str(rd), "--junit", str(xml))
    out = r.stdout
    assert r.returncode == 1, (out, r.stderr)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines[:5] == [
        "met         outcome: completed  ->  outcome completed",
        "met         recovers: {after: cut, within: 20s}  ->  a step completed 1.00s after cut ended at 25.00s "
        "(within 20s)",
        "NOT JUDGED  recovers: {after: event 2, within: 1500ms, workers: [w2, w3]}  ->  could not be judged: the "
        "run ended (completed) before event 2 did (0 of its 1 steps applied)",
        "NOT MET     slowdown: {during: cut, at_most: 3}  ->  32.00x: median step 16.0 s during cut (1 steps), "
        "500 ms before (19 steps); at most 3",
        "NOT MET     hang_detected: {within: 60s}  ->  outcome completed: no hang to detect"], out
    assert "expectations: 2 of 5 met" in out
    suite = ET.parse(xml).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("5", "2", "1")
    # another scenario's run, or a folder without a run: refused, naming what
    (rd / "scenario.json").write_text(json.dumps({**doc, "scenario": "other"}))
    r = _cli("scenario", "judge", str(f), str(rd))
    assert r.returncode == 2 and "the run played scenario 'other', not this file's" in " ".join(r.stderr.split())
    r = _cli("scenario", "judge", str(f), str(tmp_path))
    assert r.returncode == 2 and "no scenario.json of a scenario run there" in r.stderr
