"""Planning a scenario: its timeline resolved against a topology into a Plan (testbed.faults.scenario_plan).

Names are checked against the topology, random picks made with ``random.Random(seed)``, `for:` reverts
and flaps expanded into primitive steps, and overlapping contradictory events on one link or node refused.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from testbed.faults.scenario import Event, Scenario, field_error
from testbed.faults.scenario_plan import Plan, Step, format_seconds
from testbed.topology.model import Topology

if TYPE_CHECKING:
    from testbed.jobs.groups import Job

__all__ = ["plan_scenario", "resolve_partition_groups"]


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
                raise field_error(file, "unknown node", p, name)
            if node.is_worker:
                expanded = [name]
            else:
                expanded = [n for n in topo.neighbors(name) if topo.nodes[n].is_worker]
                if not expanded:
                    raise field_error(file, "a switch in a partition stands for the workers attached to it; "
                                            "this one has none", p, name)
            for w in expanded:
                if w in seen and seen[w] != j:
                    raise field_error(file, f"worker {w} is in two groups", p, name)
                if w not in seen:
                    seen[w] = j
                    members.append(w)
        out.append(members)
    rest = [w for w in topo.workers if w not in seen]
    if rest:
        out.append(rest)
    if len(out) < 2:
        raise field_error(file, "a partition needs at least two groups of workers", path,
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
            raise field_error(f, "unknown worker" if node is None else "not a worker", "job.workers", w)
    if isinstance(scenario.job.workers, int) and scenario.job.workers > len(topo.workers):
        raise field_error(f, f"the topology has only {len(topo.workers)} workers", "job.workers", scenario.job.workers)
    if len(set(workers)) != len(workers):
        raise field_error(f, "a worker is named twice", "job.workers", list(workers))
    if scenario.job.groups is not None:
        workers = _group_workers(scenario, topo, workers)
    real = scenario.job.resolve_real(workers)
    if real is not None:
        stray = [w for w in real if w not in workers]
        if stray:
            raise field_error(f, "not one of the job's workers", "job.real", stray[0])
        if len(set(real)) == len(workers):
            raise field_error(f, "every worker of the job is real: no phantom is left (drop real:, or name fewer)",
                              "job.real", list(real))

    def link_key(a: str, b: str) -> tuple[str, str]:
        link = topo.link_between(a, b)
        assert link is not None
        return (link.a, link.b)

    def pick(candidates: list, how: str | int, path: str) -> list:
        if not candidates:
            raise field_error(f, "the selector matches nothing in this topology", path)
        if how == "all":
            return candidates
        if how == "random":
            return [rng.choice(candidates)]
        if how > len(candidates):
            raise field_error(f, f"only {len(candidates)} match", f"{path}.pick", how)
        return sorted(rng.sample(candidates, how), key=candidates.index)

    for ev in scenario.events:
        p = ev.path
        if ev.target == "link":
            if isinstance(ev.selector, tuple):
                a, b = ev.selector
                for end in (a, b):
                    if end not in topo.nodes:
                        raise field_error(f, "unknown node", f"{p}.link", end)
                if topo.link_between(a, b) is None:
                    raise field_error(f, "no such link in the topology", f"{p}.link", [a, b])
                chosen = [(a, b)]
            else:
                sel = ev.selector
                if sel["tier"] is not None and sel["tier"] not in topo.tiers():
                    raise field_error(f, f"unknown tier; tiers: {', '.join(topo.tiers())}", f"{p}.link.tier",
                                      sel["tier"])
                if sel["node"] is not None and sel["node"] not in topo.nodes:
                    raise field_error(f, "unknown node", f"{p}.link.node", sel["node"])
                cands = [(l.a, l.b) for l in topo.links
                         if (sel["tier"] is None or l.tier == sel["tier"])
                         and (sel["node"] is None or sel["node"] in (l.a, l.b))]
                chosen = pick(cands, sel["pick"], f"{p}.link")
            for a, b in chosen:
                _plan_link_event(ev, a, b, link_key(a, b), steps, uses)
        elif ev.target == "node":
            if isinstance(ev.selector, str):
                if ev.selector not in topo.nodes:
                    raise field_error(f, "unknown node", f"{p}.node", ev.selector)
                chosen_nodes = [ev.selector]
            else:
                sel = ev.selector
                for k, name in enumerate(sel["exclude"]):
                    if name not in topo.nodes:
                        raise field_error(f, "unknown node", f"{p}.node.exclude[{k}]", name)
                cands = [n.name for n in topo.nodes.values()
                         if (sel["kind"] is None or n.kind == sel["kind"]) and n.name not in sel["exclude"]]
                if ev.action in ("crash", "slow"):
                    cands = [n for n in cands if topo.nodes[n].is_worker]
                chosen_nodes = pick(cands, sel["pick"], f"{p}.node")
            for n in chosen_nodes:
                node = topo.nodes[n]
                if ev.action in ("crash", "slow") and not node.is_worker:
                    raise field_error(f, f"{ev.action} acts on workers only", f"{p}.node", n)
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
                raise field_error(f, f"{'unknown worker' if node is None else 'not a worker'}; the topology's workers: "
                                     f"{', '.join(topo.workers)}", f"{path}.workers", w)
            if w not in allowed:
                raise field_error(f, f"not one of the job's workers (job.workers: {', '.join(allowed)})",
                                  f"{path}.workers", w)
        for c in g.cmd:
            _check_addr_names(f, c, f"{path}.command", job.groups, topo)
    for k, v in job.env:
        _check_addr_names(f, v, f"job.env.{k}", job.groups, topo)
    return [w for w in allowed if w in job.groups.workers]


def _check_addr_names(f: str | None, text: str, path: str, job: "Job", topo: Topology) -> None:
    from testbed.jobs import groups as groups_mod

    for name in groups_mod.addr_names(text):
        if name not in topo.workers and all(g.name != name for g in job.groups):
            raise field_error(f, f"{{addr:{name}}}: no group, service or worker of that name", path, text)


def _check_expect_workers(scenario: Scenario, workers: list[str], real: list[str] | None) -> None:
    """`workers:` of an expectation names workers of the job that record steps (phantoms record none)."""
    for e in scenario.expect:
        for k, w in enumerate(e.workers or ()):
            path = f"{e.path}.{e.kind}.workers[{k}]"
            if w not in workers:
                raise field_error(scenario.source, f"not one of the job's workers ({', '.join(workers)})", path, w)
            if real is not None and w not in real:
                raise field_error(scenario.source, "a phantom rank's worker: phantoms record no steps", path, w)
            if scenario.job.groups is not None and \
                    all(w not in g.workers for g in scenario.job.groups.groups if not g.service):
                raise field_error(scenario.source,
                                  "a service's worker only: the probe records the steps of groups' ranks", path, w)


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
                raise field_error(f, f"contradicts {first.path} on {u.resource[0]} {what} "
                                     f"(both act on it between {format_seconds(max(u.start, v.start))} and "
                                     f"{format_seconds(max(min(u.end, v.end), max(u.start, v.start)))})",
                                  second.path, second.action)
