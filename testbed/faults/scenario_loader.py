"""Loading a scenario file: the YAML read, then walked field by field into a Scenario
(testbed.faults.scenario's schema): the job, each event with its target and action, the
`expect:` list. Shape and units only; `plan_scenario` checks the result against a topology.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from testbed.errors import TopologyError
from testbed.faults.expect import EventInfo, ExpectError, parse_expectations
from testbed.faults.scenario import (DEFAULT_HANG_AFTER_S, DEFAULT_STARTUP_S, DEFAULT_TIMEOUT_S, EVENT_FIELDS,
                                     JOB_FIELDS, LINK_ACTIONS, LINK_SELECT_FIELDS, NODE_ACTIONS, NODE_SELECT_FIELDS,
                                     TOP_FIELDS, Event, JobSpec, Scenario, ScenarioError, field_error,
                                     parse_direction, parse_link_changes, read_mapping, read_names, read_pick,
                                     read_time)

if TYPE_CHECKING:
    from testbed.jobs.groups import Job

__all__ = ["load_scenario", "scenario_from_data"]

_EVENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_EVENT_N = re.compile(r"^event\s*\d+$", re.IGNORECASE)


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
    data = read_mapping(f, data, "", TOP_FIELDS)
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise field_error(f, "a scenario needs a name", "name", name)
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise field_error(f, "seed must be an integer", "seed", seed)
    description = data.get("description")
    topology = data.get("topology")
    overrides: tuple[str, ...] = ()
    if isinstance(topology, dict):
        t = read_mapping(f, topology, "topology", ("file", "set"))
        sets = t.get("set") or []
        if not isinstance(sets, list) or not all(isinstance(x, str) and "=" in x for x in sets):
            raise field_error(f, "set must be a list of PATH=VALUE strings", "topology.set", sets)
        topology, overrides = t.get("file"), tuple(sets)
    if topology is not None and not isinstance(topology, str):
        raise field_error(f, "topology must be a topology file or name (or {file: .., set: [..]})", "topology",
                          topology)
    job = _job(f, data.get("job"))
    raw_events = data.get("events")
    if raw_events is None:
        raw_events = []
    if not isinstance(raw_events, list):
        raise field_error(f, "events must be a list", "events", raw_events)
    events = tuple(_event(f, raw, i) for i, raw in enumerate(raw_events))
    seen: dict[str, Event] = {}
    for ev in events:
        if ev.name is not None:
            if ev.name in seen:
                raise field_error(f, f"two events are named {ev.name!r} (the first: {seen[ev.name].path})",
                                  f"{ev.path}.name", ev.name)
            seen[ev.name] = ev
    try:
        expect = parse_expectations(data.get("expect"), [EventInfo(e.name, e.lasts) for e in events], file=f)
    except ExpectError as e:
        raise ScenarioError(e.reason, file=e.file, path=e.path, value=e.value) from None
    return Scenario(name=name, seed=seed, job=job, events=events, description=description,
                    topology=topology, topology_overrides=overrides, source=source, expect=expect)


def _job(f: str | None, raw: Any) -> JobSpec:
    raw = read_mapping(f, raw, "job", JOB_FIELDS)
    if not raw:
        raise field_error(f, "a scenario needs a job (job.command, job.workers)", "job")
    workers: Any = raw.get("workers", "all")
    if workers == "all":
        pass
    elif isinstance(workers, int) and not isinstance(workers, bool):
        if workers < 1:
            raise field_error(f, "workers must be all, a count >= 1 or a list of workers", "job.workers", workers)
    else:
        workers = read_names(f, workers, "job.workers")
    groups = _groups(f, raw)
    command = raw.get("command", "" if groups is not None else None)
    if groups is not None:
        pass
    elif isinstance(command, list) and command and all(isinstance(c, str) for c in command):
        command = tuple(command)
    elif not isinstance(command, str) or not command.strip():
        raise field_error(f, "job.command must be a command line (a string or a list of strings), or the job's "
                             "groups: (testbed run --job's form)", "job.command", command)
    timeout = read_time(f, raw["timeout"], "job.timeout") if "timeout" in raw else DEFAULT_TIMEOUT_S
    hang = read_time(f, raw["hang_after"], "job.hang_after") if "hang_after" in raw else DEFAULT_HANG_AFTER_S
    startup = read_time(f, raw["startup"], "job.startup") if "startup" in raw else DEFAULT_STARTUP_S
    if startup <= 0:
        raise field_error(f, "startup must be positive", "job.startup", raw.get("startup"))
    if timeout <= 0:
        raise field_error(f, "timeout must be positive", "job.timeout", raw.get("timeout"))
    if hang <= 0:
        raise field_error(f, "hang_after must be positive", "job.hang_after", raw.get("hang_after"))
    env = read_mapping(f, raw.get("env"), "job.env", list(raw.get("env") or {}))
    env_items = []
    for k, v in env.items():
        if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
            raise field_error(f, "env values must be strings or numbers", f"job.env.{k}", v)
        env_items.append((k, str(v)))
    phantoms = raw.get("phantoms", False)
    if not isinstance(phantoms, bool):
        raise field_error(f, "phantoms must be true or false", "job.phantoms", phantoms)
    real = read_names(f, raw["real"], "job.real") if "real" in raw else None
    if real is not None and "phantoms" in raw and not phantoms:
        raise field_error(f, "real: names the workers that run the command while the others are phantoms; "
                             "it cannot go with phantoms: false", "job.phantoms", phantoms)
    if groups is not None and (phantoms or real is not None):
        raise field_error(f, "groups run real commands: no phantoms: or real: with them",
                          "job.real" if real is not None else "job.phantoms", raw.get("real", phantoms))
    return JobSpec(workers=workers, command=command, timeout_s=timeout, hang_after_s=hang, env=tuple(env_items),
                   startup_s=startup, real=real, phantoms=phantoms or real is not None, groups=groups)


def _groups(f: str | None, raw: dict[str, Any]) -> "Job | None":
    """`job.groups:` and `job.services:` (testbed.jobs.groups' schema), or None when the job is a command."""
    if "groups" not in raw and "services" not in raw:
        return None
    from testbed.jobs import groups as groups_mod

    if "command" in raw:
        raise field_error(f, "a job is a command or groups: (with services:), not both: each group names its command",
                          "job.command", raw["command"])
    try:
        return groups_mod.from_mapping({k: raw[k] for k in ("services", "groups") if k in raw}, f, "job")
    except groups_mod.JobError as e:
        raise ScenarioError(e.reason, file=f, path=e.path, value=e.value) from None


def _event(f: str | None, raw: Any, i: int) -> Event:
    path = f"events[{i}]"
    raw = read_mapping(f, raw, path, EVENT_FIELDS)
    if "at" not in raw:
        raise field_error(f, "an event needs a time (at: 10s)", f"{path}.at")
    at = read_time(f, raw["at"], f"{path}.at")
    targets = [k for k in ("link", "node", "partition", "heal") if k in raw]
    if len(targets) != 1:
        raise field_error(f, "an event acts on exactly one of link, node, partition, heal",
                          path, targets or None)
    target = targets[0]
    action = raw.get("action")
    if action is not None and not isinstance(action, str):
        raise field_error(f, "action must be a word", f"{path}.action", action)
    for_s = read_time(f, raw["for"], f"{path}.for") if "for" in raw else None
    if for_s is not None and for_s <= 0:
        raise field_error(f, "for must be a positive duration", f"{path}.for", raw["for"])
    note = raw.get("note")
    ev_name = raw.get("name")
    if ev_name is not None and (not isinstance(ev_name, str) or not _EVENT_NAME.match(ev_name)):
        raise field_error(f, "an event's name is a word (letters, digits, - _ .; expect: refers to it)",
                          f"{path}.name", ev_name)
    if ev_name is not None and _EVENT_N.match(ev_name):
        raise field_error(f, "'event N' is how expectations name an unnamed event: choose another name",
                          f"{path}.name", ev_name)
    common: dict[str, Any] = {"index": i, "path": path, "at_s": at, "target": target, "for_s": for_s,
                              "note": str(note) if note is not None else None, "name": ev_name}

    def refuse_extra(allowed: Iterable[str]) -> None:
        allowed = set(allowed) | {"at", "note", "name", target}
        for key in raw:
            if key not in allowed:
                what = f"{action}" if action else target
                raise field_error(f, f"field does not apply to a {target} {what} event", f"{path}.{key}", raw[key])

    if target == "link":
        sel = raw["link"]
        if isinstance(sel, list):
            if len(sel) != 2 or not all(isinstance(x, str) and x for x in sel):
                raise field_error(f, "link must be [A, B] or {tier: .., pick: ..}", f"{path}.link", sel)
            if sel[0] == sel[1]:
                raise field_error(f, "a link joins two different nodes", f"{path}.link", sel)
            selector: Any = (sel[0], sel[1])
        elif isinstance(sel, dict):
            sel = read_mapping(f, sel, f"{path}.link", LINK_SELECT_FIELDS)
            if "tier" not in sel and "node" not in sel:
                raise field_error(f, "a link selector needs tier and/or node", f"{path}.link", sel)
            for k in ("tier", "node"):
                if k in sel and not isinstance(sel[k], str):
                    raise field_error(f, f"{k} must be a name", f"{path}.link.{k}", sel[k])
            selector = {"tier": sel.get("tier"), "node": sel.get("node"),
                        "pick": read_pick(f, sel.get("pick"), f"{path}.link.pick")}
        else:
            raise field_error(f, "link must be [A, B] or {tier: .., pick: ..}", f"{path}.link", sel)
        if action is None:
            action = "set" if "set" in raw else None
        if action not in LINK_ACTIONS:
            raise field_error(f, f"a link action must be one of {', '.join(LINK_ACTIONS)}", f"{path}.action", action)
        ev = dict(common, selector=selector, action=action)
        if action == "set":
            if "set" not in raw:
                raise field_error(f, "a set event needs set: {bandwidth|delay|jitter|loss|queue: ..}", f"{path}.set")
            ev["changes"] = tuple(parse_link_changes(raw["set"], file=f, path=f"{path}.set").items())
            ev["direction"] = parse_direction(raw.get("direction"), file=f, path=f"{path}.direction")
            refuse_extra(("action", "set", "direction", "for"))
        elif action == "flap":
            for key in ("every", "count"):
                if key not in raw:
                    raise field_error(f, "a flap needs every: and count:", f"{path}.{key}")
            every = read_time(f, raw["every"], f"{path}.every")
            if every <= 0:
                raise field_error(f, "every must be a positive duration", f"{path}.every", raw["every"])
            count = raw["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise field_error(f, "count must be an integer >= 1", f"{path}.count", count)
            down_for = read_time(f, raw["down_for"], f"{path}.down_for") if "down_for" in raw else every / 2
            if not 0 < down_for < every:
                raise field_error(f, "down_for must be positive and shorter than every", f"{path}.down_for",
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
            sel = read_mapping(f, sel, f"{path}.node", NODE_SELECT_FIELDS)
            kind = sel.get("kind")
            if kind not in (None, "worker", "switch"):
                raise field_error(f, "kind must be worker or switch", f"{path}.node.kind", kind)
            exclude = read_names(f, sel["exclude"], f"{path}.node.exclude") if "exclude" in sel else ()
            selector = {"kind": kind, "pick": read_pick(f, sel.get("pick"), f"{path}.node.pick"), "exclude": exclude}
        else:
            raise field_error(f, "node must be a node name or {kind: .., pick: ..}", f"{path}.node", sel)
        if action is None and "cpus" in raw:
            action = "slow"
        if action not in NODE_ACTIONS:
            raise field_error(f, f"a node action must be one of {', '.join(NODE_ACTIONS)}", f"{path}.action", action)
        ev = dict(common, selector=selector, action=action)
        if action == "slow":
            cpus = raw.get("cpus")
            if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus < 1e4 \
                    or not math.isfinite(cpus):
                raise field_error(f, "slow needs cpus: a positive number (e.g. 0.2)", f"{path}.cpus", cpus)
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
            raise field_error(f, "partition must be a list of groups: [[w0, w1], [w2, w3]]", f"{path}.partition",
                              groups_raw)
        groups = tuple(read_names(f, g, f"{path}.partition[{j}]") for j, g in enumerate(groups_raw))
        if action not in (None, "partition"):
            raise field_error(f, "a partition event has no other action", f"{path}.action", action)
        refuse_extra(("action", "for"))
        return Event(**dict(common, selector=groups, action="partition"))

    # heal
    if raw["heal"] is not True:
        raise field_error(f, "write heal: true", f"{path}.heal", raw["heal"])
    if action not in (None, "heal"):
        raise field_error(f, "a heal event has no other action", f"{path}.action", action)
    if for_s is not None:
        raise field_error(f, "heal takes no for:", f"{path}.for", raw["for"])
    refuse_extra(("action",))
    return Event(**dict(common, selector=None, action="heal"))
