"""A command inside a node of a running testbed: a worker through the testbed's runtime (netns
containers, Docker), a switch (a plain namespace) through the bare runtime."""

from __future__ import annotations

from typing import Any, Sequence

from testbed.errors import StateError
from testbed.lifecycle import node_netns, runtime_for


def node_target(st: dict[str, Any], node: str) -> tuple[Any, dict[str, Any], str]:
    """(runtime, record, kind) of a node of a running testbed: workers through the testbed's
    runtime, switches (plain namespaces) through the bare runtime."""
    nodes = {n["name"]: n for n in st.get("topology", {}).get("nodes", [])}
    if node not in nodes:
        some = ", ".join(list(nodes)[:12]) + (" ..." if len(nodes) > 12 else "")
        raise StateError(f"testbed {st['name']!r} has no node {node!r}; nodes: {some}")
    if nodes[node]["kind"] == "worker":
        rec = st.get("runtime", {}).get("workers", {}).get(node) or {"netns": node_netns(st, node)}
        return runtime_for(st), dict(rec), "worker"
    from testbed.runtime.bare import BareRuntime

    return BareRuntime(st["name"]), {"netns": node_netns(st, node)}, "switch"


def exec_argv(st: dict[str, Any], node: str, argv: Sequence[str], **kw: Any) -> list[str]:
    """The host command line running argv inside `node` (a worker through its runtime, a switch bare)."""
    rt, rec, _ = node_target(st, node)
    return rt.exec_argv(node, rec, argv, **kw)
