"""A run's processes: one Rank per process the launcher starts, and how they are signalled (by their
process groups, then by PID: every process that carries the run's tag)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Sequence

from testbed import procs


@dataclass
class Rank:
    worker: str
    node_rank: int
    local_rank: int | None       # None: a torchrun agent (ranks inside it are torchrun's)
    rank: int | None
    label: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    rc: int | None = None
    started: float = 0.0
    ended: float | None = None
    phantom: bool = False        # testbed run --real: a rank that mirrors a real one (jobs/phantom.py)
    group: str | None = None     # a run of groups: the group or service this rank belongs to
    service: bool = False
    starts: int = 1              # a group started again after a failure: how many times it started


def exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def tagged_pids(run_id: str) -> list[int]:
    """Every process (host view) but this one whose environment carries our run id."""
    return procs.pids_with_env("TESTBED_RUN_ID", run_id, include_self=False)


def signal_all(ranks: Sequence[Rank], run_id: str, sig: int) -> None:
    signal_ranks(ranks, tagged_pids(run_id), sig)


def signal_ranks(ranks: Sequence[Rank], tagged: Sequence[int], sig: int) -> None:
    """The ranks' process groups, then every process that carries our tag (torchrun's workers live
    in sessions of their own)."""
    for r in ranks:
        if r.proc is not None and r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    for pid in tagged:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(ranks: Sequence[Rank], tag: str, sig: int) -> None:
    """Every process of one group: its ranks' process groups, then whatever carries its tag."""
    signal_ranks(ranks, procs.pids_with_env("TESTBED_GROUP_RUN", tag, include_self=False), sig)
