"""testbed cp SRC DST: copy files between the host and nodes (or node to node).

A path inside a node is written NODE:PATH (`w3:/tmp/out.txt`); anything else
is a path on the host. Semantics follow `docker cp` / `cp -r`:

- a file to an existing directory lands inside it; otherwise it is written
  to DST itself;
- a directory to an existing directory lands inside it (DST/NAME); to a path
  that does not exist yet, DST becomes the copy.

Copying goes through the node's runtime (`exec` of cat/tar inside it), so it
sees what the node sees: its private /tmp, its /etc/hosts; with the netns
runtime that is `nsenter -t PID -a` into its mount namespace.

A testbed over several hosts: a copy between two nodes of one host runs on
that host; a copy that involves this machine's files or two hosts is not
built yet: it is refused (exit 2) with the two steps that do it over SSH
(`scp` between this machine and the node's host, `testbed cp` there).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, require_root, resolve_name
from testbed.errors import TestbedError

_STAT = 'if [ -d "$1" ]; then echo d; elif [ -e "$1" ]; then echo f; else echo -; fi'


@dataclass
class Side:
    node: str | None          # None: the host
    path: str


def parse(spec: str, nodes: set[str]) -> Side:
    """NODE:PATH when NODE is a node of the testbed, else a host path."""
    head, sep, tail = spec.partition(":")
    if sep and head in nodes and "/" not in head:
        return Side(head, tail or ".")
    return Side(None, spec)


class Copier:
    def __init__(self, st: dict[str, Any]):
        from testbed.cli.attach import node_target

        self.st = st
        self._target = node_target

    def argv(self, side: Side, argv: list[str]) -> list[str]:
        if side.node is None:
            return argv
        rt, rec, _ = self._target(self.st, side.node)
        return rt.exec_argv(side.node, rec, argv)

    def kind(self, side: Side, path: str | None = None) -> str:
        """'d' directory, 'f' other existing file, '-' missing."""
        p = path or side.path
        if side.node is None:
            return "d" if os.path.isdir(p) else "f" if os.path.lexists(p) else "-"
        r = subprocess.run(self.argv(side, ["/bin/sh", "-c", _STAT, "sh", p]), capture_output=True, text=True)
        if r.returncode != 0:
            raise TestbedError(f"cannot look at {side.node}:{p}: {r.stderr.strip() or 'exit status ' + str(r.returncode)}")
        return (r.stdout.strip() or "-")[:1]

    def copy(self, src: Side, dst: Side) -> None:
        sk = self.kind(src)
        where = lambda s: f"{s.node}:{s.path}" if s.node else s.path  # noqa: E731
        if sk == "-":
            raise TestbedError(f"{where(src)}: no such file or directory")
        dk = self.kind(dst)
        base = os.path.basename(src.path.rstrip("/")) or "root"
        if sk == "d":
            if dk == "f":
                raise TestbedError(f"cannot copy directory {where(src)} onto file {where(dst)}")
            if dk == "d":
                reader = ["tar", "-C", os.path.dirname(src.path.rstrip("/")) or "/", "-cf", "-", base]
                writer = ["tar", "-C", dst.path, "-xf", "-"]
            else:
                parent = os.path.dirname(dst.path.rstrip("/")) or "."
                if self.kind(dst, parent) != "d":
                    raise TestbedError(f"{where(Side(dst.node, parent))}: no such directory")
                reader = ["tar", "-C", src.path, "-cf", "-", "."]
                writer = ["/bin/sh", "-c", 'mkdir -p "$1" && exec tar -C "$1" -xf -', "sh", dst.path]
        else:
            if dk == "d":
                target = os.path.join(dst.path, base)
            elif dst.path.endswith("/"):
                raise TestbedError(f"{where(dst)}: no such directory")
            else:
                target = dst.path
            reader = ["cat", src.path]
            writer = ["/bin/sh", "-c", 'exec cat > "$1"', "sh", target]
        self._pipe(self.argv(src, reader), self.argv(dst, writer), where(src), where(dst))

    @staticmethod
    def _pipe(reader: list[str], writer: list[str], s: str, d: str) -> None:
        r = subprocess.Popen(reader, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        w = subprocess.Popen(writer, stdin=r.stdout, stderr=subprocess.PIPE)
        assert r.stdout is not None
        r.stdout.close()
        werr = w.communicate()[1]
        rerr = r.communicate()[1]
        if r.returncode != 0:
            raise TestbedError(f"reading {s} failed: {rerr.decode(errors='replace').strip() or r.returncode}")
        if w.returncode != 0:
            raise TestbedError(f"writing {d} failed: {werr.decode(errors='replace').strip() or w.returncode}")


def _across_hosts(tb: str, src: str, dst: str) -> None:
    """cp on a testbed over several hosts: node to node on one host runs there; anything else is
    refused with the scp and ssh commands that do it."""
    import shlex
    import sys

    from testbed.cli.attach import AcrossHosts, node_host, ssh_command, ssh_login, ssh_options
    from testbed.cluster import controller

    doc = controller.load(tb)
    s, d = parse(src, set(doc["placement"])), parse(dst, set(doc["placement"]))
    if s.node is None and d.node is None:
        raise TestbedError("one of SRC and DST must be NODE:PATH (a path inside a node)")
    hosts = {doc["placement"][x.node] for x in (s, d) if x.node}
    if s.node and d.node and len(hosts) == 1:
        r = controller.run_on_node_host(tb, s.node, ["cp", src, dst, "--name", tb])
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        if r.rc != 0:
            raise typer.Exit(r.rc if r.rc > 0 else 1)
        return
    where = "; ".join(f"{x.node} is on host {doc['placement'][x.node]}" for x in (s, d) if x.node)
    tmp = "/tmp"   # the node's host's: where the file stops on its way

    def scp(a: str, b: str, host) -> str:
        return shlex.join(["scp", "-r", *ssh_options(doc, host, scp=True), a, b])

    def remote(host, path: str) -> str:
        return f"{ssh_login(host, scp=True)}:{path}"

    base = lambda x: os.path.basename(x.path.rstrip("/")) or "root"  # noqa: E731
    if d.node and not s.node:          # this machine -> a node
        _, h = node_host(tb, d.node)
        steps = [scp(s.path, remote(h, tmp + "/"), h),
                 ssh_command(doc, h, ["cp", f"{tmp}/{base(s)}", dst, "--name", tb])]
    elif s.node and not d.node:        # a node -> this machine
        _, h = node_host(tb, s.node)
        steps = [ssh_command(doc, h, ["cp", src, f"{tmp}/", "--name", tb]),
                 scp(remote(h, f"{tmp}/{base(s)}"), d.path, h)]
    else:                              # a node on one host -> a node on another
        _, hs = node_host(tb, s.node)
        _, hd = node_host(tb, d.node)
        steps = [ssh_command(doc, hs, ["cp", src, f"{tmp}/", "--name", tb]),
                 scp(remote(hs, f"{tmp}/{base(s)}"), ".", hs),
                 scp(base(s), remote(hd, tmp + "/"), hd),
                 ssh_command(doc, hd, ["cp", f"{tmp}/{base(s)}", dst, "--name", tb])]
    raise AcrossHosts(f"testbed cp does not copy across hosts yet ({where}; testbed {tb} spans several hosts). "
                      "Copy over SSH instead: " + "; then ".join(f"`{c}`" for c in steps))


def register(app: typer.Typer) -> None:
    @app.command(help="Copy files or directories between the host and nodes: "
                      "`testbed cp w3:/tmp/out.txt .`, `testbed cp ./data w0:/tmp/`, `testbed cp w0:/a w1:/b`.")
    def cp(src: str = typer.Argument(..., help="NODE:PATH or a host path."),
           dst: str = typer.Argument(..., help="NODE:PATH or a host path."),
           name: Optional[str] = NameOption) -> None:
        from testbed import lifecycle

        require_root("cp")
        tb = resolve_name(name, clusters=True)
        from testbed.cli.attach import spread

        if spread(tb):
            _across_hosts(tb, src, dst)
            return
        st = lifecycle.load(tb)
        nodes = {n["name"] for n in st.get("topology", {}).get("nodes", [])}
        s, d = parse(src, nodes), parse(dst, nodes)
        if s.node is None and d.node is None:
            raise TestbedError("one of SRC and DST must be NODE:PATH (a path inside a node)")
        Copier(st).copy(s, d)
