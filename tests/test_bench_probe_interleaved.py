"""bench/probe_interleaved.py's summary: the probe's cost is judged against 2% only when the method's
own A/A difference is small and the interval is on one side of the target. Pure."""

import pytest
from bench_modules import load

pi = load("probe_interleaved")


def _epochs(probe: float, plain2: float = 1.0, n: int = 12) -> list[dict[str, float]]:
    # a drifting machine: every arm of an epoch moves alike, the ratios do not
    return [{"plain": 0.025 * (1 + 0.05 * (i % 3)), "plain 2": 0.025 * plain2 * (1 + 0.05 * (i % 3)),
             "probe": 0.025 * probe * (1 + 0.05 * (i % 3)) * (1 + 0.002 * (i % 2))} for i in range(n)]


def test_a_cheap_probe_is_met_and_a_costly_one_missed():
    cheap, costly = pi.summarize(_epochs(1.005)), pi.summarize(_epochs(1.06))
    assert cheap["verdict"] == "met" and cheap["overhead_95"][1] <= pi.TARGET
    assert costly["verdict"].startswith("missed (by") and costly["overhead"] == pytest.approx(0.06, abs=0.002)


def test_a_wide_a_a_difference_says_nothing():
    s = pi.summarize(_epochs(1.005, plain2=1.02))
    assert s["verdict"].startswith("not resolvable: the A/A difference is +2.0%")


def test_an_interval_across_the_target_is_not_a_verdict():
    assert pi.judge((0.02, 0.01, 0.03), 0.0).startswith("not resolvable at 2%")


def test_the_interval_holds_the_median_and_narrows_with_agreeing_epochs():
    ratios = [1.04, 1.05, 1.06, 1.05, 1.07, 1.03]
    lo, hi = pi.bootstrap(ratios)
    assert lo <= 1.05 <= hi and pi.bootstrap([1.05] * 6) == (1.05, 1.05)
