"""`testbed graph` of a testbed over several hosts: the page's documents from its hosts.

The controller serves the same page as on one host (testbed.observe.graph); only where its
documents come from differs, behind the interface of testbed.observe.graph.LocalSource:

- the topology: the controller's record (topology, placement, dilation); each node's "host", each
  link's "hosts" (its ends' hosts: two different ones for a cut link, a tunnel), the document's
  "hosts" (the hosts file's order); addresses from the address plan every host computes alike
  (testbed.topology.plan.plan_network);
- link states, why each is down and the profile it runs at: every host's agent's `link.show` (the
  first host in the hosts file's order that answers: every host keeps the same records), asked
  every REFRESH_S seconds while a page watches, and at once after a control action. A node is
  down when a link is held down by it ("node:NAME" in its down_by); a worker's own state (up,
  down, crashed) comes with each sample;
- samples: testbed.cluster.top.HostsTop (every host's top stream, merged): each link
  direction's utilisation measured where it is shaped, each worker's CPU and memory, the run's
  ranks and steps added up over the hosts (the step chart works as on one host). The sample keeps
  HostsTop's "hosts" (host -> state, why, t);
- events: every host's `events` (in the same agent session as its link records), at the same pace,
  merged in time order, each with its "host" (testbed.observe.answers.merge; the latest answer of
  a host that fails now is kept);
- control (--allow-control): the action sent to every host's agent at once, as `testbed link
  down|up` and `testbed node down|up` do from the controller; an unknown node or link is refused
  (400) before any host is asked; a host that fails is answered 502, naming it and why.

A host that fails (its top, its link show, its events) is a line of the sample's "trouble"
("HOST: what: why"; the page shows them in its banner), never an error of the server. A host whose
top failed (unreachable, its session dropped) is watched again once it answers the link show and
events again (HostsSampler starts the hosts' tops again).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from testbed.errors import StateError
from testbed.observe import answers
from testbed.observe.graph import IDLE_S
from testbed.observe.graph_access import GraphRequestError
from testbed.observe.graph_doc import EVENTS_KEEP, EVENTS_LIMIT, topology_doc

REFRESH_S = 3.0            # the hosts' link records and events are asked for this often while a page watches
STALE_S = 5.0              # a host whose top lags behind the newest reading this long is named in the banner
ASK_TIMEOUT_S = 60.0
CONTROL_TIMEOUT_S = 120.0
CONTROL_OPS = {"link_down": {"op": "link.down"}, "link_up": {"op": "link.up"},
               "node_down": {"op": "node", "verb": "down"}, "node_up": {"op": "node", "verb": "up"}}


# -- pure ----------------------------------------------------------------------------------------------------


def hosts_of(record: Mapping[str, Any]) -> list[str]:
    """The testbed's hosts, in the hosts file's order."""
    return list(record.get("hosts") or {}) or list(dict.fromkeys(record["placement"].values()))


def downed_nodes(links: Sequence[Mapping[str, Any]]) -> set[str]:
    """Nodes that hold a link down (`testbed node down`: "node:NAME" in its down_by)."""
    return {r[5:] for l in links for r in l.get("down_by") or () if isinstance(r, str) and r.startswith("node:")}


def address_plan(record: Mapping[str, Any]) -> dict[str, Any]:
    """The address plan every host computed from the record's topology ({} if it cannot be made)."""
    from testbed.topology.model import Topology
    from testbed.topology.plan import plan_network

    try:
        return plan_network(Topology.from_json(record["topology"])).to_json()
    except Exception:   # noqa: BLE001 - addresses are a nicety: none rather than no page
        return {}


def state_of(record: Mapping[str, Any], links: Sequence[Mapping[str, Any]] | None,
             plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A state as testbed.observe.graph_doc.topology_doc reads it, made of the controller's record and a
    host's `link show --json` (None: no host answered; the links then read as the topology has them)."""
    records = []
    for l in links or ():
        rec: dict[str, Any] = {"state": l.get("state", "up"), "down_by": list(l.get("down_by") or []),
                               "ifnames": l.get("ifnames")}
        if l.get("changed"):
            rec["profile"] = {"ab": l["ab"], "ba": l["ba"]}
        records.append(rec)
    down = downed_nodes(links or ())
    return {"name": record["name"], "topology": record["topology"], "created": record.get("created"),
            "time_dilation": record.get("time_dilation"), "links": records,
            "plan": dict(plan) if plan is not None else address_plan(record),
            "faults": {"nodes": {n: {"state": "down"} for n in sorted(down)}}}


def hosts_topology_doc(record: Mapping[str, Any], links: Sequence[Mapping[str, Any]] | None, version: int = 0,
                       control: bool = False, plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The /api/topology document of a testbed over several hosts (with "states", as a source gives it)."""
    from testbed.observe.graph_doc import node_states

    st = state_of(record, links, plan)
    doc = topology_doc(st, version, control)
    placement = record["placement"]
    for n in doc["nodes"]:
        n["host"] = placement.get(n["name"])
    for l in doc["links"]:
        l["hosts"] = [placement.get(l["a"]), placement.get(l["b"])]
    doc["hosts"] = hosts_of(record)
    doc["states"] = node_states(st)
    return doc


def why(res: Any) -> str:
    """One line: why a host failed a request (its word, its exception, or its last line of stderr)."""
    if res is None:
        return "no answer"
    return getattr(res, "why", None) or answers.why(res)


def link_answers(results: Mapping[str, Any], hosts: Sequence[str]) -> tuple[list[dict[str, Any]] | None,
                                                                             dict[str, str]]:
    """(the link records of the first host in `hosts` that answered `link.show` (None: none did),
    host -> why it failed). results: host -> its answer (checked records, or why it failed)."""
    got, failed = None, {}
    for h in hosts:
        r = results.get(h)
        if r is None or isinstance(r, BaseException):
            failed[h] = why(r)
        elif got is None:
            got = [rec.model_dump() if hasattr(rec, "model_dump") else rec for rec in r]
    return got, failed


def trouble_lines(hosts: Sequence[str], top: Mapping[str, Mapping[str, Any]] | None,
                  failed: Mapping[str, Mapping[str, str]], newest: float | None = None) -> list[str]:
    """One line per host with something wrong: its top's state when not ok (HostsTop's "hosts"; a
    stale one only once its reading is STALE_S older than `newest`, the sample's t), and what else
    failed there (what -> why)."""
    lines = []
    for h in hosts:
        said = []
        st = (top or {}).get(h) or {}
        state = st.get("state")
        if state == "stale" and newest is not None and st.get("t") is not None and newest - st["t"] < STALE_S:
            state = "ok"   # (a reading a little late: not worth a banner)
        if state not in (None, "ok"):
            said.append(f"top {state}" + (f": {st['why']}" if st.get("why") else ""))
        said += [f"{what}: {text}" for what, text in (failed.get(h) or {}).items()]
        if said:
            lines.append(f"{h}: " + "; ".join(said))
    return lines


def control_request(record: Mapping[str, Any], name: str, action: str, values: Sequence[str]) -> dict[str, Any]:
    """The agent request every host gets for one action of the page; an unknown node or link is
    refused here (FaultError), before any host is asked."""
    from testbed.faults.control import FaultError

    nodes = list(record["placement"])
    for v in values:
        if v not in record["placement"]:
            some = ", ".join(nodes[:12]) + (" ..." if len(nodes) > 12 else "")
            raise FaultError(f"node: testbed {name!r} has no node {v!r} (nodes: {some})")
    if action.startswith("link_"):
        a, b = values
        ends = {frozenset(l["endpoints"]) for l in (record.get("topology") or {}).get("links") or []}
        if frozenset((a, b)) not in ends:
            raise FaultError(f"link: testbed {name!r} has no link between {a} and {b}")
        return {**CONTROL_OPS[action], "name": name, "a": a, "b": b}
    return {**CONTROL_OPS[action], "name": name, "node": values[0]}


# -- the source ----------------------------------------------------------------------------------------------


class HostsSampler:
    """testbed.cluster.top.HostsTop, started again when a host whose top failed (it could not
    be reached, its session dropped) answers the source's questions again: a host that comes back
    is watched again."""

    def __init__(self, source: "HostsSource", interval: float, runs_dir: str | None):
        self.source, self.interval, self.runs_dir = source, interval, runs_dir
        self.top = source.new_top(interval, runs_dir)
        self.failed_since: dict[str, float] = {}   # host -> (monotonic) when its top was first seen failed

    def sample(self) -> dict[str, Any]:
        doc = self.top.sample()
        now = time.monotonic()
        failed = [h for h, st in (doc.get("hosts") or {}).items() if st.get("state") == "failed"]
        self.failed_since = {h: self.failed_since.get(h, now) for h in failed}
        if any(self.source.answering(h, t) for h, t in self.failed_since.items()):
            self.top.close()
            self.top = self.source.new_top(self.interval, self.runs_dir)
            self.failed_since = {}
        return doc

    def close(self) -> None:
        self.top.close()


class HostsEvents:
    """The hosts' events, merged (the latest answer of each host), for /api/events."""

    def __init__(self, source: "HostsSource"):
        self.source = source
        self.records: list[dict[str, Any]] = []

    def since(self, t: float, limit: int = EVENTS_LIMIT) -> list[dict[str, Any]]:
        self.source.touch()
        with self.source.lock:
            newer = [r for r in self.records if r["t"] > t]
        return newer[-limit:] if limit > 0 else []


class HostsSource:
    """A testbed over several hosts, seen from its controller (the module text says what from where).

    ask(name, requests, timeout=...) and stream(...) are testbed.cluster.agents' (a test may give
    others)."""

    overlay_states = False   # a sample's link states are the hosts' own, newer than the records asked for here
    close_wait_s = 25.0      # HostsTop.close waits up to testbed.cluster.top.CLOSE_WAIT_S for the hosts' tops

    def __init__(self, name: str, *, record: Mapping[str, Any] | None = None,
                 ask: Callable[..., dict[str, Any]] | None = None, stream: Callable[..., Any] | None = None,
                 refresh_s: float = REFRESH_S, idle_s: float = IDLE_S, background: bool = True):
        from testbed.cluster import agents, controller

        self.name = name
        self.record = dict(record) if record is not None else controller.load(name)
        self.hosts = hosts_of(self.record)
        self._ask = ask or agents.ask
        self._stream = stream
        self.refresh_s, self.idle_s = refresh_s, idle_s
        self.lock = threading.Lock()
        self._asking = threading.Lock()
        self.links: list[dict[str, Any]] | None = None
        self.failed: dict[str, dict[str, str]] = {}      # host -> {what: why}, as of the last answers
        self.top_hosts: dict[str, Any] | None = None      # HostsTop's "hosts" of the latest sample
        self.top_t: float | None = None                   # and its t
        self.host_events: dict[str, list[dict[str, Any]]] = {}
        self.version = 0
        self.asked: float | None = None                    # (monotonic) when the hosts last answered
        self.events = HostsEvents(self)
        self._plan: dict[str, Any] | None = None
        self._samplers: list[Any] = []
        self._wanted = time.monotonic()
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"graph-hosts-{name}", daemon=True)
            self._thread.start()

    # -- asking the hosts
    def refresh(self) -> None:
        """Every host's link records and events, at once, in one agent session each."""
        from testbed.agent.protocol import request

        with self._asking:
            asks = [request({"op": "link.show", "name": self.name}),
                    request({"op": "events", "name": self.name})]
            try:
                out = self._ask(self.name, asks, timeout=ASK_TIMEOUT_S)
            except Exception as exc:   # noqa: BLE001 - no host could be asked: each fails with it
                out = {h: [exc, exc] for h in self.hosts}
            links, links_failed = link_answers({h: (out.get(h) or [None, None])[0] for h in self.hosts}, self.hosts)
            got, events_failed = {}, {}
            for h in self.hosts:
                ev = (out.get(h) or [None, None])[1]
                if ev is None or isinstance(ev, BaseException):
                    events_failed[h] = why(ev)
                else:
                    got[h] = [r.model_dump() for r in ev.items]
            with self.lock:
                if links is not None and links != self.links:
                    self.links = links
                    self.version += 1
                self.host_events.update(got)
                self.events.records = answers.merge({h: self.host_events[h] for h in self.hosts
                                                        if h in self.host_events})[-EVENTS_KEEP:]
                failed: dict[str, dict[str, str]] = {}
                for what, bad in (("link show", links_failed), ("events", events_failed)):
                    for h, text in bad.items():
                        failed.setdefault(h, {})[what] = text
                self.failed = failed
                self.asked = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            watched = now - self._wanted <= self.idle_s
            due = self.asked is not None and now - self.asked >= self.refresh_s   # (the first: topology())
            if self._poke.is_set() or (watched and due):
                self._poke.clear()
                try:
                    self.refresh()
                except Exception:   # noqa: BLE001 - a bug here must not end the page: asked again later
                    self.asked = time.monotonic()
                continue
            self._poke.wait(0.25 if watched else 1.0)

    def poke(self) -> None:
        """Ask the hosts again now (after a control action)."""
        self._poke.set()

    # -- the interface of testbed.observe.graph.LocalSource
    def exists(self) -> bool:
        from testbed.cluster import controller

        return controller.exists(self.name)

    def stamp(self) -> Any:
        if not self.exists():
            return None
        if self.asked is None:
            self.refresh()   # the first document: what the hosts say now
        return self.version

    def topology(self, version: int, control: bool) -> dict[str, Any]:
        if not self.exists():
            raise StateError(f"testbed {self.name!r} is no longer up")
        if self.asked is None:
            self.refresh()   # the first document: what the hosts say now
        if self._plan is None:
            self._plan = address_plan(self.record)
        with self.lock:
            links = self.links
        return hosts_topology_doc(self.record, links, version, control, self._plan)

    def sampler(self, interval: float, runs_dir: str | os.PathLike[str] | None) -> Any:
        return HostsSampler(self, interval, os.path.abspath(runs_dir) if runs_dir else None)

    def new_top(self, interval: float, runs_dir: str | None) -> Any:
        """A HostsTop of the testbed (its hosts' tops stopped by close(), too)."""
        from testbed.cluster import top as hosts_top

        top = hosts_top.HostsTop(self.name, interval, runs_dir, first_wait=hosts_top.LIVE_FIRST_WAIT_S,
                                 stream=self._stream, record=self.record)
        self._samplers = [t for t in self._samplers if not t.stop.is_set()] + [top]
        if self._stop.is_set():
            top.stop.set()
        return top

    def answering(self, host: str, since: float) -> bool:
        """The host answered the hosts' questions asked after `since` (monotonic)."""
        with self.lock:
            return self.asked is not None and self.asked > since and host not in self.failed

    def annotate(self, doc: dict[str, Any], states: Mapping[str, str]) -> dict[str, Any]:
        """A sample's nodes (the records' states, each worker's own from its host) and trouble."""
        nodes = dict(states)
        for w in doc.get("workers") or []:
            if w.get("state") in ("up", "down", "crashed"):
                nodes[w["name"]] = w["state"]
        with self.lock:
            self.top_hosts, self.top_t = doc.get("hosts"), doc.get("t")
        doc.update({"nodes": nodes, "trouble": self.trouble(doc)})
        return doc

    def trouble(self, doc: Mapping[str, Any] | None = None) -> list[str]:
        with self.lock:
            if doc is not None and doc.get("hosts") is not None:
                top, newest = doc["hosts"], doc.get("t")
            else:
                top, newest = self.top_hosts, self.top_t
            return trouble_lines(self.hosts, top, self.failed, newest)

    def control(self, action: str, values: list[str]) -> Any:
        from testbed.agent.protocol import request

        req = request(control_request(self.record, self.name, action, values))
        try:
            results = {h: vals[0] for h, vals in self._ask(self.name, [req], timeout=CONTROL_TIMEOUT_S).items()}
        finally:
            self.poke()
        bad = {h: why(r) for h, r in results.items() if isinstance(r, BaseException)}
        if bad:
            raise GraphRequestError(502, "; ".join(f"{h}: {text}" for h, text in bad.items()))
        if action != "link_up":
            return None
        left: list[str] = []
        for reasons in results.values():
            left += [r for r in reasons or [] if r not in left]
        return left or None

    def touch(self) -> None:
        self._wanted = time.monotonic()

    def close(self) -> None:
        """Stop asking the hosts, and tell the hosts' tops to stop (the sampler's thread closes them:
        HostsTop.close, which waits for them)."""
        self._stop.set()
        self._poke.set()
        for top in self._samplers:
            top.stop.set()
        if self._thread is not None:
            self._thread.join(5)
