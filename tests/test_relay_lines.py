"""Lines from ranks and hosts wait for their newline in bounded buffers (issue #23).

- The relay of phantom announcements (testbed/jobs/relay.py): the leader's host reads the leader's
  FIFO (Outbound), another host notes the leader's end in what the controller relays (Inbound).
- The controller's readers of a host's stdout (testbed/cluster/controller.py, through
  testbed.cluster.remote.lines): here the `part up --check` session of `up`.

Each side is sent 16-32 MiB with no newline. What it holds meanwhile is measured with tracemalloc
(every Python allocation, in every thread of this process, the reader's included); the bound is
three times the line limit (a cut line is held as the buffer, its bytes and, for the controller,
its text while it is passed on) plus what is in flight (a few 1 MiB chunks). The unbounded
readers these replaced kept the whole flood, twice the bound or more. Then a newline and a real line follow, and come
through whole. Real FIFOs and threads; the host is a stand-in that feeds bytes as SSH would.
"""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
from pathlib import Path

from testbed.cluster import remote
from testbed.cluster import up as hosts_up
from testbed.jobs import relay
from waiting import wait_for

MiB = 1 << 20
CHUNK = b"x" * MiB
# Besides a held line: the chunk being read or passed on, its copies in the queue and in Lines'
# slicing (each at most 1 MiB here), tracemalloc's own bookkeeping. 4 MiB is about twice that.
IN_FLIGHT = 4 * MiB


def bound(limit: int) -> int:
    return 3 * limit + IN_FLIGHT


def _peak(fn) -> int:
    """Bytes allocated at the peak while fn() ran, above what was held before it."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


def test_the_leaders_fifo_is_read_in_lines_of_at_most_line_max(tmp_path: Path):
    fifo = tmp_path / relay.FIFO_NAME
    os.mkfifo(fifo, 0o600)
    sent: list[bytes] = []
    out = relay.Outbound(str(fifo), sent.append).start()
    w = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)
    flood = 16 * MiB
    try:
        def leader() -> None:   # a leader that never ends its line, then one that does
            for _ in range(flood // MiB):
                os.write(w, CHUNK)
            os.write(w, b'\n{"ev":"op","op":"allreduce","n":[4]}\n')
            wait_for(lambda: len(sent) == 2, timeout=30, what="both lines passed on")

        grew = _peak(leader)
    finally:
        os.close(w)
        out.stop()
    assert [len(line) for line in sent[:1]] == [relay.LINE_MAX] and sent[0] == b"x" * relay.LINE_MAX
    assert sent[1] == b'{"ev":"op","op":"allreduce","n":[4]}', sent[1][:80]
    assert out.lines == 2 and json.loads(sent[2])["ev"] == "end"   # (stop() tells the end the leader did not)
    assert grew < bound(relay.LINE_MAX), f"the reader held {grew / MiB:.1f} MiB for a {flood / MiB:.0f} MiB line"


def test_what_the_controller_relays_is_seen_in_lines_of_at_most_line_max(tmp_path: Path):
    fifo = tmp_path / "phantom.fifo"
    os.mkfifo(fifo, 0o600)
    drained = [0]
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    stop = threading.Event()

    def phantom() -> None:   # reads everything, as a phantom does
        import select

        p = select.poll()
        p.register(r, select.POLLIN)
        while not stop.is_set():
            if p.poll(100):
                try:
                    drained[0] += len(os.read(r, MiB))
                except BlockingIOError:
                    pass

    reader = threading.Thread(target=phantom, daemon=True)
    reader.start()
    inbound = relay.Inbound([str(fifo)])
    flood = 16 * MiB
    end = b'\n{"ev":"end","t":1}\n'
    try:
        def controller_relays() -> None:
            for i in range(flood // MiB):
                inbound(CHUNK)   # one at a time: what the queue holds is not what is measured
                wait_for(lambda: inbound.bytes == (i + 1) * MiB, timeout=30, what=f"chunk {i} written")
            inbound(end)
            wait_for(inbound.ended.is_set, timeout=30, what="the leader's end seen")

        grew = _peak(controller_relays)
        wait_for(lambda: drained[0] == flood + len(end), timeout=30, what="every byte in the phantom's FIFO")
    finally:
        inbound.close()
        stop.set()
        reader.join(5)
        os.close(r)
    assert grew < bound(relay.LINE_MAX), f"held {grew / MiB:.1f} MiB for a {flood / MiB:.0f} MiB line"


class _FloodingHost:
    """A host's `part up --check` that first sends `flood` bytes with no newline, then its answers
    and what it built, as SshHost.run passes stdout on (on_stdout, in pieces)."""

    name = "h9"
    address = "h9.example"

    def __init__(self, flood: int):
        self.flood = flood

    def run(self, argv, *, stdin=None, timeout=None, check=False, on_stdout=None):
        for _ in range(self.flood // MiB):
            on_stdout(CHUNK)
        on_stdout(b"\n" + json.dumps({"check": {"uid": 0}}).encode() + b"\n")
        on_stdout(json.dumps({"built": True, "name": "t", "nodes": ["s0"]}).encode() + b"\n")
        return remote.RemoteResult(rc=0, stdout="", stderr="", host=self.name, argv=tuple(argv))

    def close(self) -> None:
        pass


def test_a_host_that_never_ends_its_answers_line_holds_at_most_part_line_max():
    flood = 8 * hosts_up.PART_LINE_MAX
    box: dict[str, hosts_up._PartSession] = {}

    def up_asks() -> None:
        s = box["s"] = hosts_up._PartSession(_FloodingHost(flood), ["testbed", "part", "up", "--check"])
        s.send(None)
        s.wait(60)

    grew = _peak(up_asks)
    s = box["s"]
    assert s.done and s.result.rc == 0
    # the cut line is not the answers (refused as JSON); the host's last line still counts
    assert s.answers(0) is None and s.built == {"built": True, "name": "t", "nodes": ["s0"]}
    assert grew < bound(hosts_up.PART_LINE_MAX), \
        f"held {grew / MiB:.1f} MiB of a {flood / MiB:.0f} MiB line (the bound: {hosts_up.PART_LINE_MAX / MiB:.0f} MiB)"


def test_a_phantom_that_stops_reading_costs_at_most_queue_max_and_never_holds_the_end(tmp_path: Path):
    """A phantom that never reads its FIFO: the relay holds at most QUEUE_MAX for it, then gives up
    (saying why) and drops the rest; close() still returns at once (its writes wait in poll, not
    in a blocking write). The unbounded queue this replaced kept every byte the controller sent."""
    import time

    fifo = tmp_path / "stalled.fifo"
    os.mkfifo(fifo, 0o600)
    inbound = relay.Inbound([str(fifo)])
    flood = relay.QUEUE_MAX + 32 * MiB
    try:
        def controller_relays() -> None:
            for _ in range(flood // MiB):
                inbound(b"y" * MiB)   # (a fresh chunk each time: what the queue holds is real memory)

        grew = _peak(controller_relays)
        assert inbound.gave_up is not None and "unread" in inbound.gave_up, inbound.gave_up
        assert grew < relay.QUEUE_MAX + IN_FLIGHT, f"held {grew / MiB:.1f} MiB for a phantom that never read"
        assert inbound.bytes <= relay.QUEUE_MAX + MiB
    finally:
        t0 = time.monotonic()
        inbound.close()
        took = time.monotonic() - t0
    assert took < 1.5, f"close() took {took:.2f} s behind a phantom that never reads"
    assert not inbound._thread.is_alive()
