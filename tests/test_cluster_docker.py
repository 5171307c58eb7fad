"""Docker workers on the hosts of a testbed over several hosts: `testbed up --hosts ... --runtime docker`.

Two emulated hosts (testbed/cluster/emulate.py, create(docker_socket=...)) share this machine's Docker
daemon: each sees its socket at /run/docker.sock, where the Docker SDK looks by default, and keeps
its testbed state under its own DIR/hN/state (the daemon resolves the containers' bind mounts in
this machine's filesystem, and the state root labels each host's containers apart). The controller
keeps its record in a state root of its own (TESTBED_STATE_DIR). topologies/two-sides.yaml pinned
across them (s0-s1 is the cut link, a VXLAN tunnel) goes up with containers as workers, w0 pings w2
across the cut link, and `down` leaves no container, namespace or interface on either host.

Needs root, openssh-server, a Docker daemon (DOCKER_HOST, a unix socket; `scripts/dockerd.sh start`)
and the worker image (`make image`). Without the daemon or the image it skips, except where
TESTBED_REQUIRE_DOCKER=1 (CI starts the daemon and builds the image, so a skip there would hide a
failure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

import requires

from cluster_hosts import PINS, REPO, TOPOLOGY, tb

pytestmark = [pytest.mark.root, pytest.mark.docker, pytest.mark.requires("sshd")]

HOST = {"w0": "h1", "w1": "h1", "w2": "h2", "w3": "h2"}


def _skip_or_fail(msg: str) -> None:
    requires.need("docker", ok=False, why=msg)   # a failure under TESTBED_REQUIRE_DOCKER=1 or TESTBED_REQUIRE=all


@pytest.fixture(scope="module")
def socket_path() -> str:
    from testbed.runtime import docker as dk

    if not dk.daemon_available():
        _skip_or_fail(f"no Docker daemon at {dk.docker_host()} (scripts/dockerd.sh start)")
    image = os.environ.get("TESTBED_WORKER_IMAGE", dk.DEFAULT_IMAGE)
    if not dk.image_available(image):
        _skip_or_fail(f"image {image} missing (make image)")
    if not dk.docker_host().startswith("unix://"):
        _skip_or_fail(f"the Docker daemon at {dk.docker_host()} is not a unix socket the emulated hosts can share")
    return dk.docker_host().removeprefix("unix://")


@pytest.fixture(scope="module")
def emulated_options(socket_path) -> dict:
    """The hosts share this machine's Docker daemon (`emu`, tests/conftest.py)."""
    return {"docker_socket": socket_path}


def containers(name: str) -> dict[str, dict]:
    """The daemon's containers of testbed `name`: container name -> its `docker inspect` document."""
    from testbed.runtime import docker as dk

    client = dk.connect()
    try:
        return {c.name: c.attrs for c in client.containers.list(all=True, filters={"label": f"testbed.name={name}"})}
    finally:
        client.close()


def host_run(emu, host: str) -> Path:
    """The host's own /run, seen from this machine through its holder process."""
    run = Path(f"/proc/{emu.host(host).holder_pid}/root/run")
    assert (run / ".testbed-emulated-host").read_text().split()[1] == host
    return run


def host_links(emu, host: str) -> list[str]:
    out = subprocess.run(["ip", "-n", emu.host(host).netns, "-j", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return sorted(link["ifname"] for link in json.loads(out))


def test_docker_workers_over_two_hosts_sharing_one_daemon(emu):
    from testbed.cluster import controller

    name = f"dk{uuid.uuid4().hex[:6]}"
    try:
        tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(emu.hosts_file), "--known-hosts", str(emu.known_hosts),
           "--time-dilation", "none", "--runtime", "docker", *PINS)
        found = containers(name)
        assert sorted(found) == [f"tb-{name}-{w}" for w in ("w0", "w1", "w2", "w3")]
        for w, host in HOST.items():
            c = found[f"tb-{name}-{w}"]
            # labelled with its host's own state root: one host's cleanup never takes the other's
            assert c["Config"]["Labels"]["testbed.state_root"] == emu.state_root(emu.host(host))
            assert c["State"]["Running"]
            # the container's network namespace is the one bound on its host's /run/netns, where
            # the host's data plane moved the worker's veth
            bound = host_run(emu, host) / "netns" / f"tb-{name}-{w}"
            assert os.stat(f"/proc/{c['State']['Pid']}/ns/net").st_ino == os.stat(bound).st_ino
        assert "eth0" in tb("exec", "w2", "--name", name, "--", "ip", "-br", "link").stdout
        # the directory `up` ran in on the controller is the workers' (as on one host), not the SSH login's
        assert tb("exec", "w2", "--name", name, "--", "pwd").stdout.strip() == str(REPO)
        tb("exec", "w0", "--name", name, "--", "ping", "-c", "1", "-W", "2", "w2")   # over the cut link
        # a DDP job over both hosts' containers (they start in the controller's directory, as on one
        # host); its run directories (the merged one and the hosts') go to this checkout's runs/
        before = set((REPO / "runs").glob("*")) if (REPO / "runs").is_dir() else set()
        try:
            r = tb("run", "--name", name, "--", "python", "examples/train_ddp.py", "--steps", "3", timeout=240)
            run_dir = Path(re.search(r"run directory: (\S+)", r.stdout).group(1))
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["status"] == "completed" and sorted(summary["hosts"]) == ["h1", "h2"], summary["status"]
            assert "parameters IDENTICAL on all 4 ranks" in (run_dir / "logs" / "w0.log").read_text()
        finally:
            for made in set((REPO / "runs").glob("*")) - before:
                shutil.rmtree(made, ignore_errors=True)
    finally:
        if controller.exists(name):
            r = tb("down", name, check=False)
            assert r.returncode == 0, r.stderr
    assert not controller.exists(name)
    assert containers(name) == {}
    for host in ("h1", "h2"):
        assert [ns for ns in os.listdir(host_run(emu, host) / "netns") if name in ns] == []
        assert host_links(emu, host) == ["eth0", "lo"]
        assert not (Path(emu.state_root(emu.host(host))) / name).exists()
