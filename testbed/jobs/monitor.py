"""What tells whether the emulation held while a job ran (the verdict's evidence, after Mininet-HiFi).

Started by `testbed run` around the ranks' lifetime, `Monitor` samples:

- the CPUs (every SAMPLE_S): busy share and runnable tasks from /proc/stat,
  and the time some task waited for a CPU from /proc/pressure/cpu (PSI)
  where the kernel has it; between the first and the last sample, the
  share of the CPUs that work other than the testbed's took (the machine's
  busy time less the workers' cgroups, this process, the delay-line
  engines and the kernel's threads): a run that shared the machine cannot
  speak for the emulation;
- every link end's root qdisc (every QDISC_SAMPLE_S, through one netlink
  socket per namespace opened once, not a process per node): backlog, and
  drops and overlimits between the first and the last sample;
- every delay line (first and last sample, from its engine): frames sent, dropped, and
  how late held frames left against their schedule;
- the workers' CPU cap (first and last sample, their cgroups' cpu.stat): periods, and the
  periods and seconds the cap held a worker back (throttled).

`stop()` returns a JSON-able document (the run writes it to monitor.json).
Sampling costs a few netlink dumps a second; nothing here changes the testbed.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from testbed import cpustat
from testbed.procs import ProcRef

SAMPLE_S = 0.2
QDISC_SAMPLE_S = 1.0


def busy_cpu_s() -> float:
    """CPU seconds all CPUs spent in user, nice and system since boot (interrupt work left out: much
    of it is the testbed's own traffic)."""
    return cpustat.read().busy / cpustat.ticks_per_s()


def ours_cpu_s(groups: list[list[Any]], engines: Iterable[ProcRef] = ()) -> float:
    """CPU seconds the workers' cgroups (one list of directories each), this process, the delay-line
    engines (they forward every delayed frame) and the kernel's threads (kernel_threads_cpu_s) used
    so far: busy_cpu_s() less this, over a span, is what other programs took."""
    from testbed.runtime import cgroups

    return (sum(cgroups.cpu_usage_s(g) or 0.0 for g in groups) + time.process_time() + processes_cpu_s(engines)
            + kernel_threads_cpu_s())


def cap_throttling(groups: list[list[Any]]) -> dict[str, list[float]]:
    """Each worker's CPU cap so far, by its group's first directory: [periods, periods throttled,
    seconds throttled]. A `node slow` group (TESTBED.faults) is left out: its throttling is the
    fault's, not the dilation's; so is a group whose counters cannot be read."""
    from testbed.runtime import cgroups

    out = {}
    for g in groups:
        if not g or Path(g[0]).parent.name.endswith(".faults"):
            continue
        try:
            t = cgroups.cpu_throttling(g)
        except (OSError, ValueError):   # the group went away between listing and reading
            continue
        if t is not None:
            out[str(g[0])] = list(t)
    return out


def cap_delta(first: dict[str, list[float]] | None, last: dict[str, list[float]] | None) -> dict[str, float] | None:
    """The caps' counters between two samples, summed over the workers present in both: {periods,
    throttled, throttled_s, workers}; None where none was."""
    both = [k for k in (last or {}) if k in (first or {})]
    if not both:
        return None
    d = [[b - a for a, b in zip(first[k], last[k])] for k in both]
    return {"periods": sum(x[0] for x in d), "throttled": sum(x[1] for x in d), "throttled_s": sum(x[2] for x in d),
            "workers": len(both)}


def engines_of(delay_lines: Iterable[Mapping[str, Any]]) -> list[ProcRef]:
    """The running engines that serve these delay lines (each line's pid file names its engine)."""
    from testbed.net.delayline import read_pid_file

    refs: set[ProcRef] = set()
    for rec in delay_lines:
        pf = rec.get("pid_file")
        ref = read_pid_file(Path(pf)) if isinstance(pf, str) and pf else None
        if ref is not None:
            refs.add(ref)
    return sorted(refs, key=lambda r: r.pid)


def processes_cpu_s(refs: Iterable[ProcRef]) -> float:
    """CPU seconds (user + system) these processes used so far; one whose PID now names another
    process (its start time differs) or that is gone counts nothing."""
    total = 0
    for ref in refs:
        fields = _stat_fields(ref.pid)
        if fields is not None and int(fields[19]) == ref.start:   # starttime: the same process
            total += int(fields[11]) + int(fields[12])            # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read(1024)
        fields = data[data.rindex(b")") + 2:].split()
        return fields if len(fields) > 19 else None
    except (OSError, ValueError):
        return None


def kernel_threads_cpu_s() -> float:
    """CPU seconds the kernel's own threads (children of kthreadd: ksoftirqd, kworkers, kswapd,
    kdamond...) used so far. Counted with the testbed's work, not as another program's: they forward
    the emulated links' packets and manage the ranks' memory (on the 2-core machine, 0.5-2% of the
    CPUs in two windows of the main job's training, 2026-12-02)."""
    try:   # kthreadd's children (CONFIG_PROC_CHILDREN); else every process, keeping those of parent 2
        with open("/proc/2/task/2/children") as f:
            pids, check = f.read().split(), False
    except OSError:
        pids, check = [p for p in os.listdir("/proc") if p.isdigit()], True
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None and (not check or fields[1] == b"2"):   # (parent: kthreadd)
            total += int(fields[11]) + int(fields[12])   # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _psi_some_us() -> int | None:
    """Microseconds some task waited for a CPU since boot (PSI), or None without PSI."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Qdiscs:
    """Root qdisc counters of every interface of some namespaces, one netlink socket each."""

    def __init__(self, netns_of: Mapping[str, str]):
        from pyroute2 import IPRoute

        from testbed.net import netns

        self.sockets: dict[str, Any] = {}
        self.names: dict[str, dict[int, str]] = {}
        for node, ns in netns_of.items():
            try:
                with netns.enter(ns):
                    ipr = IPRoute()
                self.sockets[node] = ipr
                self.names[node] = {l["index"]: l.get_attr("IFLA_IFNAME") for l in ipr.get_links()}
            except Exception:   # a namespace that went away (a crashed node): not sampled
                continue

    def sample(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for node, ipr in self.sockets.items():
            try:
                msgs = ipr.get_qdiscs()
            except Exception:
                continue
            per = out.setdefault(node, {})
            for q in msgs:
                if q["parent"] != 0xFFFFFFFF or q.get_attr("TCA_KIND") == "noqueue":
                    continue
                st = q.get_attr("TCA_STATS2")
                qs = st.get_attr("TCA_STATS_QUEUE") if st else None
                if not qs:
                    continue
                ifn = self.names[node].get(q["index"])
                if ifn and ifn != "lo":
                    per[ifn] = {"backlog": qs["backlog"], "drops": qs["drops"], "overlimits": qs["overlimits"],
                                "qlen": qs["qlen"]}
        return out

    def close(self) -> None:
        for ipr in self.sockets.values():
            try:
                ipr.close()
            except Exception:
                pass


def _delay_line_stats(lines: list[Mapping[str, Any]]) -> dict[str, Any]:
    from testbed.net import delayline

    out = {}
    for rec in lines:
        control = rec.get("control")
        if not control:
            continue
        try:
            out[str(rec.get("link_id"))] = delayline.stats(control)
        except Exception:   # an engine that died: the verdict reports its absence
            out[str(rec.get("link_id"))] = None
    return out


class Monitor:
    """Samples in a thread from start() to stop(); see the module text."""

    def __init__(self, netns_of: Mapping[str, str], delay_lines: list[Mapping[str, Any]] | None = None,
                 cores: int = 1, groups: list[list[Any]] | None = None):
        """groups: the workers' cgroups (one list of directories each), whose CPU time is the
        testbed's; None when they do not hold the ranks (Docker's own groups): others' share unknown."""
        self.netns_of = dict(netns_of)
        self.groups = groups
        self.delay_lines = list(delay_lines or [])
        self.engines = engines_of(self.delay_lines)
        self.cores = cores
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cpu: list[tuple[float, float, int]] = []   # (t, busy share since last, runnable)
        self.backlog_max: dict[str, dict[str, int]] = {}
        self.first: dict[str, Any] = {}
        self.last: dict[str, Any] = {}

    def start(self) -> "Monitor":
        self._qd = Qdiscs(self.netns_of)
        self.first = {"t": time.time(), "psi_some_us": _psi_some_us(), "qdiscs": self._qd.sample(),
                      "delay_lines": _delay_line_stats(self.delay_lines), **self._cpu_split()}
        self._thread = threading.Thread(target=self._loop, name="testbed-monitor", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        prev = cpustat.read()
        next_qdisc = time.monotonic() + QDISC_SAMPLE_S
        while not self._stop.wait(SAMPLE_S):
            try:
                cur = cpustat.read()
            except (OSError, ValueError):
                continue
            dt, didle = cur.total - prev.total, cur.idle_all - prev.idle_all
            busy = 1 - didle / dt if dt > 0 else 0.0
            self.cpu.append((time.time(), busy, max(0, cur.running - 1)))   # minus this sampler
            prev = cur
            if time.monotonic() >= next_qdisc:
                next_qdisc += QDISC_SAMPLE_S
                self._note_backlog(self._qd.sample())

    def _cpu_split(self) -> dict[str, float]:
        if self.groups is None:
            return {}
        try:
            return {"busy_s": busy_cpu_s(), "ours_s": ours_cpu_s(self.groups, self.engines),
                    "engines_s": processes_cpu_s(self.engines), "cap": cap_throttling(self.groups)}
        except (OSError, ValueError):
            return {}

    def _note_backlog(self, sample: dict[str, dict[str, dict[str, int]]]) -> None:
        for node, ifs in sample.items():
            for ifn, st in ifs.items():
                per = self.backlog_max.setdefault(node, {})
                per[ifn] = max(per.get(ifn, 0), st["backlog"])

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        last_q = self._qd.sample()
        self._note_backlog(last_q)
        self._qd.close()
        self.last = {"t": time.time(), "psi_some_us": _psi_some_us(), "qdiscs": last_q,
                     "delay_lines": _delay_line_stats(self.delay_lines), **self._cpu_split()}
        return self.document()

    def document(self) -> dict[str, Any]:
        t0, t1 = self.first.get("t"), self.last.get("t")
        p0, p1 = self.first.get("psi_some_us"), self.last.get("psi_some_us")
        psi = (p1 - p0) / 1e6 / (t1 - t0) if None not in (p0, p1, t0, t1) and t1 > t0 else None
        qd: dict[str, dict[str, dict[str, int]]] = {}
        for node, ifs in (self.last.get("qdiscs") or {}).items():
            for ifn, end in ifs.items():
                start = (self.first.get("qdiscs") or {}).get(node, {}).get(ifn, {})
                qd.setdefault(node, {})[ifn] = {
                    "drops": end["drops"] - start.get("drops", 0),
                    "overlimits": end["overlimits"] - start.get("overlimits", 0),
                    "backlog_max": self.backlog_max.get(node, {}).get(ifn, 0)}
        others = engines = None
        f, l_ = self.first, self.last
        if all(k in d for d in (f, l_) for k in ("busy_s", "ours_s", "engines_s")) and t1 > t0:
            cpu_s = max(1, os.cpu_count() or 1) * (t1 - t0)
            spent = (l_["busy_s"] - f["busy_s"]) - (l_["ours_s"] - f["ours_s"])
            others = max(0.0, spent / cpu_s)
            engines = max(0.0, (l_["engines_s"] - f["engines_s"]) / cpu_s)
        cap = cap_delta(f.get("cap"), l_.get("cap"))
        return {"t0": t0, "t1": t1, "cores": self.cores, "sample_s": SAMPLE_S, "others_cpu_share": others,
                "engines_cpu_share": engines, "cpu_cap": cap,
                "cpu": [{"t": t, "busy": b, "runnable": r} for t, b, r in self.cpu],
                "psi_cpu_some_share": psi, "qdiscs": qd,
                "delay_lines": {"first": self.first.get("delay_lines"), "last": self.last.get("delay_lines")}}
