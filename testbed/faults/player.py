"""Play a scenario against a job on a running testbed (`testbed scenario run`).

    result = play(name, scenario)          # -> PlayResult(outcome, error, run_dir, ...)

1. plan: everything is checked against the running testbed's topology *before* the job
   starts (unknown nodes/links, contradictions, units); a bad file changes nothing;
2. the job starts through testbed.jobs.run (the run directory, logs, probe);
3. a player thread applies each step at t0 + at x dilation (t0: the job's first training
   step, as the probe records it: start-up time varies, the timeline should not) and
   writes events.jsonl (planned time, applied time, what changed) as it goes; a
   watchdog reads the probe's step records: no step progress for hang_after (x
   dilation) ends the job as `hung`;
4. when the job ends (or the timeout hits), the testbed is put back as the topology
   describes it (testbed.faults.control.restore_all), the file's `expect:` items are
   judged on the run (testbed.faults.expect), and scenario.json (with the verdicts) +
   step-time plot (scenario.png) are written into the run directory.

Outcomes: completed (every rank exited 0), failed (a rank failed: its first error
line is reported), hung (no step progress for hang_after, or the timeout hit).
"""

from __future__ import annotations

import io
import json
import re
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from testbed import events as tb_events
from testbed import safeio
from testbed.faults import control, expect
from testbed.faults.scenario import Scenario
from testbed.faults.scenario_plan import Plan
from testbed.faults.scenario_planner import plan_scenario
from testbed.jobs import rundir
from testbed.jobs.rundir import StepReader

LOG_READ_MAX = 16 << 20     # a worker's log read for its first error line: its first 16 MiB
PROBE_READ_MAX = 512 << 20  # as testbed.jobs.probe_files.PROBE_FILE_MAX_BYTES
EXIT_CODES = {"completed": 0, "failed": 1, "hung": 124}
EXPECT_NOT_MET = 1      # an expectation not met (or not judged)
_ERROR_RE = re.compile(r"\b([A-Za-z_][\w.]*(Error|Exception)|error|Traceback|terminate called)\b")


@dataclass
class PlayResult:
    outcome: str                       # completed | failed | hung
    error: str | None
    run_dir: Path | None
    events: list[dict[str, Any]] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    rc: int = 0
    plan: Plan | None = None
    expectations: list[expect.Verdict] = field(default_factory=list)
    judged: bool = False               # the scenario has an `expect:` block (judged after the run)

    @property
    def exit_code(self) -> int:
        """With an `expect:` block: 0 when every expectation is met, 1 otherwise (the outcome is one of
        them when the file says so); without: the outcome's (0 completed, 1 failed, 124 hung)."""
        if self.judged:
            return 0 if expect.all_met(self.expectations) else EXPECT_NOT_MET
        return EXIT_CODES[self.outcome]


def plan_for(name: str, scenario: Scenario) -> Plan:
    """The scenario's plan against running testbed `name` (its topology and dilation factor),
    with what this machine cannot do refused up front (a delay on a kernel without netem, on a
    link that is no delay line)."""
    h = control.Handle(name)
    plan = plan_scenario(scenario, h.topo, h.dilation)
    preflight(h, scenario, plan)
    return plan


def preflight(h: "control.Handle", scenario: Scenario, plan: Plan) -> None:
    from testbed.faults.scenario import ScenarioError
    from testbed.net import shaping

    caps = h.caps
    for step in plan.steps:
        if step.op != "link_set":
            continue
        changes = dict(step.kwargs["changes"])
        i = h.topo.link_index(*step.target)
        link = h.topo.links[i]
        if not (h.here(link.a) or h.here(link.b)):
            continue   # over several hosts: another host shapes this link, and checks it
        path = f"events[{step.event}].set"
        for prof in (link.ab.with_changes(**changes), link.ba.with_changes(**changes)):
            if shaping.needs_delay_line(prof, caps) and control._delay_line_of(h, i) is None:
                raise ScenarioError("this kernel has no sch_netem, and the link is no delay line: its delay "
                                    "cannot change at run time (give the link a delay in the topology)",
                                    file=scenario.source, path=f"{path}.delay",
                                    value=changes.get("delay_s"))
            if prof.loss > 0 and not caps.can_lose:
                raise ScenarioError("this kernel can drop packets neither with netem nor with cls_bpf",
                                    file=scenario.source, path=f"{path}.loss", value=changes.get("loss"))


def _first_error_line(run_dir: Path, failure: dict[str, Any] | None) -> str | None:
    if not failure:
        return None
    worker, label = failure.get("worker"), failure.get("label", "")
    tag = f"[{label.split(':', 1)[1]}] " if ":" in label else ""
    try:
        lines = safeio.read_text(run_dir / "logs" / f"{worker}.log", LOG_READ_MAX).splitlines()
    except (OSError, safeio.Unsafe):
        lines = []
    mine = [l[len(tag):] for l in lines if l.startswith(tag)] if tag else lines
    # the exception line of a traceback says most; else the first line that looks like an error
    for l in mine:
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", l.strip()):
            return l.strip()
    for l in mine:
        if _ERROR_RE.search(l):
            return l.strip()
    rc = failure.get("rc")
    if rc is not None and rc > 128:
        try:
            return f"{label} killed by {signal.Signals(rc - 128).name}"
        except ValueError:
            pass
    return f"{label} exited with status {rc}"


def sayer(echo: Callable[[str], None] | bool | None) -> Callable[[str], None] | None:
    """What prints the player's lines: True: stdout; a function: it; False/None: nothing."""
    if echo is True:
        def say(line: str) -> None:
            print(line, flush=True)
        return say
    return echo or None


def outcome_of(rd: Path, summary: dict[str, Any], rc: int, hung: dict[str, Any], events: list[dict[str, Any]], *,
               hang_s: float, startup_s: float, timeout_s: float, dilation: float) -> tuple[str, str | None]:
    """(outcome, error) of a played run: hung (the watchdog, or the run's timeout), completed (rc 0)
    or failed (the first failing rank's first error line; a crash the scenario caused is named)."""
    s = dilation
    if hung or summary.get("status") == "timeout":
        error = ((f"no step progress for {hang_s / s:g}s (after {hung.get('steps', 0)} steps)"
                  if hung.get("steps") else f"no training step within {max(hang_s, startup_s) / s:g}s of the start")
                 if hung
                 else f"timeout after {timeout_s / s:g}s")
        return "hung", error
    if rc == 0:
        return "completed", None
    error = _first_error_line(rd, summary.get("first_failure"))
    fw = (summary.get("first_failure") or {}).get("worker")
    crash = [e for e in events if e["op"] == "node_crash" and e["target"] == [fw]]
    if crash:
        error = f"{error} (node crash of {fw} at {crash[0]['applied_s']:.2f}s)"
    return "failed", error


def play(name: str, scenario: Scenario, *, hang_after: float | None = None, timeout: float | None = None,
         echo: Callable[[str], None] | bool | None = True, base_dir: Any = None) -> PlayResult:
    from testbed.jobs import run as jobrun
    from testbed.jobs.ranks import signal_all
    from testbed.jobs.target import RuntimeExecutor, cluster_from_state

    plan = plan_for(name, scenario)          # refuses bad input before anything happens
    s = plan.dilation
    hang_s = (hang_after if hang_after is not None else scenario.job.hang_after_s) * s
    startup_s = scenario.job.startup_s * s
    timeout_s = (timeout if timeout is not None else scenario.job.timeout_s) * s
    cmd = list(scenario.job.command) if isinstance(scenario.job.command, tuple) \
        else shlex.split(scenario.job.command)
    cluster = cluster_from_state(name)
    records = (control.Handle(name).st.get("runtime") or {}).get("workers") or {}
    ex = cluster.executor
    if isinstance(ex, RuntimeExecutor) and records and not any(ex.records.get(w) for w in records):
        ex.records = records   # lifecycle keeps worker records under runtime.workers
    say = sayer(echo)

    events: list[dict[str, Any]] = []
    stop = threading.Event()
    hung: dict[str, Any] = {}
    ctx: dict[str, Any] = {}

    def player(rd: Path, probe_dir: Path) -> None:
        t0: float | None = None
        try:
            log = rundir.open_append(rd / "events.jsonl")
        except safeio.Unsafe as exc:   # (a FIFO or a link a job planted there): no step is played
            ctx["player_error"] = f"the timeline was not played: {exc}"
            if say:
                say(f"[scenario] {ctx['player_error']}")
            return
        steps = StepReader(probe_dir)
        pending = list(plan.steps)
        try:
            while not stop.is_set():
                steps.poll()
                now = time.monotonic()
                if t0 is None and steps.steps:
                    # `at:` counts from the training's first step (start-up time varies from run to run)
                    t0 = now
                    ctx["t0_events_wall"] = time.time()
                    if say:
                        say("[scenario] training started: the timeline begins")
                while t0 is not None and pending and now >= t0 + plan.wall(pending[0]):
                    step = pending.pop(0)
                    rec: dict[str, Any] = {"event": step.event, "planned_s": step.t,
                                           "planned_wall_s": plan.wall(step), "op": step.op,
                                           "target": list(step.target), "revert": step.revert}
                    try:
                        what = control.apply_step(name, step)
                        rec["what"] = what
                    except Exception as exc:   # recorded; the run goes on (and is restored at the end)
                        rec["what"] = step.describe()
                        rec["error"] = str(exc)
                    rec["applied_wall_s"] = time.monotonic() - t0
                    rec["applied_s"] = rec["applied_wall_s"] / s
                    rec["t"] = time.time()
                    events.append(rec)
                    log.write(json.dumps(rec) + "\n")
                    tb_events.emit(name, "scenario", f"{scenario.name} #{step.event} at {rec['applied_s']:.3f}s: "
                                   f"{rec['what']}" + (f" (error: {rec['error']})" if "error" in rec else ""),
                                   scenario=scenario.name, event=step.event, applied_s=rec["applied_s"])
                    if say:
                        say(f"[scenario] {rec['applied_s']:8.3f}s  #{step.event} {rec['what']}"
                            + (f"  ERROR: {rec['error']}" if "error" in rec else ""))
                    now = time.monotonic()
                if steps.last_step_t is not None:
                    quiet = time.time() - steps.last_step_t > hang_s
                else:   # start-up (imports, rendezvous) gets its own allowance
                    quiet = time.time() - ctx["t0_wall"] > max(hang_s, startup_s)
                if quiet and not hung:
                    hung.update(at=time.monotonic() - ctx["t0"], steps=steps.steps, wall=time.time())
                    if say:
                        say(f"[scenario] no step progress for {hang_s:g}s"
                            f"{'' if steps.steps else ' (none at all since the start)'}: the job is hung; "
                            "stopping it")
                    run_id = (rundir.read_json(rd / "summary.json") or {}).get("run_id")
                    if run_id:
                        hung["stacks"] = jobrun.save_stacks(rd, name, run_id, say)
                        signal_all([], run_id, signal.SIGKILL)
                stop.wait(0.02)
        finally:
            log.close()

    threads: list[threading.Thread] = []

    def on_start(rd: Path, probe_dir: Path) -> None:
        ctx["t0"] = time.monotonic()
        ctx["t0_wall"] = time.time()
        ctx["rd"] = rd
        rundir.write_bytes(rd / "scenario-plan.json", json.dumps(plan.to_json(), indent=1).encode())
        t = threading.Thread(target=player, args=(rd, probe_dir), daemon=True)
        t.start()
        threads.append(t)

    tb_events.emit(name, "scenario", f"{scenario.name} started: {len(plan.steps)} steps, job on "
                   f"{', '.join(plan.workers)}", scenario=scenario.name)
    if say:
        say(f"[scenario] {scenario.name}: {len(plan.steps)} steps, job on {', '.join(plan.workers)}"
            + (f", time dilation {s:g}" if s != 1 else ""))
    res = None
    try:
        res = jobrun.run(cluster, cmd, workers=plan.workers, timeout=timeout_s, env=dict(scenario.job.env),
                         echo=say if say else False, base_dir=base_dir, on_start=on_start,
                         real=plan.job.resolve_real(plan.workers), job=scenario.job.groups)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        restored = control.restore_all(name)
        if say and restored:
            say(f"[scenario] testbed restored: {'; '.join(restored)}")
    rd = res.run_dir
    summary = res.summary
    outcome, error = outcome_of(rd, summary, res.rc, hung, events, hang_s=hang_s, startup_s=startup_s,
                                timeout_s=timeout_s, dilation=s)
    if ctx.get("player_error") and outcome == "completed":   # the job ran, but not the scenario
        outcome, error = "failed", ctx["player_error"]
    doc = {"scenario": scenario.name, "source": scenario.source, "seed": scenario.seed, "testbed": name,
           "outcome": outcome, "error": error, "rc": res.rc, "dilation": s, "hang_after_s": hang_s / s,
           "timeout_s": timeout_s / s, "events": events, "restored": restored, "plan": plan.to_json(),
           "job_status": summary.get("status"), "first_failure": summary.get("first_failure"),
           "t0_wall": ctx.get("t0_events_wall"), "started_wall": ctx.get("t0_wall"),
           "watchdog": {"detected_wall": hung["wall"], "steps": hung.get("steps")} if hung else None}
    verdicts = judge_run(rd, doc, scenario)
    rundir.write_bytes(rd / "scenario.json", json.dumps(doc, indent=1).encode())
    tb_events.emit(name, "scenario", f"{scenario.name} ended: {outcome}" + (f" ({error})" if error else "")
                   + expectations_text(verdicts), scenario=scenario.name, outcome=outcome, run_dir=str(rd))
    try:
        plot(rd, doc, ctx.get("t0_events_wall") or ctx.get("t0_wall"))
    except Exception as exc:  # a missing plot must not hide the outcome
        if say:
            say(f"[scenario] plot failed: {exc}")
    return PlayResult(outcome, error, rd, events, restored, res.rc, plan, verdicts, bool(scenario.expect))


def judge_run(rd: Path, doc: dict[str, Any], scenario: Scenario) -> list[expect.Verdict]:
    """The scenario's expectations judged on the run (`doc`: its scenario.json, which gets them)."""
    if not scenario.expect:
        return []
    try:
        facts = expect.run_facts(rd, doc)
    except Exception as exc:  # noqa: BLE001 - an unreadable run directory: not judged, saying why (not a traceback)
        facts = None
        why = f"could not be judged: the run directory could not be read: {exc}"
    verdicts = expect.judge(scenario.expect, facts) if facts is not None else \
        [expect.Verdict(e.written, None, None, why, e.path) for e in scenario.expect]
    doc["expectations"] = [v.to_json() for v in verdicts]
    return verdicts


def expectations_text(verdicts: list[expect.Verdict]) -> str:
    """What the event stream's `ended` line adds: "; expectations: 2 of 3 met" (nothing without any)."""
    if not verdicts:
        return ""
    return f"; expectations: {sum(v.ok is True for v in verdicts)} of {len(verdicts)} met"


def step_times(run_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """rank -> [(end time, step time)] from the probe: a step's time is the wall time between the
    ends of consecutive optimizer steps (forward, backward, all-reduce and update), the first
    step of each rank left out (it includes start-up)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for f in sorted((Path(run_dir) / "probe").glob("rank-*.jsonl")):
        rank = f.stem.split("-", 1)[1]
        prev = None
        try:   # a rank's file: never followed through a link, never waited on (a FIFO)
            text = safeio.read_text(f, PROBE_READ_MAX)
        except (OSError, safeio.Unsafe):
            continue
        for line in text.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") != "step":
                continue
            t = float(ev["t"])
            if prev is not None:
                out.setdefault(rank, []).append((t, t - prev))
            prev = t
    return out


def plot(run_dir: Path, doc: dict[str, Any], t0_wall: float | None) -> Path:
    """scenario.png: step time of every rank over the run, events marked (times undilated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = float(doc.get("dilation") or 1.0)
    data = step_times(run_dir)
    if t0_wall is None:
        t0_wall = min((t for pts in data.values() for t, _ in pts), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for rank, pts in sorted(data.items(), key=lambda kv: (len(kv[0]), kv[0])):
        ax.plot([(t - t0_wall) / s for t, _ in pts], [d / s * 1e3 for _, d in pts], ".-", ms=3, lw=0.8,
                label=f"rank {rank}")
    colours = {"down": "tab:red", "crash": "black", "up": "tab:green", "heal": "tab:green",
               "set": "tab:orange", "restore": "tab:green", "slow": "tab:purple", "partition": "tab:red",
               "reset": "tab:green"}
    ymax = ax.get_ylim()[1]
    for e in doc.get("events", []):
        verb = e["op"].split("_", 1)[-1]
        c = colours.get(verb, "tab:gray")
        x = e["applied_s"]
        ax.axvline(x, color=c, ls="--" if e.get("revert") else "-", lw=0.9, alpha=0.7)
        ax.annotate(e["what"][:40], (x, ymax), rotation=90, fontsize=6, va="top", ha="right", color=c)
    ax.set_xlabel("time since the first training step (s)" + (f", undilated (s={s:g})" if s != 1 else ""))
    ax.set_ylabel("step time (ms)")
    title = f"{doc['scenario']}: {doc['outcome']}"
    if doc.get("error"):
        title += f" - {doc['error'][:80]}"
    ax.set_title(title, fontsize=9)
    if data:
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out = Path(run_dir) / "scenario.png"
    # rendered in memory, written through no link a job planted in the run directory
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    rundir.write_bytes(out, buf.getvalue())
    return out
