"""The output of the jobs started in a node (`testbed logs`): the files under its log directory.

Jobs write their output under the node's log directory, /run/testbed/NAME/logs/NODE/
(TESTBED_LOG_DIR inside the worker; see testbed/runtime/env.py), one file per job. `show` prints
every non-empty file there, oldest first, with a `==> file <==` header when there are several; with
follow it keeps following them, new files included. A job's files are read without following a
link it planted or waiting on a FIFO, and what it wrote is passed on inert.
"""

from __future__ import annotations

import codecs
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from testbed import safeio, terminal
from testbed.errors import StateError


LOG_READ_MAX = 16 << 20   # read of one log file at a time: what more a job wrote comes at the next read


def log_files(d: Path) -> list[Path]:
    """The plain files under d (a job's: a link, a FIFO or a directory there is passed over), oldest first."""
    if not d.is_dir():
        return []
    files = []
    for p in d.iterdir():
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            files.append((st.st_mtime, p.name, p))
    return [p for *_k, p in sorted(files)]


def _tail_bytes(data: bytes, lines: int | None) -> bytes:
    if lines is None:
        return data
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def _read(p: Path, offset: int, limit: int = LOG_READ_MAX) -> tuple[bytes, int] | None:
    """(at most `limit` bytes of p from offset, p's size) or None where p is gone or not a plain
    file: the job's files are read without following a link or waiting on a FIFO (testbed.safeio)."""
    try:
        fd = safeio.open_regular(p)
    except (OSError, safeio.Unsafe):
        return None
    try:
        size = os.fstat(fd).st_size
        if size < offset:   # truncated: start over
            offset = 0
        if offset == 0 and size > limit:   # first read of a long file: its end
            offset = size - limit
        return safeio.read_fd_regular(fd, limit, offset, where=str(p)), offset
    except (OSError, safeio.Unsafe):
        return None
    finally:
        os.close(fd)


def show(d: Path, *, follow: bool = False, lines: int | None = None, out: BinaryIO | None = None,
         poll_s: float = 0.2, stop_after_s: float | None = None, stop: threading.Event | None = None) -> int:
    """Print the logs under d (and follow them, until a Ctrl-C, stop_after_s or `stop`); return how
    many files were shown. What a job wrote is shown inert (testbed.terminal: no escape sequence
    reaches the terminal)."""
    out = out or sys.stdout.buffer
    offsets: dict[Path, int] = {}
    decoders: dict[Path, Any] = {}
    last: list[Path | None] = [None]

    def emit(p: Path, data: bytes, many: bool) -> None:
        if not data:
            return
        if many and last[0] != p:
            name = terminal.inert(p.name.encode(errors="surrogateescape").decode(errors="replace"))
            out.write(f"{'' if last[0] is None else chr(10)}==> {name} <==\n".encode())
        last[0] = p
        dec = decoders.setdefault(p, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        out.write(terminal.inert(dec.decode(data)).encode())
        out.flush()

    shown = 0
    files = []
    for p in log_files(d):
        got = _read(p, 0)
        if got is not None and got[0]:
            files.append((p, got))
    many = len(files) > 1 or follow
    for p, (data, start) in files:
        offsets[p] = start + len(data)
        emit(p, _tail_bytes(data, lines), many)
        shown += 1
    if not follow:
        return shown
    t0 = time.monotonic()
    try:
        while stop_after_s is None or time.monotonic() - t0 < stop_after_s:
            # (the poll period: a log has no event to wait on)
            if stop is None:
                time.sleep(poll_s)
            elif stop.wait(poll_s):
                break
            for p in log_files(d):
                got = _read(p, offsets.get(p, 0))
                if got is None:
                    continue
                data, start = got
                if data:
                    offsets[p] = start + len(data)
                    emit(p, data, True)
    except KeyboardInterrupt:
        pass
    return len(offsets)


def node_logs(name: str, node: str, *, follow: bool = False, lines: int | None = None,
              out: BinaryIO | None = None, stop: threading.Event | None = None) -> tuple[int, Path]:
    """`show` of the logs of `node` of testbed `name`, which this host holds: (files shown, the
    directory). A node this host does not hold, of a testbed over several hosts, is refused."""
    from testbed import lifecycle
    from testbed.runtime.env import log_dir

    st = lifecycle.load(name)
    nodes = [n["name"] for n in st.get("topology", {}).get("nodes", [])]
    if node not in nodes:
        raise StateError(f"testbed {name!r} has no node {node!r}; nodes: {', '.join(nodes[:12])}"
                         f"{' ...' if len(nodes) > 12 else ''}")
    part = st.get("part")
    if part is not None and node not in part.get("nodes", ()):
        raise StateError(f"{node} is not on this host ({part.get('host')}): testbed {name} spans several hosts; "
                         f"run it on the controller (where `testbed up --hosts` ran), which asks {node}'s host")
    d = log_dir(name, node)
    return show(d, follow=follow, lines=lines, out=out, stop=stop), d
