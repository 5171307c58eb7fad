"""The netns runtime against the real kernel: identity, isolation, limits, attach, cleanup.

Namespaces are made here directly (two workers joined by one veth), so these
tests need nothing of the data plane beyond testbed.net.netns.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import requires
from waiting import wait_for

pytestmark = pytest.mark.root

requires.need("root", ok=os.geteuid() == 0, module=True)

from testbed.net import netns as nsmod  # noqa: E402
from testbed.runtime import cgroups, worker_init  # noqa: E402
from testbed.runtime import netns as netns_rt  # noqa: E402
from testbed.runtime.env import worker_env  # noqa: E402
from testbed.runtime.netns import NetnsRuntime, pids_in_pidns  # noqa: E402
from testbed.topology.model import Node  # noqa: E402

requires.need("cgroups", ok=cgroups.hierarchy() is not None, module=True)

REPO = Path(__file__).resolve().parents[1]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Bed:
    """A few workers joined pairwise by veths eth0 (10.77.0.0/24), started by the runtime."""

    def __init__(self, state_dir: Path, nodes: list[Node], link: bool = True, net_admin: bool = False,
                 env: dict[str, str] | None = None):
        self.name = "rt" + uuid.uuid4().hex[:6]
        os.environ["TESTBED_STATE_DIR"] = str(state_dir)
        self.rt = NetnsRuntime(self.name, net_admin=net_admin)
        self.extra_env = env or {}
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
        recs = self.rt.start_many([(n, self.ns[n.name], worker_env(self.name, n.name, ["eth0"], cpus=n.cpus,
                                                                   extra=self.extra_env),
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
        # the starter has exited (run returned): an exec that reaches the init shows it outlived it
        assert bed.run("solo", "hostname").stdout.strip() == "solo"
        assert bed.rt.pid("solo", bed.recs["solo"])
        # an orphan is reaped by the worker's init (no zombie left behind): a background sleep whose
        # shell has exited, killed from here, must go from the PID namespace entirely
        import psutil

        bed.run("solo", "sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & exit 0")
        init = bed.recs["solo"]["pid"]

        def orphans() -> list[psutil.Process]:
            return [psutil.Process(p) for p in pids_in_pidns(init) if psutil.Process(p).name() == "sleep"]

        orphan = wait_for(orphans, timeout=10, what="the orphaned sleep in the worker", ignore=psutil.Error)
        assert len(orphan) == 1, orphan
        orphan[0].kill()
        # is_running: the same process (PID and start time) is still in the table, a zombie included
        wait_for(lambda: not orphan[0].is_running(), timeout=10,
                 what="the worker's init to reap the killed orphan (no zombie)")
    finally:
        bed.down()
    assert bed.rt.pid("solo", bed.recs.get("solo", {})) is None


@pytest.mark.timing
def test_cpu_limit_holds(bed_factory):
    bed = bed_factory([W("c0", cpus=0.5)], link=False)
    rec = bed.recs["c0"]
    busy = subprocess.Popen(bed.rt.exec_argv("c0", rec, [sys.executable, "-c", "while True: pass"]))
    try:
        start = cgroups.cpu_usage_s(rec["cgroups"])
        # the loop runs (a tenth of a second of CPU in the worker's group) before the window opens
        wait_for(lambda: cgroups.cpu_usage_s(rec["cgroups"]) - start > 0.1, timeout=30, what="the busy loop to run")
        u0, t0 = cgroups.cpu_usage_s(rec["cgroups"]), time.monotonic()
        time.sleep(2.0)   # the measured window: the share is CPU time over these 2 s of wall time
        u1, t1 = cgroups.cpu_usage_s(rec["cgroups"]), time.monotonic()
        share = (u1 - u0) / (t1 - t0)
        print(f"a 0.5-cpu worker's busy loop used {share:.3f} cores")
        # 0.373-0.501 cores in 5 runs (2026-12-02, 2-core machine, other sessions' tests beside:
        # `pytest -s -k cpu_limit_holds`). At most the quota (0.5) and a period's edge in the
        # window: 0.6. The lower bound only says the loop ran under the limit (others' work takes
        # its share of 2 cores): 0.25, two thirds of the lowest seen (was 0.1)
        assert 0.25 <= share <= 0.6, f"a 0.5-cpu worker used {share:.2f} cores"
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
    # a stretched period (under 0.1 core) carries one quota of burst, where the kernel has the knob
    bed.rt.set_limits("c0", rec, cpus=1 / 31.4)
    burst = [Path(p) / f for p in rec["cgroups"] for f in ("cpu.cfs_burst_us", "cpu.max.burst")
             if (Path(p) / f).exists()]
    if burst:
        assert int(burst[0].read_text()) == cgroups.cfs_burst(1 / 31.4) == 1_000
    bed.rt.set_limits("c0", rec, cpus=1.0)
    if burst:
        assert int(burst[0].read_text()) == 0


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
    requires.need("pexpect")
    import pexpect

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
    wait_for(lambda: len(pids_in_pidns(rec["pid"])) >= 2, timeout=30, what="the background sleep in r0")
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


@pytest.mark.timing
def test_sixteen_workers_start_fast(bed_factory):
    t0 = time.monotonic()
    bed = bed_factory([W(f"n{i}", cpus=0.5) for i in range(16)], link=False)
    took = time.monotonic() - t0
    print(f"16 workers up in {took:.2f} s")
    # measured 0.13-0.14 s in 5 runs alone (2026-12-02, 2-core machine, others' jobs beside): 1 s
    # is 7x that and still fails a start that lost its speed (one process per worker: ~0.5 s+)
    assert took < 1.0, f"16 workers took {took:.2f} s"
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
    requires.need("pexpect")
    import pexpect

    name, st = cli_bed
    assert st["runtime"]["kind"] == "netns", st["runtime"]   # the default runtime
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
        import json as _json

        def listed() -> list[dict] | None:
            rows = _json.loads(_cli("ps", "--name", name, "--json").stdout)
            return rows if any(r["node"] == "w1" and r["command"].startswith("sleep 30") for r in rows) else None

        rows = wait_for(listed, timeout=60, interval=0.2,
                        what="`testbed ps` to list the sleep that `testbed exec` started in w1")
        assert {r["node"] for r in rows} == {"w0", "w1"}
        assert all(r["nspid"] == 1 for r in rows if r["command"].startswith("testbed-init"))
    finally:
        bg.kill()
        bg.wait()


# -- the worker's init (testbed/runtime/worker_init.py) ---------------------------------------------------

DEFAULT_BND = 0xA80425FB    # Docker's default set
NET_ADMIN_BND = DEFAULT_BND | 1 << 12


def _cfg(**over) -> dict:
    cfg = {"netns": "/nonexistent/ns", "cgroup_procs": [], "hostname": "h", "share_ipc": False, "log": "/dev/null",
           "grace": 1.0, "keep": [], "binds": [], "caps": worker_init.worker_caps(), "state_root": "/run/testbed",
           "state_binds": []}
    cfg.update(over)
    return cfg


def test_init_module_stands_alone():
    """Standard library only: it must run without site, venv or the testbed package."""
    src = Path(worker_init.__file__).read_text()
    assert "import testbed" not in src and "from testbed" not in src
    assert netns_rt.INIT_SCRIPT == str(Path(worker_init.__file__).resolve())
    # no init or spawner source is kept as a string to exec any more
    for mod in (netns_rt, worker_init):
        text = Path(mod.__file__).read_text()
        assert not re.search(r"(?<![\w.])exec\(", text) and '"-S", "-c"' not in text, mod.__name__
        assert "TESTBED_INIT" not in text, mod.__name__
    code = (f"import runpy; runpy.run_path({netns_rt.INIT_SCRIPT!r}, run_name='x'); "
            "import sys; print(sorted(m for m in sys.modules if m.startswith('testbed')))")
    r = subprocess.run([sys.executable, "-S", "-P", "-c", code],
                       check=False, capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r


def test_init_capability_sets():
    assert worker_init.cap_mask(worker_init.worker_caps()) == DEFAULT_BND
    assert worker_init.cap_mask(worker_init.worker_caps(net_admin=True)) == NET_ADMIN_BND
    names = worker_init.worker_caps()
    assert not set(names) & {"sys_admin", "net_admin", "sys_module", "sys_boot", "sys_time", "sys_rawio",
                             "dac_read_search"}
    # numbering as linux/capability.h has it
    assert [worker_init.CAP_NAMES.index(n) for n in ("chown", "net_admin", "sys_admin", "setfcap")] == [0, 12, 21, 31]
    # the setpriv line a process entering a worker runs through
    argv = netns_rt.setpriv_argv(False)
    assert argv[1:] == ["--inh-caps=-all", "--bounding-set=-all," + ",".join("+" + c for c in names), "--"]
    assert "+net_admin" in netns_rt.setpriv_argv(True)[2]


def test_init_parse_items():
    good = [{"node": "w0", "log": "/dev/null", "cfg": _cfg()}]
    assert worker_init.parse_items(json.dumps(good)) == good
    assert worker_init.parse_items(json.dumps(good).encode()) == good
    with pytest.raises(ValueError):
        worker_init.parse_items("{not json")
    not_a_record = [
        {"node": "", "log": "/dev/null", "cfg": _cfg()},
        {"node": "w0", "cfg": _cfg()},
        {"node": "w0", "log": "/dev/null", "cfg": {k: v for k, v in _cfg().items() if k != "state_root"}},
        {"node": "w0", "log": "/dev/null", "cfg": _cfg(share_ipc="yes")},
    ]
    for item in not_a_record:
        with pytest.raises(TypeError):
            worker_init.parse_items(json.dumps([*good, item]))
    with pytest.raises(TypeError):
        worker_init.parse_items(json.dumps({"node": "w0"}))
    with pytest.raises(ValueError, match="unknown capabilities"):
        worker_init.parse_items(json.dumps([{**good[0], "cfg": _cfg(caps=["chown", "everything"])}]))


def test_init_title_helpers():
    # /proc/PID/stat: the name may hold spaces and parentheses; fields 48 and 49 are the argv area
    rest = " ".join(str(i) for i in range(3, 48)) + " 1000 1064 1064 2000 0"
    assert worker_init.arg_area(f"42 (a) b (c) {rest}") == (1000, 1064)
    with pytest.raises(ValueError):
        worker_init.arg_area("42 (x) S 1 2 3")
    b = worker_init.title_bytes("testbed-init w0", 40)
    assert len(b) == 40 and b.startswith(b"testbed-init w0\0") and b[-1:] != b"\0"
    assert set(b[len("testbed-init w0"):-1]) == {0}
    cut = worker_init.title_bytes("testbed-init " + "n" * 80, 30)
    assert len(cut) == 30 and cut[:28] == b"testbed-init " + b"n" * 15 and cut[28:] == b"\0 "
    assert worker_init.title_bytes("x", 2) is None


def test_init_mount_helpers():
    text = ("22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
            "30 22 0:30 / /sys/fs/cgroup/cpu,cpuacct ro,nosuid shared:9 - cgroup cgroup rw,cpu\n"
            "31 22 0:31 / /mnt/with\\040space rw - tmpfs tmpfs rw\n")
    assert worker_init.mount_points(text) == [("/proc", "rw,nosuid,nodev,noexec,relatime"),
                                              ("/sys/fs/cgroup/cpu,cpuacct", "ro,nosuid"), ("/mnt/with space", "rw")]
    assert worker_init.kept_flags("rw,nosuid,nodev,noexec,relatime") == (worker_init.MS_NOSUID | worker_init.MS_NODEV
                                                                         | worker_init.MS_NOEXEC)
    assert worker_init.kept_flags("ro,relatime") == 0
    assert worker_init.is_within("/run/testbed/x/runs", "/run/testbed")
    assert worker_init.is_within("/run/testbed", "/run/testbed/")
    assert not worker_init.is_within("/run/testbed2/x", "/run/testbed")
    assert worker_init.is_within("/anything", "/")


def test_init_loop_refuses_to_run_outside_its_namespace():
    """kill(-1) from anywhere but PID 1 of a worker would reach the host's processes."""
    with pytest.raises(RuntimeError):
        worker_init.init_loop(0.1)


def test_init_spawner_forks_and_reports_in_order(tmp_path):
    """spawn(): one fork per item, stdout a pipe back, stderr the item's log; lines in item order."""
    def fake(cfg: dict, title: str) -> None:
        if cfg["hostname"] == "bad":
            os.write(2, b"complaint\n")
            os.write(1, b"error it broke\n")
            os._exit(1)
        os.write(1, f"pid {os.getpid()}\nok\n".encode())
        os.write(1, f"title {title}\n".encode())
        os._exit(0)

    items = [{"node": n, "log": str(tmp_path / f"{n}.log"), "cfg": _cfg(hostname=h)}
             for n, h in (("w0", "w0"), ("w1", "bad"), ("w2", "w2"))]
    lines = worker_init.spawn(items, start=fake)
    assert [ln.split()[0] for ln in lines] == ["w0", "w0", "w0", "w1", "w2", "w2", "w2"]
    assert lines[1:3] == ["w0 ok", "w0 title testbed-init w0"] and lines[3] == "w1 error it broke"
    assert (tmp_path / "w1.log").read_text() == "complaint\n"


def test_init_spawner_as_a_program(tmp_path):
    """The real spawner, as netns.py starts it: bad input is refused; a worker whose namespace is
    missing reports an error and leaves nothing."""
    argv = [worker_init.TITLE, "-S", "-P", netns_rt.INIT_SCRIPT, "spawn"]
    env = {"PATH": os.environ["PATH"], "PYTHONHOME": f"{sys.base_prefix}:{sys.base_exec_prefix}"}
    r = subprocess.run(argv, executable=sys.executable, input="[{}]", check=False, capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 2 and "bad batch" in r.stderr
    r = subprocess.run(argv[:-1], executable=sys.executable, check=False, capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
    items = [{"node": "w0", "log": str(tmp_path / "w0.log"), "cfg": _cfg(netns=str(tmp_path / "no-such-ns"))}]
    r = subprocess.run(argv, executable=sys.executable, input=json.dumps(items), check=False, capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.returncode == 0, r
    assert r.stdout.startswith("w0 error ") and "no-such-ns" in r.stdout and len(r.stdout.splitlines()) == 1


def test_init_title_and_caps_in_a_process():
    """set_title/set_comm/drop_capabilities, in a child (they change the process that calls them)."""
    code = ("import os, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); import worker_init as w;"
            "ok = w.set_title('testbed-init node-7'); w.set_comm(w.INIT_COMM);"
            "w.drop_capabilities(w.worker_caps());"
            "print(ok); print(repr(open('/proc/self/cmdline', 'rb').read())); print(open('/proc/self/comm').read());"
            "print(open('/proc/self/status').read())")
    r = subprocess.run([sys.executable, "-S", "-c", code, netns_rt.INIT_SCRIPT, "x" * 20], check=False, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[0] == "True" and lines[1] == repr(b"testbed-init node-7\0") and lines[2] == "tb-init"
    status = dict(ln.split(":\t", 1) for ln in lines if ":\t" in ln)
    assert int(status["CapBnd"], 16) == DEFAULT_BND
    assert int(status["CapEff"], 16) == DEFAULT_BND and int(status["CapPrm"], 16) == DEFAULT_BND
    assert int(status["CapInh"], 16) == 0


# -- the worker as its processes see it ---------------------------------------------------------------


def _caps(bed: Bed, node: str, pid: str = "self") -> dict[str, int]:
    out = bed.run(node, "sh", "-c", f"grep ^Cap /proc/{pid}/status").stdout
    return {ln.split(":")[0]: int(ln.split()[1], 16) for ln in out.splitlines()}


def test_ps_names_the_init(bed_factory):
    bed = bed_factory([W("w0"), W("w1")])
    r = bed.run("w0", "ps", "-o", "pid=,comm=,args=")
    assert r.returncode == 0, r
    rows = [ln.split(None, 2) for ln in r.stdout.splitlines()]
    assert rows[0] == ["1", "tb-init", "testbed-init w0"], r.stdout
    assert len(rows) == 2 and rows[1][1] == "ps"     # the init and ps: nothing else in the worker
    pid = bed.recs["w1"]["pid"]
    host = subprocess.run(["ps", "-o", "comm=,args=", "-p", str(pid)], check=False, capture_output=True, text=True).stdout
    assert host.split(None, 1) == ["tb-init", "testbed-init w1\n"]
    assert Path(f"/proc/{pid}/cmdline").read_bytes() == b"testbed-init w1\0"
    assert Path(f"/proc/{pid}/comm").read_text() == "tb-init\n"


def test_workers_trace_their_own_processes_not_entering_ones(bed_factory):
    """No sys_ptrace in a worker: root there can still debug the worker's processes (py-spy, gdb:
    same user, no capability they lack), but not a process that entered with the host's
    capabilities (nsenter without setpriv: what every `exec` is for a moment)."""
    bed = bed_factory([W("w0")])
    opener = "import sys; open('/proc/%s/mem' % sys.argv[1], 'rb').close(); print('traced')"
    r = bed.run("w0", "sh", "-c", f"sleep 30 & {sys.executable} -c \"{opener}\" $!; kill $!")
    assert r.stdout.strip() == "traced", r
    full = subprocess.Popen(["nsenter", "-t", str(bed.recs["w0"]["pid"]), "-a", "--", "sh", "-c", "echo $$; exec sleep 30"],
                            stdout=subprocess.PIPE, text=True)
    try:
        nspid = full.stdout.readline().strip()
        assert nspid.isdigit()
        r = bed.run("w0", sys.executable, "-c", opener, nspid)
        assert r.returncode != 0 and "PermissionError" in r.stderr, r
    finally:
        bed.run("w0", "kill", nspid)
        full.wait(10)


def test_workers_cannot_undo_their_shaping(bed_factory):
    bed = bed_factory([W("w0"), W("w1")])
    assert bed.recs["w0"]["net_admin"] is False
    ns = bed.ns["w0"]
    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"],
                   check=True, capture_output=True)
    r = bed.run("w0", "tc", "qdisc", "del", "dev", "eth0", "root")
    assert r.returncode != 0 and "Operation not permitted" in r.stderr, r
    assert bed.run("w0", "ip", "link", "set", "eth0", "mtu", "1400").returncode != 0
    shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], check=False, capture_output=True, text=True).stdout
    assert shown.startswith("qdisc htb 1: root"), shown
    # the worker's set, in the process and its bounding set, and in the init itself
    caps = _caps(bed, "w0")
    assert caps["CapBnd"] == caps["CapEff"] == caps["CapPrm"] == DEFAULT_BND and caps["CapInh"] == caps["CapAmb"] == 0
    assert bed.run("w0", "sh", "-c", "grep CapBnd /proc/self/status").stdout.split() == ["CapBnd:", f"{DEFAULT_BND:016x}"]
    caps = _caps(bed, "w0", "1")
    assert caps["CapBnd"] == caps["CapEff"] == DEFAULT_BND
    # ping (net_raw) and a privileged port (net_bind_service) still work
    assert bed.run("w0", "ping", "-c", "1", "-W", "2", "w1").returncode == 0
    r = bed.run("w0", sys.executable, "-c", "import socket; s = socket.socket(); s.bind(('', 80)); print('bound')")
    assert r.stdout.strip() == "bound", r


def test_net_admin_workers_can(bed_factory):
    bed = bed_factory([W("n0"), W("n1")], net_admin=True)
    rec = bed.recs["n0"]
    assert rec["net_admin"] is True
    ns = bed.ns["n0"]
    assert _caps(bed, "n0")["CapBnd"] == _caps(bed, "n0", "1")["CapBnd"] == NET_ADMIN_BND
    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"],
                   check=True, capture_output=True)
    r = bed.run("n0", "tc", "qdisc", "del", "dev", "eth0", "root")
    assert r.returncode == 0, r
    shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], check=False, capture_output=True, text=True).stdout
    assert "htb" not in shown
    # another CLI process (a runtime made without the flag) follows the record
    other = NetnsRuntime(bed.name)
    r = subprocess.run(other.exec_argv("n0", rec, ["grep", "CapBnd", "/proc/self/status"]), check=False, capture_output=True,
                       text=True, timeout=30)
    assert int(r.stdout.split()[1], 16) == NET_ADMIN_BND
    r = subprocess.run(other.exec_argv("n1", {**bed.recs["n1"], "net_admin": False}, ["grep", "CapBnd",
                                                                                        "/proc/self/status"]),
                       check=False, capture_output=True, text=True, timeout=30)
    assert int(r.stdout.split()[1], 16) == DEFAULT_BND
    # a restart keeps the worker's setting, whatever the runtime restarting it was told
    new = other.restart("n0", rec)
    bed.recs["n0"] = new
    assert new["net_admin"] is True and _caps(bed, "n0", "1")["CapBnd"] == NET_ADMIN_BND


def test_missing_setpriv_is_an_error(bed_factory, monkeypatch):
    from testbed.errors import CapabilityError

    bed = bed_factory([W("s0")], link=False)
    monkeypatch.setattr(netns_rt, "SETPRIV_DIRS", ())
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CapabilityError, match="setpriv"):
        bed.rt.exec_argv("s0", bed.recs["s0"], ["true"])
    with pytest.raises(CapabilityError, match="setpriv"):
        Bed(Path(os.environ["TESTBED_STATE_DIR"]), [W("s1")], link=False).rt.begin_start_many([])


def test_state_root_is_hidden(bed_factory, tmp_path):
    root = tmp_path / "state"
    bed = bed_factory([W("h0"), W("h1")], link=False)
    sdir = root / bed.name
    (sdir / "state.json").write_text('{"mine": 1}')
    (root / ".locks").mkdir(exist_ok=True)
    (root / ".locks" / f"{bed.name}.lock").write_text("")
    (root / "other-testbed").mkdir()
    # the root holds only this testbed's dir, which holds only what workers need
    assert bed.run("h0", "ls", "-A", str(root)).stdout.split() == [bed.name]
    assert sorted(bed.run("h0", "ls", "-A", str(sdir)).stdout.split()) == ["logs", "runs", "workers"]
    assert bed.run("h0", "ls", "-A", str(sdir / "logs")).stdout.split() == ["h0"]
    assert bed.run("h0", "ls", "-A", str(sdir / "workers")).stdout.split() == ["h0"]
    r = bed.run("h0", "cat", str(sdir / "state.json"))
    assert r.returncode != 0 and "No such file" in r.stderr
    # writing at the state file's path fails and never reaches the host
    r = bed.run("h0", "sh", "-c", f"echo '{{}}' > {sdir}/state.json")
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r
    r = bed.run("h0", "sh", "-c", f"mkdir -p {sdir}/x && echo x > {root}/.locks/{bed.name}.lock")
    assert r.returncode != 0
    assert (sdir / "state.json").read_text() == '{"mine": 1}' and not (sdir / "x").exists()
    assert (root / ".locks" / f"{bed.name}.lock").read_text() == ""
    # nor can a worker uncover it: no umount, no mount (no CAP_SYS_ADMIN)
    r = bed.run("h0", "umount", str(root))
    assert r.returncode != 0, r
    r = bed.run("h0", "umount", "-l", str(sdir / "runs"))
    assert r.returncode != 0, r
    r = bed.run("h0", "mount", "-t", "tmpfs", "none", str(sdir / "runs"))
    assert r.returncode != 0, r
    assert bed.run("h0", "test", "-e", f"{sdir}/state.json").returncode == 1
    # what workers need: the runs' exchange folder (read-write), the log dir (read-write), its own
    # files (read-only)
    run_id = uuid.uuid4().hex[:12]
    (sdir / "runs" / run_id / "probe").mkdir(parents=True)
    r = bed.run("h0", "sh", "-c", f'echo step > {sdir}/runs/{run_id}/probe/rank-0.jsonl && '
                                  f'echo hi > "$TESTBED_LOG_DIR/job.log"')
    assert r.returncode == 0, r
    assert (sdir / "runs" / run_id / "probe" / "rank-0.jsonl").read_text() == "step\n"
    assert (sdir / "logs" / "h0" / "job.log").read_text() == "hi\n"
    assert bed.run("h0", "cat", f"{sdir}/workers/h0/etc/hostname").stdout == "h0\n"
    r = bed.run("h0", "sh", "-c", f"echo x > {sdir}/workers/h0/etc/hosts")
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert "h1" in (sdir / "workers" / "h0" / "etc" / "hosts").read_text()
    # a file the host adds later (attach's rcfile, a new run) shows up at once
    (sdir / "workers" / "h0" / "attachrc").write_text("PS1=x\n")
    assert bed.run("h0", "cat", f"{sdir}/workers/h0/attachrc").stdout == "PS1=x\n"
    # the host's kernel knobs are read-only; the worker's own network's are its own
    r = bed.run("h0", "sh", "-c", "cat /proc/sys/vm/swappiness > /proc/sys/vm/swappiness")
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r
    r = bed.run("h0", "sh", "-c", "grep -E ' /(proc/sys|proc/sys/net|sys) ' /proc/self/mounts")
    opts = {ln.split()[1]: ln.split()[3].split(",")[0] for ln in r.stdout.splitlines()}
    assert opts == {"/proc/sys": "ro", "/proc/sys/net": "rw", "/sys": "ro"}, r.stdout


def test_mps_dirs_are_visible(bed_factory, tmp_path):
    """A worker on MPS reaches the daemon's pipe and log dirs under the (otherwise hidden) state dir."""
    name_dir = tmp_path / "state" / "mpsdirs"
    pipe, log = name_dir / "pipe", name_dir / "log"
    pipe.mkdir(parents=True)
    log.mkdir()
    bed = bed_factory([W("g0")], link=False, env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                                  "CUDA_MPS_LOG_DIRECTORY": str(log)})
    assert bed.recs["g0"]["share_ipc"] is True
    r = bed.run("g0", "sh", "-c", 'echo p > "$CUDA_MPS_PIPE_DIRECTORY/x" && echo l > "$CUDA_MPS_LOG_DIRECTORY/y"')
    assert r.returncode == 0, r
    assert (pipe / "x").read_text() == "p\n" and (log / "y").read_text() == "l\n"
    assert bed.run("g0", "ls", "-A", str(name_dir)).stdout.split() == ["log", "pipe"]


def test_cli_state_hidden_from_jobs(cli_bed):
    """Through the CLI, on a testbed lifecycle built: the state file stays out of the workers' reach."""
    from testbed import paths

    name, st = cli_bed
    assert st["runtime"]["kind"] == "netns", st["runtime"]   # the default runtime
    sfile = paths.state_file(name)
    assert sfile.exists()
    before = sfile.read_bytes()
    r = _cli("exec", "--name", name, "w0", "--", "sh", "-c", f"cat {sfile}; echo '{{}}' > {sfile}")
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r
    assert sfile.read_bytes() == before
    r = _cli("exec", "--name", name, "w0", "--", "sh", "-c", "grep CapBnd /proc/self/status; ps -o pid=,args=")
    assert r.stdout.split()[:4] == ["CapBnd:", f"{DEFAULT_BND:016x}", "1", "testbed-init"], r
