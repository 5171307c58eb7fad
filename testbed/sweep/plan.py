"""The points of a sweep and their runs; what a point changes against the testbed that runs now.

Pure logic over the validated Sweep (testbed.sweep.spec) and topologies: every point's topology is
loaded (and so checked) when the plan is made, before anything is built. A point is a set of
parameter values; a run is a point and a repeat. `profile_changes` says whether a testbed up for
one topology can reach another by changing link profiles only (the runner then reconfigures the
links in place); `estimate_seconds` says how long the runs left should take.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from testbed.errors import TopologyError
from testbed.sweep.spec import LINK_FIELDS, Job, Sweep
from testbed.lifecycle import effective_topology  # noqa: F401 (the sweep's name for it)
from testbed.topology.model import LinkProfile, Topology

# Guesses before a sweep has measured anything (this project's 2-core machine, the main job on the
# k=4 fat-tree: README "A short tour"); the estimate uses the sweep's own times once it has them.
GUESS_UP_S_PER_NODE = 0.05       # `up` of 36 nodes ~1 s, `down` about as long
GUESS_RUN_S_PER_RANK_STEP = 0.4  # 16 ranks x 20 steps of the main job at auto dilation: ~130 s
GUESS_COMMAND_RUN_S = 60.0       # a command we know nothing of


@dataclass(frozen=True)
class Point:
    """One combination of parameter values, and what it makes of the sweep's base."""

    index: int
    params: tuple[tuple[str, Any], ...]   # as written (values unparsed)
    sets: tuple[str, ...]                 # topology overrides: the sweep's, then the point's
    dilation: str                         # "auto", "none" or a factor
    scenario: str | None                  # a scenario file (resolved path) or None
    job: Job

    @property
    def id(self) -> str:
        return f"p{self.index:02d}"

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params) or "base"

    def value(self, key: str) -> Any:
        return dict(self.params).get(key)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "params": [[k, v] for k, v in self.params], "set": list(self.sets),
                "dilation": self.dilation, "scenario": self.scenario, "job": self.job.to_json()}


@dataclass(frozen=True)
class Run:
    point: Point
    repeat: int          # 1-based

    @property
    def key(self) -> str:
        return f"{self.point.id}-r{self.repeat}"


@dataclass(frozen=True)
class Plan:
    sweep: Sweep
    points: tuple[Point, ...]
    topologies: tuple[Topology, ...]      # each point's (nominal) topology, validated

    @property
    def runs(self) -> list[Run]:
        """Points in order, a point's repeats one after the other (on the same testbed)."""
        return [Run(p, r) for p in self.points for r in range(1, self.sweep.repeats + 1)]

    def topology(self, point: Point) -> Topology:
        return self.topologies[point.index]

    def to_json(self) -> dict[str, Any]:
        return {"sweep": self.sweep.to_json(), "points": [p.to_json() for p in self.points],
                "fingerprint": self.fingerprint()}

    def fingerprint(self) -> str:
        """What decides the results: the points (topologies included), the job, the repeats. A sweep
        directory continues only the plan it was started with."""
        doc = {"points": [p.to_json() for p in self.points], "repeats": self.sweep.repeats,
               "testbed": self.sweep.testbed,
               "topologies": [_shape(t, profiles=True) for t in self.topologies]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _resolve(path: str, base_dir: str) -> str:
    """A file named in the sweep file: next to it first, else as given (a bare topology name stays)."""
    near = Path(base_dir) / path
    return str(near) if not Path(path).is_absolute() and near.is_file() else path


def link_sets(key: str, value: Any, topo_data_tiers: Sequence[str]) -> list[str]:
    """`link.FIELD=V` as overrides: that field on every tier the topology has, and its link default."""
    fld = key.split(".", 1)[1]
    text = _yaml_scalar(value)
    return [f"tiers.{t}.{fld}={text}" for t in topo_data_tiers] + [f"defaults.link.{fld}={text}"]


def _yaml_scalar(value: Any) -> str:
    return "null" if value is None else (json.dumps(value) if isinstance(value, str) else repr(value))


def _expected_profile(fld: str, value: Any) -> Any:
    from testbed.topology.units import parse_bandwidth, parse_loss, parse_time

    if value is None:
        return {"bandwidth": None, "delay": 0.0, "jitter": 0.0, "loss": 0.0, "queue": None}[fld]
    return {"bandwidth": parse_bandwidth, "delay": parse_time, "jitter": parse_time, "loss": parse_loss,
            "queue": int}[fld](value)


_ATTR = {"bandwidth": "bandwidth_bps", "delay": "delay_s", "jitter": "jitter_s", "loss": "loss", "queue": "queue"}


def make_plan(sweep: Sweep, load: Callable[[str, Sequence[str]], Topology] | None = None) -> Plan:
    """Every point with its topology loaded and checked. `load(spec, overrides)`: the topology
    loader (default: what `testbed up` uses); a problem names the sweep file and the point."""
    if load is None:
        from testbed.topology.mininet_import import load_any

        def load(spec: str, sets: Sequence[str]) -> Topology:
            return load_any(spec, sets)[0]

    src = sweep.source
    topo_spec = _resolve(sweep.topology, sweep.base_dir)
    try:
        base = load(topo_spec, sweep.sets)
    except TopologyError as exc:
        raise TopologyError(f"topology {sweep.topology!r} with set: {exc}", file=src, path="topology") from None
    tiers = sorted({link.tier for link in base.links})
    points, topologies = [], []
    for i, params in enumerate(sweep.points):
        where = f"grid ({', '.join(f'{k}={v}' for k, v in params)})" if sweep.grid else f"points[{i}]"
        values = dict(params)
        sets = list(sweep.sets)
        for key, value in params:
            if key.startswith("link."):
                sets += link_sets(key, value, tiers)
            elif key not in ("dilation", "scenario") and not key.startswith("job."):
                sets.append(f"{key}={_yaml_scalar(value)}")
        try:
            topo = load(topo_spec, sets)
        except TopologyError as exc:
            raise TopologyError(f"this point's topology: {exc}", file=src, path=where) from None
        for key, value in params:
            if key.startswith("link."):
                fld = key.split(".", 1)[1]
                want = _expected_profile(fld, value)
                for j, link in enumerate(topo.links):
                    if getattr(link.ab, _ATTR[fld]) != want or getattr(link.ba, _ATTR[fld]) != want:
                        raise TopologyError(f"{key}={value} does not reach link {link.a}-{link.b} (links[{j}] "
                                            f"sets its own {fld}, which a tier cannot override): sweep that "
                                            "link's own field instead", file=src, path=where)
        scenario = values.get("scenario", sweep.scenario) if "scenario" in values else sweep.scenario
        if scenario:
            scenario = _resolve(str(scenario), sweep.base_dir)
            from testbed.faults.scenario_loader import load_scenario

            try:
                load_scenario(scenario)
            except TopologyError as exc:
                raise TopologyError(f"scenario: {exc}", file=src, path=where) from None
        job = sweep.job
        if "job.steps" in values:
            job = replace(job, steps=int(values["job.steps"]))
        if "job.batch_size" in values:
            job = replace(job, batch_size=int(values["job.batch_size"]))
        if "job.args" in values:
            import shlex

            job = replace(job, args=job.args + tuple(shlex.split(str(values["job.args"] or ""))))
        dilation = str(values["dilation"]) if "dilation" in values else sweep.dilation
        points.append(Point(i, tuple(params), tuple(sets), dilation.lower() if dilation.isalpha() else dilation,
                            scenario or None, job))
        topologies.append(topo)
    return Plan(sweep, tuple(points), tuple(topologies))


# -- what a point changes --------------------------------------------------------------------------------------


def _shape(topo: Topology, profiles: bool = False) -> dict[str, Any]:
    """The topology as JSON without where it came from (and without link profiles unless asked)."""
    doc = topo.to_json()
    doc.pop("source", None)
    if not profiles:
        doc["links"] = [{"endpoints": link["endpoints"], "tier": link["tier"],
                         "mtu": [link["ab"].get("mtu"), link["ba"].get("mtu")]} for link in doc["links"]]
    return doc


def profile_changes(live: Topology, target: Topology) -> list[tuple[int, LinkProfile, LinkProfile]] | None:
    """The links whose profile differs between the testbed up now (`live`, its profiles as they run)
    and `target`, as (index, a->b, b->a) of the target; None when anything but the profiles that a
    running link can change (bandwidth, delay, jitter, loss, queue) differs: then only a new `up`
    gives the target."""
    if _shape(live) != _shape(target):
        return None
    return [(i, t.ab, t.ba) for i, (l, t) in enumerate(zip(live.links, target.links)) if (l.ab, l.ba) != (t.ab, t.ba)]


def direction_changes(old: LinkProfile, new: LinkProfile) -> dict[str, Any]:
    """The fields of one direction that differ, as `link set` takes them."""
    fields = ("bandwidth_bps", "delay_s", "jitter_s", "loss", "queue")
    return {f: getattr(new, f) for f in fields if getattr(old, f) != getattr(new, f)}


# -- how long ------------------------------------------------------------------------------------------------


def guess_run_s(point: Point, topo: Topology) -> float:
    """A run's wall time before anything was measured."""
    if point.job.main and not point.scenario:
        return GUESS_RUN_S_PER_RANK_STEP * len(topo.workers) * point.job.steps
    return GUESS_COMMAND_RUN_S


def guess_build_s(point: Point, topo: Topology) -> float:
    """A fresh `up` (and `down` of the one before)."""
    return 2 * GUESS_UP_S_PER_NODE * len(topo.nodes)


def estimate_seconds(plan: Plan, left: Sequence[Run], builds: Sequence[bool],
                     measured_run_s: Sequence[float] = (), measured_build_s: Sequence[float] = ()) -> float:
    """Seconds the runs `left` should take; builds[i]: whether run i needs a fresh `up` first.
    The sweep's own measured times (medians) replace the guesses once there are any."""
    import statistics

    run_s = statistics.median(measured_run_s) if measured_run_s else None
    build_s = statistics.median(measured_build_s) if measured_build_s else None
    total = 0.0
    for run, build in zip(left, builds):
        topo = plan.topology(run.point)
        total += run_s if run_s is not None else guess_run_s(run.point, topo)
        if build:
            total += build_s if build_s is not None else guess_build_s(run.point, topo)
    return total


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


# -- the swept values as numbers (tables and plots) ----------------------------------------------------------


def numeric(key: str, value: Any) -> float | None:
    """A parameter's value as a number in the unit it is plotted in (Gbit/s, ms, %), or None."""
    from testbed.topology.units import parse_bandwidth, parse_loss, parse_time

    if value is None or isinstance(value, bool):
        return None
    last = key.rsplit(".", 1)[-1]
    try:
        if last == "bandwidth":
            return parse_bandwidth(value) / 1e9
        if last in ("delay", "jitter"):
            return parse_time(value) * 1e3
        if last == "loss":
            return parse_loss(value) * 100
        return float(value)
    except (TypeError, ValueError):
        return None


def unit(key: str) -> str:
    last = key.rsplit(".", 1)[-1]
    return {"bandwidth": "Gbit/s", "delay": "ms", "jitter": "ms", "loss": "%"}.get(last, "")


__all__ = ["Point", "Run", "Plan", "make_plan", "profile_changes", "effective_topology", "direction_changes",
           "estimate_seconds", "format_duration", "numeric", "unit", "LINK_FIELDS"]
