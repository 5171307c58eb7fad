"""`testbed topo`, run as a user runs it (a subprocess through testbed.cli.main)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", "from testbed.cli import main; main()", *args],
                          capture_output=True, text=True, env=env, cwd=cwd or ROOT, timeout=120)


def test_fat_tree_json():
    r = cli("topo", "fat-tree", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"name", "workers", "switches", "links", "addresses", "routes"}
    assert doc["name"] == "fat-tree"
    assert len(doc["workers"]) == 16 and len(doc["switches"]) == 20 and len(doc["links"]) == 48
    assert doc["workers"][0] == "w0" and "core0" in doc["switches"]
    link = doc["links"][0]
    assert set(link) == {"endpoints", "tier", "bandwidth_bps", "delay_s", "jitter_s", "loss", "queue", "mtu"}
    assert link["endpoints"] == ["w0", "edge0-0"] and link["tier"] == "host"
    assert link["bandwidth_bps"] == 10_000_000_000 and link["delay_s"] == pytest.approx(2e-6)
    assert set(doc["addresses"]) == set(doc["workers"]) | set(doc["switches"])
    assert len(doc["addresses"]["w0"]) == 1
    ips = [a.split("/")[0] for addrs in doc["addresses"].values() for a in addrs]
    assert len(ips) == len(set(ips))
    # routes per switch: edges only a default, aggregations their pod's 2 edges too, cores 3 pods of 4
    routes = doc["routes"]
    assert routes["total"] == 48 and routes["unsummarised"] == 152
    assert [(r["layer"], r["switches"], r["min"], r["max"]) for r in routes["layers"]] == [
        (1, 8, 1, 1), (2, 8, 3, 3), (3, 4, 4, 4)]
    assert routes["per_switch"]["edge0-0"] == 1 and sum(routes["per_switch"].values()) == 48


def test_json_reverse_only_when_asymmetric(tmp_path):
    f = tmp_path / "asym.yaml"
    f.write_text(textwrap.dedent("""
        name: asym
        nodes: {a: {kind: worker}, b: {kind: worker}, s: {kind: switch}}
        links:
          - {endpoints: [a, s], bandwidth: 1gbit, reverse: {bandwidth: 100mbit}}
          - {endpoints: [b, s], bandwidth: 1gbit}
    """))
    r = cli("topo", str(f), "--json")
    assert r.returncode == 0, r.stderr
    first, second = json.loads(r.stdout)["links"]
    assert first["bandwidth_bps"] == 10**9 and first["reverse"]["bandwidth_bps"] == 10**8
    assert "reverse" not in second


def test_set_overrides():
    r = cli("topo", "fat-tree", "--set", "params.k=6", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["workers"]) == 54 and len(doc["switches"]) == 45


def test_describe_text():
    r = cli("topo", "leaf-spine", "--set", "params.oversubscription=4")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "16 workers, 6 switches, 24 links" in out
    assert "leaf-spine" in out and "5gbit" in out
    assert "bisection bandwidth: 20gbit" in out
    assert "routes: 12 on 6 switches" in out and "routes per switch" in out
    assert "4:1" in out


def test_png(tmp_path):
    out = tmp_path / "ft.png"
    r = cli("topo", "fat-tree", "--png", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mininet_builtin_and_custom(tmp_path):
    r = cli("topo", "mininet:tree,depth=2,fanout=2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (len(doc["workers"]), len(doc["switches"]), len(doc["links"])) == (4, 3, 6)
    custom = tmp_path / "mine.py"
    custom.write_text(textwrap.dedent("""
        from mininet.topo import Topo
        class Pair(Topo):
            def build(self, bw=10):
                s = self.addSwitch('s1')
                for h in ('h1', 'h2'):
                    self.addLink(self.addHost(h, ip='10.9.9.9'), s, bw=bw, delay='1ms')
        topos = {'pair': Pair}
    """))
    r = cli("topo", f"{custom}:pair,bw=25", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["workers"] == ["h1", "h2"] and doc["links"][0]["bandwidth_bps"] == 25_000_000
    assert "ignored host option 'ip'" in r.stderr


@pytest.mark.parametrize("args, needles", [
    (["no-such-topology"], ["no-such-topology", "not found"]),
    (["fat-tree", "--set", "params.k=3"], ["fat-tree.yaml", "params.k", "3"]),
    (["fat-tree", "--set", "tiers.host.bandwidth=fast"], ["fat-tree.yaml", "tiers.host.bandwidth", "'fast'"]),
    (["mininet:nope"], ["mininet:nope", "unknown Mininet topology", "'nope'"]),
])
def test_bad_input_exits_2_without_traceback(args, needles):
    r = cli("topo", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    text = " ".join(r.stderr.split())
    for needle in needles:
        assert needle in text
    assert text.startswith("error:")


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\nnodes:\n  w0: {kind: worker}\n  s0: {kind: blender}\nlinks: []\n")
    r = cli("topo", str(f))
    assert r.returncode == 2
    text = " ".join(r.stderr.split())
    assert str(f) in text and "nodes.s0.kind" in text and "'blender'" in text
    assert "Traceback" not in r.stderr


def test_bad_custom_python_file(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("topos = {}\n")
    r = cli("topo", str(f))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert str(f) in " ".join(r.stderr.split())


def test_draw_with_utilisation_and_at_scale(tmp_path):
    from testbed.report.draw import draw_topology, layout
    from testbed.topology.loader import load_topology

    topo = load_topology("fat-tree")
    pos = layout(topo)
    assert pos["w0"][1] == 0 and pos["edge0-0"][1] == 1 and pos["agg0-0"][1] == 2 and pos["core0"][1] == 3
    util = {(link.b, link.a) if i % 2 else (link.a, link.b): (i % 10) / 10 for i, link in enumerate(topo.links)}
    util[(topo.links[0].a, topo.links[0].b)] = None
    out = draw_topology(topo, tmp_path / "u.png", utilisation=util)
    assert out.read_bytes()[:4] == b"\x89PNG"
    big = load_topology("fat-tree", ["params.k=16"])  # 1344 nodes, 3072 links: no labels, still renders
    out = draw_topology(big, tmp_path / "big.png")
    assert out.stat().st_size > 0


def test_an_error_with_brackets_and_escapes_is_shown_as_written(tmp_path):
    """A path or a host's words in an error may hold Rich markup (`[/tmp]` closes a tag) or terminal
    escapes: the error handler shows them inert, it does not crash on them."""
    import subprocess
    import sys

    bad = tmp_path / "[/tmp]\x1b[31mred"
    out = subprocess.run([sys.executable, "-m", "testbed", "topo", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "[/tmp]" in out.stderr and "\x1b" not in out.stderr and "\\x1b" in out.stderr, out.stderr


def test_inert_text_keeps_its_lines_and_shows_the_rest():
    """Hosts' answers are often several lines (JSON): the lines stay lines; a carriage return (which
    overwrites what was printed), ESC and NUL are shown, not obeyed."""
    from testbed.terminal import inert, plain

    assert inert('{\n  "a": 1\n}\tx') == '{\n  "a": 1\n}\tx'
    assert inert("ok\rfake\x1b[2J\x00") == "ok\\x0dfake\\x1b[2J\\x00"
    assert plain("[/tmp]\n[bold]") == "\\[/tmp]\n\\[bold]"
