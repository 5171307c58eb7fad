"""The plan a player follows: a scenario resolved against a topology (testbed.faults.scenario_planner
makes it) into primitive Steps sorted by emulated time, with the job and the expectations to judge.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from testbed.faults.expect import Expectation
from testbed.faults.scenario import JobSpec, format_changes

__all__ = ["Step", "Plan"]


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
            lines.append(f"{format_seconds(s.t):>10}  {format_seconds(self.wall(s)):>10}  "
                         f"#{s.event:<5} {s.describe()}{name}")
        if self.expect:
            lines.append(f"expectations ({len(self.expect)}), judged after the run:")
            lines.extend(f"  - {e.written}" for e in self.expect)
        return "\n".join(lines)


def format_seconds(t: float) -> str:
    """Seconds as plans and their conflicts print them (millisecond precision)."""
    return f"{t:.3f}s"
