"""Phantom ranks on a testbed over several hosts (`testbed run --real`, `--record-ops`, `--replay`), end to
end against two emulated hosts (testbed/cluster/emulate.py).

One testbed for the module: topologies/two-sides.yaml pinned so that h1 holds w0, w1 and s0 and h2
holds w2, w3 and s1 (tests/cluster_hosts.py): s0-s1 is the cut link, a VXLAN tunnel. With --real w0
the leader (rank 0) is on h1; its announcements reach the phantoms of h2 through the controller
(testbed/jobs/relay.py), never over the emulated network. The CLI runs as a process, as a user runs
it, from a working directory under /var/tmp (the ranks start in it on every host, and the run
directories go there; not /tmp: workers have their own).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from cluster_hosts import LINE, REPO, pids_with, tb
from waiting import need_py_spy, python_frames, wait_for


def hosts(test):
    """Against the emulated hosts: root, sshd and ssh."""
    return pytest.mark.root(pytest.mark.requires("sshd")(test))


JOB = ["python", f"{REPO}/examples/train_ddp.py", "--steps", "15", "--model", "mlp", "--hidden", "512", "--no-check"]


@pytest.fixture(scope="module")
def line_topology(tmp_path_factory) -> Path:
    """two-sides with Linux's 1000-packet queue on its cut link, not the default 209 at 1 Gbit/s: the
    tests compare the bytes each link carried in runs of the job, and the job's flows overflow 209
    packets there (150-207 drops per direction per run, measured): their retransmissions differed
    by 3.3-3.9% between runs, more than the 1% the replay is held to."""
    topo = yaml.safe_load(LINE)
    cut = topo["links"][-1]
    assert cut["endpoints"] == ["s0", "s1"], cut
    cut["queue"] = 1000
    path = tmp_path_factory.mktemp("topology") / "two-sides-deep.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="tb-cluster-phantoms-", dir="/var/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run(line: str, cwd: Path, *args: str, check: bool = True) -> tuple[subprocess.CompletedProcess, dict]:
    r = tb("run", "--name", line, *args, cwd=cwd, check=check, timeout=300)
    m = re.search(r"run directory: (\S+)", r.stdout)
    assert m, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r, json.loads((Path(m.group(1)) / "summary.json").read_text())


def _links(summary: dict) -> dict:
    return {(lk["a"], lk["b"]): (lk["bytes_ab"], lk["bytes_ba"]) for lk in summary["links"]}


def _drops(summary: dict) -> dict:
    """The packets each port's queue dropped in a run (monitor.json, merged from both hosts: both are
    checked to be in it), where any did. Any drop counts: its retransmission is in the bytes."""
    monitor = json.loads((Path(summary["run_dir"]) / "monitor.json").read_text())
    assert monitor.get("hosts") == ["h1", "h2"] and {"s0", "s1"} <= set(monitor["qdiscs"]), \
        (monitor.get("hosts"), sorted(monitor["qdiscs"]))
    return {f"{node}.{port}": q["drops"] for node, ports in monitor["qdiscs"].items() for port, q in ports.items()
            if q.get("drops")}


def _same_bytes(ref: dict, got: dict, rel: float, slack: int) -> int:
    """Every link direction of `got` carried what it did in `ref` (within rel x + slack bytes: the
    rendezvous and control traffic differ); returns the bytes compared. Neither run dropped a
    packet: a retransmission would count in the bytes."""
    assert not _drops(ref) and not _drops(got), (_drops(ref), _drops(got))
    want, have = _links(ref), _links(got)
    assert want.keys() == have.keys()
    total = 0
    for k, (ab, ba) in want.items():
        for w, h in ((ab, have[k][0]), (ba, have[k][1])):
            total += w
            assert abs(h - w) <= rel * w + slack, (k, h, w)
    return total


@hosts
def test_phantoms_on_both_hosts_and_a_replay_put_the_jobs_bytes_on_every_link(line, workdir):
    """The all-real DDP job records rank 0's operations (--record-ops, on rank 0's host); the same job
    with w0 real and ranks 1-3 phantoms (one on h1, two on h2, fed through the controller) and a
    replay of the recording with every rank a phantom (each host plays the trace it was sent) put
    the same bytes on every link, the cut one included, as the job did."""
    full_r, full = _run(line, workdir, "--record-ops", "--", *JOB)
    assert full["status"] == "completed", full_r.stdout[-3000:]
    rec_dir = Path(full["run_dir"])
    assert [p.name for p in (rec_dir / "probe").glob("ops-*.jsonl")] == ["ops-0.jsonl"]   # rank 0's host only

    ph_r, ph = _run(line, workdir, "--real", "w0", "--", *JOB)
    assert ph["status"] == "completed" and ph["rc"] == 0, (ph_r.stdout[-3000:], ph_r.stderr[-2000:])
    info = ph["phantoms"]
    assert info["real_ranks"] == [0] and info["phantom_ranks"] == [1, 2, 3] and not info["errors"], info
    assert len(set(info["ops_mirrored"])) == 1 and info["ops_mirrored"][0] > 15, info   # each saw every op
    assert sorted(info["announce_late_by_host"]) == ["h1", "h2"] and info["relayed_lines"] > 15, info
    assert [(r["rank"], r["host"], r["phantom"]) for r in ph["ranks"]] == \
        [(0, "h1", False), (1, "h1", True), (2, "h2", True), (3, "h2", True)]
    total = _same_bytes(full, ph, 0.05, 30_000)
    assert total > 15 * 4 * 1_000_000   # megabytes of gradients per step: the comparison means something
    assert _links(ph)[("s0", "s1")][0] > 15 * 1_000_000   # and the cut link carried them
    probe = Path(ph["run_dir"]) / "probe"
    assert sorted(p.name for p in probe.glob("rank-*.jsonl")) == ["rank-0.jsonl"]   # step times: the real rank's
    assert "phantom" in ph_r.stdout   # the verdict names the phantoms
    assert "ranks: 1 real (0 on w0), 3 phantoms (1-3)\n" in ph_r.stdout   # and the console says which

    rep_r, rep = _run(line, workdir, "--replay", str(rec_dir))
    assert rep["status"] == "completed", (rep_r.stdout[-3000:], rep_r.stderr[-2000:])
    assert rep["replay"]["source"] == str(rec_dir / "probe" / "ops-0.jsonl")   # the controller's, not a copy
    assert rep["phantoms"]["phantom_ranks"] == [0, 1, 2, 3]
    assert "ranks: none real (a replay), 4 phantoms (0-3)\n" in rep_r.stdout
    _same_bytes(full, rep, 0.01, 30_000)
    assert not list(Path("/tmp").glob("testbed-replay-*")), "a host kept its copy of the trace"
    assert not _phantoms_of(line), "phantoms left running"


@hosts
def test_a_phantom_killed_on_the_other_host_ends_the_run(line, workdir):
    """A phantom of h2 killed mid-run: the real rank's collective fails, the run ends with a failure
    (not a hang) and no rank or phantom is left on either host."""
    from testbed import procs
    from testbed.jobs import stacks

    need_py_spy("the test kills the phantom once the real rank's stack is in its loop")
    marker = f"tbkill{uuid.uuid4().hex[:8]}"
    # (the sleep paces the loop: 1200 collectives over about a minute, long enough to be killed in)
    job = ("import time, torch, torch.distributed as dist\n"
           "dist.init_process_group('gloo')\n"
           "for i in range(1200):\n"
           f"    dist.all_reduce(torch.ones(1000)); time.sleep(0.05)  # {marker}\n")

    def real_rank_in_the_loop() -> bool:
        """The real rank (w0's, no phantom) runs the job's lines 3-4: its group is up, collectives flow."""
        real = [pid for pid, env in stacks.rank_pids(line) if not env.get("TESTBED_PHANTOM_IN")]
        return any((f := python_frames(pid)) and f[-1][0] == "<module>" and f[-1][2] >= 3 for pid in real)

    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", "--name", line, "--real", "w0", "--grace", "2",
                             "--", "python", "-c", job], cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "250"})
    try:
        victims = wait_for(lambda: proc.poll() is not None or [
            p for p in procs.pids_with_env("TESTBED_WORKER", "w2") if p in _phantoms_of(line)],
            timeout=120, what="the phantom of w2 on h2", interval=0.5)
        assert proc.poll() is None, proc.communicate()
        wait_for(lambda: proc.poll() is not None or real_rank_in_the_loop(), timeout=120, interval=0.5,
                 what="the real rank in its loop of collectives (past init_process_group)")
        assert proc.poll() is None, proc.communicate()
        for pid in victims:
            os.kill(pid, 9)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    took = time.monotonic() - t0
    print(f"the run ended {took:.2f} s after its phantom on h2 was killed")
    # a bound on a hang (the job's loop would go on for a minute), not a timing claim: 6.97 s here (2026-12-02)
    assert took < 60, "the run took too long to end after its phantom died"
    assert proc.returncode not in (0, 130), (proc.returncode, out[-2000:], err[-2000:])
    m = re.search(r"run directory: (\S+)", out)
    assert m, (proc.returncode, out[-3000:], err[-3000:])
    summary = json.loads((Path(m.group(1)) / "summary.json").read_text())
    assert summary["status"] == "rank failed", summary["status"]
    assert not pids_with(marker), "ranks left running"
    assert not _phantoms_of(line), "phantoms left running"


def _phantoms_of(name: str) -> list[int]:
    """This testbed's phantoms (on every emulated host: they share this PID namespace), not another
    test's that happens to run beside it."""
    from testbed import procs

    mine = set(procs.pids_with_env("TESTBED_NAME", name))
    return [p for p in pids_with("testbed.jobs.phantom") if p in mine]


@hosts
def test_replay_with_a_command_or_a_broken_trace_is_refused_before_any_host_starts(line, workdir):
    bad = workdir / "ops-0.jsonl"
    bad.write_text('{"ev": "op", "t": 1}\n')
    r = tb("run", "--name", line, "--replay", str(bad), cwd=workdir, check=False)
    assert r.returncode != 0 and "an operation before the init record" in r.stderr, r.stderr
    assert "rank(s) on 2 host(s)" not in r.stderr   # nothing was started
    r = tb("run", "--name", line, "--replay", str(bad), "--", "true", cwd=workdir, check=False)
    assert r.returncode == 2 and "either a command or --replay" in r.stderr, r.stderr
    r = tb("run", "--name", line, "--real", "w9", "--", "true", cwd=workdir, check=False)
    assert r.returncode != 0 and "--real w9: not among the run's workers" in r.stderr, r.stderr
