"""`testbed top` on a testbed over several hosts: every host's own `top --json`, merged.

Each host keeps the whole topology and its agent samples its own part (the `top` stream op,
testbed.agent): it reads the namespaces it holds, so a direction whose sending end is elsewhere
has no tx counters there (at best the rx of its receiving end, when that end is here) and no
queue. The controller streams every host's documents at once (testbed.cluster.agents.stream),
keeps each host's latest one, and `merge` makes one document of the single-host shape (see
testbed.observe.top) out of them:

- every link direction once, in topology order, taken from the host that holds its sending end
  (where it is shaped: tx counters and queue, as on one host). When that host's reading has no
  rate (its end cannot be read, or the host failed), the rate comes from the receiving end's
  host (its rx counters), as a single-host top falls back to the receiving port; the queue fields
  stay unknown then (only the sending end has the queue);
- each worker from its host; the run merged from the hosts that see one (below);
- t the newest host's reading, interval_s the median of the hosts', read_s the longest (the
  hosts read at once).

It adds, across hosts only (a single-host document is unchanged):

  hosts          host -> {"state", "why", "t"}: "ok"; "stale" (no new reading for a while: its
                 latest numbers are still used); "waiting" (no reading yet); "failed" (its top
                 ended or could not start: its numbers are dropped). why: a sentence, null when ok.
                 t: wall time of its reading in use (null: none)
  links[].host     the host of the direction's `from` end (where it is shaped and measured)
  links[].to_host  the host of its `to` end (another host: the link is cut, a VXLAN tunnel)
  workers[].host   the worker's host
  run.hosts        the hosts whose ranks the run document counts

The run: each host sees its own ranks' probe files (its active run directory, or its exchange
directory). Several hosts' runs are one run: ranks and ranks_ended add up, step is the highest,
step_min the lowest, last_step_max_s the slowest, last_step_age_s the newest; last_step_s is the
median of the hosts' medians (not the median over every rank); run_id, dir and status are those
of the first host (in the hosts file's order) that sees the run (dir is a path on that host).

`merge` is pure (documents in, one out); `Gather` keeps the hosts' latest documents as their
lines arrive; `HostsTop` drives the hosts and samples like testbed.observe.top.Top.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from testbed.errors import TestbedError

RATE_FIELDS = ("rate_bps", "wire_rate_bps", "packets_per_s", "util")
QUEUE_FIELDS = ("backlog_bytes", "backlog_packets", "drops", "overlimits")
FIRST_WAIT_S = 30.0        # --once / --json: how long the first document waits for every host's first reading
LIVE_FIRST_WAIT_S = 10.0   # the live view: shown with what is there after this (plus two intervals)
CLOSE_WAIT_S = 20.0        # how long closing waits for the hosts' tops to stop


class HostsTopEnded(TestbedError):
    """Every host's top ended: nothing more to show."""


# -- the merge (pure) ---------------------------------------------------------------------------------------


def _key(entry: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return (entry.get("index"), entry.get("from"), entry.get("to"))


def _order(topology: Mapping[str, Any] | None, docs: Iterable[Mapping[str, Any]]
           ) -> tuple[list[tuple[Any, Any, Any]], list[str]]:
    """(link directions, workers) in topology order: from the topology, else as the documents list them."""
    if topology is not None:
        dirs = []
        for i, link in enumerate(topology.get("links") or []):
            a, b = link["endpoints"]
            dirs += [(i, a, b), (i, b, a)]
        workers = [n["name"] for n in topology.get("nodes") or [] if n.get("kind") == "worker"]
        return dirs, workers
    dirs_seen: dict[tuple[Any, Any, Any], None] = {}
    workers_seen: dict[str, None] = {}
    for doc in docs:
        for l in doc.get("links") or []:
            dirs_seen.setdefault(_key(l))
        for w in doc.get("workers") or []:
            workers_seen.setdefault(w["name"])
    # a direction's place: its link's index, then the order the documents give (a->b before b->a)
    pos = {k: i for i, k in enumerate(dirs_seen)}
    return sorted(dirs_seen, key=lambda k: (k[0] if isinstance(k[0], int) else -1, pos[k])), list(workers_seen)


def _blank_link(topology: Mapping[str, Any] | None, key: tuple[Any, Any, Any]) -> dict[str, Any]:
    """A direction no host reported (none answered): what the topology says, every reading unknown."""
    i, a, b = key
    links = (topology or {}).get("links") or []
    link = links[i] if isinstance(i, int) and 0 <= i < len(links) else {}
    prof = (link.get("ab") if [a, b] == list(link.get("endpoints") or []) else link.get("ba")) or {}
    return {"index": i, "name": f"{a}->{b}", "from": a, "to": b, "tier": link.get("tier") or "", "ifname": None,
            "state": "unknown", "down_by": [], "bandwidth_bps": prof.get("bandwidth_bps"),
            **{f: None for f in RATE_FIELDS + QUEUE_FIELDS}}


def merge_runs(runs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """One run document out of the hosts' (host -> run document or None), as the module text says."""
    seen = {h: r for h, r in runs.items() if r}
    if not seen:
        return None
    hosts = list(seen)
    first = seen[hosts[0]]

    def vals(f: str) -> list[Any]:
        return [r[f] for r in seen.values() if r.get(f) is not None]

    def pick(fn: Callable[[list[Any]], Any], f: str) -> Any:
        v = vals(f)
        return fn(v) if v else None

    return {"run_id": first.get("run_id"), "dir": first.get("dir"),
            "status": "running" if "running" in vals("status") else first.get("status"),
            "world_size": pick(max, "world_size"), "ranks": sum(vals("ranks")),
            "ranks_ended": sum(vals("ranks_ended")), "step": pick(max, "step"), "step_min": pick(min, "step_min"),
            "last_step_s": pick(statistics.median, "last_step_s"), "last_step_max_s": pick(max, "last_step_max_s"),
            "last_step_age_s": pick(min, "last_step_age_s"), "hosts": hosts}


def merge(name: str, docs: Mapping[str, Mapping[str, Any] | None], placement: Mapping[str, str],
          topology: Mapping[str, Any] | None = None, hosts: Mapping[str, Mapping[str, Any]] | None = None,
          ) -> dict[str, Any]:
    """One `top` document of testbed `name` out of its hosts' latest ones.

    docs: host -> its latest document (None: none, or dropped); placement: node -> host;
    topology: Topology.to_json() (the order and the directions no host reported); hosts: host ->
    {"state", "why"} (default: "ok" with a document, "waiting" without). Pure."""
    order = list(hosts or docs)
    order += [h for h in docs if h not in order]
    have = {h: d for h, d in docs.items() if d}
    by_host = {h: {_key(l): l for l in d.get("links") or []} for h, d in have.items()}
    workers_of = {h: {w["name"]: w for w in d.get("workers") or []} for h, d in have.items()}
    # hosts in a fixed order, so that a fallback does not depend on the order the documents came in
    ranked = [h for h in order if h in have]

    dir_keys, worker_names = _order(topology, (have[h] for h in ranked))
    links = []
    for key in dir_keys:
        _i, a, b = key
        src, dst = placement.get(a), placement.get(b)
        primary = by_host.get(src, {}).get(key)
        received = by_host.get(dst, {}).get(key) if dst != src else None
        if primary is not None:
            entry = dict(primary)
            if entry.get("rate_bps") is None and received is not None and received.get("rate_bps") is not None:
                entry.update({f: received.get(f) for f in RATE_FIELDS})   # its rx, as one host falls back
        else:
            other = received or next((by_host[h][key] for h in ranked if key in by_host[h]), None)
            entry = dict(other) if other is not None else _blank_link(topology, key)
            if received is None:
                entry.update({f: None for f in RATE_FIELDS})
            entry.update({f: None for f in QUEUE_FIELDS})   # only the sending end holds the queue
        entry["host"], entry["to_host"] = src, dst
        links.append(entry)

    workers = []
    for w in worker_names:
        h = placement.get(w)
        rec = workers_of.get(h, {}).get(w)
        if rec is None:
            other = next((workers_of[x][w] for x in ranked if w in workers_of[x]), None)
            rec = {"name": w, "state": other["state"] if other else "unknown", "cpu": None, "memory_bytes": None}
        workers.append({**rec, "host": h})

    present = [have[h] for h in ranked]

    def nums(f: str) -> list[float]:
        return [d[f] for d in present if isinstance(d.get(f), (int, float))]

    s = next((d["dilation"] for d in present if d.get("dilation")), 1.0)
    status = {}
    for h in order:
        given = dict((hosts or {}).get(h) or {})
        state = given.get("state") or ("ok" if h in have else "waiting")
        status[h] = {"state": state, "why": given.get("why"), "t": have[h].get("t") if h in have else None}
    return {"testbed": name, "t": max(nums("t"), default=None),
            "interval_s": statistics.median(nums("interval_s")) if nums("interval_s") else None,
            "read_s": max(nums("read_s"), default=None), "time": "emulated" if s != 1 else "real", "dilation": s,
            "links": links, "workers": workers, "run": merge_runs({h: have[h].get("run") for h in ranked}),
            "hosts": status}


# -- the hosts' documents as they come -----------------------------------------------------------------------


def why_failed(result: Any) -> str:
    """One line of why a host's top ended: its error (a host's refusal: its words), its last line
    on stderr, or its exit status."""
    if isinstance(result, BaseException):
        return getattr(result, "why", None) or str(result) or type(result).__name__
    if not hasattr(result, "rc"):   # its stream's end (the agent's reply): it was stopped
        return "its top ended"
    err = [ln for ln in (getattr(result, "stderr", "") or "").strip().splitlines() if ln.strip()]
    rc = getattr(result, "rc", None)
    if err:
        return err[-1].removeprefix("error: ")
    return f"its top ended (exit status {rc})"


class Gather:
    """Every host's latest top document, fed from the hosts' threads.

    doc(host, doc): a document (replaces the host's last), or {"error": why} (the host's top
    failed); line(host, text): the same as a line of JSON (other lines are ignored).
    ended(host, result): the host's top is over (its stream's end, or why it failed)."""

    def __init__(self, hosts: Sequence[str], clock: Callable[[], float] = time.monotonic):
        self.hosts = list(hosts)
        self.clock = clock
        self.cond = threading.Condition()
        self.docs: dict[str, dict[str, Any] | None] = {h: None for h in self.hosts}
        self.seq = {h: 0 for h in self.hosts}           # documents received
        self.when: dict[str, float | None] = {h: None for h in self.hosts}   # (clock) the latest arrived
        self.errors: dict[str, str | None] = {h: None for h in self.hosts}
        self.over = {h: False for h in self.hosts}
        self.results: dict[str, Any] = {}                # host -> how its top ended (RemoteResult or exception)
        self.since = clock()

    def line(self, host: str, text: str) -> None:
        text = text.strip()
        if not text.startswith("{"):
            return
        try:
            doc = json.loads(text)
        except ValueError:
            return
        if isinstance(doc, dict):
            self.doc(host, doc)

    def doc(self, host: str, doc: dict[str, Any]) -> None:
        with self.cond:
            if isinstance(doc.get("error"), str):
                self.errors[host] = doc["error"]
                self.docs[host] = None
            elif isinstance(doc.get("links"), list) and isinstance(doc.get("workers"), list):
                self.docs[host] = doc
                self.seq[host] += 1
                self.when[host] = self.clock()
                self.errors[host] = None
            else:
                return
            self.cond.notify_all()

    def ended(self, host: str, result: Any) -> None:
        with self.cond:
            if self.over.get(host):
                return
            self.over[host] = True
            self.results[host] = result
            if self.errors.get(host) is None:
                self.errors[host] = why_failed(result)
            self.docs[host] = None   # its top is over: its numbers are no longer now's
            self.cond.notify_all()

    def live(self) -> list[str]:
        """Hosts whose top still runs (and has not said it failed)."""
        return [h for h in self.hosts if not self.over[h] and self.errors[h] is None]

    def wait(self, after: Mapping[str, int], deadline: float, stop: threading.Event | None = None) -> None:
        """Until every live host has sent a document newer than `after` (host -> seq), or `deadline`
        (clock), or none is live any more, or `stop`. (A Ctrl-C interrupts it: short waits.)"""
        with self.cond:
            while True:
                pending = [h for h in self.live() if self.seq[h] <= after.get(h, 0)]
                left = deadline - self.clock()
                if not pending or left <= 0 or (stop is not None and stop.is_set()):
                    return
                self.cond.wait(min(left, 0.25))

    def snapshot(self, after: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, int]]:
        """(docs, host states as merge takes them, seqs): the latest document of each host, and what
        state each host is in (a live host without a document newer than `after` is stale)."""
        with self.cond:
            now = self.clock()
            states: dict[str, dict[str, Any]] = {}
            for h in self.hosts:
                if self.errors[h] is not None:
                    states[h] = {"state": "failed", "why": self.errors[h]}
                elif self.docs[h] is None:
                    states[h] = {"state": "waiting", "why": f"no reading yet ({now - self.since:.0f} s)"}
                elif self.seq[h] <= after.get(h, 0):
                    states[h] = {"state": "stale",
                                 "why": f"no new reading for {now - (self.when[h] or self.since):.0f} s"}
                else:
                    states[h] = {"state": "ok", "why": None}
            return dict(self.docs), states, dict(self.seq)


# -- the sampler across hosts ---------------------------------------------------------------------------------


class HostsTop:
    """Samples a testbed over several hosts like testbed.observe.top.Top: `sample()` returns the
    next merged document. Starts every host's top stream at once (its agent's `top` op);
    `close()` stops them and waits for them. stream: what carries the request
    (testbed.cluster.agents.stream, unless a test gives another)."""

    def __init__(self, name: str, interval: float = 1.0, runs_dir: str | None = None, *, first_wait: float = FIRST_WAIT_S,
                 stream: Callable[..., dict[str, Any]] | None = None, record: Mapping[str, Any] | None = None):
        from testbed.cluster import agents, controller

        self.name, self.interval, self.first_wait = name, interval, first_wait
        doc = record if record is not None else controller.load(name)
        self.placement: dict[str, str] = dict(doc["placement"])
        self.topology: dict[str, Any] | None = doc.get("topology")
        self.hosts = [h for h in (doc.get("hosts") or {})] or list(dict.fromkeys(self.placement.values()))
        self.tiers = tuple(dict.fromkeys(l.get("tier") or "" for l in (self.topology or {}).get("links") or []))
        self.gather = Gather(self.hosts)
        self.stop = threading.Event()
        self._done = threading.Event()
        self._stream = stream or agents.stream
        self._after: dict[str, int] = {}
        self._sampled = False
        self.request = {"op": "top", "name": name, "interval": interval, **({"runs": str(runs_dir)} if runs_dir else {})}
        self._thread = threading.Thread(target=self._run, name=f"top-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from testbed.agent.protocol import request

        try:   # on_end: a host whose stream ends (an unreachable one: at once) is shown failed then
            results = self._stream(self.name, request(self.request),
                                   lambda host, doc: self.gather.doc(host, doc.model_dump()),
                                   stop=self.stop, on_end=self.gather.ended)
        except Exception as exc:  # noqa: BLE001 - no host could be asked: every host fails with it
            results = {h: exc for h in self.hosts}
        finally:
            self._done.set()
        for h in self.hosts:
            self.gather.ended(h, results.get(h, TestbedError("no answer")))

    def sample(self) -> dict[str, Any]:
        """The next merged document: once every host still running has sent a new reading (or it
        waited long enough: a host without one is shown stale or waiting). HostsTopEnded when
        every host's top has ended and nothing new came."""
        g = self.gather
        wait = self.first_wait + 2 * self.interval if not self._sampled else 2 * self.interval + 2.0
        g.wait(self._after, g.clock() + wait, self.stop)
        docs, states, seq = g.snapshot(self._after)
        if not g.live() and not any(docs.values()):
            raise HostsTopEnded(f"testbed {self.name}: no host's top runs any more: "
                                + "; ".join(f"{h}: {s['why']}" for h, s in states.items() if s["why"]))
        self._after, self._sampled = seq, True
        return merge(self.name, docs, self.placement, self.topology, states)

    def close(self) -> None:
        """Stop every host's top and wait for them (a second Ctrl-C stops waiting)."""
        self.stop.set()
        try:
            self._done.wait(CLOSE_WAIT_S)
        except KeyboardInterrupt:
            pass

    def settle(self, doc: dict[str, Any]) -> dict[str, Any]:
        """After close(): a host the document shows waiting or stale whose top had in fact failed
        (it could not be reached, or its agent refused the request) is shown failed, with why."""
        with self.gather.cond:
            results = dict(self.gather.results)
            errors = dict(self.gather.errors)
        for h, st in (doc.get("hosts") or {}).items():
            if st["state"] not in ("waiting", "stale") or h not in results:
                continue
            if isinstance(results[h], BaseException) and errors.get(h):   # (a stream our stop ended: no failure)
                st.update(state="failed", why=errors[h])
        return doc
