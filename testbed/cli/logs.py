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

import sys
import time
from pathlib import Path
from typing import BinaryIO, Optional

import typer

from testbed.cli.common import NameOption, resolve_name
from testbed.errors import StateError


def log_files(d: Path) -> list[Path]:
    if not d.is_dir():
        return []
    files = [p for p in d.iterdir() if p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def _tail_bytes(data: bytes, lines: int | None) -> bytes:
    if lines is None:
        return data
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def show(d: Path, *, follow: bool = False, lines: int | None = None, out: BinaryIO | None = None,
         poll_s: float = 0.2, stop_after_s: float | None = None) -> int:
    """Print the logs under d (and follow them); return how many files were shown."""
    out = out or sys.stdout.buffer
    offsets: dict[Path, int] = {}
    last: list[Path | None] = [None]

    def emit(p: Path, data: bytes, many: bool) -> None:
        if not data:
            return
        if many and last[0] != p:
            out.write(f"{'' if last[0] is None else chr(10)}==> {p.name} <==\n".encode())
        last[0] = p
        out.write(data)
        out.flush()

    files = [p for p in log_files(d) if p.stat().st_size > 0]
    many = len(files) > 1 or follow
    for p in files:
        with open(p, "rb") as f:
            data = f.read()
        offsets[p] = len(data)
        emit(p, _tail_bytes(data, lines), many)
    if not follow:
        return len(files)
    t0 = time.monotonic()
    try:
        while stop_after_s is None or time.monotonic() - t0 < stop_after_s:
            time.sleep(poll_s)
            for p in log_files(d):
                off = offsets.get(p, 0)
                try:
                    size = p.stat().st_size
                except FileNotFoundError:
                    continue
                if size < off:      # truncated: start over
                    off = 0
                if size > off:
                    with open(p, "rb") as f:
                        f.seek(off)
                        data = f.read()
                    offsets[p] = off + len(data)
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
    if follow:   # streamed as it comes, until Ctrl-C (passed on: the host's `logs -f` ends)
        def out(data: bytes) -> None:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()

        r = controller.run_on_node_host(tb, node, [*argv, "-f"], lifeline=True, on_stdout=out)
        sys.stderr.write(r.stderr)
        raise typer.Exit(r.rc if r.rc >= 0 else 1)   # (a Ctrl-C ends it with 0 there, as on one host)
    r = controller.run_on_node_host(tb, node, argv)
    sys.stdout.write(r.stdout)
    sys.stdout.flush()
    sys.stderr.write(r.stderr)
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
