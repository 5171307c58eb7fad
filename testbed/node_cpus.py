"""A worker's CPU limit as a recorded fault: `node slow` (a cgroup CPU quota, kept in the state's
faults.nodes[NODE]["cpus"], told on the event stream) and `node restore` (the topology's limit back).
A run caps its real ranks the same way (jobs/run: phantoms compute nothing, so a real rank would
otherwise get a whole core); it lives below faults/ and jobs/ for that reason.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from testbed import running
from testbed.errors import CapabilityError
from testbed.net import netns
from testbed.running import FaultError, locked


def _own_cgroup_slow(h: running.Handle, node: str, cpus: float, ns: dict[str, Any]) -> None:
    """The runtime has no cgroups (bare): a group of our own, with the worker's processes moved in."""
    from testbed.runtime import cgroups

    paths = ns.get("cgroup") or cgroups.create(f"{h.name}.faults", node, cpus=cpus)
    if not paths:
        raise CapabilityError("node slow needs cgroups, and none are mounted")
    cgroups.set_limits(paths, cpus=cpus)
    for pid in netns.pids_in([h.netns(node)]):
        with contextlib.suppress(OSError):
            cgroups.add(paths, pid)
    ns["cgroup"] = list(paths)


def _own_cgroup_release(ns: dict[str, Any]) -> None:
    from pathlib import Path

    from testbed.runtime import cgroups

    paths = ns.pop("cgroup", None)
    if not paths:
        return
    for p in map(Path, paths):
        root = p.parent.parent.parent   # <mount>/testbed/<tb>/<worker> -> <mount>
        for pid in cgroups.pids([p]):
            with contextlib.suppress(OSError):
                cgroups.add([root], pid)
    with contextlib.suppress(OSError):
        cgroups.remove(paths, kill=False)


def node_slow(name: str, node: str, cpus: float) -> None:
    """Make worker `node` a straggler: at most `cpus` CPUs (cgroup CPU quota)."""
    nodes_slow(name, [node], cpus)


def nodes_slow(name: str, nodes: Sequence[str], cpus: float) -> None:
    """`node_slow` for several workers under one lock (a run caps all its real workers at once)."""
    if not (cpus > 0):
        raise FaultError(f"--cpus must be positive (got {cpus})")
    with locked(name) as h:
        for node in nodes:
            _slow(h, node, cpus)


def _slow(h: running.Handle, node: str, cpus: float) -> None:
    n = h.node(node)
    if not n.is_worker:
        raise FaultError(f"node: {node} is a switch; slow acts on workers")
    ns = h.faults()["nodes"].setdefault(node, {})
    if not h.here(node):   # on another host, which caps it: the record only, kept the same here
        ns["cpus"] = cpus
        h.log(f"node slow {node} cpus={cpus:g} (on another host)")
        return
    rt = running.runtime_of(h)
    rec = running.worker_record(h, node)
    done = False
    if not ns.get("cgroup"):
        try:
            done = running.try_runtime(rt.set_limits, node, rec, cpus=cpus)
        except CapabilityError:
            done = False
        paths = rec.get("cgroups") or []
        if done and paths:
            from testbed.runtime import cgroups

            for r in running.strays(h, rt, node, rec):   # everything in the worker is slowed
                with contextlib.suppress(OSError):
                    cgroups.add(paths, r.pid)
        elif done:
            done = False
    if not done:
        _own_cgroup_slow(h, node, cpus, ns)
    ns["cpus"] = cpus
    h.log(f"node slow {node} cpus={cpus:g}")


def node_restore(name: str, node: str) -> None:
    """Undo `node slow`: the worker's CPU limit back to the topology's (or none)."""
    nodes_restore(name, [node])


def nodes_restore(name: str, nodes: Sequence[str]) -> None:
    """`node_restore` for several workers under one lock."""
    with locked(name) as h:
        for node in nodes:
            _restore(h, node)


def _restore(h: running.Handle, node: str) -> None:
    n = h.node(node)
    ns = h.faults()["nodes"].setdefault(node, {})
    if "cpus" not in ns and not ns.get("cgroup"):
        return
    if not h.here(node):   # on another host, which lifts the cap: the record only
        ns.pop("cgroup", None)
    elif ns.get("cgroup"):
        _own_cgroup_release(ns)
    else:
        rt = running.runtime_of(h)
        rec = running.worker_record(h, node)
        cpus = n.cpus
        if (h.st.get("dilation") or {}).get("cap_cpu"):   # what `up` gave it (Choice.cap_cores)
            from testbed.topology.dilation import rank_cores

            cpus = (n.cpus or 1.0) * rank_cores(h.st.get("dilation")) / h.dilation
        if cpus is not None:
            running.try_runtime(rt.set_limits, node, rec, cpus=cpus)
        else:
            from testbed.runtime import cgroups

            paths = rec.get("cgroups") or []
            if paths:
                cgroups.set_limits(paths, clear=True)
                if n.memory_bytes is not None:
                    cgroups.set_limits(paths, memory_bytes=n.memory_bytes)
    ns.pop("cpus", None)
    h.log(f"node restore {node}" + ("" if h.here(node) else " (on another host)"))
