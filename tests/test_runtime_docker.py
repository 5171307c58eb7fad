"""The Docker runtime: workers as containers whose namespaces the data plane wires up.

Needs root, a Docker daemon (DOCKER_HOST; `scripts/dockerd.sh start`) and the
worker image (`make image`). Without them these tests skip, except where
TESTBED_REQUIRE_DOCKER=1 (CI starts the daemon and builds the image, so a
skip there would hide a failure).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import time

import pytest

import requires
from waiting import need_py_spy, paused_at, wait_for

from testbed.net import netns
from testbed.runtime import docker as dk
from testbed.topology.model import Node

_counter = itertools.count()


def _skip_or_fail(msg: str) -> None:
    requires.need("docker", ok=False, why=msg)   # a failure under TESTBED_REQUIRE_DOCKER=1 or TESTBED_REQUIRE=all


# -- no daemon needed ------------------------------------------------------------------------------------------

def test_missing_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(dk.DockerUnavailable) as ei:
        dk.connect(f"unix://{tmp_path}/nothing.sock", timeout=2)
    assert "scripts/dockerd.sh start" in str(ei.value)
    assert ei.value.exit_code == 3


def test_exec_argv_shape():
    rt = dk.DockerRuntime("argv", host="unix:///x.sock")
    rec = {"container": "tb-argv-w0", "env": {"GLOO_SOCKET_IFNAME": "eth0"}}
    argv = rt.exec_argv("w0", rec, ["python", "t.py"], env={"A": "1"}, tty=True, workdir="/w")
    assert argv[1:] == ["-H", "unix:///x.sock", "exec", "-i", "-t", "-w", "/w",
                        "-e", "GLOO_SOCKET_IFNAME=eth0", "-e", "A=1", "tb-argv-w0", "python", "t.py"]
    assert "-t" not in rt.exec_argv("w0", {}, ["true"])
    assert rt.exec_argv("w0", {}, ["true"])[-2] == "tb-argv-w0"


def test_hosts_file_either_direction():
    text = dk._hosts_file({"w0": "10.0.0.1", "10.0.0.2/24": "w1"}, "w0")
    assert "10.0.0.1\tw0" in text and "10.0.0.2\tw1" in text and "localhost" in text


# -- with a daemon -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon():
    if os.geteuid() != 0:
        _skip_or_fail("not root (binding container namespaces on /run/netns needs it)")
    if not dk.daemon_available():
        _skip_or_fail(f"no Docker daemon at {dk.docker_host()} (scripts/dockerd.sh start)")
    image = os.environ.get("TESTBED_WORKER_IMAGE", dk.DEFAULT_IMAGE)
    if not dk.image_available(image):
        _skip_or_fail(f"image {image} missing (make image)")
    return image


@pytest.fixture
def rt(daemon, tmp_path, monkeypatch):
    """A DockerRuntime for a unique testbed; removes every container and namespace it made."""
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    name = f"dk{os.getpid() % 100000}x{next(_counter)}"
    runtime = dk.DockerRuntime(name, workdir=str(tmp_path))
    try:
        yield runtime
    finally:
        dk.cleanup_by_label(name)
        for ns in netns.list_names(f"tb-{name}-"):
            netns.delete(ns)


def _run(rt, node, rec, argv, **kw):
    return subprocess.run(rt.exec_argv(node, rec, argv), capture_output=True, text=True, timeout=120, **kw)


def _veth(ns_a: str, ns_b: str, addr_a: str, addr_b: str) -> None:
    """A veth eth0<->eth0 between two namespaces, addressed (what the data plane does, by hand)."""
    tag = f"tbv{os.getpid() % 10000}{next(_counter)}"
    cmds = [
        ["ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"],
        ["ip", "link", "set", f"{tag}a", "netns", ns_a, "name", "eth0"],
        ["ip", "link", "set", f"{tag}b", "netns", ns_b, "name", "eth0"],
        ["ip", "-n", ns_a, "addr", "add", addr_a, "dev", "eth0"],
        ["ip", "-n", ns_b, "addr", "add", addr_b, "dev", "eth0"],
        ["ip", "-n", ns_a, "link", "set", "eth0", "up"],
        ["ip", "-n", ns_b, "link", "set", "eth0", "up"],
    ]
    for c in cmds:
        subprocess.run(c, check=True, capture_output=True)


def _pair(rt, **node_kw):
    nodes = [Node(n, "worker", **node_kw) for n in ("w0", "w1")]
    nss = [f"tb-{rt.testbed}-{n.name}" for n in nodes]
    rt.prepare_many(zip(nodes, nss))
    _veth(nss[0], nss[1], "10.77.0.1/24", "10.77.0.2/24")
    hosts = {"w0": "10.77.0.1", "w1": "10.77.0.2"}
    recs = {n.name: rt.start(n, ns, {"GLOO_SOCKET_IFNAME": "eth0"}, hosts) for n, ns in zip(nodes, nss)}
    return recs


@pytest.mark.docker
@pytest.mark.root
def test_worker_isolation(rt, tmp_path):
    recs = _pair(rt)
    r0, r1 = recs["w0"], recs["w1"]
    assert _run(rt, "w0", r0, ["hostname"]).stdout.strip() == "w0"
    assert _run(rt, "w1", r1, ["hostname"]).stdout.strip() == "w1"
    # only its own processes: init (tini), sleep, and ps itself
    ps = _run(rt, "w0", r0, ["ps", "-e", "-o", "comm="]).stdout.split()
    assert set(ps) <= {"docker-init", "tini", "sleep", "ps"}, ps
    # private /tmp
    assert _run(rt, "w0", r0, ["sh", "-c", "echo hi > /tmp/only-w0"]).returncode == 0
    assert _run(rt, "w1", r1, ["test", "-e", "/tmp/only-w0"]).returncode != 0
    assert not os.path.exists("/tmp/only-w0")
    # names of peers, from /etc/hosts
    assert _run(rt, "w0", r0, ["getent", "hosts", "w1"]).stdout.split()[0] == "10.77.0.2"
    # only lo + the emulated interface, and traffic crosses it
    links = _run(rt, "w0", r0, ["ip", "-o", "link", "show"]).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == ["eth0", "lo"]
    assert _run(rt, "w0", r0, ["ping", "-c", "2", "-i", "0.2", "-W", "2", "w1"]).returncode == 0
    # the env given to start() reaches jobs, and the project directory is the working directory
    out = _run(rt, "w0", r0, ["sh", "-c", "echo $GLOO_SOCKET_IFNAME; pwd"]).stdout.split()
    assert out == ["eth0", str(tmp_path)]
    # the testbed package imports inside (the probe and jobs run there)
    assert _run(rt, "w0", r0, ["python", "-c", "import testbed.runtime.base, torch"]).returncode == 0
    # the record reaches the worker from another process: pid is its init in the host's view
    assert rt.pid("w0", r0) == r0["pid"]
    assert os.stat(f"/proc/{r0['pid']}/ns/net").st_ino == netns.inode(r0["netns"])


@pytest.mark.timing   # a CPU share: measured alone, after the parallel part
@pytest.mark.docker
@pytest.mark.root
def test_cpu_limit(rt):
    node = Node("w0", "worker", cpus=0.5)
    ns = f"tb-{rt.testbed}-w0"
    rt.prepare_netns(node, ns)
    rec = rt.start(node, ns, {}, {"w0": "10.77.0.1"})
    burn = textwrap.dedent("""
        import time
        t0, c0 = time.time(), time.process_time()
        while time.time() - t0 < 3: pass
        print((time.process_time() - c0) / (time.time() - t0))
    """)
    # 5 runs (2026-12-02, the 2-core machine, other sessions' tests beside; `pytest -s -k cpu_limit`):
    # 0.487-0.500 cores at 0.5 cpu, 0.245-0.250 at 0.25. Above the quota only by a period's edge in
    # the 3 s window; below it by what others' work takes (under 3% seen, 20% allowed). (Were 0.3-0.7
    # and 0.1-0.4.)
    share = float(_run(rt, "w0", rec, ["python", "-c", burn]).stdout)
    print(f"a 0.5-cpu container's busy loop: {share:.3f} cores")
    assert 0.4 < share < 0.55, share
    rt.set_limits("w0", rec, cpus=0.25)
    share = float(_run(rt, "w0", rec, ["python", "-c", burn]).stdout)
    print(f"at 0.25 cpu: {share:.3f} cores")
    assert 0.2 < share < 0.3, share


@pytest.mark.docker
@pytest.mark.root
def test_memory_hog_is_killed_alone(rt):
    recs = _pair(rt, memory_bytes=192 << 20)
    hog = "b = bytearray(600 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')"
    res = _run(rt, "w0", recs["w0"], ["python", "-c", hog])
    assert res.returncode == 137 and "survived" not in res.stdout, res
    # the worker itself, its neighbour and the link between them are fine
    assert rt.pid("w0", recs["w0"]) and rt.pid("w1", recs["w1"])
    assert _run(rt, "w1", recs["w1"], ["ping", "-c", "1", "-W", "2", "w0"]).returncode == 0
    c = rt.client.containers.get(recs["w0"]["container"])
    assert c.attrs["HostConfig"]["Memory"] == 192 << 20
    assert c.attrs["HostConfig"]["MemorySwap"] == 192 << 20


@pytest.mark.docker
@pytest.mark.root
def test_remove_leaves_nothing(rt):
    node = Node("w0", "worker")
    ns = f"tb-{rt.testbed}-w0"
    rt.prepare_netns(node, ns)
    rec = rt.start(node, ns, {}, {})
    rt.remove("w0", rec)
    assert not netns.exists(ns)
    assert dk.list_containers(rt.testbed) == []
    rt.remove("w0", rec)  # idempotent
    rt.remove("w0", {"netns": ns})  # a half-made worker's record


@pytest.mark.docker
@pytest.mark.root
def test_stop_kill_restart_keep_the_namespace(rt):
    """Faults act inside the container: its namespace (and so its links) survives them all."""
    recs = _pair(rt)
    rec = recs["w0"]
    ns_inode = netns.inode(rec["netns"])
    job = subprocess.Popen(rt.exec_argv("w0", rec, ["sleep", "300"]))
    try:
        # tini and its `sleep infinity` (the machine), and the job's sleep once `docker exec` runs it
        wait_for(lambda: len(rt.processes("w0", rec)) >= 3, timeout=30, what="the job's sleep in w0")
        rt.stop("w0", rec)                      # frozen
        assert rt._get("w0", rec).status == "paused"
        rt.kill("w0", rec)                      # crashed: the workload dies, the init stays
        job.wait(timeout=30)
        assert len(rt.processes("w0", rec)) == 2  # tini and its sleep: the machine itself
        new = rt.restart("w0", rec)
        assert new["pid"] == rec["pid"] and rt.pid("w0", new) == rec["pid"]
        assert netns.inode(new["netns"]) == ns_inode
        assert _run(rt, "w0", new, ["hostname"]).stdout.strip() == "w0"
        assert "eth0" in _run(rt, "w0", new, ["ip", "-o", "link", "show"]).stdout
        assert _run(rt, "w0", new, ["ping", "-c", "1", "-W", "2", "w1"]).returncode == 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


@pytest.mark.docker
@pytest.mark.root
def test_cleanup_by_label_after_cli_died(rt):
    script = textwrap.dedent(f"""
        import os
        from testbed.runtime.docker import DockerRuntime
        from testbed.topology.model import Node
        rt = DockerRuntime({rt.testbed!r})
        for n in ("w0", "w1"):
            rt.prepare_netns(Node(n, "worker"), "tb-{rt.testbed}-" + n)
        os.kill(os.getpid(), 9)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == -9, res.stderr
    assert len(dk.list_containers(rt.testbed)) == 2
    other = dk.DockerRuntime(rt.testbed + "y")  # another testbed's containers are not touched
    assert other.cleanup_by_label() == []
    removed = dk.cleanup_by_label(rt.testbed)
    assert sorted(removed) == [f"tb-{rt.testbed}-w0", f"tb-{rt.testbed}-w1"]
    assert dk.list_containers(rt.testbed) == []
    assert netns.list_names(f"tb-{rt.testbed}-") == []


@pytest.mark.docker
@pytest.mark.root
@pytest.mark.slow
def test_sixteen_workers_start_concurrently(rt):
    nodes = [Node(f"w{i}", "worker", cpus=0.5, memory_bytes=512 << 20) for i in range(16)]
    t0 = time.perf_counter()
    rt.prepare_many((n, f"tb-{rt.testbed}-{n.name}") for n in nodes)
    recs = {n.name: rt.start(n, f"tb-{rt.testbed}-{n.name}", {}, {m.name: f"10.0.0.{i + 1}" for i, m in
                                                                     enumerate(nodes)}) for n in nodes}
    took = time.perf_counter() - t0
    print(f"\n16 docker workers prepared+started in {took:.1f} s")
    assert all(rt.pid(n, r) for n, r in recs.items())
    assert took < 120


@pytest.mark.docker
@pytest.mark.root
def test_up_star_with_docker_runtime(daemon, tmp_path, monkeypatch):
    from testbed import lifecycle
    from testbed import node_exec
    from testbed.topology.generators import GENERATORS
    from testbed.topology.model import Topology

    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    name = f"dkup{os.getpid() % 100000}x{next(_counter)}"
    nodes, links = GENERATORS["star"].generate({"n": 2}, None, None)
    topo = Topology(name="star", nodes=nodes, links=links, generator="star").validate()
    try:
        st = lifecycle.up(topo, name, runtime="docker")
        assert st["runtime"]["kind"] == "docker"
        workers = sorted(st["runtime"]["workers"])
        assert len(workers) == 2 and all(st["runtime"]["workers"][w].get("container") for w in workers)
        a, b = workers

        def run(node, argv):
            return subprocess.run(node_exec.exec_argv(st, node, argv), capture_output=True, text=True, timeout=60)

        assert run(a, ["hostname"]).stdout.strip() == a
        assert run(a, ["ping", "-c", "2", "-i", "0.2", "-W", "2", b]).returncode == 0
        ifs = run(a, ["ip", "-o", "link", "show"]).stdout
        assert len(ifs.splitlines()) == 2  # lo + the host link
        assert run(a, ["sh", "-c", "echo $GLOO_SOCKET_IFNAME"]).stdout.strip()
        # out of a worker's reach: the state file (root acts on it) and, by default, writes to the
        # caller's directory; the runs' exchange folder is there for the probe
        from testbed import paths

        assert run(a, ["test", "-e", str(paths.state_file(name))]).returncode == 1
        assert run(a, ["test", "-d", str(paths.directory(name) / "runs")]).returncode == 0
        run(a, ["sh", "-c", f"echo planted > {paths.directory(name)}/planted"])
        assert not (paths.directory(name) / "planted").exists()
        assert run(a, ["sh", "-c", f"touch {tmp_path}/from-worker"]).returncode != 0
        assert not (tmp_path / "from-worker").exists()
        lifecycle.down(name)
        assert dk.list_containers(name) == []
        assert netns.list_names(f"tb-{name}-") == []
    finally:
        dk.cleanup_by_label(name)
        try:
            lifecycle.down(name)
        except Exception:
            pass


@pytest.mark.docker
@pytest.mark.root
def test_fat_tree_on_docker_all_pairs_then_kill_9_and_cleanup(daemon, tmp_path, monkeypatch):
    """The k=4 fat-tree with 16 worker containers: every worker reaches every other; an `up`
    killed with -9 midway leaves containers that `testbed cleanup` removes, and nothing else."""
    from test_dataplane import all_pairs_reachable
    from testbed import lifecycle
    from testbed.topology.loader import load_topology

    state_dir = tmp_path / "state"
    monkeypatch.setenv("TESTBED_STATE_DIR", str(state_dir))
    monkeypatch.chdir(tmp_path)
    name = f"dkft{os.getpid() % 100000}x{next(_counter)}"
    try:
        st = lifecycle.up(load_topology("fat-tree"), name, runtime="docker")
        assert len(dk.list_containers(name)) == 16
        all_pairs_reachable(st)
        lifecycle.down(name)
        assert dk.list_containers(name) == [] and netns.list_names(f"tb-{name}-") == []

        # kill -9 of the CLI once the containers exist, then cleanup
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        p = subprocess.Popen([sys.executable, "-c", "from testbed.cli import main; main()", "up", "fat-tree",
                              "--runtime", "docker", "--name", name],
                             env={**os.environ, "PYTHONPATH": repo, "TESTBED_PAUSE_AT": "configured:60"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            need_py_spy("the test waits for up's pause by reading its stack")
            wait_for(lambda: p.poll() is not None or paused_at(p.pid, "configured"), timeout=120, interval=0.2,
                     what="up to pause once the fabric is configured (its 16 containers made)")
            assert p.poll() is None, f"up ended first: status {p.returncode}"
        finally:
            p.kill()
            p.wait()
        assert dk.list_containers(name), "the killed up should have left containers behind"
        r = subprocess.run([sys.executable, "-c", "from testbed.cli import main; main()", "cleanup"],
                           env={**os.environ, "PYTHONPATH": repo}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert dk.list_containers(name) == []
        assert netns.list_names(f"tb-{name}-") == []
        assert not (state_dir / name).exists()
    finally:
        dk.cleanup_by_label(name)
        for ns in netns.list_names(f"tb-{name}-"):
            netns.delete(ns)
