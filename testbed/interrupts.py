"""Ctrl-C, SIGTERM and SIGHUP during `up`: each rolls the build back (testbed.lifecycle).

A handler raises where the main thread is. Where that exception is swallowed (a weakref callback,
a __del__, an event loop's internals, pyroute2's bare `except: pass` while it parses netlink
replies), the signal stays recorded and the next `checkpoint` between `up`'s phases raises it
again. Test hooks at the checkpoints: TESTBED_FAIL_AT=PHASE raises there, TESTBED_PAUSE_AT=
PHASE:SECONDS sleeps there (tests/waiting.py finds a process paused in one).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from testbed.errors import TestbedError


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that the same rollback runs."""


_signalled: list[int] = []   # INT/TERM/HUP received while the handlers are in place


def _raise(signum: int, frame: Any) -> None:
    _signalled.append(signum)
    raise _as_raised(signum)


def _as_raised(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(f"signal {signum}")


def raise_if_signalled() -> None:
    if _signalled:
        raise _as_raised(_signalled[0])


def checkpoint(phase: str) -> None:
    """Between the phases of `up`: a signal whose exception was swallowed where it landed is raised
    again here; then the test hooks (the module text)."""
    raise_if_signalled()
    fail = os.environ.get("TESTBED_FAIL_AT")
    if fail and fail == phase:
        raise TestbedError(f"injected failure at {phase} (TESTBED_FAIL_AT)")
    pause = os.environ.get("TESTBED_PAUSE_AT")
    if pause:
        p, _, secs = pause.partition(":")
        if p == phase:
            time.sleep(float(secs or 5))
            raise_if_signalled()


class Handlers:
    """The handlers in place for one build; `finish` puts back what was there."""

    def __init__(self) -> None:
        # signals can only be handled in the main thread: a caller in another thread keeps its own
        self.main = threading.current_thread() is threading.main_thread()
        _signalled.clear()
        self.old_term = signal.signal(signal.SIGTERM, _raise) if self.main else None
        self.old_hup = signal.signal(signal.SIGHUP, _raise) if self.main else None
        # (a Ctrl-C this process was started to ignore stays ignored)
        self.ctrl_c = self.main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        self.old_ctrl_c = signal.signal(signal.SIGINT, _raise) if self.ctrl_c else None

    def ignore_during_rollback(self) -> None:
        """A second Ctrl-C or TERM must not stop the rollback (`finish` restores the handlers)."""
        if self.main:
            old_ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.old_ctrl_c = self.old_ctrl_c if self.ctrl_c else old_ignored

    def finish(self) -> None:
        if self.main:
            signal.signal(signal.SIGTERM, self.old_term)
            signal.signal(signal.SIGHUP, self.old_hup)
            if self.old_ctrl_c is not None:
                signal.signal(signal.SIGINT, self.old_ctrl_c)
        _signalled.clear()   # a later `up` in this process starts clean

