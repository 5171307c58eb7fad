"""The tar gate fuzzed against GNU tar's reading of what it writes.

Hypothesis builds archives of hostile members (odd names, control characters, links out and
through links, devices, set-id modes, owners, every header format); whatever the gate lets
through, GNU tar (as root, as testbed cp runs it) must unpack inside its directory only, with no
device, no set-id bit and no owner of the stream's, and must list exactly the names the gate
wrote.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from testbed import errors  # noqa: E402
from testbed.tarstream import Gate  # noqa: E402

PART = st.sampled_from(["top", "a", "b", "..", ".", "", "x\ny", "x\x00y", "\x1b[2J", "é", "c d", "top"])
NAME = st.lists(PART, min_size=1, max_size=4).map("/".join) | st.sampled_from(["/etc/x", "top/../../x"])
TYPE = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
                        tarfile.BLKTYPE, tarfile.FIFOTYPE, tarfile.CONTTYPE, b"Z"])
LINK = NAME | st.sampled_from(["/", "/etc", "..", "top", "top/a"])
MEMBER = st.tuples(NAME, TYPE, LINK, st.sampled_from([0o644, 0o4755, 0o6777, 0o1777, 0o2755]),
                   st.integers(0, 70000), st.binary(max_size=64))
FORMAT = st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])


def _archive(members, fmt) -> bytes | None:
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            for name, typ, link, mode, uid, data in members:
                ti = tarfile.TarInfo(name)
                ti.type, ti.linkname, ti.mode, ti.uid, ti.gid = typ, link, mode, uid, uid
                ti.uname = ti.gname = "mallory"
                ti.size = len(data) if typ in (tarfile.REGTYPE, tarfile.CONTTYPE) else 0
                tf.addfile(ti, io.BytesIO(data) if ti.size else None)
    except (ValueError, tarfile.TarError, UnicodeError):
        return None   # (tarfile cannot write it: nothing to test)
    return buf.getvalue()


@pytest.mark.root   # GNU tar as root, as testbed cp runs it
@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MEMBER, min_size=1, max_size=6), FORMAT)
def test_what_the_gate_passes_gnu_tar_unpacks_inside(members, fmt):
    raw = _archive(members, fmt)
    if raw is None:
        return
    out = bytearray()
    gate = Gate(io.BytesIO(raw), "fuzz")
    try:
        gate.first()
        gate.pump(out.extend)
    except errors.TestbedError:
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp") as outer:
        root = Path(outer) / "in"
        root.mkdir()
        before = set(os.listdir(outer))
        listed = subprocess.run(["tar", "-tf", "-"], input=bytes(out), capture_output=True)
        assert listed.returncode == 0, listed.stderr
        with tarfile.open(fileobj=io.BytesIO(bytes(out))) as tf:
            wrote = [m.name + ("/" if m.isdir() else "") for m in tf.getmembers()]
        assert listed.stdout.decode(errors="surrogateescape").splitlines() == wrote
        r = subprocess.run(["tar", "-C", str(root), "-xf", "-", "--no-same-owner"], input=bytes(out),
                           capture_output=True)
        assert set(os.listdir(outer)) == before   # nothing beside its directory
        for dirpath, dirnames, filenames in os.walk(root):
            for n in dirnames + filenames:
                st_ = os.lstat(os.path.join(dirpath, n))
                assert not (stat.S_ISBLK(st_.st_mode) or stat.S_ISCHR(st_.st_mode)), n
                assert not st_.st_mode & 0o6000 and st_.st_uid == 0, (n, oct(st_.st_mode), st_.st_uid)
        assert r.returncode == 0 or b"Cannot" in r.stderr, r.stderr
