"""A verdict's checks besides the model's: each a named outcome with its detail and fix, and those of
the machine a run ran on (CPU oversubscription, the delay lines' lateness, other work, queue drops)."""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from testbed.report.analyze import finite

TOLERANCE = 0.10   # |measured - model| / model beyond this is "off" (the floor of a class's tolerance)


# Others' share of the CPUs during a run above which its misses may be theirs. Measured here: 0.8% in
# a quiet run; 13% while a test suite ran beside it, which slowed its all_reduce by 1.3-1.5x.
OTHERS_MAX = 0.05


LATE_US_MIN = 50   # delay-line lateness below this is noise, whatever the delay
LINES_NAMED = 4    # late delay-line directions named one by one; beyond this, one line says them all

# The CPUs' busy share while the judged collectives ran from which they are called saturated: a value
# chosen between the two measured here (docs/fidelity.md), the main job's 48% (1.6 runnable tasks per
# core, FAITHFUL) and the 64-rank phantom run's 99% (46 per core, all_reduce 2.74x the model).
SATURATED = 0.9
MIN_SAMPLES = 5    # CPU samples inside the collectives before their busy share is said
MAX_RUNNABLE = 1e6   # a sample's runnable count above this is no count (monitor.json comes from disk)
# The delay-line engines' share of the CPUs above which a saturated run's fix says that a higher s does not
# relieve them (chosen: the runs measured took 44-66%, docs/fidelity.md "What the delay lines cost")
ENGINES_MATERIAL = 0.25


@dataclass
class Check:
    name: str
    ok: bool | None        # None: informational
    detail: str
    fix: str | None = None


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
    samples = [c for c in cpu_samples(monitor) if window is None or window[0] <= c["t"] <= window[1]]
    cores = sampled_cores(monitor)
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
    detail += _cap_held_back(monitor)
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


def cpu_samples(monitor: dict[str, Any]) -> list[dict[str, Any]]:
    """The monitor's CPU samples that are what the monitor writes (t, a busy share in 0..1, a count of
    runnable tasks); others are passed over (monitor.json comes from disk)."""
    samples = monitor.get("cpu")
    return [c for c in samples if isinstance(c, dict) and all(_number(c.get(k)) for k in ("t", "busy", "runnable"))
            and c["busy"] <= 1.0 and c["runnable"] <= MAX_RUNNABLE] if isinstance(samples, list) else []


def sampled_cores(monitor: dict[str, Any]) -> int:
    """The cores of the machine the CPU samples come from (over hosts, cpu_cores: `cores` is then the
    run's compute devices); 1 when neither is a count."""
    for key in ("cpu_cores", "cores"):
        n = monitor.get(key)
        if _number(n) and 1 <= n <= MAX_RUNNABLE:
            return int(n)
    return 1


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping spans as one (DDP's buckets are in flight together)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def cpu_while_collectives(monitor: dict[str, Any], spans: list[tuple[float, float]]) -> Check | None:
    """How busy the CPUs were while the judged collectives ran: the monitor's samples whose whole
    interval (sample_s before their time) lies inside an instance (start, end, real seconds). The
    run's CPU check looks at the whole job, compute included; this one is what the collectives'
    times were measured under. ok True below SATURATED; above it informational, with the fix (the
    verdict must not then call the misses the collectives' own work). None with fewer than
    MIN_SAMPLES such samples."""
    step = monitor.get("sample_s")
    step = float(step) if _number(step) and step <= 60 else 0.0
    merged = _merged([(a, b) for a, b in spans if finite(a) and finite(b) and b > a])
    starts = [a for a, _ in merged]
    inside = []
    for c in cpu_samples(monitor):
        i = bisect.bisect_right(starts, c["t"] - step) - 1
        if i >= 0 and c["t"] <= merged[i][1]:
            inside.append(c)
    if len(inside) < MIN_SAMPLES:
        return None
    share = statistics.fmean(c["busy"] for c in inside)
    per_core = statistics.fmean(c["runnable"] for c in inside) / sampled_cores(monitor)
    detail = (f"while the collectives ran, the CPUs were {100 * share:.0f}% busy with {per_core:.1f} runnable tasks "
              f"per core ({len(inside)} samples)")
    if share < SATURATED:
        return Check("cpu while collectives", True, detail)
    engines = monitor.get("engines_cpu_share")
    busy_engines = _number(engines) and 0 < engines <= 1
    if busy_engines:
        detail += f"; the delay-line engines took {100 * engines:.0f}% of the CPUs over the run"
    not_s = (" A higher --time-dilation does not relieve the engines' CPU (it only makes their lateness a smaller "
             "share of each delay): TCP sends smaller frames at a lower rate, and a frame costs them about the "
             "same whatever its size." if busy_engines and engines >= ENGINES_MATERIAL else "")
    return Check("cpu while collectives", None, "CPUs saturated: " + detail,
                 "the testbed's own work (its ranks, the kernel's forwarding at every hop, the delay-line engines) "
                 f"took every CPU while the collectives ran, so their times likely say more about this machine's "
                 f"CPUs than about the links.{not_s} Not yet tried as fixes: fewer ranks on this machine (a phantom "
                 "moves its bytes like a real rank), "
                 + ("a kernel with sch_netem (no delay-line engines), " if busy_engines else "")
                 + "more machines (testbed up --hosts); docs/fidelity.md, \"What the delay lines cost\", has the "
                 "measurements")


def _cap_held_back(monitor: dict[str, Any]) -> str:
    """How often the workers' CPU cap held them back during the run (monitor.json's cpu_cap, from
    their cgroups' counters; it comes from disk: numbers or nothing). Said, not judged: a throttled
    worker waits for its next period, and what that costs a collective shows in its own check."""
    cap = monitor.get("cpu_cap")
    t0, t1 = monitor.get("t0"), monitor.get("t1")
    if not isinstance(cap, dict) or not all(_number(x) for x in (t0, t1)) or t1 <= t0:
        return ""
    periods, throttled, secs, workers = (cap.get(k) for k in ("periods", "throttled", "throttled_s", "workers"))
    if (not all(_number(x) for x in (periods, throttled, secs, workers)) or periods <= 0 or throttled > periods
            or workers < 1 or workers != int(workers) or secs / workers > (t1 - t0) * 1.01):
        return ""
    return (f"; the CPU cap held workers back in {throttled:.0f} of its {periods:.0f} periods "
            f"({100 * throttled / periods:.0f}%), {secs / workers:.2g} s real each on average "
            f"({100 * secs / workers / (t1 - t0):.1f}% of the run)")


def _number(x: Any) -> bool:
    return finite(x) and x >= 0


def delay_line_checks(monitor: dict[str, Any], s: float) -> list[Check]:
    from testbed.net.delayline import lateness_mean, lateness_percentile

    dl = _dict(monitor.get("delay_lines"))
    first, last = _dict(dl.get("first")), _dict(dl.get("last"))
    out, late = [], []
    for link_id, end in last.items():
        if end is None:
            out.append(Check("delay line", False, f"delay line of link {link_id} did not answer at the end of the "
                                                  "run (helper gone?)", "testbed status; testbed cleanup"))
            continue
        start = _dict(first.get(link_id))
        for d in ("ab", "ba"):
            e, b = _dict(_dict(end).get(d)), _dict(start.get(d))
            drops = _count(e.get("drops")) - _count(b.get("drops"))
            hist = [x - y for x, y in zip_longest(_counts(e.get("late_hist_us_log2")),
                                                  _counts(b.get("late_hist_us_log2")), fillvalue=0)]
            hist = hist if all(x >= 0 for x in hist) else []   # counters that went back are no histogram
            p99 = lateness_percentile(hist, 99) if hist else None
            mean = lateness_mean(hist) if hist else None
            delay = e["delay_s"] if _number(e.get("delay_s")) else 0.0
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
                late.append((mean, p99, delay, name, what))
            else:
                out.append(Check("delay line", True, what))
    # (a frame's lateness is real microseconds: at a higher s it is a smaller share of each delay)
    fix = "a higher --time-dilation, a kernel with sch_netem, or fewer delayed links"
    if len(late) <= LINES_NAMED:
        return out + [Check("delay line", False, what, fix) for *_, what in late]
    # a 64-worker leaf-spine has 192 directions: one line for them all, the latest named
    worst = max(late, key=lambda x: x[0])
    shares = [m / d for m, _, d, *_ in late if d]
    of_delay = ""
    if shares:
        on = "" if len(shares) == len(late) else f", on the {len(shares)} with a delay"
        of_delay = f" ({100 * min(shares):.0f}-{100 * max(shares):.0f}% of their delay{on})"
    return out + [Check("delay line", False,
                        f"{len(late)} delay-line directions left frames late: {min(m for m, *_ in late) * 1e6:.0f}-"
                        f"{worst[0] * 1e6:.0f} us on average{of_delay}, p99 up to "
                        f"{max(p for _, p, *_ in late) * 1e6:.0f} us; the latest: {worst[4]}", fix)]


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _count(x: Any) -> int:
    return int(x) if _number(x) and x <= 2 ** 62 else 0


def _counts(x: Any) -> list[int]:
    """A histogram's counts (monitor.json comes from disk): [] unless every bucket is a count."""
    return [int(v) for v in x] if isinstance(x, list) and len(x) <= 64 and all(
        _number(v) and v <= 2 ** 62 for v in x) else []


def machine_check(monitor: dict[str, Any]) -> Check | None:
    """Whether work other than the testbed's took the CPUs during the run (monitor.others_cpu_share).
    Informational: a run that shared the machine and still landed on the model is faithful; one that
    missed cannot say whether the miss is the emulation's (judge says inconclusive)."""
    others = monitor.get("others_cpu_share")
    if not _number(others):
        return None
    detail = f"other work took {100 * others:.0f}% of the CPUs during the run"
    engines = monitor.get("engines_cpu_share")
    if _number(engines):   # the testbed's own, counted with it: said, for the reader's sums
        detail += f" (the delay-line engines, counted as the testbed's: {100 * engines:.0f}%)"
    return Check("machine", None if others > OTHERS_MAX else True, detail)


def queue_check(monitor: dict[str, Any]) -> Check | None:
    drops = [(n, i, _count(_dict(q).get("drops"))) for n, ifs in _dict(monitor.get("qdiscs")).items()
             for i, q in _dict(ifs).items() if _count(_dict(q).get("drops")) > 0]
    if not drops:
        return Check("queues", None, "no queue dropped a packet")
    drops.sort(key=lambda x: -x[2])
    top = ", ".join(f"{n}:{i} {d}" for n, i, d in drops[:3])
    return Check("queues", None, f"{sum(d for *_, d in drops)} packet(s) dropped at full queues ({top}): "
                                 "congestion, as a real switch would drop")
