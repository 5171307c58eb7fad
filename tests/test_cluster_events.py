"""`testbed events` and `testbed stacks` on a testbed over several hosts, end to end, against two
emulated hosts (testbed/cluster/emulate.py): every host's events merged in time order with their hosts
(and followed with -f until a Ctrl-C, which ends every host's `events -f`), and the stacks of a job's
ranks on both hosts.

One testbed for the module: topologies/two-sides.yaml pinned so that h1 holds w0, w1 and s0 and h2
holds w2, w3 and s1 (s0-s1 is the cut link: a change to it is made, and logged, on both hosts). The
CLI runs as a process, as a user runs it; the controller keeps its record in a state directory of its
own (TESTBED_STATE_DIR), the hosts in their own /run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from testbed.cluster import emulate

REPO = Path(__file__).resolve().parents[1]
CAN_EMULATE = os.geteuid() == 0 and Path(emulate.SSHD).exists() and shutil.which("ssh-keygen") is not None \
    and shutil.which("ssh") is not None
pytestmark = [pytest.mark.root, pytest.mark.skipif(not CAN_EMULATE, reason="needs root, openssh-server and -client")]

TOPO = (REPO / "topologies" / "two-sides.yaml").read_text()
PINS = ["--pin", "w0=h1", "--pin", "w1=h1", "--pin", "s0=h1", "--pin", "w2=h2", "--pin", "w3=h2", "--pin", "s1=h2"]


@pytest.fixture(scope="module")
def line(tmp_path_factory):
    from testbed.cluster import controller

    state = tmp_path_factory.mktemp("controller")   # the controller's own state root (0700, root's)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESTBED_STATE_DIR", str(state))
        with emulate.emulated(2, tmp_path_factory.mktemp("emu") / "hosts", cores=8) as emu:
            topo = tmp_path_factory.mktemp("topo") / "two-sides.yaml"
            topo.write_text(TOPO)
            name = f"ev{uuid.uuid4().hex[:6]}"
            tb("up", str(topo), "--name", name, "--hosts", str(emu.hosts_file), "--known-hosts",
               str(emu.known_hosts), "--time-dilation", "none", *PINS)
            try:
                yield name
            finally:
                if controller.exists(name):
                    tb("down", name, check=False)


def tb(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """`testbed ARGS` as a process, the way a user runs it."""
    r = subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO, env={**os.environ, "COLUMNS": "250"})
    if check and r.returncode != 0:
        raise AssertionError(f"testbed {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def _pids_with(marker: str, start: bool = False) -> list[int]:
    """PIDs of processes whose command line holds `marker` (start: begins with it). The emulated
    hosts share this machine's PID namespace, so their processes are seen here."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(marker) if start else marker in cmd:
                found.append(int(d.name))
    return [p for p in found if p != os.getpid()]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_events_of_both_hosts_merged_in_time_order_and_followed(line):
    t0 = time.time()
    tb("link", "down", "s0", "s1", "--name", line)
    tb("link", "up", "s0", "s1", "--name", line)
    recs = [json.loads(x) for x in tb("events", "--json", "--name", line).stdout.splitlines()]
    assert [r["t"] for r in recs] == sorted(r["t"] for r in recs), "not in time order"
    assert {r["host"] for r in recs if r["kind"] == "up"} == {"h1", "h2"}, recs
    links = [(r["host"], r["what"]) for r in recs if r["kind"] == "link" and r["t"] >= t0]
    for host in ("h1", "h2"):   # each host changed its own end of the cut link, and logged it
        assert [w.split()[:2] for h, w in links if h == host] == [["link", "down"], ["link", "up"]], links
    text = tb("events", "--kind", "link", "--name", line).stdout.splitlines()
    assert re.match(r"TIME\s+HOST\s+KIND\s+WHAT", text[0]), text
    assert any(re.search(r"\sh2\s+link\s+link down", x) for x in text[1:]), text
    assert not any(" up: " in x for x in text), text   # --kind went to the hosts

    # -f: what was there, then what comes, as it comes, until a Ctrl-C ends every host's `events -f`
    follow = subprocess.Popen([sys.executable, "-m", "testbed", "events", "-f", "--json", "--name", line],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen: list[dict] = []
        while len([r for r in seen if r["kind"] == "link"]) < len(links):   # the history, from both hosts
            seen.append(json.loads(follow.stdout.readline()))
        t1 = time.time()
        tb("link", "down", "s0", "s1", "--name", line)
        tb("link", "up", "s0", "s1", "--name", line)
        new: list[tuple[str, str]] = []
        while len(new) < 4:
            r = json.loads(follow.stdout.readline())
            if r["t"] >= t1:
                new.append((r["host"], r["what"].split()[1]))
        assert sorted(new) == [("h1", "down"), ("h1", "up"), ("h2", "down"), ("h2", "up")], new
        assert _pids_with(f"events --json --name {line} -f"), "no events -f on the hosts"
        follow.send_signal(signal.SIGINT)   # what Ctrl-C on the controller's terminal does
        _, err = follow.communicate(timeout=30)
    finally:
        _stop(follow)
    assert follow.returncode == 0, err   # a Ctrl-C ends -f, as on one host
    deadline = time.monotonic() + 10
    while _pids_with(f"events --json --name {line} -f") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids_with(f"events --json --name {line} -f"), "events -f still runs on a host"


def test_stacks_of_a_job_across_hosts(line):
    from testbed.jobs.stacks import py_spy

    if py_spy() is None:
        pytest.skip("py-spy is not installed (pip install py-spy): the hosts cannot read the ranks' stacks")
    marker = f"waiting_{uuid.uuid4().hex[:8]}"   # the function the ranks wait in (and no one else runs)
    job = f"import time\ndef {marker}():\n    time.sleep(120)\n{marker}()"
    run = subprocess.Popen([sys.executable, "-m", "testbed", "run", "--name", line, "--no-probe", "--", "python",
                            "-c", job], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(_pids_with(f"python -c {job}", start=True)) < 4:
            assert run.poll() is None and time.monotonic() < deadline, "the job did not start its 4 ranks"
            time.sleep(0.2)
        time.sleep(1)   # past the interpreter's start: in the job's function
        out = tb("stacks", "--name", line).stdout
        assert "4 ranks (0-3) [h1: 2, h2: 2]:" in out and marker in out, out
        ranks = json.loads(tb("stacks", "--json", "--name", line).stdout)
        assert sorted((r["rank"], r["worker"], r["host"]) for r in ranks) == [
            (0, "w0", "h1"), (1, "w1", "h1"), (2, "w2", "h2"), (3, "w3", "h2")], ranks
        out = tb("stacks", "--workers", "w3", "--name", line).stdout
        assert "1 rank (3) [h2: 1]:" in out, out
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=90)
    finally:
        _stop(run)
    assert not _pids_with(f"python -c {job}", start=True), "ranks left running"
