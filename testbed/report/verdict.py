"""The verdict on a run: did the emulation hold? `faithful`, `not faithful` or `unverified`.

Evidence (a run directory, see testbed.jobs.rundir):

1. The model: every collective the probe saw on the whole world is one
   instance across the ranks (same process group, same sequence number); its
   time is from the last rank's arrival to the last rank's completion (real
   clock, divided by the dilation factor), so waiting for a late rank is not
   counted. Instances of one (collective, size) form a class whose mean (what
   a loop of them takes per call, stalls included) is compared with the reference model (testbed.topology.reference) for those
   ranks on that topology, with the machine constants the run recorded and
   the hosts the topology declares (Topology.host_rate). Each class has its
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
from itertools import zip_longest
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.jobs import rundir
from testbed.report.analyze import LATENCY_OP
from testbed.topology.units import format_size

TOLERANCE = 0.10   # |measured - model| / model beyond this is "off" (the floor of a class's tolerance)
MAX_NOISE = 0.25   # a class whose mean is less certain than this (95% interval, relative) is not judged
# Others' share of the CPUs during a run above which its misses may be theirs. Measured here: 0.8% in
# a quiet run; 13% while a test suite ran beside it, which slowed its all_reduce by 1.3-1.5x.
OTHERS_MAX = 0.05
MATERIAL = 0.10    # a class with this share of the measured communication time decides the verdict
LATE_US_MIN = 50   # delay-line lateness below this is noise, whatever the delay

_MODEL_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "reduce_scatter": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "broadcast": "broadcast", "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
             "barrier": "barrier"}


@dataclass
class Check:
    name: str
    ok: bool | None        # None: informational
    detail: str
    fix: str | None = None


@dataclass
class ClassRow:
    op: str
    nbytes: int
    count: int
    measured_s: float      # mean instance, emulated time
    model_s: float
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
    status: str = "within"  # "within" | "off" | "undecided" (off by more than TOLERANCE, within its
    #                          uncertainty) | "noisy" (an uncertainty wider than MAX_NOISE)

    @property
    def bounded(self) -> bool:
        return self.hi_s > self.lo_s * (1 + 1e-9)

    @property
    def in_bounds(self) -> bool:
        return self.lo_s <= self.measured_s <= self.hi_s


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


def instances(probe: dict[str, list[dict[str, Any]]], world: int, recording: int | None = None
              ) -> dict[tuple[str, int, tuple[int, ...]], list[dict[str, Any]]]:
    """(op, bytes, ranks) -> complete instances: {"start", "end", "skew"} (real seconds; skew: from
    the first rank's arrival to the last's, the wait that is in the ranks' steps but not in `end - start`).

    Collectives on the whole world (ranks = ()), matched by process group and sequence number;
    blocking sends and receives, the k-th send from a to b with the k-th receive at b from a
    (ranks = (a, b), op "send_recv"). recording: how many ranks have probe records (the real
    ones of a run with phantoms; default: all of them); an instance is complete with theirs."""
    recording = world if recording is None else recording
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for label, recs in probe.items():
        start = next((r for r in recs if r.get("ev") == "start"), {})
        me = start.get("rank")
        p2p_count: dict[tuple[int, int], int] = {}
        for r in recs:
            if r.get("ev") != "coll" or "seq" not in r:
                continue
            if r.get("async") and r.get("src") != "ddp" and not r.get("done"):   # a launch without its completion
                continue
            if r.get("op") in ("send", "recv"):
                peer = r.get("peer")
                if not isinstance(me, int) or not isinstance(peer, int):
                    continue
                pair = (me, peer) if r["op"] == "send" else (peer, me)
                p2p_count[pair] = k = p2p_count.get(pair, 0) + 1
                by_key.setdefault(("p2p", pair, k), []).append(r)
            elif r.get("gn") == world and isinstance(r.get("seq"), int):
                by_key.setdefault((str(r.get("g")), r["seq"]), []).append(r)
    out: dict[tuple[str, int, tuple[int, ...]], list[dict[str, Any]]] = {}
    for key, recs in by_key.items():
        if key[0] == "p2p":
            if sorted(r["op"] for r in recs) != ["recv", "send"]:
                continue
            op, ranks = "send_recv", key[1]
        else:
            raw = recs[0].get("op")
            op, ranks = _MODEL_OP.get(raw, raw) if isinstance(raw, str) else None, ()   # unmodelled: unjudged later
            if len(recs) != recording or op is None or any(_MODEL_OP.get(r.get("op"), r.get("op")) != op for r in recs):
                continue
        try:   # records come from ranks: a malformed one drops its instance, not the report
            start = max(float(r["t"]) for r in recs)
            first = min(float(r["t"]) for r in recs)
            end = max(float(r["t"]) + float(r["dur"]) for r in recs)
            nbytes = int(recs[0].get("bytes") or 0)
        except (KeyError, TypeError, ValueError):
            continue
        out.setdefault((op, nbytes, ranks), []).append({"start": start, "end": end, "skew": start - first})
    return out


def _arrival_spread(probe: dict[str, list[dict[str, Any]]], summary: dict[str, Any], s: float) -> str:
    """How far apart the ranks reached their collectives (mean, emulated): the expected iteration has
    every rank compute in the ranks' typical time, and ranks that share CPUs come out uneven; the wait
    for the last one is in every step but in no collective's time (2026-12-02, k=4 fat-tree main job:
    rank 0's median step held 77 ms of all_reduce against the class's 60 ms)."""
    world = int(summary.get("world_size") or 1)
    skews = [i["skew"] for k, xs in instances(probe, world, _recording(summary, world)).items()
             if k[2] == () and k[0] != LATENCY_OP for i in xs]
    if world < 2 or not skews:
        return ""
    return (f"; the ranks reached a collective {statistics.fmean(skews) / s * 1e3:.3g} ms apart on average "
            "(waiting for the last one is in the steps, not in the collectives' times)")


def launches_only(probe: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, int], int]:
    """(op, bytes) -> how many asynchronous collectives the lowest rank launched whose completion
    was not recorded (a probe older than completion timing, or a job that never waited on them)."""
    out: dict[tuple[str, int], int] = {}
    first = min(probe, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k), default=None)
    for r in probe.get(first, []) if first is not None else []:
        if r.get("ev") == "coll" and r.get("async") and r.get("src") != "ddp" and not r.get("done"):
            key = (str(r.get("op")), int(r.get("bytes") or 0) if isinstance(r.get("bytes"), int) else 0)
            out[key] = out.get(key, 0) + 1
    return out


def _rank_workers(probe: dict[str, list[dict[str, Any]]], world: int,
                  summary: dict[str, Any] | None = None) -> list[str] | None:
    workers: dict[int, str] = {}
    if summary and summary.get("phantoms"):   # phantoms record nothing: the launcher's own table
        for r in summary.get("ranks") or []:
            if isinstance(r, dict) and isinstance(r.get("rank"), int) and isinstance(r.get("worker"), str):
                workers[r["rank"]] = r["worker"]
    for recs in probe.values():
        start = next((r for r in recs if r.get("ev") == "start"), None)
        if start and isinstance(start.get("rank"), int) and start.get("worker"):
            workers[start["rank"]] = str(start["worker"])
    if sorted(workers) != list(range(world)):
        return None
    return [workers[r] for r in range(world)]


def _recording(summary: dict[str, Any], world: int) -> int:
    """How many ranks ran the job (and have probe records): the real ones when there were phantoms
    (they compute nothing; their traffic is the network's to carry, which the model accounts)."""
    ph = summary.get("phantoms")
    if isinstance(ph, dict) and isinstance(ph.get("real_ranks"), list) and (ph["real_ranks"] or summary.get("replay")):
        return len(ph["real_ranks"])   # a replay: none computes
    return world


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
                  machine: Any = None) -> tuple[list[ClassRow], list[Unjudged], str | None, str | None]:
    """(rows, classes left unjudged, constants description, why there are no rows).

    machine: the MachineConstants to judge with (default: the ones the run recorded)."""
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
    ranks = _rank_workers(probe, world, summary)
    if ranks is None:
        return [], [], None, "the probe did not record every rank's worker"
    inst = instances(probe, world, _recording(summary, world))
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
    rows, unjudged = [], []
    for (op, nbytes, who), xs in sorted(inst.items(), key=lambda kv: -sum(i["end"] - i["start"] for i in kv[1])):
        times = [(i["end"] - i["start"]) / s for i in xs]
        who_workers = [ranks[r] for r in who] if who else ranks
        try:
            p = predict(topo, plan, op, nbytes, who_workers, constants, backend=backend)
            links = predict(topo, plan, op, nbytes, who_workers, NETWORK_ONLY, backend=backend, placements=1)
        except ModelError as exc:
            unjudged.append(Unjudged(op, nbytes, len(xs), f"the reference model cannot answer: {exc}"))
            continue
        mean = statistics.fmean(times)   # what a loop of them takes per call, stalls included
        noise = _interval(times)
        # alpha's uncertainty (the burst's, or the calibration's spread) moves the model's latency part
        model_noise = calibrated.spread * (p.latency_s / p.time_s) if p.time_s > 0 else 0.0
        uncertain = math.hypot(noise, model_noise)
        tol = max(TOLERANCE, uncertain)
        err = mean / p.time_s - 1 if p.time_s > 0 else math.inf
        # off beyond even a wide tolerance is off; within one wider than MAX_NOISE cannot be told (either
        # side too uncertain); further off than TOLERANCE but within its uncertainty, neither "within
        # TOLERANCE" nor "off" is shown: the verdict never calls a class within that it measured further off
        if abs(err) > tol:
            status = "off"
        elif uncertain > MAX_NOISE:
            status = "noisy"
        else:
            status = "undecided" if abs(err) > TOLERANCE else "within"
        rows.append(ClassRow(op, nbytes, len(xs), mean, p.time_s, p.lo_s, p.hi_s, err,
                             sum(times) / total if total > 0 else 0.0, p.bottleneck,
                             (min(i["start"] for i in xs), max(i["end"] for i in xs)),
                             links_s=links.time_s, noise=noise, tolerance=tol, status=status,
                             model_noise=model_noise, backend=backend))
    for (op, nbytes), count in sorted(launches_only(probe).items()):
        unjudged.append(Unjudged(op, nbytes, count, "asynchronous: only its launch was recorded, not its completion"))
    return rows, unjudged, constants.describe(), None if rows else "no recorded collective is modelled"


LATENCY_WARMUP = 2             # the burst's first ones pay for connections and first touches: not counted


def run_alpha(topo: Any, plan: Any, ranks: list[str], burst: list[dict[str, Any]], constants: Any, s: float,
              backend: str) -> tuple[float, float, str] | None:
    """(alpha, its relative uncertainty, where it comes from) measured in the run itself: the probe's
    small all_reduces after init_process_group, less what the model gives them without a per-message
    cost, per message. None when the run has too few of them (no probe burst: a replay, an older
    probe, nccl): the calibration's alpha then stands. With phantoms the burst is mirrored like the
    job's collectives, and pays the same announcement delay they do.

    Why: what one message costs here depends on the run's own conditions (ranks per core, dilation,
    the machine's load). On the 2-core machine a 16-rank fat-tree at s=15.9 paid 0.69 ms per message
    while calibrations of the same boot said 0.6-1.2 ms (docs/fidelity.md)."""
    from testbed.topology.reference import ModelError, cost_terms, predict, with_alpha

    xs = sorted(burst, key=lambda i: i["start"])[LATENCY_WARMUP:]
    if len(xs) < 3 or backend != "gloo":
        return None
    times = [(i["end"] - i["start"]) / s for i in xs]
    nbytes = LATENCY_BYTES
    try:
        bare = predict(topo, plan, "all_reduce", nbytes, ranks, with_alpha(constants, 0.0, 0.0, ""), backend=backend,
                       placements=1)
    except ModelError:
        return None
    messages = cost_terms("all_reduce", nbytes, len(ranks), backend)[0]
    t = statistics.median(times)
    if messages <= 0 or not t > bare.time_s:
        return None
    alpha = (t - bare.time_s) / messages
    spread = _interval(times) * t / (t - bare.time_s)
    return alpha, spread, f"{RUN_ALPHA} ({len(times)} all_reduce of {nbytes} B after init_process_group)"


LATENCY_BYTES = 4096   # the burst's size (_testbed_probe.LATENCY_BYTES)
RUN_ALPHA = "measured in this run"   # in the constants' description when run_alpha gave the alpha


def run_constants(run: str | Path, machine: Any, topo: Any, ranks: list[str]) -> Any:
    """The constants a run is judged with on its topology's declared hosts: the calibration's,
    with the per-message cost the run measured itself when it did (run_alpha)."""
    from testbed.report.analyze import load_probe
    from testbed.topology.plan import plan_network
    from testbed.topology.reference import for_hosts, with_alpha

    run = Path(run)
    summary = rundir.read_json(run / "summary.json", {}) or {}
    probe = load_probe(run)
    world = int(summary.get("world_size") or len(ranks))
    s = float((summary.get("time_dilation") or {}).get("factor") or 1.0)
    burst = [i for k, xs in instances(probe, world, _recording(summary, world)).items() if k[0] == LATENCY_OP
             for i in xs]
    constants = for_hosts(machine, topo.host_rate)
    backends = {str(r.get("be")) for recs in probe.values() for r in recs if r.get("ev") == "coll" and r.get("be")}
    measured = run_alpha(topo, plan_network(topo), ranks, burst, constants, s,
                         "nccl" if backends == {"nccl"} else "gloo")
    return with_alpha(constants, *measured) if measured is not None else constants


# Student's t at 97.5% for n - 1 degrees of freedom (n = 2..31); beyond, the normal's 1.96
_T975 = (12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def _interval(times: list[float]) -> float:
    """The 95% confidence interval's half-width of the mean of `times`, relative to the mean
    (0 for one instance: nothing says how it varies)."""
    n = len(times)
    mean = statistics.fmean(times) if times else 0.0
    if n < 2 or mean <= 0:
        return 0.0
    t = _T975[n - 2] if n - 2 < len(_T975) else 1.96
    return t * statistics.stdev(times) / math.sqrt(n) / mean


# -- the CPU, delay-line and queue checks ------------------------------------------------------------------


def cpu_check(monitor: dict[str, Any], s: float, window: tuple[float, float] | None, ranks: int,
              devices: int | None, capped: bool = False, rank_cores: float = 1.0) -> Check:
    """Ranks per compute device against the factor; the CPU samples say how busy the machine was.

    A rank that shares its device with r - 1 others computes r times slower, so the factor must
    be at least ranks / devices (DieCast's rule). Runnable tasks per core are reported: gloo runs
    more than one thread per rank, and the calibration's own two ranks kept ~1.5 per core
    runnable on two cores, so they are evidence to read, not a threshold."""
    if not devices:
        return Check("cpu", None, "how many cores or GPUs the ranks shared was not recorded")
    need = max(1.0, ranks / devices)
    samples = [c for c in monitor.get("cpu") or [] if window is None or window[0] <= c["t"] <= window[1]]
    cores = int(monitor.get("cpu_cores") or monitor.get("cores") or 1)   # (over hosts: the sampled machine's)
    detail = f"{ranks} ranks on {devices} compute device(s) need dilation >= {need:.3g}, the run had {s:g}"
    if capped and rank_cores > 1.0001:   # auto's cap: each rank its share of the cores (dilation.Choice.cap_cores)
        detail += (f", each rank capped at its share of the cores: {rank_cores:.2f} of this machine's cores in "
                   f"emulated time, for its traffic's host work (its compute runs {rank_cores:.2f}x as fast as on "
                   "one core here)")
    if samples:
        runnable = statistics.mean(c["runnable"] for c in samples) / cores
        busy = statistics.mean(c["busy"] for c in samples)
        psi = monitor.get("psi_cpu_some_share")
        detail += (f" ({runnable:.1f} runnable tasks per core, CPUs {100 * busy:.0f}% busy"
                   + (f", some task waiting for a CPU {100 * psi:.0f}% of the time" if psi is not None else "") + ")")
    if s * (1 + TOLERANCE) < need:
        return Check("cpu", False, f"CPU oversubscribed: {detail}: ranks compute {need / s:.1f}x slower than on "
                                   "the emulated cluster", f"--time-dilation {math.ceil(need * 10) / 10:g} "
                                                           "(or fewer ranks per core)")
    if not capped and s > need * (1 + TOLERANCE):
        # Only a warning: other jobs may share the machine (their ranks are not in this run's count);
        # if they do not, the CPU work looks s/need times faster and the model check says so.
        return Check("cpu", None, f"possibly over-dilated: {detail}: unless other jobs share the machine, this "
                                  f"run's CPU work looks {s / need:.1f}x faster than on the emulated cluster "
                                  f"(testbed up --ranks {ranks} makes auto count the ranks you run)")
    return Check("cpu", True, detail)


def delay_line_checks(monitor: dict[str, Any], s: float) -> list[Check]:
    from testbed.net.delayline import lateness_mean, lateness_percentile

    dl = monitor.get("delay_lines") or {}
    first, last = dl.get("first") or {}, dl.get("last") or {}
    out = []
    for link_id, end in last.items():
        if end is None:
            out.append(Check("delay line", False, f"delay line of link {link_id} did not answer at the end of the "
                                                  "run (helper gone?)", "testbed status; testbed cleanup"))
            continue
        start = first.get(link_id) or {}
        for d in ("ab", "ba"):
            e, b = end.get(d) or {}, start.get(d) or {}
            drops = int(e.get("drops", 0)) - int(b.get("drops", 0))
            hist = [x - y for x, y in zip_longest(e.get("late_hist_us_log2") or [], b.get("late_hist_us_log2") or [],
                                                  fillvalue=0)]
            p99 = lateness_percentile(hist, 99) if hist else None
            mean = lateness_mean(hist) if hist else None
            delay = float(e.get("delay_s") or 0.0)
            name = f"link {link_id} {d}"
            if drops > 0:
                out.append(Check("delay line", False, f"delay line {name} dropped {drops} frame(s)",
                                 "a kernel with sch_netem, or fewer delayed links"))
            if mean is None:
                continue
            what = (f"delay line {name}: frames left {mean * 1e6:.0f} us late on average, {p99 * 1e6:.0f} us p99"
                    + (f" ({100 * mean / delay:.0f}% of its {delay * 1e3:.3g} ms delay on average)" if delay else ""))
            # the average lateness is what every frame's delay grows by; a tail alone is reported, not judged
            if mean * 1e6 > LATE_US_MIN and mean > TOLERANCE * delay:
                out.append(Check("delay line", False, what,
                                 "a higher --time-dilation, a kernel with sch_netem, or fewer delayed links"))
            else:
                out.append(Check("delay line", True, what))
    return out


def machine_check(monitor: dict[str, Any]) -> Check | None:
    """Whether work other than the testbed's took the CPUs during the run (monitor.others_cpu_share).
    Informational: a run that shared the machine and still landed on the model is faithful; one that
    missed cannot say whether the miss is the emulation's (judge says inconclusive)."""
    others = monitor.get("others_cpu_share")
    if not isinstance(others, (int, float)):
        return None
    detail = f"other work took {100 * others:.0f}% of the CPUs during the run"
    engines = monitor.get("engines_cpu_share")
    if isinstance(engines, (int, float)):   # the testbed's own, counted with it: said, for the reader's sums
        detail += f" (the delay-line engines, counted as the testbed's: {100 * engines:.0f}%)"
    return Check("machine", None if others > OTHERS_MAX else True, detail)


def queue_check(monitor: dict[str, Any]) -> Check | None:
    drops = [(n, i, q["drops"]) for n, ifs in (monitor.get("qdiscs") or {}).items() for i, q in ifs.items()
             if q.get("drops", 0) > 0]
    if not drops:
        return Check("queues", None, "no queue dropped a packet")
    drops.sort(key=lambda x: -x[2])
    top = ", ".join(f"{n}:{i} {d}" for n, i, d in drops[:3])
    return Check("queues", None, f"{sum(d for *_, d in drops)} packet(s) dropped at full queues ({top}): "
                                 "congestion, as a real switch would drop")


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
    monitor = rundir.read_json(run / "monitor.json") or {}
    checks: list[Check] = []
    reasons: list[str] = []
    fixes: list[str] = []

    rows, unjudged, constants, why_none = model_classes(run, probe, summary, machine)
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
            noise = _interval([x["dt"] for x in mid.get("step_times") or []])
            tol = max(TOLERANCE, noise)
            # as for a class: further off than TOLERANCE but within the steps' noise is undecided
            iteration_undecided = TOLERANCE < abs(err) <= tol
            checks.append(Check("iteration", None if iteration_undecided else abs(err) <= tol,
                                f"iteration p50 {it * 1e3:.4g} ms, {100 * err:+.1f}% against the expected "
                                f"{expected_iteration_s * 1e3:.4g} ms, tolerance +-{100 * tol:.0f}%"
                                + (f" (undecided: more than {TOLERANCE:.0%} off, within the steps' own noise)"
                                   if iteration_undecided else "")
                                + _arrival_spread(probe, summary, s)))

    cpu = cpu_check(monitor, s, _active_window(probe), _recording(summary, int(summary.get("world_size") or 1)),
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
    shared = machine_check(monitor)
    if shared is not None:
        checks.append(shared)
    q = queue_check(monitor)
    if q is not None:
        checks.append(q)

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
        worst = max(r.measured_s / r.model_s for r in slow)
        dil = summary.get("time_dilation") or {}
        if dil.get("cap_cpu") or dil.get("setting") == "auto":
            # auto already hid the host's cost per byte; what is left is CPU work inside the collective
            # (reductions, gloo's copies), which runs at this machine's core speed at any dilation
            # (docs/fidelity.md: all_gather 64 MiB at 1.66x with s=12, 1.83x with s=30)
            fixes.append(f"collectives ran up to {worst:.2f}x the model with the CPUs not oversubscribed: what is "
                         "left is their own CPU work (reductions, gloo's copies of its output), which the emulation "
                         "runs at this machine's core speed whatever the dilation, so a higher --time-dilation does "
                         "not remove it; docs/fidelity.md says which collectives and sizes it touches")
        else:
            fixes.append(f"the CPUs were not oversubscribed, yet collectives ran up to {worst:.2f}x the model: "
                         "--time-dilation auto chooses a dilation that hides this machine's cost per byte; "
                         "docs/fidelity.md says what the model does not capture")
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


RANK_CORES_MAX = 1000.0


def recorded_rank_cores(summary: dict[str, Any]) -> float:
    """The cores of this machine each rank had in emulated time (dilation.Choice.rank_cores), as the
    run's summary recorded it: 1 when it did not, or when the record is not a sane number (it comes
    from disk)."""
    dil = summary.get("time_dilation")
    v = dil.get("rank_cores") if isinstance(dil, dict) else None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 1 <= v <= RANK_CORES_MAX
    return float(v) if ok else 1.0


def _devices(summary: dict[str, Any], monitor: dict[str, Any]) -> int | None:
    """What the ranks time-share: the GPUs the testbed handed out, else the CPU cores (None: unknown)."""
    gpus = int((summary.get("gpus") or 0))
    cores = monitor.get("cores") or summary.get("cores")
    return gpus if gpus > 0 else (int(cores) if cores else None)


def _active_window(probe: dict[str, list[dict[str, Any]]]) -> tuple[float, float] | None:
    """From the first collective or step to the last one, over all ranks (the job's busy time)."""
    ts = [(float(r["t"]), float(r["t"]) + float(r.get("dur") or 0.0)) for recs in probe.values() for r in recs
          if r.get("ev") in ("coll", "step") and "t" in r]
    if not ts:
        return None
    return min(a for a, _ in ts), max(b for _, b in ts)
