"""`testbed run`: start an unmodified training command on the testbed's workers.

Two styles, both for unmodified scripts:
  env       (default) one process per rank, each with the environment torchrun
            gives its workers (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
            LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, ROLE_*, TORCHELASTIC_*).
  torchrun  when CMD starts with `torchrun` (or `python -m torch.distributed.run`):
            one torchrun per worker, with c10d rendezvous on the master worker
            over the emulated network (--nnodes, --nproc-per-node, --rdzv-*
            are added unless CMD already says them).

Groups (testbed.jobs.groups: --group, --service, --job, or a YAML job file as CMD): different
commands on different workers, each group its own torch world; a group that fails is started
again (its `restarts`) once its workers are up, services are stopped when every group is done.

Elastic torchrun (--nnodes=MIN:MAX or --max-restarts > 0): an agent that ends because its node
crashed or went down does not stop the run; it is started again when the node is up (`testbed
node up`, a scenario's `for:`), as a node's supervisor (systemd, a Kubernetes pod, Slurm's
requeue) would, and joins the job's next rendezvous. An agent that fails on a live node fails
the run as before.

Every rank gets TESTBED_JOB_DIR, a folder every worker sees (a checkpoint the ranks share), and
TESTBED_ADDR, its worker's address; both are gone or meaningless after the run.

Every rank's output is streamed with a "[worker:rN]" prefix and kept in
runs/<time>-<testbed>/logs/<worker>.log. Exit status: 0 when every rank
succeeded, else that of the first failure (128+signal for a signal, 124 on
--timeout, 130 on Ctrl-C). After the first failure the others get `grace`
seconds, then SIGTERM, then SIGKILL.

No orphans: every process we start carries TESTBED_RUN_ID=<id> in its
environment (inherited by all its descendants, torchrun's workers included,
which torchrun puts in sessions of their own), and the launcher ends, by PID,
every process that carries it, when the run ends for any reason.

Workers are reached only through the testbed's runtime
(testbed.node_exec.exec_argv: netns containers, docker), for a testbed
brought up by testbed.lifecycle.up.

Probe files: ranks cannot be relied on to see the run directory (a netns
worker has a private /tmp, a docker worker sees only what is mounted), so
they write to <state dir>/runs/<run id>/probe/ (the testbed's state dir,
which both runtimes show inside every worker at the same path); during the
run runs/<time>-<testbed>/probe is a symbolic link to it, and at the end the
launcher moves the files there and removes <state dir>/runs/<run id>.

torchrun mode: torchrun is asked to tee every local rank's output with a
"[rN]:" prefix (N: the global rank), so lines are tagged "[worker:rN]" as in
env mode (lines of torchrun itself stay "[worker:torchrun]"); its own log
files go to <state dir>/runs/<run id>/torchrun/ and are removed at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from testbed import events, safeio
from testbed.errors import RunError
from testbed.jobs import counters, relay, rundir
from testbed.jobs import groups as groups_mod
from testbed.jobs.phantom_ranks import (cap_real_workers, check_real, feed_trace, load_trace, make_phantoms,
                                        read_phantom_stats, real_and_phantom_ranks, uncap)
from testbed.jobs.probe import PROBE_PATH
from testbed.jobs.probe_files import collect_probe, shared_dir
from testbed.jobs.ranks import Rank, exit_status
from testbed.jobs.run_groups import group_ranks
from testbed.jobs.supervise import Supervisor
from testbed.jobs.target import Cluster, select_workers
from testbed.jobs.torchrun import TORCHRUN_PREFIX_TEMPLATE, is_elastic, is_torchrun, torchrun_argv

DEFAULT_GRACE_S = 5.0
LATENCY_BURST = 12         # small all_reduces the probe times after init_process_group (the verdict's alpha)


# -- the run ----------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    rc: int
    run_dir: Path
    summary: dict[str, Any]


def _base_path() -> str:
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    return venv_bin + os.pathsep + path if venv_bin not in path.split(os.pathsep) else path


def run(cluster: Cluster, cmd: Sequence[str], *, workers: str | Sequence[str] | None = None,
        nproc_per_node: int = 1, master: str | None = None, port: int | None = None,
        timeout: float | None = None, env: Mapping[str, str] | None = None, probe: bool = True,
        grace: float = DEFAULT_GRACE_S, base_dir: str | os.PathLike | None = None,
        workdir: str | None = None, echo: Callable[[str], None] | None | bool = True,
        on_start: Callable[[Path, Path], None] | None = None, machine: Any = None,
        monitor: bool = True, emulated_clock: bool = True, stop: threading.Event | None = None,
        real: Sequence[str] | None = None, record_ops: bool = False,
        replay: str | os.PathLike | None = None, this_host_only: bool = False,
        relay_send: Callable[[bytes], None] | None = None,
        relay_listen: Callable[[Callable[[bytes], None]], None] | None = None,
        job: "groups_mod.Job | None" = None) -> RunResult:
    """Run CMD across the cluster; return the exit status and the run directory.

    on_start(run_dir, probe_dir): once the ranks start; probe_dir is where their records are read
    live (the testbed's own folder: RUN/probe is a link a job with a writable run directory can swap);
    machine: the calibrated MachineConstants, recorded for the verdict (testbed.report.verdict);
    monitor: sample CPUs, qdiscs and delay lines while the ranks run (monitor.json);
    emulated_clock: under dilation the probe slows the ranks' clocks by the factor;
    stop: when set (from another thread), the ranks are stopped as on a timeout (exit 143);
    real: the workers whose ranks run CMD; every other rank is a phantom (testbed.jobs.phantom)
    mirroring the lowest real rank's collectives (None: every rank is real);
    record_ops: rank 0 records every operation of its process groups (probe/ops-0.jsonl, as
    phantoms would be told them; gloo jobs); with `real`, the leader always records;
    replay: a recorded run directory (or its ops-N.jsonl): no command runs, every rank is a
    phantom fed that sequence with its recorded gaps (scaled to this testbed's dilation);
    this_host_only: on one host of a testbed over several hosts, start the ranks of this host's
    workers only (the controller starts the others on theirs, with the same master and port);
    relay_send, relay_listen: with `real` there, how the leader's announcements reach the phantoms
    of the other hosts (testbed.jobs.relay): on the leader's host each line goes to relay_send; on
    the others relay_listen(sink) is called once and the sink gets the relayed bytes;
    job: groups and services (testbed.jobs.groups), each its own command on its own workers, each
    group its own torch world, restarted when it fails (up to its `restarts`); a CMD that is one
    YAML file is read as such a job file."""
    req = _checked_request(cluster, cmd, workers=workers, nproc_per_node=nproc_per_node, master=master, port=port,
                           probe=probe, real=real, record_ops=record_ops, replay=replay, this_host_only=this_host_only,
                           relay_send=relay_send, relay_listen=relay_listen, job=job, env=env)
    cmd, job, trace, chosen, here, real = req.cmd, req.job, req.trace, req.chosen, req.here, req.real
    leader_worker, leads_here, master = req.leader_worker, req.leads_here, req.master

    import random

    port = int(port or random.randint(20000, 29999))
    run_id = uuid.uuid4().hex[:12]
    workdir = workdir or os.getcwd()
    rd = rundir.create(cluster.name, base_dir)
    # What the ranks write lives in the testbed's state dir (visible in every worker, same path).
    shared = shared_dir(cluster, run_id)
    # Until the ranks start, whatever fails (or a Ctrl-C) undoes what the run made so far: the
    # exchange folder, the real ranks' CPU cap, the monitor, the logs (the `finally` below).
    sup = mon = mirror = outbound = inbound = old_term = old_int = None
    # A Ctrl-C (or SIGTERM) seen, kept even when the KeyboardInterrupt it raised is lost: a library
    # on this thread can swallow it (pyroute2's reply parsing, in the monitor's start, has a bare
    # `except: pass`), so the run checks this before its ranks start and every second after.
    signalled = threading.Event()
    logs: dict[str, Any] = {}
    feeds: list[str] = []
    checks: list[str] = []
    capped: list[str] = []
    not_kept: list[str] = []   # what could not be written into the run directory at the end
    stop_feed = threading.Event()
    summary: dict[str, Any] = {}
    announced = False                     # summary.json says "running", the "started" event went out
    failed: BaseException | None = None   # what ended the launcher itself, if anything did
    try:
        if threading.current_thread() is threading.main_thread():   # SIGTERM undoes it all, as Ctrl-C does
            def _interrupt(signum, frame):
                signalled.set()
                raise KeyboardInterrupt

            old_term = signal.signal(signal.SIGTERM, _interrupt)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:   # (one started to ignore it does)
                old_int = signal.signal(signal.SIGINT, _interrupt)
        probe_dir = shared / "probe"
        probe_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(shared, 0o755)      # ranks run as root in both runtimes: nobody else needs to write here
        os.chmod(probe_dir, 0o755)
        job_dir = shared / "job"   # the job's own shared folder (a checkpoint every worker sees), gone at the end
        job_dir.mkdir(mode=0o755)
        (rd / "probe").rmdir()
        (rd / "probe").symlink_to(probe_dir)   # live view (progress bars, scenario players)
        probe_path, pythonpath = PROBE_PATH, os.environ.get("PYTHONPATH", "")
        if cluster.runtime == "docker":       # the package is mounted at PKG_TARGET there
            from testbed.runtime.docker import PKG_TARGET

            probe_path, pythonpath = f"{PKG_TARGET}/testbed/jobs/probe", PKG_TARGET
        torchrun = is_torchrun(cmd)
        world = len(chosen) * nproc_per_node
        master_addr = cluster.address[master]
        if echo is True:
            def echo(line: str) -> None:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        elif echo is False:
            echo = None

        # Topology snapshot and counters before.
        topo = cluster.topology
        nodes = list(topo.nodes) if topo is not None else list(chosen)
        if cluster.part is not None:
            nodes = [n for n in nodes if n in cluster.part]
        if topo is not None:
            rundir.write_json(rd / "topology.json", {**topo.to_json(), "hosts": cluster.address})
        before = counters.snapshot(cluster.name, nodes, cluster.netns_of)
        rundir.write_json(rd / "counters-before.json", before)

        # The processes.
        common = {k: v for k, v in os.environ.items() if not k.startswith(("TESTBED_", "TORCHELASTIC_"))
                  and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        common.update({"PATH": _base_path(), "PYTHONUNBUFFERED": "1"})
        common.setdefault("OMP_NUM_THREADS", "1")
        ranks: list[Rank] = []
        gports: dict[str, int] = {}
        if job is not None:
            ranks, gports = group_ranks(cluster, job, port, run_id, shared, probe_dir if probe else None,
                                         probe_path, pythonpath, env or {}, emulated_clock, str(rd))
            world = sum(1 for r in ranks if r.local_rank is not None) + sum(
                int(r.env["LOCAL_WORLD_SIZE"]) for r in ranks if r.local_rank is None)
        for node_rank, w in enumerate(chosen if job is None else []):
            wenv = {
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(len(chosen)),
                "LOCAL_WORLD_SIZE": str(nproc_per_node),
                # NCCL/gloo interface, host id and GPUs come with the worker's own environment (runtime)
                "TESTBED_NAME": cluster.name, "TESTBED_WORKER": w, "TESTBED_RUN_ID": run_id,
                "TESTBED_RUN_DIR": str(rd), "TESTBED_TIME_DILATION": repr(float(cluster.time_dilation)),
                "TESTBED_EMULATED_CLOCK": "1" if emulated_clock else "0", "TESTBED_JOB_DIR": str(job_dir),
                "TESTBED_ADDR": cluster.address[w],
            }
            if probe:
                wenv["TESTBED_PROBE_DIR"] = str(probe_dir)
                wenv["PYTHONPATH"] = probe_path + (os.pathsep + pythonpath if pythonpath else "")
                # every rank runs it, or none: phantoms mirror the real ranks' (the leader announces it);
                # not into a recorded trace, which a replay would play back as the job's own
                if replay is None and not record_ops:
                    wenv["TESTBED_LATENCY_BURST"] = str(LATENCY_BURST)
            wenv.update(env or {})
            if torchrun:
                wenv.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", TORCHRUN_PREFIX_TEMPLATE)
                argv = torchrun_argv(cmd, len(chosen), nproc_per_node, f"{master_addr}:{port}", run_id,
                                     is_host=(w == master), log_dir=str(shared / "torchrun" / w))
                ranks.append(Rank(w, node_rank, None, None, f"{w}:torchrun", argv, {**wenv}))
                continue
            for lr in range(nproc_per_node):
                rank = node_rank * nproc_per_node + lr
                renv = {**wenv, "RANK": str(rank), "LOCAL_RANK": str(lr), "ROLE_RANK": str(rank),
                        "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default", "TESTBED_RANK": str(rank),
                        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": "0"}
                ranks.append(Rank(w, node_rank, lr, rank, f"{w}:r{rank}", list(cmd), renv))
        ranks = [r for r in ranks if r.worker in here]   # over several hosts: this host's ranks only
        if real is not None:
            feeds, checks = make_phantoms(ranks, set(real), shared / "phantom", cluster.runtime,
                                           leader_rank=None if torchrun else chosen.index(leader_worker) * nproc_per_node,
                                           leader_here=leads_here, relay_out=leads_here and relay_send is not None)
        elif trace is not None:
            feeds, _ = make_phantoms(ranks, set(), shared / "phantom", cluster.runtime, leader_rank=trace.rank)
        if leads_here or (record_ops and real is None):
            lead = next(r for r in ranks if not r.phantom)   # the lowest real rank, or torchrun's agent there
            lead.env["TESTBED_OPS_TRACE"] = str(probe_dir / f"ops-{'{RANK}' if lead.rank is None else lead.rank}.jsonl")
            if lead.rank is None:
                lead.env["TESTBED_PHANTOM_LEADER_LOCAL_RANK"] = "0"   # one of the agent's ranks records

        for w in here:   # (one by one: a failure closes those already open)
            logs[w] = rundir.open_append(rd / "logs" / f"{w}.log")

        from testbed.topology.dilation import rank_cores

        summary = {
            "testbed": cluster.name, "run_id": run_id, "run_dir": str(rd), "cmd": cmd,
            "launcher": "groups" if job is not None else "torchrun" if torchrun else "env",
            "elastic": is_elastic(cmd), "workers": chosen, "nproc_per_node": nproc_per_node,
            "world_size": world, "master": master, "master_addr": master_addr, "master_port": port,
            "workdir": workdir, "probe": probe, "env": dict(env or {}), "grace_s": grace, "timeout_s": timeout,
            "time_dilation": {"factor": float(cluster.time_dilation), "source": cluster.dilation_source,
                              "setting": cluster.dilation.get("setting"), "reasons": cluster.dilation.get("reasons"),
                              "cap_cpu": bool(cluster.dilation.get("cap_cpu")),
                              "rank_cores": rank_cores(cluster.dilation)},
            "emulated_clock": bool(probe and emulated_clock and cluster.time_dilation > 1),
            "machine": machine.to_json() if machine is not None else None, "gpus": cluster.gpus, "cores": _cores(),
            "started": time.time(),
        }
        if real is not None:
            summary["real_cpu_cap"] = cap_real_workers(cluster, [w for w in real if w in here], nproc_per_node,
                                                        capped, echo)
        rundir.write_json(rd / "summary.json", {**summary, "status": "running"})
        events.emit(cluster.name, "run", f"run {run_id} started: {world} rank(s) on {len(chosen)} worker(s)"
                    + (f", {len(feeds)} phantom(s)" if feeds else "") + f": {shlex.join(cmd)[:200]}",
                    run_id=run_id, run_dir=str(rd))
        announced = True
        steps = rundir.StepReader(probe_dir)
        milestone = [1]
        if on_start is not None:
            on_start(rd, probe_dir)

        if monitor:
            from testbed.jobs.monitor import Monitor

            try:
                from testbed.runtime import cgroups

                groups = cgroups.groups_of(cluster.name) if cluster.runtime == "netns" else None   # Docker's are its own
                mon = Monitor(cluster.netns_of, cluster.delay_lines, _cores(), groups=groups or None).start()
            except Exception as exc:   # evidence missing is reported by the verdict, the run goes on
                if echo is not None:
                    echo(f"[testbed] monitor not started ({exc}); the verdict will lack CPU and link samples")

        def if_signalled() -> None:
            if signalled.is_set():
                raise KeyboardInterrupt

        def every_second() -> None:
            if_signalled()
            milestone[0] = _step_milestones(cluster.name, run_id, steps, milestone[0])

        def on_timeout() -> None:
            summary["stacks"] = save_stacks(rd, cluster.name, run_id, echo)

        sup = Supervisor(cluster, run_id, ranks, common_env=common, workdir=workdir, logs=logs, echo=echo, grace=grace,
                         timeout=timeout, stop=stop, groups=job.groups if job is not None else (),
                         elastic=job is None and real is None and trace is None and is_elastic(cmd),
                         with_phantoms=real is not None,
                         leader_ended=lambda: inbound is not None and inbound.ended.is_set(),
                         every_second=every_second, on_timeout=on_timeout)
        mirror = groups_mod.ProbeMirror(probe_dir, [g.name for g in job.groups]).start() \
            if job is not None and probe else None
        if_signalled()
        try:
            if real is not None and relay_send is not None and relay_listen is not None:
                if leads_here:
                    outbound = relay.Outbound(str(shared / "phantom" / relay.FIFO_NAME), relay_send).start()
                else:
                    inbound = relay.Inbound(feeds + checks)
                    relay_listen(inbound)
            sup.start()
            if trace is not None:
                feeder = threading.Thread(target=feed_trace, args=(trace, feeds, float(cluster.time_dilation or 1.0),
                                                              stop_feed), daemon=True)
                feeder.start()
            sup.watch()
        except KeyboardInterrupt:
            sup.interrupted()
    except BaseException as exc:
        failed = exc
        raise
    finally:
        # the handlers back first: a Ctrl-C during the cleanup below is the caller's, as it was
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)
        if sup is not None:
            sup.reap()
        for f in logs.values() if sup is None else ():
            f.close()
        if mon is not None:
            try:
                rundir.write_json(rd / "monitor.json", mon.stop())
            except Exception as exc:   # like a monitor that did not start: the verdict says what it lacks
                if echo is not None:
                    echo(f"[testbed] monitor samples lost ({exc})")
        stop_feed.set()
        if outbound is not None:
            outbound.stop()
        if inbound is not None:
            inbound.close()
            if inbound.gave_up and echo is not None:
                echo(f"[testbed] phantom relay: {inbound.gave_up}")
        phantom_stats = read_phantom_stats(shared / "phantom") if feeds else None
        if mirror is not None:
            mirror.stop()
        uncap(cluster, capped, echo)
        _into_run_dir(not_kept, "the probe's records", lambda: collect_probe(rd, shared))
        if failed is not None and announced:
            _ended_by(failed, cluster.name, run_id, rd, summary, not_kept)

    rc, reason, first_fail = sup.rc, sup.reason, sup.first_fail
    after = counters.snapshot(cluster.name, nodes, cluster.netns_of)
    _into_run_dir(not_kept, "counters-after.json", lambda: rundir.write_json(rd / "counters-after.json", after))
    ended = time.time()
    if not not_kept:   # the probe files were collected there from the exchange folder (the ranks are gone)
        steps.dir = rd / "probe"
    _step_milestones(cluster.name, run_id, steps, milestone[0])
    events.emit(cluster.name, "run", f"run {run_id} ended: {reason}, exit status {rc}, "
                f"{ended - summary['started']:.1f} s", run_id=run_id, status=reason, rc=rc)
    _into_run_dir(not_kept, "testbed-events.jsonl",
                  lambda: _keep_events(rd, cluster.name, summary["started"], time.time()))
    summary.update({
        "status": reason, "rc": rc, "ended": ended, "duration_s": ended - summary["started"],
        "first_failure": None if first_fail is None else {"label": first_fail.label, "worker": first_fail.worker,
                                                          "rank": first_fail.rank, "rc": exit_status(first_fail.rc)},
        "ranks": [{"label": r.label, "worker": r.worker, "node_rank": r.node_rank, "local_rank": r.local_rank,
                   "rank": r.rank, "pid": r.proc.pid if r.proc else None,
                   "rc": None if r.rc is None else exit_status(r.rc),
                   "duration_s": (r.ended or ended) - r.started if r.started else None,
                   "argv": r.argv if r is ranks[0] or r.group else None, "phantom": r.phantom,
                   "starts": r.starts, **({"group": r.group, "service": r.service} if r.group else {})}
                  for r in ranks],
        "groups": None if job is None else [
            {**g.group.to_json(), "port": gports[g.group.name], "restarts_used": g.group.restarts - g.left,
             "failures": g.failures} for g in sup.groups.values()],
        "leftover_pids": sup.leftovers,
        "replay": None if trace is None else {"source": str(trace.source), "ops": len(trace.lines),
                                               "recorded_dilation": trace.dilation, "format": trace.kind,
                                               "skipped": dict(trace.skipped)},
        "phantoms": None if not feeds and real is None else {
            "real_workers": list(real or []), **real_and_phantom_ranks(ranks, world, phantom_stats),
            **{k: v for k, v in (phantom_stats or {}).items() if k != "ranks"},
            **({"relayed_lines": outbound.lines} if outbound is not None else {}),
            **({"relayed_bytes": inbound.bytes, "relay_gave_up": inbound.gave_up} if inbound is not None else {})},
    })
    if topo is not None:
        summary["links"] = counters.link_bytes(topo, before, after)
    _into_run_dir(not_kept, "summary.json", lambda: rundir.write_json(rd / "summary.json", summary))
    if not_kept:
        summary["not_kept"] = not_kept
        if echo is not None:
            echo(f"[testbed] the run directory {rd} was changed while the job ran; not kept there: "
                 + "; ".join(not_kept))
    return RunResult(rc, rd, summary)


@dataclass
class _Request:
    """A run as asked, checked: the command (or what stands for groups and replays), the workers."""
    cmd: list[str]
    job: "groups_mod.Job | None"
    trace: Any
    chosen: list[str]          # the run's workers, in topology order
    here: list[str]            # those on this host
    real: list[str] | None
    leader_worker: str | None  # with phantoms: the real worker whose lowest rank announces
    leads_here: bool
    master: str


def _checked_request(cluster: Cluster, cmd: Sequence[str], *, workers: Any, nproc_per_node: int, master: str | None,
                     port: int | None, probe: bool, real: Sequence[str] | None, record_ops: bool, replay: Any,
                     this_host_only: bool, relay_send: Any, relay_listen: Any, job: "groups_mod.Job | None",
                     env: Mapping[str, str] | None) -> _Request:
    """run()'s first phase: everything it was asked checked before anything is made (RunError
    naming what cannot be done)."""
    cmd = list(cmd)
    trace = None
    if groups_mod.is_job_file(cmd):
        if job is not None:
            raise RunError("give either a job file or groups, not both")
        job, cmd = groups_mod.load(cmd[0]), []
    if job is not None:
        if cmd:
            raise RunError("a run of groups takes no command of its own: each group names its command")
        if real is not None or replay is not None or record_ops:
            raise RunError("groups run real commands: no --real, --replay or --record-ops with them")
        if cluster.part is not None or this_host_only:
            raise RunError(f"testbed {cluster.name} spans several hosts: groups run on a testbed of one host only "
                           "(they are started and restarted by one launcher)")
        cmd = ["<groups>"]
    if replay is not None:
        if cmd:
            raise RunError("--replay runs no command: give either a command or --replay")
        if real is not None or record_ops:
            raise RunError("--replay plays a recorded run to phantoms only: no --real, no --record-ops")
        trace = load_trace(replay)
        cmd = ["<replay>"]
    if not cmd:
        raise RunError("nothing to run: give a command after --")
    if record_ops and not probe:
        raise RunError("--record-ops needs the probe (it records the operations): drop --no-probe")
    if nproc_per_node < 1:
        raise RunError("--nproc-per-node must be >= 1")
    chosen = select_workers(cluster, workers)
    if job is not None:   # the groups' workers, among those the caller allowed, in topology order
        groups_mod.check_workers(job, chosen)
        groups_mod.check_addresses(job, cluster.address, env or {})
        chosen = [w for w in chosen if w in job.workers]
    if cluster.part is not None and not this_host_only:
        raise RunError(f"testbed {cluster.name} spans several hosts and this host holds part of it: start jobs "
                       "from the controller, where it was brought up (`testbed run` there starts every host's ranks)")
    if this_host_only and (cluster.part is None or port is None):
        raise RunError("--this-host-only is the controller's: one host's ranks of a testbed over several hosts, "
                       "with --port given")
    if this_host_only and real is not None and (relay_send is None or relay_listen is None):
        raise RunError("--real over several hosts needs the controller's relay (--mirror-relay): start the run "
                       "from the controller")
    here = [w for w in chosen if cluster.part is None or w in cluster.part]
    if not here:
        raise RunError(f"none of the run's workers ({', '.join(chosen)}) is on this host")
    if real is not None:
        real = check_real(real, chosen)
        if not probe:
            raise RunError("--real needs the probe (it announces the real rank's collectives): drop --no-probe")
    leader_worker = next((w for w in chosen if w in (real or ())), None)   # its lowest rank leads
    leads_here = leader_worker is not None and leader_worker in here
    master = master or chosen[0]
    if master not in chosen:
        raise RunError(f"master {master!r} is not among the selected workers ({', '.join(chosen)})")
    if trace is not None and trace.world != len(chosen) * nproc_per_node:
        raise RunError(f"{trace.source} is a {trace.world}-rank job; this run has {len(chosen) * nproc_per_node} "
                       "ranks (--workers, --nproc-per-node)")
    return _Request(cmd, job, trace, chosen, here, real, leader_worker, leads_here, master)


def _into_run_dir(not_kept: list[str], what: str, write: Callable[[], None]) -> None:
    """One write into the run directory once the ranks ended. A job with a writable run directory
    may have replaced it (or runs/) with a link, which every write refuses (safeio.Unsafe): the run
    still ends as it should (its events, the exchange folder removed) and says what it did not keep."""
    try:
        write()
    except (OSError, safeio.Unsafe) as exc:
        not_kept.append(f"{what} ({exc})")


def _ended_by(exc: BaseException, name: str, run_id: str, rd: Path, summary: dict[str, Any],
             not_kept: list[str]) -> None:
    """A run said "started" (summary.json "running", its event), then the launcher itself was
    interrupted before its ranks ran (Ctrl-C, SIGTERM) or failed (an error of ours or of the
    machine's): the run ends as such, not "running" forever (`testbed top` follows the newest
    running run)."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    reason, rc = ("interrupted", 130) if interrupted else ("error", 1)
    error = None if interrupted else f"{type(exc).__name__}: {str(exc)[:300]}"
    ended = time.time()
    events.emit(name, "run", f"run {run_id} ended: {reason}" + (f" ({error})" if error else "")
                + f", exit status {rc}, {ended - summary['started']:.1f} s", run_id=run_id, status=reason, rc=rc)
    _into_run_dir(not_kept, "testbed-events.jsonl", lambda: _keep_events(rd, name, summary["started"], time.time()))
    done = {**summary, "status": reason, "rc": rc, "ended": ended, "duration_s": ended - summary["started"],
            "error": error, "not_kept": not_kept}
    _into_run_dir(not_kept, "summary.json", lambda: rundir.write_json(rd / "summary.json", done))


def _keep_events(rd: Path, name: str, t0: float, t1: float) -> None:
    """The testbed's events of the run's time span (faults, captures, scenario steps), into the run
    directory: the report lists them, also once the testbed is down."""
    kept = [e for e in events.read(name) if t0 - 1 <= e["t"] <= t1]
    rundir.write_bytes(rd / "testbed-events.jsonl", "".join(json.dumps(e) + "\n" for e in kept).encode())


def _step_milestones(name: str, run_id: str, steps: rundir.StepReader, milestone: int) -> int:
    """Tell the event stream of steps 1, 10, 100, 1,000 and every 1,000th after, once each, as the
    probe records them; returns the next milestone."""
    steps.poll()
    while steps.max_rank_steps >= milestone:
        events.emit(name, "run", f"run {run_id}: step {milestone}", run_id=run_id, step=milestone)
        milestone = milestone * 10 if milestone < 1000 else milestone + 1000
    return milestone


def save_stacks(rd: Path, name: str, run_id: str, echo: Callable[[str], None] | None) -> str | None:
    """Every rank's stack into the run directory (a hung or timed-out job); its path, or None."""
    from testbed.jobs import stacks

    path = stacks.save(rd, name, run_id)
    if echo is not None:
        echo(f"[testbed] stacks of the ranks: {path}" if path else "[testbed] no rank stack taken")
    return str(path) if path else None


def _cores() -> int:
    from testbed.lifecycle import cores

    return cores()


def format_cmd(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
