"""A run of groups (testbed.jobs.groups) as the launcher starts it: each group's ranks with their own
world, and what it reads of the testbed while groups restart (nodes down, fresh worker records)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from testbed.jobs import groups as groups_mod
from testbed.jobs.ranks import Rank
from testbed.jobs.target import Cluster, RuntimeExecutor
from testbed.jobs.torchrun import TORCHRUN_PREFIX_TEMPLATE, is_torchrun, torchrun_argv


def group_ranks(cluster: Cluster, job: "groups_mod.Job", port: int, run_id: str, shared: Path,
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
class GroupState:
    group: "groups_mod.Group"
    left: int                          # restarts left
    state: str = "running"             # running | stopping (its ranks being ended) | waiting (to start again)
    since: float = 0.0
    restart_at: float = 0.0
    killed: bool = False
    failures: list[dict[str, Any]] = field(default_factory=list)


RESTART_DELAY_S = 1.0   # between a failed group's end and its new start (a node just restarted settles)


def workers_down(cluster: Cluster, workers: Sequence[str]) -> list[str]:
    """Those of `workers` the testbed holds down or crashed (testbed node down/crash)."""
    from testbed import store

    nodes = (store.load(cluster.name).get("faults") or {}).get("nodes") or {}
    return [w for w in workers if (nodes.get(w) or {}).get("state") in ("down", "crashed")]


def fresh_records(cluster: Cluster) -> None:
    """A worker started again (node up) may have a new init: the executor reads the state again."""
    from testbed import store

    if isinstance(cluster.executor, RuntimeExecutor):
        recs = (store.load(cluster.name).get("runtime") or {}).get("workers") or {}
        if recs:
            cluster.executor.records = dict(recs)
