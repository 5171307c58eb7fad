"""A testbed's event stream: what changed, when, one JSON object per line.

<root>/NAME/events.jsonl, appended by whoever changes the testbed: `up` (built),
the fault layer (every link, node and partition change it logs), scenarios
(start, each event, end), `testbed run` (start, step milestones, end, verdict),
`testbed capture` (start and end, with the file) and `down` (the last line
before the directory goes). A run keeps the events of its own time span in its
directory (testbed-events.jsonl), so its report can list them after the testbed
is gone. `testbed events` prints
it from the start and can follow it; `top` and `graph` can read it too.

A record: {"t": unix time, "kind": KIND, "what": one line for people, ...}
with KIND one of KINDS. Writes are single O_APPEND writes of one line, so
concurrent writers never interleave within a record; a failed write loses the
event, never the operation that emitted it. Reading trusts nothing: a line
that is not such a record is skipped and counted.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testbed import paths

KINDS = ("up", "down", "link", "node", "partition", "scenario", "run", "verdict", "capture")
MAX_LINE = 16384   # a longer line is not one we wrote


def path(name: str) -> Path:
    return paths.directory(name) / "events.jsonl"


def emit(name: str, kind: str, what: str, **fields: Any) -> None:
    """Append one event to testbed `name`'s stream (nothing when the testbed's directory is gone)."""
    if kind not in KINDS:
        raise ValueError(f"event kind {kind!r} is not one of {', '.join(KINDS)}")
    rec = {"t": time.time(), "kind": kind, "what": what, **fields}
    line = (json.dumps(rec, default=str, separators=(",", ":")) + "\n").encode()
    if len(line) > MAX_LINE:
        line = (json.dumps({"t": rec["t"], "kind": kind, "what": what[:1000]}, separators=(",", ":")) + "\n").encode()
    try:
        fd = os.open(path(name), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return   # no directory (a testbed going away): nobody left to tell
    try:
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def parse(line: bytes) -> dict[str, Any] | None:
    """One record from one line, or None when the line is not a record."""
    if len(line) > MAX_LINE:
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("kind") not in KINDS or not isinstance(rec.get("what"), str) \
            or not isinstance(rec.get("t"), (int, float)) or isinstance(rec.get("t"), bool):
        return None
    return rec


def read(name: str, *, follow: bool = False, poll_s: float = 0.2, stop_after_s: float | None = None,
         skipped: list[int] | None = None, stop: threading.Event | None = None) -> Iterator[dict[str, Any]]:
    """Every record from the start; with follow, then the new ones as they come, until the testbed's
    directory is gone (after `down`), stop_after_s or `stop` is set. Lines that are not records add
    to skipped[0]."""
    p = path(name)
    offset = 0
    partial = b""
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
    while True:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                if os.fstat(fd).st_size < offset:   # replaced (a testbed of the same name came up again)
                    offset, partial = 0, b""
                os.lseek(fd, offset, os.SEEK_SET)
                while chunk := os.read(fd, 1 << 16):
                    offset += len(chunk)
                    *lines, partial = (partial + chunk).split(b"\n")
                    for line in lines:
                        rec = parse(line)
                        if rec is not None:
                            yield rec
                        elif line.strip() and skipped is not None:
                            skipped[0] += 1
            finally:
                os.close(fd)
        if not follow or (deadline is not None and time.monotonic() >= deadline):
            return
        if not p.parent.is_dir():
            return   # the testbed went down: its stream ended with it
        if stop is None:
            time.sleep(poll_s)
        elif stop.wait(poll_s):
            return


def describe(rec: dict[str, Any], host_width: int | None = None) -> str:
    """A record as one line for people: time, kind, what. host_width: the record's `host` after the
    time, in a column that wide (the events of a testbed over several hosts)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(rec["t"])) + f".{int(rec['t'] * 1000) % 1000:03d}"
    host = "" if host_width is None else f"{rec.get('host') or '-':<{host_width}}  "
    return f"{stamp}  {host}{rec['kind']:<9} {rec['what']}"
