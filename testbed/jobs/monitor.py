"""What tells whether the emulation held while a job ran (the verdict's evidence, after Mininet-HiFi).

Started by `testbed run` around the ranks' lifetime, `Monitor` samples:

- the CPUs (every SAMPLE_S): busy share and runnable tasks from /proc/stat,
  and the time some task waited for a CPU from /proc/pressure/cpu (PSI)
  where the kernel has it;
- every link end's root qdisc (every QDISC_SAMPLE_S, through one netlink
  socket per namespace opened once, not a process per node): backlog, and
  drops and overlimits between the first and the last sample;
- every delay-line helper (first and last sample): frames sent, dropped, and
  how late held frames left against their schedule.

`stop()` returns a JSON-able document (the run writes it to monitor.json).
Sampling costs a few netlink dumps a second; nothing here changes the testbed.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

SAMPLE_S = 0.2
QDISC_SAMPLE_S = 1.0


def _read_stat() -> tuple[int, int, int]:
    """(total jiffies, idle jiffies, runnable tasks) from /proc/stat."""
    total = idle = running = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                vals = [int(x) for x in line.split()[1:]]
                total, idle = sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0)
            elif line.startswith("procs_running"):
                running = int(line.split()[1])
    return total, idle, running


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
        except Exception:   # a helper that died: the verdict reports its absence
            out[str(rec.get("link_id"))] = None
    return out


class Monitor:
    """Samples in a thread from start() to stop(); see the module text."""

    def __init__(self, netns_of: Mapping[str, str], delay_lines: list[Mapping[str, Any]] | None = None,
                 cores: int = 1):
        self.netns_of = dict(netns_of)
        self.delay_lines = list(delay_lines or [])
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
                      "delay_lines": _delay_line_stats(self.delay_lines)}
        self._thread = threading.Thread(target=self._loop, name="testbed-monitor", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        prev = _read_stat()
        next_qdisc = time.monotonic() + QDISC_SAMPLE_S
        while not self._stop.wait(SAMPLE_S):
            try:
                cur = _read_stat()
            except (OSError, ValueError):
                continue
            dt, didle = cur[0] - prev[0], cur[1] - prev[1]
            busy = 1 - didle / dt if dt > 0 else 0.0
            self.cpu.append((time.time(), busy, max(0, cur[2] - 1)))   # minus this sampler
            prev = cur
            if time.monotonic() >= next_qdisc:
                next_qdisc += QDISC_SAMPLE_S
                self._note_backlog(self._qd.sample())

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
                     "delay_lines": _delay_line_stats(self.delay_lines)}
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
        return {"t0": t0, "t1": t1, "cores": self.cores, "sample_s": SAMPLE_S,
                "cpu": [{"t": t, "busy": b, "runnable": r} for t, b, r in self.cpu],
                "psi_cpu_some_share": psi, "qdiscs": qd,
                "delay_lines": {"first": self.first.get("delay_lines"), "last": self.last.get("delay_lines")}}
