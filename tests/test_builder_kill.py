"""testbed.net.teardown.kill_processes_in against the real kernel, and who one test's cleanup may end.

A PID from a scan of /proc can change hands before the signal lands (the process ends, its PID goes
to anyone's next process: under `make test`, another test's). kill_processes_in holds each process
by a pidfd, checks it is in one of the namespaces while held and signals through the pidfd. The
first test makes the scan stale on purpose (it lists a bystander's PID, as a scan does whose PID
changed hands) and fails on the old code, which killed by PID. Marked root.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

import requires
from waiting import wait_for

pytestmark = pytest.mark.root


@pytest.fixture
def spaces(root):
    """make() -> a fresh network namespace's name; all of them and what runs in them go afterwards."""
    from testbed.net import netns, teardown

    made: list[str] = []

    def make() -> str:
        name = f"tbk-{uuid.uuid4().hex[:8]}"
        netns.create(name)
        made.append(name)
        return name

    yield make
    teardown.kill_processes_in(made)
    for name in made:
        netns.delete(name)


@pytest.fixture
def started():
    """start(argv) -> Popen; every one is ended and reaped afterwards."""
    procs_: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        procs_.append(p)
        return p

    yield start
    for p in procs_:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _in(ns: str, pid: int) -> bool:
    from testbed import procs
    from testbed.net import netns

    return procs.ns_inode(pid, "net") == netns.inode(ns)


def test_a_pid_that_changed_hands_since_the_scan_is_not_signalled(spaces, started, monkeypatch):
    from testbed import procs
    from testbed.net import netns, teardown

    ns, other = spaces(), spaces()
    inside = started(["ip", "netns", "exec", ns, "sleep", "60"])
    # the bystander: another test's process, in a namespace of its own
    bystander = started(["ip", "netns", "exec", other, "sleep", "60"])
    wait_for(lambda: _in(ns, inside.pid) and _in(other, bystander.pid), timeout=10,
             what="both sleeps in their namespaces")
    in_ref, by_ref = procs.ref(inside.pid), procs.ref(bystander.pid)
    scan = procs.pids_in_ns

    def stale(kind, inodes, **kw):
        found = scan(kind, inodes, **kw)
        # what a scan returns when a PID it read changed hands before the kill: the PID, under our namespace
        return {**found, bystander.pid: netns.inode(ns)} if kind == "net" else found

    monkeypatch.setattr(procs, "pids_in_ns", stale)
    teardown.kill_processes_in([ns])
    monkeypatch.undo()
    assert not procs.alive(in_ref)                     # the namespace's own process: killed
    assert procs.alive(by_ref), "the bystander whose PID the scan listed was killed"
    assert _in(other, bystander.pid)


def test_everything_in_the_namespace_goes_pid_namespaces_and_late_comers_included(spaces, started):
    """A PID namespace's init with children, a shell that keeps forking while it is killed, and a
    process that entered with nsenter (nobody's child here): all gone, our children reaped, and a
    process in the namespace next door untouched."""
    from testbed import procs
    from testbed.net import netns, teardown

    requires.need("unshare")
    ns, other = spaces(), spaces()
    path = str(netns.path(ns))
    pidns = started(["nsenter", f"--net={path}", "unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                     "sleep 60 & sleep 60 & wait"])
    forker = started(["nsenter", f"--net={path}", "sh", "-c", "while :; do sleep 60 & sleep 0.1; done"])
    entered = int(subprocess.run(["nsenter", f"--net={path}", "sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                                 capture_output=True, text=True, check=True, timeout=10).stdout)
    neighbour = started(["ip", "netns", "exec", other, "sleep", "60"])
    ino = netns.inode(ns)
    # the two sleeps under the PID namespace's init, the forker's first sleeps, the entered sleep
    wait_for(lambda: len(procs.pids_in_ns("net", {ino})) >= 8 and _in(other, neighbour.pid), timeout=10,
             what="the processes in the namespace and the neighbour")
    n_ref = procs.ref(neighbour.pid)
    assert teardown.kill_processes_in([ns]) == []
    assert procs.pids_in_ns("net", {ino}) == {}, "processes left in the namespace"
    for p in (pidns, forker):
        with pytest.raises(ChildProcessError):   # already reaped (no zombie of ours left)
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG)
    assert not procs.exists(entered) or procs.ns_inode(entered, "net") != ino
    assert procs.alive(n_ref) and _in(other, neighbour.pid)


def test_one_state_roots_cleanup_leaves_anothers_testbed_alone(root, tmp_path, monkeypatch):
    """Two tests side by side (xdist workers) each clean up after themselves: `cleanup` under one
    state root finds the other's namespaces (labelled ours, no state in this root) and must not
    touch them, nor the processes in them."""
    from testbed import lifecycle, procs
    from testbed.cleanup import cleanup
    from testbed.net import names, netns
    from testbed.topology.loader import load_topology_text

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    name = f"k{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("TESTBED_STATE_DIR", str(a))
    st = lifecycle.up(load_topology_text("name: k\ngenerator: star\nparams: {n: 2}\n", "<test>"), name,
                      time_dilation="none")
    try:
        inits = [procs.ProcRef(r["pid"], r["starttime"]) for r in st["runtime"]["workers"].values()]
        spaces_before = netns.list_names(names.netns_prefix(name))
        monkeypatch.setenv("TESTBED_STATE_DIR", str(b))
        said = cleanup()
        assert not [r for r in said if r[0] == name], said
        assert netns.list_names(names.netns_prefix(name)) == spaces_before
        assert all(procs.alive(r) for r in inits)
    finally:
        monkeypatch.setenv("TESTBED_STATE_DIR", str(a))
        lifecycle.down(name)
    assert netns.list_names(names.netns_prefix(name)) == []
