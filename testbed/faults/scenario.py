"""Scenario files: a timeline of faults played against a running job.

Three stages, the first two pure (no I/O beyond reading the file):

1. `load_scenario` / `scenario_from_data`: the YAML's shape, field by field
   (unknown fields, bad units and bad actions are refused naming the field);
2. `plan_scenario(scenario, topology, dilation)`: resolves the timeline against
   a topology: names checked, random picks made with ``random.Random(seed)``
   (so the same file and seed always give the same plan), `for:` reverts and
   flaps expanded into primitive steps, overlapping contradictory events on one
   link or node refused. The result is a `Plan`: a list of `Step`s sorted by time;
3. `play` (in testbed.faults.player): applies each step at its time through
   testbed.faults.control and writes the event log.

A scenario file::

    name: core-flap
    seed: 7
    topology: fat-tree          # optional: what `scenario plan` uses when no testbed is up
    job:
      workers: all              # all | N (the first N workers) | [w0, w4, ...]
      command: python examples/train_ddp.py --steps 300
      timeout: 120s             # wall-clock limit of the run (emulated time: scaled by dilation)
      hang_after: 30s           # no step progress for this long: the run is `hung`
      startup: 180s             # ... but the first step may take this long (imports, rendezvous)
      phantoms: true            # optional: the first worker runs the command, the others are
                                # phantom ranks (testbed run --real); or real: [w0, w4]
    events:
      - name: cut               # optional: what expect: calls it (else "event 1")
        at: 10s
        link: [agg0-0, core0]
        action: down
        for: 5s
      - at: 20s
        link: [edge1-0, agg1-0]
        action: flap            # down at at + i*every, up down_for (default every/2) later
        every: 2s
        count: 5
      - at: 30s
        link: {tier: agg-core, pick: random}
        set: {loss: 2%}
        direction: both         # both | A->B | B->A (A, B as written in `link:`)
        for: 10s
      - at: 45s
        node: core1
        action: down
    expect:                     # judged after the run (testbed.faults.expect)
      - outcome: completed
      - recovers: {after: cut, within: 5s}
      - slowdown: {during: cut, at_most: 3}

A fault-tolerant job is written in place of `command:` as its groups and services (testbed.jobs.groups:
each group a torch world of its own, restarted when it fails; services beside them), the same
mapping a job file holds (a `command:` naming a job file works too). `env:` is then every rank's,
`{addr:NAME}` in it and in the commands is NAME's address, and the job's workers are the groups'::

    job:
      env: {TORCHFT_LIGHTHOUSE: "http://{addr:lighthouse}:29510"}
      services:
        lighthouse: {workers: [w0], command: 'torchft_lighthouse --min_replicas 1 --bind "[::]:29510"'}
      groups:
        g0: {workers: [w1], command: python examples/train_torchft.py, restarts: 3}
        g1: {workers: [w2], command: python examples/train_torchft.py, restarts: 3}
      timeout: 180s

Targets: ``link: [A, B]`` or ``link: {tier: T, node: N, pick: random|all|K}``;
``node: NAME`` or ``node: {kind: worker|switch, pick: random|all|K, exclude: [..]}``;
``partition: [[w0, w1], [w2, w3]]`` (or ``["w0,w1", "w2,w3"]``); ``heal: true``.
Actions: link down|up|flap|reset|set; node down|up|crash|slow (``cpus: 0.2``)|restore.
"""

from __future__ import annotations

import math
import random
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from testbed.errors import TopologyError
from testbed.faults.expect import EventInfo, ExpectError, Expectation, event_label, parse_expectations
from testbed.topology.model import Topology
from testbed.topology.units import format_bandwidth, format_time, parse_bandwidth, parse_loss, parse_time

if TYPE_CHECKING:
    from testbed.jobs.groups import Job

__all__ = ["ScenarioError", "JobSpec", "Event", "Scenario", "Step", "Plan", "load_scenario",
           "scenario_from_data", "plan_scenario", "parse_link_changes", "parse_direction",
           "SET_FIELDS", "DIRECTIONS"]

TOP_FIELDS = ("name", "description", "seed", "topology", "job", "events", "expect")
JOB_FIELDS = ("workers", "command", "groups", "services", "timeout", "hang_after", "startup", "env", "phantoms",
              "real")
EVENT_FIELDS = ("name", "at", "link", "node", "partition", "heal", "action", "set", "direction", "for",
                "every", "count", "down_for", "cpus", "note")
LINK_SELECT_FIELDS = ("tier", "node", "pick")
NODE_SELECT_FIELDS = ("kind", "pick", "exclude")
SET_FIELDS = ("bandwidth", "delay", "jitter", "loss", "queue")
DIRECTIONS = ("both", "A->B", "B->A")
LINK_ACTIONS = ("down", "up", "flap", "reset", "set")
NODE_ACTIONS = ("down", "up", "crash", "slow", "restore")

_EVENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_EVENT_N = re.compile(r"^event\s*\d+$", re.IGNORECASE)

DEFAULT_HANG_AFTER_S = 30.0
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_STARTUP_S = 180.0


class ScenarioError(TopologyError):
    """A scenario file is malformed or does not fit the topology: exit status 2, naming file, field and value."""

    exit_code = 2

    def with_file(self, file: str) -> "ScenarioError":
        if self.file:
            return self
        return ScenarioError(self.reason, file=file, path=self.path, value=self.value)


# -- the parsed file ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    workers: str | int | tuple[str, ...] = "all"   # "all", the first N, or names
    command: str | tuple[str, ...] = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    hang_after_s: float = DEFAULT_HANG_AFTER_S
    env: tuple[tuple[str, str], ...] = ()
    startup_s: float = DEFAULT_STARTUP_S           # the first step may take this long (imports, rendezvous)
    real: tuple[str, ...] | None = None            # phantoms: the workers that run the command (None: all)
    phantoms: bool = False                         # phantoms: true without real: the first worker is real
    groups: "Job | None" = None                    # groups and services in place of a command (their env: `env`)

    def resolve_real(self, workers: Sequence[str]) -> list[str] | None:
        """The workers that run the command when the others are phantoms (None: every worker runs it)."""
        if self.real is not None:
            return list(self.real)
        return list(workers[:1]) if self.phantoms else None

    def resolve_workers(self, topo: Topology) -> list[str]:
        if self.workers == "all":
            return list(topo.workers)
        if isinstance(self.workers, int):
            return list(topo.workers[: self.workers])
        return list(self.workers)

    def to_json(self) -> dict[str, Any]:
        out = {"workers": list(self.workers) if isinstance(self.workers, tuple) else self.workers,
               "command": list(self.command) if isinstance(self.command, tuple) else self.command,
               "timeout_s": self.timeout_s, "hang_after_s": self.hang_after_s, "startup_s": self.startup_s,
               "env": dict(self.env), "real": None if self.real is None else list(self.real),
               "phantoms": self.phantoms or self.real is not None}
        if self.groups is not None:
            out["groups"] = [g.to_json() for g in self.groups.groups]
        return out


@dataclass(frozen=True)
class Event:
    """One entry of `events:` as written (targets not yet resolved against a topology)."""

    index: int
    path: str                          # "events[3]", for error messages
    at_s: float
    target: str                        # "link" | "node" | "partition" | "heal"
    selector: Any                      # ("A", "B") | {"tier":..} | "NODE" | {"kind":..} | groups | None
    action: str                        # down, up, flap, reset, set, crash, slow, restore, partition, heal
    changes: tuple[tuple[str, Any], ...] = ()   # set: parsed values (bandwidth_bps, delay_s, ...)
    direction: str = "both"
    for_s: float | None = None
    every_s: float | None = None
    count: int | None = None
    down_for_s: float | None = None
    cpus: float | None = None
    note: str | None = None
    name: str | None = None            # what `expect:` calls it (None: "event N", 1-based)

    @property
    def label(self) -> str:
        return event_label(self.index, self.name)

    @property
    def lasts(self) -> bool:
        """It has a duration: a `for:`, or a flap (down and up again)."""
        return self.for_s is not None or self.action == "flap"


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    job: JobSpec
    events: tuple[Event, ...]
    description: str | None = None
    topology: str | None = None
    topology_overrides: tuple[str, ...] = ()
    source: str | None = None
    expect: tuple[Expectation, ...] = ()

    def load_topology(self) -> Topology:
        """The topology the scenario names (`topology:`), looked up next to the file first."""
        from testbed.topology.loader import load_topology

        if not self.topology:
            raise ScenarioError("the scenario names no topology (topology:) and no testbed is given",
                                file=self.source, path="topology")
        spec = self.topology
        if self.source:
            near = Path(self.source).parent / spec
            if near.is_file():
                spec = str(near)
        return load_topology(spec, self.topology_overrides)


# -- the plan ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One primitive change at emulated time `t` (seconds from the job's start).

    op: link_down, link_up, link_set (params: changes, direction), link_restore (params:
    fields, direction: back to the topology's values), link_reset, node_down, node_up,
    node_crash, node_slow (params: cpus), node_restore, partition (params: groups), heal.
    """

    t: float
    op: str
    target: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()
    event: int = -1
    revert: bool = False

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def describe(self) -> str:
        p = self.kwargs
        tgt = " ".join(self.target)
        if self.op == "link_set":
            text = f"link set {tgt} {format_changes(dict(p['changes']))}"
            if p.get("direction", "both") != "both":
                text += f" ({p['direction']})"
        elif self.op == "link_restore":
            text = f"link restore {tgt} {','.join(p['fields'])}"
            if p.get("direction", "both") != "both":
                text += f" ({p['direction']})"
        elif self.op == "node_slow":
            text = f"node slow {tgt} cpus={p['cpus']:g}"
        elif self.op == "partition":
            text = "partition " + " | ".join(",".join(g) for g in p["groups"])
        elif self.op == "heal":
            text = "heal"
        else:
            kind, verb = self.op.split("_", 1)
            text = f"{kind} {verb} {tgt}"
        return text + (" (revert)" if self.revert else "")

    def to_json(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for k, v in self.params:
            if k == "changes":
                v = dict(v)
            elif k == "groups":
                v = [list(g) for g in v]
            elif k == "fields":
                v = list(v)
            params[k] = v
        return {"t": self.t, "op": self.op, "target": list(self.target), "params": params,
                "event": self.event, "revert": self.revert, "what": self.describe()}


@dataclass
class Plan:
    scenario: str
    seed: int
    steps: list[Step]
    workers: list[str]
    dilation: float = 1.0
    job: JobSpec = field(default_factory=JobSpec)
    expect: tuple[Expectation, ...] = ()
    event_labels: tuple[str, ...] = ()   # event index -> how the file names it (its name, or "event N")

    def wall(self, step: Step) -> float:
        """Wall-clock offset of a step: emulated time scaled by the dilation factor."""
        return step.t * self.dilation

    @property
    def end_s(self) -> float:
        return max((s.t for s in self.steps), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "seed": self.seed, "dilation": self.dilation,
                "workers": self.workers, "job": self.job.to_json(),
                "steps": [dict(s.to_json(), wall_t=self.wall(s)) for s in self.steps],
                "event_labels": list(self.event_labels), "expect": [e.to_json() for e in self.expect]}

    def format(self) -> str:
        head = f"scenario {self.scenario} (seed {self.seed}): {len(self.steps)} steps, " \
               f"job on {len(self.workers)} workers"
        real = self.job.resolve_real(self.workers)
        if real is not None:
            head += f" ({', '.join(real)} real, {len(self.workers) - len(real)} phantom(s))"
        if self.dilation != 1:
            head += f", time dilation {self.dilation:g} (wall = {self.dilation:g} x at)"
        lines = [head]
        for g in self.job.groups.groups if self.job.groups is not None else ():
            again = f", restarts {g.restarts}" if g.restarts else ""
            lines.append(f"  {g.kind} {g.name} on {','.join(g.workers)}{again}: {shlex.join(g.cmd)}")
        lines.append(f"{'at':>10}  {'wall':>10}  {'event':<6} change")
        for s in self.steps:
            name = self.event_labels[s.event] if 0 <= s.event < len(self.event_labels) else ""
            name = f"  ({name})" if name and not name.startswith("event ") else ""
            lines.append(f"{_fmt_s(s.t):>10}  {_fmt_s(self.wall(s)):>10}  #{s.event:<5} {s.describe()}{name}")
        if self.expect:
            lines.append(f"expectations ({len(self.expect)}), judged after the run:")
            lines.extend(f"  - {e.written}" for e in self.expect)
        return "\n".join(lines)


def _fmt_s(t: float) -> str:
    return f"{t:.3f}s"


def format_changes(changes: dict[str, Any]) -> str:
    out = []
    for k, v in changes.items():
        if k == "bandwidth_bps":
            out.append(f"bandwidth={format_bandwidth(v)}")
        elif k in ("delay_s", "jitter_s"):
            out.append(f"{k[:-2]}={format_time(v)}")
        elif k == "loss":
            out.append(f"loss={v * 100:g}%")
        else:
            out.append(f"{k}={v}")
    return " ".join(out)


# -- parsing helpers -----------------------------------------------------------------------------------------


def _err(ctx_file: str | None, message: str, path: str, *value: Any) -> ScenarioError:
    if value:
        return ScenarioError(message, file=ctx_file, path=path, value=value[0])
    return ScenarioError(message, file=ctx_file, path=path)


def _mapping(f: str | None, value: Any, path: str, allowed: Sequence[str]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _err(f, "expected a mapping", path or "(top level)", value)
    for key in value:
        if key not in allowed:
            raise _err(f, f"unknown field; allowed fields: {', '.join(allowed)}",
                       f"{path}.{key}" if path else str(key), key)
    return value


def _time(f: str | None, value: Any, path: str) -> float:
    try:
        return parse_time(value)
    except ValueError as e:
        raise _err(f, str(e), path, value) from None


def parse_link_changes(raw: dict[str, Any], *, file: str | None = None, path: str = "set") -> dict[str, Any]:
    """A `set:` mapping (bandwidth, delay, jitter, loss, queue) as LinkProfile fields.

    Used by scenario files and by `testbed link set` alike, so both accept the same units.
    """
    raw = _mapping(file, raw, path, SET_FIELDS)
    if not raw:
        raise _err(file, f"nothing to set: give at least one of {', '.join(SET_FIELDS)}", path)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        p = f"{path}.{key}"
        try:
            if key == "bandwidth":
                out["bandwidth_bps"] = parse_bandwidth(value)
            elif key == "delay":
                out["delay_s"] = parse_time(value)
            elif key == "jitter":
                out["jitter_s"] = parse_time(value)
            elif key == "loss":
                out["loss"] = parse_loss(value)
            elif key == "queue":
                if isinstance(value, str) and value.strip().isdigit():
                    value = int(value.strip())
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError("queue must be a positive number of packets")
                out["queue"] = value
        except ValueError as e:
            raise _err(file, str(e), p, value) from None
    return out


def parse_direction(value: Any, *, file: str | None = None, path: str = "direction") -> str:
    if value is None:
        return "both"
    text = str(value).strip().replace(" ", "")
    aliases = {"both": "both", "a->b": "A->B", "b->a": "B->A", "forward": "A->B", "reverse": "B->A"}
    if text.lower() not in aliases:
        raise _err(file, f"direction must be one of {', '.join(DIRECTIONS)}", path, value)
    return aliases[text.lower()]


def _names(f: str | None, value: Any, path: str) -> tuple[str, ...]:
    """A list of node names, or a comma-separated string of them."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise _err(f, "expected a list of node names (or 'A,B,C')", path, value)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise _err(f, "expected a node name", f"{path}[{i}]", item)
    if not items:
        raise _err(f, "empty list of nodes", path, value)
    return tuple(items)


def _pick(f: str | None, value: Any, path: str) -> str | int:
    if value is None:
        return "all"
    if value in ("random", "all"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise _err(f, "pick must be random, all or a positive count", path, value)


# -- loading -------------------------------------------------------------------------------------------------


def load_scenario(file: str | Path) -> Scenario:
    """Read and check a scenario file (shape and units only; `plan_scenario` checks it against a topology)."""
    from testbed.topology.loader import parse_yaml

    source = str(file)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError("scenario file not found", file=source) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"cannot read the file: {e}", file=source) from None
    try:
        data = parse_yaml(text, source)
    except TopologyError as e:
        raise ScenarioError(e.reason, file=source, path=e.path, value=e.value) from None
    return scenario_from_data(data, source)


def scenario_from_data(data: Any, source: str | None = None) -> Scenario:
    f = source
    data = _mapping(f, data, "", TOP_FIELDS)
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _err(f, "a scenario needs a name", "name", name)
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _err(f, "seed must be an integer", "seed", seed)
    description = data.get("description")
    topology = data.get("topology")
    overrides: tuple[str, ...] = ()
    if isinstance(topology, dict):
        t = _mapping(f, topology, "topology", ("file", "set"))
        sets = t.get("set") or []
        if not isinstance(sets, list) or not all(isinstance(x, str) and "=" in x for x in sets):
            raise _err(f, "set must be a list of PATH=VALUE strings", "topology.set", sets)
        topology, overrides = t.get("file"), tuple(sets)
    if topology is not None and not isinstance(topology, str):
        raise _err(f, "topology must be a topology file or name (or {file: .., set: [..]})", "topology", topology)
    job = _job(f, data.get("job"))
    raw_events = data.get("events")
    if raw_events is None:
        raw_events = []
    if not isinstance(raw_events, list):
        raise _err(f, "events must be a list", "events", raw_events)
    events = tuple(_event(f, raw, i) for i, raw in enumerate(raw_events))
    seen: dict[str, Event] = {}
    for ev in events:
        if ev.name is not None:
            if ev.name in seen:
                raise _err(f, f"two events are named {ev.name!r} (the first: {seen[ev.name].path})",
                           f"{ev.path}.name", ev.name)
            seen[ev.name] = ev
    try:
        expect = parse_expectations(data.get("expect"), [EventInfo(e.name, e.lasts) for e in events], file=f)
    except ExpectError as e:
        raise ScenarioError(e.reason, file=e.file, path=e.path, value=e.value) from None
    return Scenario(name=name, seed=seed, job=job, events=events, description=description,
                    topology=topology, topology_overrides=overrides, source=source, expect=expect)


def _job(f: str | None, raw: Any) -> JobSpec:
    raw = _mapping(f, raw, "job", JOB_FIELDS)
    if not raw:
        raise _err(f, "a scenario needs a job (job.command, job.workers)", "job")
    workers: Any = raw.get("workers", "all")
    if workers == "all":
        pass
    elif isinstance(workers, int) and not isinstance(workers, bool):
        if workers < 1:
            raise _err(f, "workers must be all, a count >= 1 or a list of workers", "job.workers", workers)
    else:
        workers = _names(f, workers, "job.workers")
    groups = _groups(f, raw)
    command = raw.get("command", "" if groups is not None else None)
    if groups is not None:
        pass
    elif isinstance(command, list) and command and all(isinstance(c, str) for c in command):
        command = tuple(command)
    elif not isinstance(command, str) or not command.strip():
        raise _err(f, "job.command must be a command line (a string or a list of strings), or the job's "
                      "groups: (testbed run --job's form)", "job.command", command)
    timeout = _time(f, raw["timeout"], "job.timeout") if "timeout" in raw else DEFAULT_TIMEOUT_S
    hang = _time(f, raw["hang_after"], "job.hang_after") if "hang_after" in raw else DEFAULT_HANG_AFTER_S
    startup = _time(f, raw["startup"], "job.startup") if "startup" in raw else DEFAULT_STARTUP_S
    if startup <= 0:
        raise _err(f, "startup must be positive", "job.startup", raw.get("startup"))
    if timeout <= 0:
        raise _err(f, "timeout must be positive", "job.timeout", raw.get("timeout"))
    if hang <= 0:
        raise _err(f, "hang_after must be positive", "job.hang_after", raw.get("hang_after"))
    env = _mapping(f, raw.get("env"), "job.env", list(raw.get("env") or {}))
    env_items = []
    for k, v in env.items():
        if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
            raise _err(f, "env values must be strings or numbers", f"job.env.{k}", v)
        env_items.append((k, str(v)))
    phantoms = raw.get("phantoms", False)
    if not isinstance(phantoms, bool):
        raise _err(f, "phantoms must be true or false", "job.phantoms", phantoms)
    real = _names(f, raw["real"], "job.real") if "real" in raw else None
    if real is not None and "phantoms" in raw and not phantoms:
        raise _err(f, "real: names the workers that run the command while the others are phantoms; "
                      "it cannot go with phantoms: false", "job.phantoms", phantoms)
    if groups is not None and (phantoms or real is not None):
        raise _err(f, "groups run real commands: no phantoms: or real: with them",
                   "job.real" if real is not None else "job.phantoms", raw.get("real", phantoms))
    return JobSpec(workers=workers, command=command, timeout_s=timeout, hang_after_s=hang, env=tuple(env_items),
                   startup_s=startup, real=real, phantoms=phantoms or real is not None, groups=groups)


def _groups(f: str | None, raw: dict[str, Any]) -> "Job | None":
    """`job.groups:` and `job.services:` (testbed.jobs.groups' schema), or None when the job is a command."""
    if "groups" not in raw and "services" not in raw:
        return None
    from testbed.jobs import groups as groups_mod

    if "command" in raw:
        raise _err(f, "a job is a command or groups: (with services:), not both: each group names its command",
                   "job.command", raw["command"])
    try:
        return groups_mod.from_mapping({k: raw[k] for k in ("services", "groups") if k in raw}, f, "job")
    except groups_mod.JobError as e:
        raise ScenarioError(e.reason, file=f, path=e.path, value=e.value) from None


def _event(f: str | None, raw: Any, i: int) -> Event:
    path = f"events[{i}]"
    raw = _mapping(f, raw, path, EVENT_FIELDS)
    if "at" not in raw:
        raise _err(f, "an event needs a time (at: 10s)", f"{path}.at")
    at = _time(f, raw["at"], f"{path}.at")
    targets = [k for k in ("link", "node", "partition", "heal") if k in raw]
    if len(targets) != 1:
        raise _err(f, "an event acts on exactly one of link, node, partition, heal",
                   path, targets or None)
    target = targets[0]
    action = raw.get("action")
    if action is not None and not isinstance(action, str):
        raise _err(f, "action must be a word", f"{path}.action", action)
    for_s = _time(f, raw["for"], f"{path}.for") if "for" in raw else None
    if for_s is not None and for_s <= 0:
        raise _err(f, "for must be a positive duration", f"{path}.for", raw["for"])
    note = raw.get("note")
    ev_name = raw.get("name")
    if ev_name is not None and (not isinstance(ev_name, str) or not _EVENT_NAME.match(ev_name)):
        raise _err(f, "an event's name is a word (letters, digits, - _ .; expect: refers to it)",
                   f"{path}.name", ev_name)
    if ev_name is not None and _EVENT_N.match(ev_name):
        raise _err(f, "'event N' is how expectations name an unnamed event: choose another name",
                   f"{path}.name", ev_name)
    common: dict[str, Any] = {"index": i, "path": path, "at_s": at, "target": target, "for_s": for_s,
                              "note": str(note) if note is not None else None, "name": ev_name}

    def refuse_extra(allowed: Iterable[str]) -> None:
        allowed = set(allowed) | {"at", "note", "name", target}
        for key in raw:
            if key not in allowed:
                what = f"{action}" if action else target
                raise _err(f, f"field does not apply to a {target} {what} event", f"{path}.{key}", raw[key])

    if target == "link":
        sel = raw["link"]
        if isinstance(sel, list):
            if len(sel) != 2 or not all(isinstance(x, str) and x for x in sel):
                raise _err(f, "link must be [A, B] or {tier: .., pick: ..}", f"{path}.link", sel)
            if sel[0] == sel[1]:
                raise _err(f, "a link joins two different nodes", f"{path}.link", sel)
            selector: Any = (sel[0], sel[1])
        elif isinstance(sel, dict):
            sel = _mapping(f, sel, f"{path}.link", LINK_SELECT_FIELDS)
            if "tier" not in sel and "node" not in sel:
                raise _err(f, "a link selector needs tier and/or node", f"{path}.link", sel)
            for k in ("tier", "node"):
                if k in sel and not isinstance(sel[k], str):
                    raise _err(f, f"{k} must be a name", f"{path}.link.{k}", sel[k])
            selector = {"tier": sel.get("tier"), "node": sel.get("node"),
                        "pick": _pick(f, sel.get("pick"), f"{path}.link.pick")}
        else:
            raise _err(f, "link must be [A, B] or {tier: .., pick: ..}", f"{path}.link", sel)
        if action is None:
            action = "set" if "set" in raw else None
        if action not in LINK_ACTIONS:
            raise _err(f, f"a link action must be one of {', '.join(LINK_ACTIONS)}", f"{path}.action", action)
        ev = dict(common, selector=selector, action=action)
        if action == "set":
            if "set" not in raw:
                raise _err(f, "a set event needs set: {bandwidth|delay|jitter|loss|queue: ..}", f"{path}.set")
            ev["changes"] = tuple(parse_link_changes(raw["set"], file=f, path=f"{path}.set").items())
            ev["direction"] = parse_direction(raw.get("direction"), file=f, path=f"{path}.direction")
            refuse_extra(("action", "set", "direction", "for"))
        elif action == "flap":
            for key in ("every", "count"):
                if key not in raw:
                    raise _err(f, "a flap needs every: and count:", f"{path}.{key}")
            every = _time(f, raw["every"], f"{path}.every")
            if every <= 0:
                raise _err(f, "every must be a positive duration", f"{path}.every", raw["every"])
            count = raw["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise _err(f, "count must be an integer >= 1", f"{path}.count", count)
            down_for = _time(f, raw["down_for"], f"{path}.down_for") if "down_for" in raw else every / 2
            if not 0 < down_for < every:
                raise _err(f, "down_for must be positive and shorter than every", f"{path}.down_for",
                           raw.get("down_for"))
            ev.update(every_s=every, count=count, down_for_s=down_for)
            refuse_extra(("action", "every", "count", "down_for"))
        elif action in ("down", "up"):
            refuse_extra(("action", "for"))
        else:  # reset
            refuse_extra(("action",))
        return Event(**ev)

    if target == "node":
        sel = raw["node"]
        if isinstance(sel, str) and sel:
            selector = sel
        elif isinstance(sel, dict):
            sel = _mapping(f, sel, f"{path}.node", NODE_SELECT_FIELDS)
            kind = sel.get("kind")
            if kind not in (None, "worker", "switch"):
                raise _err(f, "kind must be worker or switch", f"{path}.node.kind", kind)
            exclude = _names(f, sel["exclude"], f"{path}.node.exclude") if "exclude" in sel else ()
            selector = {"kind": kind, "pick": _pick(f, sel.get("pick"), f"{path}.node.pick"), "exclude": exclude}
        else:
            raise _err(f, "node must be a node name or {kind: .., pick: ..}", f"{path}.node", sel)
        if action is None and "cpus" in raw:
            action = "slow"
        if action not in NODE_ACTIONS:
            raise _err(f, f"a node action must be one of {', '.join(NODE_ACTIONS)}", f"{path}.action", action)
        ev = dict(common, selector=selector, action=action)
        if action == "slow":
            cpus = raw.get("cpus")
            if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus < 1e4 \
                    or not math.isfinite(cpus):
                raise _err(f, "slow needs cpus: a positive number (e.g. 0.2)", f"{path}.cpus", cpus)
            ev["cpus"] = float(cpus)
            refuse_extra(("action", "cpus", "for"))
        elif action in ("down", "crash"):
            refuse_extra(("action", "for"))
        else:
            refuse_extra(("action",))
        return Event(**ev)

    if target == "partition":
        groups_raw = raw["partition"]
        if not isinstance(groups_raw, list) or not groups_raw:
            raise _err(f, "partition must be a list of groups: [[w0, w1], [w2, w3]]", f"{path}.partition",
                       groups_raw)
        groups = tuple(_names(f, g, f"{path}.partition[{j}]") for j, g in enumerate(groups_raw))
        if action not in (None, "partition"):
            raise _err(f, "a partition event has no other action", f"{path}.action", action)
        refuse_extra(("action", "for"))
        return Event(**dict(common, selector=groups, action="partition"))

    # heal
    if raw["heal"] is not True:
        raise _err(f, "write heal: true", f"{path}.heal", raw["heal"])
    if action not in (None, "heal"):
        raise _err(f, "a heal event has no other action", f"{path}.action", action)
    if for_s is not None:
        raise _err(f, "heal takes no for:", f"{path}.for", raw["for"])
    refuse_extra(("action",))
    return Event(**dict(common, selector=None, action="heal"))


# -- planning ------------------------------------------------------------------------------------------------


def resolve_partition_groups(groups: Sequence[Sequence[str]], topo: Topology, *, file: str | None = None,
                             path: str = "partition") -> tuple[tuple[str, ...], ...]:
    """Groups of workers. A switch stands for the workers attached to it; with one group the
    rest of the workers form the other; workers named in no group form one more group."""
    out: list[list[str]] = []
    seen: dict[str, int] = {}
    for j, group in enumerate(groups):
        members: list[str] = []
        for k, name in enumerate(group):
            p = f"{path}[{j}][{k}]"
            node = topo.nodes.get(name)
            if node is None:
                raise _err(file, "unknown node", p, name)
            if node.is_worker:
                expanded = [name]
            else:
                expanded = [n for n in topo.neighbors(name) if topo.nodes[n].is_worker]
                if not expanded:
                    raise _err(file, "a switch in a partition stands for the workers attached to it; "
                                     "this one has none", p, name)
            for w in expanded:
                if w in seen and seen[w] != j:
                    raise _err(file, f"worker {w} is in two groups", p, name)
                if w not in seen:
                    seen[w] = j
                    members.append(w)
        out.append(members)
    rest = [w for w in topo.workers if w not in seen]
    if rest:
        out.append(rest)
    if len(out) < 2:
        raise _err(file, "a partition needs at least two groups of workers", path,
                   [list(g) for g in groups])
    return tuple(tuple(g) for g in out)


@dataclass
class _Use:
    """What an event holds on a resource over [start, end) (end == start: an instant)."""

    event: Event
    start: float
    end: float
    resource: tuple[str, ...]  # ("link", a, b) | ("node", n) | ("cpu", n) | ("partition",)
    kind: str                  # "admin" | "shape" | "all"
    fields: frozenset[str] = frozenset()
    directions: frozenset[str] = frozenset()

    def overlaps(self, other: "_Use") -> bool:
        if self.start == self.end and other.start == other.end:
            return self.start == other.start
        if self.start == self.end:
            return other.start <= self.start < other.end
        if other.start == other.end:
            return self.start <= other.start < self.end
        return self.start < other.end and other.start < self.end

    def conflicts(self, other: "_Use") -> bool:
        if self.resource != other.resource or not self.overlaps(other):
            return False
        if "all" in (self.kind, other.kind):
            return True
        if self.kind != other.kind:
            return False
        if self.kind == "shape":
            return bool(self.fields & other.fields) and bool(self.directions & other.directions)
        return True


def _dirs(direction: str, a: str, b: str, key: tuple[str, str]) -> frozenset[str]:
    """Directions as (from, to) strings relative to the canonical link key."""
    fwd, rev = f"{key[0]}>{key[1]}", f"{key[1]}>{key[0]}"
    if direction == "both":
        return frozenset((fwd, rev))
    frm, to = (a, b) if direction == "A->B" else (b, a)
    return frozenset((f"{frm}>{to}",))


def plan_scenario(scenario: Scenario, topo: Topology, dilation: float = 1.0) -> Plan:
    """Resolve a scenario against a topology: deterministic for a given file, seed and topology."""
    f = scenario.source
    rng = random.Random(scenario.seed)
    steps: list[Step] = []
    uses: list[_Use] = []

    workers = scenario.job.resolve_workers(topo)
    for w in workers:
        node = topo.nodes.get(w)
        if node is None or not node.is_worker:
            raise _err(f, "unknown worker" if node is None else "not a worker", "job.workers", w)
    if isinstance(scenario.job.workers, int) and scenario.job.workers > len(topo.workers):
        raise _err(f, f"the topology has only {len(topo.workers)} workers", "job.workers", scenario.job.workers)
    if len(set(workers)) != len(workers):
        raise _err(f, "a worker is named twice", "job.workers", list(workers))
    if scenario.job.groups is not None:
        workers = _group_workers(scenario, topo, workers)
    real = scenario.job.resolve_real(workers)
    if real is not None:
        stray = [w for w in real if w not in workers]
        if stray:
            raise _err(f, "not one of the job's workers", "job.real", stray[0])
        if len(set(real)) == len(workers):
            raise _err(f, "every worker of the job is real: no phantom is left (drop real:, or name fewer)",
                       "job.real", list(real))

    def link_key(a: str, b: str) -> tuple[str, str]:
        link = topo.link_between(a, b)
        assert link is not None
        return (link.a, link.b)

    def pick(candidates: list, how: str | int, path: str) -> list:
        if not candidates:
            raise _err(f, "the selector matches nothing in this topology", path)
        if how == "all":
            return candidates
        if how == "random":
            return [rng.choice(candidates)]
        if how > len(candidates):
            raise _err(f, f"only {len(candidates)} match", f"{path}.pick", how)
        return sorted(rng.sample(candidates, how), key=candidates.index)

    for ev in scenario.events:
        p = ev.path
        if ev.target == "link":
            if isinstance(ev.selector, tuple):
                a, b = ev.selector
                for end in (a, b):
                    if end not in topo.nodes:
                        raise _err(f, "unknown node", f"{p}.link", end)
                if topo.link_between(a, b) is None:
                    raise _err(f, "no such link in the topology", f"{p}.link", [a, b])
                chosen = [(a, b)]
            else:
                sel = ev.selector
                if sel["tier"] is not None and sel["tier"] not in topo.tiers():
                    raise _err(f, f"unknown tier; tiers: {', '.join(topo.tiers())}", f"{p}.link.tier", sel["tier"])
                if sel["node"] is not None and sel["node"] not in topo.nodes:
                    raise _err(f, "unknown node", f"{p}.link.node", sel["node"])
                cands = [(l.a, l.b) for l in topo.links
                         if (sel["tier"] is None or l.tier == sel["tier"])
                         and (sel["node"] is None or sel["node"] in (l.a, l.b))]
                chosen = pick(cands, sel["pick"], f"{p}.link")
            for a, b in chosen:
                _plan_link_event(ev, a, b, link_key(a, b), steps, uses)
        elif ev.target == "node":
            if isinstance(ev.selector, str):
                if ev.selector not in topo.nodes:
                    raise _err(f, "unknown node", f"{p}.node", ev.selector)
                chosen_nodes = [ev.selector]
            else:
                sel = ev.selector
                for k, name in enumerate(sel["exclude"]):
                    if name not in topo.nodes:
                        raise _err(f, "unknown node", f"{p}.node.exclude[{k}]", name)
                cands = [n.name for n in topo.nodes.values()
                         if (sel["kind"] is None or n.kind == sel["kind"]) and n.name not in sel["exclude"]]
                if ev.action in ("crash", "slow"):
                    cands = [n for n in cands if topo.nodes[n].is_worker]
                chosen_nodes = pick(cands, sel["pick"], f"{p}.node")
            for n in chosen_nodes:
                node = topo.nodes[n]
                if ev.action in ("crash", "slow") and not node.is_worker:
                    raise _err(f, f"{ev.action} acts on workers only", f"{p}.node", n)
                _plan_node_event(ev, n, topo, link_key, steps, uses)
        elif ev.target == "partition":
            groups = resolve_partition_groups(ev.selector, topo, file=f, path=f"{p}.partition")
            steps.append(Step(ev.at_s, "partition", (), (("groups", groups),), ev.index))
            end = ev.at_s
            if ev.for_s is not None:
                end = ev.at_s + ev.for_s
                steps.append(Step(end, "heal", (), (), ev.index, revert=True))
            uses.append(_Use(ev, ev.at_s, end, ("partition",), "all"))
        else:  # heal
            steps.append(Step(ev.at_s, "heal", (), (), ev.index))
            uses.append(_Use(ev, ev.at_s, ev.at_s, ("partition",), "all"))

    _check_conflicts(f, uses)
    order = {id(s): i for i, s in enumerate(steps)}
    # Reverts first at equal times (a revert and a new event at one instant: undo, then apply).
    steps.sort(key=lambda s: (s.t, 0 if s.revert else 1, order[id(s)]))
    _check_expect_workers(scenario, workers, real)
    return Plan(scenario=scenario.name, seed=scenario.seed, steps=steps, workers=workers,
                dilation=float(dilation), job=scenario.job, expect=scenario.expect,
                event_labels=tuple(ev.label for ev in scenario.events))


def _group_workers(scenario: Scenario, topo: Topology, allowed: list[str]) -> list[str]:
    """The workers of a job of groups (those its groups and services name, in topology order), each
    a worker of the topology and of `job.workers` (when given), and every `{addr:NAME}` naming one
    of them, a group or a service."""
    f, job = scenario.source, scenario.job
    assert job.groups is not None
    for g in job.groups.groups:
        path = f"job.{g.kind}s.{g.name}"
        for w in g.workers:
            node = topo.nodes.get(w)
            if node is None or not node.is_worker:
                raise _err(f, f"{'unknown worker' if node is None else 'not a worker'}; the topology's workers: "
                              f"{', '.join(topo.workers)}", f"{path}.workers", w)
            if w not in allowed:
                raise _err(f, f"not one of the job's workers (job.workers: {', '.join(allowed)})", f"{path}.workers", w)
        for c in g.cmd:
            _check_addr_names(f, c, f"{path}.command", job.groups, topo)
    for k, v in job.env:
        _check_addr_names(f, v, f"job.env.{k}", job.groups, topo)
    return [w for w in allowed if w in job.groups.workers]


def _check_addr_names(f: str | None, text: str, path: str, job: "Job", topo: Topology) -> None:
    from testbed.jobs import groups as groups_mod

    for name in groups_mod.addr_names(text):
        if name not in topo.workers and all(g.name != name for g in job.groups):
            raise _err(f, f"{{addr:{name}}}: no group, service or worker of that name", path, text)


def _check_expect_workers(scenario: Scenario, workers: list[str], real: list[str] | None) -> None:
    """`workers:` of an expectation names workers of the job that record steps (phantoms record none)."""
    for e in scenario.expect:
        for k, w in enumerate(e.workers or ()):
            path = f"{e.path}.{e.kind}.workers[{k}]"
            if w not in workers:
                raise _err(scenario.source, f"not one of the job's workers ({', '.join(workers)})", path, w)
            if real is not None and w not in real:
                raise _err(scenario.source, "a phantom rank's worker: phantoms record no steps", path, w)
            if scenario.job.groups is not None and \
                    all(w not in g.workers for g in scenario.job.groups.groups if not g.service):
                raise _err(scenario.source, "a service's worker only: the probe records the steps of groups' ranks",
                           path, w)


def _plan_link_event(ev: Event, a: str, b: str, key: tuple[str, str], steps: list[Step], uses: list[_Use]) -> None:
    res = ("link",) + key
    t = ev.at_s
    if ev.action in ("down", "up"):
        other = "up" if ev.action == "down" else "down"
        steps.append(Step(t, f"link_{ev.action}", (a, b), (), ev.index))
        end = t
        if ev.for_s is not None:
            end = t + ev.for_s
            steps.append(Step(end, f"link_{other}", (a, b), (), ev.index, revert=True))
        uses.append(_Use(ev, t, end, res, "admin"))
    elif ev.action == "flap":
        assert ev.every_s is not None and ev.count is not None and ev.down_for_s is not None
        for i in range(ev.count):
            s = t + i * ev.every_s
            steps.append(Step(s, "link_down", (a, b), (), ev.index))
            steps.append(Step(s + ev.down_for_s, "link_up", (a, b), (), ev.index, revert=True))
        uses.append(_Use(ev, t, t + (ev.count - 1) * ev.every_s + ev.down_for_s, res, "admin"))
    elif ev.action == "reset":
        steps.append(Step(t, "link_reset", (a, b), (), ev.index))
        uses.append(_Use(ev, t, t, res, "all"))
    else:  # set
        changes = ev.changes
        params = (("changes", changes), ("direction", ev.direction))
        steps.append(Step(t, "link_set", (a, b), params, ev.index))
        end = t
        fields = tuple(k for k, _ in changes)
        if ev.for_s is not None:
            end = t + ev.for_s
            steps.append(Step(end, "link_restore", (a, b), (("fields", fields), ("direction", ev.direction)),
                              ev.index, revert=True))
        uses.append(_Use(ev, t, end, res, "shape", frozenset(fields), _dirs(ev.direction, a, b, key)))


def _plan_node_event(ev: Event, n: str, topo: Topology, link_key, steps: list[Step], uses: list[_Use]) -> None:
    t = ev.at_s
    end = t if ev.for_s is None else t + ev.for_s
    if ev.action == "slow":
        steps.append(Step(t, "node_slow", (n,), (("cpus", ev.cpus),), ev.index))
        if ev.for_s is not None:
            steps.append(Step(end, "node_restore", (n,), (), ev.index, revert=True))
        uses.append(_Use(ev, t, end, ("cpu", n), "all"))
        return
    if ev.action == "restore":
        steps.append(Step(t, "node_restore", (n,), (), ev.index))
        uses.append(_Use(ev, t, t, ("cpu", n), "all"))
        return
    op = {"down": "node_down", "up": "node_up", "crash": "node_crash"}[ev.action]
    steps.append(Step(t, op, (n,), (), ev.index))
    if ev.for_s is not None:
        steps.append(Step(end, "node_up", (n,), (), ev.index, revert=True))
    uses.append(_Use(ev, t, end, ("node", n), "all"))
    # A node going down or up takes its links with it: it contradicts link up/down events meanwhile.
    for link in topo.links_of(n):
        uses.append(_Use(ev, t, end, ("link",) + link_key(link.a, link.b), "admin"))


def _check_conflicts(f: str | None, uses: list[_Use]) -> None:
    for i, u in enumerate(uses):
        for v in uses[:i]:
            if u.event.index == v.event.index:
                continue
            if u.conflicts(v):
                what = " ".join(u.resource[1:]) or u.resource[0]
                first, second = sorted((u.event, v.event), key=lambda e: e.index)
                raise _err(f, f"contradicts {first.path} on {u.resource[0]} {what} "
                              f"(both act on it between {_fmt_s(max(u.start, v.start))} and "
                              f"{_fmt_s(max(min(u.end, v.end), max(u.start, v.start)))})",
                           second.path, second.action)
