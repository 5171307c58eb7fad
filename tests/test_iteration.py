"""The iteration with the model's communication (testbed/report/iteration.py): a rank's steps as
measured, each of its collectives at the model's time. Pure; the last test judges a run directory
built here."""

import json

import pytest

from testbed.report.iteration import Span, expected_iteration, expected_steps, step_ends


def blocking(start, end, model_end, ranks=()):
    return Span(start, end, model_end, False, ranks)


def bucket(start, end, model_end):
    return Span(start, end, model_end, True, ())


def test_a_collective_the_rank_waited_for_costs_its_step_what_it_took_beyond_the_model():
    ends = [0.0, 10.0, 20.0]
    spans = [blocking(t + 1, t + 4, t + 3) for t in (0.0, 10.0)] + [blocking(t + 5, t + 6, t + 5.5) for t in (0.0, 10.0)]
    assert expected_steps(ends, spans) == [8.5, 8.5]
    assert expected_iteration(ends, spans, s=2.0) == (5.0, pytest.approx(4.25))   # emulated: real / s


def test_overlapping_waits_are_one_wait_and_others_pairs_are_not_the_ranks():
    """Collectives of the rank in flight together (two groups, or its pairs of a ring) hold it until
    the last one ends, and in the model until the model's last end; a pair the rank is not in costs
    it nothing."""
    ends = [0.0, 10.0]
    ring = [blocking(1.0, 3.0, 2.5, (0, 1)), blocking(1.0, 3.2, 2.6, (7, 0))]   # rank 0's two pairs, together
    others = [blocking(1.0, 3.5, 2.0, (2, 3)), blocking(4.0, 6.0, 5.0, (3, 4))]
    assert expected_steps(ends, ring + others) == [pytest.approx(10.0 - 0.6)]    # 3.2 against 2.6, once
    assert expected_steps(ends, others) == [10.0]


def test_buckets_cost_the_step_only_where_it_waited_for_them():
    """DDP waits for its buckets together before the optimizer steps: a first bucket that came late
    but ended while backward still computed (before the last launch) costs nothing; the last end
    against the model's last end is what moves the step. Other asynchronous collectives are waits
    of their own (each waited for once it ended: testbed.report.sharing says the same)."""
    ends = [0.0, 10.0]
    assert expected_steps(ends, [bucket(1.0, 6.0, 4.0), bucket(7.0, 8.0, 8.0)]) == [10.0]
    assert expected_steps(ends, [bucket(1.0, 6.0, 4.0), bucket(7.0, 9.0, 8.0)]) == [9.0]    # the last 1 s late
    assert expected_steps(ends, [bucket(1.0, 3.0, 4.0), bucket(7.0, 7.5, 8.0)]) == [10.5]   # faster than the model
    # the same two spans launched asynchronously but not DDP's: two waits, 2 s late each
    assert expected_steps(ends, [blocking(1.0, 4.0, 2.0), blocking(5.0, 8.0, 6.0)]) == [6.0]


def test_what_falls_outside_the_steps_or_is_not_a_number_is_left_out():
    ends = [0.0, 10.0, 20.0, 30.0]
    spans = [blocking(-5.0, 1.0, 0.0), blocking(35.0, 40.0, 36.0), blocking(12.0, float("nan"), 13.0),
             blocking(22.0, 24.0, 23.0)]
    assert expected_steps(ends, spans) == [10.0, 10.0, 9.0]
    assert expected_iteration(ends[:2], spans, 1.0) is None                        # fewer than three steps
    assert expected_iteration(ends, [blocking(35.0, 40.0, 36.0)], 1.0) is None     # no collective in them
    assert expected_iteration(ends, [blocking(2.0, 3.0, 3.0, (1, 2))], 1.0) is None   # none of the rank's
    assert expected_iteration(ends, [blocking(1.0, 30.0, 2.0)], 1.0) is None       # records that do not hold together
    probe = {"0": [{"ev": "step", "t": 3.0}, {"ev": "step", "t": float("inf")}, {"ev": "step", "t": "4"},
                   {"ev": "step", "t": True}, {"ev": "coll", "t": 2.0}, {"ev": "step", "t": 1.0}],
             "1": [{"ev": "step", "t": 9.0}], "x": [{"ev": "step", "t": 0.5}]}
    assert step_ends(probe) == (0, [1.0, 3.0])                                     # rank 0's, numbers only
    assert step_ends({"x": []}) is None


def _run_with_steps(d, first, second_took, offset, s):
    from tests.test_sharing import _ddp_run

    run = _ddp_run(d, first, second_took, offset, s=s)
    for rank in (0, 1):
        f = run / "probe" / f"rank-{rank}.jsonl"
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        # each step ends 2 ms (emulated) after its last bucket: the optimizer
        recs += [{"ev": "step", "t": 100.0 + i + (offset + second_took + 0.002) * s, "dur": 0.001, "n": i + 1}
                 for i in range(8)]
        f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return run


def test_a_ddp_run_is_told_what_its_buckets_cost_its_steps(tmp_path):
    """A run of steps whose second bucket ends late: the verdict says the steps against the same
    steps at the model's communication, and that line decides nothing (the class decides)."""
    from tests.test_sharing import _bucket
    from tests.test_verdict import _model
    from testbed.report.sharing import shared_times
    from testbed.report.verdict import judge

    s = 4.0
    a, b, offset = _model(9 << 20), _model(13 << 20), 0.2 * _model(9 << 20)
    first, second = shared_times([_bucket(0.0, a, end=1.0), _bucket(offset, b, end=1.0)], 2)

    on = judge(_run_with_steps(tmp_path / "on", first, second, offset, s))
    steps = [c for c in on.checks if c.name == "steps"]
    assert on.status == "faithful" and len(steps) == 1 and steps[0].ok is None, on.lines()
    assert steps[0].detail.startswith("iteration p50 250 ms (rank 0), +0.0% against 250 ms") and \
        steps[0].detail in on.reasons, steps[0].detail
    for late in (1.05, 1.3):   # the steps come 1 s apart (real) whatever the bucket took
        v = judge(_run_with_steps(tmp_path / f"late{late}", first, late * second, offset, s))
        detail = [c for c in v.checks if c.name == "steps"][0].detail
        expected = (1.0 - (late - 1) * second * s) / s
        assert f"{100 * (0.25 / expected - 1):+.1f}% against {expected * 1e3:.4g} ms" in detail, detail
        assert v.status == ("faithful" if late < 1.1 else "not faithful"), v.lines()   # as the class says


def test_step_and_collective_records_without_numbers_are_passed_over_not_a_crash(tmp_path):
    """Ranks write the probe: a step whose time is a string, a collective whose duration is missing,
    negative or not finite are passed over by the report and the verdict (they stopped `testbed
    report` with a TypeError before), and the rest is judged as without them."""
    from tests.test_sharing import _bucket
    from tests.test_verdict import _model
    from testbed.report.analyze import analyze, load_probe
    from testbed.report.sharing import shared_times
    from testbed.report.verdict import judge

    s = 4.0
    a, b, offset = _model(9 << 20), _model(13 << 20), 0.2 * _model(9 << 20)
    first, second = shared_times([_bucket(0.0, a, end=1.0), _bucket(offset, b, end=1.0)], 2)
    clean = judge(_run_with_steps(tmp_path / "clean", first, second, offset, s))
    run = _run_with_steps(tmp_path / "hostile", first, second, offset, s)
    bad = [{"ev": "step", "t": "4"}, {"ev": "step", "t": True}, {"ev": "step"},
           {"ev": "coll", "op": "all_reduce", "bytes": 8, "t": 100.5, "g": "0", "gn": 2, "seq": 999},
           {"ev": "coll", "op": "all_reduce", "bytes": 8, "t": 100.5, "dur": -1.0, "g": "0", "gn": 2, "seq": 998},
           {"ev": "coll", "op": "all_reduce", "bytes": 8, "t": 100.5, "dur": "1", "g": "0", "gn": 2, "seq": 997}]
    with open(run / "probe" / "rank-0.jsonl", "a") as f:
        f.write("\n".join(json.dumps(r) for r in bad) + "\n")
        f.write('{"ev": "coll", "op": "all_reduce", "t": 100.5, "dur": NaN, "g": "0", "gn": 2, "seq": 996}\n')
    assert len(load_probe(run)["0"]) == len(load_probe(tmp_path / "clean")["0"])
    assert analyze(run)["ranks"][0]["steps"] == 8
    v = judge(run)
    assert (v.status, [r.error for r in v.classes]) == (clean.status, [r.error for r in clean.classes]), v.lines()
