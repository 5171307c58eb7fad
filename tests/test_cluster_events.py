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
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

import requires
from waiting import wait_for

from cluster_hosts import REPO, pids_with, tb

pytestmark = [pytest.mark.root, pytest.mark.requires("sshd")]


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

    # -f: what was there, then what comes, as it comes, until a Ctrl-C ends every host's stream
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
        assert pids_with("testbed agent"), "no agent streaming the events on the hosts"
        follow.send_signal(signal.SIGINT)   # what Ctrl-C on the controller's terminal does
        _, err = follow.communicate(timeout=30)
    finally:
        _stop(follow)
    assert follow.returncode == 0, err   # a Ctrl-C ends -f, as on one host
    wait_for(lambda: not pids_with("testbed agent"), timeout=10, what="the hosts' agents to end their streams")


def test_stacks_of_a_job_across_hosts(line):
    from testbed.jobs.stacks import py_spy

    requires.need("py-spy", ok=py_spy() is not None, why="the hosts cannot read the ranks' stacks")
    marker = f"waiting_{uuid.uuid4().hex[:8]}"   # the function the ranks wait in (and no one else runs)
    job = f"import time\ndef {marker}():\n    time.sleep(120)\n{marker}()"
    run = subprocess.Popen([sys.executable, "-m", "testbed", "run", "--name", line, "--no-probe", "--", "python",
                            "-c", job], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: run.poll() is not None or len(pids_with(f"python -c {job}", start=True)) >= 4, timeout=90,
                 what="the job's 4 ranks to start")
        assert run.poll() is None, run.communicate()
        # the ranks are in the job's function once the stacks say so (was: one look after 1 s)
        def in_function() -> str | None:
            o = tb("stacks", "--name", line).stdout
            return o if marker in o and "4 ranks" in o else None

        out = wait_for(in_function, timeout=60, what=f"the stacks of all 4 ranks in {marker}()")
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
    assert not pids_with(f"python -c {job}", start=True), "ranks left running"
