"""A host's side of a scenario played over several hosts (testbed.cluster.scenario drives it): the
agent's `scenario.check`, `scenario.apply` and `scenario.restore` ops, each on what this host holds.

Steps travel as Step.to_json() and come back through step_from_json; the controller keeps one agent
session per host for the whole run and sends each batch of steps a little before it falls due, with
each step's deadline on the wall clock: the host sleeps until then (testbed.cluster.agents.Sessions).
"""

from __future__ import annotations

import time
from typing import Any

from testbed import events as tb_events
from testbed.faults.player import preflight
from testbed.faults.scenario import ScenarioError
from testbed.faults.scenario_plan import Plan, Step


# -- steps as JSON (they travel to the hosts) -------------------------------------------------------------


def step_from_json(d: dict[str, Any]) -> Step:
    """A Step back from Step.to_json()."""
    params = []
    for k, v in (d.get("params") or {}).items():
        if k == "changes":
            v = tuple(v.items())
        elif k == "groups":
            v = tuple(tuple(g) for g in v)
        elif k == "fields":
            v = tuple(v)
        params.append((k, v))
    return Step(float(d["t"]), str(d["op"]), tuple(d.get("target") or ()), tuple(params), int(d.get("event", -1)),
                bool(d.get("revert", False)))


# -- what a host does ---------------------------------------------------------------------------------------


def check_here(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """`scenario.check` on a host: preflight the steps against this host's part (its kernel, its delay
    lines, only the links it holds an end of). {"now", "problem": None | {reason, path, value}}."""
    from types import SimpleNamespace

    from testbed.faults import control

    h = control.Handle(name)
    steps = [step_from_json(s) for s in data.get("steps") or []]
    problem = None
    try:
        preflight(h, SimpleNamespace(source=data.get("source")),
                  Plan(scenario=str(data.get("scenario", "")), seed=0, steps=steps, workers=[]))
    except ScenarioError as exc:
        problem = {"reason": exc.reason, "path": exc.path}
        if exc.value is not ScenarioError._MISSING:
            problem["value"] = exc.value
    if problem is None and data.get("say"):
        tb_events.emit(name, "scenario", str(data["say"]), scenario=data.get("scenario"))
    return {"now": time.time(), "problem": problem}


def apply_here(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """`scenario.apply` on a host: each step at its deadline ("at", wall clock), in order, to this host's
    part (control.apply_step). {"results": [{"what" | "error", "start", "done"}]}."""
    from testbed.faults import control

    if data.get("say"):
        tb_events.emit(name, "scenario", str(data["say"]), scenario=data.get("scenario"))
    _warm_up()   # while it waits: what the first step would otherwise load after its deadline
    out = []
    for item in data.get("steps") or []:
        step = step_from_json(item["step"])
        at = item.get("at")
        if at is not None:
            wait = float(at) - time.time()
            if wait > 0:
                time.sleep(wait)
        rec: dict[str, Any] = {"start": time.time()}
        try:
            rec["what"] = control.apply_step(name, step)
        except Exception as exc:   # recorded; the next steps still go (as on one host)
            rec["what"] = step.describe()
            rec["error"] = str(exc)
        rec["done"] = time.time()
        if data.get("t0") is not None:   # this host's event stream tells it, as on one host
            applied_s = (rec["done"] - float(data["t0"])) / float(data.get("dilation") or 1.0)
            tb_events.emit(name, "scenario", f"{data.get('scenario')} #{step.event} at {applied_s:.3f}s: "
                           f"{rec['what']}" + (f" (error: {rec['error']})" if "error" in rec else ""),
                           scenario=data.get("scenario"), event=step.event, applied_s=applied_s)
        out.append(rec)
    return {"results": out}


def _warm_up() -> None:
    """Import what applying a step uses (netlink, shaping, routes): a few hundred ms on a loaded host."""
    import pyroute2  # noqa: F401

    from testbed.net import builder, fanout, routes, shaping  # noqa: F401
    from testbed.topology import dilation, plan  # noqa: F401


def restore_here(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """`scenario.restore` on a host: its part back as the topology describes it (control.restore_all)."""
    from testbed.faults import control

    restored = control.restore_all(name)
    if data.get("say"):
        tb_events.emit(name, "scenario", str(data["say"]), scenario=data.get("scenario"))
    return {"restored": restored}


