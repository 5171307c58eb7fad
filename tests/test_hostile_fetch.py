"""Run directories fetched from hosts: what a host sends is hostile input.

The "host" here runs its commands for real on this machine (tar, bash), as SshHost would run them
there, or answers with bytes a hostile host would send. Nothing of a host's may land outside
parts/HOST, no link of the host's may be followed (there or here), and a huge header is refused
before it is read whole.
"""

from __future__ import annotations

import io
import os
import resource
import subprocess
import tarfile
from pathlib import Path

import pytest

from testbed.cluster import job as hosts_job
from testbed.cluster.remote import RemoteResult
from testbed import errors


class Host:
    """A host that runs argv here (real tar), or, given `answer`, sends those bytes as its tar's output."""

    name = "h1"

    def __init__(self, answer: bytes | None = None):
        self.answer = answer

    def run(self, argv, *, stdin=None, timeout=None, check=False, on_stdout=None):
        if self.answer is not None and "tar" in " ".join(argv):
            data = self.answer
            if "base64" in " ".join(argv):   # (the old fetch's pipeline)
                import base64
                data = base64.b64encode(data)
            out = b""
            if on_stdout is not None:
                for i in range(0, len(data), 1 << 16):
                    on_stdout(data[i:i + (1 << 16)])
            else:
                out = data
            return RemoteResult(rc=0, stdout=out.decode(), stderr="", host=self.name, argv=tuple(argv))
        p = subprocess.run(list(argv), capture_output=True)
        if on_stdout is not None:
            on_stdout(p.stdout)
        return RemoteResult(rc=p.returncode, stdout="" if on_stdout else p.stdout.decode(),
                            stderr=p.stderr.decode(), host=self.name, argv=tuple(argv))


def _fetch(host: Host, remote: str, part: Path) -> None:
    hosts_job.fetch_run_dir(host, "h1", remote, part)


def _tar(*members: tuple[tarfile.TarInfo, bytes | None], fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _m(name: str, typ=tarfile.REGTYPE, data: bytes | None = None, linkname: str = "", mode: int = 0o644):
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.linkname = typ, mode, linkname
    ti.size = len(data) if data is not None else 0
    return ti, data


def test_a_link_a_job_left_is_not_dereferenced_on_the_host(tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("the host's /etc/shadow")
    remote = tmp_path / "remote-run"
    (remote / "logs").mkdir(parents=True)
    (remote / "summary.json").write_text("{}")
    (remote / "logs" / "w0.log").symlink_to(secret)
    part = tmp_path / "rd" / "parts" / "h1"
    with pytest.raises(errors.TestbedError, match="w0.log"):
        _fetch(Host(), str(remote), part)
    assert not part.exists()
    assert "shadow" not in "".join(p.read_text() for p in (tmp_path / "rd").rglob("*") if p.is_file())


def test_a_plain_run_directory_comes_back(tmp_path):
    remote = tmp_path / "remote-run"
    (remote / "probe").mkdir(parents=True)
    (remote / "summary.json").write_text('{"rc": 0}')
    (remote / "probe" / "rank-0.jsonl").write_text("{}\n")
    part = tmp_path / "rd" / "parts" / "h1"
    _fetch(Host(), str(remote), part)
    assert (part / "summary.json").read_text() == '{"rc": 0}'
    assert (part / "probe" / "rank-0.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in part.parent.iterdir()) == ["h1"]


@pytest.mark.parametrize("members", [
    # a link out, then a file written through it (the CVE-2025-4517 family)
    [_m("run", tarfile.DIRTYPE), _m("run/out", tarfile.SYMTYPE, linkname="/var/tmp"),
     _m("run/out/planted", data=b"x")],
    [_m("run", tarfile.DIRTYPE), _m("run/disk", tarfile.BLKTYPE)],
    [_m("run", tarfile.DIRTYPE), _m("../escape", data=b"x")],
    [_m("run", tarfile.DIRTYPE), _m("run/sh", data=b"#!", mode=0o4755), _m("run/x", tarfile.SYMTYPE, linkname="sh")],
], ids=["through-a-link", "device", "dotdot", "symlink"])
def test_a_hostile_archive_lands_nothing(tmp_path, members):
    part = tmp_path / "rd" / "parts" / "h1"
    with pytest.raises(errors.TestbedError):
        _fetch(Host(_tar(*members)), "/nonexistent", part)
    assert not part.exists() and not Path("/var/tmp/planted").exists()
    assert list(part.parent.iterdir()) == [] if part.parent.exists() else True


def test_a_huge_pax_header_is_refused_before_it_is_read(tmp_path):
    ti = tarfile.TarInfo("run")
    ti.type = tarfile.DIRTYPE
    hdr = ti.tobuf(tarfile.USTAR_FORMAT)
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    pax.size = 64 << 20
    body = b"%d path=%s\n" % (pax.size, b"a" * (pax.size - 20))
    data = hdr + pax.tobuf(tarfile.USTAR_FORMAT) + body[:pax.size].ljust(pax.size, b"\n") + b"\0" * 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(errors.TestbedError, match="extended header"):
        _fetch(Host(data), "/nonexistent", tmp_path / "rd" / "parts" / "h1")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 40, grown_mib
