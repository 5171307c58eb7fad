"""The hosts file (testbed.cluster.hosts) and placement (testbed.cluster.placement): pure, no root.

- the schema: the example loads; every kind of mistake names the file, the field path and the value;
- placement: capacity never exceeded, pins kept, every switch where most of its bandwidth is
  (hypothesis over generated topologies and random hosts); the partitioner cuts less than dealing
  nodes round-robin, and exactly the known minimum on fat-trees and leaf-spines; a k=4 fat-tree
  over two equal hosts keeps each pod whole; the same input gives the same output (also across
  processes with different hash seeds); shortfalls are refused naming the resource;
- `testbed topo FILE --hosts` (text and --json), run as a user runs it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.errors import TopologyError
from testbed.topology.generators import GENERATORS
from testbed.cluster.hosts import Hosts, hosts_from_data, load_hosts, load_hosts_text, parse_ssh
from testbed.topology.model import Link, LinkProfile, Node, Topology
from testbed.cluster.placement import parse_pins, place

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hosts.yaml"


def generated(gen: str, worker: dict | None = None, **params) -> Topology:
    nodes, links = GENERATORS[gen].generate(params, {}, worker or {})
    return Topology(name=gen, nodes=nodes, links=links).validate()


def make_hosts(*cores: int, gpus: tuple[int, ...] = (), memory: tuple[str | None, ...] = ()) -> Hosts:
    hosts = []
    for i, c in enumerate(cores):
        cap: dict = {"cores": c}
        if i < len(gpus):
            cap["gpus"] = gpus[i]
        if i < len(memory) and memory[i] is not None:
            cap["memory"] = memory[i]
        hosts.append({"name": f"h{i}", "ssh": f"root@h{i}.test", "underlay": f"10.99.0.{i + 1}", "capacity": cap})
    return hosts_from_data({"hosts": hosts}, "hosts.yaml")


def assert_valid(p, topo: Topology, hosts: Hosts, pins: dict[str, str] | None = None) -> None:
    """What every placement promises: all nodes placed, capacity kept, pins kept, consistent totals and cut
    links, every unpinned switch on a host with at least as much of its bandwidth as any other."""
    assert set(p.assignment) == set(topo.nodes)
    assert set(p.assignment.values()) <= set(hosts.names)
    for node, host in (pins or {}).items():
        assert p.assignment[node] == host
    for load in p.loads:
        host = hosts[load.host]
        workers = [w for w in topo.workers if p.assignment[w] == load.host]
        assert sorted(load.workers) == sorted(workers)
        assert sorted(load.switches) == sorted(s for s in topo.switches if p.assignment[s] == load.host)
        cores = sum(topo.nodes[w].cpus or 1 for w in workers)
        gpus = sum(topo.nodes[w].gpus for w in workers)
        memory = sum(topo.nodes[w].memory_bytes or 0 for w in workers)
        assert load.cores_used == pytest.approx(cores) and load.gpus_used == gpus and load.memory_used == memory
        assert cores <= host.capacity.cores + 1e-9, f"{load.host}: {cores} cores > {host.capacity.cores}"
        assert gpus <= host.capacity.gpus
        if host.capacity.memory is not None:
            assert memory <= host.capacity.memory
    cut = {c.index for c in p.cut_links}
    assert cut == {i for i, link in enumerate(topo.links) if p.assignment[link.a] != p.assignment[link.b]}
    assert p.cut_bps == sum((link.ab.bandwidth_bps or 0) + (link.ba.bandwidth_bps or 0)
                            for i, link in enumerate(topo.links) if i in cut)
    shaped = [d.bandwidth_bps for link in topo.links for d in (link.ab, link.ba) if d.bandwidth_bps]
    unshaped = max(shaped, default=1)   # an unshaped direction weighs as the fastest shaped one
    for sw in topo.switches:
        if sw in (pins or {}):
            continue
        bw = {h: 0 for h in hosts.names}
        for link in topo.links_of(sw):
            bw[p.assignment[link.other(sw)]] += (link.ab.bandwidth_bps or unshaped) + (link.ba.bandwidth_bps or unshaped)
        assert bw[p.assignment[sw]] == max(bw.values()), f"{sw} is not where most of its bandwidth is: {bw}"


# -- the hosts file ------------------------------------------------------------------------------------------


def test_a_relative_key_is_the_hosts_files_neighbour(tmp_path, monkeypatch):
    d = tmp_path / "lab"
    d.mkdir()
    (d / "hosts.yaml").write_text(
        "hosts:\n"
        "  - {name: a, ssh: a.test, key: keys/id_a, underlay: 10.99.0.1, capacity: {cores: 1}}\n"
        "  - {name: b, ssh: b.test, key: ~/.ssh/id_b, underlay: 10.99.0.2, capacity: {cores: 1}}\n"
        "  - {name: c, ssh: c.test, key: /etc/k, underlay: 10.99.0.3, capacity: {cores: 1}}\n")
    monkeypatch.chdir(tmp_path)   # elsewhere: the key is still found beside the file
    a, b, c = load_hosts("lab/hosts.yaml")
    assert a.key == str(d / "keys" / "id_a") and b.key == "~/.ssh/id_b" and c.key == "/etc/k"
    assert load_hosts_text((d / "hosts.yaml").read_text())["a"].key == "keys/id_a"   # no base: as written


def test_example_loads():
    hosts = load_hosts(EXAMPLE)
    assert hosts.names == ["node-a", "node-b"] and hosts.source == str(EXAMPLE)
    a, b = hosts
    assert (a.target.user, a.target.address, a.target.port) == ("root", "node-a.lab", 22)
    assert (b.target.user, b.target.address, b.target.port) == ("admin", "node-b.lab", 2222)
    assert a.key == "~/.ssh/testbed_ed25519" and not a.uses_agent and b.key is None and b.uses_agent
    assert a.capacity.cores == 8 and a.capacity.memory == 32 * 2**30 and b.capacity.gpus == 0
    assert a.underlay == "10.20.0.1" and a.labels == {"rack": "r1"}
    doc = hosts.to_json()
    assert doc["hosts"][1]["ssh"] == "admin@node-b.lab:2222" and doc["hosts"][0]["capacity"]["cores"] == 8


@pytest.mark.parametrize("text, user, address, port", [
    ("h", None, "h", 22),
    ("root@h.example.org", "root", "h.example.org", 22),
    ("u@10.0.0.1:2200", "u", "10.0.0.1", 2200),
    ("[fe80::1]", None, "fe80::1", 22),
    ("ops@[2001:DB8::1]:22022", "ops", "2001:db8::1", 22022),
    ("Host-A", None, "host-a", 22),
])
def test_parse_ssh(text, user, address, port):
    t = parse_ssh(text)
    assert (t.user, t.address, t.port) == (user, address, port)
    assert parse_ssh(str(t)) == t


@pytest.mark.parametrize("text", ["", "a:b:c", "h:0", "h:65536", "h:x", "@h", "bad user@h", "[::1", "[nope]:22",
                                  "-h", "h_1"])
def test_parse_ssh_refuses(text):
    with pytest.raises(ValueError):
        parse_ssh(text)


BASE = {"hosts": [
    {"name": "a", "ssh": "root@a.test", "underlay": "10.99.0.1", "capacity": {"cores": 4}},
    {"name": "b", "ssh": "root@b.test:2222", "key": "/k", "underlay": "10.99.0.2",
     "capacity": {"cores": 4, "gpus": 1, "memory": "8g"}, "labels": {"rack": 1}},
    {"name": "c", "ssh": "c.test", "underlay": "10.99.0.3", "capacity": {"cores": 2}},
]}


def _set(path: str, value):
    """A mutation of BASE: set the dotted `path` ('hosts[2].capacity.cores') to `value` (DELETE removes it)."""
    def apply(doc):
        parts = path.replace("[", ".").replace("]", "").split(".")
        target = doc
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        last = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return apply


DELETE = object()

# (mutation, the error's path, its value or DELETE for none, a word of the reason)
SCHEMA_ERRORS = [
    (_set("hosts[2].capacity.cores", 0), "hosts[2].capacity.cores", 0, "must be >= 1"),
    (_set("hosts[0].capacity.cores", "4"), "hosts[0].capacity.cores", "4", "expected an integer"),
    (_set("hosts[0].capacity.cores", True), "hosts[0].capacity.cores", True, "expected an integer"),
    (_set("hosts[0].capacity.cores", 2.5), "hosts[0].capacity.cores", 2.5, "expected an integer"),
    (_set("hosts[1].capacity.gpus", -1), "hosts[1].capacity.gpus", -1, "must be >= 0"),
    (_set("hosts[1].capacity.memory", "8q"), "hosts[1].capacity.memory", "8q", "unknown size unit"),
    (_set("hosts[1].capacity.memory", 0), "hosts[1].capacity.memory", 0, "must be > 0"),
    (_set("hosts[1].capacity.disk", 1), "hosts[1].capacity.disk", "disk", "unknown field; allowed fields: cores"),
    (_set("hosts[0].capacity", DELETE), "hosts[0].capacity", DELETE, "missing"),
    (_set("hosts[0].capacity.cores", DELETE), "hosts[0].capacity.cores", DELETE, "missing"),
    (_set("hosts[0].capacity", 4), "hosts[0].capacity", 4, "expected a mapping"),
    (_set("hosts[0].ssh", DELETE), "hosts[0].ssh", DELETE, "missing"),
    (_set("hosts[0].ssh", "a:b:c"), "hosts[0].ssh", "a:b:c", "IPv6"),
    (_set("hosts[0].ssh", "root@a.test:99999"), "hosts[0].ssh", "root@a.test:99999", "port"),
    (_set("hosts[0].ssh", 7), "hosts[0].ssh", 7, "expected a string"),
    (_set("hosts[1].ssh", "root@C.TEST"), "hosts[2].ssh", "c.test", "the same SSH address and port as hosts[1]"),
    (_set("hosts[0].underlay", "10.99.0.300"), "hosts[0].underlay", "10.99.0.300", "not an IP address"),
    (_set("hosts[0].underlay", "127.0.0.1"), "hosts[0].underlay", "127.0.0.1", "loopback"),
    (_set("hosts[0].underlay", "224.0.0.1"), "hosts[0].underlay", "224.0.0.1", "multicast"),
    (_set("hosts[2].underlay", "10.99.0.1"), "hosts[2].underlay", "10.99.0.1", "the same underlay address as hosts[0]"),
    (_set("hosts[2].name", "a"), "hosts[2].name", "a", "the same name as hosts[0]"),
    (_set("hosts[0].name", "a.b"), "hosts[0].name", "a.b", "letters, digits"),
    (_set("hosts[0].name", DELETE), "hosts[0].name", DELETE, "missing"),
    (_set("hosts[0].agent", False), "hosts[0].agent", False, "no way to log in"),
    (_set("hosts[0].agent", "yes"), "hosts[0].agent", "yes", "expected true or false"),
    (_set("hosts[0].key", ""), "hosts[0].key", "", "private key"),
    (_set("hosts[0].labels", ["x"]), "hosts[0].labels", ["x"], "expected a mapping"),
    (_set("hosts[0].labels", {"a b": "x"}), "hosts[0].labels.a b", "a b", "label name"),
    (_set("hosts[0].labels", {"x": None}), "hosts[0].labels.x", None, "expected a string"),
    (_set("hosts[0].port", 22), "hosts[0].port", "port", "unknown field; allowed fields: name, ssh"),
    (_set("hosts[1]", "b"), "hosts[1]", "b", "expected a mapping"),
    (_set("hosts", []), "hosts", [], "must not be empty"),
    (_set("hosts", {"a": {}}), "hosts", {"a": {}}, "expected a list"),
    (_set("hosts", DELETE), "hosts", DELETE, "missing"),
    (_set("version", 1), "version", "version", "unknown field; allowed fields: hosts, description"),
]


@pytest.mark.parametrize("mutate, path, value, reason", SCHEMA_ERRORS,
                         ids=[f"{e[1]}:{e[3]}" for e in SCHEMA_ERRORS])
def test_schema_errors_name_file_field_and_value(mutate, path, value, reason):
    doc = copy.deepcopy(BASE)
    mutate(doc)
    with pytest.raises(TopologyError) as exc:
        hosts_from_data(doc, "hosts.yaml")
    e = exc.value
    assert (e.file, e.path) == ("hosts.yaml", path), str(e)
    assert reason in e.reason, str(e)
    if value is DELETE:
        assert e.value is TopologyError._MISSING, str(e)
    else:
        assert e.value == value and type(e.value) is type(value), str(e)
    assert str(e).startswith(f"hosts.yaml: {path}: ")


def test_schema_error_message_reads_like_the_loaders():
    doc = copy.deepcopy(BASE)
    doc["hosts"][2]["capacity"]["cores"] = 0
    with pytest.raises(TopologyError, match=r"^hosts\.yaml: hosts\[2\]\.capacity\.cores: must be >= 1 \(got 0\)$"):
        hosts_from_data(doc, "hosts.yaml")


def test_base_is_valid_and_label_numbers_become_text():
    hosts = hosts_from_data(copy.deepcopy(BASE), "hosts.yaml")
    assert hosts["b"].labels == {"rack": "1"} and hosts["b"].capacity.memory == 8 * 2**30
    assert hosts["a"].uses_agent and not hosts["b"].uses_agent
    assert hosts.get("zz") is None and len(hosts) == 3


def test_yaml_problems(tmp_path):
    with pytest.raises(TopologyError, match=r"hosts\[0\]\.name: duplicate key at line 4 \(first at line 3\)"):
        load_hosts_text("hosts:\n  - ssh: a\n    name: a\n    name: b\n", "h.yaml")
    with pytest.raises(TopologyError, match="invalid YAML at line"):
        load_hosts_text("hosts: [\n", "h.yaml")
    with pytest.raises(TopologyError, match="the file is empty"):
        load_hosts_text("", "h.yaml")
    with pytest.raises(TopologyError, match="expected a mapping"):
        load_hosts_text("- a\n", "h.yaml")
    with pytest.raises(TopologyError, match="hosts file not found"):
        load_hosts(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"hosts: \xff\n")
    with pytest.raises(TopologyError, match="not UTF-8"):
        load_hosts(bad)


# -- placement: properties ---------------------------------------------------------------------------------


@st.composite
def topologies(draw):
    gen = draw(st.sampled_from(["fat-tree", "leaf-spine", "dumbbell", "star"]))
    if gen == "fat-tree":
        params = {"k": draw(st.sampled_from([2, 4]))}
    elif gen == "leaf-spine":
        params = {"leaves": draw(st.integers(1, 5)), "spines": draw(st.integers(1, 3)),
                  "hosts_per_leaf": draw(st.integers(1, 4))}
    elif gen == "dumbbell":
        params = {"left": draw(st.integers(1, 6)), "right": draw(st.integers(1, 6))}
    else:
        params = {"n": draw(st.integers(1, 10))}
    topo = generated(gen, **params)
    # workers of different sizes: cores, GPUs, memory
    nodes = dict(topo.nodes)
    for w in topo.workers:
        nodes[w] = Node(w, "worker", cpus=draw(st.sampled_from([None, 0.5, 1, 2])), gpus=draw(st.sampled_from([0, 0, 1])),
                        memory_bytes=draw(st.sampled_from([None, 2**30])))
    return Topology(name=topo.name, nodes=nodes, links=topo.links).validate()


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(topo=topologies(), data=st.data())
def test_placement_never_exceeds_capacity_and_keeps_pins(topo, data):
    n = data.draw(st.integers(1, 4), label="hosts")
    cores = [data.draw(st.integers(1, 12), label=f"cores{i}") for i in range(n)]
    gpus = tuple(data.draw(st.integers(0, 3), label=f"gpus{i}") for i in range(n))
    memory = tuple(data.draw(st.sampled_from([None, "3g", "16g"]), label=f"memory{i}") for i in range(n))
    hosts = make_hosts(*cores, gpus=gpus, memory=memory)
    pinned = data.draw(st.lists(st.sampled_from(list(topo.nodes)), max_size=3, unique=True), label="pinned")
    pins = {node: data.draw(st.sampled_from(hosts.names), label=f"pin {node}") for node in pinned}
    try:
        p = place(topo, hosts, pins)
    except TopologyError as e:
        # refused: only ever for lack of room, and it says so
        assert "cannot hold" in e.reason or "do not pack" in e.reason or "more than any host" in e.reason \
            or "pinned to" in e.reason, str(e)
        need = sum(topo.nodes[w].cpus or 1 for w in topo.workers)
        if all(topo.nodes[w].cpus in (None, 1) and not topo.nodes[w].gpus and not topo.nodes[w].memory_bytes
               for w in topo.workers) and not pins:
            assert need > sum(cores), f"unit workers that fit in total must be placed: {e}"
        return
    assert_valid(p, topo, hosts, pins)
    assert p.method == "partition" and p.pins == pins


@settings(deadline=None, max_examples=25)
@given(topo=topologies(), seed=st.integers(0, 10**6))
def test_unit_workers_always_fit_when_the_cores_do(topo, seed):
    """1-core workers always pack when the hosts have the cores in total (racks are split when needed)."""
    workers = {w: Node(w, "worker") for w in topo.workers}
    topo = Topology(name=topo.name, nodes={**topo.nodes, **workers}, links=topo.links).validate()
    r = random.Random(seed)
    n = r.randint(1, 4)
    cores = [1] * n
    for _ in range(len(topo.workers) - n):
        cores[r.randrange(n)] += 1
    hosts = make_hosts(*cores)
    assert_valid(place(topo, hosts), topo, hosts)


def test_pins_are_kept_even_when_they_cost_bandwidth():
    topo = generated("fat-tree", k=4)
    hosts = make_hosts(8, 8)
    free = place(topo, hosts)
    pins = {"w0": "h0", "w1": "h1", "core0": "h1", "agg3-1": "h0"}   # w0 and w1 share a rack
    p = place(topo, hosts, pins)
    assert_valid(p, topo, hosts, pins)
    assert p.cut_bps > free.cut_bps
    assert p.pins == pins


def test_switches_go_where_their_bandwidth_is():
    """A rack whose uplinks outweigh its access links: the switch leaves its worker for the uplinks' host."""
    fast, slow = LinkProfile(bandwidth_bps=40 * 10**9), LinkProfile(bandwidth_bps=10**9)
    nodes = {n: Node(n, "worker") for n in ("w0", "w1", "w2")}
    nodes.update({s: Node(s, "switch") for s in ("tor0", "tor1")})
    links = [Link("w0", "tor0", "host", slow, slow), Link("w1", "tor1", "host", slow, slow),
             Link("w2", "tor1", "host", slow, slow), Link("tor0", "tor1", "fabric", fast, fast)]
    topo = Topology(name="t", nodes=nodes, links=links).validate()
    hosts = make_hosts(1, 2)
    p = place(topo, hosts, {"w0": "h0"})
    assert p.host_of("tor0") == "h1" and p.host_of("w0") == "h0"
    assert [(c.a, c.b) for c in p.cut_links] == [("w0", "tor0")] and p.cut_bps == 2 * 10**9
    assert_valid(p, topo, hosts, {"w0": "h0"})


def test_gpus_and_memory_are_counted():
    topo = generated("star", {"gpus": 1, "memory_bytes": 4 * 2**30, "cpus": 1}, n=6)
    hosts = make_hosts(8, 8, 8, gpus=(4, 0, 2), memory=(None, "64g", "64g"))
    p = place(topo, hosts)
    assert_valid(p, topo, hosts)
    assert {load.host: load.gpus_used for load in p.loads} == {"h0": 4, "h1": 0, "h2": 2}
    hosts = make_hosts(8, 8, gpus=(4, 4), memory=("8g", "8g"))
    with pytest.raises(TopologyError, match=r"need 24 GiB, the hosts have 16 GiB in all \(8 GiB short\)") as exc:
        place(topo, hosts)
    assert exc.value.file == "hosts.yaml" and exc.value.path == "hosts[*].capacity.memory"


# -- placement: shortfalls are refused, naming them ------------------------------------------------------


def test_too_few_cores_names_the_shortfall():
    with pytest.raises(TopologyError) as exc:
        place(generated("fat-tree", k=4), make_hosts(4, 8))
    e = exc.value
    assert (e.file, e.path) == ("hosts.yaml", "hosts[*].capacity.cores")
    assert "they need 16 cores, the hosts have 12 cores in all (4 cores short)" in str(e)


def test_too_few_gpus_names_the_shortfall():
    with pytest.raises(TopologyError, match=r"need 4 GPUs, the hosts have 3 GPUs in all \(1 GPUs short\)"):
        place(generated("star", {"gpus": 1}, n=4), make_hosts(8, 8, gpus=(1, 2)))


def test_a_worker_bigger_than_every_host():
    with pytest.raises(TopologyError, match=r"worker w0 needs 6 cores, more than any host has \(the most: 4 cores on h1\)"):
        place(generated("star", {"cpus": 6}, n=1), make_hosts(2, 4, 4))


def test_workers_that_do_not_pack():
    # 3 workers of 2 cores, 2 hosts of 3 cores: 6 <= 6 in total, but each host holds one worker
    with pytest.raises(TopologyError, match="do not pack onto the hosts") as exc:
        place(generated("star", {"cpus": 2}, n=3), make_hosts(3, 3))
    assert exc.value.path == "hosts[*].capacity"


def test_pins_that_overfill_a_host():
    with pytest.raises(TopologyError, match="the workers pinned to h0 need 3 cores, it has 2 cores") as exc:
        place(generated("star", n=4), make_hosts(2, 4), {"w0": "h0", "w1": "h0", "w2": "h0"})
    assert exc.value.path == "--pin" and exc.value.value == ["w0", "w1", "w2"]


def test_bad_pins():
    topo, hosts = generated("star", n=2), make_hosts(2, 2)
    with pytest.raises(TopologyError, match="no node 'w9' in topology star"):
        place(topo, hosts, {"w9": "h0"})
    with pytest.raises(TopologyError, match=r"no host 'h7' in the hosts file \(hosts: h0, h1\)"):
        place(topo, hosts, {"w0": "h7"})
    assert parse_pins(["w0=h0", " s0 = h1 ", "w0=h0"]) == {"w0": "h0", "s0": "h1"}
    for bad in (["w0"], ["=h0"], ["w0="], ["w0=h0", "w0=h1"]):
        with pytest.raises(TopologyError) as exc:
            parse_pins(bad)
        assert exc.value.path == "--pin"


# -- placement: what it achieves ---------------------------------------------------------------------------

G = 10**9
# (topology, hosts' cores, the partitioner's cut, round-robin's cut), both directions, in bit/s.
# The partitioner's figures are the minimum: e.g. a k=4 fat-tree over 2 hosts must cut at least its
# bisection (8 links of 10 Gbit/s, 20 both ways).
COMPARISON = [
    (("fat-tree", {"k": 4}), (8, 8), 160 * G, 480 * G),
    (("fat-tree", {"k": 4}), (4, 4, 4, 4), 240 * G, 640 * G),
    (("fat-tree", {"k": 8}), (64, 64), 1280 * G, 3840 * G),
    (("fat-tree", {"k": 8}), (32, 32, 32, 32), 1920 * G, 5760 * G),
    (("leaf-spine", {}), (8, 8), 80 * G, 240 * G),
    (("leaf-spine", {}), (4, 4, 4, 4), 120 * G, 360 * G),
]


@pytest.mark.parametrize("spec, cores, best, round_robin", COMPARISON,
                         ids=[f"{s[0]}{s[1]}-{len(c)}hosts" for s, c, _, _ in COMPARISON])
def test_partitioner_cuts_less_than_round_robin(spec, cores, best, round_robin):
    topo, hosts = generated(spec[0], {"cpus": 1}, **spec[1]), make_hosts(*cores)
    p = place(topo, hosts)
    rr = place(topo, hosts, method="round-robin")
    assert_valid(p, topo, hosts)
    assert rr.method == "round-robin" and all(load.cores_used <= load.cores for load in rr.loads)
    assert p.cut_bps == best and rr.cut_bps == round_robin
    assert p.cut_bps < rr.cut_bps


def test_fat_tree_over_two_hosts_keeps_each_pod_whole():
    topo, hosts = generated("fat-tree", k=4), make_hosts(8, 8)
    p = place(topo, hosts)
    assert {c.tier for c in p.cut_links} == {"agg-core"}
    for pod in range(4):
        members = [f"edge{pod}-{i}" for i in range(2)] + [f"agg{pod}-{i}" for i in range(2)]
        members += [f"w{4 * pod + i}" for i in range(4)]
        assert len({p.host_of(n) for n in members}) == 1, f"pod {pod} is split"
    assert sorted(len(load.workers) for load in p.loads) == [8, 8]
    # the cores are shared out too (each has as much bandwidth to both hosts)
    assert sorted(sum(p.host_of(f"core{i}") == h for i in range(4)) for h in hosts.names) == [2, 2]


def test_a_rack_that_fits_nowhere_whole_is_split():
    topo, hosts = generated("star", n=6), make_hosts(4, 2)
    p = place(topo, hosts)
    assert_valid(p, topo, hosts)
    assert p.host_of("s0") == "h0" and len(p.cut_links) == 2


def test_one_host_cuts_nothing():
    topo, hosts = generated("fat-tree", k=4), make_hosts(16)
    p = place(topo, hosts)
    assert p.cut_links == () and p.cut_bps == 0 and set(p.assignment.values()) == {"h0"}


def test_deterministic():
    topo = generated("fat-tree", k=4)
    nodes = list(topo.nodes)
    random.Random(3).shuffle(nodes)
    shuffled = Topology(name="x", nodes={n: topo.nodes[n] for n in nodes}, links=list(reversed(topo.links))).validate()
    hosts = make_hosts(6, 6, 6)
    first = place(shuffled, hosts).to_json()
    for _ in range(3):
        assert place(shuffled, hosts).to_json() == first


def test_deterministic_across_processes():
    """No dependence on hash seeds (set order of strings): two interpreters, two seeds, one answer."""
    code = textwrap.dedent("""
        import json
        from testbed.topology.generators import GENERATORS
        from testbed.cluster.hosts import hosts_from_data
        from testbed.topology.model import Topology
        from testbed.cluster.placement import place
        nodes, links = GENERATORS["leaf-spine"].generate({"leaves": 5, "spines": 3, "hosts_per_leaf": 3}, {}, {})
        topo = Topology(name="ls", nodes=nodes, links=links).validate()
        hosts = hosts_from_data({"hosts": [{"name": f"h{i}", "ssh": f"h{i}", "underlay": f"10.9.0.{i + 1}",
                                            "capacity": {"cores": c}} for i, c in enumerate((7, 5, 4))]})
        print(json.dumps(place(topo, hosts, {"spine2": "h2"}).to_json(), sort_keys=True))
    """)
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1]


# -- testbed topo FILE --hosts -----------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", "from testbed.cli import main; main()", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_json_includes_the_placement():
    r = cli("topo", "fat-tree", "--hosts", str(EXAMPLE), "--pin", "core0=node-a", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [h["name"] for h in doc["hosts"]["hosts"]] == ["node-a", "node-b"]
    pl = doc["placement"]
    assert pl["method"] == "partition" and pl["pins"] == {"core0": "node-a"} and pl["nodes"]["core0"] == "node-a"
    assert set(pl["nodes"]) == set(doc["workers"]) | set(doc["switches"])
    assert pl["cut_bps"] == 160 * G and len(pl["cut_links"]) == 8 and pl["round_robin_cut_bps"] > 160 * G
    link = pl["cut_links"][0]
    assert set(link) == {"index", "endpoints", "tier", "hosts", "ab_bps", "ba_bps", "bandwidth_bps"}
    assert link["tier"] == "agg-core" and link["bandwidth_bps"] == 20 * G
    assert [(h["host"], len(h["workers"]), h["cores_used"], h["cores"]) for h in pl["hosts"]] == [
        ("node-a", 8, 8, 8), ("node-b", 8, 8, 8)]
    assert pl["hosts"][0]["memory_used"] == 16 * 2**30 and pl["hosts"][0]["memory"] == 32 * 2**30


def test_cli_text_shows_hosts_cut_links_and_total():
    r = cli("topo", "fat-tree", "--hosts", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "placement on 2 hosts" in out and "root@node-a.lab" in out and "admin@node-b.lab:2222" in out
    assert "8: w0..w7" in out and "8: w8..w15" in out and "8 / 8" in out
    assert "cut links (8)" in out and "agg-core" in out
    assert "cut bandwidth: 160gbit (both directions) over 8 links; dealing nodes round-robin would cut 480gbit" in out


def test_cli_errors():
    r = cli("topo", "fat-tree", "--hosts", str(EXAMPLE), "--set", "params.k=8")
    assert r.returncode == 2 and "they need 128 cores, the hosts have 16 cores in all (112 cores short)" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("topo", "fat-tree", "--pin", "w0=node-a")
    assert r.returncode == 2 and "--pin: needs --hosts" in r.stderr
    r = cli("topo", "fat-tree", "--hosts", str(EXAMPLE), "--pin", "w0=nowhere")
    assert r.returncode == 2 and "no host 'nowhere'" in r.stderr
