"""The emulated clock, which the probe installs in every rank.

Under time dilation s (TESTBED_TIME_DILATION > 1, unless
TESTBED_EMULATED_CLOCK=0) time.time, time.perf_counter, time.monotonic (and
their _ns forms) run s times slower from the moment the probe loads, and
time.sleep(x) sleeps s*x, so a script's own throughput figures are the
emulated cluster's. Calls made from the Python parts of torch.distributed,
multiprocessing, threading, asyncio and the like keep real time: their
timeouts and heartbeats are the real machine's (the C++ parts never see the
patch). Functions bound before the probe loaded keep real time too.

Standard library only: it runs inside the user's job.
"""

from __future__ import annotations

import os
import sys
import time

_real_sleep = time.sleep
state = {"emulated": False, "factor": 1.0}   # what the probe's start record says

# Callers from these packages keep real time (timeouts, heartbeats, schedulers).
REAL_TIME_CALLERS = ("torch.distributed", "torch.multiprocessing", "torch.utils.data", "multiprocessing",
                     "concurrent", "asyncio", "threading", "queue", "subprocess", "selectors", "socket",
                     "logging", "_testbed_probe", "_testbed_mirror", "_testbed_groups", "_testbed_clock",
                     "sitecustomize")


def _real_caller():
    try:
        mod = sys._getframe(2).f_globals.get("__name__") or ""
    except ValueError:
        return True
    return mod.startswith(REAL_TIME_CALLERS)


def install(s: float) -> None:
    """Make the time module run s times slower for the user's code (see the module text)."""
    def slowed(real, ns=False):
        a = real()

        def emulated():
            now = real()
            if _real_caller():
                return now
            if ns:
                return a + (now - a) * 1000 // int(s * 1000)
            return a + (now - a) / s

        emulated.__name__ = real.__name__
        emulated.__doc__ = (real.__doc__ or "") + f"\n\n[testbed: emulated clock, {s:g} times slower]"
        emulated.__testbed_probe__ = True
        return emulated

    def sleep(secs):
        if _real_caller():
            return _real_sleep(secs)
        return _real_sleep(secs * s)

    sleep.__doc__ = (time.sleep.__doc__ or "") + f"\n\n[testbed: emulated clock, sleeps {s:g} times longer]"
    sleep.__testbed_probe__ = True
    for fname, ns in (("time", False), ("perf_counter", False), ("monotonic", False),
                      ("time_ns", True), ("perf_counter_ns", True), ("monotonic_ns", True)):
        setattr(time, fname, slowed(getattr(time, fname), ns))
    time.sleep = sleep
    state.update({"emulated": True, "factor": s})


def dilation() -> float:
    """The run's time dilation s (TESTBED_TIME_DILATION), 1 where it is unset or not a factor > 1."""
    try:
        s = float(os.environ.get("TESTBED_TIME_DILATION") or 1.0)
    except ValueError:
        return 1.0
    return s if s > 1 and s == s and s != float("inf") else 1.0
