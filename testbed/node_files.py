"""Files in and out of a node (`testbed cp`): tar streams through the node's runtime.

A path inside a node is written NODE:PATH; anything else is a path on this host. The rules, the
checks on a tar stream that comes in, and how a copy lands: testbed/cli/cp.py's text (the verb's
help). Copying goes through the node's runtime (`exec` of cat/tar inside it), so it sees what the
node sees. What a node's command prints is read up to a bound (OUTPUT_MAX), never kept whole.
"""

from __future__ import annotations

import os
import secrets
import selectors
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from testbed import nodeside, terminal
from testbed.errors import TestbedError
from testbed.tarstream import Gate, Refused


STDERR_MAX = 64 << 10   # of what a side's command said: its start
OUTPUT_MAX = 4 << 20    # what a node's look or step prints, on each stream (a few lines): past it, it is ended
# cp's looks and steps inside a node, sh programs (testbed/nodeside/: each says what it takes)
_KINDS = nodeside.text("cp_kinds.sh")
_UNPACK = nodeside.text("cp_unpack.sh")
_HERE_OPTIONS = ["--no-same-owner"]   # (unpacking onto this machine: the caller's files, not the stream's owners')
_PLACE = nodeside.text("cp_place.sh")
_MERGE = nodeside.text("cp_merge.sh")


class CopyFailed(TestbedError):
    """One side of a copy across hosts failed; exits with that side's status when it has one."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.exit_code = code if code in (1, 2, 3, 4) else 1


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


def where(side: Side, path: str | None = None) -> str:
    p = side.path if path is None else path
    return f"{side.node}:{p}" if side.node else p


def write_all(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    return write


class Copier:
    def __init__(self, st: dict[str, Any] | None):
        from testbed.node_exec import node_target

        self.st = st
        self._target = node_target

    def argv(self, side: Side, argv: list[str]) -> list[str]:
        if side.node is None:
            return argv
        assert self.st is not None
        rt, rec, _ = self._target(self.st, side.node)
        return rt.exec_argv(side.node, rec, argv)

    def kinds(self, side: Side, *paths: str) -> tuple[list[str], bool, str]:
        """The kind of each path (as kind()) in one look; whether the first is a symbolic link, and
        its real path ('' when it has none)."""
        if side.node is None:
            ks = ["d" if os.path.isdir(p) else "f" if os.path.exists(p) else "-" for p in paths]
            return ks, os.path.islink(paths[0]), os.path.realpath(paths[0])
        what = f"cannot look at {where(side)}"
        r = _bounded(self.argv(side, ["/bin/sh", "-c", _KINDS, "sh", *paths]), what)
        out = r.stdout.decode(errors="surrogateescape").split("\n")
        if r.returncode != 0 or len(out) < len(paths) + 2:
            raise TestbedError(f"{what}: {_said(r)}")
        real = "\n".join(out[len(paths) + 1:]).removesuffix("\n")
        return [(k or "-")[:1] for k in out[:len(paths)]], out[len(paths)] == "L", real

    def copy(self, src: Side, dst: Side) -> None:
        """src to dst on this host (a node and this machine, or two nodes): src read as a tar stream
        and put at dst by receive(), so what lands passes the same gate as a stream from elsewhere
        (no devices, no set-id bits, no owners, nothing out of place)."""
        argv = self.reader(src)
        what = f"reading {where(src)} failed"
        r = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert r.stdout is not None
        err = StderrTail(r)
        failed: BaseException | None = None
        try:
            self.receive(dst, r.stdout, f"the copy of {where(src)}")
        except (TestbedError, OSError) as exc:
            failed = exc
        finally:
            r.stdout.close()
            if failed is not None and r.poll() is None:
                r.kill()
            rc = r.wait()
        why = err.said(what)
        # the reading side's failure first: the writing side's is then its consequence
        if rc != 0 and not (failed is not None and rc < 0 and not err.over):
            raise TestbedError(f"{what}: {why or f'exit status {rc}'}")
        if failed is not None:
            raise failed

    # -- the `-` sides: a tar stream with one top entry

    def reader(self, src: Side) -> list[str]:
        """The command line (on src's host) that writes src as a tar stream on its stdout: one top
        entry under src's name (a directory's contents under it; src followed when it is a symbolic
        link, as a copy of a file reads what it points to; links below it stay links)."""
        path = os.path.normpath(src.path)
        (k,), link, real = self.kinds(src, path)
        if k == "-":
            raise TestbedError(f"{where(src)}: no such file or directory")
        base = os.path.basename(path)
        if base in ("", ".", ".."):
            base = os.path.basename(real)
        if not base:
            raise Refused(f"{where(src)}: the root directory has no name to copy it under: name a directory in it")
        if k == "d":   # -C follows a link; tar's name "." becomes the top entry's
            name = base.replace("\\", "\\\\").replace("&", "\\&").replace("|", "\\|")
            argv = ["tar", "-C", path, "-cf", "-", f"--transform=s|^\\.|{name}|S", "."]
        else:          # (-h: a file has nothing below it, so only src itself is followed)
            argv = ["tar", "-C", os.path.dirname(path) or ".", "-chf" if link else "-cf", "-", "--", base]
        return self.argv(src, argv)

    def send(self, src: Side, out_fd: int) -> None:
        """`testbed cp NODE:PATH -`: src as a tar stream on out_fd."""
        argv = self.reader(src)
        r = _bounded(argv, f"reading {where(src)} failed", stdout=out_fd)
        if r.returncode != 0:
            raise TestbedError(f"reading {where(src)} failed: {_said(r)}")

    def receive(self, dst: Side, stream: IO[bytes], what: str = "the tar stream on stdin") -> None:
        """`testbed cp - NODE:DST`: the stream's one top entry put at dst (cp's rules), checked as it
        comes (testbed.tarstream: what tar unpacks is the checked members, written anew), unpacked
        next to its place and moved there once whole (a file, or a directory that DST becomes), or
        merged into a directory that exists."""
        gate = Gate(stream, what)
        top, top_dir = gate.first()
        path = dst.path
        parent = os.path.dirname(path.rstrip("/")) or ("/" if path.startswith("/") else ".")
        (dk, tk, pk), _, _ = self.kinds(dst, path, os.path.join(path, top), parent)
        if dk == "d":                     # inside it, under its own name
            target = os.path.join(path, top)
        elif dk == "f":                   # a file is replaced by a file
            if top_dir:
                raise TestbedError(f"cannot copy directory {top!r} onto file {where(dst)}")
            target, tk = path, "f"
        else:                             # DST becomes the copy
            if path.endswith("/") and not top_dir:
                raise TestbedError(f"{where(dst)}: no such directory")
            if pk != "d":
                raise TestbedError(f"{where(dst, parent)}: no such directory")
            target, tk = path.rstrip("/"), "-"
        if top_dir and tk == "f":
            raise TestbedError(f"cannot copy directory {top!r} onto file {where(dst, target)}")
        if not top_dir and tk == "d":
            raise TestbedError(f"cannot copy file {top!r} onto directory {where(dst, target)}")
        tmp = os.path.join(os.path.dirname(target) or ".", f".tbcp-{secrets.token_hex(6)}")
        done = False
        unpack = ["/bin/sh", "-c", _UNPACK, "sh", tmp, *(_HERE_OPTIONS if dst.node is None else [])]
        w = subprocess.Popen(self.argv(dst, unpack), stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, bufsize=0)
        assert w.stdin is not None
        err = StderrTail(w)
        try:
            try:
                gate.pump(write_all(w.stdin.fileno()))
            except BrokenPipeError:
                pass   # tar stopped reading: its status and stderr say why
            finally:
                try:
                    w.stdin.close()
                except BrokenPipeError:
                    pass
            rc = w.wait()
            why = err.said(f"writing {where(dst, target)} failed")
            if rc != 0 or not gate.complete:
                raise TestbedError(f"writing {where(dst, target)} failed: {why or f'tar exit status {rc}'}")
            place = _MERGE if tk == "d" else _PLACE
            r = _bounded(self.argv(dst, ["/bin/sh", "-c", place, "sh", tmp, top, target]),
                         f"writing {where(dst, target)} failed")
            if r.returncode != 0:
                raise TestbedError(f"writing {where(dst, target)} failed: {_said(r)}")
            done = True
        finally:
            if not done:
                if w.poll() is None:
                    try:
                        w.wait(5)
                    except subprocess.TimeoutExpired:
                        w.kill()
                        w.wait()
                try:
                    _bounded(self.argv(dst, ["rm", "-rf", "--", tmp]), f"removing {where(dst, tmp)}")
                except TestbedError:
                    pass


def _bounded(argv: list[str], what: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess:
    """argv run to its end, what it prints kept: a node's command is not trusted to print little, so
    more than OUTPUT_MAX on stdout or stderr ends it and is an error (`what`, then the limit)."""
    p = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE)
    kept = {f: bytearray() for f in (p.stdout, p.stderr) if f is not None}
    over = None
    try:
        with selectors.DefaultSelector() as sel:
            for f in kept:
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map() and over is None:
                for key, _ in sel.select():
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fileobj)
                    elif len(kept[key.fileobj]) + len(data) > OUTPUT_MAX:
                        over = "stdout" if key.fileobj is p.stdout else "stderr"
                        break
                    else:
                        kept[key.fileobj] += data
    finally:
        if p.poll() is None and over is not None:
            p.kill()
        for f in kept:
            f.close()
        rc = p.wait()
    if over is not None:
        raise TestbedError(f"{what}: its command printed more than {OUTPUT_MAX >> 20} MiB on {over} "
                           "(the most testbed reads of a node's command): ended")
    return subprocess.CompletedProcess(argv, rc, bytes(kept.get(p.stdout, b"")), bytes(kept[p.stderr]))


class StderrTail:
    """A running command's stderr, read on a thread as it comes (a pipe left unread would stall it):
    its first OUTPUT_MAX bytes are kept; a command that prints more is ended, never written to disk
    or kept whole (a node's command is not trusted to print little)."""

    def __init__(self, p: subprocess.Popen) -> None:
        assert p.stderr is not None
        self.p, self.kept, self.over = p, bytearray(), False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        assert self.p.stderr is not None
        try:
            while data := os.read(self.p.stderr.fileno(), 1 << 16):
                if len(self.kept) + len(data) > OUTPUT_MAX:
                    self.over = True
                    self.p.kill()
                    return
                self.kept += data
        finally:
            self.p.stderr.close()

    def said(self, what: str) -> str:
        """Once the command ended: what it said (its start, without escape sequences). TestbedError
        (`what`, then the limit) when it printed past the bound and was ended for it."""
        self._thread.join()
        if self.over:
            raise TestbedError(f"{what}: its command printed more than {OUTPUT_MAX >> 20} MiB on stderr "
                               "(the most testbed reads of a node's command): ended")
        return terminal.inert(bytes(self.kept[:STDERR_MAX]).decode(errors="replace").strip())


def _said(r: subprocess.CompletedProcess) -> str:
    """What a failed command said on stderr (its start, without escape sequences), or its status."""
    return terminal.inert(r.stderr[:STDERR_MAX].decode(errors="replace").strip()) or f"exit status {r.returncode}"


def stdin_stream() -> IO[bytes]:
    if sys.stdin is None or sys.stdin.isatty():
        raise Refused("SRC -: stdin is a terminal, not a tar stream "
                      "(pipe one in: `tar -cf - DIR | testbed cp - NODE:DST`)")
    return sys.stdin.buffer


def stdout_fd() -> int:
    if sys.stdout is None or sys.stdout.isatty():
        raise Refused("DST -: stdout is a terminal; a tar stream goes to a pipe or a file "
                      "(`testbed cp NODE:PATH - | tar -tvf -`)")
    sys.stdout.flush()
    return sys.stdout.fileno()


# -- across hosts -------------------------------------------------------------------------------------


def copy_here(name: str, src: str, dst: str) -> None:
    """`testbed cp SRC DST` on a testbed of this host (or this host's nodes of one over several)."""
    from testbed import lifecycle

    if src == "-" and dst == "-":
        raise Refused("SRC and DST are both -: one of them must be NODE:PATH")
    st = lifecycle.load(name)
    nodes = {n["name"] for n in st.get("topology", {}).get("nodes", [])}
    s = None if src == "-" else parse(src, nodes)
    d = None if dst == "-" else parse(dst, nodes)
    if not (s is not None and s.node or d is not None and d.node):
        raise TestbedError("one of SRC and DST must be NODE:PATH (a path inside a node)")
    if s is None:
        assert d is not None
        Copier(st).receive(d, stdin_stream())
    elif d is None:
        Copier(st).send(s, stdout_fd())
    else:
        Copier(st).copy(s, d)
