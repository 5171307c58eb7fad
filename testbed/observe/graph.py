"""`testbed graph`: a local web page of a running testbed, served by the standard library.

The page (testbed/observe/static/: graph.html, graph.js, graph.css; vanilla JS and inline SVG,
nothing fetched from elsewhere) draws the topology in tiers as the report's links.png does
(testbed.topology.layout: workers at the bottom, each switch a row above per hop to its
nearest worker), colours each link by its live utilisation, marks downed links and nodes, shows
a link's profile and counters or a node's state, CPU and memory on hover or click, the active
`testbed run`'s step times as a small chart, and the testbed's latest events.

Endpoints (GET unless said; JSON, fields may be added):

  /                   the page (and graph.js, graph.css)
  /api/topology       the drawing: {"testbed", "version", "up", "created", "dilation", "time",
                      "control", "tiers", "layers", "widest",
                      "nodes": [{"name", "kind", "layer", "x", "state", "gpus", "addresses"}],
                      "links": [{"index", "a", "b", "tier", "state", "down_by", "ab", "ba",
                                 "ab_text", "ba_text", "changed", "ifnames"}]}
                      x in (0, 1) within the row, layer 0 = workers; ab/ba are the profiles the
                      link runs at now, in emulated units, as `testbed link show --json` gives
                      them (bandwidth_bps, delay_s, jitter_s, loss, queue), *_text as it prints
                      them. "version" changes whenever the state file does. Across hosts also:
                      "hosts" (names), each node's "host", each link's "hosts" (its ends').
  /api/sample         the latest sample, shared by every client: `testbed top --json`'s document
                      (testbed.observe.top: "links" per direction with rate_bps, util,
                      backlog_bytes, drops, overlimits, state; "workers" with cpu,
                      memory_bytes; "run") plus "up" (false once the testbed is gone),
                      "version" (the topology's: fetch /api/topology again when it differs),
                      "nodes" ({node: "up"|"down"|"crashed"} for switches and workers),
                      "steps" (the active run's step times seen so far: [{"step", "t",
                      "step_s", "max_s"}]), "warming" (no sample yet), "error" (null, or why
                      the last sample failed) and "trouble" (lines "HOST: what: why", one per
                      host of a testbed over several hosts that fails or lags; [] on one host).
                      Across hosts the document is testbed.cluster.top's (with "hosts").
  /api/events?since=T the testbed's events (testbed.events) with "t" > T, oldest first, at most
                      `limit` (default 100, the newest): {"testbed", "events": [...], "t"}.
  POST /api/control   only with --allow-control: {"action": "link_down"|"link_up", "a", "b"} or
                      {"action": "node_down"|"node_up", "node"}; calls testbed.faults.control
                      (across hosts: sent to every host, as `testbed link` and `testbed node` do).

Where the documents come from is a source (LocalSource: this host's state file, Top, events file
and testbed.faults.control; testbed.cluster.graph.HostsSource: a testbed over several hosts,
from its controller); the server and the page are the same for both.

Sampling: one background thread takes one sample per interval (testbed.observe.top.Top: one
netlink conversation per namespace) while some page asked for a sample in the last IDLE_S
seconds, and none otherwise; every request is answered from the latest sample (its JSON encoded
once).

Security: bound to 127.0.0.1 unless --bind says otherwise. A random token (secrets.token_urlsafe)
is required on every request when the address is not a loopback one, and when --allow-control
is given (the server runs as root: another local user must not reach control through the
loopback port). The token comes in the printed URL's fragment (#token=..., which a browser never
sends); the page keeps it in sessionStorage (scoped to this origin: scheme, host and port, where a
cookie would go to every port of 127.0.0.1), drops it from the address bar and sends it as
`Authorization: Bearer TOKEN` with every API request. Nothing else carries it: no cookie, no query
(which would end up in history and logs). The page's own files (no data) need no token. A --bind
on an address that is not loopback would carry the token over plain HTTP: refused unless
--plain-http says the network is trusted (or use `ssh -L`). Tokens are compared with
hmac.compare_digest. Without a token (loopback, read-only), the Host header must name the
loopback address and port (DNS rebinding cannot reach the API from another site). POSTs are
refused (403) without --allow-control, without the header `X-Testbed-Graph: 1` (which a page of
another origin cannot set without a CORS preflight, which this server never grants), and with an
Origin that is not this server's. Every response carries a Content-Security-Policy that allows
only this server's own script, style and fetches; nothing is logged but control actions.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs, urlsplit

from testbed import events, paths, store
from testbed.errors import StateError, TestbedError
from testbed.topology.units import format_profile

DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 8765            # tried first when no --port is given; taken: any free port
IDLE_S = 15.0                  # sampling pauses when no page asked for a sample this long
FIRST_SAMPLE_WAIT_S = 3.0      # a request that wakes the sampler waits this long for its first sample
DOWN_GRACE_S = 5.0             # after the testbed went down, serve "down" this long, then exit
EVENTS_KEEP = 500
EVENTS_LIMIT = 100
STEPS_KEEP = 600
MAX_BODY = 4096
CONTROL_ACTIONS = ("link_down", "link_up", "node_down", "node_up")
CONTROL_HEADER = "X-Testbed-Graph"
STATIC = Path(__file__).with_name("static")
FILES = {"/": ("graph.html", "text/html; charset=utf-8"),
         "/graph.js": ("graph.js", "text/javascript; charset=utf-8"),
         "/graph.css": ("graph.css", "text/css; charset=utf-8")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SAMPLE_FIELDS = ("up", "version", "nodes", "steps", "warming", "error", "trouble")


class GraphError(TestbedError):
    """A flag of `testbed graph` that cannot be honoured (a --bind that is not an address): exit 2."""

    exit_code = 2


# -- the drawing: pure functions of a state -----------------------------------------------------------------


def node_states(st: Mapping[str, Any]) -> dict[str, str]:
    """Every node's state: "up", or what `testbed node` made it ("down", "crashed")."""
    faults = (st.get("faults") or {}).get("nodes") or {}
    return {n["name"]: (faults.get(n["name"]) or {}).get("state") or "up" for n in st["topology"]["nodes"]}


def addresses(st: Mapping[str, Any]) -> dict[str, list[str]]:
    """Node -> the addresses (CIDR) of its ports, from the state's address plan."""
    out: dict[str, list[str]] = {}
    for lp in (st.get("plan") or {}).get("links") or []:
        for side in ("a", "b"):
            end = lp.get(side) or {}
            if end.get("node") and end.get("address"):
                out.setdefault(end["node"], []).append(end["address"])
    return out


def topology_doc(st: Mapping[str, Any], version: int = 0, control: bool = False) -> dict[str, Any]:
    """The /api/topology document of a (validated) state."""
    from testbed.faults.control import PROFILE_FIELDS
    from testbed.running import dilation_of
    from testbed.topology.layout import layout
    from testbed.topology.model import LinkProfile, Topology

    topo = Topology.from_json(st["topology"])
    pos = layout(topo)
    states = node_states(st)
    addrs = addresses(st)
    rows: dict[int, int] = {}
    nodes = []
    for name, node in topo.nodes.items():
        x, y = pos[name]
        rows[int(y)] = rows.get(int(y), 0) + 1
        nodes.append({"name": name, "kind": node.kind, "layer": int(y), "x": x, "state": states.get(name, "up"),
                      "gpus": node.gpus, "addresses": addrs.get(name, [])})
    records = st.get("links") or []
    links = []
    for i, link in enumerate(topo.links):
        rec = records[i] if i < len(records) else {}
        prof = rec.get("profile")
        ab, ba = (LinkProfile.from_json(prof["ab"]), LinkProfile.from_json(prof["ba"])) if prof else (link.ab, link.ba)
        ab_d = {k: getattr(ab, k) for k in PROFILE_FIELDS}
        ba_d = {k: getattr(ba, k) for k in PROFILE_FIELDS}
        down_by = rec.get("down_by")
        if down_by is None:
            down_by = ["link"] if rec.get("state") == "down" else []
        links.append({"index": i, "a": link.a, "b": link.b, "tier": link.tier, "state": rec.get("state", "up"),
                      "down_by": list(down_by), "ab": ab_d, "ba": ba_d, "ab_text": format_profile(ab_d),
                      "ba_text": format_profile(ba_d), "changed": bool(prof), "ifnames": rec.get("ifnames")})
    s = dilation_of(dict(st))
    return {"testbed": st["name"], "version": version, "up": True, "created": st.get("created"), "dilation": s,
            "time": "emulated" if s != 1 else "real", "control": control, "tiers": topo.tiers(),
            "layers": max(rows, default=0) + 1, "widest": max(rows.values(), default=0),
            "nodes": nodes, "links": links}


def overlay(sample: Mapping[str, Any], topo: Mapping[str, Any], states: Mapping[str, str]) -> dict[str, Any]:
    """A sample with the link and node states of a newer topology document (a change made after
    the sample was taken shows at once, not at the next sample)."""
    records = topo["links"]
    links = []
    for l in sample.get("links") or []:
        rec = records[l["index"]] if l.get("index") is not None and l["index"] < len(records) else None
        links.append(l if rec is None else {**l, "state": rec["state"], "down_by": list(rec["down_by"])})
    return {**sample, "links": links, "nodes": dict(states), "version": topo["version"]}


def empty_sample(name: str, up: bool, version: int = 0, error: str | None = None,
                 trouble: list[str] | None = None) -> dict[str, Any]:
    """A sample with no readings: before the first one (warming) or once the testbed is gone."""
    return {"testbed": name, "t": time.time(), "interval_s": None, "read_s": None, "time": None, "dilation": None,
            "links": [], "workers": [], "run": None, "up": up, "version": version, "nodes": {}, "steps": [],
            "warming": up, "error": error, "trouble": list(trouble or [])}


class StepHistory:
    """The active run's step times, one point per new step a sample saw (the ranks' median)."""

    def __init__(self, keep: int = STEPS_KEEP):
        self.keep = keep
        self.run_id: str | None = None
        self.points: list[dict[str, Any]] = []

    def update(self, run: Mapping[str, Any] | None, now: float | None = None) -> list[dict[str, Any]]:
        if run is None:
            self.run_id, self.points = None, []
            return []
        if run.get("run_id") != self.run_id:
            self.run_id, self.points = run.get("run_id"), []
        step, dt = run.get("step"), run.get("last_step_s")
        if step is not None and dt is not None and (not self.points or self.points[-1]["step"] != step):
            self.points.append({"step": step, "t": time.time() if now is None else now, "step_s": dt,
                                "max_s": run.get("last_step_max_s")})
            del self.points[:-self.keep]
        return list(self.points)


class EventTail:
    """The testbed's event stream, read again only when the file changed, the last `keep` kept."""

    def __init__(self, name: str, keep: int = EVENTS_KEEP, reader: Callable[..., Any] = events.read):
        self.name = name
        self.keep = keep
        self._reader = reader
        self._stamp: tuple[int, int, int] | None = None
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            s = os.stat(events.path(self.name))
            stamp = (s.st_ino, s.st_size, s.st_mtime_ns)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._records = list(self._reader(self.name))[-self.keep:] if stamp is not None else []
            self._stamp = stamp

    def since(self, t: float, limit: int = EVENTS_LIMIT) -> list[dict[str, Any]]:
        with self._lock:
            self._refresh()
            newer = [r for r in self._records if r["t"] > t]
        return newer[-limit:] if limit > 0 else []


# -- where the numbers come from: a testbed on this host, or one over several hosts ------------------------


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        s = os.stat(path)
    except OSError:
        return None
    return (s.st_ino, s.st_mtime_ns, s.st_size)


class LocalSource:
    """A testbed on this host: its state file, testbed.observe.top.Top, its events file and
    testbed.faults.control. The one interface a Graph reads (testbed.cluster.graph.HostsSource
    is the other, for a testbed over several hosts):

      exists()                 the testbed is still up
      stamp()                  changes whenever topology() would say something new (None: gone)
      topology(version, control)  the /api/topology document, with "states" (node -> state) added;
                               StateError when the testbed is gone
      sampler(interval, runs)  an object with sample() (a `top --json` document) and close()
      annotate(doc, states)    a fresh sample given its "nodes" and "trouble"
      trouble(doc)             lines naming a host and what is wrong with it (one host: none)
      events                   since(t, limit): the events after t, oldest first
      control(action, values)  one action of the page (parse_control's)
      touch()                  a page asked for something (a source may refresh while pages watch)
      overlay_states           a sample's link states give way to a newer topology document's
      close()                  the server stops: stop what runs (without waiting for the sampler)
      close_wait_s             how long closing waits for the sampler thread"""

    overlay_states = True
    close_wait_s = 10.0

    def __init__(self, name: str):
        self.name = name
        self.events = EventTail(name)

    def exists(self) -> bool:
        return store.exists(self.name)

    def stamp(self) -> Any:
        return _stamp(paths.state_file(self.name))

    def topology(self, version: int, control: bool) -> dict[str, Any]:
        st = store.load(self.name)
        doc = topology_doc(st, version, control)
        doc["states"] = node_states(st)
        return doc

    def sampler(self, interval: float, runs_dir: str | os.PathLike[str] | None) -> Any:
        from testbed.observe.top import Top

        return Top(self.name, interval, runs_dir)

    def annotate(self, doc: dict[str, Any], states: Mapping[str, str]) -> dict[str, Any]:
        doc.update({"nodes": dict(states), "trouble": []})
        return doc

    def trouble(self, doc: Mapping[str, Any] | None = None) -> list[str]:
        return []

    def control(self, action: str, values: list[str]) -> Any:
        from testbed.faults import control

        return getattr(control, action)(self.name, *values)

    def touch(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- the shared state of a server: one topology, one sampler, one event tail -------------------------------


class Graph:
    """What every request of one server reads: the topology document (rebuilt when the state file
    changes), the latest sample (taken by one thread while pages ask for samples), the events."""

    def __init__(self, name: str, *, interval: float = 1.0, runs_dir: str | os.PathLike[str] | None = None,
                 allow_control: bool = False, sampler: Callable[..., Any] | None = None,
                 idle_s: float = IDLE_S, source: Any = None):
        self.name = name
        self.source = source if source is not None else LocalSource(name)
        self.interval = interval
        self.runs_dir = runs_dir
        self.allow_control = allow_control
        self.idle_s = idle_s
        self._make_sampler = sampler
        self._topo_lock = threading.Lock()
        self._topo_stamp: tuple[int, int, int] | None = None
        self._topo: dict[str, Any] | None = None
        self.version = 0
        self._cond = threading.Condition()
        self._latest: dict[str, Any] | None = None
        self._latest_json: bytes | None = None
        self._wanted = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.down = False
        self.down_since: float | None = None
        self.error: str | None = None
        self.steps = StepHistory()
        self.events = self.source.events
        self._thread = threading.Thread(target=self._run, name=f"graph-sampler-{name}", daemon=True)
        self._thread.start()

    # -- topology
    def topology(self) -> dict[str, Any]:
        """The /api/topology document (the last one known, "up": false, once the testbed is gone)."""
        with self._topo_lock:
            stamp = self.source.stamp()
            if stamp is None:
                self.mark_down()
            elif stamp != self._topo_stamp or self._topo is None:
                try:
                    doc = self.source.topology(self.version + 1, self.allow_control)
                except StateError:
                    if not self.source.exists():
                        self.mark_down()
                    else:
                        raise
                else:
                    self.version += 1
                    self._topo = doc
                    self._topo_stamp = stamp
            if self._topo is None:
                raise StateError(f"testbed {self.name!r} is no longer up")
            doc = dict(self._topo)
            doc.pop("states", None)
            doc["up"] = not self.down
            return doc

    def _node_states(self) -> dict[str, str]:
        self.topology()
        with self._topo_lock:
            return dict((self._topo or {}).get("states") or {})

    def mark_down(self) -> None:
        if not self.down:
            self.down, self.down_since = True, time.monotonic()
            self._wake.set()
            with self._cond:
                self._latest, self._latest_json = None, None
                self._cond.notify_all()

    # -- samples
    def _new_sampler(self) -> Any:
        if self._make_sampler is not None:
            return self._make_sampler(self.name, self.interval, self.runs_dir)
        return self.source.sampler(self.interval, self.runs_dir)

    def _publish(self, doc: dict[str, Any] | None) -> None:
        with self._cond:
            self._publish_locked(doc)

    def _publish_locked(self, doc: dict[str, Any] | None) -> None:
        self._latest = doc
        self._latest_json = None if doc is None else json.dumps(doc, separators=(",", ":"), default=str).encode()
        self._cond.notify_all()

    def _run(self) -> None:
        sampler = None
        try:
            while not self._stop.is_set() and not self.down:
                if time.monotonic() - self._wanted > self.idle_s:   # nobody watches: no readings
                    if sampler is not None:
                        sampler.close()
                        sampler = None
                        self._publish(None)
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                try:
                    if sampler is None:
                        sampler = self._new_sampler()
                    doc = sampler.sample()
                    states = self._node_states()
                except Exception as exc:   # gone (StateError), or a reading failed: say so, keep going
                    if not self.source.exists():
                        self.mark_down()
                        break
                    self.error = f"{type(exc).__name__}: {exc}"
                    with self._cond:
                        stale = self._latest
                    if stale is not None:
                        self._publish({**stale, "error": self.error, "trouble": self.source.trouble(None)})
                    if sampler is not None:
                        sampler.close()
                        sampler = None
                    self._stop.wait(self.interval)
                    continue
                self.error = None
                doc = self.source.annotate(doc, states)
                doc.update({"up": True, "version": self.version, "steps": self.steps.update(doc.get("run")),
                            "warming": False, "error": None})
                self._publish(doc)
        finally:
            if sampler is not None:
                sampler.close()

    def sample_json(self, wait: float = FIRST_SAMPLE_WAIT_S) -> bytes:
        """The latest sample, JSON-encoded once for every client; wakes the sampler, and waits up to
        `wait` seconds for its first sample."""
        self._wanted = time.monotonic()
        self._wake.set()
        self.source.touch()
        with self._cond:
            if self._latest_json is None and not self.down:
                self._cond.wait_for(lambda: self._latest_json is not None or self.down, timeout=wait)
            latest, encoded = self._latest, self._latest_json
        if latest is not None and not self.down:
            if self.source.overlay_states and self.source.stamp() != self._topo_stamp:   # changed since: states now
                try:
                    topo = self.topology()
                except StateError:
                    topo = None
                if topo is not None and not self.down:
                    latest = overlay(latest, topo, self._node_states())
                    with self._cond:
                        if self._latest is not None and self._latest.get("t") == latest.get("t"):
                            self._publish_locked(latest)   # later requests get it too, until the next sample
                            return self._latest_json
                    return json.dumps(latest, separators=(",", ":"), default=str).encode()
            if not self.down:
                return encoded
        doc = empty_sample(self.name, up=not self.down, version=self.version, error=self.error,
                           trouble=self.source.trouble(None) if not self.down else [])
        return json.dumps(doc, separators=(",", ":")).encode()

    def sample(self, wait: float = FIRST_SAMPLE_WAIT_S) -> dict[str, Any]:
        return json.loads(self.sample_json(wait))

    # -- control
    def control(self, body: Any) -> dict[str, Any]:
        """One action from the page (testbed.faults.control, or sent to every host); GraphRequestError
        when malformed."""
        action, values = parse_control(body)
        result = self.source.control(action, values)
        return {"ok": True, "action": action, "args": values,
                "result": result if isinstance(result, (bool, list)) else None}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.source.close()   # (across hosts: tells the hosts' tops to stop; the sampler thread waits for them)
        self._thread.join(self.source.close_wait_s)


# -- who may ask -----------------------------------------------------------------------------------------------


class GraphRequestError(Exception):
    """A request the server answers with `status` and `message` (a malformed query or body)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_control(body: Any) -> tuple[str, list[str]]:
    """(action, its node names) of a /api/control body; GraphRequestError(400) when malformed."""
    if not isinstance(body, dict) or body.get("action") not in CONTROL_ACTIONS:
        raise GraphRequestError(400, f"action: one of {', '.join(CONTROL_ACTIONS)}")
    action = body["action"]
    values = []
    for key in (("a", "b") if action.startswith("link_") else ("node",)):
        v = body.get(key)
        if not isinstance(v, str) or not v or len(v) > 64:
            raise GraphRequestError(400, f"{key}: a node name")
        values.append(v)
    return action, values


def is_loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return bind == "localhost"


def check_bind(bind: str) -> str:
    """The address to bind: an IP address (or localhost); GraphError otherwise."""
    if bind == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(bind))
    except ValueError:
        raise GraphError(f"--bind {bind!r}: not an IP address (127.0.0.1, ::1, 0.0.0.0, or one of this "
                         "machine's addresses)") from None


class Access:
    """Who may ask: a token (when one is required) and, without one, a Host header naming loopback."""

    def __init__(self, bind: str, port: int, token: str | None):
        self.token = token
        self.port = port
        if token is None:
            names_ = {"127.0.0.1", "localhost", "[::1]", bind if ":" not in bind else f"[{bind}]"}
            self.hosts: frozenset[str] | None = frozenset(f"{h}:{port}" for h in names_)
        else:
            self.hosts = None

    def _token_ok(self, given: str | None) -> bool:
        return given is not None and self.token is not None and hmac.compare_digest(
            given.encode("utf-8", "replace"), self.token.encode())

    def check(self, headers: Mapping[str, str], query: Mapping[str, list[str]],
              page: bool = False) -> tuple[bool, bool, str]:
        """(allowed, False, why not). page: one of the page's own files (no token needed: no data)."""
        host = (headers.get("Host") or "").strip().lower()
        if self.hosts is not None and host not in self.hosts:
            return False, False, f"Host {host!r} is not this server's loopback address"
        if self.token is None or page:
            return True, False, ""
        auth = headers.get("Authorization") or ""
        if auth.startswith("Bearer ") and self._token_ok(auth[7:].strip()):
            return True, False, ""
        return False, False, ("a token is required (Authorization: Bearer): open the URL `testbed graph` printed "
                              "(it carries #token=)")


# -- HTTP ------------------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    server_version = "testbed-graph"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    timeout = 30          # an idle keep-alive connection ends after this long
    graph: Graph
    access: Access
    log: Callable[[str], None]

    def log_message(self, format: str, *args: Any) -> None:   # no access log
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              extra: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "no-referrer")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: Any) -> None:
        self._send(status, json.dumps(doc, separators=(",", ":"), default=str).encode())

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _allowed(self, query: Mapping[str, list[str]], page: bool = False) -> tuple[bool, bool]:
        ok, via_query, why = self.access.check(self.headers, query, page)
        if not ok:
            self._error(HTTPStatus.FORBIDDEN, why)
        return ok, via_query

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        ok, _ = self._allowed(query, page=url.path in FILES)
        if not ok:
            return
        try:
            if url.path in FILES:
                fname, ctype = FILES[url.path]
                self._send(HTTPStatus.OK, (STATIC / fname).read_bytes(), ctype)
            elif url.path == "/api/topology":
                self._json(HTTPStatus.OK, self.graph.topology())
            elif url.path == "/api/sample":
                self._send(HTTPStatus.OK, self.graph.sample_json())
            elif url.path == "/api/events":
                since = _number(query, "since", 0.0)
                limit = int(_number(query, "limit", EVENTS_LIMIT))
                recs = self.graph.events.since(since, max(0, min(limit, EVENTS_KEEP)))
                self._json(HTTPStatus.OK, {"testbed": self.graph.name, "events": recs,
                                           "t": recs[-1]["t"] if recs else since})
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no such page: {url.path}")
        except GraphRequestError as exc:
            self._error(exc.status, exc.message)
        except StateError as exc:
            self._error(HTTPStatus.CONFLICT, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:   # a bug: the page says what, the server goes on
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        ok, _ = self._allowed(parse_qs(url.query))
        if not ok:
            return
        if url.path != "/api/control":
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: {url.path}")
            return
        if not self.graph.allow_control:
            self._error(HTTPStatus.FORBIDDEN, "control is off: start `testbed graph` with --allow-control")
            return
        if self.headers.get(CONTROL_HEADER) != "1":
            self._error(HTTPStatus.FORBIDDEN, f"a control request carries the header {CONTROL_HEADER}: 1")
            return
        origin = self.headers.get("Origin")
        if origin is not None and origin != f"http://{self.headers.get('Host', '')}":
            self._error(HTTPStatus.FORBIDDEN, f"Origin {origin!r} is not this server")
            return
        if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
            self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "a control request is application/json")
            return
        try:
            length = int(self.headers.get("Content-Length") or "-1")
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length > MAX_BODY else HTTPStatus.LENGTH_REQUIRED,
                        f"a control request has a Content-Length of at most {MAX_BODY}")
            return
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            self._error(HTTPStatus.BAD_REQUEST, "the body is not JSON")
            return
        try:
            doc = self.graph.control(body)
        except GraphRequestError as exc:
            self._error(exc.status, exc.message)
            return
        except StateError as exc:
            self._error(HTTPStatus.CONFLICT, str(exc))
            return
        except TestbedError as exc:   # FaultError: no such node or link
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
            return
        except Exception as exc:
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
            return
        self.log(f"control from {self.client_address[0]}: {doc['action'].replace('_', ' ')} {' '.join(doc['args'])}")
        self._json(HTTPStatus.OK, doc)


def _number(query: Mapping[str, list[str]], key: str, default: float) -> float:
    raw = (query.get(key) or [None])[0]
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise GraphRequestError(400, f"{key}: a number") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise GraphRequestError(400, f"{key}: a number")
    return v


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:   # one line, no traceback
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)):
            print(f"testbed graph: request from {client_address[0]}: {type(exc).__name__}: {exc}", file=sys.stderr)


class _Server6(_Server):
    address_family = socket.AF_INET6


def make_server(graph: Graph, bind: str = DEFAULT_BIND, port: int | None = None, token: str | None = None,
                log: Callable[[str], None] = print) -> tuple[ThreadingHTTPServer, Access]:
    """A server for `graph` on bind:port (port None: DEFAULT_PORT, or any free one when it is taken)."""
    cls = _Server6 if ":" in bind else _Server
    tries = [port] if port is not None else [DEFAULT_PORT, 0]
    for i, p in enumerate(tries):
        try:
            server = cls((bind, p), Handler)
            break
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and i + 1 < len(tries):
                continue
            if exc.errno == errno.EADDRINUSE:
                raise GraphError(f"--port {p}: in use (--port 0 picks a free one)") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise GraphError(f"--bind {bind}: not an address of this machine") from None
            raise
    actual = server.server_address[1]
    access = Access(bind, actual, token)
    server.RequestHandlerClass = type("GraphHandler", (Handler,), {"graph": graph, "access": access,
                                                                   "log": staticmethod(log)})
    return server, access


def url_of(bind: str, port: int, token: str | None) -> str:
    host = bind
    if bind in ("0.0.0.0", "::"):
        host = socket.gethostname()
    elif ":" in bind:
        host = f"[{bind}]"
    return f"http://{host}:{port}/" + (f"#token={token}" if token else "")


def serve(name: str, *, bind: str = DEFAULT_BIND, port: int | None = None, allow_control: bool = False,
          runs_dir: str | os.PathLike[str] | None = None, interval: float = 1.0,
          log: Callable[[str], None] = print, ready: Callable[[str], None] | None = None,
          plain_http: bool = False, open_source: Callable[[str], Any] | None = None) -> str:
    """Serve testbed `name`'s page until Ctrl-C (KeyboardInterrupt propagates, after a clean stop) or
    until the testbed has been down DOWN_GRACE_S seconds (returns "down"). open_source(name): where
    its documents come from (None: this host's, a LocalSource; testbed.handle's graph_source
    picks its hosts' for a testbed over several hosts), closed when the server stops."""
    bind = check_bind(bind)
    if not is_loopback(bind) and not plain_http:
        raise GraphError(f"--bind {bind}: not a loopback address; the page's token would cross the network in "
                         "plain HTTP. Bind 127.0.0.1 and reach it through `ssh -L PORT:127.0.0.1:PORT HOST`, or "
                         "give --plain-http where that network is trusted")
    token = secrets.token_urlsafe(24) if (allow_control or not is_loopback(bind)) else None
    source = (open_source or LocalSource)(name)
    try:
        graph = Graph(name, interval=interval, runs_dir=runs_dir, allow_control=allow_control, source=source)
    except BaseException:
        source.close()
        raise
    try:
        graph.topology()   # the state is readable before we say where to look
        server, access = make_server(graph, bind, port, token, log)
    except BaseException:
        graph.close()
        raise
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                              name="graph-server")
    thread.start()
    url = url_of(bind, access.port, token)
    try:
        (ready or log)(url)
        while True:
            time.sleep(0.25)
            if not graph.source.exists():
                graph.mark_down()
            if graph.down and time.monotonic() - (graph.down_since or 0) >= DOWN_GRACE_S:
                return "down"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        graph.close()
