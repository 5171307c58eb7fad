"""`testbed agent`: answer a controller's requests on stdin, one reply a line on stdout.

A request is carried out by testbed.agent.ops on this host's state, in the order it came; a request
that fails gets its error as its reply and the agent reads on. End of stdin ends the agent."""

from __future__ import annotations

import sys
from typing import IO, Any

from testbed.agent import ops, protocol
from testbed.errors import TestbedError

LINE_MAX = 1 << 20   # a request is small; a longer line is refused whole


def answer(req: Any) -> Any:
    """What `req` (a protocol request) asks, done on this host: its reply's value."""
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
    raise protocol.ProtocolError(f"op: no op {op!r}")   # (REQUESTS admits none other)


def _reply(line: str) -> str:
    try:
        req = protocol.read_request(line)
    except protocol.ProtocolError as exc:
        return protocol.reply_error(f"request: {exc}", 2)
    try:
        return protocol.reply_ok(answer(req))
    except TestbedError as exc:
        return protocol.reply_error(str(exc), exc.exit_code)
    except OSError as exc:
        return protocol.reply_error(str(exc), 1)


def serve(stdin: IO[bytes] | None = None, stdout: IO[str] | None = None) -> None:
    """Say hello, then one reply per request line until stdin ends."""
    src = stdin if stdin is not None else sys.stdin.buffer
    out = stdout if stdout is not None else sys.stdout
    out.write(protocol.hello() + "\n")
    out.flush()
    while True:
        raw = src.readline(LINE_MAX + 1)
        if not raw:
            return
        if len(raw) > LINE_MAX and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):   # (the rest of that line is read and dropped)
                raw = src.readline(LINE_MAX + 1)
            out.write(protocol.reply_error(f"request: a line over {LINE_MAX} bytes", 2) + "\n")
        elif raw.strip():
            out.write(_reply(raw.decode("utf-8", "replace")) + "\n")
        else:
            continue
        out.flush()
