"""testbed cp on one host: what a node hands back passes the tar gate like any other stream.

Root in a worker makes a setuid-root copy of /bin/sh and a world-writable block device node, then
the operator copies the directory (or the file) out. Nothing set-id, no device and no owner from
the node may land on this machine; a refused copy leaves nothing behind. On both runtimes: a netns
worker, and a Docker worker (where the boundary is Docker's: root in the container keeps Docker's
default capabilities, mknod among them, and `docker exec tar` would hand both over as they are).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.root   # (the root marker skips, or fails where root is required: tests/requires.py)

REPO = Path(__file__).resolve().parents[1]
TOPO = """
name: hc
nodes:
  w0: {kind: worker}
  w1: {kind: worker}
  s0: {kind: switch}
links:
  - {endpoints: [w0, s0], bandwidth: 1gbit}
  - {endpoints: [w1, s0], bandwidth: 1gbit}
"""


def _tb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def _docker_ready() -> None:
    import requires

    from testbed.runtime import docker as dk

    if not dk.daemon_available():
        requires.need("docker", ok=False, why=f"no Docker daemon at {dk.docker_host()} (scripts/dockerd.sh start)")
    image = os.environ.get("TESTBED_WORKER_IMAGE", dk.DEFAULT_IMAGE)
    if not dk.image_available(image):
        requires.need("docker", ok=False, why=f"image {image} missing (make image)")


@pytest.fixture(params=["netns", pytest.param("docker", marks=pytest.mark.docker)])
def bed(request, testbed, tmp_path, monkeypatch):
    from testbed.topology.loader import load_topology_text

    if request.param == "docker":
        _docker_ready()
        monkeypatch.chdir(tmp_path)   # (Docker workers mount the directory `up` ran in)
    st = testbed(load_topology_text(TOPO, "<test>"), runtime=request.param)
    assert st["runtime"]["kind"] == request.param
    name = st["name"]
    loot = ("mkdir -p /tmp/loot && cp /bin/sh /tmp/loot/sh && chmod 4755 /tmp/loot/sh && "
            "mknod -m 666 /tmp/loot/disk b 8 0 && echo hi > /tmp/loot/note && chown 1234:1234 /tmp/loot/note && "
            "cp /bin/sh /tmp/suid && chmod 6755 /tmp/suid && mknod -m 666 /tmp/dev b 8 0")
    r = _tb("exec", "--name", name, "w0", "--", "sh", "-c", loot)
    assert r.returncode == 0, r.stderr
    dst = Path("/var/tmp") / f"tbcp-{uuid.uuid4().hex[:8]}"
    dst.mkdir()
    yield name, dst
    shutil.rmtree(dst, ignore_errors=True)


def _setid_or_devices(root: Path) -> list[str]:
    bad = []
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode) or st.st_mode & 0o6000 or st.st_uid != 0:
            bad.append(f"{p} {oct(st.st_mode)} uid {st.st_uid}")
    return bad


def test_a_directory_with_a_device_is_refused_and_leaves_nothing(bed):
    name, dst = bed
    r = _tb("cp", "--name", name, "w0:/tmp/loot", f"{dst}/")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "disk" in r.stderr and "device" in r.stderr
    assert list(dst.iterdir()) == []


def test_a_device_file_is_refused(bed):
    name, dst = bed
    r = _tb("cp", "--name", name, "w0:/tmp/dev", str(dst / "dev"))
    assert r.returncode == 2 and "device" in r.stderr, r.stderr
    assert list(dst.iterdir()) == []


def test_setid_bits_and_owners_do_not_land(bed):
    name, dst = bed
    r = _tb("exec", "--name", name, "w0", "--", "rm", "/tmp/loot/disk")
    assert r.returncode == 0
    r = _tb("cp", "--name", name, "w0:/tmp/loot", f"{dst}/")
    assert r.returncode == 0, r.stderr
    r = _tb("cp", "--name", name, "w0:/tmp/suid", str(dst / "suid"))
    assert r.returncode == 0, r.stderr
    assert (dst / "loot" / "note").read_text() == "hi\n"
    assert (dst / "suid").stat().st_mode & 0o7777 == 0o755
    assert _setid_or_devices(dst) == []
    # node to node on one host takes the same way: no set-id bits inside the other node either
    r = _tb("cp", "--name", name, "w0:/tmp/suid", "w1:/tmp/suid")
    assert r.returncode == 0, r.stderr
    r = _tb("exec", "--name", name, "w1", "--", "stat", "-c", "%a", "/tmp/suid")
    assert r.stdout.strip() == "755", r.stdout
