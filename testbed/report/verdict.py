"""The verdict on a run: did the emulation hold? `faithful`, `not faithful` or `unverified`.

Evidence (a run directory, see testbed.jobs.rundir):

1. The model: every collective the probe saw on the whole world is one
   instance across the ranks (same process group, same sequence number); its
   time is from the last rank's arrival to the last rank's completion (real
   clock, divided by the dilation factor), so waiting for a late rank is not
   counted. Instances of one (collective, size) form a class whose mean (what
   a loop of them takes per call, stalls included) is compared with the reference model (testbed.topology.reference) for those
   ranks on that topology, with the machine constants the run recorded. A
   class off by more than TOLERANCE that holds at least MATERIAL of the
   measured communication time fails the run; so does the total.
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
iteration) is `faithful`; with nothing to compare it is `unverified`, never
faithful. Every failure says by how much and what to change.
"""

from __future__ import annotations

import math
import statistics
from itertools import zip_longest
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.jobs import rundir
from testbed.topology.units import format_size

TOLERANCE = 0.10   # |measured - model| / model beyond this is "off"
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
    error: float           # relative, 0 inside [lo, hi]
    share: float           # of all measured communication time
    bottleneck: str
    window: tuple[float, float] = (0.0, 0.0)   # real wall time of the first instance's start, the last's end


@dataclass
class Verdict:
    status: str                              # "faithful" | "not faithful" | "unverified"
    reasons: list[str]
    fixes: list[str]
    checks: list[Check] = field(default_factory=list)
    classes: list[ClassRow] = field(default_factory=list)
    constants: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reasons": self.reasons, "fixes": self.fixes,
                "checks": [asdict(c) for c in self.checks], "classes": [asdict(c) for c in self.classes],
                "constants": self.constants}

    def lines(self) -> list[str]:
        head = {"faithful": "FAITHFUL", "not faithful": "NOT FAITHFUL", "unverified": "UNVERIFIED"}[self.status]
        out = [f"verdict: {head}"]
        out += [f"  - {r}" for r in self.reasons]
        out += [f"  fix: {f}" for f in self.fixes]
        return out


# -- the model check ---------------------------------------------------------------------------------------


def instances(probe: dict[str, list[dict[str, Any]]], world: int, recording: int | None = None
              ) -> dict[tuple[str, int, tuple[int, ...]], list[dict[str, Any]]]:
    """(op, bytes, ranks) -> complete instances: {"start", "end"} (real seconds).

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
            if r.get("async") and r.get("src") != "ddp":   # launch time only: no completion to time
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
            op, ranks = _MODEL_OP.get(recs[0].get("op", "")), ()
            if len(recs) != recording or op is None or any(_MODEL_OP.get(r.get("op", "")) != op for r in recs):
                continue
        try:   # records come from ranks: a malformed one drops its instance, not the report
            start = max(float(r["t"]) for r in recs)
            end = max(float(r["t"]) + float(r["dur"]) for r in recs)
            nbytes = int(recs[0].get("bytes") or 0)
        except (KeyError, TypeError, ValueError):
            continue
        out.setdefault((op, nbytes, ranks), []).append({"start": start, "end": end})
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


def model_classes(run: Path, probe: dict[str, list[dict[str, Any]]], summary: dict[str, Any]
                  ) -> tuple[list[ClassRow], str | None, str | None]:
    """(rows, constants description, why there are none)."""
    from testbed.topology.model import Topology
    from testbed.topology.plan import plan_network
    from testbed.topology.reference import MachineConstants, ModelError, predict

    world = int(summary.get("world_size") or 0)
    machine = summary.get("machine")
    if not machine:
        return [], None, "no calibrated machine constants were recorded (testbed calibrate)"
    topo_json = rundir.read_json(run / "topology.json")
    if not topo_json:
        return [], None, "no topology snapshot in the run directory"
    ranks = _rank_workers(probe, world, summary)
    if ranks is None:
        return [], None, "the probe did not record every rank's worker"
    inst = instances(probe, world, _recording(summary, world))
    if not inst:
        return [], None, "no complete collective on the whole world was recorded"
    s = float((summary.get("time_dilation") or {}).get("factor") or 1.0)
    topo = Topology.from_json({k: v for k, v in topo_json.items() if k != "hosts"})
    plan = plan_network(topo)
    constants = MachineConstants.from_json(machine)
    backends = {str(r.get("be")) for recs in probe.values() for r in recs if r.get("ev") == "coll" and r.get("be")}
    backend = "nccl" if backends == {"nccl"} else "gloo"
    total = sum((i["end"] - i["start"]) / s for xs in inst.values() for i in xs)
    rows = []
    for (op, nbytes, who), xs in sorted(inst.items(), key=lambda kv: -sum(i["end"] - i["start"] for i in kv[1])):
        times = [(i["end"] - i["start"]) / s for i in xs]
        try:
            p = predict(topo, plan, op, nbytes, [ranks[r] for r in who] if who else ranks, constants,
                        backend=backend)
        except ModelError:
            continue
        mean = statistics.fmean(times)   # what a loop of them takes per call, stalls included
        rows.append(ClassRow(op, nbytes, len(xs), mean, p.time_s, p.lo_s, p.hi_s, p.error(mean),
                             sum(times) / total if total > 0 else 0.0, p.bottleneck,
                             (min(i["start"] for i in xs), max(i["end"] for i in xs))))
    return rows, constants.describe(), None if rows else "no recorded collective is modelled"


# -- the CPU, delay-line and queue checks ------------------------------------------------------------------


def cpu_check(monitor: dict[str, Any], s: float, window: tuple[float, float] | None, ranks: int,
              devices: int | None, capped: bool = False) -> Check:
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


def judge(run: str | Path, expected_iteration_s: float | None = None, analysis: dict[str, Any] | None = None
          ) -> Verdict:
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

    rows, constants, why_none = model_classes(run, probe, summary)
    total = sum(r.measured_s * r.count for r in rows)
    predicted = sum(r.model_s * r.count for r in rows)
    verified = False
    if rows:
        verified = True
        for r in rows:
            off = abs(r.error) > TOLERANCE
            what = (f"{r.op} {format_size(r.nbytes)} (x{r.count}): {r.measured_s * 1e3:.3g} ms, "
                    f"{r.measured_s / r.model_s:.2f}x the model's {r.model_s * 1e3:.3g} ms")
            if off and r.share >= MATERIAL:
                checks.append(Check("model", False, what, None))
            else:
                checks.append(Check("model", None if off else True, what + (" (a minor share)" if off else "")))
        if total > 0 and predicted > 0 and abs(total / predicted - 1) > TOLERANCE:
            checks.append(Check("model", False, f"communication in total {total * 1e3:.4g} ms, "
                                                f"{total / predicted:.2f}x the model's {predicted * 1e3:.4g} ms"))
    else:
        checks.append(Check("model", None, f"not compared with the model: {why_none}"))

    if expected_iteration_s:
        p50s = [r["iter_p50_s"] for r in a["ranks"] if r.get("iter_p50_s")]
        if p50s:
            verified = True
            it = statistics.median(p50s)
            err = it / expected_iteration_s - 1
            checks.append(Check("iteration", abs(err) <= TOLERANCE,
                                f"iteration p50 {it * 1e3:.4g} ms, {100 * err:+.1f}% against the expected "
                                f"{expected_iteration_s * 1e3:.4g} ms"))

    cpu = cpu_check(monitor, s, _active_window(probe), _recording(summary, int(summary.get("world_size") or 1)),
                    _devices(summary, monitor),
                    capped=bool((summary.get("time_dilation") or {}).get("cap_cpu") or summary.get("real_cpu_cap")))
    checks.append(cpu)
    ph = phantom_check(summary, rows, s)
    if ph is not None:
        checks.append(ph)
    if not monitor:
        checks.append(Check("monitor", None, "no CPU, queue or delay-line samples (monitor.json missing)"))
    checks += delay_line_checks(monitor, s)
    q = queue_check(monitor)
    if q is not None:
        checks.append(q)

    failed = [c for c in checks if c.ok is False]
    for c in failed:
        reasons.append(c.detail)
        if c.fix and c.fix not in fixes:
            fixes.append(c.fix)
    ratio = total / predicted if predicted else 1.0
    if any(c.name == "model" for c in failed) and cpu.ok is not False and ratio > 1 + TOLERANCE:
        fixes.append(f"the CPUs were not oversubscribed, yet the collectives ran {ratio:.2f}x the model: a higher "
                     f"--time-dilation (about {math.ceil(s * ratio)}) gives the emulation more room; "
                     "docs/fidelity.md says what the model does not capture")
    elif any(c.name == "model" for c in failed) and ratio < 1 - TOLERANCE:
        fixes.append(f"the collectives ran faster than the model ({ratio:.2f}x): if they were large, this machine "
                     "moves bytes faster than when it was calibrated (`testbed calibrate --refresh` on a quiet "
                     "machine); if small, docs/fidelity.md says where the emulation is optimistic (latency-bound "
                     "messages)")
    if failed:
        status = "not faithful"
    elif verified:
        status = "faithful"
        if rows:
            reasons.append(f"{sum(r.count for r in rows)} collective(s) in {len(rows)} class(es) within "
                           f"{TOLERANCE:.0%} of the model")
        reasons += [c.detail for c in checks if c.name == "iteration"]
        reasons.append(cpu.detail)
    else:
        status = "unverified"
        reasons.append(why_none or "nothing to compare with")
    return Verdict(status, reasons, fixes, checks, rows, constants)


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
