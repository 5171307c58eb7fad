"""A tar stream from someone we do not trust, checked member by member and written anew.

`testbed cp` takes tar streams from nodes, from other hosts and from stdin, and
hands them to a tar that runs as root (in a node, or on this machine). What
reaches that tar is never the bytes that came in: each member is read with
tarfile, checked, and written again as a plain PAX member of a new archive. Tar
implementations read some headers differently (a GNU long name against a pax
`path`, a size field with an `0o` prefix, a lone zero block and what follows
it): forwarding the original bytes would let a stream show the checks one
archive and the writer another.

The checks: one top entry (a file, or a directory and what lies under it), no
absolute path, no `..`, no device, no member through one of the stream's own
symbolic links (or a hard link to one), hard links only to members of the
stream, no sparse files, no other member types, and the archive must end with
its end-of-archive block: a stream that stops earlier was cut short. Pure: it
reads one stream and writes to one sink.
"""

from __future__ import annotations

import itertools
import re
import tarfile
from collections.abc import Callable, Iterator
from typing import IO

from testbed.errors import TestbedError

BLOCK = 512
_KEEP = 1 << 16   # bytes of the stream's end kept for the end check (tarfile reads 10 KiB ahead)
_SPECIAL_BITS = 0o6000   # setuid, setgid: never written
HEADER_MAX = 64 << 10    # a PAX or GNU long-name header: read into memory, so bounded (PATH_MAX is 4 KiB)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _Bounded(tarfile.TarInfo):
    """tarfile's member reader, with the headers it would read whole into memory bounded first."""

    what = "the tar stream"

    def _proc_member(self, tarfile_: tarfile.TarFile):  # type: ignore[override]
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                         tarfile.SOLARIS_XHDTYPE) and self.size > HEADER_MAX:
            raise Refused(f"{self.what}: an extended header of "
                          f"{self.size} bytes at byte {self.offset} (at most {HEADER_MAX}): refused")
        if self.type == tarfile.XGLTYPE:   # (its keys would apply to every later member, and pile up)
            raise Refused(f"{self.what}: a global PAX header at byte "
                          f"{self.offset}: refused")
        if self.type == tarfile.GNUTYPE_SPARSE:   # (its map is read block after block before any check)
            raise Refused(f"{self.what}: member {self.name!r} is a "
                          "sparse file: refused")
        return super()._proc_member(tarfile_)


class Refused(TestbedError):
    """A tar stream testbed will not take (exit 2, naming the member)."""

    exit_code = 2


class CutShort(TestbedError):
    """The stream stopped inside the archive: the reading side stopped, or its connection was lost."""


class _Source:
    """The stream as tarfile reads it, with its last bytes kept: where the archive's end must be."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.tail = bytearray()
        self.tail_at = 0   # stream offset of tail[0]

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n if n and n > 0 else 1 << 16)
        if data:
            self.tail += data
            if len(self.tail) > _KEEP:
                drop = len(self.tail) - _KEEP
                del self.tail[:drop]
                self.tail_at += drop
        return data

    def block_at(self, offset: int) -> bytes | None:
        i = offset - self.tail_at
        return bytes(self.tail[i:i + BLOCK]) if i >= 0 else None

    def drain(self) -> None:
        """Read to the end: the writing side is not cut off (an ssh or tar that writes on)."""
        while self.raw.read(1 << 16):
            pass


class _Sink:
    """What tarfile writes, passed on to a callable, until abandoned: a stream given up on is never
    ended (tarfile's stream would flush its buffer and the archive's end when collected, onto a
    descriptor that may be closed, or another file's by then)."""

    def __init__(self, write: Callable[[bytes], None]):
        self.write_to: Callable[[bytes], None] | None = write

    def write(self, data: bytes) -> int:
        if self.write_to is not None:
            self.write_to(bytes(data))
        return len(data)

    def abandon(self) -> None:
        self.write_to = None


class Gate:
    """Check a tar stream read from `src` and write it anew: first() reads and checks the first
    member, pump(sink) writes every checked member to sink as a new archive, then its end.
    What is written carries no owner (uid and gid 0, no names: the unpacking side's own) and no
    setuid or setgid bit, wherever it lands. max_bytes: the most file data the stream may hold."""

    def __init__(self, src: IO[bytes], what: str, *, plain_modes: bool = True, max_bytes: int | None = None,
                 files_only: bool = False):
        self.src = _Source(src)
        self.what = what
        self.max_bytes = max_bytes
        self.files_only = files_only   # only files and directories (a fetched run directory)
        self.total = 0
        self.top: str | None = None
        self.top_dir = False
        self.links: set[tuple[str, ...]] = set()   # the stream's symbolic links (and hard links to them)
        self.names: set[tuple[str, ...]] = set()   # every member so far: hard links must point at one
        self.complete = False
        self._tf: tarfile.TarFile | None = None
        self._first: tuple[tarfile.TarInfo, tarfile.TarInfo] | None = None   # (as read, as written)

    # -- the checks

    def _parts(self, name: str, what: str) -> tuple[str, ...]:
        if _CONTROL.search(name):
            raise Refused(f"{self.what}: {what} {name!r} has a control character in its name: refused")
        if name.startswith("/"):
            raise Refused(f"{self.what}: {what} {name!r} is an absolute path: refused")
        parts = tuple(p for p in name.split("/") if p not in ("", "."))
        if ".." in parts:
            raise Refused(f"{self.what}: {what} {name!r} has '..' in its path: refused")
        if not parts:
            raise Refused(f"{self.what}: {what} {name!r} is the archive's root, not a top entry: the stream must "
                          "hold one file or directory under its own name")
        if self.top is not None and parts[0] != self.top:
            raise Refused(f"{self.what}: more than one top entry ({self.top!r} and {parts[0]!r}): the stream must "
                          "hold one file or directory")
        for i in range(1, len(parts)):
            if parts[:i] in self.links:
                raise Refused(f"{self.what}: {what} {name!r} lies under {'/'.join(parts[:i])!r}, a symbolic link "
                              "of the stream: refused")
        return parts

    def _check(self, m: tarfile.TarInfo) -> tarfile.TarInfo:
        """m checked; the member to write in its place (only the fields tar needs, names normalised)."""
        parts = self._parts(m.name, "member")
        if self.top is None:
            self.top, self.top_dir = parts[0], len(parts) > 1 or m.isdir()
        if len(parts) == 1 and m.isdir() != self.top_dir or len(parts) > 1 and not self.top_dir:
            raise Refused(f"{self.what}: member {m.name!r}: the top entry {self.top!r} is both a file and a "
                          "directory: refused")
        if m.ischr() or m.isblk():
            raise Refused(f"{self.what}: member {m.name!r} is a device: refused")
        if m.issparse():
            raise Refused(f"{self.what}: member {m.name!r} is a sparse file: refused")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk() or m.isfifo()):
            raise Refused(f"{self.what}: member {m.name!r} has a type testbed cp does not take ({m.type!r})")
        if self.files_only and not (m.isreg() or m.isdir()):
            raise Refused(f"{self.what}: member {m.name!r} is not a file or a directory (a link or a FIFO a job "
                          "left?): refused")
        if m.size and not m.isreg():
            raise Refused(f"{self.what}: member {m.name!r} is not a file but carries data: refused")
        if m.size < 0:
            raise Refused(f"{self.what}: member {m.name!r} has a negative size ({m.size}): refused")
        self.total += m.size if m.isreg() else 0
        if self.max_bytes is not None and self.total > self.max_bytes:
            raise Refused(f"{self.what}: member {m.name!r} takes the stream past {self.max_bytes} bytes of "
                          "file data: refused")
        out = tarfile.TarInfo("/".join(parts))
        out.type = tarfile.REGTYPE if m.isreg() else m.type
        out.mode = m.mode & 0o7777 & ~_SPECIAL_BITS
        out.uid, out.gid, out.uname, out.gname = 0, 0, "", ""   # owners are the unpacking side's
        out.mtime = m.mtime if isinstance(m.mtime, (int, float)) and 0 <= m.mtime < 1 << 33 else 0
        out.size = m.size if m.isreg() else 0
        if m.islnk():
            target = self._parts(m.linkname, f"hard link {m.name!r} ->")
            if target not in self.names:
                raise Refused(f"{self.what}: hard link {m.name!r} -> {m.linkname!r}: no such member before it")
            if target in self.links:   # a hard link to a symbolic link is one too
                self.links.add(parts)
            out.linkname = "/".join(target)
        elif m.issym():
            if _CONTROL.search(m.linkname) or not m.linkname:
                raise Refused(f"{self.what}: symbolic link {m.name!r} -> {m.linkname!r}: an empty target or a "
                              "control character in it: refused")
            self.links.add(parts)
            out.linkname = m.linkname   # (it may point anywhere: nothing of the stream goes through it)
        self.names.add(parts)
        return out

    # -- reading

    def _members(self) -> Iterator[tarfile.TarInfo]:
        """The members after the first, as they come."""
        assert self._tf is not None
        while True:
            try:
                m = self._tf.next()
            except tarfile.TarError as exc:
                raise CutShort(f"{self.what} stops inside a member (cut short, or damaged): {exc}") from None
            if m is None:
                return
            self._tf.members.clear()   # (stream mode keeps every member seen: not needed here)
            yield m

    def first(self) -> tuple[str, bool]:
        """Read and check the first member: (the top entry's name, whether it is a directory)."""
        try:
            info = type("_Bounded", (_Bounded,), {"what": self.what})   # (named in its refusals)
            self._tf = tarfile.open(fileobj=self.src, mode="r|", tarinfo=info)   # type: ignore[call-overload]
        except tarfile.TarError as exc:
            raise Refused(f"{self.what} is not a tar stream ({exc})") from None
        m = self._tf.next()   # (the member open() read ahead)
        if m is None:
            self._end()
            raise Refused(f"{self.what} is an empty tar archive: nothing to copy")
        self._first = (m, self._check(m))
        assert self.top is not None
        return self.top, self.top_dir

    def _end(self) -> None:
        assert self._tf is not None
        block = self.src.block_at(self._tf.offset)
        if block is None or len(block) < BLOCK:
            raise CutShort(f"{self.what} ends before the end of the archive (cut short: the reading side "
                           "stopped, or its connection was lost)")
        if block.count(0) != BLOCK:
            raise Refused(f"{self.what}: no tar header at byte {self._tf.offset}: not a tar stream from there on")

    def pump(self, sink: Callable[[bytes], None]) -> None:
        """Every member checked and written anew to sink, then the new archive's end once the stream's
        end has come; the rest of the stream is read and dropped (a writer is not cut off). On any
        refusal or a stream cut short it raises before the end is written, so what sink got is no
        whole archive."""
        assert self._tf is not None, "first() comes first"
        assert self._first is not None, "first() comes first"
        to = _Sink(sink)
        out = tarfile.open(fileobj=to, mode="w|", format=tarfile.PAX_FORMAT)  # type: ignore[call-overload]
        first, self._first = self._first, None
        try:
            for m, clean in itertools.chain([first], ((m, self._check(m)) for m in self._members())):
                data = self._tf.extractfile(m) if m.isreg() else None
                try:
                    out.addfile(clean, data)
                except BrokenPipeError:
                    raise   # the writing side stopped reading: its own status says why
                except (OSError, tarfile.TarError) as exc:
                    raise CutShort(f"{self.what} stops inside {m.name!r} (cut short: {exc})") from None
            self._end()
        except BaseException:
            to.abandon()
            raise
        out.close()   # the end-of-archive blocks, padded to a record
        self.complete = True
        self.src.drain()
