"""Files in places a job can reach, written and read by root without trusting what is there.

A rank (a netns worker, a Docker worker with a writable mount of the working directory) can plant a
symbolic link, a FIFO or a huge file where root later writes or reads. Everything here works
relative to a directory descriptor, one path component at a time, with O_NOFOLLOW: a planted link
is refused, never followed. Reads never block (O_NONBLOCK: a FIFO is refused, not waited on) and
never take more than they are told.

- open_beneath(base, rel, flags): base is trusted (the operator named it); every part of rel is not.
- write_beneath(base, rel, data): written to a new hidden name, then renamed into place.
- open_regular(path): a descriptor of a plain file, never blocking on a FIFO; Unsafe otherwise.
- read_regular(path, limit, offset): a plain file's bytes, at most `limit`; Unsafe otherwise.
- copy_beneath(src, base, rel, limit): read_regular's file into write_beneath's place, in chunks.
- Lines: a byte stream cut into lines, each at most `limit` bytes (the rest of a longer line dropped).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from testbed.errors import TestbedError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unsafe(TestbedError):
    """A path a job can reach holds something testbed will not write through or read (a link, a FIFO)."""


def _parts(rel: str | os.PathLike) -> list[str]:
    parts = [p for p in os.fspath(rel).split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise Unsafe(f"{os.fspath(rel)!r}: not a path below its directory")
    return parts


def _why(exc: OSError, where: str) -> Unsafe:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return Unsafe(f"{where}: a symbolic link or not a directory (planted by a job?): refused")
    return Unsafe(f"{where}: {exc.strerror}")


def open_dir_beneath(base: str | os.PathLike, rel: str | os.PathLike = "", *, create: bool = False) -> int:
    """A descriptor of directory base/rel, reached without following a link below base."""
    fd = os.open(os.fspath(base), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    done = os.fspath(base)
    try:
        for part in ([] if os.fspath(rel) in ("", ".") else _parts(rel)):
            done = os.path.join(done, part)
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                raise _why(exc, done) from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _regular_only(fd: int, where: str, flags: int) -> int:
    """fd, checked to be a plain file (else closed, Unsafe), blocking again unless flags asked
    O_NONBLOCK: opened non-blocking only so that a FIFO is refused rather than waited on. A file
    opened for writing must have one name: a hard link a job made to a file elsewhere is refused."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe(f"{where}: not a plain file (a FIFO, a device or a directory; planted by a job?): refused")
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise Unsafe(f"{where}: a plain file with {st.st_nlink} names (a hard link planted by a job?): refused")
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_why(exc: OSError, where: str) -> Unsafe:
    if exc.errno == errno.ENXIO:   # O_WRONLY | O_NONBLOCK of a FIFO nobody reads
        return Unsafe(f"{where}: a FIFO or a socket (planted by a job?): refused")
    return _why(exc, where)


def open_beneath(base: str | os.PathLike, rel: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """os.open of the plain file base/rel with flags, no link followed below base (O_NOFOLLOW on
    every part). Never blocks on what is there: a FIFO, a device or a directory is Unsafe (opened
    non-blocking, checked with fstat, then made blocking again for the caller's reads and writes)."""
    parts = _parts(rel)
    where = os.path.join(os.fspath(base), *parts)
    dfd = open_dir_beneath(base, "/".join(parts[:-1]))
    try:
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dfd)
    except OSError as exc:
        raise _open_why(exc, where) from None
    finally:
        os.close(dfd)
    return _regular_only(fd, where, flags)


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY) -> int:
    """os.open of the plain file at path (its last part not a link), never blocking on what is
    there: a FIFO, a device or a directory is Unsafe (as open_beneath). FileNotFoundError passes."""
    where = os.fspath(path)
    try:
        fd = os.open(where, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
        raise _open_why(exc, where) from None
    return _regular_only(fd, where, flags)


def write_beneath(base: str | os.PathLike, rel: str | os.PathLike, data: bytes | Iterable[bytes],
                  mode: int = 0o644) -> None:
    """base/rel holds data (bytes, or chunks of them as they come): written to a new name (O_EXCL)
    in the same directory, then renamed over."""
    parts = _parts(rel)
    dfd = open_dir_beneath(base, "/".join(parts[:-1]))
    tmp = f".{parts[-1]}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            for chunk in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        # rename replaces a link at the name itself; it never writes through one
        os.rename(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    finally:
        os.close(dfd)


def read_fd_regular(fd: int, limit: int, offset: int = 0, *, where: str = "") -> bytes:
    """At most `limit` bytes from offset of an open descriptor that must be a plain file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{where}: not a plain file (a FIFO, a device or a directory): refused")
    if offset:
        os.lseek(fd, offset, os.SEEK_SET)
    out = bytearray()
    while len(out) < limit:
        chunk = os.read(fd, min(1 << 20, limit - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_regular(path: str | os.PathLike, limit: int, offset: int = 0) -> bytes:
    """At most `limit` bytes from offset of the plain file at path (its last part not a link).
    Never blocks: a FIFO or a device is Unsafe, as is a link."""
    fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return read_fd_regular(fd, limit, offset, where=os.fspath(path))
    finally:
        os.close(fd)


def copy_beneath(src: str | os.PathLike, base: str | os.PathLike, rel: str | os.PathLike, limit: int) -> None:
    """The plain file src (as read_regular: no link, no FIFO) copied to base/rel (as write_beneath),
    at most `limit` bytes of it, in chunks: never whole in memory."""
    fd = open_regular(src)
    try:
        def chunks() -> Iterator[bytes]:
            left = limit
            while left > 0:
                data = os.read(fd, min(1 << 20, left))
                if not data:
                    return
                left -= len(data)
                yield data
        write_beneath(base, rel, chunks())
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int) -> str:
    """read_regular's bytes as text (undecodable bytes replaced)."""
    return read_regular(path, limit).decode(errors="replace")


class Lines:
    """Bytes as they come, cut into lines (without their newline) passed to `emit`; a line longer
    than `limit` is passed cut at limit, its rest dropped up to the next newline: what waits for a
    newline never grows past limit."""

    def __init__(self, emit: Callable[[bytes], None], limit: int = 1 << 16):
        self.emit, self.limit = emit, limit
        self.buf = bytearray()
        self.skipping = False

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start:nl]
            if not self.skipping:
                room = self.limit - len(self.buf)
                self.buf += piece[:room]
                if len(piece) > room:
                    self.emit(bytes(self.buf))
                    self.buf.clear()
                    self.skipping = True
            if nl < 0:
                return
            if not self.skipping:
                self.emit(bytes(self.buf))
            self.buf.clear()
            self.skipping = False
            start = nl + 1

    def close(self) -> None:
        if self.buf and not self.skipping:
            self.emit(bytes(self.buf))
        self.buf.clear()


def lines_of_fd(fd: int, limit: int = 1 << 16, *, max_bytes: int | None = None) -> Iterator[bytes]:
    """The lines read from fd to its end (or its first max_bytes bytes), each at most `limit`
    bytes (see Lines)."""
    got: list[bytes] = []
    lines = Lines(got.append, limit)
    left = max_bytes
    while True:
        chunk = os.read(fd, 1 << 16 if left is None else min(1 << 16, left))
        if left is not None:
            left -= len(chunk)
        if not chunk:
            lines.close()
            yield from got
            return
        lines.feed(chunk)
        yield from got
        got.clear()


def path_beneath_runs(path: str | os.PathLike) -> tuple[Path, Path]:
    """(trusted base, the rest) of a path in a run directory: the base is what lies before its last
    `runs` part (the operator's directory), the rest a job may reach; a path without a `runs` part
    trusts its parent directory."""
    p = Path(os.path.abspath(os.fspath(path)))
    parts = p.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "runs":
            return Path(*parts[:i]), Path(*parts[i:])
    return p.parent, Path(p.name)
