"""Processes testbed started, named so that a recycled PID is never taken for ours.

A process is referred to by (pid, start): `start` is when it started, in clock
ticks since boot (field 22 of /proc/PID/stat). The pair names one process for
the life of the machine, and unlike a wall-clock start time (what psutil's
create_time derives from the boot time and the clock) no NTP step can change
it. Every signal testbed sends goes through `signal_ref`, which checks the
pair first; stopping is TERM, a bounded wait, KILL, a bounded wait.

No matching of command lines anywhere (a name says nothing about who started a process): a process is ours
because we recorded its (pid, start) when we started it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Iterable

TERM_WAIT_S = 2.0
KILL_WAIT_S = 2.0


@dataclass(frozen=True)
class ProcRef:
    pid: int
    start: int     # clock ticks since boot

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            stat = f.read()
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def ref(pid: int) -> ProcRef | None:
    """A reference to the live process `pid` (None if there is none)."""
    t = start_ticks(pid)
    return None if t is None else ProcRef(int(pid), t)


def alive(r: ProcRef) -> bool:
    """The process this reference names still runs (same PID, same start, not a zombie)."""
    return r.pid > 0 and start_ticks(r.pid) == r.start


def in_netns(r: ProcRef, netns_path: str | os.PathLike) -> bool:
    """The process lives in the network namespace bound at netns_path (a second proof of identity:
    a worker's init is in its worker's namespace)."""
    try:
        return alive(r) and os.stat(f"/proc/{r.pid}/ns/net").st_ino == os.stat(netns_path).st_ino
    except OSError:
        return False


def has_env(r: ProcRef, key: str, value: str) -> bool:
    """The process was started with key=value in its environment (a second proof for daemons we
    start with a marker variable)."""
    try:
        with open(f"/proc/{r.pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    return alive(r) and f"{key}={value}".encode() in env


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def signal_ref(r: ProcRef, sig: int) -> bool:
    """Send `sig` to the process only if it is still the one we started; True if sent."""
    if not alive(r):
        return False
    try:
        os.kill(r.pid, sig)
        return True
    except ProcessLookupError:
        return False


def wait_gone(refs: Iterable[ProcRef], timeout: float) -> list[ProcRef]:
    """Wait up to `timeout` for the processes to end (reaping our children); the survivors."""
    left = list(refs)
    deadline = time.monotonic() + timeout
    while left:
        for r in left:
            _reap(r.pid)
        left = [r for r in left if alive(r)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    return left


def stop(refs: Iterable[ProcRef], term_wait: float = TERM_WAIT_S, kill_wait: float = KILL_WAIT_S,
         term: bool = True) -> list[ProcRef]:
    """End processes we started: TERM (unless term=False), wait, KILL, wait. Bounded in time;
    returns those still alive at the end (a process in uninterruptible sleep can outlive KILL)."""
    refs = [r for r in refs if alive(r)]
    if term:
        for r in refs:
            signal_ref(r, signal.SIGTERM)
        refs = wait_gone(refs, term_wait)
    for r in refs:
        signal_ref(r, signal.SIGKILL)
    return wait_gone(refs, kill_wait)
