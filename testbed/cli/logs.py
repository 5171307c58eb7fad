"""testbed logs NODE [-f]: the output of the jobs started in a node.

Jobs write their output under the node's log directory,
/run/testbed/NAME/logs/NODE/ (TESTBED_LOG_DIR inside the worker; see
testbed/runtime/env.py), one file per job. This prints every non-empty file
there, oldest first, with a `==> file <==` header when there are several;
with -f it keeps following them, new files included, until Ctrl-C.

A testbed over several hosts: the logs are on the node's host, where this
runs (its output comes back when it ends); with -f its output streams back as
it comes, and a Ctrl-C here ends the `logs -f` there (its lifeline, as for exec).
"""

from __future__ import annotations

import codecs
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Optional

import typer

from testbed import safeio, terminal
from testbed.cli.common import NameOption, resolve_name
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
         poll_s: float = 0.2, stop_after_s: float | None = None) -> int:
    """Print the logs under d (and follow them); return how many files were shown. What a job
    wrote is shown inert (testbed.terminal: no escape sequence reaches the terminal)."""
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
            time.sleep(poll_s)   # (the poll period: a log has no event to wait on)
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


def _across_hosts(tb: str, node: str, follow: bool, tail: int | None) -> None:
    """logs of a node of a testbed over several hosts: run on its host, its output passed on."""
    from testbed.cli.attach import node_host
    from testbed.cluster import controller

    argv = ["logs", node, "--name", tb, *([] if tail is None else ["--tail", str(tail)])]
    node_host(tb, node)   # an unknown node: said here, before connecting
    # the host's words are shown inert, as a job's are on one host: the host may be hostile too
    if follow:   # streamed as it comes, until Ctrl-C (passed on: the host's `logs -f` ends)
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def out(data: bytes) -> None:
            sys.stdout.write(terminal.inert(dec.decode(data)))
            sys.stdout.flush()

        r = controller.run_on_node_host(tb, node, [*argv, "-f"], lifeline=True, on_stdout=out)
        sys.stderr.write(terminal.inert(r.stderr))
        raise typer.Exit(r.rc if r.rc >= 0 else 1)   # (a Ctrl-C ends it with 0 there, as on one host)
    r = controller.run_on_node_host(tb, node, argv)
    sys.stdout.write(terminal.inert(r.stdout))
    sys.stdout.flush()
    sys.stderr.write(terminal.inert(r.stderr))
    if r.rc != 0:
        raise typer.Exit(r.rc if r.rc > 0 else 1)


def register(app: typer.Typer) -> None:
    @app.command(help="Show the output of the jobs started in NODE (-f: keep following it).")
    def logs(node: str = typer.Argument(..., help="The worker (or switch) whose logs to show."),
             follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output until Ctrl-C."),
             tail: Optional[int] = typer.Option(None, "--tail", help="Only the last N lines of each file."),
             name: Optional[str] = NameOption) -> None:
        from testbed import lifecycle
        from testbed.cli.common import err_console
        from testbed.runtime.env import log_dir

        tb = resolve_name(name, clusters=True)
        from testbed.cli.attach import spread

        if spread(tb):
            _across_hosts(tb, node, follow, tail)
            return
        st = lifecycle.load(tb)
        nodes = [n["name"] for n in st.get("topology", {}).get("nodes", [])]
        if node not in nodes:
            raise StateError(f"testbed {tb!r} has no node {node!r}; nodes: {', '.join(nodes[:12])}"
                             f"{' ...' if len(nodes) > 12 else ''}")
        part = st.get("part")
        if part is not None and node not in part.get("nodes", ()):
            raise StateError(f"{node} is not on this host ({part.get('host')}): testbed {tb} spans several hosts; "
                             f"run it on the controller (where `testbed up --hosts` ran), which asks {node}'s host")
        d = log_dir(tb, node)
        shown = show(d, follow=follow, lines=tail)
        if not shown and not follow:
            err_console.print(f"no output from jobs in {node} yet (they write to {d})", highlight=False)
