"""`testbed graph` (testbed.observe.graph, testbed.cli.graph, testbed/observe/static/).

Pure tests: the drawing's tiers and the /api/topology document from a state (links down, nodes
down, changed profiles), the step history, the event tail, who may ask (token, Host), and the HTTP
server itself on loopback with a made-up sampler and topology: endpoints, JSON shapes, headers,
and every way a POST is refused. Across hosts (testbed.cluster.graph): the topology document
of a controller's record with each node's host, the lines naming a failing host, the command
lines control sends, and the same server with made-up hosts (tests/test_cluster_graph.py runs it
against two emulated hosts).

Kernel tests (root): `testbed graph` as a process against a 100 Mbit/s star: /api/topology and
/api/sample, a link's utilisation rising under an iperf3 flow, a downed link reading down, POST
control refused without --allow-control, Ctrl-C, and the server stopping by itself when the
testbed goes down; bound to a non-loopback address (a worker's, from inside its namespace) it
refuses a request without the token (403) and serves one with it.

Browser test (root, Debian's chromium): the page of a k=4 fat-tree in headless Chromium, driven
over the DevTools protocol on a pipe (no driver package): an SVG element per node and link with
data attributes filled from /api/topology, a link shown down within 3 s of `testbed link down`,
a link's profile in the details panel, the link brought back up from the page (--allow-control),
and a screenshot (TESTBED_TEST_ARTIFACTS=DIR keeps a copy).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from testbed.observe import graph, graph_access, graph_doc
from waiting import WaitTimeout, tcp_sockets, wait_for
from testbed.observe.graph_access import Access
from testbed.observe.graph_doc import EventTail, StepHistory, topology_doc
from testbed.topology.units import format_profile

IS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

TOPOLOGY_FIELDS = {"testbed", "version", "up", "created", "dilation", "time", "control", "tiers", "layers", "widest",
                   "nodes", "links"}
NODE_FIELDS = {"name", "kind", "layer", "x", "state", "gpus", "addresses"}
LINK_FIELDS = {"index", "a", "b", "tier", "state", "down_by", "ab", "ba", "ab_text", "ba_text", "changed", "ifnames"}
PROFILE_FIELDS = {"bandwidth_bps", "delay_s", "jitter_s", "loss", "queue"}
# testbed top --json's document, and what graph adds to it
TOP_FIELDS = {"testbed", "t", "interval_s", "read_s", "time", "dilation", "links", "workers", "run"}
SAMPLE_FIELDS = TOP_FIELDS | set(graph_doc.SAMPLE_FIELDS)


# -- pure: the drawing ---------------------------------------------------------------------------------------


def _state(topo_name: str, overrides: list[str], **extra) -> dict:
    """A state as `up` writes it, enough for topology_doc (no kernel: nothing is built)."""
    from testbed.topology.loader import load_topology

    topo = load_topology(topo_name, overrides)
    links = [{"index": i, "endpoints": [l.a, l.b], "tier": l.tier, "state": "up", "down_by": []}
             for i, l in enumerate(topo.links)]
    return {"name": "tb", "topology": topo.to_json(), "links": links, "created": "now", **extra}


def test_fat_tree_is_drawn_in_tiers():
    st = _state("fat-tree", ["params.k=4"])
    doc = topology_doc(st, version=3)
    assert set(doc) == TOPOLOGY_FIELDS and doc["version"] == 3 and doc["control"] is False
    assert all(set(n) == NODE_FIELDS for n in doc["nodes"]) and all(set(l) == LINK_FIELDS for l in doc["links"])
    assert len(doc["nodes"]) == 36 and len(doc["links"]) == 48
    layer = {n["name"]: n["layer"] for n in doc["nodes"]}
    rows = {}
    for n in doc["nodes"]:
        rows.setdefault(n["layer"], set()).add(n["name"][:3])
    # workers at the bottom, then edge, aggregation, core: each switch one row above its lowest neighbour
    assert rows == {0: {n[:3] for n in layer if n.startswith("w")}, 1: {"edg"}, 2: {"agg"}, 3: {"cor"}}, rows
    assert doc["layers"] == 4 and doc["widest"] == 16
    assert all(0 < n["x"] < 1 for n in doc["nodes"])
    for l in doc["links"]:
        assert abs(layer[l["a"]] - layer[l["b"]]) == 1, l          # every link joins adjacent rows
        assert set(l["ab"]) == PROFILE_FIELDS and l["state"] == "up" and l["down_by"] == []
    # a pod's edge switches sit above their own workers (the barycentre order of links.png)
    x = {n["name"]: n["x"] for n in doc["nodes"]}
    assert x["edge0-0"] < x["edge1-0"] < x["edge2-0"] < x["edge3-0"]
    assert doc["tiers"] == ["host", "edge-agg", "agg-core"]


def test_star_down_links_nodes_and_changed_profiles():
    st = _state("star", ["params.n=3", "tiers.host.bandwidth=100mbit", "tiers.host.delay=2ms"],
                time_dilation=2.0,
                faults={"nodes": {"w1": {"state": "down"}, "w2": {"state": "crashed"}}},
                plan={"links": [{"a": {"node": "w0", "address": "10.0.0.2/24"}, "b": {"node": "s0", "address": None}}]})
    st["links"][1].update(state="down", down_by=["node:w1"])
    st["links"][2]["state"] = "down"
    del st["links"][2]["down_by"]                                    # an older record: no down_by
    st["links"][0]["profile"] = {
        "ab": {"bandwidth_bps": 10e6, "delay_s": 0.002, "jitter_s": 0.001, "loss": 0.01, "queue": 50},
        "ba": {"bandwidth_bps": 100e6, "delay_s": 0.002, "jitter_s": 0.0, "loss": 0.0, "queue": None}}
    doc = topology_doc(st, control=True)
    assert doc["control"] is True and doc["dilation"] == 2.0 and doc["time"] == "emulated"
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert (nodes["w0"]["state"], nodes["w1"]["state"], nodes["w2"]["state"], nodes["s0"]["state"]) == \
        ("up", "down", "crashed", "up")
    assert nodes["w0"]["addresses"] == ["10.0.0.2/24"] and nodes["s0"]["addresses"] == []
    assert (nodes["s0"]["layer"], nodes["w0"]["layer"]) == (1, 0) and nodes["s0"]["x"] == 0.5
    l0, l1, l2 = doc["links"]
    assert l0["changed"] and l0["ab_text"] == "10mbit 2ms ±1ms loss 1% q 50" and l0["ba_text"] == "100mbit 2ms"
    assert (l1["state"], l1["down_by"]) == ("down", ["node:w1"])
    assert (l2["state"], l2["down_by"], l2["changed"]) == ("down", ["link"], False)
    assert l2["ab_text"] == "100mbit 2ms"                             # emulated units, as link show


def test_overlay_takes_newer_states():
    st = _state("star", ["params.n=2"])
    st["links"][1].update(state="down", down_by=["link"])
    topo = topology_doc(st, version=7)
    sample = {"t": 1.0, "version": 6, "nodes": {}, "links": [
        {"index": 1, "name": "w1->s0", "state": "up", "down_by": [], "util": 0.5},
        {"index": 0, "name": "w0->s0", "state": "up", "down_by": [], "util": 0.1}]}
    out = graph_doc.overlay(sample, topo, {"w1": "down"})
    assert [(l["state"], l["down_by"], l["util"]) for l in out["links"]] == [("down", ["link"], 0.5),
                                                                         ("up", [], 0.1)]
    assert out["version"] == 7 and out["nodes"] == {"w1": "down"}
    assert sample["links"][0]["state"] == "up" and sample["version"] == 6   # the shared sample is left alone


def test_format_profile_as_link_show():
    assert format_profile({"bandwidth_bps": None, "delay_s": 0.0}) == "unshaped"
    assert format_profile({"bandwidth_bps": 1e9, "delay_s": 5e-6, "loss": 0.5}) == "1gbit 5us loss 50%"


def test_step_history_one_point_per_step_and_per_run():
    h = StepHistory(keep=3)
    run = {"run_id": "r1", "step": None, "last_step_s": None, "last_step_max_s": None}
    assert h.update(run) == []
    for step, dt in ((1, 0.5), (1, 0.5), (2, 0.4), (3, 0.3), (4, 0.2)):
        pts = h.update({**run, "step": step, "last_step_s": dt, "last_step_max_s": dt * 2}, now=float(step))
    assert [p["step"] for p in pts] == [2, 3, 4] and pts[-1] == {"step": 4, "t": 4.0, "step_s": 0.2, "max_s": 0.4}
    assert h.update({**run, "run_id": "r2", "step": 1, "last_step_s": 0.1}, now=9.0)[0]["step"] == 1
    assert len(h.points) == 1
    assert h.update(None) == [] and h.points == []


def test_event_tail_reads_again_only_when_the_file_changed(state_dir):
    from testbed import events

    (state_dir / "tb").mkdir()
    reads = []

    def reader(name):
        reads.append(name)
        return events.read(name)

    tail = EventTail("tb", keep=3, reader=reader)
    assert tail.since(0) == [] and reads == []                      # no file: nothing read
    for i in range(5):
        events.emit("tb", "link", f"link down w{i} s0")
    recs = tail.since(0)
    assert [r["what"] for r in recs] == ["link down w2 s0", "link down w3 s0", "link down w4 s0"]
    assert tail.since(recs[1]["t"]) == recs[2:] and tail.since(0, limit=1) == recs[2:]
    assert len(reads) == 1                                          # unchanged: not read again
    events.emit("tb", "node", "node down w0")
    assert tail.since(recs[2]["t"])[0]["what"] == "node down w0" and len(reads) == 2


# -- pure: who may ask -----------------------------------------------------------------------------------------


def test_access_without_token_checks_the_host():
    a = Access("127.0.0.1", 8765, None)
    assert a.check({"Host": "127.0.0.1:8765"}, {})[0] and a.check({"Host": "localhost:8765"}, {})[0]
    assert a.check({"Host": "[::1]:8765"}, {})[0]
    for host in ("evil.example:8765", "127.0.0.1:9999", "", "127.0.0.1"):
        ok, _, why = a.check({"Host": host}, {})
        assert not ok and "Host" in why, host


def test_access_with_token():
    a = Access("192.0.2.1", 8000, "s3cret-token")
    assert a.check({"Host": "anything:8000"}, {"token": ["s3cret-token"]})[0] is False   # never in a query
    assert a.check({"Host": "x"}, {}, )[0] is False
    assert a.check({"Host": "x"}, {"token": ["s3cret-tokeN"]})[0] is False
    assert a.check({"Host": "x"}, {"token": ["\u00e9"]})[0] is False
    assert a.check({"Authorization": "Bearer s3cret-token"}, {}) == (True, False, "")
    assert a.check({"Cookie": "other=1; tbgraph-8000=s3cret-token"}, {})[0] is False   # never in a cookie
    assert a.check({"Authorization": "Bearer wrong"}, {})[0] is False
    assert a.check({"Cookie": "\x00garbage;;="}, {})[0] is False
    ok, _, why = a.check({}, {})
    assert not ok and "token" in why


def test_bind_and_url():
    assert graph_access.check_bind("localhost") == "127.0.0.1" and graph_access.check_bind("::1") == "::1"
    with pytest.raises(graph_access.GraphError) as e:
        graph_access.check_bind("example.org")
    assert e.value.exit_code == 2 and "--bind" in str(e.value)
    assert graph_access.is_loopback("127.0.0.2") and graph_access.is_loopback("::1") and not graph_access.is_loopback("0.0.0.0")
    assert graph.url_of("127.0.0.1", 80, None) == "http://127.0.0.1:80/"
    assert graph.url_of("::1", 80, "t") == "http://[::1]:80/#token=t"


# -- pure: the server with a made-up sampler --------------------------------------------------------------------


FAKE_TOPO = topology_doc(_state("star", ["params.n=2", "tiers.host.bandwidth=100mbit", "tiers.host.delay=0"]),
                         version=1)


class FakeTop:
    made: list["FakeTop"] = []

    def __init__(self, name, interval, runs_dir):
        self.name, self.interval, self.n, self.closed = name, interval, 0, False
        FakeTop.made.append(self)

    def sample(self):
        time.sleep(self.interval)   # a sample takes one interval, as top's does (the fake's timing)
        self.n += 1
        links = [{"index": i, "name": f"{a}->{b}", "from": a, "to": b, "tier": "host", "ifname": "eth0",
                  "state": "up", "down_by": [], "bandwidth_bps": 100e6, "rate_bps": 50e6, "wire_rate_bps": 50e6,
                  "packets_per_s": 1.0, "util": 0.5, "backlog_bytes": 0, "backlog_packets": 0, "drops": 0,
                  "overlimits": 0}
                 for i, l in enumerate(FAKE_TOPO["links"]) for a, b in ((l["a"], l["b"]), (l["b"], l["a"]))]
        return {"testbed": self.name, "t": time.time(), "interval_s": 1.0, "read_s": 0.01, "time": "real",
                "dilation": 1.0, "links": links, "workers": [{"name": "w0", "state": "up", "cpu": 0.25,
                                                              "memory_bytes": 1}], "run": None}

    def close(self):
        self.closed = True


class FakeGraph(graph.Graph):
    def __init__(self, **kw):
        self.controlled = []
        super().__init__("tb", sampler=FakeTop, interval=0.1, **kw)

    def topology(self):
        return dict(FAKE_TOPO, up=not self.down)

    def _node_states(self):
        return {"w0": "up", "w1": "down", "s0": "up"}

    def control(self, body):
        action, args = graph_access.parse_control(body)
        self.controlled.append(body)
        return {"ok": True, "action": action, "args": args, "result": None}


@pytest.fixture
def fake_server(state_dir):
    servers = []

    def start(token=None, allow_control=False, idle_s=graph.IDLE_S):
        g = FakeGraph(allow_control=allow_control, idle_s=idle_s)
        logged = []
        server, access = graph.make_server(g, "127.0.0.1", 0, token, logged.append)
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        servers.append((server, t, g))
        return f"http://127.0.0.1:{access.port}", g, logged

    yield start
    for server, t, g in servers:
        server.shutdown()
        server.server_close()
        t.join(5)
        g.close()


def _get(url, headers=None, method="GET", data=None):
    """(status, headers, body) without raising on 4xx/5xx."""
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kw):
        return None


def test_server_endpoints_and_shapes(fake_server):
    from testbed import events

    base, g, _ = fake_server()
    (Path(os.environ["TESTBED_STATE_DIR"]) / "tb").mkdir()
    events.emit("tb", "link", "link down w0 s0")
    status, headers, body = _get(base + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b'src="graph.js"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Server"].strip() == "testbed-graph"                 # no Python version on the wire
    for page, kind in (("/graph.js", "text/javascript"), ("/graph.css", "text/css")):
        status, headers, body = _get(base + page)
        assert status == 200 and headers["Content-Type"].startswith(kind) and len(body) > 1000
    status, _, body = _get(base + "/api/topology")
    topo = json.loads(body)
    assert status == 200 and set(topo) == TOPOLOGY_FIELDS and len(topo["nodes"]) == 3
    t0 = time.monotonic()
    status, headers, body = _get(base + "/api/sample")                  # wakes the sampler, waits for it
    waited = time.monotonic() - t0
    print(f"\nfirst /api/sample answered in {waited:.3f} s (load {os.getloadavg()[0]:.2f})")
    sample = json.loads(body)
    # one fake sample (0.1 s) and the request: 0.101-0.108 s in 5 runs (2026-12-02, load 7.9-8.6); a
    # sampler the request did not wake starts within its 1 s idle check, and a request gives up
    # waiting (answers warming) after graph.FIRST_SAMPLE_WAIT_S, 3 s: 2 s lies between
    assert status == 200 and headers["Cache-Control"] == "no-store" and waited < 2
    assert set(sample) == SAMPLE_FIELDS and sample["up"] and not sample["warming"] and sample["error"] is None
    assert sample["nodes"] == {"w0": "up", "w1": "down", "s0": "up"} and sample["version"] == g.version
    assert sample["steps"] == [] and len(sample["links"]) == 4
    status, _, body = _get(base + "/api/events?since=0")
    ev = json.loads(body)
    assert status == 200 and [e["what"] for e in ev["events"]] == ["link down w0 s0"]
    assert ev["t"] == ev["events"][0]["t"]
    assert json.loads(_get(base + f"/api/events?since={ev['t']}")[2])["events"] == []
    assert _get(base + "/api/events?since=nan")[0] == 400
    assert _get(base + "/api/events?since=abc")[0] == 400
    assert _get(base + "/../../etc/passwd")[0] == 404 and _get(base + "/static/graph.js")[0] == 404
    assert _get(base + "/", method="HEAD")[0] == 200


def test_one_sampler_shared_and_paused_when_nobody_asks(fake_server):
    base, g, _ = fake_server(idle_s=0.6)
    t0 = time.monotonic()
    docs = [json.loads(_get(base + "/api/sample")[2]) for _ in range(30)]
    took = time.monotonic() - t0
    assert all(d["up"] for d in docs)
    sampler = FakeTop.made[-1]
    assert sampler.n <= took / sampler.interval + 2, (sampler.n, took)   # one per interval, not per request
    assert len({d["t"] for d in docs}) <= sampler.n
    wait_for(lambda: sampler.closed, timeout=5, what="the idle sampler to close (nobody asked)")
    assert json.loads(_get(base + "/api/sample")[2])["warming"] is False   # a new sampler, a new first sample


def test_down_testbed_sample_says_so(fake_server):
    base, g, _ = fake_server()
    g.mark_down()
    s = json.loads(_get(base + "/api/sample")[2])
    assert set(s) == SAMPLE_FIELDS and s["up"] is False and s["links"] == []
    assert json.loads(_get(base + "/api/topology")[2])["up"] is False


def test_token_only_in_a_header_never_a_cookie(fake_server):
    """Cookies are not isolated by port: any other service on 127.0.0.1 the browser visits would get
    one. The token travels only as Authorization: Bearer; the page's own files need none."""
    base, g, _ = fake_server(token="tok-123")
    port = base.rsplit(":", 1)[1]
    assert _get(base + "/api/sample")[0] == 403
    assert _get(base + "/api/topology?token=tok-123")[0] == 403
    assert _get(base + "/api/topology", {"Cookie": f"tbgraph-{port}=tok-123"})[0] == 403
    status, headers, _ = _get(base + "/?token=tok-123")
    assert status == 200 and headers.get("Set-Cookie") is None
    assert _get(base + "/api/topology", {"Authorization": "Bearer tok-123"})[0] == 200


def test_control_refused_unless_allowed_and_asked_right(fake_server):
    body = json.dumps({"action": "link_down", "a": "w0", "b": "s0"}).encode()
    ok = {"Content-Type": "application/json", graph_access.CONTROL_HEADER: "1"}
    base, g, _ = fake_server()                                         # read-only
    status, _, out = _get(base + "/api/control", ok, "POST", body)
    assert status == 403 and "--allow-control" in json.loads(out)["error"] and g.controlled == []
    base, g, logged = fake_server(token="tk", allow_control=True)
    auth = {**ok, "Authorization": "Bearer tk"}
    assert _get(base + "/api/control", ok, "POST", body)[0] == 403                    # no token
    no_header = {k: v for k, v in auth.items() if k != graph_access.CONTROL_HEADER}
    assert _get(base + "/api/control", no_header, "POST", body)[0] == 403              # a form post from anywhere
    assert _get(base + "/api/control", {**auth, "Origin": "http://evil.example"}, "POST", body)[0] == 403
    assert _get(base + "/api/control", {**auth, "Content-Type": "text/plain"}, "POST", body)[0] == 415
    assert _get(base + "/api/control", auth, "POST", b"x" * (graph_access.MAX_BODY + 1))[0] == 413
    assert _get(base + "/api/control", auth, "POST", b"{not json")[0] == 400
    assert _get(base + "/api/other", auth, "POST", body)[0] == 404
    assert g.controlled == []
    status, _, out = _get(base + "/api/control", {**auth, "Origin": base}, "POST", body)
    assert status == 200 and json.loads(out)["ok"] and g.controlled == [json.loads(body)]
    assert logged and "link down" in logged[-1]
    for bad in ({"action": "bogus"}, {"action": "link_down", "a": "w0"}, {"action": "node_down", "node": 3},
                {"action": "node_up", "node": "x" * 65}, ["link_down"]):
        status, _, out = _get(base + "/api/control", auth, "POST", json.dumps(bad).encode())
        assert status == 400 and json.loads(out)["error"], (bad, out)
    assert len(g.controlled) == 1


# -- pure: a testbed over several hosts (testbed.cluster.graph), its hosts made up -------------------------------

HOST_OF = {"w0": "h1", "w1": "h1", "s0": "h1", "w2": "h2", "w3": "h2", "s1": "h2"}


def _record() -> dict:
    """The controller's record of two-sides pinned over h1 and h2 (s0-s1 the cut link), as `up --hosts` keeps it."""
    from testbed.topology.loader import load_topology

    topo = load_topology(str(REPO / "topologies" / "two-sides.yaml"), [])
    return {"name": "mh", "created": "now", "time_dilation": 1.0, "topology": topo.to_json(),
            "placement": dict(HOST_OF), "hosts": {"h1": {"nodes": 3}, "h2": {"nodes": 3}}}


def _link_show(record, down: dict | None = None, changed: dict | None = None) -> list:
    """`testbed link show --json` of that testbed: index -> down_by for links down, index -> (ab, ba) changed."""
    out = []
    for i, l in enumerate(record["topology"]["links"]):
        by = (down or {}).get(i, [])
        ab, ba = (changed or {}).get(i, (l["ab"], l["ba"]))
        pick = lambda p: {k: p.get(k) for k in PROFILE_FIELDS}   # noqa: E731
        out.append({"index": i, "endpoints": l["endpoints"], "tier": l["tier"], "state": "down" if by else "up",
                    "down_by": by, "ab": pick(ab), "ba": pick(ba), "changed": i in (changed or {}),
                    "ifnames": [f"a{i}", f"b{i}"]})
    return out


def _answer(rc=0, stdout="", stderr=""):
    from testbed.cluster.remote import RemoteResult

    return RemoteResult(rc=rc, stdout=stdout, stderr=stderr, host="h", argv=())


def test_hosts_topology_doc_names_each_nodes_host_and_what_is_down():
    from testbed.cluster.graph import hosts_topology_doc

    rec = _record()
    slow = {"bandwidth_bps": 100e6, "delay_s": 0.001, "jitter_s": 0.0, "loss": 0.0, "queue": None}
    links = _link_show(rec, down={2: ["node:s1"], 3: ["node:s1"], 4: ["link", "node:s1"]}, changed={0: (slow, slow)})
    doc = hosts_topology_doc(rec, links, version=4, control=True)
    assert set(doc) == TOPOLOGY_FIELDS | {"hosts", "states"} and doc["hosts"] == ["h1", "h2"]
    assert doc["testbed"] == "mh" and doc["version"] == 4 and doc["control"] is True and doc["time"] == "real"
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert {n: x["host"] for n, x in nodes.items()} == HOST_OF
    assert all(set(n) == NODE_FIELDS | {"host"} for n in doc["nodes"])
    assert nodes["s1"]["state"] == "down" and nodes["s0"]["state"] == "up" and doc["states"]["s1"] == "down"
    assert nodes["w0"]["addresses"] and nodes["w0"]["layer"] == 0 and nodes["s0"]["layer"] == 1   # the plan's
    by = {(l["a"], l["b"]): l for l in doc["links"]}
    assert by[("s0", "s1")]["hosts"] == ["h1", "h2"] and by[("w0", "s0")]["hosts"] == ["h1", "h1"]
    assert (by[("s0", "s1")]["state"], by[("s0", "s1")]["down_by"]) == ("down", ["link", "node:s1"])
    assert by[("w0", "s0")]["changed"] and by[("w0", "s0")]["ab_text"] == "100mbit 1ms"
    assert by[("w1", "s0")]["state"] == "up" and not by[("w1", "s0")]["changed"]
    assert by[("s0", "s1")]["ab_text"] == "1gbit" and by[("s0", "s1")]["ifnames"] == ["a4", "b4"]
    # no host answered: the topology as the record has it, every link up
    doc = hosts_topology_doc(rec, None)
    assert all(l["state"] == "up" for l in doc["links"]) and doc["states"]["s1"] == "up"


def test_hosts_trouble_control_requests_and_answers():
    from testbed.cluster import graph as gh
    from testbed.cluster.agents import HostFailed
    from testbed.faults.control import FaultError

    top = {"h1": {"state": "ok", "why": None, "t": 1.0}, "h2": {"state": "failed", "why": "cannot reach host h2"}}
    assert gh.trouble_lines(["h1", "h2"], top, {}) == ["h2: top failed: cannot reach host h2"]
    assert gh.trouble_lines(["h1", "h2"], None, {"h1": {"events": "boom"}, "h2": {"link show": "x", "events": "y"}}) \
        == ["h1: events: boom", "h2: link show: x; events: y"]
    assert gh.trouble_lines(["h1", "h2"], {"h1": {"state": "ok"}}, {}) == []
    stale = {"h1": {"state": "stale", "why": "no new reading for 3 s", "t": 97.0}}
    assert gh.trouble_lines(["h1"], stale, {}, newest=100.0) == []                  # a little late: no banner
    assert gh.trouble_lines(["h1"], stale, {}, newest=97.0 + gh.STALE_S) == ["h1: top stale: no new reading for 3 s"]
    rec = _record()
    assert gh.control_request(rec, "mh", "link_down", ["s1", "s0"]) == {"op": "link.down", "name": "mh", "a": "s1",
                                                                        "b": "s0"}
    assert gh.control_request(rec, "mh", "node_up", ["w2"]) == {"op": "node", "verb": "up", "name": "mh", "node": "w2"}
    with pytest.raises(FaultError, match="no node 'nope'"):
        gh.control_request(rec, "mh", "node_down", ["nope"])
    with pytest.raises(FaultError, match="no link between w0 and w2"):
        gh.control_request(rec, "mh", "link_down", ["w0", "w2"])
    links = _link_show(rec)
    got, failed = gh.link_answers({"h1": HostFailed("h1", "cannot reach host h1"), "h2": links}, ["h1", "h2"])
    assert got == links and failed == {"h1": "cannot reach host h1"}
    got, failed = gh.link_answers({"h1": HostFailed("h1", "no testbed named 'mh' is up"), "h2": None}, ["h1", "h2"])
    assert got is None and failed == {"h1": "no testbed named 'mh' is up", "h2": "no answer"}


def test_a_host_whose_top_failed_is_watched_again_once_it_answers():
    from testbed.cluster.graph import HostsSampler

    class Top:
        def __init__(self, state):
            self.state, self.closed = state, False

        def sample(self):
            return {"hosts": {"h1": {"state": "ok"}, "h2": {"state": self.state}}}

        def close(self):
            self.closed = True

    class Source:
        def __init__(self):
            self.tops, self.back = [], False

        def new_top(self, interval, runs_dir):
            self.tops.append(Top("failed" if not self.tops else "ok"))
            return self.tops[-1]

        def answering(self, host, since):
            return self.back and host == "h2"

    src = Source()
    s = HostsSampler(src, 1.0, None)
    assert s.sample()["hosts"]["h2"]["state"] == "failed" and len(src.tops) == 1
    assert s.sample() and len(src.tops) == 1 and "h2" in s.failed_since        # still unreachable: no restart
    src.back = True
    assert s.sample()["hosts"]["h2"]["state"] == "failed"                        # that sample, then a new top
    assert len(src.tops) == 2 and src.tops[0].closed and s.top is src.tops[1]
    assert s.sample()["hosts"]["h2"]["state"] == "ok" and len(src.tops) == 2
    s.close()
    assert src.tops[1].closed


class FakeHosts:
    """testbed.cluster.agents.ask for h1 and h2, answered from here as the agents would: h2's events fail."""

    def __init__(self, record):
        self.record = record
        self.links = _link_show(record)
        self.calls: list[dict] = []
        self.fail_control: str | None = None

    def __call__(self, name, requests, timeout=None):
        from testbed.agent.protocol import EventRecord, EventsEnd, value_type
        from testbed.cluster.agents import HostFailed, Streamed

        out = {h: [] for h in ("h1", "h2")}
        for req in requests:
            self.calls.append(req.model_dump(exclude_none=True))
            if req.op == "link.show":
                for h in out:
                    out[h].append(value_type("link.show").validate_python(self.links))
            elif req.op == "events":
                ev = {"t": 5.0, "kind": "link", "what": "link down s0 s1", "testbed": name}
                out["h1"].append(Streamed([EventRecord(**{**ev, "t": 4.0, "kind": "up", "what": "up"}),
                                           EventRecord(**ev)], EventsEnd()))
                out["h2"].append(HostFailed("h2", "events.jsonl: permission denied"))
            else:
                if req.op == "link.down":
                    i = next(i for i, l in enumerate(self.links) if set(l["endpoints"]) == {req.a, req.b})
                    self.links[i].update(state="down", down_by=["link"])
                for h in out:
                    out[h].append(HostFailed(h, "boom") if h == self.fail_control else None)
        return out


class FakeHostsTop:
    """HostsTop's merged document of two-sides, h2's top failed."""

    def __init__(self, name, interval, runs_dir):
        self.interval = interval

    def sample(self):
        time.sleep(self.interval)   # a sample takes one interval, as top's does (the fake's timing)
        rec = _record()
        links = [{"index": i, "name": f"{a}->{b}", "from": a, "to": b, "tier": l["tier"], "ifname": None,
                  "state": "up", "down_by": [], "bandwidth_bps": 1e9, "rate_bps": 5e8, "wire_rate_bps": 5e8,
                  "packets_per_s": 1.0, "util": 0.5, "backlog_bytes": None, "backlog_packets": None, "drops": None,
                  "overlimits": None, "host": HOST_OF[a], "to_host": HOST_OF[b]}
                 for i, l in enumerate(rec["topology"]["links"]) for a, b in (l["endpoints"], l["endpoints"][::-1])]
        workers = [{"name": w, "state": "crashed" if w == "w1" else "up", "cpu": 0.1, "memory_bytes": 1,
                    "host": HOST_OF[w]} for w in ("w0", "w1", "w2", "w3")]
        return {"testbed": "mh", "t": time.time(), "interval_s": 1.0, "read_s": 0.01, "time": "real", "dilation": 1.0,
                "links": links, "workers": workers, "run": None,
                "hosts": {"h1": {"state": "ok", "why": None, "t": time.time()},
                          "h2": {"state": "failed", "why": "cannot reach host h2", "t": None}}}

    def close(self):
        pass


def test_server_across_hosts_names_hosts_and_forwards_control(state_dir, monkeypatch):
    """The same server, its source a testbed over two made-up hosts: each node's host, the hosts'
    events merged, a failing host's lines in "trouble", control sent to every host."""
    from testbed.cluster import controller
    from testbed.cluster.graph import HostsSource

    monkeypatch.setattr(controller, "exists", lambda name: name == "mh")
    rec = _record()
    hosts = FakeHosts(rec)
    source = HostsSource("mh", record=rec, ask=hosts, refresh_s=0.2)
    g = graph.Graph("mh", sampler=FakeHostsTop, interval=0.1, allow_control=True, source=source)
    server, access = graph.make_server(g, "127.0.0.1", 0, "tok", lambda _l: None)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    base, auth = f"http://127.0.0.1:{access.port}", {"Authorization": "Bearer tok"}
    try:
        topo = json.loads(_get(base + "/api/topology", auth)[2])
        assert topo["hosts"] == ["h1", "h2"] and {n["name"]: n["host"] for n in topo["nodes"]} == HOST_OF
        assert "states" not in topo and topo["control"] is True
        s = json.loads(_get(base + "/api/sample", auth)[2])
        assert set(s) == SAMPLE_FIELDS | {"hosts"} and not s["warming"] and s["error"] is None, s
        assert s["nodes"]["w1"] == "crashed" and s["nodes"]["s1"] == "up"              # a worker's own state
        assert "h2: top failed: cannot reach host h2" in s["trouble"][0]
        assert "events: events.jsonl: permission denied" in s["trouble"][0]
        ev = json.loads(_get(base + "/api/events?since=0", auth)[2])["events"]
        assert [(e["host"], e["what"]) for e in ev] == [("h1", "up"), ("h1", "link down s0 s1")]
        # control: to every host, then the records asked for again (a new version of the topology)
        version = topo["version"]
        post = {**auth, "Content-Type": "application/json", graph_access.CONTROL_HEADER: "1"}
        status, _, body = _get(base + "/api/control", post, "POST",
                               json.dumps({"action": "link_down", "a": "s0", "b": "s1"}).encode())
        assert status == 200 and json.loads(body)["ok"], body
        assert {"op": "link.down", "name": "mh", "a": "s0", "b": "s1"} in hosts.calls
        wait_for(lambda: json.loads(_get(base + "/api/topology", auth)[2])["version"] > version, timeout=5,
                 interval=0.2, what="a new version of the topology")
        topo = json.loads(_get(base + "/api/topology", auth)[2])
        assert next(l for l in topo["links"] if l["a"] == "s0")["state"] == "down"
        status, _, body = _get(base + "/api/control", post, "POST", json.dumps({"action": "node_down",
                                                                                "node": "nope"}).encode())
        assert status == 400 and "no node 'nope'" in json.loads(body)["error"]
        hosts.fail_control = "h2"
        status, _, body = _get(base + "/api/control", post, "POST", json.dumps({"action": "node_down",
                                                                                "node": "w2"}).encode())
        assert status == 502 and json.loads(body)["error"] == "h2: boom", body
        # the controller's record gone (`testbed down`): the page says so
        monkeypatch.setattr(controller, "exists", lambda name: False)
        wait_for(lambda: json.loads(_get(base + "/api/sample", auth)[2])["up"] is False, timeout=5, interval=0.2,
                 what="the sample to say the testbed is down")
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)
        g.close()


# -- the CLI without a testbed ----------------------------------------------------------------------------------


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env={**os.environ, "COLUMNS": "120"})


def test_cli_no_such_testbed_and_bad_bind(state_dir):
    r = _cli("graph", "--name", "nope")
    if IS_ROOT:
        assert r.returncode == 4 and "no testbed named 'nope' is up" in r.stderr, r.stderr
    else:
        assert r.returncode == 1 and "needs root" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("graph", "--bind", "not an address")
    assert r.returncode == 2 and "--bind" in r.stderr and "Traceback" not in r.stderr


# -- kernel: a served star ---------------------------------------------------------------------------------------

STAR = ["params.n=3", "tiers.host.bandwidth=100mbit", "tiers.host.delay=0"]
FAT = ["params.k=4", "tiers.host.delay=0", "tiers.edge-agg.delay=0", "tiers.agg-core.delay=0"]


def _up(testbed, kind, overrides):
    from testbed.topology.loader import load_topology

    name = f"tg{uuid.uuid4().hex[:6]}"
    testbed(load_topology(kind, overrides), name, time_dilation="none")
    return name


def _addr(name, w):
    from testbed import store

    for lp in store.load(name)["plan"]["links"]:
        for side in ("a", "b"):
            if lp[side]["node"] == w and lp[side].get("address"):
                return lp[side]["address"].split("/")[0]
    raise AssertionError(f"no address for {w}")


class Served:
    """`testbed graph` as a process (a command prefix may put it in a namespace); its URL read from stdout."""

    def __init__(self, name: str, *args: str, prefix: tuple[str, ...] = ()):
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "testbed", "graph", "--name", name, "--port", "0",
                                      *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "COLUMNS": "200"})
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 30
        self.url = None
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise AssertionError(f"no URL printed: {self.out} {self.proc.stderr.read()}")
            m = re.search(r"(http://\S+)", line)
            if m:
                self.url = m.group(1)
        self.base = self.url.split("#")[0].split("?")[0].rstrip("/")
        self.token = self.url.split("#token=")[1] if "#token=" in self.url else None

    def _pump(self):
        for line in self.proc.stdout:
            self.out.append(line)
            self.lines.put(line)

    def json(self, path: str, **kw):
        status, _, body = _get(self.base + path, **kw)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C; (exit status, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.close()
            raise
        return self.proc.returncode, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _link(sample, name):
    return next(l for l in sample["links"] if l["name"] == name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_served_star_traffic_down_link_and_exits(testbed):
    from testbed import lifecycle
    from testbed.faults import control

    name = _up(testbed, "star", STAR)
    srv = Served(name)
    server = client = None
    try:
        assert srv.url.startswith("http://127.0.0.1:") and srv.token is None   # loopback, read-only: no token
        topo = srv.json("/api/topology")
        assert set(topo) == TOPOLOGY_FIELDS and topo["testbed"] == name and topo["control"] is False
        assert {(l["a"], l["b"]) for l in topo["links"]} == {("w0", "s0"), ("w1", "s0"), ("w2", "s0")}
        assert {n["name"]: n["layer"] for n in topo["nodes"]} == {"w0": 0, "w1": 0, "w2": 0, "s0": 1}
        assert topo["links"][0]["ab_text"] == "100mbit"
        s = srv.json("/api/sample")
        assert set(s) == SAMPLE_FIELDS and s["up"] and not s["warming"], s
        # utilisation bands, from 5 runs (2026-12-02, load 5.5-9.1 on 2 cores, printed below): a link
        # without traffic read 0.000; the 100 Mbit/s links iperf3 filled read 0.744-0.960 (0.955-0.960
        # once ramped up; 0.744 was a sample taken as it crossed 0.7, 0.82 s in); above 0.7 came
        # 0.82-1.86 s after iperf3 started (6 s allowed); a downed link and a testbed gone read so
        # in the next sample (0.00-0.01 s; 3 s allowed)
        assert _link(s, "w0->s0")["util"] < 0.1
        # traffic w0 -> w1: w0->s0 and s0->w1 fill up
        port = str(5201 + uuid.uuid4().int % 500)
        server = subprocess.Popen(["ip", "netns", "exec", f"tb-{name}-w1", "iperf3", "-s", "-1", "-p", port],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: server.poll() is not None or tcp_sockets(server.pid, int(port), "LISTEN", netns=f"tb-{name}-w1"),
                 timeout=30, what="iperf3's server on w1 to listen")
        client = subprocess.Popen(["ip", "netns", "exec", f"tb-{name}-w0", "iperf3", "-c", _addr(name, "w1"),
                                   "-p", port, "-t", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t_flow = time.monotonic()
        wait_for(lambda: (_link(srv.json("/api/sample"), "w0->s0")["util"] or 0) > 0.7, timeout=6, interval=0.2,
                 what="w0->s0 to fill up (util above 0.7)")
        filled = time.monotonic() - t_flow
        s = srv.json("/api/sample")
        print("\nutilisation: " + ", ".join(f"{k} {_link(s, k)['util']:.3f}" for k in ("w0->s0", "s0->w1", "w2->s0"))
              + f"; above 0.7 {filled:.2f} s after iperf3 started (load {os.getloadavg()[0]:.2f})")
        assert _link(s, "s0->w1")["util"] > 0.5 and _link(s, "w2->s0")["util"] < 0.1
        for p in (client, server):   # seen: the flow need not run its course
            p.kill()
            p.wait(5)
        # a downed link reads down, in the sample within 3 s and in a new topology version
        version = s["version"]
        control.link_down(name, "w2", "s0")
        t_down = time.monotonic()
        wait_for(lambda: _link(srv.json("/api/sample"), "w2->s0")["state"] == "down", timeout=3, interval=0.1,
                 what="the sample to read w2->s0 down")
        print(f"link down read {time.monotonic() - t_down:.2f} s after it was taken down")
        s = srv.json("/api/sample")
        assert _link(s, "s0->w2")["down_by"] == ["link"] and s["version"] > version
        topo = srv.json("/api/topology")
        assert topo["links"][2]["state"] == "down" and topo["version"] == s["version"]
        ev = srv.json("/api/events?since=0")["events"]
        assert [e["kind"] for e in ev][:1] == ["up"] and ev[-1]["what"] == "link down w2 s0"
        # read-only: a control POST, even well formed, is refused
        status, _, body = _get(srv.base + "/api/control", {"Content-Type": "application/json",
                                                          graph_access.CONTROL_HEADER: "1"}, "POST",
                               json.dumps({"action": "link_up", "a": "w2", "b": "s0"}).encode())
        assert status == 403 and "--allow-control" in json.loads(body)["error"]
        assert srv.json("/api/topology")["links"][2]["state"] == "down"
        # a request naming another host (DNS rebinding) is refused
        assert _get(srv.base + "/api/topology", {"Host": "evil.example"})[0] == 403
        code, err = srv.stop()
        assert code == 0 and "stopped" in err and "Traceback" not in err, err
        # the testbed going down stops the server by itself
        srv = Served(name)
        srv.json("/api/sample")
        lifecycle.down(name)
        t_gone = time.monotonic()
        wait_for(lambda: srv.json("/api/sample")["up"] is False, timeout=3, interval=0.2,
                 what="the sample to say the testbed is down")
        print(f"testbed down read {time.monotonic() - t_gone:.2f} s after down returned")
        srv.proc.wait(graph.DOWN_GRACE_S + 10)
        _, err = srv.proc.communicate(timeout=5)
        assert srv.proc.returncode == 0 and "went down" in err, err
    finally:
        for p in (client, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
        srv.close()


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_bind_elsewhere_needs_the_token(testbed):
    """Bound to a worker's address (the server runs in that worker's network namespace, so the
    address is reachable only from inside the testbed): no token 403, the token 200."""
    name = _up(testbed, "star", STAR)
    addr = _addr(name, "w0")
    r = _cli("graph", "--name", name, "--bind", addr)   # plain HTTP off loopback: said, not done
    assert r.returncode == 2 and "--plain-http" in r.stderr and "ssh -L" in r.stderr, r.stderr
    srv = Served(name, "--bind", addr, "--plain-http", prefix=("nsenter", f"--net=/run/netns/tb-{name}-w0"))
    try:
        assert srv.url.startswith(f"http://{addr}:") and srv.token and len(srv.token) >= 32
        probe = ("import sys, urllib.request, urllib.error\n"
                 "for tok in sys.argv[2:]:\n"
                 "    req = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + tok})\n"
                 "    try:\n"
                 "        print(urllib.request.urlopen(req, timeout=10).status)\n"
                 "    except urllib.error.HTTPError as e:\n"
                 "        print(e.code)\n")
        urls = [srv.base + "/api/topology", "", "wrong", srv.token]
        r = subprocess.run(["ip", "netns", "exec", f"tb-{name}-w1", sys.executable, "-c", probe, *urls],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # from w1, across the star's switch
        assert r.stdout.split() == ["403", "403", "200"], r.stdout
        code, err = srv.stop()
        assert code == 0, err
    finally:
        srv.close()


# -- a real browser ---------------------------------------------------------------------------------------------


class Chromium:
    """Debian's headless Chromium, driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    fd 3 carries commands in, fd 4 replies out, NUL-terminated JSON); no driver package needed."""

    def __init__(self, exe: str, width: int = 1280, height: int = 860):
        self.profile = tempfile.mkdtemp(prefix="tbgraph-chromium-")
        to_r, self._w = os.pipe()
        self._r, from_w = os.pipe()
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-sync", "--disable-default-apps", "--mute-audio",
                "--remote-debugging-pipe", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", 'exec "$0" "$@" 3<&"$TB_CDP_R" 4>&"$TB_CDP_W"', exe, *args],
                                     pass_fds=(to_r, from_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "TB_CDP_R": str(to_r), "TB_CDP_W": str(from_w)})
        os.close(to_r)
        os.close(from_w)
        self._id = 0
        self._buf = b""
        self.session = None
        self.errors: list[str] = []   # exceptions, console errors, log errors (CSP violations among them)
        try:
            page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _message(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = True, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._message()
            method_, p = m.get("method"), m.get("params") or {}
            if method_ == "Runtime.exceptionThrown":
                self.errors.append(str((p.get("exceptionDetails") or {}).get("exception", {}).get("description")))
            elif method_ == "Runtime.consoleAPICalled" and p.get("type") == "error":
                self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif method_ == "Log.entryAdded" and (p.get("entry") or {}).get("level") == "error":
                self.errors.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})

    def eval(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"].get("exception", {}).get("description") or r["exceptionDetails"])
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float = 10.0):
        """`expr`'s value once truthy, or its falsy value at the deadline: the callers' asserts then
        say what the page showed instead of a bare timeout."""
        def value():
            try:
                return self.eval(expr)
            except RuntimeError:   # the page is not there yet
                return None

        try:
            return wait_for(value, timeout=timeout, what=f"the page: {expr}")
        except WaitTimeout:
            return value()

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("Browser.close", session=False)
            except (OSError, RuntimeError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")
def test_browser_draws_the_fat_tree_and_follows_a_link_down(testbed, tmp_path):
    from testbed import store

    name = _up(testbed, "fat-tree", FAT)
    topo = store.load(name)["topology"]
    srv = Served(name, "--allow-control")
    browser = None
    try:
        assert srv.token                                                # control: the token is required
        browser = Chromium(CHROMIUM)
        browser.call("Page.navigate", url=srv.url)                     # #token= -> sessionStorage, dropped
        assert browser.wait("document.querySelector('#graph').dataset.samples >= '1'", 15), \
            browser.eval("document.body.innerText")
        assert browser.eval("location.href") == srv.base + "/"         # the token left the address bar
        # every node and link of the topology is an SVG element, filled from /api/topology
        nodes = browser.eval("Array.from(document.querySelectorAll('#graph g.node')).map("
                             "g => [g.dataset.node, g.dataset.kind, g.dataset.layer, g.namespaceURI])")
        assert sorted(n[0] for n in nodes) == sorted(n["name"] for n in topo["nodes"])
        assert all(ns == "http://www.w3.org/2000/svg" for *_, ns in nodes)
        kinds = {n: (k, int(layer)) for n, k, layer, _ in nodes}
        assert kinds["w0"] == ("worker", 0) and kinds["edge0-0"] == ("switch", 1) and kinds["core0"][1] == 3
        links = browser.eval("Array.from(document.querySelectorAll('#graph line.link')).map("
                             "l => [l.dataset.a, l.dataset.b, l.dataset.state, l.getAttribute('stroke')])")
        assert sorted((a, b) for a, b, *_ in links) == sorted(tuple(l["endpoints"]) for l in topo["links"])
        assert all(state == "up" and stroke.startswith("hsl(") for _, _, state, stroke in links), links[:3]
        assert browser.eval("document.querySelector('#title').textContent") == name
        # `testbed link down` shows within 3 s: 1.04-1.10 s from the command's start (its own
        # interpreter included) in 5 runs (2026-12-03, load 1.2-1.6 on 2 cores: `pytest -s -k browser`)
        sel = "#graph line.link[data-a=\"edge0-0\"][data-b=\"agg0-0\"], " \
              "#graph line.link[data-a=\"agg0-0\"][data-b=\"edge0-0\"]"
        t0 = time.monotonic()
        r = _cli("link", "down", "edge0-0", "agg0-0", "--name", name)
        assert r.returncode == 0, r.stderr
        assert browser.wait(f"document.querySelector('{sel}').dataset.state === 'down'", 3.0), \
            f"not down on the page {time.monotonic() - t0:.1f} s after `testbed link down`"
        print(f"link down on the page {time.monotonic() - t0:.2f} s after `testbed link down` began "
              f"(load {os.getloadavg()[0]:.2f})")
        assert browser.eval(f"document.querySelector('{sel}').classList.contains('down')")
        assert browser.wait("Array.from(document.querySelectorAll('#event-list li'))"
                            ".some(li => li.textContent.includes('link down edge0-0 agg0-0'))", 5.0)
        # a click on the link: its profile and counters in the details panel, and the control to bring it up
        browser.eval(f"document.querySelector('{sel}').dispatchEvent(new MouseEvent('click', {{bubbles: true}}))")
        details = browser.wait("document.querySelector('#detail-body').innerText", 3.0)
        assert "edge0-0" in details and "down (link)" in details and "edge0-0 \u2192 agg0-0" in details, details
        shot = browser.screenshot(tmp_path / "graph-fat-tree.png")
        keep = os.environ.get("TESTBED_TEST_ARTIFACTS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(keep) / shot.name)
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        browser.eval("Array.from(document.querySelectorAll('#detail-body button'))"
                     ".find(b => b.textContent === 'bring link up').click()")
        assert browser.wait(f"document.querySelector('{sel}').dataset.state === 'up'", 5.0), \
            browser.eval("document.querySelector('#detail-body').innerText")
        rec = next(l for l in store.load(name)["links"] if set(l["endpoints"]) == {"edge0-0", "agg0-0"})
        assert rec["state"] == "up"
        assert "control from 127.0.0.1: link up" in "".join(srv.out)
        # a node from a script with the token: down on the page, then up again
        auth = {"Authorization": f"Bearer {srv.token}", "Content-Type": "application/json", graph_access.CONTROL_HEADER: "1"}
        node = "#graph g.node[data-node=\"core0\"]"
        for action, state in (("node_down", "down"), ("node_up", "up")):
            status, _, body = _get(srv.base + "/api/control", auth, "POST",
                                   json.dumps({"action": action, "node": "core0"}).encode())
            assert status == 200 and json.loads(body)["ok"], body
            assert browser.wait(f"document.querySelector('{node}').dataset.state === '{state}'", 3.0), action
        status, _, body = _get(srv.base + "/api/control", auth, "POST",
                               json.dumps({"action": "node_down", "node": "nope"}).encode())
        assert status == 400 and "no node 'nope'" in json.loads(body)["error"]
        assert browser.errors == []                                     # no exception, no CSP violation
    finally:
        if browser is not None:
            browser.close()
        code, err = srv.stop()
        srv.close()
    assert code == 0, err
