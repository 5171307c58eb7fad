"""testbed cp SRC DST: copy files between the host and nodes (or node to node).

A path inside a node is written NODE:PATH (`w3:/tmp/out.txt`); anything else
is a path on the host. Semantics follow `docker cp` / `cp -r`:

- a file to an existing directory lands inside it; otherwise it is written
  to DST itself;
- a directory to an existing directory lands inside it (DST/NAME); to a path
  that does not exist yet, DST becomes the copy.

`-` as one side is a tar stream, as with `docker cp`: `testbed cp NODE:PATH -`
writes one to stdout whose single top entry is PATH under its own name (a
symbolic link named as PATH is followed); `testbed cp - NODE:DST` reads one
from stdin and puts its single top entry at DST with the rules above. What
comes in is checked member by member (testbed.tarstream) and written anew
before any of it reaches the node's tar: a stream with more than one top
entry, an absolute path, `..`, a device, or a path through one of its own
symbolic links is refused (exit 2, naming the member); one that stops before
the end of the archive is an error. It is unpacked into a hidden directory
next to its place (`.tbcp-*`) and moved there once whole, so an interrupted
copy never leaves something that looks complete; a directory copied into one
that exists is merged file by file after that, which a failure (a full disk)
can leave half done. Wherever it lands, the files carry no owner of the
stream's (root's, or the caller's: tar's --no-same-owner) and no setuid or setgid
bits. A copy between a node and this machine, or two nodes of one host, takes the
same way: the source is read as a tar stream and passes the same gate.

Copying goes through the node's runtime (`exec` of cat/tar inside it), so it
sees what the node sees: its private /tmp, its /etc/hosts; with the netns
runtime that is `nsenter -t PID -a` into its mount namespace.

A testbed over several hosts: a copy between two nodes of one host runs on
that host; anything else streams through the controller's SSH connections
to the hosts: the side that reads runs `testbed cp NODE:PATH -` on its node's
host (or tar here, for this machine's files), the side that writes runs
`testbed cp - NODE:DST` on its node's host (or the same checked unpacking
here), and the controller passes the tar stream from one to the other, so
nothing stops on a host's disk on the way. A failure names the side (reading
or writing, the node and its host) and what it said.
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
from typing import IO, Any, Optional

import typer

from testbed import terminal
from testbed.cli.common import NameOption, require_root, resolve_name
from testbed.errors import TestbedError
from testbed.tarstream import Gate, Refused

STDERR_MAX = 64 << 10   # of what a side's command said: its start
OUTPUT_MAX = 4 << 20    # what a node's look or step prints, on each stream (a few lines): past it, it is ended
# the kind of each argument, one letter a line; then whether the first is a symbolic link (L or -), and
# where it leads (readlink -f)
_KINDS = ('for p; do if [ -d "$p" ]; then echo d; elif [ -e "$p" ]; then echo f; else echo -; fi; done; '
          'if [ -L "$1" ]; then echo L; else echo -; fi; readlink -f -- "$1" || true')
# $1: a new directory to unpack into; the options that follow go to tar (onto this machine, files are
# the caller's, not the stream's owners')
_UNPACK = 'mkdir -m 700 -- "$1" && cd -- "$1" && shift && exec tar -xf - "$@"'
_HERE_OPTIONS = ["--no-same-owner"]
_PLACE = 'mv -f -T -- "$1/$2" "$3" && rmdir -- "$1"'            # the copy takes its place at once (a rename)
# a directory into one that exists: merged, file by file (not at once: a failure midway leaves part of it);
# an existing entry is replaced, never written through (a symbolic link there stays unfollowed)
_MERGE = 'cp -a --remove-destination -- "$1/$2/." "$3/" && rm -rf -- "$1"'


class _Failed(TestbedError):
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


def _write_all(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    return write


class Copier:
    def __init__(self, st: dict[str, Any] | None):
        from testbed.lifecycle import node_target

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
        err = _Stderr(r)
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
        err = _Stderr(w)
        try:
            try:
                gate.pump(_write_all(w.stdin.fileno()))
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


class _Stderr:
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


def _stdin() -> IO[bytes]:
    if sys.stdin is None or sys.stdin.isatty():
        raise Refused("SRC -: stdin is a terminal, not a tar stream "
                      "(pipe one in: `tar -cf - DIR | testbed cp - NODE:DST`)")
    return sys.stdin.buffer


def _stdout() -> int:
    if sys.stdout is None or sys.stdout.isatty():
        raise Refused("DST -: stdout is a terminal; a tar stream goes to a pipe or a file "
                      "(`testbed cp NODE:PATH - | tar -tvf -`)")
    sys.stdout.flush()
    return sys.stdout.fileno()


# -- across hosts -------------------------------------------------------------------------------------


def _why(res: Any) -> str:
    """One line of why a host's testbed failed: its last error line."""
    lines = [ln.strip() for ln in (res.stderr or res.stdout or "").splitlines() if ln.strip()]
    return lines[-1].removeprefix("error: ") if lines else f"exit status {res.rc}"


def _testbed_argv(ctl: Any) -> list[str]:
    """The host's `testbed` command line (its `testbed:` in the hosts file), as the controller runs it.
    (The controller has no public helper for it: SshHost keeps the hosts-file entry.)"""
    return list(ctl.host.testbed_argv)


class _Remote:
    """The reading side of a copy on a node's host: `testbed cp NODE:PATH -` there, its stdout
    passed into a pipe (os.pipe, 1 MiB where allowed) whose read end the writing side reads."""

    def __init__(self, tb: str, side: Side, ctl: Any, host: str):
        import fcntl

        self.side, self.ctl, self.host = side, ctl, host
        r, self._w = os.pipe()
        try:
            fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except (OSError, AttributeError):
            pass
        try:
            self.stream = os.fdopen(r, "rb")
        except BaseException:
            os.close(r)
            os.close(self._w)
            raise
        self._lock = threading.Lock()
        self._broken = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.stopped = False
        argv = [*_testbed_argv(ctl), "cp", f"{side.node}:{side.path}", "-", "--name", tb]
        self._thread = threading.Thread(target=self._run, args=(argv,), name=f"cp-from-{host}", daemon=True)
        self._thread.start()

    def _put(self, data: bytes) -> None:
        with self._lock:   # (held while blocked: the pipe is closed only once no write is under way)
            if self._broken or self._w < 0:
                return
            try:
                _write_all(self._w)(data)
            except OSError:
                self._broken = True   # the writing side stopped reading: the rest is dropped

    def _run(self, argv: list[str]) -> None:
        try:
            self.result = self.ctl.run(argv, on_stdout=self._put, timeout=None)
        except BaseException as exc:  # noqa: BLE001 - the caller reports it with this side's name
            self.error = exc
        finally:
            with self._lock:
                os.close(self._w)
                self._w = -1

    def stop(self) -> None:
        """The writing side is done (or gave up): the command there is ended if it still runs (the
        writing side read the stream to its end when it succeeded, so it has ended then), and what
        is still on its way is read and dropped."""
        self._thread.join(0.5)
        if self._thread.is_alive():
            self.stopped = True
            self.ctl.close()   # the command there loses its stdout and stops
        try:
            while self.stream.read(1 << 16):
                pass
        except (OSError, ValueError):
            pass
        self._thread.join(30)
        self.stream.close()

    def failure(self) -> _Failed | None:
        """This side's failure, unless it was stopped because the writing side failed."""
        what = f"reading {where(self.side)} (on host {self.host}) failed"
        if self.stopped:
            return None
        if self.error is not None:
            return _Failed(f"{what}: {self.error}", getattr(self.error, "exit_code", 1))
        if self.result is not None and self.result.rc != 0:
            return _Failed(f"{what}: {_why(self.result)}", self.result.rc)
        return None


def _across_hosts(tb: str, src: str, dst: str) -> None:
    """cp on a testbed over several hosts: node to node on one host runs there; anything else is
    streamed through the controller's SSH connections to the nodes' hosts."""
    from testbed.cluster import controller

    doc = controller.load(tb)
    nodes = set(doc["placement"])
    s = None if src == "-" else parse(src, nodes)
    d = None if dst == "-" else parse(dst, nodes)
    if not (s is not None and s.node or d is not None and d.node):
        raise TestbedError("one of SRC and DST must be NODE:PATH (a path inside a node)")
    if s is not None and d is not None and s.node and d.node \
            and doc["placement"][s.node] == doc["placement"][d.node]:
        r = controller.run_on_node_host(tb, s.node, ["cp", src, dst, "--name", tb])
        sys.stdout.write(terminal.inert(r.stdout))   # the host's words: no escape sequence passes
        sys.stderr.write(terminal.inert(r.stderr))
        if r.rc != 0:
            raise typer.Exit(r.rc if r.rc > 0 else 1)
        return
    ctls: list[Any] = []

    def open_for(node: str) -> tuple[Any, str]:
        host = controller.host_of(tb, node)
        ctls.append(controller.open_host(tb, host))
        return ctls[-1], host

    here = Copier(None)
    out = _stdout() if d is None else -1   # (refused before anything starts when it is a terminal)
    remote: _Remote | None = None
    tar: subprocess.Popen | None = None
    tar_err: _Stderr | None = None
    try:
        # the reading side: a stream to read
        if s is None:
            stream, what = _stdin(), "the tar stream on stdin"
        elif s.node is None:
            argv = here.reader(s)
            tar = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            tar_err = _Stderr(tar)
            stream, what = tar.stdout, f"the copy of {src}"
        else:
            ctl, host = open_for(s.node)
            remote = _Remote(tb, s, ctl, host)
            stream, what = remote.stream, f"the copy of {src} from host {host}"
        assert stream is not None
        # the writing side
        failed: BaseException | None = None
        try:
            if d is None:
                gate = Gate(stream, what)
                gate.first()
                gate.pump(_write_all(out))
            elif d.node is None:
                here.receive(d, stream, what)
            else:
                ctl, host = open_for(d.node)
                argv = [*_testbed_argv(ctl), "cp", "-", f"{d.node}:{d.path}", "--name", tb]
                try:
                    res = ctl.run(argv, stdin=stream, timeout=None)
                except TestbedError as exc:
                    raise _Failed(f"writing {where(d)} (on host {host}) failed: {exc}", exc.exit_code) from None
                if res.rc != 0:
                    raise _Failed(f"writing {where(d)} (on host {host}) failed: {_why(res)}", res.rc)
        except (TestbedError, OSError) as exc:
            failed = exc
        # the reading side's end; its failure comes first (the writing side's is then its consequence)
        if remote is not None:
            remote.stop()
            first = remote.failure()
        elif tar is not None:
            assert tar.stdout is not None and tar_err is not None
            tar.stdout.close()
            rc = tar.wait()
            why = tar_err.said(f"reading {src} failed")
            first = None if rc == 0 or failed is not None and rc < 0 else \
                _Failed(f"reading {src} failed: {why or f'tar exit status {rc}'}")
        else:
            first = None
        if first is not None:
            raise first
        if failed is not None:
            raise failed
    finally:   # (a Ctrl-C: the connections close first, which ends the commands there and so the streams)
        for c in ctls:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a dead connection: nothing to do
                pass
        if remote is not None:
            remote.stream.close()
        if tar is not None and tar.poll() is None:
            tar.kill()
            tar.wait()


def register(app: typer.Typer) -> None:
    @app.command(help="Copy files or directories between the host and nodes: "
                      "`testbed cp w3:/tmp/out.txt .`, `testbed cp ./data w0:/tmp/`, `testbed cp w0:/a w1:/b`.\n\n"
                      "`-` is a tar stream with one top entry, as with docker cp: `testbed cp w3:/tmp/out -` "
                      "writes one to stdout, `testbed cp - w3:/tmp/` reads one from stdin (checked: more than one "
                      "top entry, absolute paths or `..` are refused). Across hosts it streams through the "
                      "controller's SSH connections.")
    def cp(src: str = typer.Argument(..., help="NODE:PATH, a host path, or - (a tar stream on stdin)."),
           dst: str = typer.Argument(..., help="NODE:PATH, a host path, or - (a tar stream on stdout)."),
           name: Optional[str] = NameOption) -> None:
        from testbed import lifecycle

        require_root("cp")
        if src == "-" and dst == "-":
            raise Refused("SRC and DST are both -: one of them must be NODE:PATH")
        tb = resolve_name(name)
        from testbed.cli.attach import spread

        if spread(tb):
            _across_hosts(tb, src, dst)
            return
        st = lifecycle.load(tb)
        nodes = {n["name"] for n in st.get("topology", {}).get("nodes", [])}
        s = None if src == "-" else parse(src, nodes)
        d = None if dst == "-" else parse(dst, nodes)
        if not (s is not None and s.node or d is not None and d.node):
            raise TestbedError("one of SRC and DST must be NODE:PATH (a path inside a node)")
        if s is None:
            assert d is not None
            Copier(st).receive(d, _stdin())
        elif d is None:
            Copier(st).send(s, _stdout())
        else:
            Copier(st).copy(s, d)
