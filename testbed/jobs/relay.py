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

What the leader writes and what the controller relays is bounded: a line waits for its newline
up to LINE_MAX (testbed.safeio.Lines), then is passed on cut, its rest dropped (a phantom then
fails on it, naming the bad line, rather than waiting for an operation that never comes). On
another host, what waits for a phantom that stopped reading is bounded too (QUEUE_MAX): beyond
it the relay gives up on that host's phantoms (they time out waiting, summary.json says why)
rather than holding the whole job's announcements in memory; its writes never block, so a
phantom that never reads cannot hold the run's end either.

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

from testbed.safeio import Lines

PREFIX = "@mirror "          # a line of `testbed run --this-host-only` carrying an announcement
FIFO_NAME = "relay.fifo"     # the leader's extra FIFO on its host
PIPE_SIZE = 1 << 20          # F_SETPIPE_SZ: bursts of announcements (DDP's buckets) fit
LINE_MAX = 1 << 20           # an announcement line (a new_group of all 8,192 ranks: 39,901 bytes)
QUEUE_MAX = 64 << 20         # relayed bytes waiting for a host's phantoms to read them


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

    def _pass_on(self, line: bytes) -> None:
        if line:
            self.lines += 1
            self.ended = self.ended or _is_end(line)
            self.send(line)

    def _pump(self, fd: int) -> None:
        cut = Lines(self._pass_on, LINE_MAX)   # a leader that never writes a newline holds LINE_MAX at most
        waiter = select.poll()   # (not select: descriptors above 1,024 are fine)
        waiter.register(fd, select.POLLIN)
        try:
            while not self._stop.is_set():
                if not waiter.poll(200):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return
                cut.feed(chunk)
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
    of `fifos`; `ended` is set once the leader's end has come. `gave_up` says why the relay stopped
    early (its phantoms left QUEUE_MAX unread), or is None."""

    def __init__(self, fifos: Sequence[str]):
        self.fds = [_open_fifo(f) for f in fifos]
        for fd in self.fds:
            os.set_blocking(fd, False)   # a full FIFO waits in poll, where close() can end it
        self.ended = threading.Event()
        self.bytes = 0
        self.gave_up: str | None = None
        self._queued = 0
        self._count = threading.Lock()
        self._closing = threading.Event()
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lines = Lines(self._heard, LINE_MAX)   # (only to see the end: the bytes go on as they came)
        self._thread = threading.Thread(target=self._write, name="relay-in", daemon=True)
        self._thread.start()

    def __call__(self, data: bytes) -> None:
        """Called from the lifeline's reader: queue and return at once (or drop, once given up)."""
        with self._count:
            if self.gave_up is not None:
                return
            if self._queued + len(data) > QUEUE_MAX:
                self.gave_up = (f"this host's phantoms left {self._queued >> 20} MiB of announcements unread "
                                f"(the bound: {QUEUE_MAX >> 20} MiB); the rest was dropped")
                self._q.put(None)
                return
            self._queued += len(data)
        self._q.put(data)

    def _write(self) -> None:
        waiter = select.poll()
        while (data := self._q.get()) is not None:
            with self._count:
                self._queued -= len(data)
            self.bytes += len(data)
            try:
                for fd in self.fds:
                    view = memoryview(data)
                    while view:
                        try:
                            view = view[os.write(fd, view):]
                        except BlockingIOError:
                            waiter.register(fd, select.POLLOUT)
                            while not waiter.poll(200):
                                if self._closing.is_set():
                                    return
                            waiter.unregister(fd)
            except OSError:
                return   # the run is ending: the FIFOs went with it
            self._lines.feed(data)

    def _heard(self, line: bytes) -> None:
        if _is_end(line):
            self.ended.set()

    def close(self) -> None:
        self._closing.set()
        self._q.put(None)
        self._thread.join(2.0)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
