"""The netns runtime against the real kernel: identity, isolation, limits, attach, cleanup.

Namespaces are made here directly (two workers joined by one veth), so these
tests need nothing of the data plane beyond testbed.net.netns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (namespaces, cgroups)", allow_module_level=True)

from testbed.net import netns as nsmod  # noqa: E402
from testbed.runtime import cgroups  # noqa: E402
from testbed.runtime.env import worker_env  # noqa: E402
from testbed.runtime.netns import NetnsRuntime, pids_in_pidns  # noqa: E402
from testbed.topology.model import Node  # noqa: E402

if cgroups.hierarchy() is None:
    pytest.skip("no cgroup filesystem", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Bed:
    """A few workers joined pairwise by veths eth0 (10.77.0.0/24), started by the runtime."""

    def __init__(self, state_dir: Path, nodes: list[Node], link: bool = True):
        self.name = "rt" + uuid.uuid4().hex[:6]
        os.environ["TESTBED_STATE_DIR"] = str(state_dir)
        self.rt = NetnsRuntime(self.name)
        self.nodes = nodes
        self.ns = {n.name: f"tb-{self.name}-{n.name}" for n in nodes}
        self.recs: dict[str, dict] = {}
        self.hosts = {n.name: f"10.77.0.{i + 1}" for i, n in enumerate(nodes)}
        self.link = link

    def up(self) -> "Bed":
        for n in self.nodes:
            self.rt.prepare_netns(n, self.ns[n.name])
        if self.link and len(self.nodes) >= 2:
            a, b = self.nodes[0].name, self.nodes[1].name
            _ip("link", "add", "tbv" + uuid.uuid4().hex[:8], "netns", self.ns[a], "type", "veth", "peer", "name",
                "tbp" + uuid.uuid4().hex[:8], "netns", self.ns[b])
            for n in (a, b):
                ifn = subprocess.run(["ip", "-n", self.ns[n], "-o", "link", "show", "type", "veth"],
                                     capture_output=True, text=True, check=True).stdout.split(":")[1].strip()
                ifn = ifn.split("@")[0]
                _ip("-n", self.ns[n], "link", "set", ifn, "name", "eth0")
                _ip("-n", self.ns[n], "addr", "add", self.hosts[n] + "/24", "dev", "eth0")
                _ip("-n", self.ns[n], "link", "set", "eth0", "up")
                _ip("-n", self.ns[n], "link", "set", "lo", "up")
        recs = self.rt.start_many([(n, self.ns[n.name], worker_env(self.name, n.name, ["eth0"], cpus=n.cpus),
                                    self.hosts) for n in self.nodes])
        self.recs = {n.name: r for n, r in zip(self.nodes, recs)}
        return self

    def run(self, node: str, *argv: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.rt.exec_argv(node, self.recs[node], list(argv), **kw), capture_output=True,
                              text=True, timeout=timeout)

    def down(self) -> None:
        try:
            self.rt.remove_many(list(self.recs.items()))
        finally:
            for ns in self.ns.values():
                nsmod.delete(ns)


@pytest.fixture
def bed_factory(tmp_path, monkeypatch):
    beds: list[Bed] = []
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))

    def make(nodes: list[Node], **kw) -> Bed:
        b = Bed(tmp_path / "state", nodes, **kw)
        beds.append(b)
        return b.up()

    yield make
    for b in beds:
        b.down()
        for rec in b.recs.values():
            assert b.rt.pid("x", rec) is None
            for p in rec["cgroups"]:
                assert not os.path.exists(p)


def _start(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]     # a zombie is dead (its reaper is not ours)
    except (OSError, IndexError):
        return None


def W(name: str, **kw) -> Node:
    return Node(name=name, kind="worker", **kw)


def test_identity_and_isolation(bed_factory):
    bed = bed_factory([W("w0"), W("w1")])
    assert bed.run("w0", "hostname").stdout.strip() == "w0"
    assert bed.run("w1", "cat", "/etc/hostname").stdout.strip() == "w1"
    # its own PID space: the init is 1, and only its own processes are visible
    ps = bed.run("w0", "sh", "-c", "ls /proc | grep -E '^[0-9]+$'").stdout.split()
    assert "1" in ps and len(ps) <= 4, ps
    # name resolution of every worker, its own name on its emulated address
    r = bed.run("w0", "getent", "hosts", "w1")
    assert r.returncode == 0 and r.stdout.split()[0] == "10.77.0.2"
    assert bed.run("w1", "getent", "hosts", "w1").stdout.split()[0] == "10.77.0.2"
    # only lo and the emulated interfaces, seen both by netlink and by /sys
    links = bed.run("w0", "ip", "-o", "link").stdout
    assert sorted(l.split(":")[1].strip().split("@")[0] for l in links.splitlines()) == ["eth0", "lo"]
    assert sorted(bed.run("w0", "ls", "/sys/class/net").stdout.split()) == ["eth0", "lo"]
    # they talk over the emulated link
    assert bed.run("w0", "ping", "-c", "1", "-W", "2", "w1").returncode == 0
    # private /tmp (and /dev/shm): invisible to the other worker and to the host
    tag = uuid.uuid4().hex
    assert bed.run("w0", "sh", "-c", f"echo hi > /tmp/{tag} && echo hi > /dev/shm/{tag}").returncode == 0
    assert bed.run("w0", "cat", f"/tmp/{tag}").stdout == "hi\n"
    assert bed.run("w1", "test", "-e", f"/tmp/{tag}").returncode == 1
    assert bed.run("w1", "test", "-e", f"/dev/shm/{tag}").returncode == 1
    assert not os.path.exists(f"/tmp/{tag}") and not os.path.exists(f"/dev/shm/{tag}")
    # the host's filesystem otherwise: the venv and the code are there
    assert bed.run("w0", sys.executable, "-c", "import testbed, sys; print(sys.prefix)",
                   env={"PYTHONPATH": str(REPO)}).returncode == 0
    # the worker's environment, the caller's cwd by default, or a workdir
    r = bed.run("w0", "sh", "-c", "echo $TESTBED_NODE $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME; pwd",
                workdir="/etc")
    assert r.stdout.split() == ["w0", "=eth0", "eth0", "/etc"]
    # the host's hostname and /etc/hosts are untouched
    assert open("/etc/hostname").read().strip() != "w0"
    # cgroupfs is read-only inside: a job cannot lift its own limits (nor write anyone's)
    group = next((p for p in bed.recs["w0"]["cgroups"] if (Path(p) / "cgroup.procs").exists()), None)
    if group is not None:
        r = bed.run("w0", "sh", "-c", f"echo $$ > {group}/cgroup.procs")
        assert r.returncode != 0 and "Read-only file system" in r.stderr, r
        w = bed.run("w0", "sh", "-c", "grep ' /sys/fs/cgroup' /proc/self/mounts")
        visible = {}   # the last mount on a path is the one a process sees (the host's copies lie under /sys)
        for line in w.stdout.splitlines():
            visible[line.split()[1]] = line.split()[3]
        assert visible and all(opts.startswith("ro") for opts in visible.values()), w.stdout


def test_init_survives_the_starting_process(bed_factory, tmp_path):
    """A separate process starts a worker and exits; the worker keeps running; exec reaches it."""
    bed = Bed(tmp_path / "state", [W("solo")], link=False)
    try:
        bed.rt.prepare_netns(bed.nodes[0], bed.ns["solo"])
        code = (f"import json, os; os.environ['TESTBED_STATE_DIR']={str(tmp_path / 'state')!r};"
                "from testbed.runtime.netns import NetnsRuntime; from testbed.topology.model import Node;"
                f"rt = NetnsRuntime({bed.name!r});"
                f"print(json.dumps(rt.start(Node('solo', 'worker'), {bed.ns['solo']!r}, {{}}, {{}})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30).stdout
        bed.recs["solo"] = json.loads(out)
        time.sleep(0.2)
        assert bed.rt.pid("solo", bed.recs["solo"])
        assert bed.run("solo", "hostname").stdout.strip() == "solo"
        # an orphan is reaped by the worker's init (no zombie left behind)
        bed.run("solo", "sh", "-c", "sleep 0.1 & exit 0")
        time.sleep(0.5)
        st = [Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
              for p in pids_in_pidns(bed.recs["solo"]["pid"]) if os.path.exists(f"/proc/{p}/stat")]
        assert "Z" not in st
    finally:
        bed.down()
    assert bed.rt.pid("solo", bed.recs.get("solo", {})) is None


def test_cpu_limit_holds(bed_factory):
    bed = bed_factory([W("c0", cpus=0.5)], link=False)
    rec = bed.recs["c0"]
    busy = subprocess.Popen(bed.rt.exec_argv("c0", rec, [sys.executable, "-c", "while True: pass"]))
    try:
        time.sleep(0.5)
        u0, t0 = cgroups.cpu_usage_s(rec["cgroups"]), time.monotonic()
        time.sleep(2.0)
        u1, t1 = cgroups.cpu_usage_s(rec["cgroups"]), time.monotonic()
        share = (u1 - u0) / (t1 - t0)
        # at most half a core; the lower bound is loose: other work on a small machine competes
        assert 0.1 <= share <= 0.6, f"a 0.5-cpu worker used {share:.2f} cores"
    finally:
        busy.kill()
        busy.wait()
    # set_limits changes it live: the quota the kernel enforces follows
    bed.rt.set_limits("c0", rec, cpus=1.0)
    quota, period = cgroups.cfs(1.0)
    cpu_dirs = [p for p in rec["cgroups"] if "/cpu" in p and (Path(p) / "cpu.cfs_quota_us").exists()]
    v2 = [p for p in rec["cgroups"] if (Path(p) / "cpu.max").exists()]
    if cpu_dirs:
        assert int((Path(cpu_dirs[0]) / "cpu.cfs_quota_us").read_text()) == quota
    else:
        assert (Path(v2[0]) / "cpu.max").read_text().split() == [str(quota), str(period)]


def test_memory_hog_is_killed_alone(bed_factory):
    bed = bed_factory([W("m0", memory_bytes=64 << 20), W("m1")])
    hog = bed.run("m0", sys.executable, "-c", "b = [bytearray(1 << 20) for _ in range(400)]; print('survived')",
                  timeout=60)
    assert hog.returncode != 0 and "survived" not in hog.stdout
    assert (cgroups.oom_kills(bed.recs["m0"]["cgroups"]) or 0) >= 1
    # the worker and its neighbour are fine
    assert bed.run("m0", "hostname").stdout.strip() == "m0"
    assert bed.run("m1", "hostname").stdout.strip() == "m1"


def test_attach_is_interactive_and_leaves_the_worker_running(bed_factory, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    bed = bed_factory([W("a0"), W("a1")])
    code = (f"import json, os, sys; os.environ['TESTBED_STATE_DIR']={str(tmp_path / 'state')!r};"
            "from testbed.runtime.netns import NetnsRuntime;"
            f"rec = json.loads({json.dumps(json.dumps(bed.recs['a0']))});"
            f"sys.exit(NetnsRuntime({bed.name!r}).attach('a0', rec))")
    child = pexpect.spawn(sys.executable, ["-c", code], cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)},
                          encoding="utf-8", timeout=15)
    try:
        child.expect(r"a0:.*[#$] ")
        child.sendline("tty; echo HOST=$(hostname)")
        child.expect(r"/dev/pts/\d+")   # the shell inside the worker has a terminal, not a pipe
        child.expect("HOST=a0")
        child.sendline("exit 7")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 7
    assert bed.rt.pid("a0", bed.recs["a0"])
    assert bed.run("a0", "hostname").stdout.strip() == "a0"


def test_remove_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    bed = Bed(tmp_path / "state", [W("r0", cpus=1, memory_bytes=128 << 20), W("r1")]).up()
    rec = bed.recs["r0"]
    # a background job that would outlive a careless cleanup
    bg = subprocess.Popen(bed.rt.exec_argv("r0", rec, ["sleep", "300"]))
    time.sleep(0.3)
    inside = {p: _start(p) for r in bed.recs.values() for p in pids_in_pidns(r["pid"])}
    assert len(inside) >= 3     # two inits and the sleep
    bed.down()
    bg.wait(timeout=10)
    # (namespace inodes are recycled at once, so compare processes, not namespaces)
    left = [p for p, st in inside.items() if _start(p) == st]
    assert not left, f"processes left: {left}"
    for r in bed.recs.values():
        for p in r["cgroups"]:
            assert not os.path.exists(p)
    for m in cgroups.hierarchy().mounts.values():
        assert not (m / "testbed" / bed.name).exists()
    assert not (tmp_path / "state" / bed.name / "workers").exists()
    assert bed.name not in Path("/proc/self/mountinfo").read_text()


def test_sixteen_workers_start_fast(bed_factory):
    t0 = time.monotonic()
    bed = bed_factory([W(f"n{i}", cpus=0.5) for i in range(16)], link=False)
    took = time.monotonic() - t0
    assert took < 3.0, f"16 workers took {took:.2f} s"
    assert bed.run("n15", "hostname").stdout.strip() == "n15"


def test_kill_restart_stop(bed_factory):
    bed = bed_factory([W("k0")], link=False)
    rt, rec = bed.rt, bed.recs["k0"]
    rt.stop("k0", rec)
    assert cgroups.frozen(rec["cgroups"])       # a hung node: every process frozen
    rt.cont("k0", rec)
    assert not cgroups.frozen(rec["cgroups"])
    assert bed.run("k0", "hostname").stdout.strip() == "k0"
    rt.kill("k0", rec)
    assert rt.pid("k0", rec) is None
    new = rt.restart("k0", rec)
    bed.recs["k0"] = new
    assert bed.run("k0", "getent", "hosts", "k0").stdout.split()[0] == "10.77.0.1"


@pytest.fixture
def cli_bed(tmp_path, monkeypatch):
    """A testbed brought up by lifecycle.up (a star of 2 workers) for the CLI verbs."""
    from testbed import lifecycle
    from testbed.topology.model import Link, LinkProfile, Topology

    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    name = "cli" + uuid.uuid4().hex[:6]
    nodes = {"w0": W("w0"), "w1": W("w1"), "s0": Node("s0", "switch")}
    links = [Link(w, "s0", "edge", LinkProfile(), LinkProfile()) for w in ("w0", "w1")]
    st = lifecycle.up(Topology(name, nodes, links).validate(), name)
    try:
        yield name, st
    finally:
        lifecycle.down(name)


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, **kw)


def test_cli_attach_logs_cp_ps(cli_bed, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    name, st = cli_bed
    if st["runtime"]["kind"] != "netns":
        pytest.skip("lifecycle did not pick the netns runtime")
    # attach: a shell with a TTY inside w0; exiting it leaves w0 running
    child = pexpect.spawn(sys.executable, ["-m", "testbed", "attach", "w0", "--name", name], cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": str(REPO)}, encoding="utf-8", timeout=20)
    try:
        child.expect(r"w0:.*[#$] ")
        child.sendline("test -t 0 && echo TTY-$(hostname)")
        child.expect("TTY-w0")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert _cli("exec", "--name", name, "w0", "--", "hostname").stdout.strip() == "w0"
    # a switch too (a plain namespace)
    child = pexpect.spawn(sys.executable, ["-m", "testbed", "attach", "s0", "--name", name], cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": str(REPO)}, encoding="utf-8", timeout=20)
    try:
        child.expect(r"s0\].*[#$] ")
        child.sendline("exit 3")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 3
    # logs: what jobs write to TESTBED_LOG_DIR
    r = _cli("exec", "--name", name, "w1", "--", "sh", "-c", 'echo hello-from-w1 > "$TESTBED_LOG_DIR/job.log"')
    assert r.returncode == 0, r.stderr
    assert "hello-from-w1" in _cli("logs", "w1", "--name", name).stdout
    assert "no output" in _cli("logs", "w0", "--name", name).stderr
    # cp both ways, files and directories, through the worker's private /tmp
    src = tmp_path / "data"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("payload")
    assert _cli("cp", "--name", name, str(src), "w0:/tmp/").returncode == 0
    assert _cli("exec", "--name", name, "w0", "--", "cat", "/tmp/data/sub/f.txt").stdout == "payload"
    assert _cli("cp", "--name", name, "w0:/tmp/data", "w1:/tmp/copy").returncode == 0
    back = tmp_path / "back.txt"
    r = _cli("cp", "--name", name, "w1:/tmp/copy/sub/f.txt", str(back))
    assert r.returncode == 0, r.stderr
    assert back.read_text() == "payload"
    r = _cli("cp", "--name", name, "w0:/tmp/nope", str(back))
    assert r.returncode != 0 and "no such file" in r.stderr
    # ps: each worker's processes, its init first
    bg = subprocess.Popen([sys.executable, "-m", "testbed", "exec", "--name", name, "w1", "--", "sleep", "30"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        time.sleep(1.0)
        import json as _json
        rows = _json.loads(_cli("ps", "--name", name, "--json").stdout)
        assert {r["node"] for r in rows} == {"w0", "w1"}
        assert any(r["node"] == "w1" and r["command"].startswith("sleep 30") for r in rows)
        assert all(r["nspid"] == 1 for r in rows if r["command"].startswith("testbed-init"))
    finally:
        bg.kill()
        bg.wait()
