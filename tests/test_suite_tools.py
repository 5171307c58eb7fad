"""The suite's own tools: the wait helper (tests/waiting.py), require flags (tests/requires.py), the
phase runner's summary (tests/suite.py). Pure, no root."""

from __future__ import annotations

import time

import pytest

import requires
import suite
from waiting import WaitTimeout, wait_for, wait_gone


def test_wait_for_returns_the_first_truthy_value():
    seen = iter([None, 0, [], [7]])
    assert wait_for(lambda: next(seen), timeout=5, what="a list", interval=0.001) == [7]


def test_wait_for_says_what_it_waited_for_and_what_it_last_saw():
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout) as ei:
        wait_for(lambda: [], timeout=0.2, what="the server to listen", interval=0.05)
    took = time.monotonic() - t0
    assert 0.2 <= took < 2.0   # the deadline, not much more (2 s: a loaded 2-core machine)
    msg = str(ei.value)
    assert "waiting for the server to listen" in msg and "last value: []" in msg, msg
    assert isinstance(ei.value, AssertionError)   # a test failure, not an error


def test_wait_for_ignores_only_the_exceptions_it_is_told_to():
    calls = [0]

    def flaky():
        calls[0] += 1
        if calls[0] < 3:
            raise FileNotFoundError("not yet")
        return "done"

    assert wait_for(flaky, timeout=5, what="the file", interval=0.001, ignore=OSError) == "done"
    with pytest.raises(WaitTimeout, match="last error: FileNotFoundError: nope"):
        wait_for(lambda: (_ for _ in ()).throw(FileNotFoundError("nope")), timeout=0.05, what="x",
                 interval=0.01, ignore=OSError)
    with pytest.raises(ZeroDivisionError):
        wait_for(lambda: 1 / 0, timeout=5, what="x", ignore=OSError)


def test_wait_gone_returns_once_nothing_is_left_and_names_what_was():
    left = iter([[3, 4], [4], []])
    wait_gone(lambda: next(left), timeout=5, what="the helpers to end", interval=0.001)
    with pytest.raises(WaitTimeout, match=r"waiting for the helpers to end .*; still there: \[4\]$"):
        wait_gone(lambda: [4], timeout=0.05, what="the helpers to end", interval=0.01)


def test_need_skips_without_a_flag_and_fails_with_one(monkeypatch):
    for var in ("TESTBED_REQUIRE", "TESTBED_REQUIRE_TCPDUMP", "TESTBED_REQUIRE_NETEM"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs tcpdump"):
        requires.need("tcpdump", ok=False)
    requires.need("tcpdump", ok=True)
    monkeypatch.setenv("TESTBED_REQUIRE_TCPDUMP", "1")
    with pytest.raises(pytest.fail.Exception, match="TESTBED_REQUIRE_TCPDUMP=1 is set"):
        requires.need("tcpdump", ok=False)
    monkeypatch.delenv("TESTBED_REQUIRE_TCPDUMP")
    monkeypatch.setenv("TESTBED_REQUIRE", "iperf3, tcpdump")
    with pytest.raises(pytest.fail.Exception):
        requires.need("tcpdump", ok=False)
    with pytest.raises(pytest.skip.Exception):
        requires.need("chromium", ok=False)
    # all: every tool but those of another kind of machine
    monkeypatch.setenv("TESTBED_REQUIRE", "all")
    assert requires.strict() and requires.required("chromium") and not requires.required("netem")
    with pytest.raises(pytest.skip.Exception, match="sch_netem"):
        requires.need("netem", ok=False)
    assert requires.MACHINE_BOUND_REASON.search(requires.reason("netem"))
    assert requires.MACHINE_BOUND_REASON.search(requires.reason("gpu"))
    assert not requires.MACHINE_BOUND_REASON.search(requires.reason("tun"))
    with pytest.raises(KeyError, match="unknown tool"):
        requires.need("no-such-tool", ok=True)


def test_summary_line_merges_the_phases():
    fast = {"phase": "fast", "passed": 600, "failed": 1, "error": 0, "skipped": 3, "deselected": 330,
            "seconds": 400, "skipped_why": {"needs sch_netem in the running kernel": 2, "needs an NVIDIA GPU": 1}}
    timing = {"phase": "timing", "passed": 30, "failed": 0, "error": 1, "skipped": 1, "deselected": 903,
              "seconds": 90, "skipped_why": {"needs sch_netem in the running kernel": 1}}
    why, closing = suite.summary_line([fast, timing], ["fast", "timing"]).splitlines()
    assert closing == ("suite: 630 passed, 2 failed, 4 skipped "
                       "(fast 600 passed, 1 failed, 3 skipped (400 s); timing 30 passed, 1 failed, 1 skipped (90 s))")
    assert why.startswith("suite: skipped 4: 3 x no sch_netem in this kernel (make test-kernel runs them); 1 x no GPU")
    assert "299 not run (marked slow or multihost: make test-all runs them)" in why and why.endswith("(490 s)")
    assert suite.summary_line([], ["rest"]).splitlines()[-1] == "suite: 0 passed, 0 failed, 0 skipped"
    # two wordings of one kind of skip in one phase are one group, counted in full (not "N other")
    two = {**fast, "skipped": 5, "skipped_why": {"needs sch_netem in the running kernel": 3,
                                                 "kernel has no sch_netem": 2}}
    assert suite.summary_line([two], ["fast"]).splitlines()[0].startswith(
        "suite: skipped 5: 5 x no sch_netem in this kernel (make test-kernel runs them);"), two
    one = suite.summary_line([{**fast, "deselected": 0}], ["fast"]).splitlines()[-1]
    assert one == "suite: 600 passed, 1 failed, 3 skipped"   # one phase: its counts are the total


def test_summary_of_all_phases_names_each_and_one_without_a_result():
    """make test-all: every phase in one line; a phase whose pytest was killed wrote no record and
    is named, not silently missing from the counts."""
    fast = {"phase": "fast", "passed": 1000, "skipped": 10, "deselected": 110, "seconds": 250,
            "skipped_why": {"needs sch_netem in the running kernel": 10}}
    timing = {"phase": "timing", "passed": 13, "deselected": 1107, "seconds": 85}
    rest = {"phase": "rest", "passed": 97, "deselected": 1023, "seconds": 1046}
    why, closing = suite.summary_line([fast, timing, rest], list(suite.PHASES)).splitlines()
    assert closing == ("suite: 1110 passed, 0 failed, 10 skipped "
                       "(fast 1000 passed, 10 skipped (250 s); timing 13 passed (85 s); rest 97 passed (1046 s))")
    assert "not run" not in why and "deselected" not in why, why   # everything ran
    why, closing = suite.summary_line([fast, timing, {"phase": "rest", "no_result": -9}],
                                      list(suite.PHASES)).splitlines()
    assert closing.endswith("; rest: no result, pytest exited -9)"), closing
    assert "97 not run (a phase ended without a result)" in why, why


def test_all_is_every_phase_in_order(monkeypatch, capsys):
    ran: list[list[str]] = []

    class Done:
        returncode = 5   # pytest: nothing selected (no test runs here)

    def fake_run(cmd, env):
        ran.append(cmd)
        return Done()

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    assert suite.main(["--jobs", "1", "all"]) == 0
    assert [c[c.index("-m", 3) + 1] for c in ran] == [expr for _, expr in suite.PHASES.values()]
    assert "fast: no result, pytest exited 5; timing: no result" in capsys.readouterr().out
