"""`testbed agent`: answer a controller's requests on stdin, one reply a line on stdout.

A request is carried out by testbed.agent.ops on this host's state, in the order it came; a request
that fails gets its error as its reply and the agent reads on. A stream op writes its items as they
come, then its reply. End of stdin ends the agent once what came before it is answered, and a
stream that follows stops at once: that is how the controller passes a Ctrl-C on."""

from __future__ import annotations

import queue
import sys
import threading
from typing import IO, Any

from testbed.agent import ops, protocol
from testbed.errors import TestbedError

LINE_MAX = 1 << 20   # a request is small; a longer line is refused whole
_TOO_LONG = object()


def answer(req: Any, emit: Any = None, stop: threading.Event | None = None) -> Any:
    """What `req` (a protocol request) asks, done on this host: its reply's value. A stream op passes
    each item to emit(item) first, and ends early once `stop` is set."""
    op = req.op
    if op == "status":
        return ops.status(req.name)
    if op == "link.show":
        return ops.link_show(req.name)
    if op == "link.set":
        return ops.link_set(req.name, req.a, req.b, dict(req.changes), req.direction)
    if op == "link.down":
        return ops.link_down(req.name, req.a, req.b)
    if op == "link.up":
        return ops.link_up(req.name, req.a, req.b)
    if op == "link.reset":
        return ops.link_reset(req.name, req.a, req.b)
    if op == "partition":
        return ops.partition(req.name, [list(g) for g in req.groups])
    if op == "heal":
        return ops.heal(req.name)
    if op == "node":
        return ops.node(req.name, req.verb, req.node, req.cpus)
    if op == "ps":
        return ops.ps(req.name, list(req.nodes), req.all_nodes)
    if op == "stacks":
        return ops.stacks(req.name)
    if op.startswith("scenario."):
        from testbed.agent import scenario

        act = {"scenario.check": scenario.check_here, "scenario.apply": scenario.apply_here,
               "scenario.restore": scenario.restore_here}[op]
        return act(req.name, dict(req.data))
    if op == "exec":
        from testbed.agent.commands import exec_in_node

        return exec_in_node(req.name, req.node, list(req.argv), emit, stop)
    if op == "top":
        return ops.top(req.name, req.interval, req.runs, emit, stop)
    if op == "logs":
        return ops.logs(req.name, req.node, req.follow, req.tail, emit, stop)
    if op == "events":
        return ops.events(req.name, None if req.kinds is None else list(req.kinds), req.follow, emit, stop)
    raise protocol.ProtocolError(f"op: no op {op!r}")   # (protocol.request admits none other)


class _Out:
    """stdout, one whole line at a time (a stream's items come from the op's thread)."""

    def __init__(self, out: IO[str]):
        self._out, self._lock = out, threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self._out.write(text + "\n")
            self._out.flush()


def _reply(raw: Any, out: _Out, closed: threading.Event, only: str | None) -> str:
    if raw is _TOO_LONG:
        return protocol.reply_error(f"request: a line over {LINE_MAX} bytes", 2)
    try:
        req = protocol.read_request(raw.decode("utf-8", "replace"))
    except protocol.ProtocolError as exc:
        return protocol.reply_error(f"request: {exc}", 2)
    if only is not None and req.name != only:
        return protocol.reply_error(f"request: this agent serves testbed {only!r}, not {req.name!r}", 2)
    try:
        return protocol.reply_ok(answer(req, lambda item: out.line(protocol.item_line(item)), closed))
    except TestbedError as exc:
        return protocol.reply_error(str(exc), exc.exit_code)
    except OSError as exc:
        return protocol.reply_error(str(exc), 1)


def _read(src: IO[bytes], lines: queue.Queue, closed: threading.Event) -> None:
    """stdin's lines into `lines` (an over-long one as _TOO_LONG, its rest dropped); its end sets `closed`."""
    try:
        while raw := src.readline(LINE_MAX + 1):
            if len(raw) > LINE_MAX and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):
                    raw = src.readline(LINE_MAX + 1)
                lines.put(_TOO_LONG)
            elif raw.strip():
                lines.put(raw)
    except (OSError, ValueError):
        pass
    finally:
        closed.set()
        lines.put(None)


def serve(stdin: IO[bytes] | None = None, stdout: IO[str] | None = None, *, only: str | None = None) -> None:
    """Say hello, then one reply per request line until stdin ends. only: the testbed this session
    is about (a request about another is refused)."""
    out = _Out(stdout if stdout is not None else sys.stdout)
    lines: queue.Queue = queue.Queue()
    closed = threading.Event()
    threading.Thread(target=_read, args=(stdin if stdin is not None else sys.stdin.buffer, lines, closed),
                     name="agent-stdin", daemon=True).start()
    out.line(protocol.hello())
    while (raw := lines.get()) is not None:
        out.line(_reply(raw, out, closed, only))
