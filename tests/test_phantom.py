"""Phantom ranks (`testbed run --real`): one real rank, the others mirroring its collectives.

Kernel tests (root), on testbeds brought up by the conftest `testbed` fixture.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import requires
from waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

# 1000-packet queues: the tests compare the bytes each link carried in two runs, and a retransmission
# counts there too; the default at 1 Gbit/s (209 packets) dropped enough for the Chakra replay to
# differ by 2.6% (make test-rest, 2026-12-07)
STAR = "name: ph\ngenerator: star\nparams: {n: 4}\ntiers:\n  host: {bandwidth: 1gbit, delay: 0s, queue: 1000}\n"


@pytest.fixture
def star(testbed):
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text(STAR, "<test_phantom>"), time_dilation="none")
    return cluster_from_state(st["name"])


def _log(res) -> str:
    return "\n".join(p.read_text() for p in sorted((res.run_dir / "logs").glob("*.log")))


def _no_orphans(res) -> None:
    from testbed.jobs.ranks import tagged_pids

    assert tagged_pids(res.summary["run_id"]) == []


def _console_ranks(res, capsys) -> str:
    """The line `testbed run` prints on the ranks (real or phantom) of this run: from its result, as
    on one host, and from its summary.json, as over several hosts; the same either way."""
    from testbed.cli.run import _say_ranks

    capsys.readouterr()
    _say_ranks(res.run_dir, res.summary)
    _say_ranks(res.run_dir)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], lines
    return lines[0]


def _same_bytes_on_every_link(ref, got, rel: float, slack: int) -> int:
    """Every link direction of run `got` carried what it did in run `ref` (within rel x + slack
    bytes: the rendezvous and control traffic differ); returns the bytes compared."""
    by_link = {(lk["a"], lk["b"]): lk for lk in ref.summary["links"]}
    total = 0
    for lk in got.summary["links"]:
        want = by_link[(lk["a"], lk["b"])]
        for d in ("bytes_ab", "bytes_ba"):
            total += want[d]
            assert abs(lk[d] - want[d]) <= rel * want[d] + slack, (lk["a"], lk["b"], d, lk[d], want[d])
    return total


def test_ddp_with_phantoms_puts_the_same_bytes_on_every_link(star, tmp_path, capsys):
    """DDP (constructor checks, parameter broadcast, bucket rebuild, bucketed all_reduce) with
    rank 0 real and ranks 1-3 phantoms: the job completes and every link carries what the
    all-real run put on it."""
    from testbed.jobs.run import run

    cmd = [sys.executable, "examples/train_ddp.py", "--steps", "30", "--model", "mlp", "--hidden", "512", "--no-check"]
    full = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300)
    assert full.rc == 0, _log(full)[-3000:]
    ph = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300, real=["w0"])
    assert ph.rc == 0, _log(ph)[-3000:]
    info = ph.summary["phantoms"]
    assert info["real_ranks"] == [0] and info["phantom_ranks"] == [1, 2, 3] and not info["errors"]
    assert len(set(info["ops_mirrored"])) == 1 and info["ops_mirrored"][0] > 30   # every phantom saw every op
    assert [r["phantom"] for r in ph.summary["ranks"]] == [False, True, True, True]
    assert _console_ranks(ph, capsys) == "ranks: 1 real (0 on w0), 3 phantoms (1-3)"
    total = _same_bytes_on_every_link(full, ph, 0.05, 20_000)
    assert total > 30 * 4 * 1_000_000     # megabytes of gradients per step: the comparison means something
    # only the real rank wrote probe records: step times are its
    assert sorted(p.name for p in (ph.run_dir / "probe").glob("rank-*.jsonl")) == ["rank-0.jsonl"]
    # its burst of small all_reduces ran too, the phantoms mirroring it: the run is judged with the
    # per-message cost it paid itself, announcements included, not the calibration's
    from testbed.jobs.run import LATENCY_BURST
    from testbed.report.analyze import LATENCY_OP
    from testbed.report.run_constants import RUN_ALPHA, run_constants
    from testbed.topology.reference import MachineConstants

    records = [json.loads(r) for r in (ph.run_dir / "probe" / "rank-0.jsonl").read_text().splitlines() if r]
    assert sum(r.get("op") == LATENCY_OP for r in records) == LATENCY_BURST
    judged = run_constants(ph.run_dir, MachineConstants(alpha_s=1e-3, beta_s_per_byte=1e-9), star.topology,
                           star.workers)
    assert RUN_ALPHA in judged.source and judged.alpha_s != 1e-3, judged
    _no_orphans(ph)


@pytest.mark.slow
def test_torchrun_with_phantoms_puts_the_same_bytes_on_every_link(star, tmp_path):
    """The same job launched by torchrun: the real worker's agent runs the script, the others'
    agents run the phantom module with the job's torchrun options; which global ranks were
    phantoms is the rendezvous' choice, read back from the phantoms."""
    from testbed.jobs.run import run

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "examples/train_ddp.py", "--steps", "20", "--model", "mlp", "--hidden", "512", "--no-check"]
    full = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300)
    assert full.rc == 0, _log(full)[-3000:]
    ph = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300, real=["w0"])
    assert ph.rc == 0, _log(ph)[-3000:]
    info = ph.summary["phantoms"]
    assert len(info["real_ranks"]) == 1 and len(info["phantom_ranks"]) == 3 and not info["errors"], info
    assert sorted(info["real_ranks"] + info["phantom_ranks"]) == [0, 1, 2, 3]
    assert len(set(info["ops_mirrored"])) == 1 and info["ops_mirrored"][0] > 20
    _same_bytes_on_every_link(full, ph, 0.05, 20_000)
    assert len(list((ph.run_dir / "probe").glob("rank-*.jsonl"))) == 1
    assert [p.name for p in (ph.run_dir / "probe").glob("ops-*.jsonl")] == [f"ops-{info['real_ranks'][0]}.jsonl"]
    _no_orphans(ph)


@pytest.mark.slow
def test_fsdp_with_phantoms_puts_the_same_bytes_on_every_link(star, tmp_path):
    """FSDP2 (fully_shard): per-layer all_gather_into_tensor and reduce_scatter_tensor, through
    DeviceMesh groups, with rank 0 real: the links carry what the all-real run put on them."""
    from testbed.jobs.run import run

    cmd = [sys.executable, "examples/train_fsdp.py", "--steps", "8", "--hidden", "768"]
    full = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300)
    assert full.rc == 0, _log(full)[-3000:]
    ph = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300, real=["w0"])
    assert ph.rc == 0 and not ph.summary["phantoms"]["errors"], _log(ph)[-3000:]
    total = _same_bytes_on_every_link(full, ph, 0.05, 20_000)
    assert total > 8 * 4 * 4_000_000
    _no_orphans(ph)


@pytest.mark.slow
def test_every_collective_kind_is_mirrored(star, tmp_path):
    from testbed.jobs.run import run

    full = run(star, [sys.executable, "examples/collectives_tour.py"], echo=False, base_dir=tmp_path,
               workdir=str(REPO), monitor=False, timeout=180)
    assert full.rc == 0 and "tour: ok" in _log(full), _log(full)[-3000:]   # the script itself is sound
    res = run(star, [sys.executable, "examples/collectives_tour.py"], echo=False, base_dir=tmp_path,
              workdir=str(REPO), monitor=False, timeout=180, real=["w0"])
    log = _log(res)
    assert res.rc == 0 and "tour: ok" in log, log[-3000:]
    assert not res.summary["phantoms"]["errors"]
    # the tour makes a group of ranks 1-3 only: what runs there is the phantoms' own, unknowable
    assert any("has no real rank" in w for w in res.summary["phantoms"]["warnings"])
    late = res.summary["phantoms"]["announce_late_p50_s"]
    assert late is not None and 0 <= late < 0.05, late
    _no_orphans(res)


def _cfs_quota(name: str, worker: str) -> int:
    """The CFS quota (us) the kernel enforces on a worker now; -1 when unlimited."""
    from testbed import store

    for p in map(Path, store.load(name)["runtime"]["workers"][worker]["cgroups"]):
        if (p / "cpu.cfs_quota_us").exists():
            return int((p / "cpu.cfs_quota_us").read_text())
        if (p / "cpu.max").exists():
            q = (p / "cpu.max").read_text().split()[0]
            return -1 if q == "max" else int(q)
    raise AssertionError(f"{worker} has no CPU cgroup")


def test_phantoms_keep_ups_cpu_cap_and_node_restore_gives_it_back(testbed, tmp_path):
    """At s above what sharing the CPUs gives, `up` caps every worker at 1/s of a core, phantoms
    included: their per-message work then slows by s like the real rank's (lifting it, a 64-rank
    all_reduce ran 0.87x the model: docs/fidelity.md). `node restore` after `node slow` gives a
    worker that cap back (it raised TypeError once)."""
    from testbed.faults import control
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.runtime import cgroups
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text(STAR, "<test_phantom>"), time_dilation="8")
    assert st["dilation"]["cap_cpu"], st["dilation"]
    cl = cluster_from_state(st["name"])
    capped = cgroups.cfs(1 / 8)[0]
    workers = ("w0", "w1", "w2", "w3")
    during: dict[str, int] = {}
    # (the job's sleep is its whole work: a run to read the caps during, not a wait for anything)
    res = run(cl, [sys.executable, "-c", "import time; time.sleep(0.1)"], echo=False, base_dir=tmp_path,
              workdir=str(REPO), monitor=False, timeout=120, real=["w0"],
              on_start=lambda _rd, _probe: during.update({w: _cfs_quota(cl.name, w) for w in workers}))
    assert res.rc == 0, _log(res)[-2000:]
    assert during == {w: capped for w in workers}
    control.node_slow(cl.name, "w1", 0.5)
    assert _cfs_quota(cl.name, "w1") == cgroups.cfs(0.5)[0]
    control.node_restore(cl.name, "w1")
    assert {w: _cfs_quota(cl.name, w) for w in workers} == {w: capped for w in workers}


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "swallowed", "error"])
def test_a_ctrl_c_before_the_ranks_start_undoes_the_runs_cap_and_folder(star, tmp_path, how):
    """A Ctrl-C (or SIGTERM, which the launcher takes as one, or an error of the launcher's) after
    the run capped its real worker and made its exchange folder, before any rank started (here: in
    on_start): the cap is lifted, the folder is gone, nothing was started, and the run, which had
    said it started, says how it ended (its summary no longer "running"). "swallowed": a real SIGINT
    whose KeyboardInterrupt a library on the launcher's thread catches and drops (pyroute2's reply
    parsing has a bare `except: pass`; CI's sweep run of 2026-12-07 lost a Ctrl-C that way, and its
    ranks ran to the end): the run still stops before its ranks start."""
    import signal

    from testbed import store
    from testbed.jobs.ranks import tagged_pids
    from testbed.jobs.run import run

    seen: dict[str, object] = {}

    def ctrl_c(rd, probe_dir):
        seen.update(quota=_cfs_quota(star.name, "w0"), shared=probe_dir.parent, rd=rd,
                    status=json.loads((rd / "summary.json").read_text())["status"])
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)   # (its handler raises at once, in this thread)
            pytest.fail("SIGTERM did not interrupt the run's setup")
        if how == "error":
            raise OSError(28, "No space left on device")
        if how == "swallowed":
            try:
                signal.raise_signal(signal.SIGINT)   # the run's handler raises at once, in this thread
            except KeyboardInterrupt:
                return
            pytest.fail("SIGINT did not reach the run's handler")
        raise KeyboardInterrupt

    with pytest.raises(OSError if how == "error" else KeyboardInterrupt):
        run(star, [sys.executable, "-c", "pass"], echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False,
            timeout=60, real=["w0"], on_start=ctrl_c)
    assert seen["quota"] != -1, "s = 1 on 2 cores: the real rank's worker is capped at one core while it runs"
    assert _cfs_quota(star.name, "w0") == -1
    assert "cpus" not in (((store.load(star.name).get("faults") or {}).get("nodes") or {}).get("w0") or {})
    assert not Path(seen["shared"]).exists()
    assert tagged_pids(Path(seen["shared"]).name) == []
    summary = json.loads((seen["rd"] / "summary.json").read_text())
    ended = ("error", 1, "OSError: [Errno 28] No space left on device") if how == "error" else ("interrupted", 130, None)
    assert (seen["status"], summary["status"], summary["rc"], summary["error"]) == ("running", *ended)
    kept = [json.loads(line)["what"] for line in (seen["rd"] / "testbed-events.jsonl").read_text().splitlines()]
    said = [w for w in kept if w.startswith(f"run {summary['run_id']} ")]
    assert [w.split(":")[0] for w in said] == [f"run {summary['run_id']} started", f"run {summary['run_id']} ended"], kept
    reason = "error (OSError: [Errno 28] No space left on device), exit status 1" if how == "error" \
        else "interrupted, exit status 130"
    assert said[1].startswith(f"run {summary['run_id']} ended: {reason}, "), said


def test_point_to_point_is_refused_clearly(star, tmp_path):
    from testbed.jobs.run import run

    code = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(4)\n"
            "dist.send(t, 1) if dist.get_rank() == 0 else dist.recv(t, 0)\n")
    t0 = time.monotonic()
    res = run(star, [sys.executable, "-c", code], echo=False, base_dir=tmp_path, workdir=str(REPO),
              monitor=False, timeout=120, real=["w0"])
    assert res.rc != 0 and res.summary["first_failure"]["rank"] == 0
    assert "point-to-point send/recv cannot be mirrored" in _log(res)
    assert time.monotonic() - t0 < 60      # an error, not a hang until the timeout
    _no_orphans(res)


def test_real_ranks_that_diverge_end_the_run_naming_both_operations(star, tmp_path):
    """Rank-dependent control flow with two real ranks: rank 1 checks each of its operations
    against rank 0's (which the phantoms mirror) and stops at the first difference, an error that
    names both operations, not a hang."""
    from testbed.jobs.run import run

    code = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "for i in range(3):\n"
            "    dist.all_reduce(torch.ones(1000))\n"
            "if dist.get_rank() == 0:\n"
            "    dist.broadcast(torch.ones(10), 0)\n"
            "dist.all_reduce(torch.ones(2000))\n")
    t0 = time.monotonic()
    res = run(star, [sys.executable, "-c", code], echo=False, base_dir=tmp_path, workdir=str(REPO),
              monitor=False, timeout=120, real=["w0", "w1"])
    assert res.rc != 0
    log = _log(res)
    assert "rank 1 and rank 0 diverge at operation 4 of group 0" in log, log[-2000:]
    assert "allreduce of 2000 float32 element(s)" in log and "broadcast of 10 float32 element(s)" in log
    assert time.monotonic() - t0 < 60
    _no_orphans(res)


def test_real_ranks_that_agree_run_with_phantoms(star, tmp_path, capsys):
    """Two real ranks issuing the same collectives (DDP) pass the check, with the phantoms."""
    from testbed.jobs.run import run

    cmd = [sys.executable, "examples/train_ddp.py", "--steps", "5", "--model", "mlp", "--hidden", "256", "--no-check"]
    res = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300,
              real=["w0", "w1"])
    assert res.rc == 0, _log(res)[-2000:]
    assert res.summary["phantoms"]["real_ranks"] == [0, 1]
    assert _console_ranks(res, capsys) == "ranks: 2 real (0 on w0, 1 on w1), 2 phantoms (2-3)"
    _no_orphans(res)


def test_a_killed_phantom_ends_the_run(star, tmp_path):
    from testbed.jobs.run import run

    # (the sleep paces the loop, not a wait: 600 collectives over 30 s and more, a run that outlives
    # the kill; if the killed phantom did not end it, the run's 120 s timeout would)
    code = ("import time, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "for i in range(600):\n"
            "    dist.all_reduce(torch.ones(1000)); time.sleep(0.05)\n")

    killed: list[int] = []
    errors: list[BaseException] = []

    def kill_a_phantom(rd: Path, _probe: Path) -> None:
        import threading

        def later() -> None:
            from testbed import procs

            try:   # rank 2's phantom, as soon as it runs (it was: 4 s of sleep, then one look)
                pids = wait_for(lambda: procs.pids_with_env("TESTBED_PHANTOM_IN", str(_fifo(rd, 2))),
                                timeout=60, what="phantom rank 2's process", ignore=(OSError, KeyError, ValueError))
                for pid in pids:
                    os.kill(pid, 9)
                killed.extend(pids)
            except BaseException as exc:   # said by the test, not lost in this thread
                errors.append(exc)

        threading.Thread(target=later, daemon=True).start()

    t0 = time.monotonic()
    res = run(star, [sys.executable, "-c", code], echo=False, base_dir=tmp_path, workdir=str(REPO),
              monitor=False, timeout=120, real=["w0"], on_start=kill_a_phantom)
    assert not errors, errors[0]
    assert killed, "no phantom was killed"
    assert res.rc != 0 and res.summary["status"] == "rank failed"
    took = time.monotonic() - t0
    print(f"a killed phantom ended the run {took:.2f} s after it started (load {os.getloadavg()[0]:.2f})")
    # a bound on a hang (the run's own timeout is 120 s), not a timing claim: 5.20-5.25 s in 5 runs
    # (2026-12-03, load 1.3-1.5 on 2 cores: `pytest -s -k killed_phantom`); the status says who ended it
    assert took < 60, took
    _no_orphans(res)


def _fifo(rd: Path, rank: int) -> Path:
    import json

    summary = json.loads((rd / "summary.json").read_text())
    from testbed import paths

    return paths.directory(summary["testbed"]) / "runs" / summary["run_id"] / "phantom" / f"rank-{rank}.fifo"


def test_real_must_name_a_run_worker(star, tmp_path):
    from testbed.errors import RunError
    from testbed.jobs.run import run

    with pytest.raises(RunError, match="not among the run's workers"):
        run(star, ["true"], real=["w9"], base_dir=tmp_path, echo=False)
    with pytest.raises(RunError, match="at least one real worker and one phantom"):
        run(star, ["true"], real=["w0", "w1", "w2", "w3"], base_dir=tmp_path, echo=False)
    with pytest.raises(RunError, match="needs the probe"):
        run(star, ["true"], real=["w0"], probe=False, base_dir=tmp_path, echo=False)


@pytest.mark.slow
def test_record_then_replay_reproduces_the_bytes_on_every_link(star, testbed, tmp_path):
    """An all-real DDP run under torchrun records one rank's operations (--record-ops); replaying
    them with every rank a phantom puts the same bytes on every link (within 1%, control traffic
    aside), and the replay runs on another topology too."""
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology_text

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "examples/train_ddp.py", "--steps", "20", "--model", "mlp", "--hidden", "512"]
    rec = run(star, cmd, echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300,
              record_ops=True)
    assert rec.rc == 0, _log(rec)[-3000:]
    traces = list((rec.run_dir / "probe").glob("ops-*.jsonl"))
    assert len(traces) == 1, traces
    rep = run(star, [], echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300,
              replay=rec.run_dir)
    assert rep.rc == 0, _log(rep)[-3000:]
    assert rep.summary["replay"]["ops"] > 20 and [r["phantom"] for r in rep.summary["ranks"]] == [True] * 4
    _same_bytes_on_every_link(rec, rep, 0.01, 30_000)
    # the same job's traffic on a leaf-spine, without the job
    ls = testbed(load_topology_text("name: ls\ngenerator: leaf-spine\nparams: {leaves: 2, spines: 2, "
                                    "hosts_per_leaf: 2}\n", "<replay>"), time_dilation="none")
    other = run(cluster_from_state(ls["name"]), [], echo=False, base_dir=tmp_path, monitor=False, timeout=300,
                replay=traces[0])
    assert other.rc == 0, _log(other)[-3000:]
    _no_orphans(other)


def test_replay_checks_its_trace(star, tmp_path):
    from testbed.errors import RunError
    from testbed.jobs.run import run

    bad = tmp_path / "ops-0.jsonl"
    bad.write_text('{"ev": "op", "op": "allreduce", "t": 1}\n')
    with pytest.raises(RunError, match="before the init record"):
        run(star, [], replay=bad, base_dir=tmp_path, echo=False)
    bad.write_text('{"ev": "init", "backend": "gloo", "t": 1, "world": 8, "rank": 0}\n')
    with pytest.raises(RunError, match="8-rank job; this run has 4 ranks"):
        run(star, [], replay=bad, base_dir=tmp_path, echo=False)
    with pytest.raises(RunError, match="no recorded operations"):
        run(star, [], replay=tmp_path, base_dir=tmp_path, echo=False)
    with pytest.raises(RunError, match="either a command or --replay"):
        run(star, ["true"], replay=bad, base_dir=tmp_path, echo=False)


def _chakra_traces(d: Path, world: int) -> None:
    """A Chakra execution trace per rank, written with MLCommons' own schema and encoder: compute,
    an all_reduce of 4 MiB, compute, an all_gather of a 1 MiB shard, a broadcast of 256 KiB, a
    send (not replayable), a barrier."""
    from chakra.schema.protobuf import et_def_pb2 as et
    from chakra.src.third_party.utils.protolib import encodeMessage

    def coll(i: int, kind: int, size: int) -> "et.Node":
        n = et.Node(id=i, name=f"coll{i}", type=et.COMM_COLL_NODE, duration_micros=500)
        n.attr.append(et.AttributeProto(name="comm_type", int64_val=kind))
        n.attr.append(et.AttributeProto(name="comm_size", int64_val=size))
        return n

    for rank in range(world):
        with open(d / f"job.{rank}.et", "wb") as f:
            encodeMessage(f, et.GlobalMetadata(version="0.0.4"))
            encodeMessage(f, et.Node(id=1, name="fwd", type=et.COMP_NODE, duration_micros=20_000))
            encodeMessage(f, coll(2, et.ALL_REDUCE, 4 << 20))
            encodeMessage(f, et.Node(id=3, name="bwd", type=et.COMP_NODE, duration_micros=10_000))
            encodeMessage(f, coll(4, et.ALL_GATHER, 1 << 20))
            encodeMessage(f, coll(5, et.BROADCAST, 256 << 10))
            encodeMessage(f, et.Node(id=6, name="send", type=et.COMM_SEND_NODE))
            encodeMessage(f, coll(7, et.BARRIER, 0))


@pytest.mark.slow
def test_a_chakra_trace_replays_like_the_job_that_made_it(star, tmp_path):
    """An MLCommons Chakra execution trace (read with the mlc-chakra package) replayed by four
    phantoms puts on every link what a real 4-rank job issuing the same collectives puts there
    (within 1%, control traffic aside); what cannot be replayed (a send) is reported."""
    requires.need("chakra")
    from testbed.jobs.run import run

    code = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "w = dist.get_world_size()\n"
            "dist.all_reduce(torch.zeros((4 << 20) // 4))\n"
            "dist.all_gather_into_tensor(torch.zeros(w * (1 << 20) // 4), torch.zeros((1 << 20) // 4))\n"
            "dist.broadcast(torch.zeros((256 << 10) // 4), 0)\n"
            "dist.barrier()\n")
    # the trace holds the job's collectives only: the probe's latency burst (12 small all_reduces on
    # every link) is turned off so that the reference carries the job's bytes alone
    real = run(star, [sys.executable, "-c", code], echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False,
               timeout=300, env={"TESTBED_LATENCY_BURST": "0"})
    assert real.rc == 0, _log(real)[-3000:]
    traces = tmp_path / "chakra"
    traces.mkdir()
    _chakra_traces(traces, 4)
    rep = run(star, [], echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=300,
              replay=traces)
    assert rep.rc == 0, _log(rep)[-3000:]
    assert rep.summary["replay"]["format"] == "chakra" and rep.summary["replay"]["skipped"] == {"send/recv": 1}
    assert [r["phantom"] for r in rep.summary["ranks"]] == [True] * 4
    _same_bytes_on_every_link(real, rep, 0.01, 30_000)
    _no_orphans(rep)


def test_a_broken_chakra_trace_is_refused_naming_the_file(star, tmp_path):
    requires.need("chakra")
    from testbed.errors import RunError
    from testbed.jobs.run import run

    (tmp_path / "job.0.et").write_bytes(b"\x05hello")
    (tmp_path / "job.1.et").write_bytes(b"\x05hello")
    with pytest.raises(RunError, match=r"job\.0\.et: not a Chakra trace"):
        run(star, [], echo=False, base_dir=tmp_path, monitor=False, timeout=60, replay=tmp_path)
    only = tmp_path / "one"
    only.mkdir()
    _chakra_traces(only, 1)
    with pytest.raises(RunError, match="one rank's trace"):
        run(star, [], echo=False, base_dir=tmp_path, monitor=False, timeout=60, replay=only)
