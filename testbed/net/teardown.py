"""A testbed's network taken down: its delay-line engines stopped (each proven ours by its pid file),
what is left running in its namespaces ended by PID, the namespaces deleted."""

from __future__ import annotations

import os
import select
import signal
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Iterable

from testbed import procs
from testbed.net import netns


def stop_delay_lines(records: Iterable[dict[str, Any]], refused: list[str] | None = None) -> list[str]:
    """Stop the engines the records name (PID and start time); what could not be stopped. A record
    whose process its pid file does not name (written when the line started) is not acted on:
    it goes to `refused`."""
    from testbed.net import delayline

    engines: dict[procs.ProcRef, Any] = {}   # each engine once (it serves many lines), proven ours
    for rec in records:
        ref = procs.ProcRef(int(rec["pid"]), int(rec["start"]))
        if ref in engines or not procs.alive(ref):
            continue
        named = delayline.read_pid_file(Path(rec["pid_file"]))
        if named is None and not procs.wait_gone([ref], 1.0):
            continue   # it was ending (an engine removes its pid files on its way out)
        if named != ref:   # a second proof
            if refused is not None:
                refused.append(f"pid {ref.pid} recorded as the delay line of link {rec.get('link')}: its pid "
                               "file does not name it, not signalled")
            continue
        engines[ref] = rec.get("link")
    # together: each engine closes its TAPs meanwhile (k=8: 0.43 + 0.49 s one after the other)
    return [f"delay-line engine of link {engines[ref]} (pid {ref.pid}) would not end"
            for ref in delayline.stop_engines(list(engines))]


# Pidfds held at once while killing: the scan can find thousands of processes (a delay line per link
# at k=16), far more than the usual 1024 open files.
_HELD_AT_ONCE = 256


def kill_processes_in(namespaces: list[str], timeout: float = 2.0) -> list[int]:
    """End the processes that sit in our namespaces (they would keep them alive). Returns the PIDs
    still there after `timeout` s (a process in uninterruptible sleep outlives SIGKILL a while).

    A PID from a scan of /proc is only a name: the process can end before the signal and its PID
    go to anyone's next process (another test's, the machine's). So each process is held by a
    pidfd, checked to be in one of the namespaces while held, and signalled through the pidfd,
    which names that process and never its PID's next owner. Processes that fork or enter (`ip
    netns exec`) meanwhile are found by the next scan, until none is left or the time is up."""
    inodes = {ino for ino in (netns.inode(n) for n in namespaces) if ino is not None}
    deadline = time.monotonic() + timeout
    while inodes:
        pids = list(procs.pids_in_ns("net", inodes, include_self=False))
        killed, left = 0, []
        for i in range(0, len(pids), _HELD_AT_ONCE):
            n, still = _kill_held(pids[i:i + _HELD_AT_ONCE], inodes, deadline)
            killed, left = killed + n, left + still
        if left or not killed:   # the time is up, or no process of the namespaces is left
            return left
        if time.monotonic() >= deadline:
            return sorted(procs.pids_in_ns("net", inodes, include_self=False))
    return []


def _kill_held(pids: list[int], inodes: set[int], deadline: float) -> tuple[int, list[int]]:
    """SIGKILL those of `pids` that, held by a pidfd, are in one of the namespaces `inodes`; wait
    until they have ended (reaping our own children) or the deadline. Returns how many were
    signalled and the PIDs still running."""
    held: dict[int, int] = {}   # pidfd -> pid
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:   # ended since the scan
                continue
            # while the held process lives, /proc/PID is that process; if it ended just now, the
            # signal below reaches no one (a newcomer on its PID is the next scan's)
            if procs.ns_inode(pid, "net") in inodes:
                held[fd] = pid
            else:
                os.close(fd)
        for fd in held:
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller = select.poll()
        for fd in held:
            poller.register(fd, select.POLLIN)   # readable once the process has ended
        running = dict(held)
        while running:
            for fd, _event in poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                with suppress(ChildProcessError):   # ours: reaped, no zombie left; others' parents reap
                    os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
                poller.unregister(fd)
                del running[fd]
            if time.monotonic() >= deadline:
                break
        return len(held), sorted(running.values())
    finally:
        for fd in held:
            os.close(fd)


def delete_namespaces(namespaces: Iterable[str]) -> list[str]:
    """Delete namespaces (idempotent); returns those that were there."""
    gone = []
    for name in namespaces:
        if netns.delete(name):
            gone.append(name)
    return gone


def teardown(switch_namespaces: list[str], delay_lines: list[dict[str, Any]], state_dir: str | None = None,
             refused: list[str] | None = None) -> list[str]:
    """Take down what the builder made: delay-line engines, then the switch namespaces (and the
    delayed cut links' own, names.cut_netns). Returns what could not be removed (every step runs
    regardless); records it would not act on go to `refused`."""
    left = stop_delay_lines(delay_lines, refused) if delay_lines else []
    # lines started but not yet recorded (the up died in between) left a pid file
    if state_dir and any(Path(state_dir).glob("dl*.pid")):
        from testbed.net import delayline

        delayline.stop_all(state_dir)
    kill_processes_in(switch_namespaces)
    delete_namespaces(switch_namespaces)
    return left + [f"namespace {n}" for n in switch_namespaces if netns.exists(n)]
