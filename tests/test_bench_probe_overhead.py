"""bench/probe_overhead.py's summary: a cost is judged only where the runs' own spread allows. Pure."""

import pytest
from bench_modules import load

po = load("probe_overhead")


def test_a_spread_wider_than_the_target_is_not_a_verdict():
    s = po.summarize({"probe": [1.43, 1.51, 1.38, 1.14, 1.12], "no probe": [1.48, 1.36, 1.14, 1.23, 1.23]})
    assert s["overhead"] > po.TARGET and s["paired_median"] < 0      # the two readings disagree in sign
    assert s["verdict"].startswith("not resolvable") and s["spread"] == pytest.approx(1.51 / 1.12 - 1)


@pytest.mark.parametrize("on,verdict", [(1.005, "met"), (1.05, "MISSED")])
def test_tight_runs_are_judged(on, verdict):
    s = po.summarize({"probe": [on, on, on], "no probe": [1.0, 1.001, 1.002]})
    assert s["verdict"] == verdict and s["paired"] == pytest.approx([on / 1.0 - 1, on / 1.001 - 1, on / 1.002 - 1])


def test_too_few_pairs_or_unequal_arms_are_not_judged():
    assert po.summarize({"probe": [1.0], "no probe": [1.0]})["verdict"].startswith("not resolvable with 1 pair")
    with pytest.raises(ValueError):
        po.summarize({"probe": [1.0, 1.0, 1.0], "no probe": [1.0, 1.0]})
