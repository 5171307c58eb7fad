"""Scenario files: a timeline of faults played against a running job. This module is the file's
schema: its fields, their parsed form (JobSpec, Event, Scenario), the error every stage raises, and
the checks of one field's value (times, names, picks, a link's `set:` and `direction:`).

Three stages, the first two pure (no I/O beyond reading the file):

1. `load_scenario` / `scenario_from_data` (testbed.faults.scenario_loader): the YAML's shape, field
   by field (unknown fields, bad units and bad actions are refused naming the field);
2. `plan_scenario(scenario, topology, dilation)` (testbed.faults.scenario_planner): resolves the
   timeline against a topology: names checked, random picks made with ``random.Random(seed)``
   (so the same file and seed always give the same plan), `for:` reverts and
   flaps expanded into primitive steps, overlapping contradictory events on one
   link or node refused. The result is a `Plan` (testbed.faults.scenario_plan): a list of `Step`s
   sorted by time;
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

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from testbed.errors import TopologyError
from testbed.faults.expect import Expectation, event_label
from testbed.topology.model import Topology
from testbed.topology.units import format_bandwidth, format_time, parse_bandwidth, parse_loss, parse_time

if TYPE_CHECKING:
    from testbed.jobs.groups import Job

__all__ = ["ScenarioError", "JobSpec", "Event", "Scenario", "parse_link_changes", "parse_direction",
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


# -- one field's value ---------------------------------------------------------------------------------------


def field_error(ctx_file: str | None, message: str, path: str, *value: Any) -> ScenarioError:
    """The error naming a field (a dotted path); the value shows only when one is given (it may be None)."""
    if value:
        return ScenarioError(message, file=ctx_file, path=path, value=value[0])
    return ScenarioError(message, file=ctx_file, path=path)


def read_mapping(f: str | None, value: Any, path: str, allowed: Sequence[str]) -> dict:
    """A mapping of the allowed fields only (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise field_error(f, "expected a mapping", path or "(top level)", value)
    for key in value:
        if key not in allowed:
            raise field_error(f, f"unknown field; allowed fields: {', '.join(allowed)}",
                              f"{path}.{key}" if path else str(key), key)
    return value


def read_time(f: str | None, value: Any, path: str) -> float:
    """A duration (10s, 250ms, ...) in seconds."""
    try:
        return parse_time(value)
    except ValueError as e:
        raise field_error(f, str(e), path, value) from None


def parse_link_changes(raw: dict[str, Any], *, file: str | None = None, path: str = "set") -> dict[str, Any]:
    """A `set:` mapping (bandwidth, delay, jitter, loss, queue) as LinkProfile fields.

    Used by scenario files and by `testbed link set` alike, so both accept the same units.
    """
    raw = read_mapping(file, raw, path, SET_FIELDS)
    if not raw:
        raise field_error(file, f"nothing to set: give at least one of {', '.join(SET_FIELDS)}", path)
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
            raise field_error(file, str(e), p, value) from None
    return out


def parse_direction(value: Any, *, file: str | None = None, path: str = "direction") -> str:
    if value is None:
        return "both"
    text = str(value).strip().replace(" ", "")
    aliases = {"both": "both", "a->b": "A->B", "b->a": "B->A", "forward": "A->B", "reverse": "B->A"}
    if text.lower() not in aliases:
        raise field_error(file, f"direction must be one of {', '.join(DIRECTIONS)}", path, value)
    return aliases[text.lower()]


def read_names(f: str | None, value: Any, path: str) -> tuple[str, ...]:
    """A list of node names, or a comma-separated string of them."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise field_error(f, "expected a list of node names (or 'A,B,C')", path, value)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise field_error(f, "expected a node name", f"{path}[{i}]", item)
    if not items:
        raise field_error(f, "empty list of nodes", path, value)
    return tuple(items)


def read_pick(f: str | None, value: Any, path: str) -> str | int:
    """A selector's pick: random, all (the default) or a count."""
    if value is None:
        return "all"
    if value in ("random", "all"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise field_error(f, "pick must be random, all or a positive count", path, value)


def format_changes(changes: dict[str, Any]) -> str:
    """parse_link_changes' result written back in its units, for plans and logs."""
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
