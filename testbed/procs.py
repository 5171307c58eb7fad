"""Processes testbed started, named so that a recycled PID is never taken for ours.

A process is referred to by (pid, start): `start` is when it started, in clock
ticks since boot (field 22 of /proc/PID/stat). The pair names one process for
the life of the machine, and unlike a wall-clock start time (what psutil's
create_time derives from the boot time and the clock) no NTP step can change
it. Every signal testbed sends goes through `signal_ref`, which checks the
pair first; stopping is TERM, a bounded wait, KILL, a bounded wait.

Every scan of /proc goes through this module too (`pids`, `pids_in_ns`, `pids_in_pidns`,
`pids_with_env`): a process that ends mid-scan, or one we may not read, is skipped, in one place.

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


def exists(pid: int) -> bool:
    """/proc has an entry for `pid`: a process, a zombie included (no (pid, start) check: for
    names that carry only a PID, such as a probe namespace's)."""
    return int(pid) > 0 and os.path.exists(f"/proc/{int(pid)}")


def pids(*, include_self: bool = True) -> list[int]:
    """The PIDs /proc lists now (processes, zombies included, not threads), in /proc's order."""
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [int(e) for e in entries if e.isdigit() and (include_self or int(e) != me)]


def ns_inode(pid: int | str, kind: str) -> int | None:
    """The inode of the `kind` namespace ("net", "pid", ...) of `pid` (or "self"); None if the
    process is gone, is a zombie, or may not be looked at."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def pids_in_ns(kind: str, inodes: Iterable[int], *, include_self: bool = True) -> dict[int, int]:
    """Every process whose `kind` namespace is one of `inodes`: pid -> that inode, in /proc's order."""
    wanted = set(inodes)
    out: dict[int, int] = {}
    if not wanted:
        return out
    for pid in pids(include_self=include_self):
        ino = ns_inode(pid, kind)
        if ino is not None and ino in wanted:
            out[pid] = ino
    return out


def pids_in_pidns(init_pid: int) -> list[int]:
    """The processes in the PID namespace of `init_pid` (its init, or any member), `init_pid`
    first; [] if it is gone. `docker exec`'d and setns'd processes are no init's children: only
    the namespace tells."""
    target = ns_inode(init_pid, "pid")
    if target is None:
        return []
    return [init_pid] + [p for p in pids_in_ns("pid", (target,)) if p != init_pid]


def nspid(pid: int) -> int | None:
    """`pid` as its own (innermost) PID namespace numbers it; None if it is gone."""
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def environ(pid: int) -> list[bytes] | None:
    """The environment `pid` was started with, as KEY=VALUE entries; None if it is gone or may
    not be read (a kernel thread or a zombie has an empty one)."""
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return [e for e in data.split(b"\0") if e]


def _env_entry(key: str, value: str) -> bytes:
    return f"{key}={value}".encode()


def pids_with_env(key: str, value: str, *, include_self: bool = True) -> list[int]:
    """Every process whose environment carries exactly key=value (one whole entry)."""
    entry = _env_entry(key, value)
    out = []
    for pid in pids(include_self=include_self):
        env = environ(pid)
        if env is not None and entry in env:
            out.append(pid)
    return out


def in_netns(r: ProcRef, netns_path: str | os.PathLike) -> bool:
    """The process lives in the network namespace bound at netns_path (a second proof of identity:
    a worker's init is in its worker's namespace)."""
    try:
        target = os.stat(netns_path).st_ino
    except OSError:
        return False
    return alive(r) and ns_inode(r.pid, "net") == target


def has_env(r: ProcRef, key: str, value: str) -> bool:
    """The process was started with key=value in its environment (a second proof for daemons we
    start with a marker variable)."""
    env = environ(r.pid)
    return env is not None and alive(r) and _env_entry(key, value) in env


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
