"""The state schema (testbed/state_schema.py) on its own: what testbed writes validates, anything
else is refused with the field that is wrong.

- a state written by a real `testbed up` (and changed by fault commands) validates, and survives
  a JSON round trip and any order of its keys;
- synthetic states built as lifecycle.up builds them (every record type: delay lines, MPS daemon,
  `node slow` groups, a partition, leftovers; netns, docker and bare workers) validate;
- any field testbed acts on, changed to a wrong type, a foreign namespace, path or cgroup, is
  refused, and the first problem names exactly that field (hypothesis);
- an unknown field in any record is refused by name; bools are not ints, "1" is not 1;
- the store's StateError names the file, the field and the value.
"""

from __future__ import annotations

import copy
import json
import os
import random
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from testbed import store
from testbed.errors import StateError
from testbed.lifecycle import _link_records, owner_label
from testbed.net import names
from testbed.runtime import cgroups
from testbed.state_schema import StateDocument, check
from testbed.topology.loader import load_topology_text
from testbed.topology.plan import plan_network

NAME = "sx"
HIER = cgroups.hierarchy()
TOPO = """
name: schema
nodes:
  w0: {kind: worker, cpus: 1}
  w1: {kind: worker, memory: 1g}
  w2: {kind: worker}
  s0: {kind: switch}
links:
  - {endpoints: [w0, s0], bandwidth: 1gbit}
  - {endpoints: [w1, s0], bandwidth: 1gbit, delay: 1ms}
  - {endpoints: [w2, s0], bandwidth: 100mbit}
"""
DOCKER_ID = "0123456789abcdef" * 4


def cgroup_dirs(group: str, node: str) -> list[str]:
    return [str(p) for p in cgroups.group_paths(group, node)] if HIER else []


def synthetic_state(directory: Path, name: str = NAME, runtime: str = "netns", topo_text: str = TOPO) -> dict:
    """A state as lifecycle.up, the runtimes, the builder and the fault commands write it."""
    topo = load_topology_text(topo_text, "<schema test>")
    plan = plan_network(topo)
    d = str(directory)
    workers: dict[str, Any] = {}
    for w in topo.workers:
        ns = names.netns(name, w)
        env = {"TESTBED_NAME": name, "TESTBED_NODE": w, "TESTBED_LOG_DIR": f"{d}/logs/{w}",
               "NCCL_SOCKET_IFNAME": "=eth0", "CUDA_VISIBLE_DEVICES": "", "TESTBED_TIME_DILATION": "1.0"}
        if runtime == "netns":
            workers[w] = {"netns": ns, "runtime": "netns", "pid": 4100 + len(workers), "starttime": 123456,
                          "cgroups": cgroup_dirs(name, w), "dir": f"{d}/workers/{w}", "log_dir": f"{d}/logs/{w}",
                          "share_ipc": False, "net_admin": False, "env": env, "node": topo.nodes[w].to_json()}
        elif runtime == "docker":
            workers[w] = {"netns": ns, "id": DOCKER_ID, "pid": 4100 + len(workers), "starttime": 123456,
                          "container": ns, "docker_host": "unix:///run/testbed-docker/docker.sock", "env": env,
                          "hosts": plan.hosts(), "net_admin": False}
        else:
            workers[w] = {"netns": ns}
    delay = next(lp for lp in plan.links if topo.links[lp.index].ab.delay_s > 0)
    link = topo.links[delay.index]
    return {
        "schema": store.SCHEMA_VERSION, "name": name, "status": "up", "pid": 4000, "pid_start": 120000,
        "created": "2026-01-01T00:00:00+00:00", "state_root": str(Path(d).parent), "owner": owner_label(name),
        "topology": topo.to_json(), "time_dilation": 1.0,
        "dilation": {"factor": 1.0, "setting": "none", "compute": 1.0, "network": None, "cap_cpu": False,
                     "reasons": ["no dilation (real time)"]},
        "gpu": {"policy": "round-robin", "mps": True, "devices": [], "assignment": {w: [] for w in topo.workers},
                "mps_daemon": {"pid": 4050, "starttime": 120500, "pipe_dir": f"{d}/mps/pipe",
                               "log_dir": f"{d}/mps/log"}},
        "plan": plan.to_json(), "capabilities": {"netem": False, "htb": True, "notes": {}},
        "latency_floor_s": 3e-5, "no_delay_element": [{"link": 0, "from": "w0", "to": "s0", "delay_s": 0.0}],
        "delay_threshold_s": 1.3e-4,
        "runtime": {"kind": runtime, "net_admin": False, "workers": workers},
        "links": _link_records(topo, plan),
        "resources": {
            "switch_netns": [names.netns(name, s) for s in topo.switches],
            "worker_netns": [names.netns(name, w) for w in topo.workers],
            "delay_lines": [{"pid": 4060, "start": 120600, "link_id": str(delay.index),
                             "ns_a": names.netns(name, link.a), "if_a": delay.a.ifname,
                             "ns_b": names.netns(name, link.b), "if_b": delay.b.ifname,
                             "control": f"{d}/dl-{delay.index}.sock", "pid_file": f"{d}/dl-{delay.index}.pid",
                             "link": delay.index}],
        },
        "timings": {"links": 0.1, "total": 1.0},
        "faults": {
            "nodes": {"w0": {"state": "up", "cpus": 0.5, "cgroup": cgroup_dirs(f"{name}.faults", "w0")},
                      "w2": {"state": "crashed", "since": 1767225600.5}},
            "log": [{"t": 1767225600.0, "what": "node slow w0 cpus=0.5"}],
            "partition": {"groups": [["w0"], ["w1", "w2"]], "netns": [names.netns(name, w) for w in topo.workers],
                          "since": 1767225601.0},
        },
        "leftovers": [{"what": "namespace tb-sx-w9", "time": "2026-01-01T00:00:01+00:00"}],
    }


@pytest.fixture(scope="module")
def tbdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("state") / NAME
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def full(tbdir) -> dict:
    st_ = synthetic_state(tbdir)
    assert check(st_, NAME, tbdir) == []
    return st_


def at(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def put(doc: Any, path: tuple, value: Any) -> None:
    at(doc, path[:-1])[path[-1]] = value


def dotted(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


# -- what testbed writes validates ----------------------------------------------------------------------------


def test_a_real_up_validates_and_round_trips(testbed):
    """What `testbed up` wrote, then what fault commands changed (a link's profile, a partition,
    a straggler, a restarted worker, a link down), validates as written, after a JSON round
    trip, and with its keys in any order."""
    from testbed import paths
    from testbed.faults import control

    topo = load_topology_text(TOPO, "<schema test>")
    state = testbed(topo, time_dilation="none")
    name = state["name"]
    control.link_set(name, "w1", "s0", {"bandwidth_bps": 50_000_000, "delay_s": 0.002})
    control.partition(name, [["w0"], ["w1", "w2"]])
    control.node_slow(name, "w2", 0.5)
    control.node_down(name, "w1")
    control.node_up(name, "w1")      # the worker restarted: a new record merged into the old one
    control.link_down(name, "w0", "s0")
    raw = json.loads(paths.state_file(name).read_text())
    assert raw["faults"]["partition"] and raw["links"][1]["profile"] and raw["resources"]["delay_lines"]
    assert check(raw, name, paths.directory(name)) == []
    assert check(json.loads(json.dumps(raw)), name, paths.directory(name)) == []
    rng = random.Random(0)
    for _ in range(5):
        assert check(_shuffled(raw, rng), name, paths.directory(name)) == []
    assert store.load(name) == raw   # load returns the plain document
    control.restore_all(name)
    assert check(json.loads(paths.state_file(name).read_text()), name, paths.directory(name)) == []


def _shuffled(doc: Any, rng: random.Random) -> Any:
    if isinstance(doc, dict):
        items = list(doc.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(doc, list):
        return [_shuffled(v, rng) for v in doc]
    return doc


@pytest.mark.parametrize("runtime", ["netns", "docker", "bare"])
def test_synthetic_states_validate(tbdir, runtime):
    assert check(synthetic_state(tbdir, runtime=runtime), NAME, tbdir) == []


def test_checked_gives_the_topology_only_of_a_valid_state(tbdir):
    """`store.load_with_topology` (status at k=16) reuses the check's own parse of the topology."""
    from testbed.state_schema import checked
    from testbed.topology.model import Topology

    good = synthetic_state(tbdir)
    found, topo = checked(good, NAME, tbdir)
    assert found == [] and topo == Topology.from_json(good["topology"]).validate()
    bad = copy.deepcopy(good)
    bad["runtime"]["workers"]["w0"]["pid"] = True
    found, topo = checked(bad, NAME, tbdir)
    assert [f for f, _, _ in found] == ["runtime.workers.w0.pid"] and topo is None


def test_the_store_reads_back_every_string_save_writes():
    """store._parse: pydantic-core's parser refuses a lone surrogate (a non-UTF-8 file name becomes one,
    and `save` writes it as \\udce9) and nesting past 200; json reads them, and a nesting too deep
    for json is its RecursionError, which load_unchecked turns into "corrupt"."""
    doc = {"source": "/tmp/caf\udce9.yaml", "params": {"a": [[[[[[1]]]]]] * 2}}
    assert store._parse(json.dumps(doc, separators=(",", ":")).encode()) == doc
    deep = "[" * 500 + "]" * 500
    assert store._parse(deep.encode()) == json.loads(deep)
    with pytest.raises(RecursionError):
        store._parse(b"[" * 100_000)


def test_a_state_being_built_validates(tbdir):
    """The first state `up` saves: workers known by their namespace only, no delay line, no MPS."""
    st_ = synthetic_state(tbdir, runtime="netns")
    st_.update(status="building", timings={})
    st_["runtime"]["workers"] = {w: {"netns": names.netns(NAME, w)} for w in st_["runtime"]["workers"]}
    st_["resources"]["delay_lines"] = []
    st_["gpu"]["mps_daemon"] = None
    for key in ("faults", "leftovers"):
        del st_[key]
    assert check(st_, NAME, tbdir) == []


def test_a_generated_fat_tree_validates(tbdir):
    from testbed.topology.generators import GENERATORS
    from testbed.topology.model import Topology

    nodes, links = GENERATORS["fat-tree"].generate({"k": 4})
    topo = Topology(name="fat-tree", nodes=nodes, links=links, generator="fat-tree", params={"k": 4}).validate()
    doc = synthetic_state(tbdir)
    doc["topology"] = topo.to_json()
    doc["links"] = _link_records(topo, plan_network(topo))
    doc["resources"] = {"switch_netns": [names.netns(NAME, s) for s in topo.switches],
                        "worker_netns": [names.netns(NAME, w) for w in topo.workers], "delay_lines": []}
    doc["faults"] = {"nodes": {}, "log": []}
    doc["runtime"]["workers"] = {w: {"netns": names.netns(NAME, w)} for w in topo.workers}
    assert check(doc, NAME, tbdir) == []


# -- what it does not write is refused, naming the field ------------------------------------------------------


SEGMENT = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=12)
NOT_STRINGS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                        st.lists(st.integers(), max_size=2), st.dictionaries(SEGMENT, st.integers(), max_size=2))


def _not_int(required: bool, minimum: int) -> st.SearchStrategy:
    """Values a strict int >= minimum field refuses (None only where the field is required)."""
    wrong = [st.integers(max_value=minimum - 1), st.booleans(), st.floats(allow_nan=False),
             st.integers(min_value=minimum, max_value=10**6).map(str), st.text(max_size=8),
             st.lists(st.integers(min_value=minimum), min_size=1, max_size=2)]
    if required:
        wrong.append(st.none())
    return st.one_of(*wrong)


def _foreign_paths(expected: str) -> st.SearchStrategy:
    """Paths that do not resolve to `expected` (and values that are no path)."""
    parent = os.path.dirname(expected)
    return st.one_of(
        st.builds(lambda s: f"/etc/{s}", SEGMENT), st.just("/etc/passwd"), st.just("/"),
        st.builds(lambda s: f"{expected}/{s}", SEGMENT),                 # below it
        st.builds(lambda s: f"{parent}/{s}x", SEGMENT).filter(lambda p: p != expected),
        st.builds(lambda s: f"{expected}/../{s}", SEGMENT),              # '..'
        st.builds(lambda s: f"{expected}/../../{os.path.basename(expected)}", SEGMENT),
        st.builds(lambda s: f"{s}/{os.path.basename(expected)}", SEGMENT),   # relative
        st.builds(lambda s: expected.replace(f"/{NAME}/", f"/{NAME}{s}/", 1), SEGMENT),  # another testbed's
        NOT_STRINGS,
    )


def _foreign_cgroups(expected: str) -> st.SearchStrategy:
    p = Path(expected)
    mount, group, node = p.parent.parent.parent, p.parent.name, p.name
    return st.one_of(
        st.builds(lambda s: f"{mount}/{cgroups.TOP}/{s}/{node}", SEGMENT).filter(lambda c: c != expected),
        st.builds(lambda s: f"{mount}/{cgroups.TOP}/{group}/{s}", SEGMENT).filter(lambda c: c != expected),
        st.just(f"{mount}/{cgroups.TOP}/../{cgroups.TOP}/{group}/{node}"),
        st.just(f"{mount}/{cgroups.TOP}/{group}/{node}/.."),
        st.just(f"/tmp/{cgroups.TOP}/{group}/{node}"),
        st.just(f"{cgroups.CGROUP_ROOT}/not-a-mount/{cgroups.TOP}/{group}/{node}"),
        st.just(f"{cgroups.TOP}/{group}/{node}"),
        st.just(f"{mount}/{group}/{node}"),
        # not as testbed writes it (refused, not normalised: the check is string operations)
        st.just(f"{mount}//{cgroups.TOP}/{group}/{node}"),
        st.just(f"{mount}/{cgroups.TOP}/./{group}/{node}"),
        st.just(f"{mount}/{cgroups.TOP}/{group}/{node}/"),
        st.just(f"{mount}/{cgroups.TOP}/{group}/{node}/."),
        st.just(f"/{cgroups.TOP}/{group}/{node}"),   # no mount at all (an empty one is not the cwd's)
        NOT_STRINGS,
    )


def _foreign_namespaces(valid: set[str]) -> st.SearchStrategy:
    return st.one_of(
        st.just("../../proc/1/ns/net"), st.just(f"tb-{NAME}-w9"), st.just("tb-other-w0"),
        st.sampled_from([f"tb-{NAME}-w0", f"tb-{NAME}-w1", f"tb-{NAME}-w2", f"tb-{NAME}-s0", f"tb-{NAME}x-s0"]),
        st.builds(lambda s: f"tb-{NAME}-{s}", SEGMENT), SEGMENT, NOT_STRINGS,
    ).filter(lambda v: not ((v is None or isinstance(v, str)) and v in valid))


def _ns(*nodes: str) -> set[str]:
    return {names.netns(NAME, n) for n in nodes}


def acted_on(full: dict) -> list[tuple[tuple, st.SearchStrategy]]:
    """(path, values it must refuse) for every field testbed acts on, in the full netns state."""
    w0 = ("runtime", "workers", "w0")
    dl = ("resources", "delay_lines", 0)
    mps = ("gpu", "mps_daemon")
    delayed = full["resources"]["delay_lines"][0]["link"]
    out = [
        (("schema",), st.one_of(st.integers().filter(lambda v: v != 1), st.just(True), st.just(1.0), st.just("1"))),
        (("name",), st.one_of(SEGMENT.filter(lambda v: v != NAME), NOT_STRINGS)),
        (("status",), st.one_of(st.text(max_size=10).filter(lambda v: v not in ("building", "up", "removing")),
                                st.just("UP"), NOT_STRINGS)),
        (("pid",), _not_int(True, 1)),
        (("pid_start",), _not_int(True, 0)),
        (("runtime", "kind"), st.one_of(st.just("podman"), st.just("Netns"), NOT_STRINGS)),
        (w0 + ("pid",), _not_int(False, 1)),
        (w0 + ("starttime",), _not_int(True, 0)),      # required: w0 has a PID
        (w0 + ("netns",), _foreign_namespaces({names.netns(NAME, "w0")} | {None})),
        (w0 + ("dir",), _foreign_paths(full["runtime"]["workers"]["w0"]["dir"]).filter(lambda v: v is not None)),
        (w0 + ("log_dir",), _foreign_paths(full["runtime"]["workers"]["w0"]["log_dir"]).filter(
            lambda v: v is not None)),
        (w0 + ("net_admin",), st.one_of(st.integers(), st.text(max_size=5), st.lists(st.booleans(), max_size=1))),
        (w0 + ("share_ipc",), st.one_of(st.integers(), st.text(max_size=5))),
        (w0 + ("env", "TESTBED_NODE"), st.one_of(st.integers(), st.booleans(), st.none(), st.lists(SEGMENT))),
        (w0 + ("node", "name"), st.sampled_from(["w1", "s0", "../w0", ""])),
        (w0 + ("node", "kind"), st.sampled_from(["switch", "Worker", ""])),
        (("resources", "switch_netns", 0), _foreign_namespaces(_ns("s0"))),
        (("resources", "worker_netns", 1), _foreign_namespaces(_ns("w0", "w1", "w2"))),
        (dl + ("pid",), _not_int(True, 1)),
        (dl + ("start",), _not_int(True, 0)),
        (dl + ("ns_a",), _foreign_namespaces(_ns(full["topology"]["links"][delayed]["endpoints"][0]))),
        (dl + ("ns_b",), _foreign_namespaces(_ns(full["topology"]["links"][delayed]["endpoints"][1]))),
        (dl + ("control",), _foreign_paths(full["resources"]["delay_lines"][0]["control"])),
        (dl + ("pid_file",), _foreign_paths(full["resources"]["delay_lines"][0]["pid_file"])),
        (dl + ("link",), st.one_of(st.integers(max_value=-1), st.integers(min_value=len(full["links"])),
                                   NOT_STRINGS.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)))),
        (dl + ("if_a",), st.one_of(st.text(min_size=16, max_size=20), st.just(""), st.just("a/b"),
                                   st.just("eth 0"), NOT_STRINGS)),
        (mps + ("pid",), _not_int(True, 1)),
        (mps + ("starttime",), _not_int(True, 0)),
        (mps + ("pipe_dir",), _foreign_paths(full["gpu"]["mps_daemon"]["pipe_dir"])),
        (mps + ("log_dir",), _foreign_paths(full["gpu"]["mps_daemon"]["log_dir"])),
        (("faults", "partition", "netns", 0), _foreign_namespaces(_ns("w0", "w1", "w2"))),
        (("links", 1, "ifnames", 0), st.one_of(st.text(min_size=16, max_size=20), st.just(""), st.just("../x"),
                                               NOT_STRINGS)),
        (("links", 1, "index"), st.one_of(st.integers().filter(lambda v: v != 1), st.just("1"), st.just(True))),
        (("links", 1, "state"), st.sampled_from(["DOWN", "gone", "", None, 1])),
        (("topology", "nodes", 0, "name"), st.sampled_from(["../../x", "", "a b", "-x", "x" * 65, None, 3])),
    ]
    if HIER:
        out += [
            (w0 + ("cgroups", 0), _foreign_cgroups(full["runtime"]["workers"]["w0"]["cgroups"][0])),
            (("faults", "nodes", "w0", "cgroup", 0), _foreign_cgroups(full["faults"]["nodes"]["w0"]["cgroup"][0])),
        ]
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_wrong_value_in_any_acted_on_field_is_refused_by_name(full, tbdir, data):
    fields = acted_on(full)
    path, wrong = data.draw(st.sampled_from(fields), label="field")
    value = data.draw(wrong, label="value")
    doc = copy.deepcopy(full)
    put(doc, path, value)
    found = check(doc, NAME, tbdir)
    assert found, f"{dotted(path)} = {value!r} was accepted"
    assert found[0][0] == dotted(path), found[:3]


@pytest.mark.skipif(not HIER, reason="no cgroup hierarchy on this machine")
@pytest.mark.parametrize("field", [("runtime", "workers", "w0", "cgroups", 0), ("faults", "nodes", "w0", "cgroup", 0)])
@pytest.mark.parametrize("form", ["{mount}//{top}/{group}/{node}", "{mount}/{top}/./{group}/{node}",
                                  "{mount}/{top}/{group}/{node}/", "{mount}/{top}/{group}/{node}/.",
                                  "/{top}/{group}/{node}"])
def test_a_cgroup_path_not_as_testbed_writes_it_is_refused(full, tbdir, field, form):
    """Refused, not normalised (the check is string operations; every one of these was accepted, or
    read against the working directory, by a version of it)."""
    good = Path(at(full, field))
    doc = copy.deepcopy(full)
    bad = form.format(mount=good.parent.parent.parent, top=cgroups.TOP, group=good.parent.name, node=good.name)
    put(doc, field, bad)
    found = check(doc, NAME, tbdir)
    assert found and found[0][0] == dotted(field), (bad, found[:3])


@pytest.mark.skipif(not HIER, reason="no cgroup hierarchy on this machine")
def test_a_cgroup_path_without_its_mount_is_not_read_from_the_working_directory(full, tbdir, monkeypatch):
    """/testbed/NAME/NODE has an empty mount part; resolved, '' would be the working directory, which
    may be a cgroup mount."""
    good = full["runtime"]["workers"]["w0"]["cgroups"][0]
    mount = str(Path(good).parent.parent.parent)
    monkeypatch.chdir(mount)
    doc = copy.deepcopy(full)
    doc["runtime"]["workers"]["w0"]["cgroups"][0] = good[len(mount):]
    found = check(doc, NAME, tbdir)
    assert found and found[0][0] == "runtime.workers.w0.cgroups[0]", found[:3]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_docker_fields_refuse_what_docker_workers_do_not_have(tbdir, data):
    doc = synthetic_state(tbdir, runtime="docker")
    w0 = ("runtime", "workers", "w0")
    path, wrong = data.draw(st.sampled_from([
        (w0 + ("docker_host",), st.one_of(st.sampled_from(["ssh://evil.example", "http://h:2375", "unix://rel",
                                                           "tcp://h", "tcp://h:port", ""]),
                                            NOT_STRINGS.filter(lambda v: v is not None))),
        (w0 + ("container",), _foreign_namespaces({names.netns(NAME, "w0"), None})),
        (w0 + ("id",), st.one_of(st.text(alphabet="0123456789abcdef", max_size=63), st.just(DOCKER_ID.upper()),
                                 st.just("tb-sx-w0"), st.just(DOCKER_ID + "0"), NOT_STRINGS.filter(
                                     lambda v: v is not None))),
    ]), label="field")
    value = data.draw(wrong, label="value")
    put(doc, path, value)
    found = check(doc, NAME, tbdir)
    assert found and found[0][0] == dotted(path), (value, found[:3])


def records(full: dict) -> list[tuple]:
    """Paths of every record the schema types (each refuses fields it does not know)."""
    return [(), ("topology",), ("topology", "nodes", 0), ("topology", "links", 0), ("topology", "links", 0, "ab"),
            ("runtime",), ("runtime", "workers", "w0"), ("runtime", "workers", "w0", "node"),
            ("resources",), ("resources", "delay_lines", 0), ("gpu",), ("gpu", "mps_daemon"),
            ("links", 0), ("faults",), ("faults", "nodes", "w0"), ("faults", "partition"), ("faults", "log", 0),
            ("leftovers", 0)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_unknown_field_in_any_record_is_refused_by_name(full, tbdir, data):
    path = data.draw(st.sampled_from(records(full)), label="record")
    key = data.draw(SEGMENT, label="key")
    doc = copy.deepcopy(full)
    assume(key not in at(doc, path) and key != "schema_version")
    at(doc, path)[key] = data.draw(st.one_of(st.integers(), SEGMENT), label="value")
    found = check(doc, NAME, tbdir)
    assert found and found[0][:2] == (dotted(path + (key,)), "unknown field"), found[:3]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_missing_acted_on_field_is_refused_by_name(full, tbdir, data):
    path = data.draw(st.sampled_from([("name",), ("status",), ("pid",), ("pid_start",), ("schema",),
                                      ("topology",), ("runtime",), ("links",), ("resources",),
                                      ("runtime", "kind"), ("runtime", "workers"),
                                      ("resources", "delay_lines", 0, "pid"),
                                      ("resources", "delay_lines", 0, "pid_file"),
                                      ("gpu", "mps_daemon", "starttime"), ("gpu", "mps_daemon", "pipe_dir"),
                                      ("runtime", "workers", "w0", "starttime")]), label="field")
    doc = copy.deepcopy(full)
    del at(doc, path[:-1])[path[-1]]
    found = check(doc, NAME, tbdir)
    assert found and found[0][0] == dotted(path), found[:3]


def test_worker_keys_and_fault_nodes_are_nodes_of_the_topology(full, tbdir):
    doc = copy.deepcopy(full)
    doc["runtime"]["workers"]["s0"] = {"netns": names.netns(NAME, "s0")}
    assert check(doc, NAME, tbdir)[0][:2] == ("runtime.workers.s0", "not a worker of the topology")
    doc = copy.deepcopy(full)
    doc["faults"]["nodes"]["../x"] = {"state": "down"}
    assert check(doc, NAME, tbdir)[0][:2] == ("faults.nodes.../x", "not a node of the topology")


def test_a_record_names_only_its_own_things(full, tbdir):
    """Each worker's namespace, directories and cgroups are its own; delay lines their link's."""
    cases = [
        (("runtime", "workers", "w0", "netns"), names.netns(NAME, "w1")),
        (("runtime", "workers", "w0", "dir"), full["runtime"]["workers"]["w1"]["dir"]),
        (("runtime", "workers", "w0", "log_dir"), full["runtime"]["workers"]["w0"]["dir"]),
        (("resources", "delay_lines", 0, "link_id"), "0"),
        (("resources", "delay_lines", 0, "control"), full["resources"]["delay_lines"][0]["pid_file"]),
        (("gpu", "mps_daemon", "pipe_dir"), full["gpu"]["mps_daemon"]["log_dir"]),
        (("links", 0, "endpoints"), ["s0", "w0"]),
    ]
    if HIER:
        cases += [(("runtime", "workers", "w0", "cgroups", 0), full["runtime"]["workers"]["w1"]["cgroups"][0]),
                  (("runtime", "workers", "w0", "cgroups", 0), full["faults"]["nodes"]["w0"]["cgroup"][0]),
                  (("faults", "nodes", "w0", "cgroup", 0), full["runtime"]["workers"]["w0"]["cgroups"][0])]
    for path, value in cases:
        doc = copy.deepcopy(full)
        put(doc, path, value)
        found = check(doc, NAME, tbdir)
        assert found and found[0][0] == dotted(path), (path, found[:2])


def test_a_delayed_cut_links_namespace_and_line_are_its_own(full, tbdir):
    """Over several hosts without netem: a delayed cut link's own namespace (tb-NAME-~lINDEX) and
    its line, both TAPs in it, validate; another link's namespace, or one outside the topology, is
    refused by name, and so is a line with one TAP in a node's namespace."""
    dl = full["resources"]["delay_lines"][0]
    i, a = dl["link"], full["topology"]["links"][dl["link"]]["endpoints"][0]
    doc = copy.deepcopy(full)
    doc["resources"]["cut_netns"] = [names.cut_netns(NAME, i)]
    doc["resources"]["delay_lines"][0].update(ns_a=names.cut_netns(NAME, i), if_a="line-port",
                                              ns_b=names.cut_netns(NAME, i), if_b="line-tunnel")
    assert check(doc, NAME, tbdir) == []
    for path, value in ((("resources", "cut_netns", 0), names.cut_netns(NAME, 999)),
                        (("resources", "cut_netns", 0), names.cut_netns(NAME, 0) + "0"),
                        (("resources", "cut_netns", 0), "tb-other-~l0"),
                        (("resources", "delay_lines", 0, "ns_b"), names.cut_netns(NAME, i + 1)),
                        (("resources", "delay_lines", 0, "ns_a"), names.netns(NAME, a)),
                        (("resources", "delay_lines", 0, "ns_b"), names.netns(NAME, a))):
        bad = copy.deepcopy(doc)
        put(bad, path, value)
        found = check(bad, NAME, tbdir)
        assert found and found[0][0] == dotted(path), (path, value, found[:2])


def test_a_link_inside_the_directory_does_not_lead_out(full, tbdir, tmp_path):
    """workers/w0 made a symbolic link to a directory elsewhere: the path no longer resolves to
    where testbed puts it."""
    (tbdir / "workers").mkdir(exist_ok=True)
    link = tbdir / "workers" / "w0"
    link.symlink_to(tmp_path)
    try:
        found = check(full, NAME, tbdir)
        assert found and found[0][0] == "runtime.workers.w0.dir", found[:2]
    finally:
        link.unlink()
    assert check(full, NAME, tbdir) == []


def test_the_list_of_links_matches_the_topology(full, tbdir):
    doc = copy.deepcopy(full)
    doc["links"].pop()
    assert check(doc, NAME, tbdir)[0][0] == "links"
    doc = copy.deepcopy(full)
    doc["links"][0], doc["links"][1] = doc["links"][1], doc["links"][0]
    assert check(doc, NAME, tbdir)[0][0] == "links[0].index"


def test_an_invalid_topology_is_the_problem_reported(full, tbdir):
    """The rules that need the topology are not reported as problems of their own."""
    doc = copy.deepcopy(full)
    doc["topology"]["links"].append({"endpoints": ["w0", "nowhere"], "tier": "host",
                                     "ab": {"delay_s": 0.0}, "ba": {"delay_s": 0.0}})
    found = check(doc, NAME, tbdir)
    assert found[0][0] == "topology.links[3].endpoints" and "not a valid topology snapshot" in found[0][1]
    assert all(f.startswith("topology") for f, _, _ in found), found


def test_time_dilation_is_a_factor_or_a_factor_record(full, tbdir):
    for ok in (1, 2.5, {"factor": 2.0, "source": "test"}):
        assert check({**full, "time_dilation": ok}, NAME, tbdir) == []
    for bad in (0.5, True, "2", {"factor": "2"}, {"source": "x"}, float("inf")):
        assert check({**full, "time_dilation": bad}, NAME, tbdir)[0][0] == "time_dilation", bad


def test_a_testbed_name_that_is_not_one_is_refused(full, tbdir):
    assert check(full, "../sx", tbdir)[0][:2] == ("name", "not a testbed name")
    assert check(full, "other", tbdir)[0][0] == "name"


def test_without_its_context_nothing_validates(full):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        StateDocument.model_validate(full)


def test_the_store_error_names_file_field_and_value(state_dir):
    from testbed import paths

    doc = synthetic_state(paths.directory(NAME))
    doc["runtime"]["workers"]["w1"]["pid"] = "4101"
    with pytest.raises(StateError) as err:
        store.validate(NAME, doc)
    msg = str(err.value)
    assert str(paths.state_file(NAME)) in msg and "runtime.workers.w1.pid" in msg and "'4101'" in msg
    assert "cleanup" in msg
    doc["pid"] = True
    with pytest.raises(StateError, match=r"pid: .*\(got True\); 1 more: runtime\.workers\.w1\.pid"):
        store.validate(NAME, doc)
