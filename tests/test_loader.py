"""YAML loading: both forms, overrides, and one clear error per kind of bad input."""

import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from testbed.errors import TopologyError
from testbed.topology.loader import apply_overrides, load_topology, load_topology_text, topology_from_data
from testbed.topology.model import LinkProfile

REPO_TOPOLOGIES = Path(__file__).resolve().parent.parent / "topologies"

TWO_RACKS = """\
name: two-racks
defaults:
  link: {bandwidth: 10gbit, delay: 5us}
  worker: {cpus: 1, memory: 2g}
nodes:
  w0: {kind: worker}
  w1: {kind: worker, gpus: 2}
  tor0: {kind: switch}
  tor1: {kind: switch}
  spine0: {kind: switch}
links:
  - endpoints: [w0, tor0]
  - endpoints: [w1, tor1]
  - endpoints: [tor0, spine0]
    bandwidth: 40gbit
    delay: 10us
    loss: 0.01%
  - {endpoints: [tor1, spine0], bandwidth: 40gbit, queue: 2000}
"""


def write(tmp_path, text, name="topo.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def expect_error(tmp_path, text, path, value, reason=None, overrides=()):
    """Load `text` from a file; the error must name the file, the field path and the value."""
    f = write(tmp_path, text)
    with pytest.raises(TopologyError) as e:
        load_topology(f, overrides)
    msg = str(e.value)
    assert e.value.exit_code == 2
    assert str(f) in msg, msg
    if path is not None:
        assert path in msg, msg
        assert e.value.path == path, msg
    if value is not None:
        assert repr(value) in msg, msg
    if reason:
        assert reason in msg, msg
    return e.value


# -- good files ---------------------------------------------------------------------------------------------


def test_explicit_form(tmp_path):
    t = load_topology(write(tmp_path, TWO_RACKS))
    assert t.name == "two-racks" and t.source == str(tmp_path / "topo.yaml")
    assert t.workers == ["w0", "w1"] and t.switches == ["tor0", "tor1", "spine0"]
    assert t.nodes["w0"].cpus == 1 and t.nodes["w0"].memory_bytes == 2 * 2**30
    assert t.nodes["w1"].gpus == 2 and t.nodes["tor0"].cpus is None  # worker defaults only on workers
    l0, l1, l2, l3 = t.links
    assert l0.tier == "host" and l2.tier == "fabric"
    assert l0.ab == l0.ba == LinkProfile(bandwidth_bps=10**10, delay_s=5e-6)
    assert l2.ab == LinkProfile(bandwidth_bps=4 * 10**10, delay_s=1e-5, loss=0.0001)
    assert l3.ab.queue == 2000 and l3.ab.delay_s == 5e-6


def test_forward_reverse_and_tiers(tmp_path):
    text = """\
    name: asym
    tiers:
      uplink: {bandwidth: 1gbit, reverse: {bandwidth: 100mbit}}
    nodes: {w0: {kind: worker}, s0: {kind: switch}, s1: {kind: switch}}
    links:
      - {endpoints: [w0, s0], forward: {delay: 1ms}, reverse: {loss: 1%}}
      - {endpoints: [s0, s1], tier: uplink, jitter: 10us}
    """
    t = load_topology(write(tmp_path, text))
    a, b = t.links
    assert a.ab.delay_s == 0.001 and a.ba.delay_s == 0 and a.ba.loss == 0.01 and a.ab.loss == 0
    assert b.tier == "uplink" and b.ab.bandwidth_bps == 10**9 and b.ba.bandwidth_bps == 10**8
    assert b.ab.jitter_s == b.ba.jitter_s == 1e-5


def test_generator_form(tmp_path):
    text = """\
    name: ft
    generator: fat-tree
    params: {k: 4}
    defaults: {link: {delay: 3us}, worker: {gpus: 1}}
    tiers:
      agg-core: {bandwidth: 40gbit, forward: {loss: 0.1%}}
    runtime: netns
    time_dilation: 2
    gpu_policy: packed
    gpu_sharing: mps
    addressing: {pool: 10.20.0.0/16, fabric_pool: 10.30.0.0/16}
    description: a test
    """
    t = load_topology(write(tmp_path, text))
    assert t.generator == "fat-tree" and t.params == {"k": 4}
    assert len(t.workers) == 16 and all(t.nodes[w].gpus == 1 for w in t.workers)
    host = next(t.iter_links("host"))
    assert host.ab == LinkProfile(bandwidth_bps=10**10, delay_s=3e-6)  # generator default + defaults.link
    core = next(t.iter_links("agg-core"))
    assert core.ab.bandwidth_bps == 4 * 10**10 and core.ab.loss == 0.001 and core.ba.loss == 0
    assert (t.runtime, t.time_dilation, t.gpu_policy, t.gpu_sharing) == ("netns", 2, "packed", "mps")
    assert (t.address_pool, t.fabric_pool) == ("10.20.0.0/16", "10.30.0.0/16")


def test_time_dilation_auto_and_name_from_file(tmp_path):
    t = load_topology(write(tmp_path, "generator: star\ntime_dilation: auto\n", "my-star.yml"))
    assert t.name == "my-star" and t.time_dilation == "auto" and t.params == {"n": 4}


@pytest.mark.parametrize("name,workers,switches,links", [
    ("fat-tree", 16, 20, 48), ("leaf-spine", 16, 6, 24), ("dumbbell", 4, 2, 5), ("star", 4, 1, 4),
    ("two-racks", 2, 3, 4),
])
def test_shipped_topologies(name, workers, switches, links):
    for spec in (name, name + ".yaml", REPO_TOPOLOGIES / f"{name}.yaml"):
        t = load_topology(spec)
        assert (len(t.workers), len(t.switches), len(t.links)) == (workers, switches, links)
        assert t.name == name
    assert (REPO_TOPOLOGIES / f"{name}.yaml").read_text().startswith("#")


def test_shipped_fat_tree_is_fast():
    t = load_topology("fat-tree")
    assert all(p.delay_s < 50e-6 for link in t.links for p in (link.ab, link.ba))


def test_shipped_dumbbell_bottleneck():
    core = load_topology("dumbbell").link_between("s0", "s1")
    assert core.ab == core.ba == LinkProfile(bandwidth_bps=10**9, delay_s=1e-3)


def test_every_shipped_file_loads():
    files = sorted(REPO_TOPOLOGIES.glob("*.yaml"))
    assert len(files) >= 5
    for f in files:
        load_topology(f)


def test_bare_name_in_cwd_topologies(tmp_path, monkeypatch):
    (tmp_path / "topologies").mkdir()
    write(tmp_path / "topologies", "generator: star\nparams: {n: 2}\n", "mine.yaml")
    monkeypatch.chdir(tmp_path)
    assert len(load_topology("mine").workers) == 2


# -- overrides ----------------------------------------------------------------------------------------------


def test_overrides_on_generator():
    t = load_topology("fat-tree", ["params.k=8", "tiers.agg-core.bandwidth=5gbit"])
    assert len(t.workers) == 128
    assert all(link.ab.bandwidth_bps == 5 * 10**9 for link in t.iter_links("agg-core"))
    assert all(link.ab.bandwidth_bps == 10**10 for link in t.iter_links("host"))


def test_overrides_on_links_and_new_keys(tmp_path):
    t = load_topology(write(tmp_path, TWO_RACKS), ["links[2].delay=1ms", "defaults.link.loss=1%",
                                                   "addressing.pool=10.9.0.0/16", "nodes.w0.gpus=4"])
    assert t.links[2].ab.delay_s == 0.001 and t.links[0].ab.loss == 0.01
    assert t.address_pool == "10.9.0.0/16" and t.nodes["w0"].gpus == 4


def test_apply_overrides_is_a_copy():
    data = {"params": {"k": 4}}
    out = apply_overrides(data, ["params.k=6", "tiers.host.delay="])
    assert data == {"params": {"k": 4}} and out == {"params": {"k": 6}, "tiers": {"host": {"delay": None}}}


@pytest.mark.parametrize("override,reason", [
    ("params.k", "PATH=VALUE"), ("=4", "empty"), ("params..k=4", "empty field"), ("params.k.=4", "ends with"),
    ("links[9].delay=1ms", "no index 9"), ("name[0]=x", "not a list"), ("name.x=1", "not a mapping"),
    ("params.k=[", "not valid YAML"), ("params/k=1", "unexpected"), ("[0]=1", "index must follow"),
])
def test_bad_overrides(override, reason):
    with pytest.raises(TopologyError) as e:
        load_topology_text(TWO_RACKS, "x.yaml", [override])
    assert override in str(e.value) and reason in str(e.value) and "override" in str(e.value)


def test_override_makes_bad_value_names_file(tmp_path):
    expect_error(tmp_path, "generator: fat-tree\n", "params.k", 5, "even", overrides=["params.k=5"])


# -- bad input: one clear error naming file, field path and value --------------------------------------------

LINK_BASE = """\
name: t
nodes:
  w0: {kind: worker}
  s0: {kind: switch}
links:
"""


@pytest.mark.parametrize("link,path,value,reason", [
    ("- {endpoints: [w0, s9]}", "links[0].endpoints", "s9", "unknown node"),
    ("- {endpoints: [s0, s0]}", "links[0].endpoints", ["s0", "s0"], "itself"),
    ("- {endpoints: [w0, s0], bandwidth: 10gbps/s}", "links[0].bandwidth", "10gbps/s", "unit"),
    ("- {endpoints: [w0, s0], bandwidth: fast}", "links[0].bandwidth", "fast", "bandwidth"),
    ("- {endpoints: [w0, s0], bandwidth: -1gbit}", "links[0].bandwidth", "-1gbit", "positive"),
    ("- {endpoints: [w0, s0], bandwidth: 0}", "links[0].bandwidth", 0, "positive"),
    ("- {endpoints: [w0, s0], loss: 120%}", "links[0].loss", "120%", "100%"),
    ("- {endpoints: [w0, s0], loss: 5}", "links[0].loss", 5, "%"),
    ("- {endpoints: [w0, s0], delay: -1ms}", "links[0].delay", "-1ms", "negative"),
    ("- {endpoints: [w0, s0], queue: 0}", "links[0].queue", 0, ">= 1"),
    ("- {endpoints: [w0, s0], queue: lots}", "links[0].queue", "lots", "integer"),
    ("- {endpoints: [w0, s0], mtu: 20}", "links[0].mtu", 20, ">= 68"),
    ("- {endpoints: [w0, s0], bandwith: 1gbit}", "links[0].bandwith", "bandwith", "allowed fields: endpoints"),
    ("- {endpoints: [w0, s0], forward: {tier: x}}", "links[0].forward.tier", "tier", "allowed fields: bandwidth"),
    ("- {endpoints: [w0, s0], forward: 3}", "links[0].forward", 3, "mapping"),
    ("- {endpoints: [w0]}", "links[0].endpoints", ["w0"], "two node names"),
    ("- [w0, s0]", "links[0]", ["w0", "s0"], "mapping"),
    ("- {endpoints: [w0, s0]}\n- {endpoints: [s0, w0]}", "links[1].endpoints", ["s0", "w0"], "duplicate link"),
    ("- {endpoints: [w0, s0], tier: 'a b'}", "links[0].tier", "a b", "tier name"),
])
def test_bad_links(tmp_path, link, path, value, reason):
    expect_error(tmp_path, LINK_BASE + "  " + link.replace("\n", "\n  ") + "\n", path, value, reason)


@pytest.mark.parametrize("text,path,value,reason", [
    # duplicate node name: PyYAML would keep the last silently
    ("name: t\nnodes:\n  w0: {kind: worker}\n  w0: {kind: switch}\nlinks: []\n", "nodes.w0", "w0",
     "duplicate node name at line 4 (first at line 3)"),
    ("name: t\nname: u\n", "name", "name", "duplicate key at line 2"),
    ("name: t\nnodes:\n  w0: {kind: worker}\n  s0: {kind: switch}\nlinks: []\n", "nodes.w0", "w0", "no link"),
    ("name: t\nnodes:\n  w0: {kind: server}\n", "nodes.w0.kind", "server", "worker or switch"),
    ("name: t\nnodes:\n  w0: {gpus: 1}\n", "nodes.w0.kind", None, "needs a kind"),
    ("name: t\nnodes:\n  w0: {kind: worker, gpu: 1}\n", "nodes.w0.gpu", "gpu", "allowed fields: kind, gpus"),
    ("name: t\nnodes:\n  w0: {kind: worker, memory: 2 gigs}\n", "nodes.w0.memory", "2 gigs", "unit"),
    ("name: t\nnodes:\n  w0: {kind: worker, gpus: -1}\n", "nodes.w0.gpus", -1, ">= 0"),
    ("name: t\nnodes:\n  w0: {kind: worker, cpus: 0}\n", "nodes.w0.cpus", 0, "> 0"),
    ("name: t\nnodes:\n  w.0: {kind: worker}\n", "nodes.w.0", "w.0", "node name"),
    ("name: t\nnodes: [w0, s0]\n", "nodes", ["w0", "s0"], "mapping"),
    ("name: t\nnodes:\n  w0: worker\n", "nodes.w0", "worker", "mapping"),
    ("name: t\nlinks: {a: b}\nnodes:\n  w0: {kind: worker}\n", "links", {"a": "b"}, "list"),
    ("name: t\n", "nodes", None, "needs nodes"),
    ("name: t\nnodes:\n  s0: {kind: switch}\n", "nodes", None, "no workers"),
    ("name: t\ncolour: red\n", "colour", "colour", "allowed fields: name, description"),
    ("name: t\ndefaults: {links: {}}\n", "defaults.links", "links", "allowed fields: link, worker"),
    ("name: t\ndefaults: {worker: {kind: switch}}\n", "defaults.worker.kind", "kind", "allowed fields"),
    ("name: t\ndefaults: {link: {bandwidth: 10gbps/s}}\n", "defaults.link.bandwidth", "10gbps/s", "unit"),
    ("name: t\ndefaults: 5\n", "defaults", 5, "mapping"),
    ("name: t\ngenerator: fat-tree\nparams: {k: 3}\n", "params.k", 3, "even"),
    ("name: t\ngenerator: fat-tree\nparams: {k: 1}\n", "params.k", 1, ">= 2"),
    ("name: t\ngenerator: fat-tree\nparams: {k: four}\n", "params.k", "four", "integer"),
    ("name: t\ngenerator: fat-tree\nparams: {pods: 4}\n", "params.pods", "pods", "allowed: k"),
    ("name: t\ngenerator: fat-tree\nparams: 4\n", "params", 4, "mapping"),
    ("name: t\ngenerator: mesh\n", "generator", "mesh", "known: fat-tree"),
    ("name: t\ngenerator: [star]\n", "generator", ["star"], "unknown generator"),
    ("name: t\ngenerator: star\ntiers: {core: {}}\n", "tiers.core", "core", "its tiers are: host"),
    ("name: t\ngenerator: star\ntiers: {host: {loss: 101%}}\n", "tiers.host.loss", "101%", "100%"),
    ("name: t\ngenerator: star\nnodes: {w0: {kind: worker}}\n", "nodes", None, "cannot be combined"),
    ("name: t\ngenerator: star\nruntime: vm\n", "runtime", "vm", "netns, docker"),
    ("name: t\ngenerator: star\ntime_dilation: 0.5\n", "time_dilation", 0.5, ">= 1"),
    ("name: t\ngenerator: star\ntime_dilation: fast\n", "time_dilation", "fast", "auto"),
    ("name: t\ngenerator: star\ngpu_policy: spread\n", "gpu_policy", "spread", "round-robin"),
    ("name: t\ngenerator: star\ngpu_sharing: mig\n", "gpu_sharing", "mig", "mps"),
    ("name: t\ngenerator: star\naddressing: {pool: 10.0.0.0/33}\n", "addressing.pool", "10.0.0.0/33", "IPv4"),
    ("name: t\ngenerator: star\naddressing: {fabric_pool: 10.0.0.1/8}\n", "addressing.fabric_pool",
     "10.0.0.1/8", "IPv4"),
    ("name: t\ngenerator: star\naddressing: {pools: x}\n", "addressing.pools", "pools", "allowed fields: pool"),
    ("name: 'my topo'\ngenerator: star\n", "name", "my topo", "topology name"),
    ("name: t\ngenerator: star\ndescription: [1]\n", "description", [1], "string"),
])
def test_bad_files(tmp_path, text, path, value, reason):
    expect_error(tmp_path, text, path, value, reason)


@pytest.mark.parametrize("text,line", [
    ("name: t\nnodes:\n  w0: {kind: worker\n", 4),
    ("name: t\nnodes:\n  w0: {kind: worker}\n bad: indent: here\n", 4),
    ("name: t\n\tnodes: {}\n", 2),
])
def test_yaml_syntax_error_names_line(tmp_path, text, line):
    e = expect_error(tmp_path, text, None, None, "invalid YAML")
    assert f"line {line}" in str(e)


@pytest.mark.parametrize("text,reason", [("", "empty"), ("- a\n- b\n", "mapping"), ("just text\n", "mapping")])
def test_not_a_mapping_file(tmp_path, text, reason):
    expect_error(tmp_path, text, None, None, reason)


def test_missing_file(tmp_path):
    with pytest.raises(TopologyError) as e:
        load_topology(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(e.value) and "not found" in str(e.value) and e.value.exit_code == 2
    with pytest.raises(TopologyError, match="no-such-topology.*not found.*looked in"):
        load_topology("no-such-topology")


def test_directory_and_binary_file(tmp_path):
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TopologyError, match="UTF-8"):
        load_topology(f)


def test_text_source_in_errors():
    with pytest.raises(TopologyError) as e:
        load_topology_text("name: t\nnodes: {w0: {kind: worker}}\nlinks: [{endpoints: [w0, x]}]\n", "inline.yaml")
    assert str(e.value).startswith("inline.yaml: links[0].endpoints: link names an unknown node")
    assert "'x'" in str(e.value)


# -- fuzz: any data gives a Topology or a TopologyError, never another exception ----------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 20), st.floats(allow_nan=True),
                     st.sampled_from(["w0", "s0", "10gbit", "2us", "1%", "worker", "switch", "fat-tree", "star",
                                      "auto", "x", "10.0.0.0/8"]))
_keys = st.sampled_from(["name", "nodes", "links", "generator", "params", "tiers", "defaults", "kind", "endpoints",
                         "bandwidth", "delay", "loss", "queue", "forward", "k", "n", "w0", "s0", "host", "link",
                         "worker", "addressing", "pool", "time_dilation", "gpus", "memory"])
_data = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(_keys, inner, max_size=4)), max_leaves=12)


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(_keys, _data, max_size=6))
def test_fuzz_only_topology_errors(data):
    try:
        topology_from_data(data, "fuzz.yaml")
    except TopologyError as e:
        assert e.exit_code == 2 and str(e).startswith("fuzz.yaml")


@settings(deadline=None, max_examples=100)
@given(st.dictionaries(_keys, _data, max_size=6))
def test_fuzz_yaml_text(data):
    text = yaml.safe_dump(data)
    try:
        load_topology_text(text, "fuzz.yaml", ["name=t"])
    except TopologyError:
        pass


@pytest.mark.parametrize("name", ["tb\n", "w0\n", "ok\nrm"])
def test_a_name_with_a_trailing_newline_is_refused_everywhere(name):
    """`$` matches before a final newline; names are checked to their very end (\\Z)."""
    from testbed.net.names import valid_testbed_name
    from testbed.state_values import NODE_RE
    from testbed.topology.loader import NAME_RE

    assert not NAME_RE.match(name) and not NODE_RE.match(name) and not valid_testbed_name(name)
