"""The console's line on a run with phantom ranks (`testbed run --real`): which ranks were real, on
which workers, and which were phantoms, with rank lists as ranges (testbed.jobs.phantom_ranks.ranks_line).

Pure logic, on summaries shaped as summary.json is (one host's, or the controller's merge);
tests/test_phantom.py checks the line against a real run's summary.
"""

from __future__ import annotations

import pytest

from testbed.jobs.phantom_ranks import rank_ranges, ranks_line


@pytest.mark.parametrize("ranks, want", [
    ([], ""),
    ([0], "0"),
    ([1, 2, 3], "1-3"),
    ([8, 7, 0, 1, 2, 5, 2], "0-2,5,7-8"),
    ([0, 2, 4], "0,2,4"),
    (list(range(1, 64)), "1-63"),
])
def test_rank_ranges(ranks, want):
    assert rank_ranges(ranks) == want


def _summary(real, phantoms, workers, real_workers, nproc=1):
    """A summary of one rank per (worker, local rank), real or phantom as given."""
    ranks = [{"worker": workers[g // nproc], "rank": g, "phantom": g in phantoms} for g in range(len(workers) * nproc)]
    return {"ranks": ranks, "phantoms": {"real_workers": real_workers, "real_ranks": real, "phantom_ranks": phantoms}}


def test_one_real_rank_among_64():
    s = _summary([0], list(range(1, 64)), [f"w{i}" for i in range(64)], ["w0"])
    assert ranks_line(s) == "ranks: 1 real (0 on w0), 63 phantoms (1-63)"


def test_real_ranks_on_several_workers():
    s = _summary([0, 1, 4, 5], [2, 3, 6, 7], ["w0", "w1", "w2", "w3"], ["w0", "w2"], nproc=2)
    assert ranks_line(s) == "ranks: 4 real (0-1 on w0, 4-5 on w2), 4 phantoms (2-3,6-7)"


def test_one_phantom_is_singular():
    s = _summary([0], [1], ["w0", "w1"], ["w0"])
    assert ranks_line(s) == "ranks: 1 real (0 on w0), 1 phantom (1)"


def test_torchrun_real_ranks_go_to_the_real_workers():
    """Under torchrun the summary's ranks are the agents (no global rank): the rendezvous chose."""
    s = {"ranks": [{"worker": w, "rank": None, "phantom": w != "w0"} for w in ("w0", "w1", "w2", "w3")],
         "phantoms": {"real_workers": ["w0"], "real_ranks": [0, 1], "phantom_ranks": [2, 3, 4, 5, 6, 7]}}
    assert ranks_line(s) == "ranks: 2 real (0-1 on w0), 6 phantoms (2-7)"


def test_a_replay_has_no_real_rank():
    s = _summary([], [0, 1, 2, 3], ["w0", "w1", "w2", "w3"], [])
    assert ranks_line(s) == "ranks: none real (a replay), 4 phantoms (0-3)"


def test_no_phantoms_no_line():
    assert ranks_line({"ranks": [{"worker": "w0", "rank": 0, "phantom": False}], "phantoms": None}) is None
    assert ranks_line({}) is None
    assert ranks_line({"phantoms": {"real_ranks": [0, 1], "phantom_ranks": []}}) is None


def test_what_a_host_wrote_is_not_trusted():
    """A merged summary.json holds what the hosts wrote: odd values are left out, never raised on."""
    s = {"ranks": "x", "phantoms": {"real_workers": "w0", "real_ranks": [0, "1", True], "phantom_ranks": [2, None]}}
    assert ranks_line(s) == "ranks: 1 real (0), 1 phantom (2)"
