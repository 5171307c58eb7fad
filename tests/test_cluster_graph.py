"""`testbed graph` on a testbed over several hosts, end to end, against two emulated hosts
(testbed/cluster/emulate.py): the controller serves the page, its documents from the hosts
(testbed.cluster.graph: every host's `top --json` merged, their link records and events).

One testbed: topologies/two-sides.yaml pinned so that h1 holds w0, w1 and s0 and h2 holds w2, w3
and s1 (s0-s1, 1 Gbit/s, is the cut link: a VXLAN tunnel). `testbed graph` runs as a process, as a
user runs it (with --allow-control: the token then comes with the URL); the controller keeps its
record in a state directory of its own (TESTBED_STATE_DIR), the hosts in their own /run. Real hosts
(over SSH), real traffic (iperf3), a real browser (Debian's chromium, when installed).

Checked: every node with its host (/api/topology, and on the page in headless Chromium), both hosts
ok and no trouble, iperf3 w0 -> w2 showing as utilisation of s0->s1 (measured on h1), `testbed link
down s0 s1` showing down (sample and topology) with the hosts' events, the page's control bringing
it up on every host, a switch down and up from the page, a DDP run over both hosts in the run's
step chart, a host that cannot be reached named with why in the sample's "trouble" (the
page's banner) while the page goes on, Ctrl-C ending the server with no `top` left on the hosts, and
(last) `testbed down` ending a server by itself.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from cluster_hosts import REPO, host_state, iperf3_server, remote_tops, tb
from testbed.observe import graph, graph_access

from test_graph import CHROMIUM, Chromium, Served, _get
from waiting import WaitTimeout, wait_for

pytestmark = [pytest.mark.root, pytest.mark.requires("sshd")]


def _until(fn, timeout: float, step: float = 0.2):
    """The condition's value once truthy, or its falsy value at the deadline: the callers' asserts
    then print what the page said instead of a bare timeout."""
    try:
        return wait_for(fn, timeout=timeout, interval=step, what="the page's condition")
    except WaitTimeout:
        return fn()
HOST = {"w0": "h1", "w1": "h1", "s0": "h1", "w2": "h2", "w3": "h2", "s1": "h2"}


def link_record(emu, host: str, name: str, a: str, b: str) -> dict:
    st = host_state(emu, host, name)
    return next(rec for rec in st["links"] if set(rec["endpoints"]) == {a, b})


@pytest.fixture(scope="module")
def served(line):
    """`testbed graph --allow-control` of the testbed, for the module's tests in their order (the last
    one stops it with a Ctrl-C)."""
    srv = Served(line, "--allow-control", "--interval", "0.5")
    srv.auth = {"Authorization": f"Bearer {srv.token}"}
    try:
        yield srv
    finally:
        srv.close()


def get(srv, path: str) -> dict:
    status, _, body = _get(srv.base + path, srv.auth)
    assert status == 200, (path, status, body)
    return json.loads(body)


def cut(sample: dict, direction: str = "s0->s1") -> dict:
    return next(l for l in sample["links"] if l["name"] == direction)


def test_every_node_with_its_host_and_both_hosts_sampled(served, line):
    assert served.token and _until(lambda: "control on" in "".join(served.out), 5.0), served.out
    topo = get(served, "/api/topology")
    assert topo["testbed"] == line and topo["hosts"] == ["h1", "h2"] and topo["control"] is True
    assert {n["name"]: n["host"] for n in topo["nodes"]} == HOST
    s0s1 = next(l for l in topo["links"] if {l["a"], l["b"]} == {"s0", "s1"})
    assert s0s1["hosts"] == ["h1", "h2"] and s0s1["state"] == "up" and s0s1["ab_text"] == "1gbit"
    both = _until(lambda: {h: st["state"] for h, st in (get(served, "/api/sample").get("hosts") or {}).items()}
                  == {"h1": "ok", "h2": "ok"}, 30.0)
    s = get(served, "/api/sample")
    assert both and not s["warming"], (s.get("hosts"), s["trouble"], s["error"])
    assert s["trouble"] == [] and s["error"] is None
    assert {w["name"]: w["host"] for w in s["workers"]} == {w: HOST[w] for w in ("w0", "w1", "w2", "w3")}
    assert (cut(s)["host"], cut(s)["to_host"]) == ("h1", "h2")
    assert len(remote_tops(line)) == 2                                 # one top on each host, while watched
    ev = get(served, "/api/events?since=0")["events"]
    assert {e["host"] for e in ev if e["kind"] == "up"} == {"h1", "h2"}, ev


@pytest.mark.requires("chromium")
def test_the_page_in_a_browser_shows_each_nodes_host(served):
    browser = Chromium(CHROMIUM)
    try:
        browser.call("Page.navigate", url=served.url)                 # ?token= -> cookie, redirected to /
        assert browser.wait("document.querySelector('#graph').dataset.samples >= '1'", 20), \
            browser.eval("document.body.innerText")
        drawn = browser.eval("Array.from(document.querySelectorAll('#graph g.node')).map("
                             "g => [g.dataset.node, g.dataset.host, g.querySelector('title').textContent])")
        assert {n: h for n, h, _ in drawn} == HOST
        assert all(title == f"{n} (on {h})" for n, h, title in drawn), drawn
        assert "over 2 hosts (h1, h2)" in browser.eval("document.querySelector('#info').textContent")
        browser.eval("document.querySelector('#graph g.node[data-node=\"w2\"]')"
                     ".dispatchEvent(new MouseEvent('click', {bubbles: true}))")
        details = browser.wait("document.querySelector('#detail-body').innerText", 3.0)
        assert "host" in details and "h2" in details, details
        assert browser.eval("document.querySelector('#banner').hidden") is True
        assert browser.errors == []                                     # no exception, no CSP violation
    finally:
        browser.close()


def test_traffic_across_the_cut_link_shows_as_its_utilisation(served, line):
    """iperf3 w0 -> w2: s0->s1 (measured at s0, on h1) busy, its reverse carries only the ACKs."""
    port = 5201 + uuid.uuid4().int % 500
    server = iperf3_server(line, "w2", port)   # returned once it listens
    client = None
    try:
        client = subprocess.Popen([sys.executable, "-m", "testbed", "exec", "w0", "--name", line, "--", "iperf3",
                                   "-c", "w2", "-p", str(port), "-t", "12"], cwd=REPO, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        busy = _until(lambda: (cut(get(served, "/api/sample"))["util"] or 0) > 0.3, 20.0, 0.5)
        s = get(served, "/api/sample")
        assert busy, cut(s)
        assert cut(s)["host"] == "h1" and cut(s)["rate_bps"] > 300e6, cut(s)
        assert (cut(s, "s1->s0")["util"] or 0) < cut(s)["util"] / 5, cut(s, "s1->s0")
    finally:
        for p in (client, server):   # seen: the flow need not run its course (a Ctrl-C reaches iperf3 there)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in (client, server):
            if p is not None:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def test_link_down_shows_and_the_pages_control_brings_it_up_on_every_host(served, emu, line):
    version = get(served, "/api/sample")["version"]
    tb("link", "down", "s0", "s1", "--name", line)
    try:
        assert _until(lambda: cut(get(served, "/api/sample"))["state"] == "down", 5.0, 0.2), \
            cut(get(served, "/api/sample"))
        # h2's own reading of its direction: it may come an interval after h1's (each host streams its own)
        assert _until(lambda: cut(get(served, "/api/sample"), "s1->s0")["down_by"] == ["link"], 5.0, 0.2), \
            cut(get(served, "/api/sample"), "s1->s0")
        assert _until(lambda: get(served, "/api/sample")["version"] > version, 10.0)
        link = next(l for l in get(served, "/api/topology")["links"] if {l["a"], l["b"]} == {"s0", "s1"})
        assert (link["state"], link["down_by"]) == ("down", ["link"])
        assert _until(lambda: {e["host"] for e in get(served, "/api/events?since=0")["events"]
                               if e["what"] == "link down s0 s1"} == {"h1", "h2"}, 10.0)
        status, _, body = _get(served.base + "/api/control", {**served.auth, "Content-Type": "application/json",
                                                             graph_access.CONTROL_HEADER: "1"}, "POST",
                               json.dumps({"action": "link_up", "a": "s0", "b": "s1"}).encode())
        assert status == 200 and json.loads(body)["ok"], body
        assert [link_record(emu, h, line, "s0", "s1")["state"] for h in ("h1", "h2")] == ["up", "up"]
        assert _until(lambda: cut(get(served, "/api/sample"))["state"] == "up", 5.0, 0.2)
        assert "control from 127.0.0.1: link up s0 s1" in "".join(served.out)
    finally:
        if any(link_record(emu, h, line, "s0", "s1")["state"] != "up" for h in ("h1", "h2")):
            tb("link", "up", "s0", "s1", "--name", line, check=False)


def test_node_down_and_up_from_the_page_on_every_host(served, line):
    """s1 (on h2) down from the page: every host's links to it down, the page shows the node down."""
    post = {**served.auth, "Content-Type": "application/json", graph_access.CONTROL_HEADER: "1"}

    def act(action: str) -> None:
        status, _, body = _get(served.base + "/api/control", post, "POST",
                               json.dumps({"action": action, "node": "s1"}).encode())
        assert status == 200 and json.loads(body)["ok"], body

    act("node_down")
    try:
        assert _until(lambda: get(served, "/api/sample")["nodes"].get("s1") == "down", 10.0, 0.3), \
            get(served, "/api/sample")["nodes"]
        s = get(served, "/api/sample")
        assert cut(s)["state"] == "down" and "node:s1" in cut(s)["down_by"] and s["nodes"]["s0"] == "up"
        assert {n["name"]: n["state"] for n in get(served, "/api/topology")["nodes"]}["s1"] == "down"
    finally:
        act("node_up")
    assert _until(lambda: get(served, "/api/sample")["nodes"].get("s1") == "up", 10.0, 0.3)
    assert cut(get(served, "/api/sample"))["state"] == "up"
    assert tb("exec", "w0", "--name", line, "--", "ping", "-c", "1", "-W", "2", "w2", check=False).returncode == 0


def test_a_run_over_both_hosts_shows_its_step_times(served, line):
    """`testbed run` of a small DDP job, two ranks on each host: the page's run and step chart
    (every host's top reads its own ranks' probe files; HostsTop adds them up)."""
    run = subprocess.Popen([sys.executable, "-m", "testbed", "run", "--name", line, "--", "python",
                            "examples/train_ddp.py", "--steps", "100000", "--model", "mlp", "--hidden", "64"],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stepping = _until(lambda: len(get(served, "/api/sample")["steps"]) >= 3, 90.0, 0.5)
        s = get(served, "/api/sample")
        assert stepping, (s["run"], s["steps"], run.poll())
        assert s["run"]["hosts"] == ["h1", "h2"] and s["run"]["ranks"] == 4, s["run"]
        steps = [p["step"] for p in s["steps"]]
        assert steps == sorted(steps) and all(p["step_s"] > 0 for p in s["steps"]), s["steps"]
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)                              # stops the ranks on every host
        try:
            run.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate(timeout=30)
        for d in (REPO / "runs").glob(f"*-{line}*"):                    # (./runs: where `testbed run` keeps them)
            shutil.rmtree(d, ignore_errors=True)
    assert run.returncode in (0, 130), run.returncode


def test_a_host_that_cannot_be_reached_is_named_with_why_and_the_page_goes_on(served, emu):
    emu.stop_sshd("h2")   # (its top, already connected, goes on; asking it anything new fails)
    try:
        named = _until(lambda: any(t.startswith("h2: ") and "cannot reach host h2" in t
                                   for t in get(served, "/api/sample")["trouble"]), 20.0, 0.5)
        s = get(served, "/api/sample")
        assert named, s["trouble"]
        assert not any(t.startswith("h1: ") for t in s["trouble"]), s["trouble"]
        assert s["up"] and s["error"] is None and len(s["links"]) == 10
        assert {n["name"] for n in get(served, "/api/topology")["nodes"]} == set(HOST)
    finally:
        emu.start_sshd("h2")
    assert _until(lambda: get(served, "/api/sample")["trouble"] == [], 20.0, 0.5), get(served, "/api/sample")["trouble"]


def test_ctrl_c_ends_the_server_and_every_hosts_top(served, line):
    assert not get(served, "/api/sample")["warming"] and len(remote_tops(line)) == 2
    served.proc.send_signal(signal.SIGINT)                            # what Ctrl-C on its terminal does
    served.proc.wait(60)
    err = served.proc.stderr.read()
    assert served.proc.returncode == 0 and "stopped" in err and "Traceback" not in err, err
    assert _until(lambda: not remote_tops(line), 10.0), remote_tops(line)


def test_the_testbed_going_down_stops_the_server(line):
    """`testbed down` (on every host, the controller's record gone): the page says so, the server stops."""
    srv = Served(line)
    try:
        assert srv.token is None                                      # loopback, read-only: no token
        assert _until(lambda: not srv.json("/api/sample")["warming"], 30.0)
        tb("down", line)
        assert _until(lambda: srv.json("/api/sample")["up"] is False, 5.0)
        srv.proc.wait(graph.DOWN_GRACE_S + 30)
        err = srv.proc.stderr.read()
        assert srv.proc.returncode == 0 and "went down" in err and "Traceback" not in err, err
        assert _until(lambda: not remote_tops(line), 10.0), remote_tops(line)
    finally:
        srv.close()
