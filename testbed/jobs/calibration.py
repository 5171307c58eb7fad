"""This machine's constants for the reference model, measured once per boot.

The reference model (testbed.topology.reference) needs two numbers per
collective that only a measurement on the machine that runs the testbed can
give:

  alpha  the software cost of one message (send, wake-ups, receive), seconds;
  beta   the host's cost per byte one rank sends, s/B: how fast a rank moves
         data when the network is not the limit (copies, the reduction, the
         kernel's TCP path through veths and bridges).

They come from a dedicated two-rank measurement: a 2-worker star with
unshaped, undelayed links (the netns runtime), two gloo ranks running
testbed/jobs/collectives_bench.py over every collective at 4 KiB, 16 MiB and
64 MiB, three repetitions each (medians). For each collective, beta is the
slope between the two large sizes (fixed costs cancel) and alpha what the
small size leaves, each divided by the messages and bytes the collective's
algorithm costs on two ranks (reference.cost_terms). Nothing else should run
meanwhile; the busy share of the CPUs just before is recorded and a busy
machine is reported.

The result is kept for the current boot (like the capability probe) in
/run/testbed/.calibration.json (TESTBED_CALIBRATION_FILE overrides it: the
machine's constants do not depend on which state root a testbed uses), and
read back only after checking every field: the file is trusted no more than
any other input.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from testbed.errors import TestbedError
from testbed.net.capabilities import boot_id
from testbed.topology.reference import MachineConstants

DEFAULT_FILE = "/run/testbed/.calibration.json"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
SMALL, LARGE = 4096, (16 << 20, 64 << 20)
BUSY_WARNING = 0.25   # a CPU busier than this before calibrating makes the numbers pessimistic


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

    def constants(self) -> MachineConstants:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at))
        ops = tuple((op, v["alpha_s"], v["beta_s_per_byte"]) for op, v in sorted(self.ops.items()))
        return MachineConstants(self.alpha_s, self.beta_s_per_byte, source=f"calibrated {when}, this boot", ops=ops)

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
        if self.busy_before > BUSY_WARNING:
            out.append(f"the CPUs were {100 * self.busy_before:.0f}% busy before it ran: the numbers may be "
                       "pessimistic (testbed calibrate --refresh on a quiet machine)")
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
        torch=str(data.get("torch", "")), busy_before=float(data.get("busy_before") or 0.0),
        seconds=float(data.get("seconds") or 0.0), rows=tuple(rows))


def cached() -> Calibration | None:
    """This boot's calibration, if one was made with the torch installed now and is valid."""
    try:
        cal = parse(json.loads(cache_file().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if cal.boot_id != boot_id() or cal.torch != _torch_version() or cal.cores != _cores():
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
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1 - (i1 - i0) / (t1 - t0) if t1 > t0 else 0.0


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


def measure(progress: Callable[[str], None] | None = None) -> Calibration:
    """Bring up a 2-worker star, run the two-rank measurement, bring it down; save and return it."""
    from testbed import lifecycle
    from testbed.jobs.run import cluster_from_state, run
    from testbed import paths
    from testbed.topology.loader import load_topology_text

    t0 = time.time()
    busy = _busy_share(0.5)
    name = f"calib-{uuid.uuid4().hex[:6]}"
    topo = load_topology_text(f"name: {name}\ngenerator: star\nparams: {{n: 2}}\ntiers:\n"
                              "  host: {bandwidth: null, delay: 0s}\n", "<calibration>")
    if progress:
        progress("calibrating this machine (once per boot): two gloo ranks on a 2-worker star ...")
    with lifecycle.running(topo, name, runtime="netns", time_dilation=1):
        out = paths.directory(name) / "runs" / "calibration.json"   # the one folder workers may write
        cmd = [sys.executable, "-m", "testbed.jobs.collectives_bench", "--ops", ",".join(OPS),
               "--sizes", ",".join(str(x) for x in (SMALL, *LARGE)), "--budget", "0.15", "--min-iters", "3",
               "--max-iters", "300", "--repeat", "3", "--json", str(out)]
        res = run(cluster_from_state(name), cmd, echo=False, probe=False, monitor=False,
                  base_dir=str(paths.directory(name)), workdir="/", timeout=300)
        if res.rc != 0:
            logs = "\n".join((p.read_text()[-600:] for p in (res.run_dir / "logs").glob("*.log")))
            raise CalibrationError(f"the calibration job failed with status {res.rc}:\n{logs}")
        data = json.loads(out.read_text())
    ops = derive(data["results"])
    cal = Calibration(alpha_s=ops["all_reduce"]["alpha_s"], beta_s_per_byte=ops["all_reduce"]["beta_s_per_byte"],
                      ops=ops, cores=_cores(), measured_at=time.time(),
                      boot_id=boot_id(), torch=_torch_version(), busy_before=busy, seconds=time.time() - t0,
                      rows=tuple(data["results"]))
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
    return measure(progress)


def constants_or_none(progress: Callable[[str], None] | None = None) -> MachineConstants | None:
    """This boot's constants, measuring them if needed; None (said through progress) when that fails."""
    try:
        return get(progress=progress).constants()
    except CalibrationError as exc:
        if progress:
            progress(f"no calibrated constants: {exc}")
        return None
