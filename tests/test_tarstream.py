"""testbed.tarstream: hostile tar streams against the gate that stands before every tar `testbed cp` runs as root.

Each stream is built here byte by byte where tarfile would not write it (headers that tar
implementations read differently). What the gate passes on is read back twice: by tarfile, and by
GNU tar itself (`tar -tvf -`, what the nodes run), and the two must agree with what was checked.
Pure: no root, nothing outside memory but a `tar -t` process.
"""

from __future__ import annotations

import io
import subprocess
import tarfile

import pytest

from testbed.tarstream import BLOCK, CutShort, Gate, Refused


def member(name: str, data: bytes = b"", **kw) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    for k, v in kw.items():
        setattr(ti, k, v)
    if ti.isreg():
        ti.size = len(data)
    return ti, data


def archive(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def header(ti: tarfile.TarInfo) -> bytes:
    return ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


def with_checksum(block: bytearray) -> bytes:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


TOP = member("top", type=tarfile.DIRTYPE, mode=0o755)


def gate(stream: bytes, **kw) -> tuple[Gate, bytearray, BaseException | None]:
    """Run the gate over `stream`: (the gate, what it passed on, what it raised)."""
    out = bytearray()
    g = Gate(io.BytesIO(stream), "the stream", **kw)
    try:
        g.first()
        g.pump(out.extend)
    except (Refused, CutShort) as exc:
        return g, out, exc
    return g, out, None


def names_python(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:", ignore_zeros=True) as tf:
        return tf.getnames()


def names_seen(data: bytes) -> list[str]:
    """The members in a prefix of an archive (a gate that refused passed at most a prefix on)."""
    seen = []
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r|") as tf:
            seen.extend(m.name for m in tf)
    except tarfile.TarError:
        pass
    return seen


def listing_gnu(data: bytes) -> list[str]:
    r = subprocess.run(["tar", "-tf", "-"], input=bytes(data), capture_output=True, check=True)
    return [n.rstrip("/") for n in r.stdout.decode().splitlines()]


def test_a_directory_passes_and_comes_out_the_same():
    g, out, exc = gate(archive(TOP, member("top/a.txt", b"hello\n", mode=0o640),
                               member("top/sub", type=tarfile.DIRTYPE),
                               member("top/sub/l", type=tarfile.SYMTYPE, linkname="../a.txt"),
                               member("top/sub/h", type=tarfile.LNKTYPE, linkname="top/a.txt"),
                               member("top/big", b"x" * 100_000)))
    assert exc is None and g.complete and (g.top, g.top_dir) == ("top", True)
    assert listing_gnu(out) == names_python(out) == ["top", "top/a.txt", "top/sub", "top/sub/l", "top/sub/h", "top/big"]
    with tarfile.open(fileobj=io.BytesIO(bytes(out))) as tf:
        assert tf.extractfile("top/a.txt").read() == b"hello\n"
        assert tf.getmember("top/a.txt").mode == 0o640
        assert tf.extractfile("top/big").read() == b"x" * 100_000
        assert tf.getmember("top/sub/l").linkname == "../a.txt"
    assert out.endswith(b"\0" * 2 * BLOCK) and len(out) % tarfile.RECORDSIZE == 0


def test_a_single_file_passes():
    g, out, exc = gate(archive(member("./one.bin", b"\1\2\3")))
    assert exc is None and (g.top, g.top_dir) == ("one.bin", False)
    assert listing_gnu(out) == ["one.bin"]


@pytest.mark.parametrize("bad, why", [
    (member("top/../../etc/cron.d/x", b"boom"), "has '..' in its path"),
    (member("/etc/cron.d/x", b"boom"), "is an absolute path"),
    (member("other/x", b"boom"), "more than one top entry ('top' and 'other')"),
    (member("top/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3), "is a device"),
    (member("top/disk", type=tarfile.BLKTYPE, devmajor=8, devminor=0), "is a device"),
    (member("top/h", type=tarfile.LNKTYPE, linkname="/etc/shadow"), "is an absolute path"),
    (member("top/h", type=tarfile.LNKTYPE, linkname="top/not-there"), "no such member before it"),
])
def test_a_bad_member_is_refused_and_none_of_it_passes(bad, why):
    g, out, exc = gate(archive(TOP, member("top/fine", b"f" * 50_000), bad))   # (records already passed on)
    assert isinstance(exc, Refused) and why in str(exc), exc
    assert not g.complete
    assert b"boom" not in out and b"etc" not in out and b"other" not in out
    assert set(names_seen(out)) <= {"top", "top/fine"}   # only what was checked, and no end: not a whole archive
    assert not out.endswith(b"\0" * 2 * BLOCK)


def test_a_path_through_a_symbolic_link_of_the_stream_is_refused():
    _g, out, exc = gate(archive(TOP, member("top/l", type=tarfile.SYMTYPE, linkname="/etc"),
                                member("top/l/cron.d/x", b"boom")))
    assert isinstance(exc, Refused) and "lies under 'top/l', a symbolic link" in str(exc)
    assert b"boom" not in out


def test_a_hard_link_to_a_symbolic_link_is_a_symbolic_link_too():
    _g, out, exc = gate(archive(TOP, member("top/l", type=tarfile.SYMTYPE, linkname="/etc"),
                                member("top/h", type=tarfile.LNKTYPE, linkname="top/l"),
                                member("top/h/cron.d/x", b"boom")))
    assert isinstance(exc, Refused) and "lies under 'top/h'" in str(exc)
    assert b"boom" not in out


def test_a_long_name_and_a_pax_path_cannot_show_tar_another_name():
    """A GNU long name, then a pax header with another path, then the file: tarfile reads the long
    name, GNU tar the pax path. What GNU tar gets from the gate is the name that was checked."""
    long = tarfile.TarInfo._create_gnu_long_header("top/ok", tarfile.GNUTYPE_LONGNAME, "utf-8", "strict")
    pax = tarfile.TarInfo._create_pax_generic_header({"path": "other/x"}, tarfile.XHDTYPE, "utf-8")
    ti, data = member("placeholder", b"payload")
    raw = header(TOP[0]) + long + pax + header(ti) + padded(data) + b"\0" * 2 * BLOCK
    assert "other/x" in listing_gnu(raw)          # what GNU tar would have made of the stream itself
    g, out, exc = gate(raw)
    assert exc is None and g.complete
    assert listing_gnu(out) == names_python(out) == ["top", "top/ok"]


def test_a_size_field_tar_reads_otherwise_cannot_hide_a_device():
    """A size of `0o1000`: tarfile takes it as 512, GNU tar skips the field and reads the data as the
    next header, a device. Written anew, the size is plain and the data stays data."""
    dev = bytearray(header(member("top/dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3)[0]))
    ti, _ = member("top/f", b"x" * BLOCK)
    head = bytearray(header(ti))
    head[124:136] = b"0o1000".ljust(11, b" ") + b"\0"
    raw = header(TOP[0]) + with_checksum(head) + bytes(dev) + b"\0" * 2 * BLOCK
    g, out, exc = gate(raw)
    assert exc is None and g.complete
    assert listing_gnu(out) == ["top", "top/f"]
    with tarfile.open(fileobj=io.BytesIO(bytes(out))) as tf:
        assert tf.extractfile("top/f").read() == bytes(dev)


def test_what_follows_a_lone_zero_block_never_passes():
    """tarfile stops at the first zero block; busybox tar reads on. Nothing after it is passed on."""
    rest = archive(member("top/dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3), member("second", b"boom"))
    raw = archive(TOP, member("top/a", b"a"))[: 3 * BLOCK + BLOCK] + b"\0" * BLOCK + rest
    g, out, exc = gate(raw)
    assert exc is None and g.complete
    assert names_python(out) == ["top", "top/a"] and b"boom" not in out and b"dev" not in out


@pytest.mark.parametrize("cut", ["inside the data", "at a header", "inside the end"])
def test_a_stream_cut_short_is_an_error_and_no_whole_archive_passes(cut):
    full = archive(TOP, member("top/a", b"a" * 5000), member("top/b", b"b"))
    end = len(header(TOP[0])) + BLOCK + len(padded(b"a" * 5000)) + BLOCK + BLOCK   # after top/b's data
    at = {"inside the data": 3 * BLOCK, "at a header": end, "inside the end": end + 100}[cut]
    g, out, exc = gate(full[:at])
    assert isinstance(exc, CutShort) and "cut short" in str(exc), exc
    assert not g.complete and not out.endswith(b"\0" * 2 * BLOCK)


@pytest.mark.parametrize("raw, why", [
    (b"", "is not a tar stream"),
    (b"hello, this is not tar" * 40, "is not a tar stream"),
    (b"\0" * 2 * BLOCK, "is an empty tar archive"),
])
def test_no_tar_or_an_empty_one_is_refused(raw, why):
    _g, out, exc = gate(raw)
    assert isinstance(exc, Refused) and why in str(exc), exc
    assert not out


def test_a_sparse_file_or_a_fifo_with_data_is_refused():
    ti, _ = member("top/s")
    ti.type = tarfile.GNUTYPE_SPARSE
    _g, _out, exc = gate(header(TOP[0]) + header(ti) + b"\0" * 2 * BLOCK)
    assert isinstance(exc, Refused) and "sparse" in str(exc), exc
    fifo = bytearray(header(member("top/p", type=tarfile.FIFOTYPE)[0]))
    fifo[124:136] = b"%011o\0" % BLOCK
    _g, out, exc = gate(header(TOP[0]) + with_checksum(fifo) + b"z" * BLOCK + b"\0" * 2 * BLOCK)
    assert isinstance(exc, Refused) and "carries data" in str(exc), exc
    assert b"z" * 10 not in out


def test_setuid_bits_and_owners_are_dropped_wherever_it_lands():
    ti, data = member("tool", b"#!/bin/sh\n", mode=0o6755)
    ti.uid, ti.gid, ti.uname, ti.gname = 1234, 5678, "mallory", "wheel"
    _g, out, exc = gate(archive((ti, data)))
    assert exc is None
    with tarfile.open(fileobj=io.BytesIO(bytes(out))) as tf:
        m = tf.getmember("tool")
        assert (m.mode, m.uid, m.gid, m.uname, m.gname) == (0o755, 0, 0, "", "")


def test_a_refused_stream_is_never_ended_later():
    """Given up on, the new archive is never flushed or ended afterwards (when collected) onto the
    sink, whose descriptor the caller has closed by then."""
    import gc

    out = bytearray()
    g = Gate(io.BytesIO(archive(TOP, member("top/a", b"a"), member("/abs", b"x"))), "the stream")
    g.first()
    with pytest.raises(Refused) as info:   # (the traceback keeps pump's frame, and so its archive, alive)
        g.pump(out.extend)
    seen = bytes(out)
    del g, info
    gc.collect()
    assert bytes(out) == seen and not seen.endswith(b"\0" * 2 * BLOCK)


# a control character (a newline, ESC, NUL, DEL) in a name or a link target: a tar listing or an
# error message shows it to a terminal, and GNU tar and tarfile read some of them apart
_GNU, _PAX = tarfile.GNU_FORMAT, tarfile.PAX_FORMAT
_BAD_NAMES = [
    ("name-newline", member("top/a\nb", b"boom"), "has a control character in its name", (_GNU, _PAX)),
    ("name-osc", member("top/a\x1b]0;pwned\x07", b"boom"), "has a control character in its name", (_GNU, _PAX)),
    ("name-del", member("top/del\x7f", b"boom"), "has a control character in its name", (_GNU, _PAX)),
    ("hardlink-newline", member("top/h", type=tarfile.LNKTYPE, linkname="top/fine\n"),
     "has a control character in its name", (_GNU, _PAX)),
    ("hardlink-esc", member("top/h", type=tarfile.LNKTYPE, linkname="top/\x1b[2Jfine"),
     "has a control character in its name", (_GNU, _PAX)),
    ("symlink-newline", member("top/s", type=tarfile.SYMTYPE, linkname="fine\nx"), "control character in it",
     (_GNU, _PAX)),
    ("symlink-osc52", member("top/s", type=tarfile.SYMTYPE, linkname="\x1b]52;c;cm0gLXJmIH4K\x07"),
     "control character in it", (_GNU, _PAX)),
    # (a NUL ends a name in a header field: only a PAX record carries one; tarfile reads it whole,
    # GNU tar up to the NUL: the two would read different names)
    ("symlink-nul", member("top/s", type=tarfile.SYMTYPE, linkname="fine\x00/etc/shadow",
                           pax_headers={"linkpath": "fine\x00/etc/shadow"}), "control character in it", (_PAX,)),
    ("name-nul", member("top/n\x00ul", b"boom", pax_headers={"path": "top/n\x00ul"}),
     "has a control character in its name", (_PAX,)),
]


@pytest.mark.parametrize("bad, why, fmt", [
    pytest.param(bad, why, fmt, id=f"{name}-{'gnu' if fmt == _GNU else 'pax'}")
    for name, bad, why, fmts in _BAD_NAMES for fmt in fmts])
def test_a_control_character_in_a_name_or_a_link_target_is_refused(bad, why, fmt):
    stream = archive(TOP, member("top/fine", b"f" * 50_000), bad, fmt=fmt)
    with tarfile.open(fileobj=io.BytesIO(stream)) as tf:   # the archive carries the member as built
        got = tf.getmembers()[-1]
        assert (got.name, got.linkname) == (bad[0].name, bad[0].linkname)
    g, out, exc = gate(stream)
    assert isinstance(exc, Refused) and why in str(exc), exc
    assert not g.complete and not out.endswith(b"\0" * 2 * BLOCK)
    assert set(names_seen(out)) <= {"top", "top/fine"}
