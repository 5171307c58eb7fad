"""This machine's constants for the reference model, measured once per boot.

The reference model (testbed.topology.reference) needs two numbers per
collective that only a measurement on the machine that runs the testbed can
give:

  alpha  the software cost of one message (send, wake-ups, receive), seconds;
  beta   the host's cost per byte one rank sends, s/B: how fast a rank moves
         data when the network is not the limit (copies, the reduction, the
         kernel's TCP path through veths and bridges).

They come from a dedicated two-rank measurement: a 2-worker star with
unshaped, undelayed links (the netns runtime), two gloo ranks, each pinned to
a core of its own (the cost beta stands for; unpinned, a calibration sometimes
ran both on one core and measured 1.6x the cost), running
testbed/jobs/collectives_bench.py over every collective at 4 KiB, 16 MiB and
64 MiB, REPEATS (4) repetitions each (medians). For each collective, beta is the
slope between the two large sizes (fixed costs cancel) and alpha what the
small size leaves, each divided by the messages and bytes the collective's
algorithm costs on two ranks (reference.cost_terms).

One calibration taken at a bad moment must not decide a boot's verdicts, so:
- the job repeats every size REPEATS times; the constants are derived from
  each repetition too, and their spread is kept (MachineConstants.spread:
  the verdict widens a class's tolerance by it, on the model's latency part);
- the machine is watched before (its busy share) and during the
  measurement (CPU time of processes that are not the calibration's: the
  machine's busy time less the calibration workers' cgroups and this
  process; steal). A busy machine is waited for (at most QUIET_WAIT_S, with
  progress) and a measurement disturbed by others is taken again (at most
  ATTEMPTS in all);
- a calibration whose spread is above MAX_SPREAD, or that others disturbed
  in every attempt, is not kept: it serves PROVISIONAL_S, then the next
  command measures again;
- every attempt, kept or not, goes into a history (time, conditions,
  spread, constants) that `testbed calibrate --history` shows.

The result is kept for the current boot (like the capability probe) in
/run/testbed/.calibration.json (TESTBED_CALIBRATION_FILE overrides it: the
machine's constants do not depend on which state root a testbed uses), and
read back only after checking every field: the file is trusted no more than
any other input. Another boot's constants are never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from testbed import cpustat
from testbed.errors import TestbedError
from testbed.net.capabilities import boot_id
from testbed.topology.reference import MachineConstants

DEFAULT_FILE = "/run/testbed/.calibration.json"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
SMALL, LARGE = 4096, (16 << 20, 64 << 20)
REPEATS = 4           # repetitions of every size: the spread comes from them
BUSY_WARNING = 0.25   # others keeping the CPUs busier than this before calibrating: wait for quiet
FOREIGN_MAX = 0.08    # others' share of the machine's CPU time during the measurement: measure again (see verdict.OTHERS_MAX)
STEAL_MAX = 0.05      # the hypervisor's share (steal) during the measurement: measure again
# A calibration whose constants are more uncertain than this (spread_of) is not kept. Measured here
# (2026-12-02): 7% and 19.8% on a quiet machine (a 4 KiB all_reduce alone varies 1.9-3.0 ms between
# repetitions, and alpha comes from it); others' CPU time (FOREIGN_MAX) is the sharper sign of a busy
# machine, so this only catches a measurement nobody would trust. The spread itself widens the
# verdicts' tolerances on the model's latency part.
MAX_SPREAD = 0.35
ATTEMPTS = 3
QUIET_WAIT_S = 30.0
PROVISIONAL_S = 600.0  # how long a calibration that was not kept serves before the next is measured
HISTORY_KEEP = 50
# auto plans for the slowest per-byte cost this boot measured, up to this many times the calibration's
# own: the slow mode measured here is 1.5-1.7x the fast one; a kept calibration slower than that
# measured something else, and would slow every run of the boot for nothing
SLOW_MODE_MAX = 2.0


class CalibrationError(TestbedError):
    exit_code = 1


@dataclass(frozen=True)
class Calibration:
    alpha_s: float              # all_reduce's
    beta_s_per_byte: float
    ops: dict                   # collective -> {"alpha_s", "beta_s_per_byte"}
    cores: int
    measured_at: float          # wall time
    boot_id: str
    torch: str
    busy_before: float          # CPU busy share in the second before the measurement
    seconds: float              # how long calibrating took
    rows: tuple                 # the raw measurements (bytes, iters, times_s)
    spread: float = 0.0         # relative standard error of all_reduce's alpha and beta (spread_of)
    foreign: float = 0.0        # others' share of the CPU time during the measurement
    steal: float = 0.0          # the hypervisor's share during the measurement
    kept: bool = True           # False: too spread or disturbed; serves PROVISIONAL_S only
    why_not_kept: str = ""

    def constants(self) -> MachineConstants:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at))
        ops = tuple((op, v["alpha_s"], v["beta_s_per_byte"]) for op, v in sorted(self.ops.items()))
        how = "this boot" if self.kept else f"this boot, provisional: {self.why_not_kept}"
        return MachineConstants(self.alpha_s, self.beta_s_per_byte, source=f"calibrated {when}, {how}", ops=ops,
                                spread=self.spread, beta_slow_s_per_byte=self.slowest_beta())

    def slowest_beta(self) -> float:
        """The slowest per-byte cost measured this boot: this calibration's slowest repetition, and every
        kept calibration of this boot in the history, at most SLOW_MODE_MAX times this one's (what
        `auto` plans host work for, MachineConstants.planning_beta: this VM moves bytes in two modes
        1.5-1.7x apart, minutes apart, and one calibration sees one of them; docs/fidelity.md)."""
        try:
            here = [b for _, b in per_repetition(list(self.rows))]
        except CalibrationError:
            here = []
        before = [r["beta_s_per_byte"] for r in history() if r.get("boot_id") == self.boot_id
                  and r.get("kept") is True and _plausible_beta(r.get("beta_s_per_byte"))]
        return min(max([self.beta_s_per_byte, *here, *before]), SLOW_MODE_MAX * self.beta_s_per_byte)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = list(self.rows)
        return d

    def lines(self) -> list[str]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.measured_at))
        out = [f"{'collective':>15} {'alpha (per message)':>20} {'beta (host per byte)':>21} {'= per rank':>12}"]
        for op, v in sorted(self.ops.items(), key=lambda kv: OPS.index(kv[0]) if kv[0] in OPS else 99):
            out.append(f"{op:>15} {v['alpha_s'] * 1e6:>17.0f} us {v['beta_s_per_byte'] * 1e9:>16.3f} ns/B "
                       f"{8 / v['beta_s_per_byte'] / 1e9:>7.2f} Gbit/s")
        out.append(f"cores: {self.cores}; measured {when} in {self.seconds:.1f} s with torch {self.torch}, "
                   "two gloo ranks on a 2-worker star (unshaped links)")
        out.append(f"spread over {REPEATS} repetitions +-{100 * self.spread:.1f}%; CPUs {100 * self.busy_before:.0f}% "
                   f"busy before; others {100 * self.foreign:.0f}% and steal {100 * self.steal:.0f}% during")
        if not self.kept:
            out.append(f"not kept ({self.why_not_kept}): it serves for {PROVISIONAL_S / 60:.0f} min, then the next "
                       "command measures again (testbed calibrate --refresh on a quiet machine)")
        return out


def _cores() -> int:
    from testbed.lifecycle import cores

    return cores()


def cache_file() -> Path:
    return Path(os.environ.get("TESTBED_CALIBRATION_FILE") or DEFAULT_FILE)


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def _positive(data: dict[str, Any], key: str, upper: float, where: str = "") -> float:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v < upper:
        raise ValueError(f"{where}{key}: {v!r} is not a number in (0, {upper:g})")
    return float(v)


def parse(data: Any) -> Calibration:
    """A Calibration from a decoded JSON document; ValueError naming the field that is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    rows = data.get("rows")
    if not isinstance(rows, list):
        raise ValueError("rows: not a list")
    c = data.get("cores")
    if isinstance(c, bool) or not isinstance(c, int) or not 0 < c < 100_000:
        raise ValueError(f"cores: {c!r} is not a positive integer")
    ops_in = data.get("ops")
    if not isinstance(ops_in, dict) or set(ops_in) - set(OPS):
        raise ValueError(f"ops: not a mapping of {', '.join(OPS)}")
    ops = {}
    for op, v in ops_in.items():
        if not isinstance(v, dict):
            raise ValueError(f"ops.{op}: not a mapping")
        ops[op] = {"alpha_s": _positive(v, "alpha_s", 1.0, f"ops.{op}."),
                   "beta_s_per_byte": _positive(v, "beta_s_per_byte", 1e-3, f"ops.{op}.")}
    return Calibration(
        alpha_s=_positive(data, "alpha_s", 1.0), beta_s_per_byte=_positive(data, "beta_s_per_byte", 1e-3),
        ops=ops, cores=c, measured_at=_positive(data, "measured_at", 1e11), boot_id=str(data.get("boot_id", "")),
        torch=str(data.get("torch", "")), busy_before=_share(data, "busy_before"),
        seconds=float(data.get("seconds") or 0.0), rows=tuple(rows), spread=_share(data, "spread"),
        foreign=_share(data, "foreign"), steal=_share(data, "steal"), kept=data.get("kept", True) is not False,
        why_not_kept=str(data.get("why_not_kept") or "")[:300])


def _share(data: dict[str, Any], key: str) -> float:
    v = data.get(key) or 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 10:
        raise ValueError(f"{key}: {v!r} is not a share in [0, 10)")
    return float(v)


def cached() -> Calibration | None:
    """This boot's calibration, if one was made with the torch installed now and is valid."""
    try:
        cal = parse(json.loads(cache_file().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if cal.boot_id != boot_id() or cal.torch != _torch_version() or cal.cores != _cores():
        return None
    if not cal.kept and not 0 <= time.time() - cal.measured_at < PROVISIONAL_S:
        return None
    try:   # the constants follow from the measurements and the model's cost terms of today's code
        ops = derive(list(cal.rows))
    except (CalibrationError, KeyError, TypeError, ValueError):
        return cal if not cal.rows else None
    return replace(cal, ops=ops, alpha_s=ops["all_reduce"]["alpha_s"],
                   beta_s_per_byte=ops["all_reduce"]["beta_s_per_byte"])


def _save(cal: Calibration) -> None:
    p = cache_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}")
    tmp.write_text(json.dumps(cal.to_json(), indent=1))
    os.replace(tmp, p)


def _busy_share(seconds: float = 1.0) -> float:
    """Share of all CPUs' time spent busy over `seconds` (from /proc/stat)."""
    try:
        a = cpustat.read()
        time.sleep(seconds)
        b = cpustat.read()
    except (OSError, ValueError):
        return 0.0
    dt = b.total - a.total
    return (b.busy - a.busy + b.steal - a.steal) / dt if dt > 0 else 0.0


def _wait_for_quiet(progress: Callable[[str], None] | None) -> float:
    """Wait (at most QUIET_WAIT_S) until the CPUs are at most BUSY_WARNING busy; the last busy share."""
    deadline = time.monotonic() + QUIET_WAIT_S
    busy = _busy_share(0.5)
    told = 0.0
    while busy > BUSY_WARNING and time.monotonic() < deadline:
        if progress and time.monotonic() - told >= 5:
            left = deadline - time.monotonic()
            progress(f"  the CPUs are {100 * busy:.0f}% busy with other work: waiting for a quiet machine "
                     f"(at most {left:.0f} s more) ...")
            told = time.monotonic()
        busy = _busy_share(1.0)
    return busy


class _Watch:
    """Others' and the hypervisor's share of the CPU time over a measurement (monitor.busy_cpu_s less
    monitor.ours_cpu_s: the calibration workers' cgroups and this process)."""

    def __init__(self, testbed: str) -> None:
        from testbed.runtime import cgroups

        self.groups = cgroups.groups_of(testbed)
        self.cores = max(1, os.cpu_count() or 1)

    def _sample(self) -> tuple[float, float, int, int, float]:
        from testbed.jobs.monitor import ours_cpu_s

        now = cpustat.read()
        return time.monotonic(), now.busy / cpustat.ticks_per_s(), now.steal, now.total, ours_cpu_s(self.groups)

    def __enter__(self) -> "_Watch":
        self.start = self._sample()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = self._sample()

    def shares(self) -> tuple[float, float]:
        """(others' share, steal share) of all CPUs' time over the watch."""
        (w0, b0, s0, t0, o0), (w1, b1, s1, t1, o1) = self.start, self.end
        if t1 <= t0 or w1 <= w0:
            return 0.0, 0.0
        return max(0.0, ((b1 - b0) - (o1 - o0)) / (self.cores * (w1 - w0))), (s1 - s0) / (t1 - t0)


def per_repetition(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """all_reduce's (alpha, beta) from each repetition on its own ([] with fewer than two repetitions);
    CalibrationError when a repetition gives none."""
    reps = min((len(r.get("times_s") or []) for r in rows), default=0)
    if reps < 2:
        return []
    out = []
    for i in range(reps):
        try:
            ops = derive([{**r, "times_s": [r["times_s"][i]]} for r in rows if r.get("op") == "all_reduce"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"repetition {i + 1} gives no constants ({exc!r})") from None
        out.append((ops["all_reduce"]["alpha_s"], ops["all_reduce"]["beta_s_per_byte"]))
    return out


def spread_of(rows: list[dict[str, Any]]) -> float:
    """How uncertain all_reduce's constants are: each repetition derived on its own, the larger
    relative standard error of the mean of alpha and of beta over them (what the constants, taken
    from all repetitions, may be off by; inf: a repetition gave none)."""
    try:
        reps = per_repetition(rows)
    except CalibrationError:
        return math.inf
    if not reps:
        return 0.0
    return max(statistics.stdev(xs) / statistics.fmean(xs) / math.sqrt(len(xs)) for xs in zip(*reps))


def _plausible_beta(v: Any) -> bool:
    """A per-byte cost read back from the history (a file: checked like the cache's, parse())."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < 1e-3


def history_file() -> Path:
    return cache_file().with_name(".calibration-history.jsonl")


def history() -> list[dict[str, Any]]:
    """Every calibration attempt this machine kept a line of, oldest first (bad lines passed over)."""
    try:
        with open(history_file(), "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):   # (every `up` at auto reads it now: a bad line is passed over)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("measured_at"), (int, float)):
            out.append(rec)
    return out[-HISTORY_KEEP:]


def _remember(cal: "Calibration", attempt: int) -> None:
    rec = {"measured_at": cal.measured_at, "boot_id": cal.boot_id, "attempt": attempt, "seconds": cal.seconds,
           "busy_before": cal.busy_before, "foreign": cal.foreign, "steal": cal.steal,
           "spread": cal.spread if math.isfinite(cal.spread) else None, "alpha_s": cal.alpha_s,
           "beta_s_per_byte": cal.beta_s_per_byte, "kept": cal.kept, "why_not_kept": cal.why_not_kept}
    lines = [json.dumps(r) for r in history()[-(HISTORY_KEEP - 1):]] + [json.dumps(rec)]
    p = history_file()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, p)
    except OSError:
        pass   # a history we cannot write costs only the history


def derive(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """collective -> {alpha_s, beta_s_per_byte} from the benchmark's rows (two ranks)."""
    from testbed.topology.reference import cost_terms

    med: dict[str, dict[int, float]] = {}
    for r in rows:
        ts = sorted(float(t) for t in r.get("times_s") or [r["time_s"]])
        med.setdefault(r["op"], {})[int(r["bytes"])] = ts[len(ts) // 2]
    out = {}
    for op, by_size in med.items():
        small = min(by_size)
        big = sorted(b for b in by_size if b != small)
        if not big:
            continue
        m_small, b_small = cost_terms(op, small)
        (_, b_lo), (_, b_hi) = cost_terms(op, big[0]), cost_terms(op, big[-1])
        if len(big) >= 2 and by_size[big[-1]] > by_size[big[0]] and b_hi > b_lo:
            beta = (by_size[big[-1]] - by_size[big[0]]) / (b_hi - b_lo)   # the slope: fixed costs cancel
        else:
            beta = by_size[big[-1]] / b_hi
        alpha = (by_size[small] - b_small * beta) / m_small
        if not (alpha > 0 and beta > 0):
            raise CalibrationError(f"calibration of {op} gave no usable numbers (alpha {alpha!r}, beta {beta!r}); "
                                   f"medians: {by_size}")
        out[op] = {"alpha_s": alpha, "beta_s_per_byte": beta}
    if "all_reduce" not in out:
        raise CalibrationError(f"the calibration measured no all_reduce; rows: {rows}")
    return out


def _measure_once(busy: float, progress: Callable[[str], None] | None) -> Calibration:
    """Bring up a 2-worker star, run the two-rank measurement while watching the machine, bring it down."""
    from testbed import lifecycle
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed import paths
    from testbed.topology.loader import load_topology_text

    t0 = time.time()
    name = f"calib-{uuid.uuid4().hex[:6]}"
    topo = load_topology_text(f"name: {name}\ngenerator: star\nparams: {{n: 2}}\ntiers:\n"
                              "  host: {bandwidth: null, delay: 0s}\n", "<calibration>")
    with lifecycle.running(topo, name, runtime="netns", time_dilation=1):
        out = paths.directory(name) / "runs" / "calibration.json"   # the one folder workers may write
        # --pin-cpu: each rank on a core of its own, the cost the model's beta is. Unpinned, the scheduler
        # now and then ran both ranks on one core, and beta came out 1.6x as high (0.72-0.89 against
        # 1.22-1.34 ns/B here); the VM's own slow mode remains (docs/fidelity.md, "Two modes of moving bytes").
        cmd = [sys.executable, "-m", "testbed.jobs.collectives_bench", "--pin-cpu", "--ops", ",".join(OPS),
               "--sizes", ",".join(str(x) for x in (SMALL, *LARGE)), "--budget", "0.15", "--min-iters", "3",
               "--max-iters", "300", "--repeat", str(REPEATS), "--json", str(out)]
        with _Watch(name) as watch:
            res = run(cluster_from_state(name), cmd, echo=False, probe=False, monitor=False,
                      base_dir=str(paths.directory(name)), workdir="/", timeout=300)
        if res.rc != 0:
            logs = "\n".join((p.read_text()[-600:] for p in (res.run_dir / "logs").glob("*.log")))
            raise CalibrationError(f"the calibration job failed with status {res.rc}:\n{logs}")
        data = json.loads(out.read_text())
    ops = derive(data["results"])
    foreign, steal = watch.shares()
    spread = spread_of(data["results"])
    why = []
    if foreign > FOREIGN_MAX:
        why.append(f"other work took {100 * foreign:.0f}% of the CPUs during it")
    if steal > STEAL_MAX:
        why.append(f"the hypervisor took {100 * steal:.0f}% (steal)")
    if not spread <= MAX_SPREAD:
        why.append(f"its repetitions spread +-{100 * spread:.0f}% (more than {100 * MAX_SPREAD:.0f}%)")
    return Calibration(alpha_s=ops["all_reduce"]["alpha_s"], beta_s_per_byte=ops["all_reduce"]["beta_s_per_byte"],
                       ops=ops, cores=_cores(), measured_at=time.time(), boot_id=boot_id(), torch=_torch_version(),
                       busy_before=busy, seconds=time.time() - t0, rows=tuple(data["results"]),
                       spread=spread if math.isfinite(spread) else 9.99, foreign=foreign, steal=steal,
                       kept=not why, why_not_kept="; ".join(why))


def measure(progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure until a calibration is clean (at most ATTEMPTS times), save the best and return it."""
    if progress:
        progress("calibrating this machine (once per boot): two gloo ranks on a 2-worker star ...")
    t0 = time.time()
    tries: list[Calibration] = []
    for attempt in range(1, ATTEMPTS + 1):
        cal = _measure_once(_wait_for_quiet(progress), progress)
        _remember(cal, attempt)
        tries.append(cal)
        if cal.kept:
            break
        if progress and attempt < ATTEMPTS:
            progress(f"  not kept ({cal.why_not_kept}): measuring again ({attempt + 1} of {ATTEMPTS}) ...")
    cal = min(tries, key=lambda c: (not c.kept, c.foreign > FOREIGN_MAX or c.steal > STEAL_MAX, c.spread))
    cal = replace(cal, seconds=time.time() - t0)
    if progress and not cal.kept:
        progress(f"  calibration not kept ({cal.why_not_kept}); using it for {PROVISIONAL_S / 60:.0f} min, "
                 "its spread widening the verdicts' tolerances")
    try:
        _save(cal)
    except OSError:
        pass   # a cache we cannot write only costs the next command the same measurement
    return cal


def get(refresh: bool = False, progress: Callable[[str], None] | None = None) -> Calibration:
    """This boot's calibration, measured now if there is none (or refresh)."""
    if not refresh:
        cal = cached()
        if cal is not None:
            return cal
    if os.geteuid() != 0:
        raise CalibrationError("calibrating needs root (it brings up a small testbed): run it with sudo")
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise CalibrationError(f"calibrating needs torch in this Python ({sys.executable}); install it "
                               "(make venv) to get the reference model, `auto` dilation's traffic term and verdicts")
    asked = time.time()
    with _one_at_a_time(progress):
        cal = cached()   # another command may have measured one while this one waited
        if cal is not None and (not refresh or cal.measured_at >= asked):
            return cal
        return measure(progress)


@contextlib.contextmanager
def _one_at_a_time(progress: Callable[[str], None] | None) -> Iterator[None]:
    """One calibration at a time on this machine: two at once would each measure the other."""
    p = cache_file().with_name(".calibration.lock")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                progress("  another command is calibrating this machine: waiting for it ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # (closing releases the lock)


def constants_or_none(progress: Callable[[str], None] | None = None) -> MachineConstants | None:
    """This boot's constants, measuring them if needed; None (said through progress) when that fails."""
    try:
        return get(progress=progress).constants()
    except CalibrationError as exc:
        if progress:
            progress(f"no calibrated constants: {exc}")
        return None
