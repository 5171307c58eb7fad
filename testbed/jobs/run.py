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
(testbed.lifecycle.exec_argv: netns containers, docker), for a testbed
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
import re
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from testbed import events, procs, safeio, terminal
from testbed.errors import TestbedError
from testbed.jobs import counters, relay, rundir
from testbed.jobs import groups as groups_mod
from testbed.jobs.probe import PROBE_PATH

DEFAULT_GRACE_S = 5.0
PHANTOM_GRACE_S = 10.0     # after the real ranks ended: time for the phantoms to read "end" and leave
LATENCY_BURST = 12         # small all_reduces the probe times after init_process_group (the verdict's alpha)
PROBE_FILE = re.compile(r"(rank-[A-Za-z0-9_]{1,32}|ops-[0-9]{1,6})\.jsonl")   # ranks' records, ops (fullmatch)
PROBE_FILE_MAX_BYTES = 512 << 20
LINE_MAX = 1 << 16         # a rank's output line longer than this is cut
KILL_AFTER_S = 2.0
# torchrun --tee: every line of a local rank starts with this (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)
TORCHRUN_PREFIX_TEMPLATE = "[r${rank}]:"
_TORCHRUN_PREFIX = re.compile(r"^\[r(\d+)\]:")


class RunError(TestbedError):
    exit_code = 2


# -- how commands reach workers ---------------------------------------------------------------------------

class Executor:
    """Host argv that runs argv inside a worker."""

    def argv(self, worker: str, argv: Sequence[str], env: Mapping[str, str], workdir: str) -> list[str]:
        raise NotImplementedError


class RuntimeExecutor(Executor):
    """Through the testbed's runtime (netns containers, docker): testbed.lifecycle.exec_argv.

    `records` are the workers' runtime records (state runtime.workers); a caller may replace them."""

    def __init__(self, st: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]] | None = None):
        self.state = dict(st)
        self.records = dict(records if records is not None else (st.get("runtime") or {}).get("workers") or {})

    def argv(self, worker, argv, env, workdir):
        from testbed import lifecycle

        rt = dict(self.state.get("runtime") or {})
        rt["workers"] = self.records
        return lifecycle.exec_argv({**self.state, "runtime": rt}, worker, list(argv), env=dict(env),
                                   workdir=workdir)


# -- the cluster a run targets --------------------------------------------------------------------------------

@dataclass
class Cluster:
    name: str
    workers: list[str]                 # in topology order
    address: dict[str, str]            # worker -> primary IPv4
    ifname: dict[str, str]             # worker -> its emulated interface (gloo/NCCL bind there)
    executor: Executor
    topology: Any = None               # testbed.topology.model.Topology, for counters and reports
    netns_of: dict[str, str] = field(default_factory=dict)   # node -> netns (counters); default tb-NAME-NODE
    time_dilation: float = 1.0
    dilation_source: str = "none"
    dilation: dict[str, Any] = field(default_factory=dict)   # the state's choice: setting, reasons
    delay_lines: list[dict[str, Any]] = field(default_factory=list)   # the state's delay-line records
    gpus: int = 0                      # GPUs handed to workers (what ranks time-share; 0: CPU cores)
    runtime: str = "netns"             # the testbed's runtime kind
    state_dir: Path | None = None      # the testbed's state dir: visible inside every worker, same path
    part: frozenset[str] | None = None   # over several hosts: the nodes this host holds (cluster.part)


def cluster_from_state(name: str) -> Cluster:
    """The cluster of a running testbed (brought up by testbed.lifecycle), from its state file."""
    from testbed import lifecycle, paths
    from testbed import names
    from testbed.topology.plan import plan_network

    data = lifecycle.load(name)
    topo_json = data.get("topology")
    if not topo_json:
        raise RunError(f"state of testbed {name!r} has no topology snapshot")
    topo = lifecycle.effective_topology(data)   # what the links run at now (`link set` recorded)
    kind = data["runtime"]["kind"]
    records = data["runtime"]["workers"]
    plan = plan_network(topo)
    ifn = {}
    for w in topo.workers:
        ports = [p for p in plan.ports(w) if p.address]
        ifn[w] = ports[0].ifname if ports else "eth0"
    s = float(data.get("time_dilation") or 1.0)
    cl = Cluster(name=name, workers=list(topo.workers), address=plan.hosts(), ifname=ifn,
                 executor=RuntimeExecutor(data, records), topology=topo,
                 netns_of={n: names.netns(name, n) for n in topo.nodes}, time_dilation=s,
                 dilation_source="state" if s != 1.0 else "none", dilation=dict(data.get("dilation") or {}),
                 delay_lines=list((data.get("resources") or {}).get("delay_lines") or []),
                 gpus=len({u for us in ((data.get("gpu") or {}).get("assignment") or {}).values() for u in us}),
                 runtime=kind, state_dir=paths.directory(name))
    for w, rec in records.items():
        if rec.get("netns"):
            cl.netns_of[w] = rec["netns"]
    part = (data.get("part") or {}).get("nodes")
    if part is not None:   # counters and the monitor read only this host's namespaces
        cl.part = frozenset(part)
        cl.netns_of = {n: ns for n, ns in cl.netns_of.items() if n in cl.part}
    return cl


# -- the run ----------------------------------------------------------------------------------------------

@dataclass
class Rank:
    worker: str
    node_rank: int
    local_rank: int | None       # None: a torchrun agent (ranks inside it are torchrun's)
    rank: int | None
    label: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    rc: int | None = None
    started: float = 0.0
    ended: float | None = None
    phantom: bool = False        # testbed run --real: a rank that mirrors a real one (jobs/phantom.py)
    group: str | None = None     # a run of groups: the group or service this rank belongs to
    service: bool = False
    starts: int = 1              # a group started again after a failure: how many times it started


@dataclass
class RunResult:
    rc: int
    run_dir: Path
    summary: dict[str, Any]


def is_torchrun(cmd: Sequence[str]) -> bool:
    if not cmd:
        return False
    if os.path.basename(cmd[0]) == "torchrun":
        return True
    return len(cmd) >= 3 and os.path.basename(cmd[0]).startswith("python") and cmd[1] == "-m" \
        and cmd[2] == "torch.distributed.run"


def _has_opt(cmd: Sequence[str], *opts: str) -> bool:
    for a in cmd:
        for o in opts:
            if a == o or a.startswith(o + "="):
                return True
    return False


def torchrun_argv(cmd: Sequence[str], nnodes: int, nproc: int, endpoint: str, run_id: str,
                  is_host: bool | None = None, log_dir: str | None = None) -> list[str]:
    """CMD with the rendezvous options added (before the script) unless already there.

    is_host tells torchrun which worker hosts the rendezvous store: its own guess
    compares hostnames and addresses, which fails in namespaces that share the
    host's hostname."""
    cmd = list(cmd)
    head = 3 if cmd[0] != "torchrun" and not cmd[0].endswith("/torchrun") else 1
    extra = []
    if not _has_opt(cmd, "--nnodes"):
        extra.append(f"--nnodes={nnodes}")
    if not _has_opt(cmd, "--nproc-per-node", "--nproc_per_node"):
        extra.append(f"--nproc-per-node={nproc}")
    if not _has_opt(cmd, "--rdzv-backend", "--rdzv_backend"):
        extra.append("--rdzv-backend=c10d")
    if not _has_opt(cmd, "--rdzv-endpoint", "--rdzv_endpoint"):
        extra.append(f"--rdzv-endpoint={endpoint}")
    if not _has_opt(cmd, "--rdzv-id", "--rdzv_id"):
        extra.append(f"--rdzv-id={run_id}")
    if not _has_opt(cmd, "--max-restarts", "--max_restarts"):
        extra.append("--max-restarts=0")
    if is_host is not None and not _has_opt(cmd, "--rdzv-conf", "--rdzv_conf"):
        extra.append(f"--rdzv-conf=is_host={1 if is_host else 0}")
    elif is_host is not None:   # the user's rendezvous settings (e.g. last_call_timeout), and ours
        for i, a in enumerate(cmd[:]):
            name, eq, val = a.partition("=")
            if name in ("--rdzv-conf", "--rdzv_conf") and "is_host=" not in a:
                cmd[i] = f"{a},is_host={1 if is_host else 0}" if eq else a
                if not eq and i + 1 < len(cmd) and "is_host=" not in cmd[i + 1]:
                    cmd[i + 1] = f"{cmd[i + 1]},is_host={1 if is_host else 0}"
                break
    if log_dir is not None and not _has_opt(cmd, "--tee", "--redirects"):
        # per-rank output, prefixed "[rN]:" (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE in the env)
        extra.append("--tee=3")
        if not _has_opt(cmd, "--log-dir", "--log_dir"):
            extra.append(f"--log-dir={log_dir}")
    return cmd[:head] + extra + cmd[head:]


def _opt_value(cmd: Sequence[str], *opts: str) -> str | None:
    """The value of a launcher option (`--opt=V` or `--opt V`) among the words before the script."""
    for i, a in enumerate(cmd):
        for o in opts:
            if a.startswith(o + "="):
                return a.split("=", 1)[1]
            if a == o and i + 1 < len(cmd):
                return cmd[i + 1]
    return None


def is_elastic(cmd: Sequence[str]) -> bool:
    """An elastic torchrun: --nnodes=MIN:MAX with MIN < MAX, or --max-restarts above 0. Its agents
    re-form the job without a lost node and take it back when it returns (testbed run starts the
    agent of a node that crashed again once the node is up)."""
    if not is_torchrun(cmd):
        return False
    nnodes = _opt_value(cmd, "--nnodes") or ""
    lo, sep, hi = nnodes.partition(":")
    if sep and lo.isdigit() and hi.isdigit() and int(lo) < int(hi):
        return True
    restarts = _opt_value(cmd, "--max-restarts", "--max_restarts") or "0"
    return restarts.isdigit() and int(restarts) > 0


def select_workers(cluster: Cluster, spec: str | Sequence[str] | None) -> list[str]:
    if spec is None or spec == "all" or spec == ["all"]:
        return list(cluster.workers)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    items = [s.strip() for s in items if s.strip()]
    unknown = [w for w in items if w not in cluster.workers]
    if unknown:
        raise RunError(f"unknown worker(s) {', '.join(unknown)}; workers: {', '.join(cluster.workers)}")
    if len(set(items)) != len(items):
        raise RunError(f"a worker is named twice in --workers {','.join(items)}")
    return items


def _base_path() -> str:
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    return venv_bin + os.pathsep + path if venv_bin not in path.split(os.pathsep) else path


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _tagged_pids(run_id: str) -> list[int]:
    """Every process (host view) but this one whose environment carries our run id."""
    return procs.pids_with_env("TESTBED_RUN_ID", run_id, include_self=False)


def _signal_all(ranks: Sequence[Rank], run_id: str, sig: int) -> None:
    _signal(ranks, _tagged_pids(run_id), sig)


def _signal(ranks: Sequence[Rank], tagged: Sequence[int], sig: int) -> None:
    """The ranks' process groups, then every process that carries our tag (torchrun's workers live
    in sessions of their own)."""
    for r in ranks:
        if r.proc is not None and r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    for pid in tagged:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


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
    import random

    port = int(port or random.randint(20000, 29999))
    run_id = uuid.uuid4().hex[:12]
    workdir = workdir or os.getcwd()
    rd = rundir.create(cluster.name, base_dir)
    # What the ranks write lives in the testbed's state dir (visible in every worker, same path).
    shared = _shared_dir(cluster, run_id)
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
        ranks, gports = _group_ranks(cluster, job, port, run_id, shared, probe_dir if probe else None,
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
    feeds: list[str] = []
    checks: list[str] = []
    outbound = inbound = None
    if real is not None:
        feeds, checks = _make_phantoms(ranks, set(real), shared / "phantom", cluster.runtime,
                                       leader_rank=None if torchrun else chosen.index(leader_worker) * nproc_per_node,
                                       leader_here=leads_here, relay_out=leads_here and relay_send is not None)
    elif trace is not None:
        if trace.world != world:
            raise RunError(f"{trace.source} is a {trace.world}-rank job; this run has {world} ranks "
                           f"(--workers, --nproc-per-node)")
        feeds, _ = _make_phantoms(ranks, set(), shared / "phantom", cluster.runtime, leader_rank=trace.rank)
    if leads_here or (record_ops and real is None):
        lead = next(r for r in ranks if not r.phantom)   # the lowest real rank, or torchrun's agent there
        lead.env["TESTBED_OPS_TRACE"] = str(probe_dir / f"ops-{'{RANK}' if lead.rank is None else lead.rank}.jsonl")
        if lead.rank is None:
            lead.env["TESTBED_PHANTOM_LEADER_LOCAL_RANK"] = "0"   # one of the agent's ranks records

    logs: dict[str, Any] = {w: rundir.open_append(rd / "logs" / f"{w}.log") for w in here}
    log_lock = threading.Lock()
    readers: list[threading.Thread] = []

    def pump(r: Rank, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        label = r.label
        # a line waiting for its newline is bounded (LINE_MAX); what a rank prints is shown inert
        for raw in safeio.lines_of_fd(proc.stdout.fileno(), LINE_MAX):
            line = terminal.inert(raw.decode(errors="replace"))
            if r.local_rank is None:   # torchrun: "[rN]:line" is rank N's
                m = _TORCHRUN_PREFIX.match(line)
                label = (f"{r.worker}:{(r.group + '.') if r.group else ''}{'p' if r.phantom else 'r'}{m.group(1)}"
                         if m else r.label)
                if m:
                    line = line[m.end():]
            with log_lock:
                logs[r.worker].write(f"[{label.split(':', 1)[1]}] {line}\n")
                if echo is not None:
                    echo(f"[{label}] {line}")
        proc.stdout.close()

    from testbed.topology.dilation import rank_cores

    summary: dict[str, Any] = {
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
    capped: list[str] = []
    if real is not None:
        summary["real_cpu_cap"] = _cap_real_workers(cluster, [w for w in real if w in here], nproc_per_node,
                                                    capped, echo)
    rundir.write_json(rd / "summary.json", {**summary, "status": "running"})
    events.emit(cluster.name, "run", f"run {run_id} started: {world} rank(s) on {len(chosen)} worker(s)"
                + (f", {len(feeds)} phantom(s)" if feeds else "") + f": {shlex.join(cmd)[:200]}",
                run_id=run_id, run_dir=str(rd))
    steps = rundir.StepReader(probe_dir)
    next_poll, milestone = 0.0, 1
    not_kept: list[str] = []   # what could not be written into the run directory at the end
    if on_start is not None:
        on_start(rd, probe_dir)

    stop_feed = threading.Event()
    first_fail: Rank | None = None
    reason = "completed"
    rc = 0
    stop_at: float | None = None
    killed_at: float | None = None
    t_start = time.monotonic()
    mon = None
    if monitor:
        from testbed.jobs.monitor import Monitor

        try:
            from testbed.runtime import cgroups

            groups = cgroups.groups_of(cluster.name) if cluster.runtime == "netns" else None   # Docker's are its own
            mon = Monitor(cluster.netns_of, cluster.delay_lines, _cores(), groups=groups or None).start()
        except Exception as exc:   # evidence missing is reported by the verdict, the run goes on
            if echo is not None:
                echo(f"[testbed] monitor not started ({exc}); the verdict will lack CPU and link samples")
    def spawn(r: Rank) -> None:
        full_env = {**common, **r.env}
        argv = cluster.executor.argv(r.worker, r.argv, r.env, workdir)
        r.started, r.rc, r.ended = time.time(), None, None
        r.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=pump, args=(r, r.proc), daemon=True)
        t.start()
        readers.append(t)

    gstate = {g.name: _GroupState(g, g.restarts) for g in job.groups} if job is not None else {}
    elastic = job is None and real is None and trace is None and is_elastic(cmd)
    lost: dict[str, list[Any]] = {}   # elastic agents that ended: label -> [rank, decide by, lost with its node]
    next_lost_check = 0.0

    def _group_failed(gs: _GroupState, r: Rank, now: float) -> None:
        """A rank of a group that may restart failed: its other ranks are ended, then it starts again."""
        code = _exit_status(r.rc)
        gs.state, gs.since, gs.killed = "stopping", now, False
        gs.failures.append({"label": r.label, "rc": code, "t": time.time()})
        n = gs.group.restarts - gs.left + 1
        msg = f"group {gs.group.name}: {r.label} exited with status {code}; restart {n} of {gs.group.restarts}"
        events.emit(cluster.name, "run", f"run {run_id}: {msg}", run_id=run_id, group=gs.group.name, rc=code)
        if echo is not None:
            echo(f"[testbed] {msg} once its workers are up")
        _signal_group([x for x in ranks if x.group == gs.group.name], f"{run_id}.{gs.group.name}", signal.SIGTERM)

    def _tend_groups(now: float, may_start: bool) -> int:
        """Move failed groups on: ended -> waiting for their workers -> started again. Returns how many
        groups are between two lives (the run is not over while one is)."""
        between = 0
        for gs in gstate.values():
            mine = [x for x in ranks if x.group == gs.group.name]
            tag = f"{run_id}.{gs.group.name}"
            if gs.state == "stopping":
                if all(x.proc is None or x.proc.poll() is not None for x in mine) \
                        and not procs.pids_with_env("TESTBED_GROUP_RUN", tag, include_self=False):
                    gs.state, gs.restart_at = "waiting", now + RESTART_DELAY_S
                elif now - gs.since > KILL_AFTER_S and not gs.killed:
                    _signal_group(mine, tag, signal.SIGKILL)
                    gs.killed = True
            if gs.state == "waiting" and may_start and now >= gs.restart_at:
                down = _workers_down(cluster, gs.group.workers)
                if down:
                    gs.restart_at = now + 0.5   # a crashed node: started again by `node up` (or a scenario)
                else:
                    _fresh_records(cluster)
                    gs.left -= 1
                    gs.state = "running"
                    for x in mine:
                        if x.proc is not None and x.rc is None:
                            x.rc = x.proc.poll()
                        x.starts += 1
                        x.env["TORCHELASTIC_RESTART_COUNT"] = str(x.starts - 1)
                        x.env["TESTBED_GROUP_RESTART"] = str(x.starts - 1)
                        spawn(x)
                    if echo is not None:
                        echo(f"[testbed] group {gs.group.name} started again on {', '.join(gs.group.workers)}")
            if gs.state != "running":
                between += 1
        return between

    mirror = groups_mod.ProbeMirror(probe_dir, [g.name for g in job.groups]).start() \
        if job is not None and probe else None
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def _term(signum, frame):
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, _term)
    try:
        try:
            if real is not None and relay_send is not None and relay_listen is not None:
                if leads_here:
                    outbound = relay.Outbound(str(shared / "phantom" / relay.FIFO_NAME), relay_send).start()
                else:
                    inbound = relay.Inbound(feeds + checks)
                    relay_listen(inbound)
            for r in ranks:
                spawn(r)
            if trace is not None:
                feeder = threading.Thread(target=_feed, args=(trace, feeds, float(cluster.time_dilation or 1.0),
                                                              stop_feed), daemon=True)
                feeder.start()
            while True:
                now = time.monotonic()
                alive = 0
                for r in ranks:
                    if r.rc is None and r.proc is not None:
                        code = r.proc.poll()
                        if code is None:
                            alive += 1
                            continue
                        r.rc, r.ended = code, time.time()
                        gs = gstate.get(r.group or "")
                        if gs is not None and gs.state != "running":
                            continue   # a group being ended for its restart: its ranks' statuses are ours
                        if code != 0 and gs is not None and gs.left > 0 and stop_at is None:
                            _group_failed(gs, r, now)
                            continue
                        if code != 0 and elastic and r.local_rank is None and stop_at is None:
                            # an elastic agent: lost with its node (crashed, down), or failed? the
                            # state says, within a moment (node crash records the crash after its kills)
                            lost[r.label] = [r, now + LOST_DECIDE_S, False]
                            continue
                        if code != 0 and first_fail is None and stop_at is None:
                            first_fail = r
                            rc = _exit_status(code)
                            reason = "rank failed"
                            stop_at = now + grace
                            if echo is not None:
                                echo(f"[testbed] {r.label} exited with status {rc}; stopping the others "
                                     f"in {grace:g}s")
                if lost and stop_at is None and now >= next_lost_check:
                    next_lost_check = now + 0.2
                    for label, entry in list(lost.items()):
                        r, decide_by, with_node = entry
                        down = bool(_workers_down(cluster, [r.worker]))
                        if down and not with_node:
                            entry[2] = with_node = True
                            msg = (f"{r.label} (the torchrun agent) was lost with its node; it is started again "
                                   f"when {r.worker} is up (testbed node up {r.worker})")
                            events.emit(cluster.name, "run", f"run {run_id}: {msg}", run_id=run_id, worker=r.worker)
                            if echo is not None:
                                echo(f"[testbed] {msg}")
                        if with_node and not down:
                            del lost[label]
                            _fresh_records(cluster)
                            r.starts += 1
                            spawn(r)
                            events.emit(cluster.name, "run", f"run {run_id}: {r.label} started again on "
                                        f"{r.worker}", run_id=run_id, worker=r.worker)
                            if echo is not None:
                                echo(f"[testbed] {r.label} started again: it joins the job's next rendezvous")
                        elif not with_node and now >= decide_by:   # its node is up: the agent itself failed
                            del lost[label]
                            if first_fail is None:
                                first_fail, rc, reason = r, _exit_status(r.rc), "rank failed"
                                stop_at = now + grace
                                if echo is not None:
                                    echo(f"[testbed] {r.label} exited with status {rc}; stopping the others "
                                         f"in {grace:g}s")
                if stop_at is None:
                    alive += len(lost)
                if gstate:
                    alive += _tend_groups(now, stop_at is None)
                    if stop_at is None and all(r.rc is not None for r in ranks if not r.service) \
                            and all(g.state == "running" for g in gstate.values()):
                        # every group is done: the services (a lighthouse) have nothing left to serve
                        reason, stop_at = ("completed" if rc == 0 else reason), now
                if alive == 0:
                    break
                if real is not None and stop_at is None and (
                        all(r.rc is not None for r in ranks if not r.phantom) if any(not r.phantom for r in ranks)
                        else inbound is not None and inbound.ended.is_set()):
                    # the real ranks are done (on a host of phantoms only: the leader said its end):
                    # a phantom has nothing left to mirror
                    reason, stop_at = ("completed" if rc == 0 else reason), now + PHANTOM_GRACE_S
                if now >= next_poll:
                    next_poll = now + 1.0
                    milestone = _step_milestones(cluster.name, run_id, steps, milestone)
                if timeout is not None and stop_at is None and now - t_start > timeout:
                    reason, rc, stop_at = "timeout", 124, now
                    if echo is not None:
                        echo(f"[testbed] timeout after {timeout:g}s: taking every rank's stack, then stopping "
                             "all ranks")
                    summary["stacks"] = _save_stacks(rd, cluster.name, run_id, echo)
                if stop is not None and stop_at is None and stop.is_set():
                    reason, rc, stop_at = "stopped", 143, now
                    if echo is not None:
                        echo("[testbed] asked to stop: stopping all ranks")
                if stop_at is not None and now >= stop_at:
                    if killed_at is None:
                        _signal_all(ranks, run_id, signal.SIGTERM)
                        killed_at = now
                    elif now - killed_at > KILL_AFTER_S:
                        _signal_all(ranks, run_id, signal.SIGKILL)
                time.sleep(0.05)
        except KeyboardInterrupt:
            reason, rc = "interrupted", 130
            if echo is not None:
                echo("[testbed] interrupted: stopping all ranks")
            _signal_all(ranks, run_id, signal.SIGTERM)
            deadline = time.monotonic() + KILL_AFTER_S
            while time.monotonic() < deadline and any(r.proc and r.proc.poll() is None for r in ranks):
                time.sleep(0.05)
    finally:
        # No orphans: whatever still carries our run id goes, by PID.
        leftovers = _tagged_pids(run_id)
        if leftovers:
            _signal_all(ranks, run_id, signal.SIGKILL)
        for r in ranks:
            if r.proc is not None:
                try:
                    r.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                if r.rc is None:
                    r.rc, r.ended = r.proc.returncode, time.time()
        deadline = time.monotonic() + 5
        while _tagged_pids(run_id) and time.monotonic() < deadline:
            _signal_all([], run_id, signal.SIGKILL)
            time.sleep(0.05)
        for t in readers:
            t.join(2)
        for f in logs.values():
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
        phantom_stats = _phantom_stats(shared / "phantom") if feeds else None
        if mirror is not None:
            mirror.stop()
        _uncap(cluster, capped, echo)
        _into_run_dir(not_kept, "the probe's records", lambda: _collect_probe(rd, shared))
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    after = counters.snapshot(cluster.name, nodes, cluster.netns_of)
    _into_run_dir(not_kept, "counters-after.json", lambda: rundir.write_json(rd / "counters-after.json", after))
    ended = time.time()
    if not not_kept:   # the probe files were collected there from the exchange folder (the ranks are gone)
        steps.dir = rd / "probe"
    _step_milestones(cluster.name, run_id, steps, milestone)
    events.emit(cluster.name, "run", f"run {run_id} ended: {reason}, exit status {rc}, "
                f"{ended - summary['started']:.1f} s", run_id=run_id, status=reason, rc=rc)
    _into_run_dir(not_kept, "testbed-events.jsonl",
                  lambda: _keep_events(rd, cluster.name, summary["started"], time.time()))
    summary.update({
        "status": reason, "rc": rc, "ended": ended, "duration_s": ended - summary["started"],
        "first_failure": None if first_fail is None else {"label": first_fail.label, "worker": first_fail.worker,
                                                          "rank": first_fail.rank, "rc": _exit_status(first_fail.rc)},
        "ranks": [{"label": r.label, "worker": r.worker, "node_rank": r.node_rank, "local_rank": r.local_rank,
                   "rank": r.rank, "pid": r.proc.pid if r.proc else None,
                   "rc": None if r.rc is None else _exit_status(r.rc),
                   "duration_s": (r.ended or ended) - r.started if r.started else None,
                   "argv": r.argv if r is ranks[0] or r.group else None, "phantom": r.phantom,
                   "starts": r.starts, **({"group": r.group, "service": r.service} if r.group else {})}
                  for r in ranks],
        "groups": None if job is None else [
            {**g.group.to_json(), "port": gports[g.group.name], "restarts_used": g.group.restarts - g.left,
             "failures": g.failures} for g in gstate.values()],
        "leftover_pids": leftovers,
        "replay": None if trace is None else {"source": str(trace.source), "ops": len(trace.lines),
                                               "recorded_dilation": trace.dilation, "format": trace.kind,
                                               "skipped": dict(trace.skipped)},
        "phantoms": None if not feeds and real is None else {
            "real_workers": list(real or []), **_real_and_phantom_ranks(ranks, world, phantom_stats),
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


def _into_run_dir(not_kept: list[str], what: str, write: Callable[[], None]) -> None:
    """One write into the run directory once the ranks ended. A job with a writable run directory
    may have replaced it (or runs/) with a link, which every write refuses (safeio.Unsafe): the run
    still ends as it should (its events, the exchange folder removed) and says what it did not keep."""
    try:
        write()
    except (OSError, safeio.Unsafe) as exc:
        not_kept.append(f"{what} ({exc})")


def _group_ranks(cluster: Cluster, job: "groups_mod.Job", port: int, run_id: str, shared: Path,
                 probe_dir: Path | None, probe_path: str, pythonpath: str, env: Mapping[str, str],
                 emulated_clock: bool, run_dir: str) -> tuple[list[Rank], dict[str, int]]:
    """The ranks of a run of groups (testbed.jobs.groups): each group a torch world of its own (its
    first worker the master, its own port: `port` + its place in the job), each rank told its
    worker's address and every group's; `{addr:NAME}` expanded in commands and env values. With
    the probe, a group's ranks write into <probe>/<group>/ (the launcher mirrors it flat)."""
    addrs = groups_mod.addresses(job, cluster.address)
    named = groups_mod.env_names(job, addrs)
    extra = {k: groups_mod.expand(v, addrs, where=f"env {k}") for k, v in [*job.env, *env.items()]}
    trained = [g for g in job.groups if not g.service]
    ranks: list[Rank] = []
    ports: dict[str, int] = {}
    for gi, g in enumerate(job.groups):
        gport = port + gi
        ports[g.name] = gport
        cmd = [groups_mod.expand(c, addrs, where=f"{g.kind} {g.name}") for c in g.cmd]
        nproc = g.nproc_per_node
        gworld = len(g.workers) * nproc
        master_addr = cluster.address[g.workers[0]]
        for node_rank, w in enumerate(g.workers):
            wenv = {
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(gport), "WORLD_SIZE": str(gworld),
                "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(len(g.workers)),
                "LOCAL_WORLD_SIZE": str(nproc),
                "TESTBED_NAME": cluster.name, "TESTBED_WORKER": w, "TESTBED_RUN_ID": run_id, "TESTBED_RUN_DIR": run_dir,
                "TESTBED_TIME_DILATION": repr(float(cluster.time_dilation)),
                "TESTBED_EMULATED_CLOCK": "1" if emulated_clock else "0",
                "TESTBED_GROUP": g.name, "TESTBED_GROUP_KIND": g.kind,
                "TESTBED_GROUP_INDEX": str(trained.index(g)) if not g.service else "",
                "TESTBED_GROUPS": str(len(trained)), "TESTBED_GROUP_RUN": f"{run_id}.{g.name}",
                "TESTBED_ADDR": cluster.address[w], "TESTBED_JOB_DIR": str(shared / "job"), **named,
            }
            if probe_dir is not None:   # (no latency burst: each group is its own world, restarted alone)
                wenv["TESTBED_PROBE_DIR"] = str(probe_dir / g.name)
                wenv["PYTHONPATH"] = probe_path + (os.pathsep + pythonpath if pythonpath else "")
            wenv.update(extra)
            if is_torchrun(cmd):
                wenv.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", TORCHRUN_PREFIX_TEMPLATE)
                argv = torchrun_argv(cmd, len(g.workers), nproc, f"{master_addr}:{gport}", f"{run_id}-{g.name}",
                                     is_host=(w == g.workers[0]), log_dir=str(shared / "torchrun" / f"{g.name}-{w}"))
                ranks.append(Rank(w, node_rank, None, None, f"{w}:{g.name}.torchrun", argv, wenv, group=g.name,
                                  service=g.service))
                continue
            for lr in range(nproc):
                rank = node_rank * nproc + lr
                label = f"{w}:{g.name}" if g.service and gworld == 1 else f"{w}:{g.name}.r{rank}"
                renv = {**wenv, "RANK": str(rank), "LOCAL_RANK": str(lr), "ROLE_RANK": str(rank),
                        "ROLE_WORLD_SIZE": str(gworld), "ROLE_NAME": g.name, "TESTBED_RANK": f"{g.name}_{rank}",
                        "TORCHELASTIC_RUN_ID": f"{run_id}-{g.name}", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": str(g.restarts)}
                ranks.append(Rank(w, node_rank, lr, rank, label, list(cmd), renv, group=g.name, service=g.service))
    return ranks, ports


@dataclass
class _GroupState:
    group: "groups_mod.Group"
    left: int                          # restarts left
    state: str = "running"             # running | stopping (its ranks being ended) | waiting (to start again)
    since: float = 0.0
    restart_at: float = 0.0
    killed: bool = False
    failures: list[dict[str, Any]] = field(default_factory=list)


LOST_DECIDE_S = 2.0      # an elastic agent ended: this long for the state to say its node crashed
RESTART_DELAY_S = 1.0   # between a failed group's end and its new start (a node just restarted settles)


def _workers_down(cluster: Cluster, workers: Sequence[str]) -> list[str]:
    """Those of `workers` the testbed holds down or crashed (testbed node down/crash)."""
    from testbed import store

    nodes = (store.load(cluster.name).get("faults") or {}).get("nodes") or {}
    return [w for w in workers if (nodes.get(w) or {}).get("state") in ("down", "crashed")]


def _fresh_records(cluster: Cluster) -> None:
    """A worker started again (node up) may have a new init: the executor reads the state again."""
    from testbed import store

    if isinstance(cluster.executor, RuntimeExecutor):
        recs = (store.load(cluster.name).get("runtime") or {}).get("workers") or {}
        if recs:
            cluster.executor.records = dict(recs)


def _signal_group(ranks: Sequence[Rank], tag: str, sig: int) -> None:
    """Every process of one group: its ranks' process groups, then whatever carries its tag."""
    _signal(ranks, procs.pids_with_env("TESTBED_GROUP_RUN", tag, include_self=False), sig)


def check_real(real: Sequence[str], chosen: Sequence[str]) -> list[str]:
    """--real against the run's workers: every one of them among them, and at least one phantom left."""
    real = list(real)
    unknown = [w for w in real if w not in chosen]
    if unknown:
        raise RunError(f"--real {', '.join(unknown)}: not among the run's workers ({', '.join(chosen)})")
    if not real or len(set(real)) == len(chosen):
        raise RunError("--real needs at least one real worker and one phantom among the run's workers")
    return real


def _make_phantoms(ranks: list[Rank], real: set[str], chan: Path, runtime: str,
                   leader_rank: int | None = None, leader_here: bool = True,
                   relay_out: bool = False) -> tuple[list[str], list[str]]:
    """Turn the ranks of workers not in `real` into phantoms: same environment, the phantom module
    as the command, and a FIFO each on which the lowest real rank announces its operations (with
    no real rank, a replay: the launcher feeds them; leader_rank is the recorded rank). Returns
    the phantoms' FIFOs and the checking ranks'. Every other real rank gets one too
    (TESTBED_PHANTOM_CHECK): it compares each of its operations with the leader's, so
    rank-dependent control flow stops the run with both operations named instead of hanging the
    phantoms.

    Over several hosts (testbed.jobs.relay): leader_here False: the leader (rank leader_rank) is on
    another host, every real rank here checks and the FIFOs are fed by the relay; relay_out: the
    leader is here and announces on one more FIFO too, relay.FIFO_NAME, for the other hosts.

    Under torchrun a worker's Rank is its agent, and which global ranks it gets is the rendezvous'
    choice: FIFOs are named by worker and local rank, the phantom agent runs the phantom module
    with the job's torchrun options, and the real agent's local rank 0 leads."""
    chan.mkdir(mode=0o755)
    reals = [r for r in ranks if r.worker in real]
    leader = reals[0] if reals and leader_here else None
    leader_rank = leader.rank if leader is not None else int(leader_rank or 0)
    fifos = []
    pkg_root = str(Path(__file__).resolve().parents[2])
    python = sys.executable
    if runtime == "docker":
        from testbed.runtime.docker import PKG_TARGET

        pkg_root, python = PKG_TARGET, "python3"
    for r in ranks:
        if r.worker in real:
            continue
        r.phantom = True
        env = {k: v for k, v in r.env.items() if k not in ("TESTBED_PROBE_DIR", "PYTHONPATH")}
        if r.local_rank is None:   # a torchrun agent: one FIFO per local rank
            nproc = int(r.env.get("LOCAL_WORLD_SIZE", "1"))
            names = [f"{r.worker}-{lr}" for lr in range(nproc)]
            r.label = f"{r.worker}:torchrun-phantoms"
            r.argv = torchrun_module_argv(r.argv, "testbed.jobs.phantom")
            stem = f"{r.worker}-{{LOCAL_RANK}}"
        else:
            names = [f"rank-{r.rank}"]
            r.label = f"{r.worker}:p{r.rank}"
            r.argv = [python, "-m", "testbed.jobs.phantom"]
            stem = names[0]
        for n in names:
            os.mkfifo(chan / f"{n}.fifo", 0o600)
            fifos.append(str(chan / f"{n}.fifo"))
        r.env = {**env, "PYTHONPATH": pkg_root, "TESTBED_PHANTOM_IN": str(chan / f"{stem}.fifo"),
                 "TESTBED_PHANTOM_STATS": str(chan / f"stats-{stem}.json")}
        if leader_rank is not None:
            r.env["TESTBED_PHANTOM_LEADER"] = str(leader_rank)
    checks = []
    for r in reals[1:] if leader is not None else reals:   # the others: each compares its operations with the leader's
        stem = f"check-{r.worker}-{{LOCAL_RANK}}" if r.local_rank is None else f"check-rank-{r.rank}"
        nproc = int(r.env.get("LOCAL_WORLD_SIZE", "1")) if r.local_rank is None else 1
        for lr in range(nproc):
            path = chan / (stem.replace("{LOCAL_RANK}", str(lr)) + ".fifo")
            os.mkfifo(path, 0o600)
            checks.append(str(path))
        r.env["TESTBED_PHANTOM_CHECK"] = str(chan / f"{stem}.fifo")
        r.env["TESTBED_PHANTOM_LEADER"] = str(leader_rank)
    if leader is not None:
        out = fifos + checks
        if relay_out:
            os.mkfifo(chan / relay.FIFO_NAME, 0o600)
            out.append(str(chan / relay.FIFO_NAME))
        leader.env["TESTBED_PHANTOM_OUT"] = os.pathsep.join(out)
        if leader.local_rank is None:
            leader.env["TESTBED_PHANTOM_LEADER_LOCAL_RANK"] = "0"   # its other local ranks do not announce
    return fifos, checks


# torchrun options that take no value: the first other word not starting with "-" is the script
_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                   "--virtual-local-rank", "--virtual_local_rank"}


def torchrun_module_argv(argv: Sequence[str], module: str) -> list[str]:
    """A torchrun command line with its script (and the script's arguments) replaced by `python -m
    module`: the same launcher, rendezvous and local ranks, another program."""
    argv = list(argv)
    i = 3 if not os.path.basename(argv[0]).startswith("torchrun") else 1
    opts: list[str] = []
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            break
        i += 1
        if a in _TORCHRUN_FLAGS:
            continue   # how to run the script: ours is a module
        opts.append(a)
        if "=" not in a and i < len(argv):
            opts.append(argv[i])
            i += 1
    head = argv[:3] if not os.path.basename(argv[0]).startswith("torchrun") else argv[:1]
    return head + opts + ["-m", module]


def _real_and_phantom_ranks(ranks: list[Rank], world: int, stats: dict[str, Any] | None) -> dict[str, list[int]]:
    """Which global ranks were real and which phantom. Under torchrun the rendezvous chose: the
    phantoms say theirs in their stats, the rest were real."""
    if all(r.rank is not None for r in ranks):
        return {"real_ranks": [r.rank for r in ranks if not r.phantom],
                "phantom_ranks": [r.rank for r in ranks if r.phantom]}
    phantom = sorted({int(x) for x in (stats or {}).get("ranks") or [] if isinstance(x, int) and 0 <= x < world})
    return {"real_ranks": [x for x in range(world) if x not in phantom], "phantom_ranks": phantom}


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as ranges, sorted, each once: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs: list[list[int]] = []   # [first, last] of each run of consecutive ranks
    for x in sorted(set(ranks)):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def ranks_line(summary: Mapping[str, Any]) -> str | None:
    """What the console says of a run with phantoms (its summary.json, one host's or the
    controller's merge): which ranks were real, on which workers, and which phantoms, e.g.
    "ranks: 1 real (0 on w0), 63 phantoms (1-63)". None for a run without phantoms. Under torchrun
    the ranks do not say their global rank (the rendezvous chose): the real ones are then said to
    be on the real workers, all together."""
    ph = summary.get("phantoms")
    if not isinstance(ph, dict):
        return None

    def ints(v: Any) -> list[int]:
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)] if isinstance(v, list) else []

    real, phantoms = ints(ph.get("real_ranks")), ints(ph.get("phantom_ranks"))
    if not phantoms:
        return None
    where: dict[str, list[int]] = {}   # worker -> its real ranks, in rank order
    for r in summary.get("ranks") or []:
        if isinstance(r, dict) and r.get("rank") in real and not r.get("phantom"):
            where.setdefault(str(r.get("worker")), []).append(r["rank"])
    said = ""
    if real and sorted(x for v in where.values() for x in v) == sorted(set(real)):
        said = ", ".join(f"{rank_ranges(v)} on {w}" for w, v in sorted(where.items(), key=lambda kv: min(kv[1])))
    elif real:
        rw = ph.get("real_workers")
        workers = [str(w) for w in rw] if isinstance(rw, list) else []
        said = rank_ranges(real) + (f" on {','.join(workers)}" if workers else "")
    head = f"{len(set(real))} real ({said})" if real else "none real (a replay)"
    n = len(set(phantoms))
    return f"ranks: {head}, {n} phantom{'' if n == 1 else 's'} ({rank_ranges(phantoms)})"


@dataclass
class Trace:
    """A recorded sequence of operations (what the mirror announced), for --replay."""
    source: Path
    lines: list[bytes]
    times: list[float]     # each line's recorded wall time
    world: int
    rank: int
    dilation: float        # of the recorded run (1 when unknown)
    kind: str = "testbed"  # or "chakra": an MLCommons Chakra execution trace (testbed.jobs.chakra)
    skipped: dict[str, int] = field(default_factory=dict)   # what the trace holds that cannot be replayed


TRACE_MAX_BYTES = 256 << 20


def load_trace(path: str | os.PathLike) -> Trace:
    """A trace from a run directory (its probe/ops-N.jsonl) or the file itself, checked line by
    line: JSON objects with the fields the phantoms read, an init first, at most 256 MiB."""
    p = Path(path)
    run_dir = None
    from testbed.jobs import chakra

    if p.exists() and chakra.is_chakra(p):
        try:
            c = chakra.convert(p)
        except chakra.ChakraError as exc:
            raise RunError(str(exc)) from None
        return Trace(c.source, c.lines, c.times, c.world, 0, 1.0, "chakra", c.skipped)
    if p.is_dir():
        run_dir = p
        found = sorted((p / "probe").glob("ops-*.jsonl")) if (p / "probe").is_dir() else []
        if not found:
            raise RunError(f"{p}: no recorded operations (probe/ops-N.jsonl): record a run with "
                           "`testbed run --record-ops -- ...` (or --real) first")
        p = found[0]
    if not p.is_file() or p.is_symlink() or p.stat().st_size > TRACE_MAX_BYTES:
        raise RunError(f"{p}: not a plain trace file of at most {TRACE_MAX_BYTES >> 20} MiB")
    lines, times = [], []
    world = rank = None
    for i, raw in enumerate(p.read_bytes().splitlines(), 1):
        try:
            obj = json.loads(raw)
        except ValueError:
            raise RunError(f"{p}:{i}: not JSON") from None
        if not isinstance(obj, dict) or obj.get("ev") not in ("init", "op", "new_group", "end"):
            raise RunError(f"{p}:{i}: not an operation record (ev init, op, new_group or end)")
        t = obj.get("t")
        if obj["ev"] != "new_group" and not isinstance(t, (int, float)):
            raise RunError(f"{p}:{i}: field t: not a time ({t!r})")
        if obj["ev"] == "init":
            world, rank = obj.get("world"), obj.get("rank", 0)
        elif world is None:
            raise RunError(f"{p}:{i}: an operation before the init record")
        if obj["ev"] == "end":
            break
        lines.append(raw)
        times.append(float(t) if isinstance(t, (int, float)) else (times[-1] if times else 0.0))
    if not isinstance(world, int) or world < 2 or not isinstance(rank, int) or not 0 <= rank < world:
        raise RunError(f"{p}: the init record names no world size and rank (world {world!r}, rank {rank!r})")
    s = 1.0
    if run_dir is not None:
        summary = rundir.read_json(run_dir / "summary.json") or {}
        f = (summary.get("time_dilation") or {}).get("factor") if isinstance(summary, dict) else None
        s = float(f) if isinstance(f, (int, float)) and f >= 1 else 1.0
    return Trace(p, lines, times, world, rank, s)


def _feed(trace: Trace, fifos: Sequence[str], s_now: float, stop: threading.Event) -> None:
    """Play the trace to every phantom: each line at its recorded offset, in emulated time (the
    recorded gap / its run's factor x this run's factor), with its time field set to when it is
    sent (the phantoms' lateness is measured against it); then the end."""
    fds = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in fifos]
    try:
        scale = s_now / trace.dilation
        t0, first = time.monotonic(), trace.times[0] if trace.times else 0.0
        for raw, t in zip(trace.lines + [b'{"ev":"end"}'], trace.times + [trace.times[-1] if trace.times else 0.0]):
            wait = t0 + (t - first) * scale - time.monotonic()
            if wait > 0 and stop.wait(wait):
                return
            obj = json.loads(raw)
            obj["t"] = time.time()
            line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
            for fd in fds:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
            if stop.is_set():
                return
        # Held open until the run ends: a FIFO's buffered lines are freed with its last open end, so
        # a short trace played before a phantom opened its FIFO (Python and torch take seconds to
        # start) would otherwise never reach it.
        stop.wait()
    except OSError:
        return   # the run is ending: the phantoms' FIFOs went with it
    finally:
        for fd in fds:
            os.close(fd)


def _cap_real_workers(cluster: Cluster, real: Sequence[str], nproc: int, capped: list[str],
                      echo: Callable[[str], None] | None) -> float | None:
    """Slow the real ranks' compute by the dilation factor, as sharing the cores with the other ranks
    would have: with phantoms (which compute nothing) a real rank would otherwise get a whole core
    and compute s times faster than its emulated server. The same cgroup quota as `testbed node
    slow`, for the run only; workers already slowed keep their limit. Appends what it capped."""
    from testbed import node_cpus

    cpus = nproc / float(cluster.time_dilation or 1.0)
    if cpus >= _cores() or cluster.dilation.get("cap_cpu"):   # capped at `up` already (1/s, or auto's share)
        return None
    mine = [w for w in real if w not in _user_slowed(cluster)]
    try:
        node_cpus.nodes_slow(cluster.name, mine, cpus)
    except TestbedError as exc:
        if echo is not None:
            echo(f"[testbed] could not limit {', '.join(mine)} to {cpus:g} CPUs ({exc}): their ranks compute "
                 "faster than under dilation")
        return None
    capped.extend(mine)
    return cpus


def _user_slowed(cluster: Cluster) -> set[str]:
    """Workers under the user's own `node slow`: theirs to undo, the run leaves them alone."""
    from testbed import store

    nodes = (store.load(cluster.name).get("faults") or {}).get("nodes") or {}
    return {w for w, f in nodes.items() if "cpus" in (f or {})}


def _uncap(cluster: Cluster, capped: list[str], echo: Callable[[str], None] | None) -> None:
    from testbed import node_cpus

    if not capped:
        return
    try:
        node_cpus.nodes_restore(cluster.name, capped)
    except TestbedError as exc:
        if echo is not None:
            echo(f"[testbed] {', '.join(capped)} keep the run's CPU limit ({exc}): testbed node restore NODE")


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


def _save_stacks(rd: Path, name: str, run_id: str, echo: Callable[[str], None] | None) -> str | None:
    """Every rank's stack into the run directory (a hung or timed-out job); its path, or None."""
    from testbed.jobs import stacks

    path = stacks.save(rd, name, run_id)
    if echo is not None:
        echo(f"[testbed] stacks of the ranks: {path}" if path else "[testbed] no rank stack taken")
    return str(path) if path else None


def _phantom_stats(chan: Path) -> dict[str, Any]:
    """What the phantoms wrote at their end: operations mirrored, how late they read announcements."""
    rows = []
    for f in sorted(chan.glob("stats-*.json")) if chan.is_dir() else []:
        try:
            if f.is_file() and not f.is_symlink() and f.stat().st_size < 65536:
                rows.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    rows = [r for r in rows if isinstance(r, dict)]
    late = [r["announce_late_s"] for r in rows if isinstance(r.get("announce_late_s"), dict)
            and isinstance(r["announce_late_s"].get("p50"), (int, float))]
    warnings = sorted({str(w) for r in rows if isinstance(r.get("warnings"), list) for w in r["warnings"]})
    return {"ranks": [r.get("rank") for r in rows],
            "ops_mirrored": [r.get("ops") for r in rows], "errors": [r["error"] for r in rows if r.get("error")],
            "warnings": warnings[:20],
            # the median: the first announcements wait for the phantoms' own start (torch's import)
            "announce_late_p50_s": statistics.median(x["p50"] for x in late) if late else None,
            "announce_late_max_s": max((x["max"] for x in late), default=None)}


def _cores() -> int:
    from testbed.lifecycle import cores

    return cores()


def _shared_dir(cluster: Cluster, run_id: str) -> Path:
    """<state dir>/runs/<run id>: where ranks write (the state dir is visible in every worker)."""
    base = cluster.state_dir
    if base is None:
        from testbed import paths

        base = paths.directory(cluster.name)
    return Path(base) / "runs" / run_id


def _collect_probe(rd: Path, shared: Path) -> None:
    """Replace the run dir's probe link with a directory holding the ranks' files; remove `shared`.
    Each file is opened once (no link followed, never waited on), checked on that descriptor and
    copied from it: what is checked is what is copied."""
    try:
        _copy_probe(rd, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)   # <state dir>/runs stays: Docker workers mount it


def _copy_probe(rd: Path, shared: Path) -> None:
    base, rel = safeio.path_beneath_runs(rd / "probe")
    run_fd = safeio.open_dir_beneath(base, rel.parent)   # (refuses a run directory, or runs/, become a link)
    try:   # testbed's live link goes; a directory there stays
        if stat.S_ISLNK(os.lstat("probe", dir_fd=run_fd).st_mode):
            os.unlink("probe", dir_fd=run_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(run_fd)
    dst = safeio.open_dir_beneath(base, rel, create=True)
    try:
        src = safeio.open_dir_beneath(shared, "probe")
    except (OSError, safeio.Unsafe):
        src = -1
    try:
        for name in sorted(os.listdir(src)) if src >= 0 else []:
            # only the ranks' own files, plain and of a sane size: a rank is not trusted to name them
            if not PROBE_FILE.fullmatch(name):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > PROBE_FILE_MAX_BYTES:
                    continue
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                              dir_fd=dst)
                try:   # (the state dir is on a tmpfs, the run dir on disk: copied, not renamed)
                    left = PROBE_FILE_MAX_BYTES
                    while left > 0 and (chunk := os.read(fd, min(1 << 20, left))):
                        os.write(out, chunk)
                        left -= len(chunk)
                finally:
                    os.close(out)
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        os.close(dst)
        if src >= 0:
            os.close(src)


def format_cmd(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
