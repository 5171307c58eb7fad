"""The iteration with the model's communication (testbed/report/iteration.py): the steps as measured,
each collective at the model's time. Pure; the last test judges a run directory built here."""

import json
import math

import pytest

from testbed.report.iteration import expected_iteration, expected_steps, step_ends


def test_a_blocking_collective_costs_its_step_what_it_took_beyond_the_model():
    # steps of 10 s; in each, two blocking collectives 1 s and 0.5 s slower than the model
    ends = [0.0, 10.0, 20.0]
    spans = [(t + 1, t + 4, t + 3, False) for t in (0.0, 10.0)] + [(t + 5, t + 6, t + 5.5, False) for t in (0.0, 10.0)]
    assert expected_steps(ends, spans) == [8.5, 8.5]
    assert expected_iteration(ends, spans, s=2.0) == pytest.approx(4.25)   # emulated: real / s


def test_buckets_cost_the_step_only_where_it_waited_for_them():
    """DDP waits for its buckets together before the optimizer steps: a first bucket that came late
    but ended while backward still computed (before the last launch) costs nothing; the last end
    against the model's last end is what moves the step."""
    ends = [0.0, 10.0]
    # bucket A launched at 1, late by 2 s but over by 6; bucket B launched at 7 (backward's end), on the model
    on_time = [(1.0, 6.0, 4.0, True), (7.0, 8.0, 8.0, True)]
    assert expected_steps(ends, on_time) == [10.0]
    late = [(1.0, 6.0, 4.0, True), (7.0, 9.0, 8.0, True)]    # B 1 s late: the step 1 s longer than the model's
    assert expected_steps(ends, late) == [9.0]
    fast = [(1.0, 3.0, 4.0, True), (7.0, 7.5, 8.0, True)]    # faster than the model: the model's step is longer
    assert expected_steps(ends, fast) == [10.5]


def test_what_falls_outside_the_steps_or_is_not_a_number_is_left_out():
    ends = [0.0, 10.0, 20.0, 30.0]
    spans = [(-5.0, 1.0, 0.0, False), (35.0, 40.0, 36.0, False), (12.0, float("nan"), 13.0, False),
             (22.0, 24.0, 23.0, False)]
    assert expected_steps(ends, spans) == [10.0, 10.0, 9.0]
    assert expected_iteration(ends[:2], spans, 1.0) is None            # fewer than three steps
    assert expected_iteration(ends, [(35.0, 40.0, 36.0, False)], 1.0) is None   # no collective in them
    probe = {"0": [{"ev": "step", "t": 3.0}, {"ev": "step", "t": float("inf")}, {"ev": "step", "t": "4"},
                   {"ev": "step", "t": True}, {"ev": "coll", "t": 2.0}, {"ev": "step", "t": 1.0}],
             "1": [{"ev": "step", "t": 9.0}], "x": [{"ev": "step", "t": 0.5}]}
    assert step_ends(probe) == [1.0, 3.0]                              # rank 0's, numbers only
    assert step_ends({}) == [] and not math.isnan(expected_steps([0.0, 1.0], [])[0])


def test_a_ddp_run_is_judged_on_its_iteration_with_the_models_communication(tmp_path):
    """A run of steps whose second bucket ends 30% late: the verdict's iteration check compares the
    measured steps with the same steps at the model's communication, and names the difference."""
    from tests.test_sharing import _bucket, _ddp_run
    from tests.test_verdict import _model
    from testbed.report.sharing import shared_times
    from testbed.report.verdict import judge

    s = 4.0
    a, b, offset = _model(9 << 20), _model(13 << 20), 0.2 * _model(9 << 20)
    first, second = shared_times([_bucket(0.0, a, end=1.0), _bucket(offset, b, end=1.0)], 2)

    def with_steps(d, second_took):
        run = _ddp_run(d, first, second_took, offset, s=s)
        for rank in (0, 1):
            f = run / "probe" / f"rank-{rank}.jsonl"
            recs = [json.loads(x) for x in f.read_text().splitlines()]
            # each step ends 2 ms (emulated) after its last bucket: the optimizer
            recs += [{"ev": "step", "t": 100.0 + i + (offset + second_took + 0.002) * s, "dur": 0.001, "n": i + 1}
                     for i in range(8)]
            f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        return judge(run)

    on = with_steps(tmp_path / "on", second)
    it = [c for c in on.checks if c.name == "iteration"]
    assert len(it) == 1 and it[0].ok is True, on.lines()
    assert "+0.0% against the expected" in it[0].detail and "each collective at the model's time" in it[0].detail
    late = with_steps(tmp_path / "late", 1.3 * second)
    it = [c for c in late.checks if c.name == "iteration"][0]
    # the steps come 1 s apart whatever the buckets took (real time): the model's steps are 0.3 x second
    # longer than the measured ones, as the job waited for the late bucket
    err = 1.0 / (1.0 - 0.3 * second * s) - 1
    assert f"{100 * err:+.1f}% against the expected {(1.0 - 0.3 * second * s) / s * 1e3:.4g} ms" in it.detail, it.detail
    assert it.ok is (err <= 0.10) and late.status == "not faithful", late.lines()
