"""What `testbed graph` draws, as pure functions of a testbed's state and samples: the topology
document (nodes, links, their profiles and states), a sample's overlay on it, and the steps and
events the page shows beside it."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping

from testbed import events
from testbed.topology.units import format_profile

EVENTS_KEEP = 500
EVENTS_LIMIT = 100
STEPS_KEEP = 600
SAMPLE_FIELDS = ("up", "version", "nodes", "steps", "warming", "error", "trouble")


def node_states(st: Mapping[str, Any]) -> dict[str, str]:
    """Every node's state: "up", or what `testbed node` made it ("down", "crashed")."""
    faults = (st.get("faults") or {}).get("nodes") or {}
    return {n["name"]: (faults.get(n["name"]) or {}).get("state") or "up" for n in st["topology"]["nodes"]}


def addresses(st: Mapping[str, Any]) -> dict[str, list[str]]:
    """Node -> the addresses (CIDR) of its ports, from the state's address plan."""
    out: dict[str, list[str]] = {}
    for lp in (st.get("plan") or {}).get("links") or []:
        for side in ("a", "b"):
            end = lp.get(side) or {}
            if end.get("node") and end.get("address"):
                out.setdefault(end["node"], []).append(end["address"])
    return out


def topology_doc(st: Mapping[str, Any], version: int = 0, control: bool = False) -> dict[str, Any]:
    """The /api/topology document of a (validated) state."""
    from testbed.faults.control import PROFILE_FIELDS
    from testbed.running import dilation_of
    from testbed.topology.layout import layout
    from testbed.topology.model import LinkProfile, Topology

    topo = Topology.from_json(st["topology"])
    pos = layout(topo)
    states = node_states(st)
    addrs = addresses(st)
    rows: dict[int, int] = {}
    nodes = []
    for name, node in topo.nodes.items():
        x, y = pos[name]
        rows[int(y)] = rows.get(int(y), 0) + 1
        nodes.append({"name": name, "kind": node.kind, "layer": int(y), "x": x, "state": states.get(name, "up"),
                      "gpus": node.gpus, "addresses": addrs.get(name, [])})
    records = st.get("links") or []
    links = []
    for i, link in enumerate(topo.links):
        rec = records[i] if i < len(records) else {}
        prof = rec.get("profile")
        ab, ba = (LinkProfile.from_json(prof["ab"]), LinkProfile.from_json(prof["ba"])) if prof else (link.ab, link.ba)
        ab_d = {k: getattr(ab, k) for k in PROFILE_FIELDS}
        ba_d = {k: getattr(ba, k) for k in PROFILE_FIELDS}
        down_by = rec.get("down_by")
        if down_by is None:
            down_by = ["link"] if rec.get("state") == "down" else []
        links.append({"index": i, "a": link.a, "b": link.b, "tier": link.tier, "state": rec.get("state", "up"),
                      "down_by": list(down_by), "ab": ab_d, "ba": ba_d, "ab_text": format_profile(ab_d),
                      "ba_text": format_profile(ba_d), "changed": bool(prof), "ifnames": rec.get("ifnames")})
    s = dilation_of(dict(st))
    return {"testbed": st["name"], "version": version, "up": True, "created": st.get("created"), "dilation": s,
            "time": "emulated" if s != 1 else "real", "control": control, "tiers": topo.tiers(),
            "layers": max(rows, default=0) + 1, "widest": max(rows.values(), default=0),
            "nodes": nodes, "links": links}


def overlay(sample: Mapping[str, Any], topo: Mapping[str, Any], states: Mapping[str, str]) -> dict[str, Any]:
    """A sample with the link and node states of a newer topology document (a change made after
    the sample was taken shows at once, not at the next sample)."""
    records = topo["links"]
    links = []
    for l in sample.get("links") or []:
        rec = records[l["index"]] if l.get("index") is not None and l["index"] < len(records) else None
        links.append(l if rec is None else {**l, "state": rec["state"], "down_by": list(rec["down_by"])})
    return {**sample, "links": links, "nodes": dict(states), "version": topo["version"]}


def empty_sample(name: str, up: bool, version: int = 0, error: str | None = None,
                 trouble: list[str] | None = None) -> dict[str, Any]:
    """A sample with no readings: before the first one (warming) or once the testbed is gone."""
    return {"testbed": name, "t": time.time(), "interval_s": None, "read_s": None, "time": None, "dilation": None,
            "links": [], "workers": [], "run": None, "up": up, "version": version, "nodes": {}, "steps": [],
            "warming": up, "error": error, "trouble": list(trouble or [])}


class StepHistory:
    """The active run's step times, one point per new step a sample saw (the ranks' median)."""

    def __init__(self, keep: int = STEPS_KEEP):
        self.keep = keep
        self.run_id: str | None = None
        self.points: list[dict[str, Any]] = []

    def update(self, run: Mapping[str, Any] | None, now: float | None = None) -> list[dict[str, Any]]:
        if run is None:
            self.run_id, self.points = None, []
            return []
        if run.get("run_id") != self.run_id:
            self.run_id, self.points = run.get("run_id"), []
        step, dt = run.get("step"), run.get("last_step_s")
        if step is not None and dt is not None and (not self.points or self.points[-1]["step"] != step):
            self.points.append({"step": step, "t": time.time() if now is None else now, "step_s": dt,
                                "max_s": run.get("last_step_max_s")})
            del self.points[:-self.keep]
        return list(self.points)


class EventTail:
    """The testbed's event stream, read again only when the file changed, the last `keep` kept."""

    def __init__(self, name: str, keep: int = EVENTS_KEEP, reader: Callable[..., Any] = events.read):
        self.name = name
        self.keep = keep
        self._reader = reader
        self._stamp: tuple[int, int, int] | None = None
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            s = os.stat(events.path(self.name))
            stamp = (s.st_ino, s.st_size, s.st_mtime_ns)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._records = list(self._reader(self.name))[-self.keep:] if stamp is not None else []
            self._stamp = stamp

    def since(self, t: float, limit: int = EVENTS_LIMIT) -> list[dict[str, Any]]:
        with self._lock:
            self._refresh()
            newer = [r for r in self._records if r["t"] > t]
        return newer[-limit:] if limit > 0 else []
