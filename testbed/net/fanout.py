"""Independent per-namespace work spread over the machine's cores, in forked processes.

Configuring a namespace (addresses, shaping, neighbours, routes) is a few
dozen netlink messages that pyroute2 builds in Python: `up` is CPU-bound in
our own process while the kernel side is cheap, and one namespace's work does
not depend on another's. So `each` forks one child per core (at most
`MAX_PROCS`), deals the items out round-robin, and lets every child enter its
namespaces and talk netlink itself. A child reports each item on a pipe (one
JSON line: its index and a small result, or the error it raised) and stops at
its first error; the parent turns reports into progress ticks and raises the
first error by item order, naming the item, after every child has exited.
Children are ours by PID, die with the parent (PDEATHSIG), and leave nothing
behind outside the namespaces they configured, so the caller's rollback (which
removes those namespaces) stays complete.

With one core, or few items, the work runs inline: the same results, the
same errors.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from testbed.errors import TestbedError

T = TypeVar("T")

MAX_PROCS = 8
MIN_ITEMS_PER_PROC = 16   # below this, a fork costs more than it saves
_PR_SET_PDEATHSIG = 1


class FanoutError(TestbedError):
    """An item's work failed (in a child or inline): which item, and the error."""


def procs_for(n_items: int, min_per_proc: int = MIN_ITEMS_PER_PROC) -> int:
    """One per core we may run on (TESTBED_BUILD_PROCS caps it: 1 runs everything inline, e.g. on a
    machine shared with a benchmark), at most MAX_PROCS, none for fewer than min_per_proc items each."""
    cores = len(os.sched_getaffinity(0))
    cap = os.environ.get("TESTBED_BUILD_PROCS", "")
    if cap.isdigit() and int(cap) >= 1:
        cores = min(cores, int(cap))
    return max(1, min(cores, MAX_PROCS, n_items // min_per_proc))


def each(items: Sequence[T], work: Callable[[T], dict[str, Any]], *, name: Callable[[T], str] = str,
         on_done: Callable[[int, dict[str, Any]], None] | None = None, procs: int | None = None,
         min_per_proc: int = MIN_ITEMS_PER_PROC) -> None:
    """work(item) for every item, spread over `procs` processes (default: procs_for(len(items),
    min_per_proc): cheap items need more of them to pay for a fork); on_done(i, result) in this
    process as each completes. Raises FanoutError for the first item (by order) that failed."""
    procs = procs_for(len(items), min_per_proc) if procs is None else max(1, procs)
    if procs == 1:
        for i, item in enumerate(items):
            try:
                result = work(item)
            except TestbedError:
                raise
            except Exception as exc:
                raise FanoutError(f"{name(item)}: {exc}") from exc
            if on_done is not None:
                on_done(i, result)
        return
    children: dict[int, int] = {}   # pid -> read end of its pipe
    sel = selectors.DefaultSelector()
    errors: dict[int, str] = {}
    reported: set[int] = set()
    buffers: dict[int, bytes] = {}
    try:
        for k in range(procs):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:   # the child: never returns
                os.close(r)
                _child(items, k, procs, work, w)
            os.close(w)
            children[pid] = r
            buffers[r] = b""
            sel.register(r, selectors.EVENT_READ)
        open_fds = set(children.values())
        while open_fds:
            for key, _ in sel.select():
                fd = key.fd
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                *lines, buffers[fd] = (buffers[fd] + chunk).split(b"\n")
                for line in lines:
                    rec = json.loads(line)
                    i = int(rec["i"])
                    reported.add(i)
                    if "error" in rec:
                        errors[i] = rec["error"]
                    elif on_done is not None:
                        on_done(i, rec.get("r") or {})
    except BaseException:
        for pid in children:   # interrupted: ours, by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    finally:
        for pid, fd in children.items():
            _reap(pid)
            os.close(fd)
        sel.close()
    if errors:
        i = min(errors)
        raise FanoutError(f"{name(items[i])}: {errors[i]}")
    missing = [i for i in range(len(items)) if i not in reported]
    if missing:   # a child died without a word (killed, out of memory)
        raise FanoutError(f"{name(items[missing[0]])}: its worker process ended before reporting it")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _child(items: Sequence[Any], k: int, procs: int, work: Callable[[Any], dict[str, Any]], w: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)    # the parent decides about interrupts
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for i in range(k, len(items), procs):
            try:
                rec = {"i": i, "r": work(items[i])}
            except Exception as exc:   # reported by item; the parent raises it
                rec = {"i": i, "error": str(exc) or traceback.format_exception_only(exc)[-1].strip()}
                code = 1
            _write_all(w, (json.dumps(rec, default=str) + "\n").encode())
            if code:
                break
    except BaseException:
        code = 2
    finally:
        os._exit(code)   # no atexit handlers, no flush of the parent's buffers


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]
