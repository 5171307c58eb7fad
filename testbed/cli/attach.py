"""testbed attach NODE: an interactive shell inside a worker (or a switch).

Leaving the shell (exit, Ctrl-D) leaves the node running: the shell is one
more process entered into the node's namespaces, not the node's init.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, require_root, resolve_name
from testbed.errors import StateError


def node_target(st: dict[str, Any], node: str) -> tuple[Any, dict[str, Any], str]:
    """(runtime, record, kind) of a node of a running testbed: workers through the testbed's
    runtime, switches (plain namespaces) through the bare runtime."""
    from testbed import lifecycle

    nodes = {n["name"]: n for n in st.get("topology", {}).get("nodes", [])}
    if node not in nodes:
        some = ", ".join(list(nodes)[:12]) + (" ..." if len(nodes) > 12 else "")
        raise StateError(f"testbed {st['name']!r} has no node {node!r}; nodes: {some}")
    if nodes[node]["kind"] == "worker":
        rt = lifecycle.runtime_for(st)
        rec = st.get("runtime", {}).get("workers", {}).get(node) or {"netns": lifecycle.node_netns(st, node)}
        return rt, dict(rec), "worker"
    from testbed.runtime.bare import BareRuntime

    return BareRuntime(st["name"]), {"netns": lifecycle.node_netns(st, node)}, "switch"


def attach_node(st: dict[str, Any], node: str) -> int:
    rt, rec, kind = node_target(st, node)
    if kind == "worker" and rt.kind != "bare":
        return rt.attach(node, rec)
    # a plain namespace has the host's hostname: say where the shell is in its prompt
    import subprocess

    argv = rt.exec_argv(node, rec, ["/bin/bash", "--norc", "-i"], tty=True,
                        env={"PS1": f"[{st['name']}:{node}] \\w\\$ ", "TESTBED_NODE": node})
    return subprocess.call(argv)


def register(app: typer.Typer) -> None:
    @app.command(help="Open an interactive shell inside NODE (a worker or a switch). "
                      "Exiting the shell leaves the node running.")
    def attach(node: str = typer.Argument(..., help="The worker or switch to enter."),
               name: Optional[str] = NameOption) -> None:
        from testbed import lifecycle

        require_root("attach")
        tb = resolve_name(name)
        st = lifecycle.load(tb)
        if not sys.stdin.isatty():
            from testbed.cli.common import err_console

            err_console.print("note: stdin is not a terminal; for one command use "
                              f"`testbed exec {node} -- CMD`", highlight=False)
        raise typer.Exit(attach_node(st, node))
