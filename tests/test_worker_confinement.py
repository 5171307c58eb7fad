"""A worker cannot undo its own emulation nor reach the host's controls, on both runtimes.

Root inside a worker tries what a job (or a curious user) could: remove its uplink's shaping
(`tc qdisc del dev IF root`) and read or write the state file testbed acts on as root. Without
--net-admin the tc call fails and the link keeps its rate; with --net-admin (the control: it
shows the measurement can tell) the shaping goes and the rate jumps. The Docker cases need the
daemon and image (see tests/test_runtime_docker.py: they skip without, fail in CI).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess

import pytest

import requires
from waiting import tcp_sockets, wait_for

from testbed import lifecycle, paths
from testbed import node_exec
from testbed.topology.loader import load_topology_text

pytestmark = pytest.mark.root

RATE_MBIT = 40
TOPOLOGY = f"""
name: confine
nodes: {{w0: {{kind: worker}}, w1: {{kind: worker}}, s: {{kind: switch}}}}
links:
  - {{endpoints: [w0, s], bandwidth: {RATE_MBIT}mbit}}
  - {{endpoints: [w1, s]}}
"""
_counter = itertools.count()


def _docker_ready() -> str | None:
    from testbed.runtime import docker as dk

    if not dk.daemon_available():
        return f"no Docker daemon at {dk.docker_host()} (scripts/dockerd.sh start)"
    if not dk.image_available(os.environ.get("TESTBED_WORKER_IMAGE", dk.DEFAULT_IMAGE)):
        return "worker image missing (make image)"
    return None


@pytest.fixture
def testbed_of(tmp_path, monkeypatch):
    """up(runtime, net_admin) -> state; everything it made goes at the end."""
    requires.need("root", ok=os.geteuid() == 0)
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    made: list[tuple[str, str]] = []

    def up(runtime: str, net_admin: bool) -> dict:
        if runtime == "docker":
            why = _docker_ready()
            if why:
                requires.need("docker", ok=False, why=why)
        name = f"cf{os.getpid() % 100000}x{next(_counter)}"
        made.append((name, runtime))
        return lifecycle.up(load_topology_text(TOPOLOGY), name, runtime=runtime, time_dilation="none",
                            net_admin=net_admin)

    yield up
    from testbed import store

    for name, runtime in made:
        try:
            if store.exists(name):
                lifecycle.down(name)
        finally:
            if runtime == "docker":   # containers of an up that failed half-way
                from testbed.runtime import docker as dk

                dk.cleanup_by_label(name)


def _in(st: dict, node: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(node_exec.exec_argv(st, node, argv), capture_output=True, text=True, timeout=timeout)


def _uplink(st: dict, node: str) -> str:
    out = _in(st, node, ["ip", "-o", "link", "show"]).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    up = [n for n in names if n != "lo"]
    assert len(up) == 1, out
    return up[0]


def _goodput_mbit(st: dict) -> float:
    """TCP goodput w0 -> w1 over 2 s, from iperf3 in the workers."""
    server = subprocess.Popen(node_exec.exec_argv(st, "w1", ["iperf3", "-s", "-1", "-p", "5299"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # read through w1's init, which is in w1's namespace (with Docker, the exec client is not)
        init = st["runtime"]["workers"]["w1"]["pid"]
        wait_for(lambda: server.poll() is not None or tcp_sockets(init, 5299, "LISTEN"), timeout=30,
                 what="iperf3's server in w1 to listen")
        r = _in(st, "w0", ["iperf3", "-c", "w1", "-p", "5299", "-t", "2", "-J"])   # one measurement
        doc = json.loads(r.stdout or "{}")
        assert "error" not in doc and doc.get("end"), f"iperf3 failed: {r.stdout[-500:]} {r.stderr[-500:]}"
        return doc["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.parametrize("runtime", ["netns", "docker"])
def test_worker_cannot_remove_its_shaping(testbed_of, runtime):
    st = testbed_of(runtime, net_admin=False)
    before = _goodput_mbit(st)
    assert before <= RATE_MBIT * 1.1, f"the link is not shaped to begin with ({before:.1f} Mbit/s)"
    uplink = _uplink(st, "w0")
    r = _in(st, "w0", ["tc", "qdisc", "del", "dev", uplink, "root"])
    assert r.returncode != 0, "root in a worker removed its own shaping"
    assert "not permitted" in (r.stderr + r.stdout).lower(), r.stderr
    after = _goodput_mbit(st)
    assert after <= RATE_MBIT * 1.1, f"{after:.1f} Mbit/s after the worker's tc call (shaped to {RATE_MBIT})"
    assert _in(st, "w0", ["ip", "link", "set", uplink, "mtu", "1400"]).returncode != 0


@pytest.mark.parametrize("runtime", ["netns", "docker"])
def test_net_admin_lets_a_worker_remove_its_shaping(testbed_of, runtime):
    """The control: with --net-admin the same call succeeds and the rate is no longer the link's."""
    st = testbed_of(runtime, net_admin=True)
    assert st["runtime"]["net_admin"] is True
    uplink = _uplink(st, "w0")
    r = _in(st, "w0", ["tc", "qdisc", "del", "dev", uplink, "root"])
    assert r.returncode == 0, r.stderr
    after = _goodput_mbit(st)
    assert after > RATE_MBIT * 2, f"{after:.1f} Mbit/s: removing the shaping changed nothing?"


@pytest.mark.parametrize("runtime", ["netns", "docker"])
def test_worker_cannot_reach_the_state_directory(testbed_of, runtime):
    st = testbed_of(runtime, net_admin=False)
    name = st["name"]
    state = paths.state_file(name)
    assert state.is_file()
    assert _in(st, "w0", ["test", "-e", str(state)]).returncode == 1, "a worker sees the state file"
    before = state.read_bytes()
    _in(st, "w0", ["sh", "-c", f"echo planted > {state}; echo planted > {state.parent}/planted"])
    assert state.read_bytes() == before
    assert not (state.parent / "planted").exists()
    # the one folder workers share with the host: where ranks write their probe files
    runs = paths.directory(name) / "runs"
    assert _in(st, "w0", ["sh", "-c", f"echo ok > {runs}/from-w0"]).returncode == 0
    assert (runs / "from-w0").read_text() == "ok\n"
