"""A running testbed as its state records it: the Handle every change to it starts from (a fault
command, a scenario step, a run capping its ranks' CPUs), loaded and saved under the testbed's lock
(`locked`), and the worker helpers those changes share. What it may change and how is the
changers' own (testbed.faults.control, testbed.node_cpus); this module sits below both, so that a
run (jobs/) caps CPUs without importing faults/.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

from testbed import events, names, procs, store
from testbed.errors import StateError, TestbedError
from testbed.net import netns
from testbed.topology.model import LinkProfile, Topology

LOG_KEEP = 200   # entries of the state's fault log


class FaultError(TestbedError):
    """A fault command names something the testbed does not have, or cannot do it: exit status 2."""

    exit_code = 2


# -- the testbed as seen from its state -------------------------------------------------------------------------


class Handle:
    """A running testbed: its state, topology, plan and dilation factor (loaded once per operation)."""

    def __init__(self, name: str, st: dict[str, Any] | None = None):
        self.name = name
        self.st = st if st is not None else store.load(name)
        if not self.st.get("topology"):
            raise StateError(f"state of testbed {name!r} has no topology snapshot")
        self.topo = Topology.from_json(self.st["topology"])
        self._plan = None

    @property
    def plan(self):
        if self._plan is None:
            from testbed.topology.plan import plan_network

            self._plan = plan_network(self.topo)
        return self._plan

    @property
    def dilation(self) -> float:
        return dilation_of(self.st, self.topo)

    @property
    def caps(self):
        from testbed.net.capabilities import Capabilities

        data = self.st.get("capabilities")
        if isinstance(data, dict):
            return Capabilities.from_json(data)
        from testbed.net import capabilities

        return capabilities.probe()

    def here(self, node: str) -> bool:
        """Whether `node` is built on this host (always, unless the testbed spans several hosts:
        then each host's faults act on its own nodes and link ends, cluster.part)."""
        part = self.st.get("part")
        return part is None or node in part.get("nodes", ())

    def netns(self, node: str) -> str:
        if node in self.topo.workers:
            rec = self.st.get("runtime", {}).get("workers", {}).get(node) or {}
            if rec.get("netns"):
                return rec["netns"]
        return names.netns(self.name, node)

    def faults(self) -> dict[str, Any]:
        f = self.st.setdefault("faults", {})
        f.setdefault("nodes", {})
        f.setdefault("log", [])
        return f

    # -- links --
    def node(self, node: str, *, path: str = "node") -> Any:
        n = self.topo.nodes.get(node)
        if n is None:
            some = ", ".join(list(self.topo.nodes)[:12]) + (" ..." if len(self.topo.nodes) > 12 else "")
            raise FaultError(f"{path}: testbed {self.name!r} has no node {node!r} (nodes: {some})")
        return n

    def link(self, a: str, b: str) -> tuple[int, dict[str, Any]]:
        """(index, state record) of the link between a and b."""
        self.node(a, path="A")
        self.node(b, path="B")
        link = self.topo.link_between(a, b)
        if link is None:
            nb = ", ".join(self.topo.neighbors(a)) or "none"
            raise FaultError(f"link: testbed {self.name!r} has no link between {a} and {b} "
                             f"({a}'s neighbours: {nb})")
        i = self.topo.link_index(a, b)
        recs = self.st.get("links") or []
        if i >= len(recs):
            raise StateError(f"state of testbed {self.name!r} lacks the record of link {i}")
        return i, recs[i]

    def profiles(self, i: int) -> tuple[LinkProfile, LinkProfile]:
        """The emulated (undilated) profiles a->b and b->a link i runs at now."""
        link = self.topo.links[i]
        rec = self.st["links"][i]
        prof = rec.get("profile")
        if prof:
            return LinkProfile.from_json(prof["ab"]), LinkProfile.from_json(prof["ba"])
        return link.ab, link.ba

    def log(self, what: str) -> None:
        """Record a change in the state's fault log and the testbed's event stream."""
        f = self.faults()
        f["log"].append({"t": time.time(), "what": what})
        del f["log"][:-LOG_KEEP]
        word = what.split(" ", 1)[0]
        events.emit(self.name, {"node": "node", "partition": "partition", "heal": "partition"}.get(word, "link"),
                    what)


def dilation_of(st: dict[str, Any], topo: Topology | None = None) -> float:
    """The testbed's time-dilation factor (1 when none)."""
    for key in ("time_dilation", "dilation"):
        v = st.get(key)
        if isinstance(v, dict) and v.get("factor"):
            return float(v["factor"])
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    td = (topo.time_dilation if topo is not None else (st.get("topology") or {}).get("time_dilation"))
    if isinstance(td, (int, float)) and not isinstance(td, bool) and td >= 1:
        return float(td)
    return 1.0


@contextlib.contextmanager
def locked(name: str) -> Iterator[Handle]:
    """The testbed's state, loaded under an exclusive lock and saved when the block succeeds.

    Fault commands from several shells (and a scenario player) serialise here. On an error
    the state is saved too (what was changed before the error is recorded), then it re-raises.
    """
    if not store.exists(name):
        up = store.list_names()
        raise StateError(f"no testbed named {name!r} is up" + (f" (up: {', '.join(up)})" if up else ""))
    with store.lock(name, what="testbed fault"):
        h = Handle(name)   # loaded (and checked to exist) under the lock: a `down` before us wins
        try:
            yield h
        finally:
            store.save(name, h.st)   # refuses, rather than recreates, a testbed removed meanwhile


# -- a worker's runtime, record and processes ----------------------------------------------------------------------


def runtime_of(h: Handle):
    """The runtime (bare, netns, docker) the testbed's workers were started with."""
    from testbed.lifecycle import runtime_for

    return runtime_for(h.st)


def worker_record(h: Handle, node: str) -> dict[str, Any]:
    """The runtime's record of worker `node` in the state (made, with its namespace, when missing)."""
    return h.st.setdefault("runtime", {}).setdefault("workers", {}).setdefault(node, {"netns": h.netns(node)})


def try_runtime(fn, *args, **kw) -> bool:
    """Call a runtime control method; False when the runtime does not implement it."""
    try:
        fn(*args, **kw)
        return True
    except NotImplementedError:
        return False


def strays(h: Handle, rt: Any, node: str, rec: dict[str, Any]) -> list[procs.ProcRef]:
    """Processes in the worker's network namespace that its runtime does not know (e.g. started with
    nsenter --net): they are part of the worker too."""
    known: set[int] = set()
    listed = getattr(rt, "processes", None)
    if listed is not None:
        with contextlib.suppress(Exception):
            known = set(listed(node, rec))
    return refs([p for p in netns.pids_in([h.netns(node)]) if p not in known])


def refs(pids: Sequence[int]) -> list[procs.ProcRef]:
    """The processes as they are now (PID and start time): a later signal goes to the same process
    or to none, never to one that took a freed PID in the meantime."""
    return [r for r in map(procs.ref, pids) if r is not None]
