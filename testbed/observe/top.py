"""`testbed top`: what a running testbed's links, workers and job do now, sampled every interval.

A sample is the difference between two readings of the testbed's counters taken an interval
apart (rates need two). One reading is, per namespace, through one netlink socket opened once
(testbed.jobs.monitor's per-namespace sockets: no process per node): the interface counters
(one RTM_GETSTATS dump, 64-bit tx/rx bytes and packets) and the root qdisc of every link end
(one qdisc dump: backlog, drops, overlimits of the shaping HTB, or of netem when a link has
only a delay); per worker its cgroup's CPU time and memory (testbed.runtime.cgroups); and, when
a `testbed run` is active on the testbed, the new lines of the probe's rank-*.jsonl files.
A k=8 fat-tree (128 workers, 80 switches, 1,008 interfaces) reads in ~0.25 s on 2 idle cores.

Direction a->b of a link is what leaves a's port on it: a's tx counters (b's rx when a's side
cannot be read) and a's egress qdisc, where the kernel shapes a->b.

Numbers are the emulated cluster's, as in `testbed status` and `testbed report`: under time
dilation s the kernel runs a link at bandwidth/s, so a rate here is the wire rate times s and
utilisation is that rate over the link's profile bandwidth (the same as the wire rate over the
rate the kernel enforces); step times are divided by s. Queue contents, packet counts, CPU and
memory are the real machine's (s changes none of them).

The JSON document (`testbed top --json`, one per sample; field names are stable, new fields
may be added):

  testbed          the testbed's name
  t                wall-clock time (Unix seconds) of the second reading
  interval_s       real seconds between the two readings (the median over namespaces: the rates
                   are each over its own namespace's two dumps)
  read_s           real seconds one reading took (all namespaces, cgroups and probe files)
  time             "emulated" (dilation > 1) or "real"
  dilation         the time-dilation factor s (1: none)
  links            one entry per link direction, in topology order (link index, then a->b, b->a):
    index          the link's index (as `testbed status` numbers it)
    name           "FROM->TO"
    from, to       its endpoints: traffic from `from` to `to`
    tier           the link's tier
    ifname         the interface at `from` the direction leaves through
    state          "up" or "down" (the state file's link record)
    down_by        what holds it down ("link", "node:NAME", ...; [] when up)
    bandwidth_bps  the profile's bandwidth (emulated; null: unshaped)
    rate_bps       bit/s over the interval, emulated (wire rate x s); null: not readable
    wire_rate_bps  bit/s over the interval on the host's clock (what iperf3 in a worker sees)
    packets_per_s  packets/s over the interval, emulated
    util           rate_bps / bandwidth_bps (null when unshaped or unreadable)
    backlog_bytes  bytes in the shaping qdisc at the second reading (null: no qdisc to read)
    backlog_packets  packets in it
    drops          packets the qdisc dropped during the interval (null: not readable, or its
                   counters restarted, e.g. the profile was changed in between)
    overlimits     times the qdisc held packets back over its rate during the interval
  workers          one entry per worker, in topology order:
    name           the worker
    state          "up", "down" or "crashed" (`testbed node`)
    cpu            CPUs busy over the interval (1.0: one core all the time; null: no cgroup)
    memory_bytes   its cgroup's memory use at the second reading (null: no cgroup)
  run              null, or the `testbed run` active on the testbed:
    run_id         the run's id
    dir            its run directory (null when only the testbed's exchange dir was found)
    status         "running" (from summary.json), or "unknown" (no summary found)
    world_size     ranks the run started (null: unknown)
    ranks          probe files seen
    ranks_ended    ranks whose probe wrote its end record
    step           the highest optimizer step a rank finished (null: none yet)
    step_min       the lowest last step among ranks that finished one (a straggler lags here)
    last_step_s    median over ranks of their last step time (emulated: end to end of the last
                   two steps, divided by the run's factor; one step: its duration)
    last_step_max_s  the slowest rank's last step time
    last_step_age_s  wall-clock seconds since the last step a rank finished

An active run is found in ./runs (the directory `testbed run` was started from, or --runs):
the newest run directory of the testbed whose summary.json says "running" and whose probe
directory still exists; else the testbed's exchange directory (<state dir>/NAME/runs/ID/probe,
present while a run goes).

A testbed over several hosts: each host samples its own part, and testbed.cluster.top merges
the hosts' documents into one of this shape (with each direction's and worker's host added).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from testbed import paths, store
from testbed.errors import StateError
from testbed.net import names
from testbed.observe.run_watch import RunWatch

SORT_KEYS = ("util", "drops", "queue")
_STATS_LINK_64 = 1             # RTM_GETSTATS filter: IFLA_STATS_LINK_64 only


# -- counters ---------------------------------------------------------------------------------------------


def counter_delta(before: int | None, after: int | None, bits: int = 64) -> int | None:
    """How much a kernel counter of `bits` bits grew from `before` to `after`.

    A counter that went down wrapped (modulo 2**bits) when the wrapped difference is plausible
    (under half the range); else it restarted (its interface or qdisc was replaced) and the
    growth is unknown: None. None also when either reading is missing."""
    if before is None or after is None:
        return None
    d = after - before
    if d >= 0:
        return d
    wrapped = d % (1 << bits)
    return wrapped if wrapped < (1 << (bits - 1)) else None


def _rate(delta: int | None, dt: float | None) -> float | None:
    if delta is None or not dt or dt <= 0:
        return None
    return delta / dt


# -- the model: what the state says the testbed is --------------------------------------------------------


@dataclass(frozen=True)
class Direction:
    index: int
    src: str
    dst: str
    tier: str
    src_if: str
    dst_if: str
    bandwidth_bps: float | None
    state: str
    down_by: tuple[str, ...]


@dataclass(frozen=True)
class Worker:
    name: str
    state: str
    cgroups: tuple[tuple[str, ...], ...]   # the worker's own group, and `node slow`'s when it has one


@dataclass(frozen=True)
class Model:
    name: str
    created: str | None
    dilation: float
    netns_of: Mapping[str, str]
    directions: tuple[Direction, ...]
    workers: tuple[Worker, ...]
    tiers: tuple[str, ...]


def dilation_of(st: Mapping[str, Any]) -> float:
    """The testbed's factor, as every change to the running testbed reads it (testbed.running)."""
    from testbed.running import dilation_of as of

    return of(dict(st))


def model_of(st: Mapping[str, Any]) -> Model:
    """Directions, workers and the factor of a testbed, from its (validated) state."""
    name = st["name"]
    topo = st["topology"]
    records = st.get("links") or []
    dirs: list[Direction] = []
    for i, link in enumerate(topo["links"]):
        rec = records[i] if i < len(records) else {}
        a, b = link["endpoints"]
        ifa, ifb = (rec.get("ifnames") or [None, None])[:2]
        prof = rec.get("profile") or {"ab": link.get("ab") or {}, "ba": link.get("ba") or {}}
        state = rec.get("state", "up")
        down_by = tuple(rec.get("down_by") or ())
        tier = link.get("tier") or rec.get("tier") or ""
        dirs.append(Direction(i, a, b, tier, ifa, ifb, (prof.get("ab") or {}).get("bandwidth_bps"), state, down_by))
        dirs.append(Direction(i, b, a, tier, ifb, ifa, (prof.get("ba") or {}).get("bandwidth_bps"), state, down_by))
    faults = (st.get("faults") or {}).get("nodes") or {}
    recs = (st.get("runtime") or {}).get("workers") or {}
    workers = []
    for n in topo["nodes"]:
        if n["kind"] != "worker":
            continue
        w = n["name"]
        groups = [tuple((recs.get(w) or {}).get("cgroups") or ())]
        if (faults.get(w) or {}).get("cgroup"):
            groups.append(tuple(faults[w]["cgroup"]))
        workers.append(Worker(w, (faults.get(w) or {}).get("state") or "up", tuple(g for g in groups if g)))
    netns_of = {n["name"]: (recs.get(n["name"]) or {}).get("netns") or names.netns(name, n["name"])
                for n in topo["nodes"]}
    return Model(name=name, created=st.get("created"), dilation=dilation_of(st), netns_of=netns_of,
                 directions=tuple(dirs), workers=tuple(workers),
                 tiers=tuple(dict.fromkeys(link.get("tier") or "" for link in topo["links"])))


# -- readings ---------------------------------------------------------------------------------------------


class Reader:
    """Readings of a testbed's counters: one netlink socket per namespace, opened once.

    A reading is a plain dict (what `compute` takes), so that samples can be made up in tests:
      {"t": wall time,
       "ifs": {node: {"t": monotonic time of that node's dump, "ifs": {ifname: {"tx_bytes",
               "tx_packets", "rx_bytes", "rx_packets"}}}},
       "qdiscs": {node: {ifname: {"backlog", "qlen", "drops", "overlimits"}}},
       "cpu": {worker: {"t": monotonic, "usage_s": cumulative CPU seconds or None}},
       "memory": {worker: bytes or None}}
    """

    def __init__(self, model: Model):
        from testbed.jobs.monitor import Qdiscs

        self.model = model
        self._qd = Qdiscs(model.netns_of)

    def _ifnames(self, node: str) -> dict[int, str]:
        """Interface names by index, read again (an interface was made since the last time)."""
        ipr = self._qd.sockets[node]
        names_ = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        self._qd.names[node] = names_
        return names_

    def read_interfaces(self) -> dict[str, dict[str, Any]]:
        from pyroute2.netlink.exceptions import NetlinkError

        out: dict[str, dict[str, Any]] = {}
        for node, ipr in self._qd.sockets.items():
            try:
                msgs = ipr.stats("dump", filter_mask=_STATS_LINK_64)
                t = time.monotonic()
                byindex = self._qd.names.get(node) or {}
                if any(m["ifindex"] not in byindex for m in msgs):   # an interface made since: names again
                    byindex = self._ifnames(node)
            except (OSError, NetlinkError):   # its namespace is going away (the testbed went down)
                continue
            ifs = {}
            for m in msgs:
                ifn = byindex.get(m["ifindex"])
                st = m.get_attr("IFLA_STATS_LINK_64")
                if ifn and ifn != "lo" and st:
                    ifs[ifn] = {"tx_bytes": st["tx_bytes"], "tx_packets": st["tx_packets"],
                                "rx_bytes": st["rx_bytes"], "rx_packets": st["rx_packets"]}
            out[node] = {"t": t, "ifs": ifs}
        return out

    def read_workers(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from testbed.runtime import cgroups

        cpu: dict[str, Any] = {}
        mem: dict[str, Any] = {}
        for w in self.model.workers:
            usage = memory = None
            try:
                for group in w.cgroups:
                    u = cgroups.cpu_usage_s(group)
                    if u is not None:
                        usage = (usage or 0.0) + u
                    if memory is None:   # the processes' memory is charged where they were made
                        memory = cgroups.memory_usage_bytes(group)
            except (OSError, ValueError):   # the group went away (a node restarted, the testbed went down)
                pass
            cpu[w.name] = {"t": time.monotonic(), "usage_s": usage}
            mem[w.name] = memory
        return cpu, mem

    def read(self) -> dict[str, Any]:
        t0 = time.monotonic()
        ifs = self.read_interfaces()
        qdiscs = self._qd.sample()
        cpu, mem = self.read_workers()
        return {"t": time.time(), "ifs": ifs, "qdiscs": qdiscs, "cpu": cpu, "memory": mem,
                "read_s": time.monotonic() - t0}

    def close(self) -> None:
        self._qd.close()


# -- a sample: two readings -> the document ---------------------------------------------------------------


def _direction_counts(d: Direction, prev: Mapping[str, Any], cur: Mapping[str, Any]
                      ) -> tuple[int | None, int | None, float | None]:
    """(bytes, packets, seconds) that went from d.src to d.dst between two readings: the tx of
    d.src's port, or the rx of d.dst's port when d.src's cannot be read."""
    for node, ifn, side in ((d.src, d.src_if, "tx"), (d.dst, d.dst_if, "rx")):
        p, c = (prev.get("ifs") or {}).get(node), (cur.get("ifs") or {}).get(node)
        if not p or not c or not ifn:
            continue
        pi, ci = p["ifs"].get(ifn), c["ifs"].get(ifn)
        if pi is None or ci is None:
            continue
        nbytes = counter_delta(pi.get(f"{side}_bytes"), ci.get(f"{side}_bytes"))
        npkts = counter_delta(pi.get(f"{side}_packets"), ci.get(f"{side}_packets"))
        if nbytes is None:
            continue
        return nbytes, npkts, c["t"] - p["t"]
    return None, None, None


def _interval(prev: Mapping[str, Any], cur: Mapping[str, Any]) -> float:
    """Seconds between two readings: the median over namespaces of the time between their dumps
    (what the rates are over), else between the readings' wall times."""
    p, c = prev.get("ifs") or {}, cur.get("ifs") or {}
    dts = [c[n]["t"] - p[n]["t"] for n in c if n in p]
    return statistics.median(dts) if dts else (cur.get("t") or 0.0) - (prev.get("t") or 0.0)


def compute(model: Model, prev: Mapping[str, Any], cur: Mapping[str, Any]) -> dict[str, Any]:
    """The sample document (see the module text) from two readings, prev before cur."""
    s = model.dilation
    links = []
    for d in model.directions:
        nbytes, npkts, dt = _direction_counts(d, prev, cur)
        wire = _rate(None if nbytes is None else nbytes * 8, dt)
        rate = None if wire is None else wire * s
        pps = _rate(npkts, dt)
        q0 = ((prev.get("qdiscs") or {}).get(d.src) or {}).get(d.src_if) or {}
        q1 = ((cur.get("qdiscs") or {}).get(d.src) or {}).get(d.src_if)
        links.append({
            "index": d.index, "name": f"{d.src}->{d.dst}", "from": d.src, "to": d.dst, "tier": d.tier,
            "ifname": d.src_if, "state": d.state, "down_by": list(d.down_by),
            "bandwidth_bps": d.bandwidth_bps, "rate_bps": rate, "wire_rate_bps": wire,
            "packets_per_s": None if pps is None else pps * s,
            "util": rate / d.bandwidth_bps if rate is not None and d.bandwidth_bps else None,
            "backlog_bytes": None if q1 is None else q1.get("backlog"),
            "backlog_packets": None if q1 is None else q1.get("qlen"),
            "drops": None if q1 is None else counter_delta(q0.get("drops"), q1.get("drops"), 32),
            "overlimits": None if q1 is None else counter_delta(q0.get("overlimits"), q1.get("overlimits"), 32),
        })
    workers = []
    for w in model.workers:
        c0, c1 = (prev.get("cpu") or {}).get(w.name) or {}, (cur.get("cpu") or {}).get(w.name) or {}
        used = c1.get("usage_s") - c0.get("usage_s") if None not in (c0.get("usage_s"), c1.get("usage_s")) else None
        dt = c1["t"] - c0["t"] if "t" in c0 and "t" in c1 else None
        cpu = used / dt if used is not None and used >= 0 and dt and dt > 0 else None
        workers.append({"name": w.name, "state": w.state, "cpu": cpu,
                        "memory_bytes": (cur.get("memory") or {}).get(w.name)})
    return {"testbed": model.name, "t": cur.get("t"), "interval_s": _interval(prev, cur),
            "read_s": cur.get("read_s"), "time": "emulated" if s != 1 else "real", "dilation": s,
            "links": links, "workers": workers, "run": None}


def select(links: Iterable[dict[str, Any]], sort: str = "util", tier: str | None = None) -> list[dict[str, Any]]:
    """Link directions of one tier (all: None), busiest first by `sort` (util, drops or queue);
    ties keep topology order."""
    if sort not in SORT_KEYS:
        raise ValueError(f"unknown sort key {sort!r}; use one of {', '.join(SORT_KEYS)}")
    rows = [l for l in links if tier is None or l["tier"] == tier]

    def n(x: Any) -> float:
        return -1.0 if x is None else float(x)

    key = {"util": lambda l: (n(l["util"]), n(l["rate_bps"])),
           "drops": lambda l: (n(l["drops"]), n(l["overlimits"]), n(l["backlog_bytes"])),
           "queue": lambda l: (n(l["backlog_bytes"]), n(l["backlog_packets"]), n(l["drops"]))}[sort]
    return sorted(rows, key=key, reverse=True)


# -- the sampler a view drives --------------------------------------------------------------------------


class Top:
    """Samples a running testbed: `sample()` waits for the next reading and returns the document.

    The first sample takes two readings `interval` apart; each later one reads once, `interval`
    after the previous reading. The state file is read again only when it changed (links going
    down, profiles, nodes); the sockets are opened again only when the testbed was made anew."""

    def __init__(self, name: str, interval: float = 1.0, runs_dir: str | os.PathLike[str] | None = None):
        self.name = name
        self.interval = interval
        self._stamp: tuple[int, int] | None = None
        self.model: Model | None = None
        self.reader: Reader | None = None
        self.runs = RunWatch(name, runs_dir)
        self._prev: dict[str, Any] | None = None
        self._next = 0.0

    def refresh(self) -> Model:
        f = paths.state_file(self.name)
        try:
            st_ = f.stat()
        except FileNotFoundError:
            raise StateError(f"testbed {self.name!r} is no longer up") from None
        stamp = (st_.st_mtime_ns, st_.st_size)
        if stamp != self._stamp or self.model is None:
            model = model_of(store.load(self.name))
            if self.reader is not None and (self.model is None or model.created != self.model.created):
                self.reader.close()
                self.reader, self._prev = None, None
            self.model, self._stamp = model, stamp
            if self.reader is None:
                self.reader = Reader(model)
            else:
                self.reader.model = model
            self.runs.dilation = model.dilation
        return self.model

    def _read(self) -> dict[str, Any]:
        wait = self._next - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        model = self.refresh()   # opening the sockets (first reading, a testbed made anew) is not the interval's
        t0 = time.monotonic()
        self._next = t0 + self.interval
        reading = self.reader.read()
        reading["run"] = self.runs.poll()
        reading["read_s"] = time.monotonic() - t0
        reading["model"] = model
        return reading

    def sample(self) -> dict[str, Any]:
        if self._prev is None:
            self._prev = self._read()
        cur = self._read()
        if self._prev is None:   # the testbed was made anew between the two readings
            self._prev = cur
            cur = self._read()
        doc = compute(cur["model"], self._prev, cur)
        doc["run"] = cur["run"]
        self._prev = cur
        return doc

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __enter__(self) -> Top:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
