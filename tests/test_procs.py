"""testbed.procs: the /proc scans (pids, namespaces, environments) on real processes.

Every process here is a child this test starts and ends by its PID; every namespace is one it
creates (tbx-<hex>, tbprobe-<pid>) and removes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

import requires
from testbed import procs
from waiting import wait_for

REPO = Path(__file__).resolve().parents[1]


def _end(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(timeout=10)


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `sleep 60` (or argv) with extra environment; every child ends with the test."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str] | None = None, **env: str) -> subprocess.Popen:
        p = subprocess.Popen(argv or ["sleep", "60"], env={**os.environ, **env})
        started.append(p)
        # Popen returns once exec has begun; the kernel sets up the new environment a moment
        # later (/proc/PID/environ reads empty until then)
        wait_for(lambda: procs.environ(p.pid), timeout=5, interval=0.005, what=f"the environment of {argv}")
        return p

    yield start
    for p in reversed(started):
        _end(p)


def _gone_pid() -> int:
    """A PID that no process has: pid_max, above every PID the kernel gives out (a child that has
    just ended is no good: beside other tests its PID can be someone else's a moment later)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


# -- pids, exists, ns_inode -------------------------------------------------------------------


def test_pids_lists_children_and_self(spawn):
    p = spawn()
    assert p.pid in procs.pids()
    assert os.getpid() in procs.pids()
    assert os.getpid() not in procs.pids(include_self=False)
    assert p.pid in procs.pids(include_self=False)
    assert all(isinstance(x, int) for x in procs.pids())


def test_exists_counts_a_zombie_until_reaped():
    p = subprocess.Popen(["true"])
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)     # ended, not reaped: a zombie
    assert procs.exists(p.pid)
    assert procs.ref(p.pid) is None                          # ...but no live process
    p.wait()
    assert not procs.exists(p.pid)
    assert not procs.exists(0)
    assert procs.exists(os.getpid())


def test_ns_inode(spawn):
    assert procs.ns_inode("self", "net") == os.stat("/proc/self/ns/net").st_ino
    p = spawn()
    assert procs.ns_inode(p.pid, "pid") == os.stat("/proc/self/ns/pid").st_ino
    assert procs.ns_inode(_gone_pid(), "net") is None
    assert procs.ns_inode(os.getpid(), "no-such-kind") is None


# -- environments ------------------------------------------------------------------------------


def test_pids_with_env_matches_whole_entries(spawn):
    mark = uuid.uuid4().hex
    tagged = spawn(TBX_MARK=mark)
    spawn(TBX_MARK=mark + "-other")            # a longer value
    spawn(MY_TBX_MARK=mark)                    # a key that ends like ours
    spawn(OTHER=f"TBX_MARK={mark}")            # our entry inside another's value
    spawn()
    assert procs.pids_with_env("TBX_MARK", mark) == [tagged.pid]
    assert procs.pids_with_env("TBX_MARK", uuid.uuid4().hex) == []


def test_environ_and_has_env(spawn):
    mark = uuid.uuid4().hex
    p = spawn(TBX_MARK=mark)
    assert f"TBX_MARK={mark}".encode() in procs.environ(p.pid)
    assert b"" not in procs.environ(p.pid)
    r = procs.ref(p.pid)
    assert procs.has_env(r, "TBX_MARK", mark)
    assert not procs.has_env(r, "TBX_MARK", mark + "x")
    _end(p)
    assert procs.environ(p.pid) is None
    assert not procs.has_env(r, "TBX_MARK", mark)


def test_pids_with_env_leaves_self_out_when_asked(spawn):
    """A process that carries the marker itself finds itself only with include_self=True."""
    mark = uuid.uuid4().hex
    code = ("import os; from testbed import procs; "
            "print(os.getpid() in procs.pids_with_env('TBX_MARK', os.environ['TBX_MARK']), "
            "os.getpid() in procs.pids_with_env('TBX_MARK', os.environ['TBX_MARK'], include_self=False))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TBX_MARK": mark, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_run_tagged_pids(spawn):
    from testbed.jobs.ranks import tagged_pids

    run_id = uuid.uuid4().hex[:12]
    tagged = spawn(TESTBED_RUN_ID=run_id)
    spawn(TESTBED_RUN_ID=run_id + "0")
    spawn(OLD_TESTBED_RUN_ID=run_id)
    assert tagged_pids(run_id) == [tagged.pid]
    _end(tagged)
    assert tagged_pids(run_id) == []


def test_scans_survive_processes_that_vanish(spawn):
    """Processes come and go while we scan (each scan's listing goes stale at once): no error,
    and the steady ones are always found."""
    mark = uuid.uuid4().hex
    steady = spawn(TBX_MARK=mark)
    churn = spawn(["sh", "-c", "while :; do /bin/true; done"], TBX_MARK=mark)
    net = procs.ns_inode("self", "net")
    for _ in range(30):
        assert steady.pid in procs.pids_with_env("TBX_MARK", mark)
        assert steady.pid in procs.pids_in_ns("net", [net])
        assert steady.pid in procs.pids_in_pidns(steady.pid)
    assert churn.poll() is None


def test_scans_skip_what_they_may_not_read(spawn):
    """An unprivileged scanner cannot read root's environments or namespaces: they are skipped."""
    requires.need("root", ok=os.geteuid() == 0)
    requires.need("setpriv")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
    # an interpreter nobody may run (the venv's may live under root's 0700 home); that it starts at
    # all is the machine's matter, what it then prints is the test
    python = next((py for py in (sys.executable, "/usr/bin/python3") if os.path.exists(py) and subprocess.run(
        [*nobody, py, "-c", "import testbed.procs"], cwd="/", capture_output=True, env=env, timeout=60).returncode == 0),
        None)
    requires.need("setpriv", ok=python is not None, why="no python here that uid 65534 can run and import testbed with")
    mark = uuid.uuid4().hex
    root_child = spawn(TBX_MARK=mark)
    code = ("from testbed import procs; import os; "
            f"print(procs.pids_with_env('TBX_MARK', '{mark}'), "
            f"{root_child.pid} in procs.pids_in_ns('net', [procs.ns_inode('self', 'net')]), "
            f"procs.environ({root_child.pid}), procs.ns_inode({root_child.pid}, 'net'), "
            f"{root_child.pid} in procs.pids())")
    out = subprocess.run([*nobody, python, "-c", code], cwd="/", capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, f"the unprivileged scan failed: {out.stderr.strip()[-2000:]}"
    assert out.stdout.split() == ["[]", "False", "None", "None", "True"]


# -- namespaces --------------------------------------------------------------------------------


@pytest.fixture
def tbx_netns(root) -> Iterator[str]:
    name = f"tbx-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    assert not os.path.exists(f"/run/netns/{name}")


def test_pids_in_netns(spawn, tbx_netns):
    from testbed.net import netns

    target = os.stat(f"/run/netns/{tbx_netns}").st_ino
    inside = spawn(["ip", "netns", "exec", tbx_netns, "sleep", "60"])
    outside = spawn()
    wait_for(lambda: procs.ns_inode(inside.pid, "net") == target, timeout=5, what="the child in the netns")
    assert procs.pids_in_ns("net", [target]) == {inside.pid: target}
    assert procs.pids_in_ns("net", []) == {}
    assert outside.pid not in procs.pids_in_ns("net", [target])
    assert netns.pids_in([tbx_netns]) == {inside.pid: tbx_netns}
    assert netns.pids_in([tbx_netns, "tbx-none-such"]) == {inside.pid: tbx_netns}
    assert netns.pids_in(["tbx-none-such"]) == {}
    assert procs.in_netns(procs.ref(inside.pid), f"/run/netns/{tbx_netns}")
    assert not procs.in_netns(procs.ref(outside.pid), f"/run/netns/{tbx_netns}")
    _end(inside)
    assert netns.pids_in([tbx_netns]) == {}


def _child_of(pid: int) -> int | None:
    import psutil

    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return None
    return kids[0].pid if kids else None


def test_pids_in_pidns(root, spawn):
    requires.need("unshare")
    # unshare forks the namespace's init (its child); --kill-child ends it when unshare ends
    holder = spawn(["unshare", "--pid", "--fork", "--kill-child", "sleep", "60"])
    init = wait_for(lambda: _child_of(holder.pid), timeout=5, what="unshare's child (the pid namespace's init)")
    assert init
    wait_for(lambda: procs.ns_inode(init, "pid") not in (None, procs.ns_inode("self", "pid")), timeout=5,
             what="the init in a pid namespace of its own")
    # nsenter forks a member that is no child of the init: only the namespace tells
    enter = spawn(["nsenter", "-t", str(init), "-p", "sleep", "60"])
    member = wait_for(lambda: _child_of(enter.pid), timeout=5, what="nsenter's child")
    assert member
    wait_for(lambda: procs.ns_inode(member, "pid") == procs.ns_inode(init, "pid"), timeout=5,
             what="nsenter's child in the init's pid namespace")

    found = procs.pids_in_pidns(init)
    assert found[0] == init and sorted(found) == sorted([init, member])
    by_member = procs.pids_in_pidns(member)
    assert by_member[0] == member and sorted(by_member) == sorted([init, member])
    assert holder.pid not in found and enter.pid not in found
    assert os.getpid() not in procs.pids_in_pidns(init)

    os.kill(init, signal.SIGKILL)            # a child of a child we started: ends the namespace
    wait_for(lambda: procs.pids_in_pidns(init) == [], timeout=5, what="the pid namespace to empty")
    wait_for(lambda: not procs.pids_in_pidns(member), timeout=5, what="no process left in the member's pid namespace")
    assert procs.pids_in_pidns(_gone_pid()) == []


def test_sweep_stale_probes_keeps_a_live_owners(root, spawn):
    from testbed.net import netns
    from testbed.net.capabilities import sweep_stale_probes

    live = spawn()
    dead = _gone_pid()
    stale, kept = f"tbprobe-{dead}-w", f"tbprobe-{live.pid}-s"
    for n in (stale, kept):
        netns.create(n)
    try:
        removed = sweep_stale_probes()
        assert stale in removed and kept not in removed
        assert not netns.exists(stale) and netns.exists(kept)
    finally:
        for n in (stale, kept):
            if netns.exists(n):
                netns.delete(n)
