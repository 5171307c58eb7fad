"""`testbed top` on a testbed over several hosts, end to end, against two emulated hosts
(testbed/cluster/emulate.py): every host runs `top --json` on its own part and the controller merges
their documents into one (testbed.cluster.top).

One testbed for the module: topologies/two-sides.yaml pinned so that h1 holds w0, w1 and s0 and h2
holds w2, w3 and s1 (s0-s1, 1 Gbit/s, is the cut link: a VXLAN tunnel). The CLI runs as a process,
as a user runs it; the controller keeps its record in a state directory of its own
(TESTBED_STATE_DIR), the hosts in their own /run. Real hosts (over SSH), real traffic (iperf3).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

import requires

from cluster_hosts import REPO, iperf3_connections, iperf3_server, remote_tops, tb
from waiting import WaitTimeout, wait_for

pytestmark = [pytest.mark.root, pytest.mark.requires("sshd")]

HOST = {"w0": "h1", "w1": "h1", "s0": "h1", "w2": "h2", "w3": "h2", "s1": "h2"}
LINKS = [("w0", "s0"), ("w1", "s0"), ("w2", "s1"), ("w3", "s1"), ("s0", "s1")]   # the topology's order


def top_once(name: str, *extra: str, check: bool = True) -> tuple[dict, subprocess.CompletedProcess]:
    r = tb("top", "--name", name, "--once", "--json", *extra, timeout=120, check=check)
    return json.loads(r.stdout), r


def agents_left(line: str, timeout: float = 10.0) -> list[str]:
    """The hosts' agents of testbed `line` still running once they had `timeout` s to end (empty: all
    ended). A host's agent can outlive the SSH session that started it by a moment: one was seen
    orphaned and still running 0.11 s after the verb returned (2026-12-07, 1 of 3 runs of the iperf3
    test below); a leaked one runs on and is reported."""
    try:
        wait_for(lambda: not remote_tops(line), timeout=timeout, interval=0.1, what="the hosts' agents to end")
    except WaitTimeout:
        pass
    return remote_tops(line)


def test_once_json_merges_every_link_direction_from_its_sending_host(emu, line):
    doc, _ = top_once(line)
    assert doc["testbed"] == line and doc["hosts"].keys() == {"h1", "h2"}
    assert all(h["state"] == "ok" and h["why"] is None and h["t"] for h in doc["hosts"].values()), doc["hosts"]
    want = [(a, b) for a, b in LINKS for a, b in ((a, b), (b, a))]
    assert [(l["from"], l["to"]) for l in doc["links"]] == want      # every direction once, in topology order
    for l in doc["links"]:
        assert (l["host"], l["to_host"]) == (HOST[l["from"]], HOST[l["to"]]), l
        assert l["state"] == "up" and l["rate_bps"] is not None, l   # each read where its sending end is
        assert l["backlog_bytes"] is not None, l                      # and its queue there (every link is shaped)
    cut = {l["name"]: l for l in doc["links"] if l["index"] == 4}
    assert set(cut) == {"s0->s1", "s1->s0"}
    assert cut["s0->s1"]["bandwidth_bps"] == cut["s1->s0"]["bandwidth_bps"] == 1e9
    assert (cut["s0->s1"]["host"], cut["s1->s0"]["host"]) == ("h1", "h2")
    assert [(w["name"], w["host"]) for w in doc["workers"]] == [("w0", "h1"), ("w1", "h1"), ("w2", "h2"),
                                                                ("w3", "h2")]
    assert all(w["state"] == "up" and w["memory_bytes"] for w in doc["workers"]), doc["workers"]
    # --tier and --sort as on one host: only the core link's two directions
    doc, _ = top_once(line, "--tier", doc["links"][-1]["tier"], "--sort", "util")
    assert {l["name"] for l in doc["links"]} == {"s0->s1", "s1->s0"}
    r = tb("top", "--name", line, "--once", "--tier", "nope", check=False)
    assert r.returncode == 2 and "--tier 'nope'" in r.stderr


def test_traffic_over_the_tunnel_shows_as_a_rate_on_the_cut_links_direction(emu, line):
    """iperf3 w0 -> w2 (h1 -> h2) for a while; meanwhile `top --once --json`: s0->s1, measured at s0 on
    h1, carries it (near its 1 Gbit/s), its reverse carries only the ACKs."""
    port = 5201 + uuid.uuid4().int % 500
    server = iperf3_server(line, "w2", port)
    client = None
    try:
        client = subprocess.Popen([sys.executable, "-m", "testbed", "exec", "w0", "--name", line, "--", "iperf3",
                                   "-c", "w2", "-p", str(port), "-t", "20", "-J"], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        # the flow is going once iperf3's control and data connections are both up at the server
        wait_for(lambda: client.poll() is not None or iperf3_connections(port) >= 2,
                 timeout=60, what="iperf3's control and data connections from w0 to w2")
        assert client.poll() is None, client.communicate()
        doc, _ = top_once(line, "--interval", "1")
        out, err = client.communicate(timeout=90)
    finally:
        for p in (client, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        server.wait(90)
    got = json.loads(out or "{}")
    assert "sum_received" in got.get("end", {}), (out[-400:], err)
    l = {x["name"]: x for x in doc["links"]}
    s01, s10 = l["s0->s1"], l["s1->s0"]
    goodput = got["end"]["sum_received"]["bits_per_second"]
    print(f"top's s0->s1: {s01['rate_bps'] / 1e6:.0f} Mbit/s over its second; iperf3's goodput "
          f"{goodput / 1e6:.0f} Mbit/s over 20 s; ratio {s01['rate_bps'] / goodput:.3f}")
    assert s01["host"] == "h1" and s01["rate_bps"] > 100e6, s01
    # top's one second of the flow against iperf3's 20 s average: 1.004-1.016 in 5 runs (2026-12-02,
    # the 2-core machine, other sessions' tests beside; `pytest -s -k traffic` prints it), so 5% is
    # 3x the widest seen; a rate read from the wrong direction or host would be the ACKs' (was 30%)
    assert s01["rate_bps"] == pytest.approx(goodput, rel=0.05), (s01, goodput)
    assert s01["util"] == pytest.approx(s01["rate_bps"] / 1e9)
    assert s10["host"] == "h2" and s10["rate_bps"] < s01["rate_bps"] / 5, s10   # the ACKs
    # the same flow on the links inside each host: into s0 on h1, out of s1 to w2 on h2
    assert l["w0->s0"]["rate_bps"] > 100e6 and l["s1->w2"]["rate_bps"] > 100e6
    assert l["w1->s0"]["rate_bps"] < 10e6 and l["s1->w3"]["rate_bps"] < 10e6
    assert not agents_left(line)


def test_live_view_shows_both_hosts_and_ctrl_c_stops_every_hosts_top(emu, line):
    requires.need("pexpect")
    import pexpect
    child = pexpect.spawn(sys.executable, ["-m", "testbed", "top", "--name", line, "--interval", "0.5"],
                          cwd=str(REPO), env={**os.environ, "COLUMNS": "140", "LINES": "40", "TERM": "xterm"},
                          dimensions=(40, 140), timeout=60, encoding="utf-8")
    try:
        child.expect("over 2 hosts")
        child.expect("h1>h2")                   # the cut link's direction s0->s1, measured on h1
        child.expect("Ctrl-C quits")
        assert len(remote_tops(line)) == 2      # one top on each host
        child.kill(signal.SIGINT)
        child.expect(pexpect.EOF, timeout=40)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus, child.before)
    assert "Traceback" not in (child.before or "")
    assert not agents_left(line)                # the hosts' tops stopped with it


def test_an_unreachable_host_is_shown_failed_with_the_others_numbers(emu, line):
    emu.stop_sshd("h2")
    try:
        doc, r = top_once(line, check=False)
    finally:
        emu.start_sshd("h2")
    assert r.returncode == 1, r.stderr
    assert "h2:" in r.stderr and "cannot reach host h2" in r.stderr, r.stderr
    assert doc["hosts"]["h1"]["state"] == "ok"
    assert doc["hosts"]["h2"]["state"] == "failed" and "cannot reach host h2" in doc["hosts"]["h2"]["why"]
    l = {x["name"]: x for x in doc["links"]}
    assert len(l) == 2 * len(LINKS)
    assert l["w0->s0"]["rate_bps"] is not None and l["s0->s1"]["rate_bps"] is not None    # h1's own
    assert l["s1->s0"]["rate_bps"] is not None and l["s1->s0"]["backlog_bytes"] is None   # s0's rx, on h1
    assert l["w2->s1"]["rate_bps"] is None                                                # inside h2: unknown
    assert {w["name"]: w["cpu"] for w in doc["workers"]}["w2"] is None
    assert not agents_left(line)
