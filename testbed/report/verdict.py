"""The verdict on a run: did the emulation hold? `faithful`, `not faithful` or `unverified`.

Evidence (a run directory, see testbed.jobs.rundir):

1. The model: every collective the probe saw on the whole world is one
   instance across the ranks (same process group, same sequence number); its
   time is from the last rank's arrival to the last rank's completion (real
   clock, divided by the dilation factor), so waiting for a late rank is not
   counted. Instances of one (collective, size) form a class whose mean (what
   a loop of them takes per call, stalls included) is compared with the reference model (testbed.topology.reference) for those
   ranks on that topology, with the machine constants the run recorded and
   the hosts the topology declares (Topology.host_rate); where collectives
   were in flight together (DDP's buckets), they share the links in the
   model too (testbed.report.sharing). Each class has its
   own tolerance: TOLERANCE, or the 95% confidence interval of its mean
   (its instances' spread) with the calibration's spread on the model's
   latency part, whichever is larger. A class off by more than its tolerance
   is off. A class is within only when it is within TOLERANCE itself: one
   further off that its uncertainty keeps within its tolerance is undecided
   (it may be within TOLERANCE or not), and so is every class whose
   uncertainty (those two together) is wider than MAX_NOISE; undecided
   classes make the run INCONCLUSIVE unless something else fails, so
   "within" always means within TOLERANCE. A class off by more than its tolerance is named, whatever
   its share; it fails the run when it holds at least MATERIAL of the
   measured communication time, and so does the total. A model with ECMP
   bounds is judged at its median placement; whether the measurement fell
   inside the bounds is said too.
2. The CPUs: ranks per compute device (GPU, else core) against the factor
   (DieCast's rule: a rank sharing its device with r - 1 others computes r
   times slower, so s must be r: less and compute is slower than the emulated
   cluster's, more, without the CPU cap dilation sets above r, and it is
   faster); monitor.json's runnable tasks, busy share and CPU pressure are
   reported with it.
3. Delay lines: frames dropped, and how late held frames left (the mean
   against TOLERANCE of the link's delay; the p99 is reported).
4. Queues: drops per link end, reported (a real switch drops too), not judged.
5. Optionally an expected iteration time (the main job computes one).

A run without a failing check and with at least one checked class (or
iteration) is `faithful`, unless a class was too uncertain to judge
(`inconclusive`); with nothing to compare it is `unverified`, never
faithful. Every failure says by how much and what to change; every class
left unjudged is listed with the reason.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.jobs import rundir
from testbed.report.analyze import LATENCY_OP
from testbed.report.checks import (OTHERS_MAX, TOLERANCE, Check, cpu_check, cpu_while_collectives, delay_line_checks,
                                   machine_check, queue_check)
from testbed.report.instances import (active_window, instances, launches_only, rank_workers, recording_ranks,
                                      relative_ci95)
from testbed.report.iteration import Span, expected_iteration, step_ends
from testbed.report.run_constants import recorded_rank_cores, run_alpha
from testbed.report.sharing import LANES, Launch, shared_times
from testbed.report.slow_fixes import slow_fixes
from testbed.topology.units import format_size

MAX_NOISE = 0.25   # a class whose mean is less certain than this (95% interval, relative) is not judged
MATERIAL = 0.10    # a class with this share of the measured communication time decides the verdict


@dataclass
class ClassRow:
    op: str
    nbytes: int
    count: int
    measured_s: float      # mean instance, emulated time
    model_s: float         # the model, with the collectives in flight beside each instance (sharing.py)
    lo_s: float
    hi_s: float
    error: float           # relative, against model_s (the median ECMP placement)
    share: float           # of all measured communication time
    bottleneck: str
    window: tuple[float, float] = (0.0, 0.0)   # real wall time of the first instance's start, the last's end
    links_s: float = 0.0   # the links alone (no software cost, no host limit): the textbook time
    noise: float = 0.0     # the 95% confidence interval of the measured mean, relative (0: one instance)
    tolerance: float = TOLERANCE
    model_noise: float = 0.0   # the model's own uncertainty (alpha's spread on its latency part), relative
    backend: str = "gloo"
    alone_s: float = 0.0   # the model for one alone on the network (model_s is more where others were in flight)
    status: str = "within"  # "within" | "off" | "undecided" (off by more than TOLERANCE, within its
    #                          uncertainty) | "noisy" (an uncertainty wider than MAX_NOISE)
    ticked: float = 0.0    # the share of its instances that took TICK_WAIT_S or more, real time
    median_real_s: float = 0.0   # its median instance, real time

    @property
    def bounded(self) -> bool:
        return self.hi_s > self.lo_s * (1 + 1e-9)

    @property
    def in_bounds(self) -> bool:
        return self.lo_s <= self.measured_s <= self.hi_s

    @property
    def shared(self) -> bool:
        """Whether the model gave the class more time than alone: collectives were in flight beside it."""
        return self.alone_s > 0 and self.model_s > self.alone_s * 1.005


@dataclass
class Unjudged:
    op: str
    nbytes: int
    count: int
    why: str


@dataclass
class Verdict:
    status: str                              # "faithful" | "not faithful" | "inconclusive" | "unverified"
    reasons: list[str]
    fixes: list[str]
    checks: list[Check] = field(default_factory=list)
    classes: list[ClassRow] = field(default_factory=list)
    constants: str | None = None
    unjudged: list[Unjudged] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reasons": self.reasons, "fixes": self.fixes,
                "checks": [asdict(c) for c in self.checks], "classes": [asdict(c) for c in self.classes],
                "constants": self.constants, "unjudged": [asdict(u) for u in self.unjudged]}

    def lines(self) -> list[str]:
        head = {"faithful": "FAITHFUL", "not faithful": "NOT FAITHFUL", "inconclusive": "INCONCLUSIVE",
                "unverified": "UNVERIFIED"}[self.status]
        out = [f"verdict: {head}"]
        out += [f"  - {r}" for r in self.reasons]
        out += [f"  fix: {f}" for f in self.fixes]
        return out


# -- the model check ---------------------------------------------------------------------------------------


def _arrival_spread(probe: dict[str, list[dict[str, Any]]], summary: dict[str, Any], s: float) -> str:
    """How far apart the ranks reached their collectives (mean, emulated): the expected iteration has
    every rank compute in the ranks' typical time, and ranks that share CPUs come out uneven; the wait
    for the last one is in every step but in no collective's time (2026-12-02, k=4 fat-tree main job:
    rank 0's median step held 77 ms of all_reduce against the class's 60 ms)."""
    world = int(summary.get("world_size") or 1)
    skews = [i["skew"] for k, xs in instances(probe, world, recording_ranks(summary, world)).items()
             if k[2] == () and k[0] != LATENCY_OP for i in xs]
    if world < 2 or not skews:
        return ""
    return (f"; the ranks reached a collective {statistics.fmean(skews) / s * 1e3:.3g} ms apart on average "
            "(waiting for the last one is in the steps, not in the collectives' times)")


def phantom_check(summary: dict[str, Any], rows: list["ClassRow"], s: float) -> Check | None:
    """With phantom ranks: which ranks were real, and whether the phantoms kept up. A phantom enters
    each collective when it has read the real rank's announcement; the real rank's collective
    waits for it, so that lateness (real time, /s emulated) is in the measured times."""
    ph = summary.get("phantoms")
    if not isinstance(ph, dict):
        return None
    real, phantoms = ph.get("real_ranks") or [], ph.get("phantom_ranks") or []
    who = f"ranks {', '.join(map(str, real))} real, {len(phantoms)} phantom(s) mirroring rank {min(real, default='?')}"
    replay = summary.get("replay")
    if isinstance(replay, dict):
        who = f"a replay of {replay.get('source')} ({replay.get('ops')} records) by {len(phantoms)} phantom(s)"
        skipped = replay.get("skipped")
        if isinstance(skipped, dict) and skipped:   # in the trace, not on the links: said, not hidden
            who += " (not replayable, left out: " + ", ".join(f"{v} {k}" for k, v in sorted(skipped.items())) + ")"
    if ph.get("errors"):
        return Check("phantoms", False, f"{who}; a phantom fell out of step: {ph['errors'][0]}")
    late = ph.get("announce_late_p50_s")
    if not isinstance(late, (int, float)):
        return Check("phantoms", None, f"{who}; how late the phantoms followed was not recorded")
    detail = (f"{who}; they read each announcement {late * 1e3:.2g} ms after it was made (median) "
              f"({late / s * 1e6:.3g} us emulated), which the real rank's collectives include")
    if ph.get("warnings"):
        detail += f"; not mirrored: {ph['warnings'][0]}" + (f" (and {len(ph['warnings']) - 1} more)"
                                                              if len(ph["warnings"]) > 1 else "")
    n = sum(r.count for r in rows)
    mean_model = sum(r.model_s * r.count for r in rows) / n if n else None
    if mean_model and late / s > TOLERANCE * mean_model:
        return Check("phantoms", False, detail + f": more than {TOLERANCE:.0%} of the mean collective "
                     f"({mean_model * 1e3:.3g} ms)", "a higher --time-dilation gives the phantoms room "
                     "to follow (their lateness is real time)")
    return Check("phantoms", True, detail)


def model_classes(run: Path, probe: dict[str, list[dict[str, Any]]], summary: dict[str, Any],
                  machine: Any = None, spans: list[Span] | None = None
                  ) -> tuple[list[ClassRow], list[Unjudged], str | None, str | None]:
    """(rows, classes left unjudged, constants description, why there are no rows).

    machine: the MachineConstants to judge with (default: the ones the run recorded). spans: where
    given, each modelled instance is appended to it, with the model's end (testbed.report.iteration)."""
    from testbed.topology.model import Topology
    from testbed.topology.plan import plan_network
    from testbed.topology.reference import NETWORK_ONLY, MachineConstants, ModelError, for_hosts, predict, with_alpha

    world = int(summary.get("world_size") or 0)
    groups = summary.get("groups")
    if isinstance(groups, list) and groups:
        worlds = [str(g.get("name")) for g in groups if isinstance(g, dict) and g.get("kind") == "group"]
        return [], [], None, (f"a run of {len(worlds)} replica group(s) ({', '.join(worlds)}), each its own torch "
                              "world: the model judges the collectives of one world (see the groups' steps and quorum)")
    if machine is None and not summary.get("machine"):
        return [], [], None, "no calibrated machine constants were recorded (testbed calibrate)"
    topo_json = rundir.read_json(run / "topology.json")
    if not topo_json:
        return [], [], None, "no topology snapshot in the run directory"
    ranks = rank_workers(probe, world, summary)
    if ranks is None:
        return [], [], None, "the probe did not record every rank's worker"
    inst = instances(probe, world, recording_ranks(summary, world))
    if not inst:
        return [], [], None, "no complete collective on the whole world was recorded"
    s = float((summary.get("time_dilation") or {}).get("factor") or 1.0)
    topo = Topology.from_json({k: v for k, v in topo_json.items() if k != "hosts"})
    plan = plan_network(topo)
    calibrated = machine if machine is not None else MachineConstants.from_json(summary["machine"])
    backends = {str(r.get("be")) for recs in probe.values() for r in recs if r.get("ev") == "coll" and r.get("be")}
    backend = "nccl" if backends == {"nccl"} else "gloo"
    burst = [inst.pop(k) for k in [k for k in inst if k[0] == LATENCY_OP]]
    constants = for_hosts(calibrated, topo.host_rate)
    measured_alpha = run_alpha(topo, plan, ranks, [i for xs in burst for i in xs], constants, s, backend)
    if measured_alpha is not None:
        constants = with_alpha(constants, *measured_alpha)
        calibrated = constants
    if not inst:
        return [], [], constants.describe(), "no complete collective of the job on the whole world was recorded"
    total = sum((i["end"] - i["start"]) / s for xs in inst.values() for i in xs)
    alone: dict[tuple, tuple[Any, Any]] = {}   # class -> (the model's prediction, the links' alone)
    unjudged = []
    by_time = sorted(inst.items(), key=lambda kv: -sum(i["end"] - i["start"] for i in kv[1]))
    for (op, nbytes, who), xs in by_time:
        who_workers = [ranks[r] for r in who] if who else ranks
        try:
            alone[(op, nbytes, who)] = (
                predict(topo, plan, op, nbytes, who_workers, constants, backend=backend),
                predict(topo, plan, op, nbytes, who_workers, NETWORK_ONLY, backend=backend, placements=1))
        except ModelError as exc:
            unjudged.append(Unjudged(op, nbytes, len(xs), f"the reference model cannot answer: {exc}"))
    shared = _in_flight_together(inst, alone, s, backend)
    rows = []
    for (op, nbytes, who), xs in by_time:
        if (op, nbytes, who) not in alone:
            continue
        p, links = alone[(op, nbytes, who)]
        times = [(i["end"] - i["start"]) / s for i in xs]
        model_s, links_s = (alone_s if all(t == alone_s for t in v) else statistics.fmean(v)
                            for alone_s, v in zip((p.time_s, links.time_s), zip(*shared[(op, nbytes, who)])))
        grown = model_s / p.time_s if p.time_s > 0 else 1.0   # sharing the links with others in flight
        mean = statistics.fmean(times)   # what a loop of them takes per call, stalls included
        noise = relative_ci95(times)
        # alpha's uncertainty (the burst's, or the calibration's spread) moves the model where alpha binds,
        # not the links' declared delays (a WAN's 5 ms is what the topology says, exactly)
        moved = _alpha_moves(topo, plan, op, nbytes, [ranks[r] for r in who] if who else ranks, constants,
                             backend, calibrated.spread)
        model_noise = moved / model_s if model_s > 0 else 0.0
        uncertain = math.hypot(noise, model_noise)
        tol = max(TOLERANCE, uncertain)
        err = mean / model_s - 1 if model_s > 0 else math.inf
        # off beyond even a wide tolerance is off; within one wider than MAX_NOISE cannot be told (either
        # side too uncertain); further off than TOLERANCE but within its uncertainty, neither "within
        # TOLERANCE" nor "off" is shown: the verdict never calls a class within that it measured further off
        if abs(err) > tol:
            status = "off"
        elif uncertain > MAX_NOISE:
            status = "noisy"
        else:
            status = "undecided" if abs(err) > TOLERANCE else "within"
        real = [t * s for t in times]
        if spans is not None:
            spans += [Span(i["start"], i["end"], i["start"] + m * s, bool(i.get("ddp")), who)
                      for i, (m, _) in zip(xs, shared[(op, nbytes, who)])]
        rows.append(ClassRow(op, nbytes, len(xs), mean, model_s, p.lo_s * grown, p.hi_s * grown, err,
                             sum(times) / total if total > 0 else 0.0, p.bottleneck,
                             (min(i["start"] for i in xs), max(i["end"] for i in xs)),
                             links_s=links_s, noise=noise, tolerance=tol, status=status,
                             model_noise=model_noise, backend=backend, alone_s=p.time_s,
                             ticked=sum(t >= TICK_WAIT_S for t in real) / len(real),
                             median_real_s=statistics.median(real)))
    for (op, nbytes), count in sorted(launches_only(probe).items()):
        unjudged.append(Unjudged(op, nbytes, count, "asynchronous: only its launch was recorded, not its completion"))
    return rows, unjudged, constants.describe(), None if rows else "no recorded collective is modelled"


def _steps_check(probe: dict[str, list[dict[str, Any]]], spans: list[Span], s: float) -> Check | None:
    """The job's steps against the same steps with each of its collectives at the model's time
    (testbed.report.iteration), for a job that gave no expected iteration: informational, since it
    follows from the classes' own checks; it says what their misses cost the steps."""
    mine = step_ends(probe)
    both = expected_iteration(mine[1], spans, s, mine[0]) if mine else None
    if both is None:
        return None
    it, expected = both
    return Check("steps", None, f"iteration p50 {it * 1e3:.4g} ms (rank {mine[0]}), {100 * (it / expected - 1):+.1f}% "
                                f"against {expected * 1e3:.4g} ms for the same steps with each of its collectives at "
                                "the model's time (its compute as measured): what the communication's misses cost "
                                "the steps")


def _alpha_moves(topo: Any, plan: Any, op: str, nbytes: int, workers: list[str], constants: Any, backend: str,
                 spread: float) -> float:
    """How far (seconds) the model moves with alpha at either end of its spread: all of alpha's part
    where it binds, less where the transfer hides it (a step takes the longer of the two). The first
    ECMP placement: where alpha binds does not depend on which path a connection hashed to."""
    from testbed.topology.reference import predict, with_alpha

    if not spread > 0 or constants.alpha_s <= 0:
        return 0.0
    base = predict(topo, plan, op, nbytes, workers, constants, backend=backend, placements=1).time_s
    return max(abs(predict(topo, plan, op, nbytes, workers,
                           with_alpha(constants, constants.alpha_s * max(0.0, 1 + d), constants.spread, ""),
                           backend=backend, placements=1).time_s - base) for d in (spread, -spread))


TICK_WAIT_S = 0.002   # real time: a latency-bound instance this long waited a scheduler tick (4 ms at HZ=250)
TICK_WAIT_MIN = 0.10  # the share of a class's instances that makes it worth naming
TICK_WAIT_COUNT = 20  # instances a class needs for that share to say something
LATENCY_BOUND_S = 0.001   # real time: a class whose median instance is shorter than this


def tick_wait_check(rows: list[ClassRow]) -> Check | None:
    """gloo's latency-bound classes (a median instance under LATENCY_BOUND_S, real time, and at least
    TICK_WAIT_COUNT instances) of which at least TICK_WAIT_MIN took TICK_WAIT_S or more: named in
    the verdict's lines, not deciding. On this kind of machine that is the signature of gloo's
    device loop spinning on a message whose operation the rank's worker thread has not posted,
    while that thread waits for the CPU until the scheduler's tick (docs/fidelity.md, "Small
    messages under time-sharing"); a GPU server does not pay it."""
    hit = [r for r in rows if r.backend == "gloo" and r.median_real_s < LATENCY_BOUND_S
           and r.ticked >= TICK_WAIT_MIN and r.count >= TICK_WAIT_COUNT]
    if not hit:
        return None
    said = "; ".join(f"{r.op} {format_size(r.nbytes)} {100 * r.ticked:.0f}% of {r.count} (median "
                     f"{r.median_real_s * 1e3:.2f} ms)" for r in sorted(hit, key=lambda r: -r.ticked))
    return Check("tick waits", None, f"small collectives whose instances took a scheduler tick or more "
                                     f"({TICK_WAIT_S * 1e3:.0f} ms real) now and then: {said}. Their time "
                                     "includes waits a GPU server does not pay; here that is the signature of "
                                     "gloo's device loop spinning while the rank's thread it waits for is off "
                                     "the CPU (docs/fidelity.md, \"Small messages under time-sharing\")")


def _in_flight_together(inst: dict[tuple, list[dict[str, Any]]], alone: dict[tuple, tuple[Any, Any]], s: float,
                        backend: str) -> dict[tuple, list[tuple[float, float]]]:
    """class -> per instance, (the model's time, the links' time) with the collectives that were in
    flight beside it sharing the links (testbed.report.sharing); a collective alone keeps its time
    alone. Only collectives on the whole world share: a pair's send and receive keeps its own."""
    keys = [(k, i) for k, xs in inst.items() if k in alone for i in xs]
    out: dict[tuple, list[tuple[float, float]]] = {}
    world = [(k, i) for k, i in keys if k[2] == ()]
    per_kind = []
    for which in (0, 1):   # the model, then the links alone
        launches = [Launch(i["start"] / s, i["end"] / s, max(0.0, alone[k][which].time_s), str(i.get("group")),
                           bool(i.get("async"))) for k, i in world]
        per_kind.append(shared_times(launches, LANES.get(backend, 1)))
    for n, (k, _) in enumerate(world):
        out.setdefault(k, []).append((per_kind[0][n], per_kind[1][n]))
    for k, _ in keys:
        if k[2] != ():
            out.setdefault(k, []).append((alone[k][0].time_s, alone[k][1].time_s))
    return out


# -- the CPU, delay-line and queue checks ------------------------------------------------------------------


# -- putting it together -----------------------------------------------------------------------------------


def judge(run: str | Path, expected_iteration_s: float | None = None, analysis: dict[str, Any] | None = None,
          machine: Any = None) -> Verdict:
    """The verdict on RUN. machine: the MachineConstants to judge with instead of the recorded ones
    (a calibration measured again after the run contradicted the one it recorded)."""
    from testbed.report.analyze import analyze, load_probe

    run = Path(run)
    a = analysis or analyze(run)
    summary = a["summary"]
    s = float(a["dilation"])
    probe = load_probe(run)
    monitor = rundir.read_json(run / "monitor.json")
    monitor = monitor if isinstance(monitor, dict) else {}   # (from disk: a list or a number is no monitor)
    checks: list[Check] = []
    reasons: list[str] = []
    fixes: list[str] = []

    spans: list[Span] = []
    rows, unjudged, constants, why_none = model_classes(run, probe, summary, machine, spans)
    iteration_undecided = False
    judged = [r for r in rows if r.status in ("within", "off")]
    total = sum(r.measured_s * r.count for r in judged)
    predicted = sum(r.model_s * r.count for r in judged)
    verified = bool(judged)
    for r in rows:
        checks.append(_class_check(r))
    # the judged classes' total decides only where they hold a material share of the time: a minor class
    # alone (the rest too uncertain to judge) is named as minor, and must not fail the run as a total
    if (judged and total > 0 and predicted > 0 and abs(total / predicted - 1) > TOLERANCE
            and sum(r.share for r in judged) >= MATERIAL):
        checks.append(Check("model", False, f"communication in total {total * 1e3:.4g} ms, "
                                            f"{total / predicted:.2f}x the model's {predicted * 1e3:.4g} ms"))
    if not rows:
        checks.append(Check("model", None, f"not compared with the model: {why_none}"))

    if expected_iteration_s:
        p50s = [r["iter_p50_s"] for r in a["ranks"] if r.get("iter_p50_s")]
        if p50s:
            verified = True
            it = statistics.median(p50s)
            err = it / expected_iteration_s - 1
            # as for a class: the floor, or the 95% interval of the steps of the rank at the median
            # (DDP's ranks step together: their step times are one sample, not world-size ones)
            mid = min((r for r in a["ranks"] if r.get("iter_p50_s")), key=lambda r: abs(r["iter_p50_s"] - it))
            noise = relative_ci95([x["dt"] for x in mid.get("step_times") or []])
            tol = max(TOLERANCE, noise)
            # as for a class: further off than TOLERANCE but within the steps' noise is undecided
            iteration_undecided = TOLERANCE < abs(err) <= tol
            checks.append(Check("iteration", None if iteration_undecided else abs(err) <= tol,
                                f"iteration p50 {it * 1e3:.4g} ms, {100 * err:+.1f}% against the expected "
                                f"{expected_iteration_s * 1e3:.4g} ms, tolerance +-{100 * tol:.0f}%"
                                + (f" (undecided: more than {TOLERANCE:.0%} off, within the steps' own noise)"
                                   if iteration_undecided else "")
                                + _arrival_spread(probe, summary, s)))
    steps = None if expected_iteration_s else _steps_check(probe, spans, s)
    if steps is not None:   # (said whatever the verdict: it decides nothing)
        checks.append(steps)
        reasons.append(steps.detail)

    cpu = cpu_check(monitor, s, active_window(probe), recording_ranks(summary, int(summary.get("world_size") or 1)),
                    _devices(summary, monitor),
                    capped=bool((summary.get("time_dilation") or {}).get("cap_cpu") or summary.get("real_cpu_cap")),
                    rank_cores=recorded_rank_cores(summary))
    checks.append(cpu)
    ph = phantom_check(summary, rows, s)
    if ph is not None:
        checks.append(ph)
    if not monitor:
        checks.append(Check("monitor", None, "no CPU, queue or delay-line samples (monitor.json missing)"))
    checks += delay_line_checks(monitor, s)
    during = cpu_while_collectives(monitor, [(sp.start, sp.end) for sp in spans])
    saturated = during is not None and during.ok is None
    if during is not None:
        checks.append(during)
        if saturated:   # informational, but the misses it explains must not be called anything else
            reasons.append(during.detail)
    shared = machine_check(monitor)
    if shared is not None:
        checks.append(shared)
    q = queue_check(monitor)
    if q is not None:
        checks.append(q)
    ticks = tick_wait_check(rows)
    if ticks is not None:
        checks.append(ticks)
        reasons.append(ticks.detail)   # informational, but a user reading the numbers should see it

    failed = [c for c in checks if c.ok is False]
    for c in failed:
        reasons.append(c.detail)
        if c.fix and c.fix not in fixes:
            fixes.append(c.fix)
    off_material = [r for r in rows if r.status == "off" and r.share >= MATERIAL]
    slow = [r for r in off_material if r.error > 0]
    fast = [r for r in off_material if r.error < 0]
    shared_busy = shared is not None and shared.ok is None
    if slow and cpu.ok is not False and not shared_busy:
        fixes += slow_fixes(run, summary, machine, slow, s, saturated=during.fix if saturated else None)
    if fast:
        fixes.append(", ".join(f"{r.op} {format_size(r.nbytes)}" for r in fast)
                     + " ran faster than the model: docs/fidelity.md says where the emulation is "
                     "optimistic (latency-bound messages); `testbed calibrate --history` shows whether this "
                     "machine's constants moved")
    undecided = [r for r in rows if r.status == "undecided"]
    if undecided:   # neither within TOLERANCE nor off by more than their uncertainty
        reasons.append(f"undecided: more than {TOLERANCE:.0%} off the model, but within their own uncertainty, so "
                       f"whether they are within {TOLERANCE:.0%} is not shown: " + "; ".join(
                           f"{_class_what(r)}, {_uncertainty(r)}" for r in undecided))
    minor = [r for r in rows if r.status == "off" and r.share < MATERIAL]
    if minor:
        reasons.append("off the model but a minor share of the communication time (named, not deciding): "
                       + "; ".join(_class_what(r) for r in minor))
    noisy = [r for r in rows if r.status == "noisy"]
    if noisy:
        reasons.append(f"too uncertain to judge (wider than +-{MAX_NOISE:.0%}, the measured mean's 95% interval and "
                       "the model's own uncertainty together): " + "; ".join(
                           f"{_class_what(r)}, {_uncertainty(r)}" for r in noisy))
    if unjudged:
        reasons.append("not judged: " + "; ".join(f"{u.op} {format_size(u.nbytes)} (x{u.count}): {u.why}"
                                                  for u in unjudged))
    if failed and shared_busy and all(c.name in ("model", "iteration") for c in failed):
        # the misses are all the model's, and others took the CPUs meanwhile: they may be theirs
        status = "inconclusive"
        reasons.append(shared.detail + f" (more than {OTHERS_MAX:.0%}): the misses above may be theirs, "
                                       "not the emulation's")
        fixes.insert(0, "run it again on a quieter machine (testbed top shows what else runs)")
    elif failed:
        status = "not faithful"
        if shared_busy:
            reasons.append(shared.detail)
    elif iteration_undecided or ((noisy or undecided) and sum(r.share for r in noisy + undecided) >= MATERIAL):
        # (one alpha makes many classes uncertain at once: their shares count together)
        status = "inconclusive"
        if iteration_undecided:
            reasons += [c.detail for c in checks if c.name == "iteration"]
            fixes.append("a longer run (more steps) narrows the iteration's interval; so does a quieter machine")
        if any(r.noise >= r.model_noise for r in noisy + undecided):
            fixes.append("more instances of the noisy classes (a longer run) narrow their intervals; so does a "
                         "quieter machine")
        if any(r.model_noise > r.noise for r in noisy + undecided):
            fixes.append("the model's uncertainty is alpha's, which the run measures with a burst of small "
                         "all_reduces after init_process_group: `testbed run --env TESTBED_LATENCY_BURST=40 ...` "
                         "measures it with more")
    elif verified:
        status = "faithful"
        within = [r for r in rows if r.status == "within"]
        if within:
            reasons.insert(0, f"{sum(r.count for r in within)} collective(s) in {len(within)} class(es) within "
                              "their tolerance of the model (" + ", ".join(
                                  f"{r.op} {format_size(r.nbytes)} {100 * r.error:+.1f}% of +-{100 * r.tolerance:.0f}%"
                                  for r in within[:4]) + (", ..." if len(within) > 4 else "") + ")")
        reasons += [c.detail for c in checks if c.name == "iteration"]
        reasons.append(cpu.detail)
    else:
        status = "unverified"
        reasons.insert(0, why_none or ("every class was too uncertain to judge" if noisy or undecided
                                       else "nothing to compare with"))
    if ph is not None and ph.ok is not False:   # which ranks were real is said whatever the verdict
        reasons.append(ph.detail)
    return Verdict(status, reasons, fixes, checks, rows, constants, unjudged)


def _class_what(r: ClassRow) -> str:
    what = (f"{r.op} {format_size(r.nbytes)} (x{r.count}, {100 * r.share:.0f}% of the time): {r.measured_s * 1e3:.3g} ms, "
            f"{r.measured_s / r.model_s:.2f}x the model's {r.model_s * 1e3:.3g} ms")
    if r.shared:
        what += f" ({r.alone_s * 1e3:.3g} ms alone; it shared the links with collectives in flight beside it)"
    if r.bounded:
        what += (f" (median ECMP placement; {'inside' if r.in_bounds else 'outside'} its bounds "
                 f"{r.lo_s * 1e3:.3g}-{r.hi_s * 1e3:.3g} ms)")
    return what


def _uncertainty(r: ClassRow) -> str:
    """The measurement's interval, and the model's when it has one worth naming."""
    out = f"measured +-{100 * r.noise:.0f}%"
    return out + (f", model +-{100 * r.model_noise:.0f}% (alpha's spread)" if r.model_noise >= 0.005 else "")


def _class_check(r: ClassRow) -> Check:
    what = _class_what(r) + f", tolerance +-{100 * r.tolerance:.0f}%"
    if r.status == "noisy":
        return Check("model", None, what + f": too uncertain to judge ({_uncertainty(r)})")
    if r.status == "undecided":
        return Check("model", None, what + f": undecided, more than {TOLERANCE:.0%} off but within its "
                                           f"uncertainty ({_uncertainty(r)})")
    if r.status == "off":
        return Check("model", False if r.share >= MATERIAL else None, what)
    return Check("model", True, what)


def _devices(summary: dict[str, Any], monitor: dict[str, Any]) -> int | None:
    """What the ranks time-share: the GPUs the testbed handed out, else the CPU cores (None: unknown)."""
    gpus = int((summary.get("gpus") or 0))
    cores = monitor.get("cores") or summary.get("cores")
    return gpus if gpus > 0 else (int(cores) if cores else None)


