"""The layer order of testbed/ (docs/HACKING.md, "Layers"), checked on every import.

Pure logic: each module of testbed/ is parsed with `ast` (not imported), and every import is
counted, at module level or inside a function, `if TYPE_CHECKING:` included: a function-local
import is a dependency too, it only happens later. A module may import its own layer and the
layers below it; two groups that share a rank (faults and report) import neither one another.
Between modules there is no cycle, whatever the layers.

An offender is printed as `module -> imported (line)`. ALLOWED lists the imports against the order
that only the redesign of issue #24 removes (none are left); an allowance that is no longer used
fails the test too, so the list only shrinks. REMOVED names the imports issue #24 took out:
they may not come back, even as an allowance. A module without a place (a new top-level one)
fails until LAYERS gives it one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A rank is a list of groups; a group is the modules it holds (a package holds its
# submodules). Keep in step with docs/HACKING.md.
LAYERS: list[list[tuple[str, tuple[str, ...]]]] = [
    # leaves: no testbed import but one another (and testbed's own __init__, the version)
    [("leaves", ("testbed", "testbed.errors", "testbed.paths", "testbed.procs", "testbed.terminal",
                 "testbed.safeio", "testbed.tarstream", "testbed.events", "testbed.names",
                 "testbed.cgroupfs", "testbed.cpustat", "testbed.lifeline", "testbed.nodeside",
                 "testbed.interrupts"))],
    [("topology", ("testbed.topology",))],
    [("state", ("testbed.store", "testbed.state_schema", "testbed.state_values"))],
    [("net", ("testbed.net",))],
    [("runtime", ("testbed.runtime",))],
    [("lifecycle", ("testbed.lifecycle", "testbed.cleanup", "testbed.status", "testbed.node_exec", "testbed.running",
                    "testbed.node_cpus", "testbed.node_files"))],
    [("jobs", ("testbed.jobs",))],
    [("faults", ("testbed.faults",)), ("report", ("testbed.report",))],
    [("observe", ("testbed.observe",))],
    [("agent", ("testbed.agent",))],
    [("cluster", ("testbed.cluster",))],
    [("handle", ("testbed.handle",))],
    [("cli", ("testbed.cli", "testbed.mainjob", "testbed.sweep", "testbed.__main__"))],
]

# (importer, imported) -> why it is still there, each naming issue #24. Empty: the controller's
# fan-out (scenario, top and graph across hosts) moved up into testbed/cluster/, where it lives.
ALLOWED: dict[tuple[str, str], str] = {}

# (importer, imported) that issue #24 took out, each by moving the shared piece down (or the importer
# up): none may come back, not even through ALLOWED (a package on either side stands for every module in it).
REMOVED: dict[tuple[str, str], str] = {
    ("testbed.faults", "testbed.cli"): "host-follow read the CLI's lifeline: now the leaf testbed/lifeline.py",
    ("testbed.jobs", "testbed.faults"): "a run caps CPUs through testbed/node_cpus.py (the recorded `node slow`)",
    ("testbed.observe", "testbed.cli"): "the hosts' answers moved from cli/events to observe/answers.py",
    ("testbed.observe.graph", "testbed.report"): "the tiers of a drawing moved to topology/layout.py",
    ("testbed.observe.graph", "testbed.cluster"): "graph_hosts.open_source picks the page's source",
    ("testbed.observe.graph", "testbed.observe.graph_hosts"): "the graph <-> graph_hosts cycle",
    ("testbed.faults", "testbed.cluster"): "the scenario across hosts (faults/hosts_player) moved to cluster/scenario.py",
    ("testbed.observe", "testbed.cluster"): "top and graph across hosts (observe/*_hosts) moved to cluster/top.py, graph.py",
    ("testbed.net.capabilities", "testbed.net.shaping"): "the capabilities <-> shaping cycle (net/lossfilter.py)",
    ("testbed.topology", "testbed.state_schema"): "the hosts file moved to cluster/hosts.py (a pure model)",
    ("testbed.state_schema", "testbed.store"): "the store <-> state_schema cycle",
    ("testbed.state_schema", "testbed.net"): "the schema checks names from the leaf testbed/names.py",
    ("testbed.state_schema", "testbed.runtime"): "the cgroup mounts come from the leaf testbed/cgroupfs.py",
    ("testbed.state_schema", "testbed.cluster"): "the state's schema imports nothing above it",
}


@dataclass(frozen=True)
class Import:
    module: str      # the importing module, dotted
    imported: str    # the testbed module it names, dotted
    line: int

    def __str__(self) -> str:
        return f"{self.module} -> {self.imported} ({self.line})"


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under `package_dir` (a package's __init__ by the
    package's name)."""
    out = {}
    base = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module (`testbed.x.Y` names a thing in testbed.x)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(known: Mapping[str, Path], top: str) -> list[Import]:
    """Every import of a module of package `top` by a module of it, wherever it is written."""
    found = []
    for module, path in known.items():
        tree = ast.parse(path.read_bytes(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from testbed.net import names` imports the module testbed.net.names; `from
                # testbed.errors import StateError` a name of testbed.errors
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
            else:
                continue
            for target in targets:
                if target == top or target.startswith(top + "."):
                    imported = _known(target, known)
                    if imported and imported != module:
                        found.append(Import(module, imported, node.lineno))
    return sorted(set(found), key=lambda i: (i.module, i.line, i.imported))


def placement(layers: list[list[tuple[str, tuple[str, ...]]]]) -> dict[str, tuple[int, str]]:
    """Module prefix -> (rank, group)."""
    return {prefix: (rank, group) for rank, groups in enumerate(layers) for group, prefixes in groups
            for prefix in prefixes}


def layer_of(module: str, placed: Mapping[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The place of `module`: its own, or its nearest package's; the top package's (its __init__)
    is its alone, so a new top-level module has none until it is given one."""
    name = module
    while name:
        if name in placed and (name == module or "." in name):
            return placed[name]
        name = name.rpartition(".")[0]
    return None


def against_order(found: Iterable[Import], placed: Mapping[str, tuple[int, str]]) -> list[Import]:
    """The imports of a higher layer, or of another group of the same rank."""
    bad = []
    for imp in found:
        (rank, group), (to_rank, to_group) = layer_of(imp.module, placed), layer_of(imp.imported, placed)
        if to_rank > rank or (to_rank == rank and to_group != group):
            bad.append(imp)
    return bad


def cycles(found: Iterable[Import]) -> list[list[Import]]:
    """The imports that close a cycle, one list per strongly connected set of modules (Tarjan)."""
    found = list(found)
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.module, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sets: list[set[str]] = []

    def visit(v: str) -> None:   # recursive: the graph is ~100 modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                sets.append(members)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [[i for i in found if i.module in s and i.imported in s] for s in sets]


# -- the checks on testbed/ ---------------------------------------------------------------------------


KNOWN = modules(ROOT / "testbed")
FOUND = imports(KNOWN, "testbed")
PLACED = placement(LAYERS)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in KNOWN if layer_of(m, PLACED) is None)
    assert not unplaced, ("modules without a layer (place them in LAYERS and docs/HACKING.md): "
                          + ", ".join(unplaced))


def test_no_import_against_the_layer_order():
    bad = [i for i in against_order(FOUND, PLACED) if (i.module, i.imported) not in ALLOWED]
    assert not bad, "imports against the layer order (docs/HACKING.md, Layers):\n" + "\n".join(map(str, bad))


def test_no_import_cycle():
    found = cycles(FOUND)
    assert not found, "import cycles:\n" + "\n\n".join("\n".join(map(str, c)) for c in found)


def test_every_allowance_is_still_needed():
    used = {(i.module, i.imported) for i in against_order(FOUND, PLACED)}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, "allowed in ALLOWED but no longer imported (remove them): " + ", ".join(
        f"{a} -> {b}" for a, b in stale)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_import_issue_24_removed_comes_back():
    back = [f"{i}: {why}" for i in FOUND for (a, b), why in REMOVED.items()
            if _within(i.module, a) and _within(i.imported, b)]
    assert not back, "imports issue #24 removed are back (move the shared piece down instead):\n" + "\n".join(back)
    allowed = [f"{a} -> {b}" for a, b in ALLOWED for ra, rb in REMOVED if _within(a, ra) and _within(b, rb)]
    assert not allowed, "ALLOWED names an import issue #24 removed: " + ", ".join(allowed)


# -- the checker itself, on a planted package -----------------------------------------------------------


@pytest.fixture
def planted(tmp_path: Path) -> dict[str, Path]:
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "low.py": "import os\n",
        "mid/__init__.py": "from pkg import low\n",
        "mid/a.py": "from . import b\nfrom pkg.low import thing\n",
        "mid/b.py": "def f():\n    from pkg.mid.a import g\n",                    # local: a <-> b
        "high.py": "from .mid import a\n",
        "side.py": "import pkg.low\n",
        "bad.py": "def f():\n    import pkg.high.sub\n",   # bad is low, high is above it
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return modules(pkg)


def test_the_checker_finds_local_and_relative_imports_against_the_order_and_cycles(planted):
    found = imports(planted, "pkg")
    assert [str(i) for i in found] == [
        "pkg.bad -> pkg.high (2)", "pkg.high -> pkg.mid.a (1)", "pkg.mid -> pkg.low (1)",
        "pkg.mid.a -> pkg.mid.b (1)", "pkg.mid.a -> pkg.low (2)", "pkg.mid.b -> pkg.mid.a (2)",
        "pkg.side -> pkg.low (1)"]
    placed = placement([[("low", ("pkg", "pkg.low", "pkg.bad"))], [("mid", ("pkg.mid",)), ("side", ("pkg.side",))],
                        [("high", ("pkg.high",))]])
    assert [str(i) for i in against_order(found, placed)] == ["pkg.bad -> pkg.high (2)"]
    assert layer_of("pkg.mid.b", placed) == (1, "mid") and layer_of("pkg.new", placed) is None
    # the same rank, another group
    placed["pkg.side"], placed["pkg.low"] = (1, "side"), (1, "low2")
    assert "pkg.mid -> pkg.low (1)" in [str(i) for i in against_order(found, placed)]
    assert [[str(i) for i in c] for c in cycles(found)] == [["pkg.mid.a -> pkg.mid.b (1)",
                                                             "pkg.mid.b -> pkg.mid.a (2)"]]
