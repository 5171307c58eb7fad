"""Phantom ranks across hosts: the real rank's announcements carried to the phantoms of other hosts.

On one host the leading real rank writes each announcement straight into every
phantom's FIFO (jobs/phantom.py, probe/_testbed_mirror.py). Over several hosts
the phantoms of the other hosts have their FIFOs there, so the controller
carries the lines, over the SSH sessions it already holds (never over the
emulated network, whose traffic must stay the job's):

- on the leader's host, the leader gets one more FIFO; `Outbound` reads it and
  hands every line to `send` (the host's `testbed run` prints it, marked, on
  the stdout the controller reads);
- the controller passes each line to the other hosts' runs on their stdin (the
  lifeline: cli/common.on_lifeline_input);
- there, `Inbound` writes what arrives into that host's phantoms' FIFOs (and
  the checking real ranks'), from a thread of its own so that a slow reader
  never holds up the lifeline, and notes the leader's end.

How late each phantom reads an announcement is measured as on one host (its
clock against the leader's): over hosts it includes the relay, and it assumes
the hosts' clocks agree (emulated hosts share one; real hosts need NTP or PTP,
whose error then adds to the figure).
"""

from __future__ import annotations

import json
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Sequence

PREFIX = "@mirror "          # a line of `testbed run --this-host-only` carrying an announcement
FIFO_NAME = "relay.fifo"     # the leader's extra FIFO on its host
PIPE_SIZE = 1 << 20          # F_SETPIPE_SZ: bursts of announcements (DDP's buckets) fit


def _open_fifo(path: str) -> int:
    # O_RDWR: never blocks at open and never sees end-of-file while the other side comes and goes
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, PIPE_SIZE)   # F_SETPIPE_SZ
    except OSError:
        pass
    return fd


def _is_end(line: bytes) -> bool:
    if b'"end"' not in line:   # (cheap: most lines are operations)
        return False
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("ev") == "end"


class Outbound:
    """The leader's host: every whole line the leader writes on `fifo` goes to send(line) (no newline)."""

    def __init__(self, fifo: str, send: Callable[[bytes], None]):
        self.fifo, self.send = fifo, send
        self.lines = 0
        self.ended = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Outbound:
        fd = _open_fifo(self.fifo)
        self._thread = threading.Thread(target=self._pump, args=(fd,), name="relay-out", daemon=True)
        self._thread.start()
        return self

    def _pump(self, fd: int) -> None:
        buf = b""
        try:
            while not self._stop.is_set():
                if not select.select([fd], [], [], 0.2)[0]:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return
                buf += chunk
                *whole, buf = buf.split(b"\n")
                for line in whole:
                    if line:
                        self.lines += 1
                        self.ended = self.ended or _is_end(line)
                        self.send(line)
        except OSError:
            return
        finally:
            os.close(fd)

    def stop(self) -> None:
        """At the run's end: what the leader wrote last is passed on, then the thread ends. Phantoms
        elsewhere that were not told the end (the leader was killed) are told now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if not self.ended:
            self.ended = True
            self.send(json.dumps({"ev": "end", "t": time.time()}).encode())


class Inbound:
    """Another host: what the controller relays (bytes, in order, cut anywhere) goes into every FIFO
    of `fifos`; `ended` is set once the leader's end has come."""

    def __init__(self, fifos: Sequence[str]):
        self.fds = [_open_fifo(f) for f in fifos]
        self.ended = threading.Event()
        self.bytes = 0
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._tail = b""
        self._thread = threading.Thread(target=self._write, name="relay-in", daemon=True)
        self._thread.start()

    def __call__(self, data: bytes) -> None:
        """Called from the lifeline's reader: queue and return at once."""
        self._q.put(data)

    def _write(self) -> None:
        while (data := self._q.get()) is not None:
            self.bytes += len(data)
            try:
                for fd in self.fds:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
            except OSError:
                return   # the run is ending: the FIFOs went with it
            *whole, self._tail = (self._tail + data).split(b"\n")
            if any(_is_end(ln) for ln in whole):
                self.ended.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(2.0)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
