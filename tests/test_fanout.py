"""testbed/net/fanout.py: per-item work over forked processes (no kernel state needed)."""

from __future__ import annotations

import os
import signal

import pytest

from testbed.net import fanout


def test_every_item_once_with_results_in_this_process():
    seen: dict[int, dict] = {}
    fanout.each(list(range(50)), lambda x: {"sq": x * x, "pid": os.getpid()}, procs=3,
                on_done=lambda i, r: seen.__setitem__(i, r))
    assert sorted(seen) == list(range(50))
    assert all(r["sq"] == i * i for i, r in seen.items())
    pids = {r["pid"] for r in seen.values()}
    assert len(pids) == 3 and os.getpid() not in pids     # the work ran in three children


def test_the_first_failing_item_is_named():
    def work(x: int) -> dict:
        if x in (17, 30):
            raise RuntimeError(f"boom {x}")
        return {}

    with pytest.raises(fanout.FanoutError, match=r"^node17: boom 17$"):
        fanout.each(list(range(40)), work, name=lambda x: f"node{x}", procs=2)


def test_inline_gives_the_same_error():
    with pytest.raises(fanout.FanoutError, match=r"^node3: boom$"):
        fanout.each([1, 2, 3], lambda x: (_ for _ in ()).throw(ValueError("boom")) if x == 3 else {},
                    name=lambda x: f"node{x}", procs=1)


def test_a_child_that_dies_silently_is_an_error_not_a_success():
    def work(x: int) -> dict:
        if x == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    with pytest.raises(fanout.FanoutError, match="ended before reporting"):
        fanout.each(list(range(20)), work, name=lambda x: f"n{x}", procs=2)


def _children() -> set[int]:
    """This process's children, running or not yet reaped (every thread's list)."""
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            out.update(int(x) for x in f.read().split())
    return out


def test_no_child_is_left_behind():
    # fanout's own children only: in a test worker, other tests' testbeds may keep children of
    # theirs (delay-line engines) running, which waitpid(-1) would count
    before = _children()
    fanout.each(list(range(40)), lambda x: {}, procs=4)
    assert _children() <= before


def test_small_jobs_stay_inline():
    assert fanout.procs_for(3) == 1
    assert 1 <= fanout.procs_for(10_000) <= fanout.MAX_PROCS


def test_build_procs_caps_the_fan_out(monkeypatch):
    monkeypatch.setenv("TESTBED_BUILD_PROCS", "1")
    assert fanout.procs_for(10_000) == 1
    monkeypatch.setenv("TESTBED_BUILD_PROCS", "junk")     # not a count: ignored
    assert fanout.procs_for(10_000) >= 1


def test_cheap_items_need_more_of_them_per_process(monkeypatch):
    monkeypatch.delenv("TESTBED_BUILD_PROCS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert fanout.procs_for(36) == 2 and fanout.procs_for(36, min_per_proc=64) == 1
    assert fanout.procs_for(208, min_per_proc=64) == 2
