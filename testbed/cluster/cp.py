"""`testbed cp` on a testbed over several hosts, from its controller.

A copy between two nodes of one host runs on that host; anything else streams through the
controller's SSH connections to the hosts: the side that reads runs `testbed cp NODE:PATH -` on its
node's host (or tar here, for this machine's files), the side that writes runs `testbed cp -
NODE:DST` on its node's host (or the same checked unpacking here), and the controller passes the tar
stream from one to the other, so nothing stops on a host's disk on the way. A failure names the side
(reading or writing, the node and its host) and what it said.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

from testbed import terminal
from testbed.errors import TestbedError
from testbed.node_files import Copier, Side, CopyFailed, StderrTail, stdin_stream, stdout_fd, write_all, parse, where
from testbed.tarstream import Gate


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
                write_all(self._w)(data)
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

    def failure(self) -> CopyFailed | None:
        """This side's failure, unless it was stopped because the writing side failed."""
        what = f"reading {where(self.side)} (on host {self.host}) failed"
        if self.stopped:
            return None
        if self.error is not None:
            return CopyFailed(f"{what}: {self.error}", getattr(self.error, "exit_code", 1))
        if self.result is not None and self.result.rc != 0:
            return CopyFailed(f"{what}: {_why(self.result)}", self.result.rc)
        return None


def copy_across(tb: str, src: str, dst: str) -> int:
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
        return 0 if r.rc == 0 else (r.rc if r.rc > 0 else 1)
    ctls: list[Any] = []

    def open_for(node: str) -> tuple[Any, str]:
        host = controller.host_of(tb, node)
        ctls.append(controller.open_host(tb, host))
        return ctls[-1], host

    here = Copier(None)
    out = stdout_fd() if d is None else -1   # (refused before anything starts when it is a terminal)
    remote: _Remote | None = None
    tar: subprocess.Popen | None = None
    tar_err: StderrTail | None = None
    try:
        # the reading side: a stream to read
        if s is None:
            stream, what = stdin_stream(), "the tar stream on stdin"
        elif s.node is None:
            argv = here.reader(s)
            tar = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            tar_err = StderrTail(tar)
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
                gate.pump(write_all(out))
            elif d.node is None:
                here.receive(d, stream, what)
            else:
                ctl, host = open_for(d.node)
                argv = [*_testbed_argv(ctl), "cp", "-", f"{d.node}:{d.path}", "--name", tb]
                try:
                    res = ctl.run(argv, stdin=stream, timeout=None)
                except TestbedError as exc:
                    raise CopyFailed(f"writing {where(d)} (on host {host}) failed: {exc}", exc.exit_code) from None
                if res.rc != 0:
                    raise CopyFailed(f"writing {where(d)} (on host {host}) failed: {_why(res)}", res.rc)
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
                CopyFailed(f"reading {src} failed: {why or f'tar exit status {rc}'}")
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
    return 0
