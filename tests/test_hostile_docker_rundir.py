"""A Docker worker with the working directory mounted read-write plants links and FIFOs in its run
directory while `testbed run` goes (issue #23, "trust nothing you did not make").

With TESTBED_DOCKER_MOUNT_CWD=rw the run directory (runs/<time>-<testbed>/ under the directory `up`
and `run` ran in) is writable from inside the worker container, where the job is root. The job here
replaces, after the ranks started, the names root writes at the end of the run (summary.json,
monitor.json, counters-after.json, testbed-events.jsonl, report.txt, the plots) and reads (topology.json,
the probe's rank files) by symbolic links to a canary outside, a hard link to a file of the mounted
directory, and FIFOs. The real `testbed run` (the CLI, as a user runs it) must end within a bound, write
through none of them and leave everything outside the run directory as it was. A job that swaps the
whole runs/ folder for a link is refused by name.

Needs root, a Docker daemon (`scripts/dockerd.sh start`) and the worker image (`make image`); skips
without them unless TESTBED_REQUIRE_DOCKER=1 / TESTBED_REQUIRE=all.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import requires

pytestmark = [pytest.mark.docker, pytest.mark.root]   # ~12 s the file (2 cores): not slow

REPO = Path(__file__).resolve().parent.parent
TOPO = """
name: hd
nodes:
  w0: {kind: worker}
  s0: {kind: switch}
links:
  - {endpoints: [w0, s0], bandwidth: 1gbit}
"""
RUN_BOUND_S = 120   # a run of a 3 s shell job, its report included: far less; a FIFO waited on: never ends
PRECIOUS = "precious: root must never write here\n"


def _tree(top: Path, skip: Path | None = None) -> dict[str, tuple]:
    """Every entry below top (not following links), but skip's: kind, size, mtime, content hash (of a
    folder its kind only: making runs/ changes its parent's size and times)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        d = Path(dirpath)
        if skip is not None and (d == skip or skip in d.parents):
            dirnames[:] = []
            continue
        for n in dirnames + filenames:
            p = d / n
            if skip is not None and p == skip:
                continue
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            if stat.S_ISDIR(st.st_mode):
                out[str(p.relative_to(top))] = (stat.S_IFDIR,)
            else:
                out[str(p.relative_to(top))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A one-worker Docker testbed brought up in `cwd` with that directory mounted read-write in the
    worker: (name, cwd, the test's folder, env for the CLI). Down, its containers and namespaces
    gone, after the module's last test."""
    if os.geteuid() != 0:
        requires.need("docker", ok=False, why="not root (binding container namespaces on /run/netns needs it)")
    from testbed.runtime import docker as dk

    if not dk.daemon_available():
        requires.need("docker", ok=False, why=f"no Docker daemon at {dk.docker_host()} (scripts/dockerd.sh start)")
    image = os.environ.get("TESTBED_WORKER_IMAGE", dk.DEFAULT_IMAGE)
    if not dk.image_available(image):
        requires.need("docker", ok=False, why=f"image {image} missing (make image)")

    from testbed import lifecycle
    from testbed.net import netns
    from testbed.topology.loader import load_topology_text

    top = tmp_path_factory.mktemp("hostile-docker")
    cwd = top / "cwd"
    cwd.mkdir()
    name = f"hd{uuid.uuid4().hex[:6]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESTBED_STATE_DIR", str(top / "state"))
        mp.setenv("TESTBED_DOCKER_MOUNT_CWD", "rw")
        mp.chdir(cwd)
        try:
            st = lifecycle.up(load_topology_text(TOPO, "<test>"), name, runtime="docker")
            assert st["runtime"]["kind"] == "docker"
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            yield name, cwd, top, env
        finally:
            try:
                lifecycle.down(name)
            except Exception:
                pass
            dk.cleanup_by_label(name)
            for ns in netns.list_names(f"tb-{name}-"):
                netns.delete(ns)


def _release_fifos(top: Path) -> None:
    """Every FIFO below top opened and closed from here: a reader or a writer waiting on one goes on."""
    for dirpath, _dirs, files in os.walk(top):
        for n in files:
            f = os.path.join(dirpath, n)
            try:
                if stat.S_ISFIFO(os.lstat(f).st_mode):
                    os.close(os.open(f, os.O_RDWR | os.O_NONBLOCK))
            except OSError:
                pass


def _testbed_run(name: str, cwd: Path, top: Path, env: dict, script: str, *extra: str):
    """`testbed run --name NAME [extra] -- sh -c SCRIPT` in cwd, as a user runs it; (result, seconds).
    Fails if it has not ended within RUN_BOUND_S (every FIFO below top is then opened from here, which
    lets a reader or a writer waiting on one go, and the run is killed if it still goes on)."""
    argv = [sys.executable, "-m", "testbed", "run", "--name", name, "--grace", "1", *extra, "--", "sh", "-c", script]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=RUN_BOUND_S)
    except subprocess.TimeoutExpired:
        _release_fifos(top)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"testbed run did not end within {RUN_BOUND_S} s (waiting on a FIFO the job planted?)\n"
                    f"stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, p.returncode, out, err), time.monotonic() - t0


def _fresh_runs(cwd: Path) -> None:
    """runs/ of an earlier test of the module (a folder, or the link a job left) out of the way."""
    old = cwd / "runs"
    if old.exists() or old.is_symlink():
        old.rename(cwd / f"runs-before-{uuid.uuid4().hex[:6]}")


def _only_run_dir(cwd: Path) -> Path:
    runs = [d for d in (cwd / "runs").iterdir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_links_fifos_and_a_hard_link_planted_in_the_run_dir_are_neither_followed_nor_waited_on(hostile):
    name, cwd, top, env = hostile
    outside = top / "outside"
    outside.mkdir(exist_ok=True)
    canary = outside / "canary.txt"            # out of the container's sight: reached only by a host link
    canary.write_text(PRECIOUS)
    hl_canary = cwd / "project-file.txt"       # in the mounted directory, outside the run directory
    hl_canary.write_text(PRECIOUS)
    linked = ["summary.json", "monitor.json", "report.txt", "step_times.png", "links.png"]
    fifos = ["testbed-events.jsonl", "topology.json"]
    # rank 0, once it runs: every name root writes at the end (or reads: topology.json, probe files)
    script = f"""
set -e
rd="$TESTBED_RUN_DIR"
test -d "$rd/logs"
for f in {' '.join(linked)}; do ln -sfn {canary} "$rd/$f"; done
ln -f {hl_canary} "$rd/counters-after.json"
for f in {' '.join(fifos)}; do rm -f "$rd/$f"; mkfifo "$rd/$f"; done
mkfifo "$TESTBED_PROBE_DIR/rank-7.jsonl"
ln -s {canary} "$TESTBED_PROBE_DIR/rank-8.jsonl"
echo '{{"ev": "step", "t": 1.0, "dur": 0.1, "n": 1}}' > "$TESTBED_PROBE_DIR/rank-0.jsonl"
ls -l "$rd" "$TESTBED_PROBE_DIR"
echo PLANTED
sleep 3
"""
    _fresh_runs(cwd)
    before_outside = {k: v for k, v in _tree(top, skip=cwd / "runs").items() if not k.startswith("state")}
    res, took = _testbed_run(name, cwd, top, env, script, "--report")
    rd = _only_run_dir(cwd)
    log = (rd / "logs" / "w0.log").read_text() if (rd / "logs" / "w0.log").is_file() else "(no log)"
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}\nlog:\n{log[-3000:]}"
    assert "PLANTED" in log, why   # the job did plant, from inside the container
    # ended, and in time: no FIFO waited on
    assert took < RUN_BOUND_S, why
    assert res.returncode == 0, why
    # nothing written through a link or a hard link: the canaries are as made, and one name each
    assert canary.read_bytes() == PRECIOUS.encode(), why
    assert hl_canary.read_bytes() == PRECIOUS.encode() and os.stat(hl_canary).st_nlink == 1, why
    # the names root wrote are its own plain files now (the planted ones replaced, not written through)
    for f in linked[:3] + ["counters-after.json", "testbed-events.jsonl"]:
        st = os.lstat(rd / f)
        assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1, (f, stat.filemode(st.st_mode), why)
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rc"] == 0, why
    assert "verdict" in summary, why   # the report's own rewrite of summary.json landed in the run dir
    assert (rd / "report.txt").read_text().strip(), why
    # topology.json, written before the ranks started, is the job's FIFO still: read by the report
    # without waiting on it (the run ended above)
    assert stat.S_ISFIFO(os.lstat(rd / "topology.json").st_mode)
    # the probe's files were collected from the exchange folder: the plain one only
    probe = rd / "probe"
    assert probe.is_dir() and not probe.is_symlink(), why
    assert sorted(p.name for p in probe.iterdir()) == ["rank-0.jsonl"], why
    # nothing outside the run directory (and the state dir, testbed's own) changed
    after_outside = {k: v for k, v in _tree(top, skip=cwd / "runs").items() if not k.startswith("state")}
    assert after_outside == before_outside
    assert sorted(p.name for p in (cwd / "runs").iterdir()) == [rd.name]
    # what it could not read, it says: the verdict names the topology snapshot it went without
    assert "no topology snapshot" in " ".join(res.stdout.split()), why


def test_a_runs_folder_swapped_for_a_link_is_refused_by_name(hostile):
    """The job replaces the whole runs/ folder of the working directory by a link to a folder outside
    (where the run's last files would land if root followed it): `testbed run` refuses it, saying
    which path, in time; nothing lands outside."""
    name, cwd, top, env = hostile
    elsewhere = top / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    canary = elsewhere / "canary.txt"
    canary.write_text(PRECIOUS)
    _fresh_runs(cwd)
    script = f"""
set -e
rd="$TESTBED_RUN_DIR"
test -d "$rd/logs"
mv {cwd}/runs {cwd}/runs.moved
ln -s {elsewhere} {cwd}/runs
echo PLANTED
sleep 2
"""
    res, took = _testbed_run(name, cwd, top, env, script)
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert "PLANTED" in res.stdout, why
    assert took < RUN_BOUND_S, why
    assert res.returncode != 0, why
    err = " ".join(res.stderr.split())
    assert f"{cwd}/runs" in err and "refused" in err and "Traceback" not in res.stderr, why
    assert sorted(p.name for p in elsewhere.iterdir()) == ["canary.txt"], why
    assert canary.read_bytes() == PRECIOUS.encode()
    assert (cwd / "runs").is_symlink()   # (left as the job made it: testbed removes nothing it did not make)
