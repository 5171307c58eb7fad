"""testbed sweep, pure logic: the spec, the plan, what a point changes, the table, the plots,
the sweep directory. No namespaces (tests/test_sweep_run.py runs a real sweep)."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.errors import TopologyError
from testbed.sweep import plan as sweep_plan
from testbed.sweep import table
from testbed.sweep.plan import effective_topology, make_plan, profile_changes
from testbed.sweep.runner import Directory, SweepError, predict_builds
from testbed.sweep.spec import CLI_SOURCE, data_from_options, load_sweep, sweep_from_data
from testbed.topology.loader import load_topology
from testbed.topology.model import LinkProfile

BANDWIDTHS = ["100mbit", "500mbit", "1gbit", "2.5gbit", "5gbit", "10gbit"]


def _sweep(**data):
    return sweep_from_data({"topology": "star", **data}, "s.yaml")


# -- the spec ------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from(BANDWIDTHS), min_size=1, max_size=4, unique=True), min_size=1, max_size=3))
def test_a_grid_holds_every_combination_in_order(value_lists):
    keys = ["link.bandwidth", "tiers.host.bandwidth", "job.args"][: len(value_lists)]
    grid = {k: v for k, v in zip(keys, value_lists)}
    sw = _sweep(grid=grid)
    assert sw.swept == tuple(keys)
    assert len(sw.points) == math.prod(len(v) for v in value_lists)
    # the last parameter varies fastest, as written
    assert [p[-1][1] for p in sw.points[: len(value_lists[-1])]] == value_lists[-1]
    assert len({repr(p) for p in sw.points}) == len(sw.points)


@pytest.mark.parametrize("data,path,fragment", [
    ({"grid": {"link.bandwidth": ["10gbps/s"]}}, "grid.link.bandwidth[0]", "unknown bandwidth unit"),
    ({"grid": {"link.colour": ["red"]}}, "grid.link.colour", "link.FIELD takes one of"),
    ({"grid": {"job.nodes": [2]}}, "grid.job.nodes", "a job parameter is one of"),
    ({"grid": {"link.bandwidth": []}}, "grid.link.bandwidth", "at least one value"),
    ({"grid": {"link.bandwidth": ["1gbit", "1gbit"]}}, "grid.link.bandwidth", "given twice"),
    ({"grid": {"dilation": ["fast"]}}, "grid.dilation[0]", "'auto', 'none' or a number >= 1"),
    ({"grid": {"dilation": [0.5]}}, "grid.dilation[0]", ">= 1"),
    ({"grid": {"a": [1]}, "points": [{"a": 1}]}, "points", "not both"),
    ({"points": [{"link.loss": "120%"}]}, "points[0].link.loss", "loss"),
    ({"points": [{"params.n": 2}, {"params.n": 2}]}, "points[1]", "same point as points[0]"),
    ({"repeats": 0}, "repeats", ">= 1"),
    ({"repeats": "2"}, "repeats", "integer"),
    ({"colour": "red"}, "colour", "unknown field"),
    ({"job": {"stepz": 3}}, "job.stepz", "unknown field"),
    ({"job": {"steps": 1}}, "job.steps", ">= 2"),
    ({"job": {"timeout": "soon"}}, "job.timeout", ""),
    ({"set": ["params.n"]}, "set[0]", "PATH=VALUE"),
    ({"name": "no spaces please"}, "name", "letters"),
    ({"grid": {"job.steps": [1]}}, "grid.job.steps[0]", ">= 2"),
])
def test_a_bad_sweep_file_names_the_file_the_field_and_the_value(data, path, fragment):
    with pytest.raises(TopologyError) as err:
        _sweep(**data)
    text = str(err.value)
    assert text.startswith("s.yaml: "), text
    assert f": {path}: " in text or text.startswith(f"s.yaml: {path}:"), text
    assert fragment in text


def test_a_sweep_file_needs_a_topology_and_is_read_from_disk(tmp_path):
    with pytest.raises(TopologyError, match="topology: missing"):
        sweep_from_data({"grid": {"link.bandwidth": ["1gbit"]}}, "s.yaml")
    f = tmp_path / "bw.yaml"
    f.write_text("topology: star\nrepeats: 2\ngrid:\n  link.bandwidth: [1gbit, 5gbit]\n")
    sw = load_sweep(f)
    assert (sw.name, sw.testbed, sw.repeats, len(sw.points)) == ("bw", "sweep-bw", 2, 2)
    f.write_text("topology: star\ntopology: fat-tree\n")
    with pytest.raises(TopologyError, match="bw.yaml"):
        load_sweep(f)
    with pytest.raises(TopologyError, match="not found"):
        load_sweep(tmp_path / "missing.yaml")


def test_the_command_line_builds_the_same_document():
    data = data_from_options("star", ["link.bandwidth=1gbit,5gbit", "dilation=2,4"], [], ["params.n=3"],
                             job={"steps": 6, "command": None}, repeats=2, name=None, dilation=None)
    sw = sweep_from_data(data, CLI_SOURCE)
    assert sw.swept == ("link.bandwidth", "dilation")
    assert [dict(p)["dilation"] for p in sw.points] == [2, 4, 2, 4]
    assert (sw.name, sw.job.steps, sw.sets) == ("star-bandwidth-dilation", 6, ("params.n=3",))
    pts = sweep_from_data(data_from_options("star", [], ["link.bandwidth=1gbit;link.delay=1ms", "params.n=3"], []),
                          CLI_SOURCE)
    assert pts.points == ((("link.bandwidth", "1gbit"), ("link.delay", "1ms")), (("params.n", 3),))
    with pytest.raises(TopologyError, match="the command line: --grid: .*KEY=VALUE"):
        data_from_options("star", ["link.bandwidth"], [], [])


# -- the plan ------------------------------------------------------------------------------------------------


def test_link_fields_reach_every_link_and_overrides_reach_the_topology():
    sw = _sweep(grid={"link.bandwidth": ["1gbit", "5gbit"], "params.n": [2, 3]}, repeats=2)
    plan = make_plan(sw)
    assert len(plan.runs) == 8 and [r.repeat for r in plan.runs[:2]] == [1, 2]
    for p in plan.points:
        topo = plan.topology(p)
        assert len(topo.workers) == p.value("params.n")
        want = 1_000_000_000 if p.value("link.bandwidth") == "1gbit" else 5_000_000_000
        assert {link.ab.bandwidth_bps for link in topo.links} == {want}


def test_a_point_whose_topology_is_wrong_names_the_sweep_file_and_the_point():
    with pytest.raises(TopologyError) as err:
        make_plan(_sweep(points=[{"params.n": 2}, {"params.n": 0}]))
    assert str(err.value).startswith("s.yaml: points[1]: this point's topology: ")
    with pytest.raises(TopologyError, match=r"s.yaml: grid \(tiers.nowhere.bandwidth=1gbit\)"):
        make_plan(_sweep(grid={"tiers.nowhere.bandwidth": ["1gbit"]}))


def test_the_fingerprint_follows_what_decides_the_results():
    a = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}))
    assert a.fingerprint() == make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]})).fingerprint()
    assert a.fingerprint() != make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "2gbit"]})).fingerprint()
    assert a.fingerprint() != make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}, repeats=2)).fingerprint()


profiles = st.builds(LinkProfile,
                     bandwidth_bps=st.one_of(st.none(), st.integers(1_000_000, 40_000_000_000)),
                     delay_s=st.sampled_from([0.0, 2e-6, 1e-3, 5e-3]),
                     loss=st.sampled_from([0.0, 0.01]),
                     queue=st.one_of(st.none(), st.integers(10, 1000)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.integers(0, 3), st.tuples(profiles, profiles), max_size=4))
def test_profile_changes_are_exactly_the_links_that_differ(changed):
    live = load_topology("star")
    links = list(live.links)
    for i, (ab, ba) in changed.items():
        links[i] = replace(links[i], ab=ab, ba=ba)
    target = replace(live, links=links)
    got = profile_changes(live, target)
    assert got is not None
    assert {i for i, _, _ in got} == {i for i, (ab, ba) in changed.items() if (ab, ba) != (live.links[i].ab, live.links[i].ba)}
    for i, ab, ba in got:
        assert (ab, ba) == (target.links[i].ab, target.links[i].ba)
    # the state records changed profiles per link; the effective topology reads them back
    state = {"topology": live.to_json(),
             "links": [{"profile": {"ab": ab.to_json(), "ba": ba.to_json()}} if i in {j for j, _, _ in got} else {}
                       for i, (ab, ba) in enumerate((l.ab, l.ba) for l in target.links)]}
    assert profile_changes(effective_topology(state), target) == []


def test_anything_but_a_running_links_profile_needs_a_new_up():
    star = load_topology("star")
    assert profile_changes(star, load_topology("star", ["params.n=3"])) is None
    mtu = replace(star, links=[replace(star.links[0], ab=star.links[0].ab.with_changes(mtu=9000))] + star.links[1:])
    assert profile_changes(star, mtu) is None
    assert profile_changes(star, load_topology("star", ["tiers.host.bandwidth=1gbit"])) is not None


def test_builds_are_predicted_where_the_topology_or_the_dilation_changes():
    plan = make_plan(_sweep(grid={"params.n": [2, 3], "link.bandwidth": ["1gbit", "5gbit"]}, dilation=2, repeats=2))
    builds = predict_builds(plan, plan.runs, None, 2)
    firsts = [b for r, b in zip(plan.runs, builds) if r.repeat == 1]
    assert firsts == [True, False, True, False]          # n changes: up; bandwidth only: in place
    assert not any(b for r, b in zip(plan.runs, builds) if r.repeat == 2)
    fixed = make_plan(_sweep(grid={"dilation": [2, 4]}))
    assert predict_builds(fixed, fixed.runs, None, 2) == [True, True]
    lossy = str(Path(__file__).resolve().parents[1] / "scenarios" / "lossy-tor.yaml")
    scen = make_plan(_sweep(points=[{"link.bandwidth": "1gbit"}, {"link.bandwidth": "2gbit", "scenario": lossy}]))
    assert predict_builds(scen, scen.runs, None, 2) == [True, True]   # a scenario starts from its own profiles


def test_the_estimate_uses_the_sweeps_own_times_once_it_has_them():
    plan = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}, repeats=2))
    runs = plan.runs
    builds = [True, False, False, False]
    guess = sweep_plan.estimate_seconds(plan, runs, builds)
    assert guess > 0
    assert sweep_plan.estimate_seconds(plan, runs, builds, [10.0, 30.0], [5.0]) == pytest.approx(4 * 20 + 5)
    assert sweep_plan.estimate_seconds(plan, runs[2:], builds[2:], [10.0]) == pytest.approx(20)
    assert sweep_plan.format_duration(75) == "1 min 15 s" and sweep_plan.format_duration(3700) == "1 h 01 min"


def test_swept_values_become_numbers_in_their_plotting_unit():
    assert sweep_plan.numeric("link.bandwidth", "2.5gbit") == 2.5
    assert sweep_plan.numeric("tiers.host.delay", "5ms") == pytest.approx(5)
    assert sweep_plan.numeric("link.loss", "1%") == pytest.approx(1)
    assert sweep_plan.numeric("dilation", "auto") is None and sweep_plan.numeric("params.k", 4) == 4


# -- the table and the plots ----------------------------------------------------------------------------------


def _rows(plan, iterations, verdicts):
    from testbed.report.verdict import ClassRow, Verdict

    rows = []
    for run, it, v in zip(plan.runs, iterations, verdicts):
        cls = ClassRow("all_reduce", 22 << 20, 20, it / 2e3, it / 2.2e3, 0, 1, 0.1, 0.9, "links", links_s=it / 3e3)
        analysis = {"dilation": 8.0, "ranks": [{"iter_p50_s": it / 1e3, "iter_p95_s": it / 0.9e3}]}
        rows.append(table.row(run.point, run.repeat, "fresh", analysis, Verdict(v, [], [], classes=[cls]),
                              it / 1.1e3, 100.0, f"runs/{run.key}", "completed", other_work=0.02, loadavg=1.5))
    return rows


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(1, 1e4, allow_nan=False), min_size=4, max_size=4),
       st.lists(st.sampled_from(["faithful", "not faithful", "inconclusive", "unverified"]), min_size=4, max_size=4))
def test_the_csv_and_json_tables_hold_every_row(iterations, verdicts):
    plan = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}, repeats=2))
    rows = _rows(plan, iterations, verdicts)
    text = table.csv_text(rows, plan.sweep.swept)
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert len(parsed) == 4
    assert [r["point"] for r in parsed] == ["p00", "p00", "p01", "p01"]
    assert [r["link.bandwidth"] for r in parsed] == ["1gbit", "1gbit", "5gbit", "5gbit"]
    assert [r["verdict"] for r in parsed] == verdicts
    for r, it in zip(parsed, iterations):
        assert float(r["iteration_ms"]) == pytest.approx(it, rel=1e-5)
        assert float(r["all_reduce 22 MiB measured_ms"]) == pytest.approx(it / 2, rel=1e-5)
        assert r["all_reduce 22 MiB status"] == "within"
    s = table.summary_by_point(rows)
    assert [x["median_ms"] for x in s] == pytest.approx([(iterations[0] + iterations[1]) / 2,
                                                        (iterations[2] + iterations[3]) / 2])


def test_rows_are_kept_one_file_per_run_and_the_table_is_written_whole(tmp_path):
    plan = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}, repeats=2))
    rows = _rows(plan, [100, 110, 50, 55], ["faithful"] * 4)
    for run, r in zip(plan.runs[:3], rows):
        table.save_row(tmp_path, run.key, r)
    (tmp_path / table.RESULTS / "p01-r2.json").symlink_to("/etc/passwd")   # planted: not a row
    got = table.load_rows(tmp_path, [r.key for r in plan.runs])
    assert sorted(got) == ["p00-r1", "p00-r2", "p01-r1"]
    files = table.write_table(tmp_path, list(got.values()), plan.sweep.swept, {"sweep": "x"})
    assert json.loads(files[1].read_text())["rows"][2]["iteration_ms"] == pytest.approx(50)
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_plots_are_made_for_one_and_two_parameters(tmp_path):
    from testbed.sweep import plots

    plan = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}, repeats=2))
    made = plots.write_plots(tmp_path, _rows(plan, [100, 110, 50, 55], ["faithful", "inconclusive"] * 2),
                             plan.sweep.swept, "t")
    assert [p.name for p in made] == ["iteration.png"]
    two = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"], "link.delay": ["1ms", "2ms"]}))
    made = plots.write_plots(tmp_path, _rows(two, [100, 110, 50, 55], ["faithful"] * 4), two.sweep.swept, "t")
    assert [p.name for p in made] == ["iteration.png", "heatmap.png"]
    assert all(p.stat().st_size > 5000 for p in made)
    assert plots.write_plots(tmp_path / "..", [], two.sweep.swept, "t") == []


# -- the directory --------------------------------------------------------------------------------------------


def test_a_directory_continues_only_its_own_plan_and_one_sweep_at_a_time(tmp_path):
    plan = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "5gbit"]}))
    d = Directory(tmp_path / "sw", plan)
    assert d.open() == {}
    d.write_state(status="running")
    other = Directory(tmp_path / "sw", plan)
    with pytest.raises(SweepError, match="another `testbed sweep` is using"):
        other.open()
    d.close()
    again = Directory(tmp_path / "sw", plan)
    assert again.open()["status"] == "running"
    again.close()
    changed = make_plan(_sweep(grid={"link.bandwidth": ["1gbit", "2gbit"]}))
    with pytest.raises(SweepError, match="holds another sweep"):
        Directory(tmp_path / "sw", changed).open()
    table.save_row(tmp_path / "sw", "p00-r1", {"point": "p00"})
    fresh = Directory(tmp_path / "sw", changed)
    assert fresh.open(restart=True) == {}
    fresh.close()
    assert not (tmp_path / "sw" / table.RESULTS / "p00-r1.json").exists()


# -- the command line ------------------------------------------------------------------------------------------


def test_options_replace_the_files_fields(tmp_path):
    from testbed.cli.sweep import _document

    f = tmp_path / "bw.yaml"
    f.write_text("topology: star\nset: [params.n=3]\nrepeats: 2\njob: {steps: 8}\n"
                 "grid:\n  link.bandwidth: [1gbit, 5gbit]\n")
    data, source, base = _document(str(f), None, ["link.delay=1ms,2ms,3ms"], [], ["tiers.host.loss=0"],
                                   job={"batch_size": 4}, repeats=3, dilation=None)
    sw = sweep_from_data(data, source, base)
    assert (sw.swept, len(sw.points), sw.repeats) == (("link.delay",), 3, 3)
    assert sw.sets == ("params.n=3", "tiers.host.loss=0")
    assert (sw.job.steps, sw.job.batch_size, sw.source, sw.name) == (8, 4, str(f), "bw")


def test_the_dry_run_prints_the_points_and_an_estimate(tmp_path):
    import os
    import subprocess
    import sys

    spec = Path(__file__).resolve().parents[1] / "examples" / "sweep-bandwidth.yaml"
    out = subprocess.run([sys.executable, "-m", "testbed", "sweep", str(spec), "--dry-run", "--dir", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "sweep fat-tree-bandwidth: 4 point(s) x 2 repeat(s) = 8 run(s)" in text
    for bw in ("1gbit", "2.5gbit", "5gbit", "10gbit"):
        assert bw in text
    assert "fresh up" in text and "8 run(s) to do, estimated" in text
    assert not (tmp_path / "d").exists(), "a dry run makes nothing"
    bad = subprocess.run([sys.executable, "-m", "testbed", "sweep", "--topology", "star", "--grid",
                          "link.bandwidth=1gbit,fast", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "the command line: grid.link.bandwidth[1]: " in bad.stderr and "'fast'" in bad.stderr


_leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 30), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["1gbit", "auto", "none", "2", "x", "", "params.n=2", "5ms", "1%"]))
_values = st.recursive(_leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.sampled_from(
                                                            ["link.bandwidth", "dilation", "params.n", "job.args",
                                                             "steps", "command", "x y", "link.loss"]), inner,
                                                            max_size=3)), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["topology", "name", "set", "testbed", "dilation", "scenario", "job",
                                        "repeats", "grid", "points", "description", "colour"]), _values, max_size=6))
def test_any_document_is_a_sweep_or_an_error_naming_the_file(data):
    """Whatever the file holds, the answer is a Sweep or a TopologyError naming it (never a traceback)."""
    try:
        sw = sweep_from_data(data, "s.yaml")
    except TopologyError as exc:
        assert str(exc).startswith("s.yaml"), str(exc)
    else:
        assert sw.repeats >= 1 and len(sw.points) >= 1
