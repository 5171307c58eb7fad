"""The wheelhouse `testbed install` ships is vouched for by a digest its writer cannot rewrite
(testbed/cluster/install.py, wheelhouse.py, wheelhouse_ledger.py).

Whatever is in the wheelhouse cache is installed as root on every host. Its sha256 used to sit in
manifest.json beside wheels.tar: whoever could rewrite one could rewrite both, and the old check
then passed. Here the cache entry is made as a build makes it (from stand-in wheels: no package
index needed), then both files are rewritten consistently, as an attacker would: the controller
refuses the entry, and a host refuses a stream that is not the recorded one, before unpacking
anything (the real install script, run here on a real shell, with the controller's Python as the
host's).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from testbed import errors
from testbed.cluster import install, wheelhouse_ledger
from testbed.cluster import wheelhouse as wh


@pytest.fixture
def house_env(tmp_path, monkeypatch):
    """A cache and a ledger of the test's own (never ~/.cache or /var/lib)."""
    monkeypatch.setenv("TESTBED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TESTBED_WHEELHOUSE_LEDGER", str(tmp_path / "ledger"))
    return tmp_path


def _build(tmp_path: Path) -> install.Build:
    return install.Build(version="9.9.9", source=tmp_path, files=(), constraints="pinned==1.0\n", python=(3, 11),
                         machine="x86_64", key=hashlib.sha256(b"stand-in sources").hexdigest())


def _made(build: install.Build, tmp_path: Path, payload: bytes = b"a real wheel") -> install.Wheelhouse:
    """The cache entry exactly as wheelhouse() keeps what pip made, then found by wheelhouse()."""
    cache = wh._private_dir(install.cache_root())
    root = wh._private_dir(cache / "wheelhouse")
    scratch = root / ".build-test"
    wheels = scratch / "wheels"
    wheels.mkdir(parents=True)
    (wheels / f"testbed-{build.version}-py3-none-any.whl").write_bytes(payload)
    (wheels / "dep-1.0-py3-none-any.whl").write_bytes(b"a dependency")
    wh._keep(build, root, scratch, wheels, 1.0)
    house = install.wheelhouse(build)
    assert house.cached and house.dir == root / build.name
    return house


def _evil_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"not the wheel that was built"
        info = tarfile.TarInfo("testbed-9.9.9-py3-none-any.whl")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _rewrite(house: install.Wheelhouse) -> bytes:
    """What an attacker who can write the cache does: a new wheels.tar, and a manifest that vouches
    for it exactly as the old check read it (tar_bytes, tar_sha256)."""
    evil = _evil_tar()
    house.tar.write_bytes(evil)
    manifest = json.loads((house.dir / "manifest.json").read_text())
    manifest.update(tar_bytes=len(evil), tar_sha256=hashlib.sha256(evil).hexdigest())
    (house.dir / "manifest.json").write_text(json.dumps(manifest))
    return evil


def test_a_wheelhouse_whose_tar_and_manifest_were_both_rewritten_is_refused(house_env):
    build = _build(house_env)
    house = _made(build, house_env)
    assert house.sha256 == hashlib.sha256(house.tar.read_bytes()).hexdigest()
    _rewrite(house)
    with pytest.raises(errors.WheelhouseError) as caught:
        install.wheelhouse(build)
    text = str(caught.value)
    assert "changed after it was built" in text and str(house.dir) in text and house.sha256 in text, text
    # the ledger lies outside the cache: the cache's writer never reached it
    assert not str(install.ledger_root()).startswith(str(install.cache_root()))


def test_an_entry_nobody_recorded_is_not_used(house_env):
    """A whole entry planted in the cache (no build of ours recorded a digest for it) is built anew,
    never used."""
    build = _build(house_env)
    root = wh._private_dir(wh._private_dir(install.cache_root()) / "wheelhouse")
    entry = root / build.name
    entry.mkdir()
    evil = _evil_tar()
    (entry / "wheels.tar").write_bytes(evil)
    (entry / "manifest.json").write_text(json.dumps({"key": build.key, "wheels": ["x.whl"], "size": 1,
                                                     "tar_bytes": len(evil),
                                                     "tar_sha256": hashlib.sha256(evil).hexdigest()}))
    found, why = wh._load_cached(build, entry)
    assert found is None and "no digest of it was recorded" in why, why


def test_a_ledger_others_can_write_is_refused(house_env, monkeypatch):
    shared = house_env / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)   # (not sticky: anyone may replace what is in it)
    monkeypatch.setenv("TESTBED_WHEELHOUSE_LEDGER", str(shared / "ledger"))
    with pytest.raises(errors.InstallRefused, match=rf"ledger .*not private: {shared} is owned by uid \d+ "
                                                     "with mode 777"):
        wheelhouse_ledger.ledger_dir()
    os.chmod(shared, 0o1777)  # sticky, like /tmp: fine
    assert wheelhouse_ledger.ledger_dir() == shared / "ledger"


class _HereHost:
    """A HostControl that runs the command on this machine (what a host's sshd would run)."""

    name = "h-here"

    def run(self, argv, *, stdin=None, timeout=None, check=False, on_stdout=None):
        from testbed.cluster.remote import RemoteResult

        data = stdin.read() if hasattr(stdin, "read") else (stdin or b"")
        done = subprocess.run(list(argv), input=data, capture_output=True, timeout=timeout)
        if on_stdout is not None:
            on_stdout(done.stdout)
        return RemoteResult(done.returncode, done.stdout.decode(errors="replace"),
                            done.stderr.decode(errors="replace"), self.name, tuple(argv))


def test_a_host_refuses_a_stream_that_is_not_the_recorded_one(house_env):
    """The tar is rewritten after the controller checked it, on its way to the host: the host
    checks what it received against the digest the install command carries, and unpacks nothing."""
    build = _build(house_env)
    house = _made(build, house_env)
    _rewrite(house)   # (after wheelhouse() returned: the check above it cannot see this)
    prefix = house_env / "prefix"
    h = install._Host(_HereHost(), install.HostOutcome("h-here"))
    h.out.python = "3.11"
    install._install_on(h, str(prefix), build.version, sys.executable, house, False, "run1", lambda m: None)
    assert h.out.state == "failed", (h.out.why, h.out.details)
    assert "refused the wheelhouse it received" in h.out.why and house.sha256 in h.out.why, h.out.why
    assert any("not the one the controller built" in d for d in h.out.details), h.out.details
    # nothing unpacked, no venv, no scratch left
    assert sorted(p.name for p in prefix.iterdir()) == [".install.lock"], list(prefix.iterdir())


def test_the_receiver_takes_exactly_the_recorded_bytes(tmp_path):
    """The host's receiving step alone: the recorded bytes pass; one byte more, one less or another
    byte anywhere is refused with exit status 4 and both digests named."""
    good = os.urandom(300_000)
    digest = hashlib.sha256(good).hexdigest()

    def receive(data: bytes, name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", "-c", install._RECEIVE, str(tmp_path / name), digest,
                               str(len(good))], input=data, capture_output=True, timeout=60)

    ok = receive(good, "ok")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "ok").read_bytes() == good
    for name, data in [("longer", good + b"x"), ("shorter", good[:-1]), ("changed", good[:-1] + b"\0")]:
        r = receive(data, name)
        assert r.returncode == install.RECEIVE_REFUSED, (name, r.stderr)
        assert digest in r.stderr.decode() and "nothing unpacked" in r.stderr.decode(), r.stderr
    # made new, never through a link planted at its name
    (tmp_path / "planted").symlink_to(tmp_path / "target")
    r = receive(good, "planted")
    assert r.returncode != 0 and not (tmp_path / "target").exists()


def test_the_ledger_keeps_a_digest_per_build_and_prunes_old_ones(house_env, monkeypatch):
    build = _build(house_env)
    monkeypatch.setattr(wheelhouse_ledger, "KEEP_LEDGER", 3)
    for i in range(5):
        digest = hashlib.sha256(str(i).encode()).hexdigest()
        wheelhouse_ledger.record(build.name, build.key, digest, i)
        # (its age: older than the next one's, which is written now)
        entry = wheelhouse_ledger.ledger_dir() / wheelhouse_ledger.entry_name(build.name, digest)
        os.utime(entry, (1000 + i, 1000 + i))
    kept = wheelhouse_ledger.recorded(build.name)
    assert kept == {hashlib.sha256(str(i).encode()).hexdigest() for i in (2, 3, 4)}
