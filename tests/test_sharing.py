"""Collectives in flight together share the links: testbed.report.sharing (pure), and the verdict
judging DDP-style buckets that overlap against it."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from testbed.report.sharing import Launch, shared_times
from testbed.topology.dilation import HOST_MARGIN

MS = 1e-3
REPO = Path(__file__).resolve().parents[1]


def _bucket(start, alone, end=None, group="0", asynchronous=True):
    return Launch(start, start + alone if end is None else end, alone, group, asynchronous)


def test_a_collective_alone_keeps_its_time():
    assert shared_times([_bucket(0.0, 8 * MS)], 2) == [8 * MS]
    apart = [_bucket(0.0, 8 * MS), _bucket(0.1, 12 * MS)]   # the second launched after the first ended
    assert shared_times(apart, 2) == [8 * MS, 12 * MS]


def test_two_buckets_in_flight_split_the_links():
    # the seed's two-worker DDP job: 9.06 MiB alone 8.11 ms, 13.5 MiB launched 3.05 ms later, alone 12.0 ms;
    # the first runs alone 3.05 ms, then both at half rate until it is done, then the second alone
    first, second = shared_times([_bucket(0.0, 8.11 * MS, end=18 * MS), _bucket(3.05 * MS, 12.0 * MS, end=23 * MS)], 2)
    assert first == pytest.approx(3.05 * MS + 2 * (8.11 - 3.05) * MS)
    assert 3.05 * MS + second == pytest.approx((8.11 + 12.0) * MS)   # the links carried both: nothing lost


def test_one_lane_runs_them_one_after_another():
    first, second = shared_times([_bucket(0.0, 8 * MS), _bucket(1 * MS, 12 * MS)], 1)
    assert first == pytest.approx(8 * MS)
    assert second == pytest.approx(7 * MS + 12 * MS)   # waited for the lane, then alone


def test_a_third_waits_for_one_of_gloos_two_lanes():
    times = shared_times([_bucket(0.0, 1.0), _bucket(0.0, 1.0), _bucket(0.0, 1.0)], 2)
    assert times == pytest.approx([2.0, 2.0, 3.0])


def test_other_groups_share_the_links_but_not_the_lanes():
    times = shared_times([_bucket(0.0, 1.0, group="a"), _bucket(0.0, 1.0, group="b")], 1)
    assert times == pytest.approx([2.0, 2.0])


def test_blocking_collectives_the_model_makes_longer_do_not_share():
    # a loop of blocking all_reduces that ran 5% faster than the model: each launch came after the
    # last one returned; the model's longer time must not make them overlap (that would move the
    # model towards the measurement)
    loop = [Launch(i * 1.0, i * 1.0 + 0.95, 1.0, "0", False) for i in range(4)]
    assert shared_times(loop, 2) == [1.0] * 4


def test_a_blocking_collective_launched_while_buckets_run_shares_with_them():
    times = shared_times([_bucket(0.0, 1.0, end=2.0), Launch(0.0, 2.0, 1.0, "0", False)], 2)
    assert times == pytest.approx([2.0, 2.0])


def test_an_asynchronous_launch_that_ended_before_the_next_is_taken_as_waited_for():
    # measured, the first ended before the second started, though the model says it would still be
    # running: in the records that is a job that waited for it, so the two do not share (the stated
    # limit: a job that went on and whose collective ran fast is judged against its time alone)
    first, second = shared_times([_bucket(0.0, 1.0, end=0.4), _bucket(0.5, 1.0)], 2)
    assert first == pytest.approx(1.0) and second == pytest.approx(1.0)


def test_an_asynchronous_collective_waited_for_at_once_is_a_blocking_one():
    # `all_reduce(async_op=True).wait()` in a loop that ran 5% faster than the model: nothing was
    # launched while one ran, so the model must not make them overlap (the error would grow along the loop)
    loop, t = [], 0.0
    for _ in range(6):
        loop.append(Launch(t, t + 0.95, 1.0, "0", True))
        t += 0.95 + 1e-5
    assert shared_times(loop, 2) == [1.0] * 6


def test_what_the_model_keeps_in_flight_longer_shares_with_later_launches():
    # the first ran fast (0.6 of its 1.0) and the job went on without it; sharing with the second keeps
    # it in flight in the model until 1.5, so the third, launched at 1.4, shares with it too
    first, second, third = shared_times([_bucket(0.0, 1.0, end=0.6), _bucket(0.5, 1.0, end=1.1),
                                         _bucket(1.4, 1.0, end=2.4)], 2)
    assert first > 1.4 and third > 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_times_that_are_not_finite_are_refused(bad):
    # a rank's records are hostile input: NaN parses as JSON, and would stall the simulation
    with pytest.raises(ValueError, match="finite"):
        shared_times([_bucket(bad, 1.0, end=1.0), _bucket(0.5, 1.0)], 2)


def test_epoch_seconds_keep_their_precision():
    base = 1.796e9   # the probe's timestamps are seconds since the epoch
    first, second = shared_times([_bucket(base, 8.11 * MS), _bucket(base + 3.05 * MS, 12.0 * MS)], 2)
    assert first == pytest.approx(13.17 * MS, rel=1e-4) and second == pytest.approx(17.06 * MS, rel=1e-4)


def test_lanes_must_be_positive():
    with pytest.raises(ValueError, match="lanes"):
        shared_times([_bucket(0.0, 1.0)], 0)


_launch = st.builds(Launch, st.floats(0, 10), st.floats(0, 20), st.floats(0, 5), st.sampled_from("ab"),
                    st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_launch, max_size=12), st.integers(1, 3))
def test_never_shorter_than_alone_and_never_longer_than_everything_in_a_row(launches, lanes):
    times = shared_times(launches, lanes)
    assert len(times) == len(launches)
    for x, t in zip(launches, times):
        assert t >= x.alone - 1e-12
        # at worst it waited for and shared with every launch before or beside it
        assert t <= sum(y.alone for y in launches) + max((x2.start for x2 in launches), default=0.0) + 1e-9
        assert math.isfinite(t)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 5), min_size=1, max_size=8), st.integers(1, 3))
def test_buckets_launched_together_finish_when_the_links_have_carried_them_all(alones, lanes):
    times = shared_times([_bucket(0.0, a, end=100.0) for a in alones], lanes)
    assert max(times) == pytest.approx(sum(alones))   # the links never idle while work is left


# -- the verdict on DDP's overlapping buckets ---------------------------------------------------------------


def _ddp_run(d, first_s, second_s, offset_s, steps=8, s=4.0, setting=None, cap=True, blocking=None, beta=None):
    """Two ranks whose DDP launched two buckets per step, the second offset_s after the first (emulated),
    taking first_s and second_s from launch to completion (setting: the dilation's, "auto" or "fixed";
    cap: whether it capped the workers' CPUs; blocking: (bytes, seconds) of an all_reduce the job waited
    for, 0.7 s after each step's buckets began; beta: the machine's cost per byte, if not MACHINE's)."""
    from dataclasses import replace

    from tests.test_verdict import MACHINE, STAR2
    from testbed.topology.loader import load_topology_text

    machine = MACHINE if beta is None else replace(MACHINE, beta_s_per_byte=beta)
    (d / "probe").mkdir(parents=True)
    (d / "topology.json").write_text(json.dumps(load_topology_text(STAR2, "<t>").to_json()))
    (d / "summary.json").write_text(json.dumps({"world_size": 2, "time_dilation": {"factor": s, "cap_cpu": cap,
                                                                                  **({"setting": setting} if setting else {})},
                                                "machine": machine.to_json(), "duration_s": 10}))
    (d / "monitor.json").write_text(json.dumps({"cores": 2, "cpu": [], "qdiscs": {}, "delay_lines": {}}))
    for rank in (0, 1):
        recs = [{"ev": "start", "t": 0.0, "rank": rank, "world_size": 2, "worker": f"w{rank}"}]
        for i in range(steps):
            t = 100.0 + i
            for seq, (nbytes, start, dur) in enumerate(((9 << 20, 0.0, first_s), (13 << 20, offset_s, second_s)), 1):
                recs.append({"ev": "coll", "op": "all_reduce", "bytes": nbytes, "t": t + start * s, "dur": dur * s,
                             "async": True, "src": "ddp", "g": "0", "gn": 2, "seq": 2 * i + seq, "be": "gloo"})
            if blocking is not None:
                recs.append({"ev": "coll", "op": "all_reduce", "bytes": blocking[0], "t": t + 0.7,
                             "dur": blocking[1] * s, "async": False, "src": "api", "g": "0", "gn": 2,
                             "seq": 1000 + i, "be": "gloo"})
        (d / "probe" / f"rank-{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d


def test_overlapping_buckets_are_judged_against_the_links_they_shared(tmp_path):
    from tests.test_verdict import _model
    from testbed.report.verdict import judge

    a, b, offset = _model(9 << 20), _model(13 << 20), 0.2 * _model(9 << 20)
    first, second = shared_times([_bucket(0.0, a, end=1.0), _bucket(offset, b, end=1.0)], 2)
    assert second > 1.2 * b   # alone, this run would be far off the model
    v = judge(_ddp_run(tmp_path / "shared", first, second, offset))
    assert v.status == "faithful", v.lines()
    rows = {r.nbytes: r for r in v.classes}
    assert rows[13 << 20].alone_s == pytest.approx(b) and rows[13 << 20].model_s == pytest.approx(second)
    assert rows[13 << 20].error == pytest.approx(0.0, abs=1e-6)

    # the same buckets each taking their time alone, though in flight together: faster than sharing allows
    fast = judge(_ddp_run(tmp_path / "fast", a, b, offset))
    assert fast.status == "not faithful", fast.lines()
    assert any("it shared the links with collectives in flight beside it" in r for r in fast.reasons), fast.reasons


def test_buckets_slower_than_the_links_they_shared_are_named_as_running_beside_the_job(tmp_path):
    """At auto, buckets that shared the links and still ran slower than the model ran while the job
    computed beside them on the worker's CPU cap (the seed's DDP case): the fix says so, not that a
    collective's own CPU work is left whatever the dilation. At a fixed dilation the fix names the
    cap, which scales with s."""
    from tests.test_verdict import _model
    from testbed.report.verdict import judge

    a, b, offset = _model(9 << 20), _model(13 << 20), 0.2 * _model(9 << 20)
    first, second = shared_times([_bucket(0.0, a, end=1.0), _bucket(offset, b, end=1.0)], 2)
    v = judge(_ddp_run(tmp_path / "auto", 1.3 * first, second, offset, setting="auto"))
    assert v.status == "not faithful", v.lines()
    assert [f for f in v.fixes if "ran while the job went on" in f] == [v.fixes[0]], v.fixes
    assert "all_reduce 9 MiB (1.30x)" in v.fixes[0] and f"{HOST_MARGIN:g}x margin" in v.fixes[0], v.fixes[0]
    assert not any("their own CPU work" in f for f in v.fixes), v.fixes
    # a fixed dilation caps each worker's CPU by s too: not auto's margin; the cap is what to name
    # where a rank's bytes on the cap's one core take more than 1/HOST_MARGIN of the links' time (a machine
    # of 0.1 Gbit/s per core against 1 Gbit/s links)
    fixed = judge(_ddp_run(tmp_path / "fixed", 1.3 * first, second, offset, setting="fixed", beta=80e-9))
    assert fixed.status == "not faithful" and not any("ran while the job went on" in f for f in fixed.fixes), \
        fixed.fixes
    assert any("at a fixed --time-dilation 4: each worker's CPU was capped at 1/4" in f and "whatever s is" in f
               and "--time-dilation auto" in f and "0.10 Gbit/s per rank" in f for f in fixed.fixes), fixed.fixes
    assert not any("their own CPU work" in f or "not the cap" in f for f in fixed.fixes), fixed.fixes
    # where the cap's core moves those bytes in an eighth of the links' time (8 Gbit/s per core), the
    # cap cannot be why (the dumbbell at s = 8 with 1000-packet queues, docs/fidelity.md): not named
    fast_host = judge(_ddp_run(tmp_path / "fast-host", 1.3 * first, second, offset, setting="fixed"))
    assert fast_host.status == "not faithful", fast_host.lines()
    assert not any("CPU was capped" in f for f in fast_host.fixes), fast_host.fixes
    assert any("all_reduce 9 MiB (1.30x) ran slow at a fixed --time-dilation 4" in f and "not the cap" in f
               for f in fast_host.fixes), fast_host.fixes

    # only the classes that shared the links: a slow all_reduce the job waited for gets the other fix
    c = _model(4 << 20)
    mixed = judge(_ddp_run(tmp_path / "mixed", 1.3 * first, second, offset, s=2.0, setting="auto",
                           blocking=(4 << 20, 1.3 * c)))
    assert mixed.status == "not faithful", mixed.lines()
    beside = [f for f in mixed.fixes if "ran while the job went on" in f]
    assert len(beside) == 1 and "all_reduce 9 MiB" in beside[0] and "4 MiB" not in beside[0], mixed.fixes
    assert any("their own CPU work" in f for f in mixed.fixes), mixed.fixes
    # auto that did not cap the workers' CPUs: no cap to share, so not this fix
    uncapped = judge(_ddp_run(tmp_path / "uncapped", 1.3 * first, second, offset, setting="auto", cap=False))
    assert not any("ran while the job went on" in f for f in uncapped.fixes), uncapped.fixes


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_a_real_ddp_job_s_buckets_are_judged_in_flight_together(testbed, tmp_path):
    """Two gloo ranks in namespaces of their own, DDP's default buckets (two per step of the MLP) on
    1 Gbit/s links: the probe records them as asynchronous, they overlap, and the verdict's model
    has each share the links with the other, never less than its time alone."""
    from tests.test_verdict import MACHINE
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.report.verdict import judge
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text("name: sh2\ngenerator: star\nparams: {n: 2}\n"
                                    "tiers:\n  host: {bandwidth: 1gbit}\n", "<test_sharing>"))
    res = run(cluster_from_state(st["name"]), [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--model",
                                               "mlp", "--steps", "6"],
              base_dir=tmp_path, workdir=str(REPO), echo=False, timeout=240, machine=MACHINE)
    assert res.rc == 0, (Path(res.run_dir) / "logs" / "w0.log").read_text()
    v = judge(res.run_dir)
    buckets = [r for r in v.classes if r.count >= 5 and r.op == "all_reduce"]
    assert len(buckets) == 2, v.to_json()["classes"]
    assert all(r.model_s >= r.alone_s > 0 for r in v.classes)
    assert any(r.model_s > 1.2 * r.alone_s for r in buckets), [(r.nbytes, r.model_s, r.alone_s) for r in buckets]
    # its steps against the same steps with the buckets at the model's time: said, deciding nothing
    steps = [c for c in v.checks if c.name == "steps"]
    assert len(steps) == 1 and steps[0].ok is None and steps[0].detail in v.reasons, v.lines()
