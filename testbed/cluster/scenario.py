"""Play a scenario against a job on a testbed over several hosts (`testbed scenario run` there).

Every host keeps the whole topology and its own part; a fault step is applied by every host to what
it holds, exactly as the fault verbs do (testbed.handle.hosts). The controller (this module's
`play`) drives it in the same phases as the single-host player (testbed.faults.player), talking to
each host's agent (testbed.agent.scenario is the host's side):

1. plan against the controller's record (its topology and dilation factor); every host checks the
   steps it will shape against its own kernel (`scenario.check`: player.preflight on its part),
   which also proves every host answers before anything starts;
2. the job runs as `testbed run` does across hosts (testbed.cluster.job.run_job), in a thread of its own;
3. a watcher polls the master host's probe step records (with phantoms: the leading real rank's
   host's) over one SSH connection it keeps (controller.open_host): t0 is
   the first training step's time as the record says (not when the poll saw it), and no step
   progress for hang_after ends the job (`stop`) as `hung`;
4. a dispatcher sends the steps to every host at once a little *ahead* of their time, each with its
   deadline on the wall clock: each host sleeps until the deadline, so SSH does not make the step
   late. The steps go as `scenario.apply` requests on one agent session per host, opened with the
   job (its connection up before the first step is due, which matters for steps due right after
   t0); where a host's session is gone, a batch goes to a fresh agent on every host. Steps closer
   together than the lead go in one batch, applied in order. Hosts' clocks are assumed to agree
   (NTP); the check measures and reports a skew;
5. the end: every host restores its part (`scenario.restore`: control.restore_all), and
   events.jsonl, scenario.json and scenario.png go into the merged run directory.
"""

from __future__ import annotations

import base64
import json
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Callable

from testbed.cluster import hostside
from testbed.faults.player import PlayResult, expectations_text, judge_run, outcome_of, plot, sayer
from testbed.faults.scenario import Scenario, ScenarioError
from testbed.faults.scenario_plan import Plan, Step
from testbed.faults.scenario_planner import plan_scenario
from testbed.jobs import rundir

POLL_S = 0.5          # how often the master host's step records are read (the watchdog)...
FIRST_POLL_S = 0.1    # ... and until the first step is seen (t0: the first steps are sent then)
MIN_LEAD_S = 2.0      # a step is sent at least this long before its time...
MAX_LEAD_S = 10.0     # ... and at most this long (3x what the hosts' check took, in between)
BATCH_MAX = 32        # steps per call (they travel on the command line)
SKEW_WARN_S = 0.5     # a host clock this far from the controller's is reported


def plan_for(name: str, scenario: Scenario, doc: dict[str, Any] | None = None) -> Plan:
    """The scenario's plan against testbed `name` over several hosts: the controller's record `doc`
    (loaded when not given: its topology and dilation factor). Changes nothing, asks no host."""
    from testbed.cluster import controller
    from testbed.topology.model import Topology

    doc = doc if doc is not None else controller.load(name)
    topo = Topology.from_json(doc["topology"])
    plan = plan_scenario(scenario, topo, float(doc.get("time_dilation") or 1.0))
    if scenario.job.groups is not None:   # one launcher starts and restarts them (testbed.jobs.run)
        raise ScenarioError(f"testbed {name} spans several hosts: a job of groups (job.groups) runs on a "
                            "testbed of one host only", file=scenario.source, path="job.groups")
    return plan


# -- the controller side ---------------------------------------------------------------------------------


def _verb(name: str, verb: str, data: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The agent op `verb` (scenario.check, .apply, .restore) with `data` on every host at once:
    host -> its answer (a JSON object), or an Exception saying why there is none."""
    from testbed.agent.protocol import request
    from testbed.cluster import agents

    req = request({"op": verb, "name": name, "data": data})
    return {h: vals[0] for h, vals in agents.ask(name, [req], timeout=timeout).items()}


class _Followers:
    """One agent session per host for the whole run (testbed.cluster.agents.Sessions): each batch of
    steps is a `scenario.apply` on it. apply() answers as _verb does."""

    def __init__(self, name: str):
        from testbed.cluster.agents import Sessions

        self.name = name
        self._sessions = Sessions(name)
        # each agent loads what applying a step uses now, while the job starts: a step due right
        # after t0 finds it ready (an empty batch: agent.scenario.apply_here warms up, applies nothing)
        threading.Thread(target=lambda: self.apply({"scenario": "", "steps": []}, timeout=120), daemon=True,
                         name="scenario-warm-up").start()

    def alive(self) -> bool:
        return self._sessions.alive()

    def apply(self, data: dict[str, Any], timeout: float) -> dict[str, Any]:
        from testbed.agent.protocol import request

        req = request({"op": "scenario.apply", "name": self.name, "data": data})
        return self._sessions.ask(req, timeout)

    def close(self) -> None:
        self._sessions.close()


def _batches(plan: Plan, lead: float) -> list[list[Step]]:
    """The steps in calls: a step less than `lead` after the previous one goes with it (its call must
    be sent before the previous one returns); at most BATCH_MAX per call."""
    out: list[list[Step]] = []
    for step in plan.steps:
        if out and plan.wall(step) - plan.wall(out[-1][-1]) < lead and len(out[-1]) < BATCH_MAX:
            out[-1].append(step)
        else:
            out.append([step])
    return out


# The master host's step records since the last read: a shell program, sent as text (what it is
# given and what it answers: testbed/cluster/hostside/poll_steps.sh).
_POLL_SH = hostside.text("poll_steps.sh")


class RemoteSteps:
    """StepReader (testbed.jobs.rundir) over SSH: the step records of the ranks on one host, read
    incrementally from its run directory. steps, last_step_t (the host's clock) as StepReader has;
    first_new_t: the earliest step time of the last poll that found any; ended: whether every rank
    file seen has its end record (the ranks there have exited: nothing is hung any more)."""

    def __init__(self, name: str, host: str, run_dir: str):
        self.name, self.host, self.run_dir = name, host, run_dir
        self.offsets: dict[str, int] = {}
        self.steps = 0
        self.last_step_t: float | None = None
        self.first_new_t: float | None = None
        self.error: str | None = None
        self._ended: set[str] = set()
        self._ctl: Any = None

    def close(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None

    @property
    def ended(self) -> bool:
        return bool(self.offsets) and set(self.offsets) <= self._ended

    def poll(self) -> None:
        from testbed.cluster import controller

        args = [f"{f}={off}" for f, off in sorted(self.offsets.items())]
        try:
            if self._ctl is None:   # one connection for every poll (a handshake each costs ~0.2 s)
                self._ctl = controller.open_host(self.name, self.host)
            r = self._ctl.run(["sh", "-c", _POLL_SH, "sh", self.run_dir, *args], timeout=30)
        except Exception as exc:  # noqa: BLE001 - the watchdog goes on; a long silence is a hang
            self.error = str(exc)
            return
        if r.rc != 0:
            self.error = (r.stderr.strip() or f"exit status {r.rc}")[-300:]
            return
        self.error = None
        self.feed(r.stdout)

    def feed(self, text: str) -> None:
        """One answer of _POLL_SH (pure: the tests feed it)."""
        self.first_new_t = None
        for row in text.splitlines()[1:]:
            parts = row.split(" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                continue
            f, off = parts[0], int(parts[1])
            if off != self.offsets.get(f, 0):
                continue   # (not what was asked: read again next time)
            try:
                data = base64.b64decode(parts[2]) if len(parts) > 2 else b""
            except ValueError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[f] = off + end + 1
            for kind, t in rundir.step_events(data[: end + 1]):
                if kind == "end":
                    self._ended.add(f)
                if t is not None:
                    self.steps += 1
                    self.last_step_t = max(self.last_step_t or 0.0, t)
                    self.first_new_t = t if self.first_new_t is None else min(self.first_new_t, t)


def _skews(answers: dict[str, Any], sent: float, back: float) -> dict[str, float]:
    """host -> how far its clock is from the controller's beyond what the call's duration explains
    (0: within it). Its `now` was taken between `sent` and `back` on this clock."""
    out = {}
    for host, a in answers.items():
        if isinstance(a, dict) and isinstance(a.get("now"), (int, float)):
            now = float(a["now"])
            out[host] = now - back if now > back else (now - sent if now < sent else 0.0)
    return out


def play(name: str, scenario: Scenario, *, hang_after: float | None = None, timeout: float | None = None,
         echo: Callable[[str], None] | bool | None = True, base_dir: Any = None) -> PlayResult:
    """The scenario's job on testbed `name` over several hosts, its steps applied on every host
    (see the module's docstring). Returns what player.play returns."""
    from testbed.cluster import controller
    from testbed.cluster import job as hosts_job

    doc = controller.load(name)
    plan = plan_for(name, scenario, doc)     # refuses bad input before anything happens
    say = sayer(echo)
    s = plan.dilation
    hang_s = (hang_after if hang_after is not None else scenario.job.hang_after_s) * s
    startup_s = scenario.job.startup_s * s
    timeout_s = (timeout if timeout is not None else scenario.job.timeout_s) * s
    cmd = list(scenario.job.command) if isinstance(scenario.job.command, tuple) \
        else shlex.split(scenario.job.command)
    placement = doc["placement"]
    real = plan.job.resolve_real(plan.workers)
    # whose step records make t0 and the watchdog: the master's host, or the leading real rank's
    # when the others are phantoms (phantoms record no steps)
    steps_host = placement[next(w for w in plan.workers if real is None or w in real)]
    started_text = f"{scenario.name} started: {len(plan.steps)} steps, job on {', '.join(plan.workers)}"

    # every host checks what it will shape (and answers at all) before the job starts
    shaped = [st.to_json() for st in plan.steps if st.op == "link_set"]
    sent = time.time()
    answers = _verb(name, "scenario.check", {"steps": shaped, "source": scenario.source, "scenario": scenario.name,
                                         "say": started_text}, timeout=120)
    back = time.time()
    refused: Exception | None = None
    for host, a in answers.items():
        if isinstance(a, Exception):
            refused = controller.ClusterError(f"scenario: host {host} did not answer the check, nothing was "
                                              f"started: {a}")
        elif a.get("problem"):
            p = a["problem"]
            refused = ScenarioError(f"on host {host}: {p['reason']}", file=scenario.source, path=p.get("path"),
                                    **({"value": p["value"]} if "value" in p else {}))
        if refused is not None:
            # the hosts that passed told their event streams it started: they are told it did not
            _verb(name, "scenario.apply", {"scenario": scenario.name, "steps": [],
                                       "say": f"{scenario.name} ended: refused ({refused})"}, timeout=60)
            raise refused
    skews = _skews(answers, sent, back)
    lead = min(MAX_LEAD_S, max(MIN_LEAD_S, 3 * (back - sent)))
    if say:
        say(f"[scenario] {scenario.name}: {len(plan.steps)} steps, job on {', '.join(plan.workers)} over "
            f"{len(answers)} hosts ({', '.join(answers)})" + (f", time dilation {s:g}" if s != 1 else ""))
        for host, sk in skews.items():
            if abs(sk) > SKEW_WARN_S:
                say(f"[scenario] warning: host {host}'s clock is {abs(sk):.2f}s {'ahead of' if sk > 0 else 'behind'} "
                    "this machine's: its steps and step records are off by that much (synchronise the clocks, NTP)")

    events: list[dict[str, Any]] = []
    stop = threading.Event()
    hung: dict[str, Any] = {}
    ctx: dict[str, Any] = {"t_start": time.time(), "stacks": None}
    begun = threading.Event()                 # t0 is known
    steps_dir: dict[str, str] = {}

    def on_started(host: str, remote_dir: str) -> None:
        if host == steps_host and "dir" not in steps_dir:
            steps_dir["dir"] = remote_dir
            ctx["t_start"] = time.time()

    def on_output(host: str, line: str) -> None:
        if say:
            if line.startswith("[testbed]"):
                line = f"[testbed {host}]{line[len('[testbed]'):]}"
            say(line)

    def watcher() -> None:
        reader: RemoteSteps | None = None
        try:
            while not stop.is_set():
                if reader is None and "dir" in steps_dir:
                    reader = RemoteSteps(name, steps_host, steps_dir["dir"])
                if reader is not None:
                    reader.poll()
                    if not begun.is_set() and reader.first_new_t is not None:
                        # `at:` counts from the training's first step, as its record says (the poll sees it later)
                        ctx["t0_wall"] = reader.first_new_t
                        ctx["t0_seen_after_s"] = time.time() - reader.first_new_t
                        begun.set()
                        if say:
                            say("[scenario] training started: the timeline begins")
                now = time.time()
                if reader is not None and reader.ended:
                    quiet = False   # the ranks are done (their run directories are being fetched)
                elif reader is not None and reader.last_step_t is not None:
                    quiet = now - reader.last_step_t > hang_s
                else:   # start-up (imports, rendezvous) gets its own allowance
                    quiet = now - ctx["t_start"] > max(hang_s, startup_s)
                if quiet and not hung:
                    hung.update(steps=reader.steps if reader else 0, wall=time.time())
                    why = f" ({steps_host}'s step records could not be read: {reader.error})" \
                        if reader is not None and reader.error else ""
                    if say:
                        say(f"[scenario] no step progress for {hang_s:g}s"
                            f"{'' if hung['steps'] else ' (none at all since the start)'}{why}: the job is hung; "
                            "stopping it on every host")
                    ctx["stacks"] = _stacks(name)
                    stop.set()
                    return
                stop.wait(POLL_S if begun.is_set() else FIRST_POLL_S)
        finally:
            if reader is not None:
                reader.close()

    def dispatcher() -> None:
        while not begun.is_set():
            if stop.wait(0.05):
                return
        t0 = ctx["t0_wall"]
        for batch in _batches(plan, lead):
            send_at = t0 + plan.wall(batch[0]) - lead
            while not stop.is_set() and time.time() < send_at:
                stop.wait(min(0.05, max(0.0, send_at - time.time())))
            if stop.is_set():
                return
            items = [{"step": st.to_json(), "at": t0 + plan.wall(st)} for st in batch]
            last = t0 + plan.wall(batch[-1])
            data = {"scenario": scenario.name, "t0": t0, "dilation": s, "steps": items}
            try:
                if followers.alive():
                    res = followers.apply(data, timeout=max(0.0, last - time.time()) + 120)
                else:
                    res = _verb(name, "scenario.apply", data, timeout=max(0.0, last - time.time()) + 120)
            except Exception as exc:  # noqa: BLE001 - (the record unreadable...): each step says so
                res = {h: exc for h in doc.get("hosts", {})}
            for k, st in enumerate(batch):
                rec = _event_record(st, plan, t0, res, k, placement)
                events.append(rec)
                if say:
                    late = ", ".join(f"{h} {v['applied_wall_s'] - rec['planned_wall_s']:+.3f}s"
                                     for h, v in rec["hosts"].items() if "applied_wall_s" in v)
                    say(f"[scenario] {rec['applied_s']:8.3f}s  #{st.event} {rec['what']}  ({late})"
                        + (f"  ERROR: {rec['error']}" if "error" in rec else ""))

    followers = _Followers(name)
    threads = [threading.Thread(target=f, name=f"scenario-{f.__name__}", daemon=True) for f in (watcher, dispatcher)]
    for t in threads:
        t.start()
    result: dict[str, Any] | None = None
    try:
        result = hosts_job.run_job(name, cmd, workers=plan.workers, timeout=timeout_s, env=dict(scenario.job.env),
                                    base_dir=base_dir, on_output=on_output, on_started=on_started, stop=stop,
                                    real=real,
                                    progress=(lambda m: say(f"[scenario] {m}")) if say else (lambda _m: None))
    finally:
        stop.set()
        for t in threads:
            # a call in flight is waited for (its steps are applied, then restored below): it ends by
            # its last deadline, or its own timeout
            t.join()
        followers.close()
        if result is None:   # the job could not be run: what was applied is undone all the same
            _verb(name, "scenario.restore", {"scenario": scenario.name, "say": f"{scenario.name} ended: not run"},
                  timeout=600)
    rd = Path(result["run_dir"])
    summary = rundir.read_json(rd / "summary.json") or {}
    interrupted = not hung and summary.get("status") == "interrupted"
    if interrupted:   # a Ctrl-C here (run_job passed it on): reported, restored, then passed up
        outcome, error = "failed", "interrupted"
    else:
        outcome, error = outcome_of(rd, summary, result["rc"], hung, events, hang_s=hang_s, startup_s=startup_s,
                                    timeout_s=timeout_s, dilation=s)
    out = {"scenario": scenario.name, "source": scenario.source, "seed": scenario.seed, "testbed": name,
           "outcome": outcome, "error": error, "rc": result["rc"], "dilation": s, "hang_after_s": hang_s / s,
           "timeout_s": timeout_s / s, "events": events, "restored": [], "plan": plan.to_json(),
           "job_status": summary.get("status"), "first_failure": summary.get("first_failure"),
           # the events' clock: t0 is the first step's time as the steps host's record says
           "t0_wall": ctx.get("t0_wall"), "started_wall": ctx["t_start"],
           "watchdog": {"detected_wall": hung["wall"], "steps": hung.get("steps")} if hung else None}
    verdicts = judge_run(rd, out, scenario)   # before the hosts are told it ended (the line says how it did)
    ended_text = f"{scenario.name} ended: {outcome}" + (f" ({error})" if error else "") + expectations_text(verdicts)
    back_res = _verb(name, "scenario.restore", {"scenario": scenario.name, "say": ended_text}, timeout=600)
    restored, problems = _restored(back_res)
    out["restored"] = restored
    if say:
        if restored:
            say(f"[scenario] testbed restored: {'; '.join(restored)}")
        for host, why in problems.items():
            say(f"[scenario] ERROR: host {host} could not restore its part: {why} "
                f"(run `testbed link reset` / `node up` / `heal` again once it answers)")
        for host, why in (result.get("problems") or {}).items():
            say(f"[scenario] host {host}: {why}")
    if ctx["stacks"]:
        rundir.write_bytes(rd / "stacks.txt", ctx["stacks"].encode())
    rundir.write_bytes(rd / "events.jsonl", "".join(json.dumps(rec) + "\n" for rec in events).encode())
    rundir.write_bytes(rd / "scenario-plan.json", json.dumps(plan.to_json(), indent=1).encode())
    out |= {"over_hosts": {"hosts": list(answers), "master_host": placement[plan.workers[0]],
                          "steps_host": steps_host, "t0_wall": ctx.get("t0_wall"),
                          "t0_seen_after_s": ctx.get("t0_seen_after_s"),
                          "lead_s": lead,
                          "clock_skew_s": skews, "restore_problems": problems,
                          "run_problems": result.get("problems") or {}}}
    rundir.write_bytes(rd / "scenario.json", json.dumps(out, indent=1).encode())
    try:
        plot(rd, out, ctx.get("t0_wall") or summary.get("started"))
    except Exception as exc:  # a missing plot must not hide the outcome
        if say:
            say(f"[scenario] plot failed: {exc}")
    if interrupted:
        raise KeyboardInterrupt
    return PlayResult(outcome, error, rd, events, restored, result["rc"], plan, verdicts, bool(scenario.expect))


def _event_record(step: Step, plan: Plan, t0: float, res: dict[str, Any], k: int,
                  placement: dict[str, str]) -> dict[str, Any]:
    """events.jsonl's line for the k-th step of a call: what each host did and when (seconds since t0
    on the wall clock: applied_wall_s, when it was in effect on every host that answered)."""
    rec: dict[str, Any] = {"event": step.event, "planned_s": step.t, "planned_wall_s": plan.wall(step),
                           "op": step.op, "target": list(step.target), "revert": step.revert}
    hosts: dict[str, Any] = {}
    for host, a in res.items():
        try:
            r = a["results"][k]
            hosts[host] = {"what": r["what"], "applied_wall_s": float(r["done"]) - t0,
                           "took_s": float(r["done"]) - float(r["start"])}
            if r.get("error"):
                hosts[host]["error"] = r["error"]
        except (TypeError, KeyError, IndexError, ValueError):
            hosts[host] = {"error": str(a) if isinstance(a, Exception) else "no answer for this step"}
    rec["hosts"] = hosts
    home = placement.get(step.target[0]) if step.target else None
    ok = [h for h, v in hosts.items() if "what" in v]
    rec["what"] = hosts[home]["what"] if home in ok else (hosts[ok[0]]["what"] if ok else step.describe())
    failed = [h for h, v in hosts.items() if v.get("error")]
    rec["failed_hosts"] = failed
    if failed:
        rec["error"] = "; ".join(f"{h}: {hosts[h]['error']}" for h in failed)
    times = [v["applied_wall_s"] for v in hosts.values() if "applied_wall_s" in v]
    rec["applied_wall_s"] = max(times) if times else time.time() - t0
    rec["applied_s"] = rec["applied_wall_s"] / plan.dilation
    rec["t"] = t0 + rec["applied_wall_s"]
    return rec


def _restored(res: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """What the hosts restored ("link reset s0 s1 (h1, h2)"), and host -> why it could not."""
    by: dict[str, list[str]] = {}
    problems: dict[str, str] = {}
    for host, a in res.items():
        if isinstance(a, Exception):
            problems[host] = str(a)
            continue
        for what in a.get("restored") or []:
            by.setdefault(what, []).append(host)
    return [f"{what} ({', '.join(hosts)})" for what, hosts in by.items()], problems


def _stacks(name: str) -> str | None:
    """Every host's ranks' stacks (a hung job), as one text: each host's agent asked at once."""
    from testbed.agent.protocol import request
    from testbed.cluster import agents
    from testbed.jobs import stacks

    try:
        res = agents.ask(name, [request({"op": "stacks", "name": name})], timeout=60)
    except Exception as exc:  # noqa: BLE001 - the stacks are a help, the outcome stands without them
        return f"stacks could not be taken: {exc}\n"
    parts = []
    for host, (got,) in res.items():
        if isinstance(got, Exception):
            body = getattr(got, "why", None) or str(got)
        else:
            ranks = stacks.from_json([r.model_dump() for r in got], host)
            body = stacks.render(ranks) if ranks else "no rank of a job is running"
        parts.append(f"== host {host} ==\n{body.rstrip()}\n")
    return "\n".join(parts)
