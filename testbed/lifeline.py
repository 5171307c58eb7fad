"""The receiving end of a controller's lifeline: this process's stdin, when a controller on another
host started it over SSH with TESTBED_LIFELINE=stdin (cluster.controller holds the other end).

A leaf: the CLI starts watching it (cli.common.run_app), and what runs below the CLI reads from it
(phantom ranks' announcements, in a run across hosts) without importing the CLI. The hosts'
agents (testbed.agent) read their stdin themselves: its end is their stop.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "TESTBED_LIFELINE"
active = False   # this process was started by a controller with its stdin as the lifeline
_EARLY_MAX = 16 << 20   # input kept until a sink is set (more is dropped: nobody asked for it)
_lock: threading.Lock | None = None   # set once the lifeline is watched
_sink = None
_early = bytearray()


def on_input(sink) -> None:
    """sink(bytes) gets what the controller sends on the lifeline besides its end, in order, from
    the lifeline's thread (it must return quickly); what came before this call first. Phantom
    ranks across hosts use it (testbed.jobs.relay): the real rank's announcements from another
    host. Without a lifeline, nothing ever comes."""
    global _sink
    if _lock is None:
        return
    with _lock:
        _sink = sink
        if _early:
            sink(bytes(_early))
            _early.clear()


def watch() -> bool:
    """TESTBED_LIFELINE=stdin (a controller over SSH sets it): stdin is the controller's lifeline, not
    input. Its end (the controller passed a Ctrl-C on, or died and its SSH session closed) interrupts
    this process as a Ctrl-C on a terminal would. Without a terminal nothing else would: an SSH
    session that goes away sends no signal to a command run without a tty. Returns `active`."""
    global active, _lock
    if os.environ.pop(ENV, None) != "stdin":   # (popped: ranks and commands do not inherit it)
        return active
    active = True
    _lock = threading.Lock()

    def read() -> None:
        try:
            while data := os.read(0, 1 << 16):
                with _lock:
                    if _sink is not None:
                        _sink(data)
                    elif len(_early) + len(data) <= _EARLY_MAX:
                        _early.extend(data)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=read, name="lifeline", daemon=True).start()
    return active
