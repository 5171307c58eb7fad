"""The machine's limits that a big testbed meets, against what a topology needs.

Measured on a k=16 fat-tree (1,024 workers, 320 switches, 3,072 links; 2-core
Debian 12 machine): about 3.7 MiB of memory per node (a worker's init: RSS
10.6 MiB, PSS 2.3 MiB; the kernel's namespaces, veths and qdiscs the rest),
one open file per namespace while linking, one network namespace per node and
one mount namespace per worker. A job adds its ranks' threads: a gloo rank of
torch runs about 40, and each is a PID.

`check` reads the limits (/proc/sys, the process's rlimits, MemAvailable) and
says, per limit, whether it suffices and the command that raises it. `up`
refuses what cannot work (namespace limits, open files) before it builds
anything; `doctor` prints the table for a size the user names.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

MEMORY_PER_NODE = int(3.7 * 2**20)
THREADS_PER_RANK = 40
FILES_SLACK = 256


@dataclass(frozen=True)
class Limit:
    name: str
    have: int | None       # None: not readable here
    need: int
    fix: str                # what raises it
    hard: bool = True       # False: a warning (the build may still work), True: `up` refuses

    @property
    def ok(self) -> bool:
        return self.have is None or self.have >= self.need


def _sysctl(path: str) -> int | None:
    try:
        return int(Path("/proc/sys", path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def mem_available() -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check(nodes: int, workers: int, ranks: int | None = None) -> list[Limit]:
    """Each limit a testbed of `nodes` namespaces (`workers` of them workers) and a job of `ranks`
    ranks (default: one per worker) meets here."""
    ranks = workers if ranks is None else ranks
    files_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    pids = workers + ranks * THREADS_PER_RANK
    return [
        Limit("network namespaces (user.max_net_namespaces)", _sysctl("user/max_net_namespaces"), nodes,
              f"sysctl -w user.max_net_namespaces={nodes * 2}"),
        Limit("mount namespaces (user.max_mnt_namespaces)", _sysctl("user/max_mnt_namespaces"), workers,
              f"sysctl -w user.max_mnt_namespaces={workers * 2}"),
        Limit("open files (hard RLIMIT_NOFILE)", None if files_hard == resource.RLIM_INFINITY else files_hard,
              nodes + FILES_SLACK, f"ulimit -Hn {(nodes + FILES_SLACK) * 2} (LimitNOFILE= for a service)"),
        Limit("PIDs for the job's threads (kernel.pid_max)", _sysctl("kernel/pid_max"), pids,
              f"sysctl -w kernel.pid_max={max(pids * 2, 65536)}", hard=False),
        Limit("threads (kernel.threads-max)", _sysctl("kernel/threads-max"), pids,
              f"sysctl -w kernel.threads-max={pids * 2}", hard=False),
        Limit("memory (MemAvailable, MiB)", None if (m := mem_available()) is None else m >> 20,
              nodes * MEMORY_PER_NODE >> 20,
              "fewer nodes, or a machine with more memory", hard=False),
    ]


def refusals(limits: list[Limit]) -> list[str]:
    """What makes a build impossible, each with its fix."""
    return [f"{l.name}: {l.have} here, {l.need} needed ({l.fix})" for l in limits if l.hard and not l.ok]


def warnings(limits: list[Limit]) -> list[str]:
    return [f"{l.name}: {l.have} here, about {l.need} needed ({l.fix})" for l in limits if not l.hard and not l.ok]
