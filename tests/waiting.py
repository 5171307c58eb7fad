"""Wait on a condition, not a clock: the one polling helper the tests use.

    from waiting import wait_for
    pids = wait_for(lambda: procs.pids_with_env(...), timeout=30, what="the phantom rank's process")

`wait_for` calls `condition()` every `interval` seconds until it returns something truthy and
returns that value. When `timeout` seconds pass first, it raises `WaitTimeout` (an
AssertionError, so pytest shows it as a test failure) saying what it waited for, how long, how
many times it looked, and the last value or exception seen. Exceptions of the types in `ignore`
count as "not yet" (a server not listening yet, a file not written yet); any other exception
propagates at once. `wait_gone(things, ...)` is the other way round: it waits until `things()`
(the processes or files still there) is empty, and names what was left when the time is up.

Conditions the tests share, each read from outside without entering anything:

- `tcp_sockets(pid, port, state, netns=NAME)`: TCP sockets on `port` in the network namespace of a
  process (a server that listens, a flow that is connected), e.g.
  `lambda: tcp_sockets(server.pid, 5201, "LISTEN", netns="tb-x-w1")` (with `netns`, 0 until the
  process is in that namespace: `ip netns exec` and nsenter start in ours).
- `udp_sockets(pid, port, netns=NAME)`: UDP sockets bound to `port` there (a receiver that is ready).
- `capturing(pid)`: a capture (tcpdump) that has bound its packet socket to an interface: what
  crosses the interface from then on is captured.
- `python_frames(pid)` and `paused_at(pid, phase)`: a Python process's main-thread stack, read
  with py-spy; `testbed up` sleeping in its TESTBED_PAUSE_AT=PHASE:SECONDS pause (call
  `need_py_spy(why)` first).

A deadline here is a bound on a hang, not a timing assertion: pick it generously (the condition
is normally met in a fraction of it). Where timing is the feature, measure it and assert it
separately, with the bound and the measurement it comes from stated in the test.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition was not met before the deadline."""


def wait_for(condition: Callable[[], T], *, timeout: float, what: str, interval: float = 0.05,
             ignore: type[BaseException] | tuple[type[BaseException], ...] = ()) -> T:
    """Poll `condition` until it returns a truthy value (returned); WaitTimeout after `timeout` s."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    t0 = time.monotonic()
    deadline = t0 + timeout
    tries = 0
    last: object = None
    last_exc: BaseException | None = None
    while True:
        tries += 1
        try:
            value = condition()
        except ignore as exc:   # "not yet"
            last_exc, value = exc, None
        else:
            last_exc = None
            if value:
                return value
            last = value
        now = time.monotonic()
        if now >= deadline:
            seen = f"last error: {type(last_exc).__name__}: {last_exc}" if last_exc is not None \
                else f"last value: {last!r}"
            raise WaitTimeout(f"timed out after {now - t0:.1f} s waiting for {what} "
                              f"({tries} checks, every {interval:g} s; {seen})")
        time.sleep(min(interval, max(0.0, deadline - now)))


def wait_gone(things: Callable[[], object], *, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `things()` (what is left: processes, files) until it is empty; WaitTimeout after
    `timeout` s, naming what was still there."""
    left: list[object] = [None]

    def gone() -> bool:
        left[0] = things()
        return not left[0]

    try:
        wait_for(gone, timeout=timeout, what=what, interval=interval)
    except WaitTimeout as exc:
        raise WaitTimeout(f"{exc}; still there: {left[0]!r}") from None


def in_netns(pid: int, netns: str | None) -> bool:
    """Process `pid` is in network namespace `netns` (/run/netns/NAME); True when netns is None."""
    if netns is None:
        return True
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return False


def _socket_rows(pid: int, tables: tuple[str, ...]) -> list[list[str]]:
    rows = []
    for table in tables:
        try:
            rows += [r.split() for r in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]]
        except OSError:
            continue
    return rows


def tcp_sockets(pid: int, port: int, state: str, netns: str | None = None) -> int:
    """Sockets in the network namespace of process `pid` with `port` at either end and in
    `state` ("LISTEN", "ESTABLISHED"), read from /proc/PID/net/tcp{,6} (no process of ours enters
    the namespace). 0 when the process is gone, or is not (yet) in namespace `netns`."""
    code = {"LISTEN": "0A", "ESTABLISHED": "01"}[state]
    if not in_netns(pid, netns):
        return 0
    return sum(1 for f in _socket_rows(pid, ("tcp", "tcp6"))
               if f[3] == code and port in (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16)))


def udp_sockets(pid: int, port: int, netns: str | None = None) -> int:
    """UDP sockets bound to local `port` in the network namespace of process `pid` (as tcp_sockets)."""
    if not in_netns(pid, netns):
        return 0
    return sum(1 for f in _socket_rows(pid, ("udp", "udp6")) if int(f[1].rsplit(":", 1)[1], 16) == port)


def capturing(pid: int) -> bool:
    """Process `pid` holds a packet socket bound to an interface (tcpdump, once it captures:
    libpcap binds the socket, then says "listening on"). Read from /proc/PID/net/packet (the
    namespace's packet sockets, with their inode and interface) and /proc/PID/fd."""
    try:
        own = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return False
    for f in _socket_rows(pid, ("packet",)):
        # sk RefCnt Type Proto Iface R(unning) Rmem User Inode: bound to an interface, receiving
        if len(f) >= 9 and f[4] != "0" and f[5] == "1" and f"socket:[{f[8]}]" in own:
            return True
    return False


def need_py_spy(why: str) -> None:
    """Skip the test (fail it where py-spy is required) unless py-spy is there: beside the venv's
    python, where `pip install -e .` puts it, or on PATH."""
    import requires
    from testbed.jobs import stacks

    requires.need("py-spy", ok=stacks.py_spy() is not None, why=why)


def python_frames(pid: int) -> list[tuple[str, str, int]]:
    """The main thread's frames of Python process `pid`, innermost first, as (function, file,
    line), read with py-spy (root); [] while it cannot be read (an interpreter still starting)."""
    from testbed.jobs import stacks

    tool = stacks.py_spy()
    if tool is None:
        raise RuntimeError("py-spy is not installed (pip install -e .): need_py_spy() first")
    return stacks._dump(tool, pid, {}).frames


def paused_at(pid: int, phase: str) -> bool:
    """`testbed up` (process `pid`, started with TESTBED_PAUSE_AT=PHASE:SECONDS) has reached its
    pause at `phase`: its main thread is in interrupts.checkpoint, called from the line of up that
    says `checkpoint("PHASE")` (so everything up does before that phase's end is done)."""
    from testbed import lifecycle

    source = Path(lifecycle.__file__).read_text().splitlines()
    lines = {i + 1 for i, text in enumerate(source) if f'checkpoint("{phase}")' in text}
    if not lines:
        raise ValueError(f"no checkpoint({phase!r}) in {lifecycle.__file__}")
    frames = python_frames(pid)
    return len(frames) >= 2 and frames[0][0] == "checkpoint" and frames[1][0] == "up" and frames[1][2] in lines
