"""up/down/cleanup on the real kernel: all-or-nothing, refusals, kill -9, the CLI. Marked root."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import interrupts, lifecycle, node_exec
from testbed.cleanup import cleanup
from testbed.errors import StateError
from testbed.errors import TestbedError as TBError
from testbed import paths, store
from testbed.status import list_testbeds, status as status_document
from testbed.net import names, netns
from testbed.topology.loader import load_topology, load_topology_text
from waiting import need_py_spy, paused_at, wait_for

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[1]


def ours(name: str) -> list[str]:
    return netns.list_names(names.netns_prefix(name))


def procs_in_state_dir(state_dir) -> list[int]:
    """Processes whose command line mentions our state dir (delay lines, worker inits)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if str(state_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes() + \
                        Path(f"/proc/{pid}/environ").read_bytes():
                    out.append(int(pid))
            except OSError:
                pass
    return out


def assert_nothing_left(name: str, state_dir) -> None:
    assert ours(name) == [], ours(name)
    assert not paths.directory(name).exists()
    assert procs_in_state_dir(state_dir) == []


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-c", "from testbed.cli import main; main()", *args],
                          capture_output=True, text=True, env=e, timeout=120, **kw)


@pytest.mark.parametrize("phase", ["workers", "switches", "links", "configured", "started"])
def test_rollback_on_error_midway(root, state_dir, tb_name, monkeypatch, phase):
    monkeypatch.setenv("TESTBED_FAIL_AT", phase)
    with pytest.raises(TBError, match="injected failure"):
        lifecycle.up(load_topology("fat-tree"), tb_name)
    assert_nothing_left(tb_name, state_dir)


def test_rollback_on_delay_line_topology(root, state_dir, tb_name, monkeypatch):
    """A link with a delay above the floor (a delay line without netem) is rolled back too."""
    text = """
name: dl
nodes: {a: {kind: worker}, b: {kind: worker}, s: {kind: switch}}
links:
  - {endpoints: [a, s], delay: 1ms}
  - {endpoints: [b, s]}
"""
    monkeypatch.setenv("TESTBED_FAIL_AT", "configured")
    with pytest.raises(TBError, match="injected failure"):
        lifecycle.up(load_topology_text(text), tb_name)
    assert_nothing_left(tb_name, state_dir)


def test_ctrl_c_rolls_back(root, state_dir, tb_name):
    p = subprocess.Popen([sys.executable, "-c", "from testbed.cli import main; main()", "up", "fat-tree",
                          "--name", tb_name], env={**os.environ, "PYTHONPATH": str(REPO),
                                                   "TESTBED_PAUSE_AT": "links:30"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # anywhere in the build: the fat-tree's 36 namespaces are made, its links are being made
        wait_for(lambda: p.poll() is not None or len(ours(tb_name)) >= 36, timeout=60,
                 what="the fat-tree's 36 namespaces")
        p.send_signal(signal.SIGINT)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130
    assert_nothing_left(tb_name, state_dir)


def test_a_ctrl_c_whose_interrupt_a_library_swallowed_still_rolls_back(root, state_dir, tb_name, monkeypatch):
    """A real SIGINT while `up` is in the builder, whose KeyboardInterrupt code on the main thread
    catches and drops (pyroute2's netlink reply parsing has a bare `except: pass`): the next
    checkpoint raises it again, and `up` rolls back instead of leaving a testbed up."""
    from testbed.net.builder import Builder

    real = Builder.set_worker_sysctls

    def swallowing(self):
        try:
            signal.raise_signal(signal.SIGINT)   # up's handler raises at once, in this thread
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail("SIGINT did not reach up's handler")
        return real(self)

    monkeypatch.setattr(Builder, "set_worker_sysctls", swallowing)
    try:
        with pytest.raises(KeyboardInterrupt):
            lifecycle.up(load_topology("fat-tree"), tb_name)
    finally:
        if paths.directory(tb_name).exists():   # (the old code: it came up; take it down)
            lifecycle.down(tb_name)
    assert_nothing_left(tb_name, state_dir)
    assert not interrupts._signalled, "a later up in this process would stop at its first checkpoint"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_rolls_back(root, state_dir, tb_name):
    p = subprocess.Popen([sys.executable, "-c", "from testbed.cli import main; main()", "up", "fat-tree",
                          "--name", tb_name], env={**os.environ, "PYTHONPATH": str(REPO),
                                                   "TESTBED_PAUSE_AT": "configured:30"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        need_py_spy("the test waits for up's pause by reading its stack")
        wait_for(lambda: p.poll() is not None or paused_at(p.pid, "configured"), timeout=60, interval=0.2,
                 what="up to pause once the fabric is configured")
        assert p.poll() is None, p.communicate()
        p.terminate()
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert_nothing_left(tb_name, state_dir)


@pytest.mark.parametrize("phase", ["switches", "configured"])
def test_cleanup_after_kill_9(root, state_dir, tb_name, phase):
    p = subprocess.Popen([sys.executable, "-c", "from testbed.cli import main; main()", "up", "fat-tree",
                          "--name", tb_name], env={**os.environ, "PYTHONPATH": str(REPO),
                                                   "TESTBED_PAUSE_AT": f"{phase}:30"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        need_py_spy("the test waits for up's pause by reading its stack")
        wait_for(lambda: p.poll() is not None or paused_at(p.pid, phase), timeout=60, interval=0.2,
                 what=f"up to pause after its phase {phase!r}")
        assert p.poll() is None, p.communicate()
        p.kill()
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert ours(tb_name), "the killed up should have left namespaces behind"
    r = cli("cleanup")
    assert r.returncode == 0, r.stderr
    assert tb_name in r.stdout
    assert_nothing_left(tb_name, state_dir)


def test_cleanup_finds_labelled_namespaces_without_state(testbed, state_dir, tb_name):
    testbed(load_topology("two-racks"), tb_name)
    store.remove(tb_name)          # the state is gone, the namespaces are still there (labelled ours)
    assert ours(tb_name)
    removed = cleanup()
    assert any(n == tb_name for n, _ in removed)
    assert ours(tb_name) == []
    from testbed.runtime import cgroups

    assert not cgroups.groups_of(tb_name)   # its workers' groups too (ours by name in our tree)


def test_cleanup_leaves_healthy_testbeds_and_others_alone(testbed, state_dir, tb_name, tmp_path):
    st = testbed(load_topology("two-racks"), tb_name)
    # a namespace of someone else, with a name like ours but not labelled: never touched
    foreign = names.netns(tb_name + "x", "w0")
    netns.create(foreign)
    try:
        assert cleanup() == []
        assert len(ours(tb_name)) == 5
        assert netns.exists(foreign)
    finally:
        netns.delete(foreign)
    # half-gone but its workers still run: kept (`testbed down` removes it), and `ls` says so
    netns.delete(names.netns(tb_name, "spine0"))
    assert cleanup() == []
    assert next(t for t in list_testbeds() if t["name"] == tb_name)["status"].startswith("degraded")
    # once its workers are dead too, cleanup removes the rest
    from testbed import procs

    inits = [procs.ProcRef(r["pid"], r["starttime"]) for r in st["runtime"]["workers"].values()]
    assert not procs.stop(inits, term=False)
    removed = cleanup()
    assert [n for n, _ in removed] == [tb_name]
    assert_nothing_left(tb_name, state_dir)


def test_cleanup_survives_another_testbeds_down(root, tb_name):
    """`cleanup` reads the owner label of every tb- namespace on the machine, other testbeds' too;
    a `down` of one of those ends every process in its namespaces. A cleanup whose main thread sat
    in such a namespace for the read was one of them: killed (an xdist worker "crashed" while a
    test's teardown cleaned up beside another test's down). The read happens in a thread of its
    own now, and the process counts as where its main thread is."""
    from testbed.net.teardown import kill_processes_in

    ns = names.netns(tb_name, "w0")   # another testbed's, being taken down
    netns.create(ns)
    reader = subprocess.Popen([sys.executable, "-c", f"""
import time
from testbed.cleanup import read_owner
end = time.monotonic() + 4
while time.monotonic() < end:
    read_owner({ns!r})
print("read for 4 s", flush=True)
"""], env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, stdout=subprocess.PIPE, text=True)
    try:
        # what down does to the namespace's processes, again and again (it reaps a child of ours it
        # killed: Popen then says 0, so the reader's own last word is what counts)
        while reader.poll() is None:
            kill_processes_in([ns], timeout=0.2)
        out = reader.stdout.read()
        assert out == "read for 4 s\n", f"the label reader was killed by the down (said {out!r})"
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
        netns.delete(ns)


def test_second_up_same_name_refused(testbed, state_dir, tb_name):
    topo = load_topology("two-racks")
    testbed(topo, tb_name)
    before = ours(tb_name)
    with pytest.raises(StateError, match="already up"):
        lifecycle.up(topo, tb_name)
    assert ours(tb_name) == before
    assert status_document(tb_name)["status"] == "up"


def test_two_testbeds_side_by_side(testbed, state_dir):
    a = testbed(load_topology("two-racks"))
    b = testbed(load_topology("two-racks"))
    assert {t["name"] for t in list_testbeds()} == {a["name"], b["name"]}
    for st in (a, b):
        r = subprocess.run(node_exec.exec_argv(st, "w0", ["ping", "-c1", "-W2", "10.0.1.2"]), capture_output=True)
        assert r.returncode == 0
    lifecycle.down(a["name"])
    assert ours(a["name"]) == [] and len(ours(b["name"])) == 5


@pytest.mark.parametrize("args,code", [
    (["up", "no-such-topology"], 2),
    (["up", "fat-tree", "--set", "params.k=3"], 2),
    (["up", "fat-tree", "--set", "tiers.host.bandwidth=-1gbit"], 2),
    (["up", "fat-tree", "--name", "bad/name"], 1),
])
def test_bad_input_refused_leaves_nothing(root, state_dir, args, code):
    before = netns.list_names(names.PREFIX)
    r = cli(*args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "error" in r.stderr.lower()
    assert netns.list_names(names.PREFIX) == before or set(netns.list_names(names.PREFIX)) <= set(before) | \
        {n for n in netns.list_names(names.PREFIX) if not n.startswith("tb-fat-tree-")}
    assert not any(state_dir.iterdir())


def test_refused_when_namespace_exists(root, state_dir, tb_name):
    clash = names.netns(tb_name, "w0")
    netns.create(clash)
    try:
        with pytest.raises(StateError, match="already exists"):
            lifecycle.up(load_topology("two-racks"), tb_name)
        assert ours(tb_name) == [clash]
        assert not paths.directory(tb_name).exists()
    finally:
        netns.delete(clash)


def test_cli_round_trip(root, state_dir, tb_name):
    r = cli("up", "two-racks", "--name", tb_name)
    try:
        assert r.returncode == 0, r.stderr
        assert "w0" in r.stdout and "testbed exec" in r.stdout and "latency floor" in r.stdout
        r = cli("ls")
        assert tb_name in r.stdout
        doc = json.loads(cli("status", tb_name, "--json").stdout)
        assert {n["name"] for n in doc["nodes"]} == {"w0", "w1", "tor0", "tor1", "spine0"}
        assert doc["nodes"][0]["addresses"]
        link = doc["links"][2]
        assert link["endpoints"] == ["tor0", "spine0"] and link["bandwidth_bps"] == 40 * 10**9
        assert link["state"] == "up" and {"delay_s", "jitter_s", "loss", "queue"} <= set(link)
        # exec: stdin/stdout pass through, exit status comes back; switches too; --name may be left out
        r = cli("exec", "w0", "--", "sh", "-c", "cat; exit 3", input="hello\n")
        assert r.returncode == 3 and r.stdout == "hello\n"
        assert cli("exec", "spine0", "--name", tb_name, "--", "ip", "-o", "link").returncode == 0
        assert cli("exec", "w0", "--", "ping", "-c1", "-W2", "10.0.1.2").returncode == 0
        r = cli("up", "two-racks", "--name", tb_name)
        assert r.returncode == 4 and "already up" in r.stderr
    finally:
        r = cli("down", tb_name)
    assert r.returncode == 0, r.stderr
    assert_nothing_left(tb_name, state_dir)


def test_down_all(root, state_dir):
    for _ in range(2):
        assert cli("up", "two-racks", "--name", f"t{os.urandom(3).hex()}").returncode == 0
    assert len(list_testbeds()) == 2
    assert cli("down").returncode == 4   # ambiguous without a name
    r = cli("down", "--all")
    assert r.returncode == 0, r.stderr
    assert list_testbeds() == []


DELAYED = "name: s\ngenerator: star\nparams: {n: 2}\ntiers:\n  host: {bandwidth: 1gbit, delay: 5ms}\n"


def test_without_netem_every_delayed_link_gets_a_delay_line(root, state_dir, tb_name, monkeypatch):
    """TESTBED_WITHOUT=netem: on a kernel with netem too, delays go on delay lines (CI's VM has netem)."""
    monkeypatch.setenv("TESTBED_WITHOUT", "netem")
    lifecycle.up(load_topology_text(DELAYED), tb_name, time_dilation="none")
    try:
        st = store.load(tb_name)
        assert st["capabilities"]["netem"] is False and "TESTBED_WITHOUT" in st["capabilities"]["notes"]["netem"]
        assert len(st["resources"]["delay_lines"]) == 2, st["resources"]
    finally:
        lifecycle.down(tb_name)
    assert_nothing_left(tb_name, state_dir)


def test_without_netem_and_tun_a_delay_is_refused_before_anything_is_made(root, state_dir, tb_name, monkeypatch):
    from testbed.errors import CapabilityError

    monkeypatch.setenv("TESTBED_WITHOUT", "netem,tun")
    with pytest.raises(CapabilityError, match="(?s)delay 5ms needs.*turned off by TESTBED_WITHOUT=netem,tun"):
        lifecycle.up(load_topology_text(DELAYED), tb_name, time_dilation="none")
    assert_nothing_left(tb_name, state_dir)


def test_auto_caps_each_worker_at_its_share_of_the_cores(root, state_dir, tb_name):
    """`up` at auto, where the traffic needs more dilation than compute: the quota the kernel enforces
    on each worker is its share of the cores (cores / ranks), not 1/s (dilation.Choice.cap_cores)."""
    from testbed.runtime import cgroups
    from testbed.topology.dilation import auto_factor
    from testbed.topology.reference import MachineConstants

    slow_host = MachineConstants(alpha_s=100e-6, beta_s_per_byte=8 / 2e9)   # 2 Gbit/s per rank: s above compute
    topo = load_topology_text("name: s\ngenerator: star\nparams: {n: 4}\ntiers:\n  host: {bandwidth: 10gbit}\n")
    lifecycle.up(topo, tb_name, time_dilation="auto", machine=slow_host)
    try:
        st = store.load(tb_name)
        dil = st["dilation"]
        share = 1 / auto_factor(4, 0, lifecycle.cores())
        assert dil["cap_cpu"] and dil["factor"] > dil["compute"] * 1.01, dil
        assert dil["rank_cores"] == pytest.approx(dil["factor"] * share), dil
        rec = st["runtime"]["workers"]["w0"]
        quota, period = cgroups.cfs(share)
        v1 = [Path(p) / "cpu.cfs_quota_us" for p in rec["cgroups"] if (Path(p) / "cpu.cfs_quota_us").exists()]
        v2 = [Path(p) / "cpu.max" for p in rec["cgroups"] if (Path(p) / "cpu.max").exists()]
        if v1:
            assert int(v1[0].read_text()) == quota
        else:
            assert v2[0].read_text().split() == [str(quota), str(period)]
        assert cgroups.cfs(share) != cgroups.cfs(1 / dil["factor"])   # not DieCast's 1/s
    finally:
        lifecycle.down(tb_name)
    assert_nothing_left(tb_name, state_dir)
