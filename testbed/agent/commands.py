"""A command run in a node for a controller (`testbed exec` across hosts: the agent's `exec` op).

The command runs as a child in a process group of its own, its stdin empty; its output is passed on
as it comes. A stop (the controller's Ctrl-C: its agent's stdin closed) goes to that group as SIGINT,
as a terminal passes one to its foreground group: nsenter forks into a worker's PID namespace and
does not forward signals, the group reaches the command. Nobody is left to press it twice: a group
still there INTERRUPT_GRACE_S later gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from testbed.errors import StateError, TestbedError

INTERRUPT_GRACE_S = 10.0
CHUNK = 1 << 16


def _signal_group(pgid: int, sig: int) -> bool:
    """killpg; False when the group has no process left (0: only ask)."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _interrupt(proc: subprocess.Popen) -> None:
    """SIGINT to the command's group, then SIGTERM, then SIGKILL, each after INTERRUPT_GRACE_S."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if not _signal_group(proc.pid, sig):
            return
        end = time.monotonic() + INTERRUPT_GRACE_S
        while time.monotonic() < end and _signal_group(proc.pid, 0):
            proc.poll()   # (the leader is reaped once it ends; its group lives while members do)
            time.sleep(0.05)
        if not _signal_group(proc.pid, 0):
            return


def run(argv: Sequence[str], emit: Callable[[dict[str, Any]], None], stop: threading.Event | None = None) -> int:
    """argv (a host command line) as a child group; each piece of its output passed to
    emit({"fd": 1 or 2, "data": text}) as it comes (whole characters); `stop` interrupts it. Its
    exit status (128+N for a signal N)."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                process_group=0)
    except OSError as exc:
        raise TestbedError(f"cannot run {argv[0]}: {exc}") from None

    def pump(fd: int, stream: Any) -> None:
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while data := os.read(stream.fileno(), CHUNK):
            text = dec.decode(data)
            if text:
                emit({"fd": fd, "data": text})
        text = dec.decode(b"", final=True)
        if text:
            emit({"fd": fd, "data": text})

    pumps = [threading.Thread(target=pump, args=(fd, s), daemon=True) for fd, s in ((1, proc.stdout), (2, proc.stderr))]
    for t in pumps:
        t.start()
    while proc.poll() is None:
        if stop is not None and stop.wait(0.1):
            _interrupt(proc)
            break
        if stop is None:
            proc.wait()
    rc = proc.wait()
    for t in pumps:
        t.join(5)
    return rc if rc >= 0 else 128 - rc


def exec_in_node(name: str, node: str, argv: Sequence[str], emit: Callable[[dict[str, Any]], None],
                 stop: threading.Event | None = None) -> dict[str, Any]:
    """argv inside `node` of testbed `name`, which this host holds (run's terms). {"rc": status}."""
    from testbed import lifecycle
    from testbed import node_exec

    st = lifecycle.load(name)
    part = st.get("part")
    if part is not None and node not in part.get("nodes", ()):
        raise StateError(f"{node} is not on this host ({part.get('host')}): testbed {name} spans several hosts")
    return {"rc": run(node_exec.exec_argv(st, node, argv), emit, stop)}
