"""Importing Mininet topologies: Mininet's own Topo classes and a custom file."""

from __future__ import annotations

import textwrap

import pytest

import requires

requires.need("mininet", module=True)

from mininet.topo import LinearTopo, SingleSwitchTopo  # noqa: E402
from mininet.topolib import TreeTopo  # noqa: E402

from testbed.errors import TopologyError  # noqa: E402
from testbed.topology.mininet_import import (  # noqa: E402
    is_mininet_spec, load_any, load_mininet, parse_topo_arg, topology_from_topo)
from testbed.topology.loader import topology_from_data  # noqa: E402


def _same_graph(topo, mn):
    assert sorted(topo.workers) == sorted(mn.hosts())
    assert sorted(topo.switches) == sorted(mn.switches())
    assert {frozenset(link.endpoints) for link in topo.links} == {frozenset(e) for e in mn.links()}


@pytest.mark.parametrize("spec, mn", [
    ("mininet:tree,depth=2,fanout=2", TreeTopo(depth=2, fanout=2)),
    ("mininet:tree,depth=3,fanout=3", TreeTopo(depth=3, fanout=3)),
    ("mininet:linear,4", LinearTopo(4)),
    ("mininet:linear,3,2", LinearTopo(3, 2)),
    ("mininet:single,3", SingleSwitchTopo(3)),
])
def test_builtin_topologies_match_mininet(spec, mn):
    topo, warnings = load_mininet(spec)
    _same_graph(topo, mn)
    assert warnings == []
    assert topo.source == spec
    for link in topo.links:
        has_host = any(topo.nodes[e].is_worker for e in link.endpoints)
        assert link.tier == ("host" if has_host else "fabric")
        assert link.ab.bandwidth_bps is None and link.ab.delay_s == 0  # plain Mininet links: unshaped


def test_tree_counts():
    topo, _ = load_mininet("mininet:tree,depth=2,fanout=2")
    assert (len(topo.workers), len(topo.switches), len(topo.links)) == (4, 3, 6)
    assert topo.name == "mininet-tree"
    assert topo.workers == ["h1", "h2", "h3", "h4"]


def test_topo_instance_directly():
    data, warnings = topology_from_topo(SingleSwitchTopo(2), "single", "x")
    topo = topology_from_data(data, "x")
    assert topo.workers == ["h1", "h2"] and topo.switches == ["s1"]


def test_parse_topo_arg():
    assert parse_topo_arg("tree,depth=2,fanout=3") == ("tree", [], {"depth": 2, "fanout": 3})
    assert parse_topo_arg("linear,4,1.5,x") == ("linear", [4, 1.5, "x"], {})
    assert is_mininet_spec("mininet:single,3") and is_mininet_spec("a/b.py") and is_mininet_spec("b.py:t,1")
    assert not is_mininet_spec("fat-tree") and not is_mininet_spec("x.yaml")


CUSTOM = textwrap.dedent("""
    from mininet.topo import Topo
    from mininet.link import TCLink

    class Racks(Topo):
        def build(self, racks=2, per_rack=2, bw=100):
            core = self.addSwitch('core', dpid='99')
            n = 0
            for r in range(racks):
                tor = self.addSwitch(f'tor{r}')
                self.addLink(tor, core, cls=TCLink, bw=1000, delay='50us', loss=1, max_queue_size=500,
                             params2={'bw': 500}, use_htb=True)
                for _ in range(per_rack):
                    n += 1
                    h = self.addHost(f'h{n}', ip=f'10.0.0.{n}')
                    self.addLink(h, tor, cls=TCLink, bw=bw, delay='5ms', jitter='1ms')

    def small():
        return Racks(racks=1, per_rack=3)

    topos = {'racks': Racks, 'small': small}
""")


@pytest.fixture
def custom(tmp_path):
    path = tmp_path / "racks.py"
    path.write_text(CUSTOM)
    return path


def test_custom_file_default_is_first(custom):
    topo, warnings = load_mininet(str(custom))
    assert topo.name == "racks"
    assert topo.workers == ["h1", "h2", "h3", "h4"]
    assert topo.switches == ["core", "tor0", "tor1"]
    assert len(topo.links) == 6
    host = topo.link_between("h1", "tor0")
    assert host.tier == "host"
    assert host.ab == host.ba
    assert host.ab.bandwidth_bps == 100_000_000
    assert host.ab.delay_s == pytest.approx(5e-3)
    assert host.ab.jitter_s == pytest.approx(1e-3)
    up = topo.link_between("tor0", "core")
    assert up.tier == "fabric" and (up.a, up.b) == ("tor0", "core")
    assert up.ab.bandwidth_bps == 1_000_000_000       # params1/common: node1 -> node2
    assert up.ba.bandwidth_bps == 500_000_000         # params2: node2 -> node1
    assert up.ab.loss == pytest.approx(0.01) and up.ab.queue == 500
    assert up.ab.delay_s == pytest.approx(50e-6)
    text = "\n".join(warnings)
    assert "'ip'" in text and "'dpid'" in text and "'use_htb'" in text


def test_custom_file_named_topo_with_args(custom):
    topo, _ = load_mininet(f"{custom}:racks,3,per_rack=1,bw=10")
    assert len(topo.workers) == 3 and len(topo.switches) == 4
    assert topo.link_between("h1", "tor0").ab.bandwidth_bps == 10_000_000
    topo, _ = load_mininet(f"{custom}:small")
    assert topo.workers == ["h1", "h2", "h3"]


def test_custom_file_overrides(custom):
    topo, _ = load_mininet(str(custom), ["tiers.host.bandwidth=1gbit", "nodes.h1.gpus=2"])
    assert all(link.ab.bandwidth_bps == 10**9 for link in topo.iter_links("host"))
    assert topo.nodes["h1"].gpus == 2


def test_load_any_dispatches(custom):
    assert load_any("fat-tree")[0].generator == "fat-tree"
    assert load_any(str(custom))[0].name == "racks"
    assert load_any("mininet:minimal")[0].workers == ["h1", "h2"]


def _write(tmp_path, body, name="t.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.parametrize("body, needle", [
    ("x = 1\n", "topos"),
    ("topos = {'a': 1}\n", "Topo classes or functions"),
    ("def f(:\n", "syntax error"),
    ("raise RuntimeError('boom')\n", "boom"),
    ("topos = {'a': lambda: 42}\n", "did not return a mininet.topo.Topo"),
    ("""
     from mininet.topo import Topo
     class T(Topo):
         def build(self):
             s = self.addSwitch('s1'); h = self.addHost('h1')
             self.addLink(h, s, bw=-5)
     topos = {'t': T}
     """, "bw"),
    ("""
     from mininet.topo import Topo
     class T(Topo):
         def build(self):
             s = self.addSwitch('s1'); h = self.addHost('h1')
             self.addLink(h, s, delay='fast')
     topos = {'t': T}
     """, "delay"),
    ("""
     from mininet.topo import Topo
     class T(Topo):
         def build(self):
             s = self.addSwitch('s1'); h = self.addHost('h1')
             self.addLink(h, s); self.addLink(h, s)
     topos = {'t': T}
     """, "parallel links"),
    ("""
     from mininet.topo import Topo
     class T(Topo):
         def build(self):
             s = self.addSwitch('s 1'); h = self.addHost('h1')
             self.addLink(h, s)
     topos = {'t': T}
     """, "node name"),
    ("""
     from mininet.topo import Topo
     class T(Topo):
         def build(self):
             self.addSwitch('s1')
     topos = {'t': T}
     """, "no workers"),
])
def test_bad_custom_files_name_the_file(tmp_path, body, needle):
    path = _write(tmp_path, body)
    with pytest.raises(TopologyError) as err:
        load_mininet(path)
    assert err.value.file == path
    assert needle.lower() in str(err.value).lower()


def test_bad_builtin_and_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="unknown Mininet topology"):
        load_mininet("mininet:nope")
    with pytest.raises(TopologyError, match="building tree failed"):
        load_mininet("mininet:tree,bogus=1")
    with pytest.raises(TopologyError, match="not found"):
        load_mininet(str(tmp_path / "missing.py"))
