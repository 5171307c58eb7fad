"""The testbed a run targets: its workers, their addresses and interfaces, and how a command
reaches a worker (through the testbed's runtime), read from a running testbed's state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from testbed.errors import RunError


class Executor:
    """Host argv that runs argv inside a worker."""

    def argv(self, worker: str, argv: Sequence[str], env: Mapping[str, str], workdir: str) -> list[str]:
        raise NotImplementedError


class RuntimeExecutor(Executor):
    """Through the testbed's runtime (netns containers, docker): testbed.node_exec.exec_argv.

    `records` are the workers' runtime records (state runtime.workers); a caller may replace them."""

    def __init__(self, st: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]] | None = None):
        self.state = dict(st)
        self.records = dict(records if records is not None else (st.get("runtime") or {}).get("workers") or {})

    def argv(self, worker, argv, env, workdir):
        from testbed import node_exec

        rt = dict(self.state.get("runtime") or {})
        rt["workers"] = self.records
        return node_exec.exec_argv({**self.state, "runtime": rt}, worker, list(argv), env=dict(env),
                                   workdir=workdir)


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
