"""A hostile state file: testbed must not act on what it did not make.

For each crafted state (path traversal in a namespace, someone else's cgroup, a PID of a process we
did not start, a foreign Docker endpoint, truncated JSON, wrong types, a symlinked state
directory, ...), `down` and `cleanup` refuse or skip the bad entry and say so, and canaries made
outside testbed (a namespace with a process in it, a cgroup with a process in it, a plain process)
survive untouched. `cleanup` still removes what it can prove is the testbed's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from testbed import lifecycle, paths, procs, store
from testbed.cleanup import cleanup
from testbed import errors
from testbed.errors import StateError
from testbed.net import names, netns
from testbed.runtime import cgroups
from testbed.topology.loader import load_topology_text

TOPO = """
name: hs
nodes:
  w0: {kind: worker}
  w1: {kind: worker}
  s0: {kind: switch}
links:
  - {endpoints: [w0, s0], bandwidth: 1gbit}
  - {endpoints: [w1, s0], bandwidth: 1gbit, delay: 1ms}
"""


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
    """A namespace with a process in it, a cgroup with a process in it, a plain process: not ours."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    tag = uuid.uuid4().hex[:6]
    ns = f"canary-{tag}"
    netns.create(ns)
    in_ns = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
    plain = subprocess.Popen(["sleep", "600"])
    hier = cgroups.hierarchy()
    mount = hier.mounts.get("cpu") or hier.mounts.get("")
    cg = mount / f"canary-{tag}"
    cg.mkdir()
    in_cg = subprocess.Popen(["sleep", "600"])
    (cg / "cgroup.procs").write_text(str(in_cg.pid))
    time.sleep(0.2)
    c = {"ns": ns, "cgroup": str(cg), "procs": {p.pid: procs.ref(p.pid) for p in (in_ns, plain, in_cg)},
         "in_ns": in_ns.pid, "plain": plain.pid, "in_cg": in_cg.pid}
    yield c
    for p in (in_ns, plain, in_cg):
        p.kill()
        p.wait()
    netns.delete(ns)
    cg.rmdir()


def _assert_canaries_alive(c):
    for pid, ref in c["procs"].items():
        assert procs.alive(ref), f"canary process {pid} was killed"
    assert netns.exists(c["ns"]), "canary namespace was deleted"
    assert Path(c["cgroup"]).is_dir(), "canary cgroup was removed"


def _first_worker(st):
    return st["runtime"]["workers"]["w0"]


# (what, how the state is changed; the canaries are handed in)
CASES = {
    "namespace path traversal": lambda st, c: st["resources"]["worker_netns"].append("../../proc/1/ns/net"),
    "a foreign namespace": lambda st, c: st["resources"]["switch_netns"].__setitem__(0, c["ns"]),
    "a foreign cgroup": lambda st, c: _first_worker(st).__setitem__("cgroups", [c["cgroup"]]),
    "a cgroup reached by ..": lambda st, c: _first_worker(st).__setitem__(
        "cgroups", [str(Path(c["cgroup"]).parent / cgroups.TOP / ".." / Path(c["cgroup"]).name)]),
    "a cgroup outside ours by name": lambda st, c: _first_worker(st).__setitem__(
        "cgroups", [str(Path(c["cgroup"]).parent / cgroups.TOP / "someone-else" / "w0")]),
    "an init that is not ours (PID and start right)": lambda st, c: _first_worker(st).update(
        pid=c["plain"], starttime=c["procs"][c["plain"]].start),
    "an init without a start time": lambda st, c: _first_worker(st).update(pid=c["in_ns"], starttime=None),
    "a delay-line helper that is not ours": lambda st, c: st["resources"]["delay_lines"][0].update(
        pid=c["in_cg"], start=c["procs"][c["in_cg"]].start) if st["resources"]["delay_lines"] else
        _first_worker(st).update(pid=c["in_cg"], starttime=c["procs"][c["in_cg"]].start),
    "a delay-line file outside the testbed": lambda st, c: st["resources"]["delay_lines"][0].update(
        pid_file="/etc/passwd") if st["resources"]["delay_lines"] else st.update(status="lost"),
    "an MPS daemon that is not ours": lambda st, c: st["gpu"].update(mps_daemon={
        "pid": c["plain"], "starttime": c["procs"][c["plain"]].start,
        "pipe_dir": str(paths.directory(st["name"]) / "mps"), "log_dir": str(paths.directory(st["name"]) / "mps")}),
    "a straggler cgroup that is not ours": lambda st, c: st.setdefault("faults", {"nodes": {}, "log": []})
        ["nodes"].update(w0={"cgroup": [c["cgroup"]]}),
    "a partition naming a foreign namespace": lambda st, c: st.setdefault("faults", {"nodes": {}, "log": []})
        .update(partition={"groups": [["w0"], ["w1"]], "netns": [c["ns"]]}),
    "a foreign Docker endpoint": lambda st, c: _first_worker(st).update(docker_host="ssh://evil.example"),
    "a node name made to escape": lambda st, c: st["topology"]["nodes"][0].update(name="../../x"),
    "a wrong type": lambda st, c: st.update(pid="1"),
    "an unknown field": lambda st, c: st.update(run_this="rm -rf /"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_state_is_refused_and_canaries_survive(case, canaries, state_dir):
    name = f"hs{uuid.uuid4().hex[:5]}"
    lifecycle.up(load_topology_text(TOPO, "<hostile>"), name, time_dilation="none")
    sf = paths.state_file(name)
    st = json.loads(sf.read_text())
    CASES[case](st, canaries)
    sf.write_text(json.dumps(st))
    refused = None
    try:
        lifecycle.down(name)
    except errors.TestbedError as exc:   # StateError (refused) or TeardownError (a part left, named)
        refused = str(exc)
    _assert_canaries_alive(canaries)
    second_proof = ("an init that is not ours (PID and start right)", "a delay-line helper that is not ours",
                    "an MPS daemon that is not ours")
    if refused is None:
        # accepted by the schema (a live process named by PID and start time): the second proof held,
        # the canary lives (asserted above), and the testbed itself is gone
        assert case in second_proof, f"{case}: down acted on the state without a word"
    else:
        assert name in refused and "cleanup" in refused, refused
    removed = cleanup()
    _assert_canaries_alive(canaries)
    assert not netns.list_names(names.netns_prefix(name)), removed   # what is provably ours is gone
    assert not paths.directory(name).exists(), removed
    assert not any(cgroups.groups_of(name))


def test_truncated_and_symlinked_states(canaries, state_dir, tmp_path):
    name = f"hs{uuid.uuid4().hex[:5]}"
    lifecycle.up(load_topology_text(TOPO, "<hostile>"), name, time_dilation="none")
    sf = paths.state_file(name)
    good = sf.read_text()
    sf.write_text(good[: len(good) // 2])
    with pytest.raises(StateError, match="corrupt"):
        lifecycle.down(name)
    sf.write_text("[" * 100_000)   # deeper than any JSON parser recurses: an error of ours, not a crash
    with pytest.raises(StateError, match="corrupt"):
        lifecycle.down(name)
    # the state directory replaced by a link to a copy elsewhere: not followed
    sf.write_text(good)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(sf, elsewhere / "state.json")
    real = paths.directory(name).with_name(f".moved-{name}")
    paths.directory(name).rename(real)
    paths.directory(name).symlink_to(elsewhere)
    with pytest.raises(StateError, match="symbolic link"):
        store.load(name)
    paths.directory(name).unlink()
    real.rename(paths.directory(name))
    lifecycle.down(name)
    _assert_canaries_alive(canaries)


def test_state_root_writable_by_others_is_refused(state_dir):
    os.chmod(state_dir, 0o777)
    try:
        with pytest.raises(PermissionError, match="writable by group or others"):
            store.list_names() or store.load("x")
    finally:
        os.chmod(state_dir, 0o755)


def test_a_removed_testbed_never_comes_back(testbed):
    st = testbed(load_topology_text(TOPO, "<hostile>"), time_dilation="none")
    name = st["name"]
    lifecycle.down(name)
    with pytest.raises(StateError, match="gone"):
        store.save(name, st)          # what a fault racing `down` would have done
    assert not paths.directory(name).exists()
