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

from testbed import paths, store
from testbed.errors import StateError, TestbedError
from testbed.observe.graph_access import (CONTROL_HEADER, MAX_BODY, Access, GraphError, GraphRequestError, check_bind,
                                          is_loopback, parse_control)
from testbed.observe.graph_doc import (EVENTS_KEEP, EVENTS_LIMIT, EventTail, StepHistory, empty_sample, node_states,
                                       overlay, topology_doc)

DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 8765            # tried first when no --port is given; taken: any free port
IDLE_S = 15.0                  # sampling pauses when no page asked for a sample this long
FIRST_SAMPLE_WAIT_S = 3.0      # a request that wakes the sampler waits this long for its first sample
DOWN_GRACE_S = 5.0             # after the testbed went down, serve "down" this long, then exit
STATIC = Path(__file__).with_name("static")
FILES = {"/": ("graph.html", "text/html; charset=utf-8"),
         "/graph.js": ("graph.js", "text/javascript; charset=utf-8"),
         "/graph.css": ("graph.css", "text/css; charset=utf-8")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


# -- the drawing: pure functions of a state -----------------------------------------------------------------


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
