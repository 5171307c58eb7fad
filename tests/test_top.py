"""`testbed top` (testbed.observe.top, testbed.cli.top).

Pure tests: rates, utilisation, queue and CPU from two made-up readings (wrapped and restarted
counters, interfaces that cannot be read), sorting and tiers, the model read from a state, the
active run found from its probe files, the JSON fields against the module's documentation.

Kernel tests (root): a star shaped at 100 Mbit/s with iperf3 flows between its workers;
`top --once --json` reads the rates iperf3 sees (within 10%), utilisation near 100% and a queue
on the bottleneck, the same under time dilation 2 in emulated units, a downed link as down,
a busy worker's CPU; the live view exits cleanly on Ctrl-C.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import requires
from waiting import in_netns, tcp_sockets, wait_for

from testbed.observe import run_watch, top
from testbed.observe.top import Direction, Model, Worker, compute, counter_delta, select

IS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]

LINK_FIELDS = {"index", "name", "from", "to", "tier", "ifname", "state", "down_by", "bandwidth_bps", "rate_bps",
               "wire_rate_bps", "packets_per_s", "util", "backlog_bytes", "backlog_packets", "drops", "overlimits"}
WORKER_FIELDS = {"name", "state", "cpu", "memory_bytes"}
DOC_FIELDS = {"testbed", "t", "interval_s", "read_s", "time", "dilation", "links", "workers", "run"}
RUN_FIELDS = {"run_id", "dir", "status", "world_size", "ranks", "ranks_ended", "step", "step_min", "last_step_s",
              "last_step_max_s", "last_step_age_s"}


# -- pure: counters, rates, utilisation ----------------------------------------------------------------------


def test_counter_delta_growth_wrap_and_restart():
    assert counter_delta(100, 250) == 150
    assert counter_delta(5, 5) == 0
    assert counter_delta(2**32 - 10, 5, bits=32) == 15               # a u32 qdisc counter wrapped
    assert counter_delta(2**64 - 1000, 24, bits=64) == 1024
    assert counter_delta(1_000_000, 10, bits=32) is None             # restarted (qdisc replaced), not a wrap
    assert counter_delta(5000, 10) is None                           # a 64-bit counter never wraps back
    assert counter_delta(None, 10) is None and counter_delta(10, None) is None


def _model(dilation=1.0, bw_ab=100e6, bw_ba=None, state="up"):
    dirs = (Direction(0, "w0", "s0", "host", "eth0", "eth0", bw_ab, state, ("link",) if state == "down" else ()),
            Direction(0, "s0", "w0", "host", "eth0", "eth0", bw_ba, state, ("link",) if state == "down" else ()))
    return Model(name="tb", created="x", dilation=dilation, netns_of={"w0": "tb-tb-w0", "s0": "tb-tb-s0"},
                 directions=dirs, workers=(Worker("w0", "up", (("/nope",),)),), tiers=("host",))


def _reading(t, w0_tx=0, w0_rx=0, s0_tx=0, s0_rx=0, q=None, usage=None, nodes=("w0", "s0")):
    ifs = {}
    if "w0" in nodes:
        ifs["w0"] = {"t": t, "ifs": {"eth0": {"tx_bytes": w0_tx, "tx_packets": w0_tx // 1000,
                                              "rx_bytes": w0_rx, "rx_packets": w0_rx // 1000}}}
    if "s0" in nodes:
        ifs["s0"] = {"t": t, "ifs": {"eth0": {"tx_bytes": s0_tx, "tx_packets": s0_tx // 1000,
                                              "rx_bytes": s0_rx, "rx_packets": s0_rx // 1000}}}
    return {"t": 1000.0 + t, "read_s": 0.01, "ifs": ifs, "qdiscs": {"w0": {"eth0": q}} if q else {},
            "cpu": {"w0": {"t": t, "usage_s": usage}}, "memory": {"w0": 123}}


def test_rate_and_utilisation_from_two_readings():
    q0 = {"backlog": 0, "qlen": 0, "drops": 10, "overlimits": 2**32 - 5}
    q1 = {"backlog": 30_000, "qlen": 20, "drops": 25, "overlimits": 95}
    prev = _reading(10.0, w0_tx=1_000_000, s0_rx=1_000_000, s0_tx=0, q=q0, usage=3.0)
    cur = _reading(12.0, w0_tx=26_000_000, s0_rx=26_000_000, s0_tx=500_000, q=q1, usage=4.5)
    doc = compute(_model(), prev, cur)
    ab, ba = doc["links"]
    assert ab["name"] == "w0->s0" and ba["name"] == "s0->w0"
    assert ab["wire_rate_bps"] == pytest.approx(100e6) and ab["rate_bps"] == pytest.approx(100e6)
    assert ab["util"] == pytest.approx(1.0)
    assert ab["packets_per_s"] == pytest.approx(12_500)
    assert (ab["backlog_bytes"], ab["backlog_packets"], ab["drops"], ab["overlimits"]) == (30_000, 20, 15, 100)
    assert ba["rate_bps"] == pytest.approx(2e6) and ba["util"] is None      # unshaped: no utilisation
    assert ba["backlog_bytes"] is None and ba["drops"] is None              # no qdisc read at s0
    assert doc["workers"] == [{"name": "w0", "state": "up", "cpu": pytest.approx(0.75), "memory_bytes": 123}]
    assert doc["time"] == "real" and doc["dilation"] == 1.0 and doc["interval_s"] == pytest.approx(2.0)


def test_dilation_reports_emulated_rates():
    """Under s = 4 the kernel runs a 100 Mbit/s link at 25: 25 Mbit/s on the wire is 100% of it."""
    prev = _reading(0.0, w0_tx=0)
    cur = _reading(1.0, w0_tx=25_000_000 // 8)
    ab = compute(_model(dilation=4.0), prev, cur)["links"][0]
    assert ab["wire_rate_bps"] == pytest.approx(25e6)
    assert ab["rate_bps"] == pytest.approx(100e6) and ab["util"] == pytest.approx(1.0)
    doc = compute(_model(dilation=4.0), prev, cur)
    assert doc["time"] == "emulated" and doc["dilation"] == 4.0


def test_missing_interfaces_fall_back_or_say_unknown():
    # w0 cannot be read (its namespace went away): w0->s0 from s0's rx, s0->w0 from s0's tx
    prev, cur = _reading(0.0, s0_rx=0, s0_tx=0, nodes=("s0",)), _reading(1.0, s0_rx=1_250_000, s0_tx=125_000,
                                                                          nodes=("s0",))
    ab, ba = compute(_model(), prev, cur)["links"]
    assert ab["rate_bps"] == pytest.approx(10e6) and ab["util"] == pytest.approx(0.1)
    assert ba["rate_bps"] == pytest.approx(1e6)
    # neither end readable in one of the readings: unknown, not zero
    prev, cur = _reading(0.0, nodes=()), _reading(1.0, w0_tx=10**6)
    for l in compute(_model(), prev, cur)["links"]:
        assert l["rate_bps"] is None and l["wire_rate_bps"] is None and l["util"] is None
    # an interface missing from a node's dump (renamed, not made yet)
    cur = _reading(1.0, w0_tx=10**6)
    del cur["ifs"]["w0"]["ifs"]["eth0"]
    assert compute(_model(), _reading(0.0), cur)["links"][0]["rate_bps"] == 0.0   # s0's rx: nothing arrived


def test_restarted_counters_are_unknown_not_negative():
    q0 = {"backlog": 0, "qlen": 0, "drops": 500_000, "overlimits": 7}
    q1 = {"backlog": 0, "qlen": 0, "drops": 3, "overlimits": 1}     # `link set` replaced the qdisc
    prev = _reading(0.0, w0_tx=10**9, s0_rx=10**9, q=q0, usage=9.0)
    cur = _reading(1.0, w0_tx=10, s0_rx=10**9 + 1_250_000, q=q1, usage=0.5)   # w0's port made anew; a restarted cgroup
    doc = compute(_model(), prev, cur)
    ab = doc["links"][0]
    assert ab["rate_bps"] == pytest.approx(10e6)        # w0's tx restarted: s0's rx says it
    assert ab["drops"] is None and ab["overlimits"] is None
    assert doc["workers"][0]["cpu"] is None
    doc = compute(_model(), _reading(0.0), _reading(1.0))   # no cgroup
    assert doc["workers"][0]["cpu"] is None


def test_select_sorts_and_filters():
    links = [
        {"name": "a", "tier": "host", "util": 0.2, "rate_bps": 2, "drops": 0, "overlimits": 0, "backlog_bytes": 0,
         "backlog_packets": 0},
        {"name": "b", "tier": "core", "util": 0.9, "rate_bps": 9, "drops": 5, "overlimits": 1, "backlog_bytes": 10,
         "backlog_packets": 1},
        {"name": "c", "tier": "host", "util": None, "rate_bps": 50, "drops": None, "overlimits": None,
         "backlog_bytes": None, "backlog_packets": None},
        {"name": "d", "tier": "host", "util": 0.5, "rate_bps": 5, "drops": 7, "overlimits": 0,
         "backlog_bytes": 99, "backlog_packets": 3},
    ]
    assert [l["name"] for l in select(links, "util")] == ["b", "d", "a", "c"]
    assert [l["name"] for l in select(links, "drops")] == ["d", "b", "a", "c"]
    assert [l["name"] for l in select(links, "queue")] == ["d", "b", "a", "c"]
    assert [l["name"] for l in select(links, "util", "host")] == ["d", "a", "c"]
    with pytest.raises(ValueError, match="util, drops, queue"):
        select(links, "rate")


def test_model_of_state():
    st = {
        "name": "tb", "created": "now", "time_dilation": {"factor": 3.0},
        "topology": {"nodes": [{"name": "w0", "kind": "worker"}, {"name": "w1", "kind": "worker"},
                               {"name": "s0", "kind": "switch"}],
                     "links": [{"endpoints": ["w0", "s0"], "tier": "host", "ab": {"bandwidth_bps": 1e9},
                                "ba": {"bandwidth_bps": 1e9}},
                               {"endpoints": ["w1", "s0"], "tier": "host", "ab": {"bandwidth_bps": 1e9},
                                "ba": {"bandwidth_bps": None}}]},
        "links": [{"index": 0, "endpoints": ["w0", "s0"], "tier": "host", "ifnames": ["eth0", "eth0"],
                   "state": "down", "down_by": ["link"],
                   "profile": {"ab": {"bandwidth_bps": 5e8}, "ba": {"bandwidth_bps": 2e8}}},
                  {"index": 1, "endpoints": ["w1", "s0"], "tier": "host", "ifnames": ["eth0", "eth1"]}],
        "runtime": {"workers": {"w0": {"netns": "tb-tb-w0", "cgroups": ["/sys/fs/cgroup/cpu/testbed/tb/w0"]},
                                "w1": {"netns": "tb-tb-w1"}}},
        "faults": {"nodes": {"w1": {"state": "crashed",
                                    "cgroup": ["/sys/fs/cgroup/cpu/testbed/tb.faults/w1"]}}},
    }
    m = top.model_of(st)
    assert m.dilation == 3.0 and m.tiers == ("host",)
    d = {(x.src, x.dst): x for x in m.directions}
    assert [(x.src, x.dst) for x in m.directions] == [("w0", "s0"), ("s0", "w0"), ("w1", "s0"), ("s0", "w1")]
    assert d["w0", "s0"].bandwidth_bps == 5e8 and d["s0", "w0"].bandwidth_bps == 2e8   # `link set`'s profile
    assert d["w0", "s0"].state == "down" and d["w0", "s0"].down_by == ("link",)
    assert d["s0", "w1"].src_if == "eth1" and d["s0", "w1"].bandwidth_bps is None and d["w1", "s0"].state == "up"
    w = {x.name: x for x in m.workers}
    assert w["w0"].cgroups == (("/sys/fs/cgroup/cpu/testbed/tb/w0",),) and w["w0"].state == "up"
    assert w["w1"].cgroups == (("/sys/fs/cgroup/cpu/testbed/tb.faults/w1",),) and w["w1"].state == "crashed"
    assert m.netns_of == {"w0": "tb-tb-w0", "w1": "tb-tb-w1", "s0": "tb-tb-s0"}


def test_json_fields_are_the_documented_ones():
    doc = compute(_model(), _reading(0.0), _reading(1.0))
    assert set(doc) == DOC_FIELDS
    assert set(doc["links"][0]) == LINK_FIELDS and set(doc["workers"][0]) == WORKER_FIELDS
    # the docstring's field list, entry by entry (not any word of the prose): top level, then the
    # fields of each list or object, each exactly the set the document has
    fields = _documented_fields(top.__doc__)
    assert fields == {"": DOC_FIELDS, "links": LINK_FIELDS, "workers": WORKER_FIELDS, "run": RUN_FIELDS}
    json.dumps(doc)


def _documented_fields(doc: str) -> dict[str, set[str]]:
    """The field list of a module docstring: entries at indent 2 (the document's own fields) and
    indent 4 (the fields of the entry above them), "a, b" naming two fields; description lines
    are indented deeper. -> {"": top-level names, parent: its names}."""
    out: dict[str, set[str]] = {}
    parent = ""
    for line in doc.splitlines():
        m = re.match(r"^( {2}| {4})([a-z_][a-z_0-9.\[\]]*(?:, [a-z_][a-z_0-9]*)*)(?: {2,}|$)", line)
        if not m:
            continue
        names = m.group(2).split(", ")
        if len(m.group(1)) == 2:
            parent = names[0]
            out.setdefault("", set()).update(names)
        else:
            out.setdefault(parent, set()).update(names)
    return {k: v for k, v in out.items() if v}


# -- pure: a testbed over several hosts (testbed.cluster.top) --------------------------------------------------

# w0 - s0 ==cut== s1 - w2: h1 holds w0 and s0, h2 holds s1 and w2; link 1 (s0-s1) is a VXLAN tunnel
CUT_TOPO = {"nodes": [{"name": "w0", "kind": "worker"}, {"name": "s0", "kind": "switch"},
                      {"name": "s1", "kind": "switch"}, {"name": "w2", "kind": "worker"}],
            "links": [{"endpoints": ["w0", "s0"], "tier": "host", "ab": {"bandwidth_bps": 10e9},
                       "ba": {"bandwidth_bps": 10e9}},
                      {"endpoints": ["s0", "s1"], "tier": "core", "ab": {"bandwidth_bps": 1e9},
                       "ba": {"bandwidth_bps": 1e9}},
                      {"endpoints": ["s1", "w2"], "tier": "host", "ab": {"bandwidth_bps": 10e9},
                       "ba": {"bandwidth_bps": 10e9}}]}
CUT_PLACEMENT = {"w0": "h1", "s0": "h1", "s1": "h2", "w2": "h2"}
CUT_IFS = {("w0", 0): "eth0", ("s0", 0): "eth0", ("s0", 1): "eth1", ("s1", 1): "eth0", ("s1", 2): "eth1",
           ("w2", 2): "eth0"}


def _cut_model():
    dirs = []
    for i, link in enumerate(CUT_TOPO["links"]):
        a, b = link["endpoints"]
        dirs += [Direction(i, a, b, link["tier"], CUT_IFS[a, i], CUT_IFS[b, i], link["ab"]["bandwidth_bps"], "up", ()),
                 Direction(i, b, a, link["tier"], CUT_IFS[b, i], CUT_IFS[a, i], link["ba"]["bandwidth_bps"], "up", ())]
    return Model(name="tb", created="x", dilation=1.0, netns_of={}, directions=tuple(dirs),
                 workers=(Worker("w0", "up", ()), Worker("w2", "up", ())), tiers=("host", "core"))


def _host_reading(t, counters, host, q=None, usage=None):
    """A reading on one host: only the namespaces of its own nodes can be read there."""
    ifs = {}
    for (node, ifn), (tx, rx) in counters.items():
        if CUT_PLACEMENT[node] == host:
            ifs.setdefault(node, {"t": t, "ifs": {}})["ifs"][ifn] = {
                "tx_bytes": tx, "tx_packets": tx // 1000, "rx_bytes": rx, "rx_packets": rx // 1000}
    mine = [w for w in ("w0", "w2") if CUT_PLACEMENT[w] == host]
    return {"t": 1000.0 + t, "read_s": 0.02 if host == "h1" else 0.05, "ifs": ifs,
            "qdiscs": {n: qs for n, qs in (q or {}).items() if CUT_PLACEMENT[n] == host},
            "cpu": {w: {"t": t, "usage_s": usage} for w in mine}, "memory": {w: 7 for w in mine}}


def _two_host_docs():
    """Each host's own `top` document of the cut testbed, as compute() makes it there. Traffic
    w0 -> w2 at 800 Mbit/s over the tunnel (s1 receives a little less: 760), 8 Mbit/s back."""
    before = {("w0", "eth0"): (0, 0), ("s0", "eth0"): (0, 0), ("s0", "eth1"): (0, 0), ("s1", "eth0"): (0, 0),
              ("s1", "eth1"): (0, 0), ("w2", "eth0"): (0, 0)}
    after = {("w0", "eth0"): (100_000_000, 1_000_000), ("s0", "eth0"): (1_000_000, 100_000_000),
             ("s0", "eth1"): (100_000_000, 950_000), ("s1", "eth0"): (1_000_000, 95_000_000),
             ("s1", "eth1"): (95_000_000, 1_000_000), ("w2", "eth0"): (1_000_000, 95_000_000)}
    q0 = {"s0": {"eth1": {"backlog": 0, "qlen": 0, "drops": 0, "overlimits": 0}},
          "s1": {"eth0": {"backlog": 0, "qlen": 0, "drops": 0, "overlimits": 0}}}
    q1 = {"s0": {"eth1": {"backlog": 60_000, "qlen": 40, "drops": 3, "overlimits": 500}},
          "s1": {"eth0": {"backlog": 0, "qlen": 0, "drops": 0, "overlimits": 0}}}
    docs = {}
    for h in ("h1", "h2"):
        docs[h] = compute(_cut_model(), _host_reading(0.0, before, h, q0, 1.0), _host_reading(1.0, after, h, q1, 1.5))
    return docs


def test_merge_takes_each_direction_of_a_cut_link_from_its_sending_host():
    from testbed.cluster.top import merge

    docs = _two_host_docs()
    # each host alone sees the tunnel's far direction only by its receiving port (rx), with no queue
    h2_view = {l["name"]: l for l in docs["h2"]["links"]}["s0->s1"]
    assert h2_view["rate_bps"] == pytest.approx(760e6) and h2_view["backlog_bytes"] is None
    doc = merge("tb", docs, CUT_PLACEMENT, CUT_TOPO)
    names = [l["name"] for l in doc["links"]]
    assert names == ["w0->s0", "s0->w0", "s0->s1", "s1->s0", "s1->w2", "w2->s1"]   # each once, topology order
    l = {x["name"]: x for x in doc["links"]}
    # s0->s1 measured where it is shaped, at s0 on h1: s0's tx (800), not s1's rx on h2 (760), with h1's queue
    assert (l["s0->s1"]["host"], l["s0->s1"]["to_host"]) == ("h1", "h2")
    assert l["s0->s1"]["rate_bps"] == pytest.approx(800e6) and l["s0->s1"]["util"] == pytest.approx(0.8)
    assert (l["s0->s1"]["backlog_bytes"], l["s0->s1"]["drops"], l["s0->s1"]["overlimits"]) == (60_000, 3, 500)
    # s1->s0 at s1 on h2: s1's tx (8 Mbit/s), h2's (empty) queue
    assert (l["s1->s0"]["host"], l["s1->s0"]["to_host"]) == ("h2", "h1")
    assert l["s1->s0"]["rate_bps"] == pytest.approx(8e6) and l["s1->s0"]["backlog_bytes"] == 0
    # links inside one host: from that host (the other has no counters for them)
    assert l["w0->s0"]["host"] == l["w0->s0"]["to_host"] == "h1" and l["w0->s0"]["rate_bps"] == pytest.approx(800e6)
    assert l["w2->s1"]["host"] == "h2" and l["w2->s1"]["rate_bps"] == pytest.approx(8e6)
    w = {x["name"]: x for x in doc["workers"]}
    assert w["w0"] == {"name": "w0", "state": "up", "cpu": pytest.approx(0.5), "memory_bytes": 7, "host": "h1"}
    assert w["w2"]["host"] == "h2" and w["w2"]["cpu"] == pytest.approx(0.5)
    assert doc["hosts"] == {"h1": {"state": "ok", "why": None, "t": 1001.0},
                            "h2": {"state": "ok", "why": None, "t": 1001.0}}
    assert doc["read_s"] == pytest.approx(0.05) and doc["interval_s"] == pytest.approx(1.0)
    assert doc["testbed"] == "tb" and doc["time"] == "real" and doc["run"] is None
    # the documents' arrival order does not matter
    assert merge("tb", {"h2": docs["h2"], "h1": docs["h1"]}, CUT_PLACEMENT, CUT_TOPO)["links"] == doc["links"]


def test_merge_of_a_failed_host_falls_back_to_the_receiving_end():
    from testbed.cluster.top import merge

    docs = _two_host_docs()
    doc = merge("tb", {"h1": None, "h2": docs["h2"]}, CUT_PLACEMENT, CUT_TOPO,
                {"h1": {"state": "failed", "why": "host h1 unreachable"}})
    l = {x["name"]: x for x in doc["links"]}
    assert len(doc["links"]) == 6
    # h1 holds s0: s0->s1 as s1 received it on h2 (as one host falls back to the receiving port); no queue
    assert l["s0->s1"]["rate_bps"] == pytest.approx(760e6) and l["s0->s1"]["host"] == "h1"
    assert l["s0->s1"]["backlog_bytes"] is None and l["s0->s1"]["drops"] is None
    assert l["s0->s1"]["bandwidth_bps"] == 1e9 and l["s0->s1"]["state"] == "up"
    assert l["w0->s0"]["rate_bps"] is None and l["s0->w0"]["rate_bps"] is None   # nobody reads inside h1
    w = {x["name"]: x for x in doc["workers"]}
    assert w["w0"] == {"name": "w0", "state": "up", "cpu": None, "memory_bytes": None, "host": "h1"}
    assert doc["hosts"]["h1"] == {"state": "failed", "why": "host h1 unreachable", "t": None}
    assert doc["hosts"]["h2"]["state"] == "ok"
    # no host answered at all: the topology's directions, every reading unknown
    doc = merge("tb", {"h1": None, "h2": None}, CUT_PLACEMENT, CUT_TOPO)
    assert [l["name"] for l in doc["links"]] == ["w0->s0", "s0->w0", "s0->s1", "s1->s0", "s1->w2", "w2->s1"]
    assert all(l["rate_bps"] is None and l["state"] == "unknown" for l in doc["links"])
    assert doc["links"][2]["bandwidth_bps"] == 1e9 and doc["t"] is None and doc["interval_s"] is None
    assert {h: s["state"] for h, s in doc["hosts"].items()} == {"h1": "waiting", "h2": "waiting"}


def test_merge_runs_adds_up_the_hosts_ranks():
    from testbed.cluster.top import merge_runs

    r1 = {"run_id": "a1", "dir": "/srv/runs/x", "status": "running", "world_size": 4, "ranks": 2, "ranks_ended": 0,
          "step": 10, "step_min": 9, "last_step_s": 0.5, "last_step_max_s": 0.6, "last_step_age_s": 0.2}
    r2 = {**r1, "run_id": "a2", "dir": None, "status": "unknown", "world_size": None, "ranks": 2, "ranks_ended": 1,
          "step": 8, "step_min": 7, "last_step_s": 0.7, "last_step_max_s": 0.9, "last_step_age_s": 0.1}
    assert merge_runs({"h1": None, "h2": None}) is None
    assert merge_runs({"h1": None, "h2": r2}) == {**r2, "hosts": ["h2"]}
    m = merge_runs({"h1": r1, "h2": r2})
    assert m == {"run_id": "a1", "dir": "/srv/runs/x", "status": "running", "world_size": 4, "ranks": 4,
                 "ranks_ended": 1, "step": 10, "step_min": 7, "last_step_s": pytest.approx(0.6),
                 "last_step_max_s": 0.9, "last_step_age_s": 0.1, "hosts": ["h1", "h2"]}


def test_merged_fields_are_the_documented_ones_and_the_view_shows_hosts():
    from rich.console import Console

    from testbed.cli.top import render
    from testbed.cluster import top as hosts_top

    docs = _two_host_docs()
    doc = hosts_top.merge("tb", {"h1": docs["h1"], "h2": None}, CUT_PLACEMENT, CUT_TOPO,
                          {"h2": {"state": "failed", "why": "testbed 'tb' is not up"}})
    assert set(doc) == DOC_FIELDS | {"hosts"}
    assert set(doc["links"][0]) == LINK_FIELDS | {"host", "to_host"}
    assert set(doc["workers"][0]) == WORKER_FIELDS | {"host"}
    # what the merge adds is listed field by field in hosts_top's docstring, and each host's entry
    # has the keys it names
    assert _documented_fields(hosts_top.__doc__) == {
        "": {"hosts", "links[].host", "links[].to_host", "workers[].host", "run.hosts"}}
    assert set(doc["hosts"]["h1"]) == set(doc["hosts"]["h2"]) == {"state", "why", "t"}
    assert 'host -> {"state", "why", "t"}' in hosts_top.__doc__
    json.dumps(doc)
    con = Console(width=160, file=io.StringIO(), record=True)
    con.print(render(doc, "util", None))
    lines = [ln.strip() for ln in con.export_text().splitlines()]
    assert lines[0].startswith("tb: 3 links over 2 hosts") and lines[1] == "h2: failed: testbed 'tb' is not up"
    assert next(ln for ln in lines if ln.startswith("s0->s1")).split()[:4] == ["s0->s1", "core", "h1>h2", "up"]
    assert next(ln for ln in lines if ln.startswith("w0 ")).split()[:2] == ["w0", "h1"]
    assert next(ln for ln in lines if ln.startswith("worker ")).split() == ["worker", "host", "state", "cpu", "memory"]
    # a single-host document keeps its view: no host column, no host lines
    con = Console(width=160, file=io.StringIO(), record=True)
    con.print(render(compute(_model(), _reading(0.0), _reading(1.0)), "util", None))
    lines = [ln.strip() for ln in con.export_text().splitlines()]
    assert lines[0].startswith("tb: 1 links, 2 directions") and lines[1].startswith("real time")
    assert next(ln for ln in lines if ln.startswith("link ")).split()[:3] == ["link", "tier", "state"]
    assert next(ln for ln in lines if ln.startswith("worker ")).split() == ["worker", "state", "cpu", "memory"]


def test_gather_keeps_each_hosts_latest_document_and_why_one_failed():
    from testbed.cluster.top import Gather

    now = [0.0]
    g = Gather(["h1", "h2", "h3"], clock=lambda: now[0])
    docs = _two_host_docs()
    g.line("h1", "not json: a warning")
    g.line("h1", json.dumps(docs["h1"]))
    g.line("h2", json.dumps(docs["h2"]))
    g.wait({}, deadline=0.0)   # h3 is pending and the deadline has passed: returns
    now[0] = 3.0
    got, states, seq = g.snapshot({})
    assert got["h1"] == docs["h1"] and got["h3"] is None and seq == {"h1": 1, "h2": 1, "h3": 0}
    assert states["h1"] == {"state": "ok", "why": None}
    assert states["h3"] == {"state": "waiting", "why": "no reading yet (3 s)"}
    g.line("h2", json.dumps({"error": "testbed 'tb' is no longer up"}))   # a host's top said why
    g.ended("h3", OSError("host h3 unreachable: connection refused"))
    now[0] = 9.0
    got, states, _ = g.snapshot(seq)
    assert states["h1"] == {"state": "stale", "why": "no new reading for 9 s"}
    assert states["h2"] == {"state": "failed", "why": "testbed 'tb' is no longer up"} and got["h2"] is None
    assert states["h3"] == {"state": "failed", "why": "host h3 unreachable: connection refused"}
    assert g.live() == ["h1"]
    g.ended("h1", type("R", (), {"rc": 3, "stderr": "error: a reading failed\n", "stdout": ""})())
    assert g.snapshot(seq)[1]["h1"] == {"state": "failed", "why": "a reading failed"} and g.live() == []


def test_hosts_top_samples_and_shows_an_unreachable_host(monkeypatch):
    """HostsTop over a stream that behaves as testbed.cluster.agents.stream does: h1's agent sends a
    document every interval until stopped; h2 cannot be reached (said as soon as that is known)."""
    import threading

    from testbed.agent.protocol import TopDoc
    from testbed.cluster import top as hosts_top
    from testbed.cluster.agents import HostFailed

    docs = _two_host_docs()
    calls = []

    def stream(name, request, on_item, *, stop=None, on_end=None, **kw):
        calls.append((name, request.model_dump(exclude_none=True)))
        lost = HostFailed("h2", "host h2 unreachable: connection refused")
        on_end("h2", lost)   # as agents.stream says it: as soon as h2's session ends
        while not stop.wait(0.05):   # the fake's pace: h1 sends a document every 0.05 s until stopped
            on_item("h1", TopDoc(**docs["h1"]))
        return {"h1": {"samples": 3}, "h2": lost}

    record = {"placement": CUT_PLACEMENT, "topology": CUT_TOPO, "hosts": {"h1": {}, "h2": {}}}
    t = hosts_top.HostsTop("tb", 0.1, record=record, stream=stream, first_wait=0.3)
    try:
        doc = t.sample()
        assert doc["hosts"]["h1"]["state"] == "ok" and doc["hosts"]["h2"]["state"] == "failed"
        assert {x["name"]: x for x in doc["links"]}["s0->s1"]["rate_bps"] == pytest.approx(800e6)
        assert t.sample()["hosts"]["h1"]["state"] == "ok"     # a new reading each interval
    finally:
        t.close()
    assert not any(th.name == "top-tb" and th.is_alive() for th in threading.enumerate())
    doc = t.settle(doc)
    assert doc["hosts"]["h2"] == {"state": "failed", "why": "host h2 unreachable: connection refused", "t": None}
    assert calls == [("tb", {"name": "tb", "op": "top", "interval": 0.1})]
    with pytest.raises(hosts_top.HostsTopEnded, match="h2: host h2 unreachable"):
        t.sample()


# -- pure: the active run ------------------------------------------------------------------------------------


def _write_run(runs: Path, dirname: str, testbed: str, status: str = "running", factor: float = 2.0) -> Path:
    d = runs / dirname
    (d / "probe").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"testbed": testbed, "run_id": dirname[-6:], "status": status,
                                                "world_size": 2, "time_dilation": {"factor": factor}}))
    return d


def test_run_watch_reads_steps_incrementally(tmp_path, state_dir):
    runs = tmp_path / "runs"
    _write_run(runs, "20260101-100000-tb", "tb", status="completed")
    _write_run(runs, "20260101-110000-tbother", "tbother")           # another testbed, not ours
    d = _write_run(runs, "20260101-120000-tb.1", "tb")
    r0, r1 = d / "probe" / "rank-0.jsonl", d / "probe" / "rank-1.jsonl"
    r0.write_text('{"ev": "start", "t": 1.0}\n{"ev": "step", "t": 10.0, "dur": 0.5, "n": 1}\n'
                  '{"ev": "coll", "op": "all_reduce", "t": 10.1, "dur": 0.1}\n'
                  '{"ev": "step", "t": 11.0, "dur": 0.4, "n": 2}\nnot json\n{"ev": "step", "t": 1')
    r1.write_text('{"ev": "step", "t": 10.5, "dur": 0.8, "n": 1}\n')
    watch = run_watch.RunWatch("tb", runs)
    run = watch.poll(now=13.0)
    assert set(run) == RUN_FIELDS
    assert run["dir"] == str(d) and run["status"] == "running" and run["world_size"] == 2
    assert (run["ranks"], run["step"], run["step_min"]) == (2, 2, 1)
    # rank 0: (11 - 10) / 2 = 0.5 s; rank 1, one step: its duration / 2 = 0.4 s
    assert run["last_step_s"] == pytest.approx(0.45) and run["last_step_max_s"] == pytest.approx(0.5)
    assert run["last_step_age_s"] == pytest.approx(2.0)
    with open(r0, "a") as f:                    # the unfinished line ends; rank 0 ends
        f.write('3.0, "dur": 0.5, "n": 3}\n{"ev": "end", "t": 13.5}\n')
    run = watch.poll(now=14.0)
    assert (run["step"], run["ranks_ended"]) == (3, 1)
    assert run["last_step_max_s"] == pytest.approx(1.0)   # (13 - 11) / 2


def test_run_watch_long_file_reads_its_end(tmp_path, state_dir):
    runs = tmp_path / "runs"
    d = _write_run(runs, "20260101-120000-tb", "tb", factor=1.0)
    with open(d / "probe" / "rank-0.jsonl", "w") as f:
        f.writelines(json.dumps({"ev": "step", "t": float(n), "dur": 0.9, "n": n, "samples": 32}) + "\n"
                     for n in range(1, 40_001))
    assert (d / "probe" / "rank-0.jsonl").stat().st_size > run_watch.PROBE_TAIL_BYTES
    run = run_watch.RunWatch("tb", runs).poll(now=40_001.0)
    assert run["step"] == 40_000 and run["last_step_s"] == pytest.approx(1.0)


def test_run_watch_exchange_dir_and_none(tmp_path, state_dir):
    from testbed import paths

    runs = tmp_path / "runs"
    _write_run(runs, "20260101-120000-tb", "tb", status="failed")
    assert run_watch.RunWatch("tb", runs).poll() is None
    assert run_watch.RunWatch("tb", tmp_path / "nowhere").poll() is None
    probe = paths.directory("tb") / "runs" / "abc123" / "probe"
    probe.mkdir(parents=True)
    (probe / "rank-0.jsonl").write_text('{"ev": "step", "t": 5.0, "dur": 0.25, "n": 7}\n')
    run = run_watch.RunWatch("tb", runs, dilation=1.0).poll(now=6.0)
    assert (run["run_id"], run["dir"], run["status"], run["step"]) == ("abc123", None, "unknown", 7)
    assert run["last_step_s"] == pytest.approx(0.25)


# -- the CLI without a testbed --------------------------------------------------------------------------------


def _cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], check=False, capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout, env={**os.environ, "COLUMNS": "120"})


def test_cli_no_such_testbed(state_dir):
    r = _cli("top", "--name", "nope", "--once", "--json")
    if IS_ROOT:
        assert r.returncode == 4 and "no testbed named 'nope' is up" in r.stderr, r.stderr
    else:
        assert r.returncode == 1 and "needs root" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("top", "--sort", "rate")
    assert r.returncode == 2 and "util, drops, queue" in r.stderr


# -- kernel: a shaped star with traffic ----------------------------------------------------------------------

STAR = ["params.n=3", "tiers.host.bandwidth=100mbit", "tiers.host.delay=0"]


def _star(testbed, dilation="none", queue=None):
    from testbed.topology.loader import load_topology

    name = f"tp{uuid.uuid4().hex[:6]}"
    testbed(load_topology("star", STAR + ([f"tiers.host.queue={queue}"] if queue else [])), name,
            time_dilation=dilation)
    return name


def _addr(name, w):
    from testbed import store

    st = store.load(name)
    for lp in st["plan"]["links"]:
        for side in ("a", "b"):
            if lp[side]["node"] == w and lp[side].get("address"):
                return lp[side]["address"].split("/")[0]
    raise AssertionError(f"no address for {w}")


def _tx_bytes(pid: int, ifname: str) -> int:
    """Bytes sent on `ifname` of the network namespace process `pid` is in (0 once it is gone)."""
    try:
        rows = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return 0
    for row in rows:
        dev, _, data = row.partition(":")
        if dev.strip() == ifname:
            return int(data.split()[8])
    return 0


class Flows:
    """iperf3 flows client -> server between workers, each to a server of its own (ports unique)."""

    def __init__(self, name: str, pairs: list[tuple[str, str]], secs: int):
        self.procs: list[subprocess.Popen] = []
        self.clients: list[subprocess.Popen] = []
        base = 5201 + uuid.uuid4().int % 500
        self.servers: list[tuple[subprocess.Popen, int]] = []
        for i, (client, server) in enumerate(pairs):
            port = base + i
            srv = subprocess.Popen(["ip", "netns", "exec", f"tb-{name}-{server}", "iperf3", "-s", "-1",
                                    "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(srv)
            self.servers.append((srv, port))
        # `ip netns exec` execs iperf3: the PID's namespace holds the listening socket (was: 0.3 s)
        wait_for(lambda: all(tcp_sockets(srv.pid, port, "LISTEN", netns=f"tb-{name}-{server}")
                             for (srv, port), (_c, server) in zip(self.servers, pairs)), timeout=30,
                 what="every iperf3 server to listen")
        for i, (client, server) in enumerate(pairs):
            c = subprocess.Popen(["ip", "netns", "exec", f"tb-{name}-{client}", "iperf3", "-c", _addr(name, server),
                                  "-p", str(base + i), "-t", str(secs), "-J"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            self.clients.append(c)
            self.procs.append(c)

    def flowing(self) -> None:
        """Returns once every flow's control and data connections are up at its server."""
        wait_for(lambda: all(tcp_sockets(srv.pid, port, "ESTABLISHED") >= 2 for srv, port in self.servers),
                 timeout=30, what="every iperf3 flow to connect")

    def results(self) -> list[float]:
        """Goodput (bit/s) each flow's receiver saw."""
        out = []
        for c in self.clients:
            stdout, stderr = c.communicate(timeout=60)
            assert c.returncode == 0, f"iperf3 failed: {stderr} {stdout[-400:]}"
            out.append(json.loads(stdout)["end"]["sum_received"]["bits_per_second"])
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)


def _once(name: str, *extra: str, cwd: Path | None = None) -> dict:
    r = _cli("top", "--name", name, "--once", "--json", *extra, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.timing
@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_once_json_sees_the_flows(testbed):
    """Two flows into w1 through a 100 Mbit/s star: s0->w1 is the bottleneck (full, with a queue),
    its rate is what the two receivers got (within 3%: see the measurements below). The queue is
    1000 packets (121 ms at 100 Mbit/s), so that nothing is dropped and what goes into s0 leaves it:
    the default at 100 Mbit/s is 100 packets, which the two flows overflow (into over out 1.096 in
    `make test`, 2026-12-07)."""
    name = _star(testbed, queue=1000)
    flows = Flows(name, [("w0", "w1"), ("w2", "w1")], secs=5)
    try:
        flows.flowing()   # then top's own interval (1 s) samples flows already going (was: 1.5 s)
        doc = _once(name)
        goodputs = flows.results()
    finally:
        flows.close()
    assert set(doc) == DOC_FIELDS and doc["time"] == "real" and doc["dilation"] == 1.0
    links = {l["name"]: l for l in doc["links"]}
    assert len(links) == 6 and all(set(l) == LINK_FIELDS for l in doc["links"])
    bottleneck = links["s0->w1"]
    into = links["w0->s0"]["rate_bps"] + links["w2->s0"]["rate_bps"]
    print(f"s0->w1 {bottleneck['rate_bps'] / 1e6:.2f} Mbit/s (util {bottleneck['util']:.3f}) against the "
          f"receivers' {sum(goodputs) / 1e6:.2f}: ratio {bottleneck['rate_bps'] / sum(goodputs):.4f}; into s0 "
          f"over out of it {into / bottleneck['rate_bps']:.4f}; read {doc['read_s']:.3f} s, interval "
          f"{doc['interval_s']:.3f} s")
    # 5 runs (2026-12-02, 2-core machine, other sessions' tests beside; `pytest -s -k once_json`
    # prints them): s0->w1 over the receivers' goodput 0.9975-1.0023, util 0.958-0.963, what went
    # into s0 over what left it 0.9885-0.9994, read 0.008-0.029 s, interval 1.001-1.005 s. The bands:
    # 3% (over 10x the widest deviation; a rate read from the wrong counter or period is off by far
    # more), util 0.85-1.1 around the 0.956 of payload in a full link, the read well under a
    # sample's interval, the interval within 0.1 s of the 1 s asked for (was 0.3; the rates 10%)
    assert bottleneck["rate_bps"] == pytest.approx(sum(goodputs), rel=0.03), (goodputs, bottleneck)
    assert 0.85 <= bottleneck["util"] <= 1.1, bottleneck
    assert bottleneck["backlog_bytes"] > 0 or bottleneck["drops"] > 0, bottleneck
    assert bottleneck["overlimits"] > 0
    assert into == pytest.approx(bottleneck["rate_bps"], rel=0.03)
    assert links["s0->w0"]["util"] < 0.1 and links["w1->s0"]["util"] < 0.1      # acks only
    assert doc["run"] is None
    assert doc["read_s"] < 0.5 and doc["interval_s"] == pytest.approx(1.0, abs=0.1)


@pytest.mark.timing
@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_dilation_shows_emulated_rates(testbed):
    """At s = 2 the kernel runs the 100 Mbit/s links at 50: iperf3 sees ~50, top says ~100 and full."""
    name = _star(testbed, dilation=2)
    flows = Flows(name, [("w0", "w1")], secs=4)
    try:
        flows.flowing()   # then top's own interval (1 s) samples flows already going (was: 1.5 s)
        doc = _once(name)
        (goodput,) = flows.results()
    finally:
        flows.close()
    assert doc["time"] == "emulated" and doc["dilation"] == 2.0
    l = {l["name"]: l for l in doc["links"]}["w0->s0"]
    print(f"at s=2: goodput {goodput / 1e6:.2f} Mbit/s ({goodput / (50e6 * 0.95):.4f} of 0.95 x 50), wire rate "
          f"{l['wire_rate_bps'] / 1e6:.2f} ({l['wire_rate_bps'] / goodput:.4f} of the goodput), util {l['util']:.3f}")
    # 5 runs (2026-12-02, as above): goodput 1.0089-1.0093 of 0.95 x 50 Mbit/s (the payload share of
    # a full link is 1448/1514 = 0.956), the wire rate 0.9945-0.9999 of the goodput: within 3%
    # (was 10%); an undilated link would give twice the goodput
    assert goodput == pytest.approx(50e6 * 0.95, rel=0.03)
    assert l["wire_rate_bps"] == pytest.approx(goodput, rel=0.03)
    assert l["rate_bps"] == pytest.approx(2 * l["wire_rate_bps"])
    assert l["bandwidth_bps"] == 100e6 and 0.85 <= l["util"] <= 1.1, l


@pytest.mark.timing
@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_down_link_busy_worker_and_run(testbed, tmp_path):
    """A downed link reads down (both directions, JSON and view); a worker's busy loop shows as its
    CPU; a run in ./runs shows its step; --tier filters, an unknown tier is refused."""
    from testbed import store
    from testbed import node_exec
    from testbed.faults import control

    name = _star(testbed)
    control.link_down(name, "w0", "s0")
    # a run directory as `testbed run` leaves it while the job runs, in this test's working directory
    d = tmp_path / "runs" / f"20260101-120000-{name}"
    (d / "probe").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"testbed": name, "run_id": "r1", "status": "running",
                                                "world_size": 1, "time_dilation": {"factor": 1.0}}))
    (d / "probe" / "rank-0.jsonl").write_text('{"ev":"step","t":1.0,"dur":0.1,"n":41}\n'
                                              '{"ev":"step","t":1.25,"dur":0.1,"n":42}\n')
    argv = node_exec.exec_argv(store.load(name), "w2", [sys.executable, "-c",
                                                      "import time\nt=time.time()\nwhile time.time()-t<4: pass"])
    busy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import psutil

        def loop_runs() -> bool:   # the python under the exec wrapper has burnt a tenth of a second
            kids = psutil.Process(busy.pid).children(recursive=True) + [psutil.Process(busy.pid)]
            return any(k.name().startswith("python") and sum(k.cpu_times()[:2]) > 0.1 for k in kids)

        wait_for(loop_runs, timeout=30, what="w2's busy loop to run", ignore=psutil.NoSuchProcess)
        doc = _once(name, cwd=tmp_path)
        view = _cli("top", "--name", name, "--once", "--sort", "drops", cwd=tmp_path)
    finally:
        if busy.poll() is None:
            busy.kill()
        busy.wait(5)
    links = {l["name"]: l for l in doc["links"]}
    for n in ("w0->s0", "s0->w0"):
        assert links[n]["state"] == "down" and links[n]["down_by"] == ["link"], links[n]
    assert all(l["state"] == "up" for k, l in links.items() if k not in ("w0->s0", "s0->w0"))
    workers = {w["name"]: w for w in doc["workers"]}
    print(f"top's cpu: busy w2 {workers['w2']['cpu']:.3f}, idle w0 {workers['w0']['cpu']:.3f}")
    # 5 runs (2026-12-02, as above): the busy loop 0.83-0.97 of a core, the idle worker 0.000; the
    # bands only tell busy from idle with others' work on 2 cores beside
    assert workers["w2"]["cpu"] > 0.3 and workers["w0"]["cpu"] < 0.2, workers
    assert all(w["memory_bytes"] and w["memory_bytes"] > 0 for w in workers.values())
    run = doc["run"]
    assert (run["dir"], run["step"], run["last_step_s"]) == (str(d), 42, pytest.approx(0.25))
    assert view.returncode == 0, view.stderr
    assert re.search(r"w0->s0\s+host\s+down", view.stdout) and "1 down" in view.stdout, view.stdout
    assert "step 42" in view.stdout and "real time" in view.stdout
    only = _once(name, "--tier", "host", "--sort", "queue")
    assert len(only["links"]) == 6
    r = _cli("top", "--name", name, "--once", "--tier", "spine")
    assert r.returncode == 2 and "tiers host" in r.stderr, r.stderr


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_live_view_exits_cleanly_on_ctrl_c(testbed):
    requires.need("pexpect")
    import pexpect

    name = _star(testbed)
    child = pexpect.spawn(sys.executable, ["-m", "testbed", "top", "--name", name, "--interval", "0.3"],
                          cwd=str(REPO), env={**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm"},
                          dimensions=(40, 120), timeout=20, encoding="utf-8")
    try:
        child.expect("s0->w1")                     # a refreshed view
        child.expect("Ctrl-C quits")
        child.kill(signal.SIGINT)
        child.expect(pexpect.EOF, timeout=10)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus, child.before)
    assert "Traceback" not in (child.before or "")


def _has_netem() -> bool:
    if not IS_ROOT:
        return False
    from testbed.net import capabilities

    return bool(capabilities.probe(measure_floor=False).netem)


@pytest.mark.root
@pytest.mark.netem
@pytest.mark.skipif(not _has_netem(), reason="kernel has no sch_netem (loss through cls_bpf is no qdisc drop)")
def test_lossy_link_shows_drops(testbed):
    """netem's loss is a drop of the link's root qdisc: a UDP flow through a 5% lossy link shows it."""
    from testbed.topology.loader import load_topology

    name = f"tp{uuid.uuid4().hex[:6]}"
    testbed(load_topology("star", STAR + ["tiers.host.loss=5%"]), name, time_dilation="none")
    # Plain UDP datagrams at ~20 Mbit/s to w1 (no receiver needed: they are counted on w0's egress).
    # Not iperf3: its TCP control connection crosses the same lossy link and sometimes fails on it.
    sender = ("import socket, time\n"
              "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b = bytes(1400); t = time.monotonic()\n"
              "while time.monotonic() - t < 60:\n"
              "    for _ in range(18): s.sendto(b, (%r, 9))\n"
              "    time.sleep(0.01)\n" % _addr(name, "w1"))   # (the sleep paces the flow: not a wait)
    client = subprocess.Popen(["ip", "netns", "exec", f"tb-{name}-w0", sys.executable, "-c", sender],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # one reading, once the flow runs: a megabyte (about half a second of it) has left w0's eth0
        # (a reading that began before the flow did is no reading; the kernel VM starts python slowly)
        wait_for(lambda: client.poll() is not None or in_netns(client.pid, f"tb-{name}-w0"), timeout=30,
                 what="the sender in w0")
        sent0 = _tx_bytes(client.pid, "eth0")
        wait_for(lambda: client.poll() is not None or _tx_bytes(client.pid, "eth0") - sent0 > 1e6, timeout=60,
                 what="the UDP flow to leave w0")
        doc = _once(name)
    finally:
        if client.poll() is None:
            client.kill()
        said, _ = client.communicate(timeout=5)
    l = {l["name"]: l for l in doc["links"]}["w0->s0"]
    assert l["rate_bps"] > 5e6 and l["drops"] > 0, (l, (said or "")[-2000:])
