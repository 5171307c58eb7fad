"""testbed node down|up|crash|slow|restore NODE: fail, restart and slow down nodes of a running testbed.

A testbed over several hosts: a node's faults change its links, and so the
routes of switches on every host, and every host keeps the node's fault record
(faults.nodes). The command goes to every host at once (testbed.handle.hosts);
each acts on what it holds (testbed.faults.control: the node's processes and
cgroup only on its host, a link end where it is, the routes of its own
switches). What it did is printed with the node's host and the others that
acted too, or each host that failed and why.
"""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import NameOption, console, require_root


def _done(tb, node: str, verb: str, said: str) -> None:
    """What `node VERB` did, and where (over several hosts: the node's host, and the others)."""
    from rich.markup import escape

    from testbed.terminal import plain

    home = tb.host_of(node)
    if home is None:
        console.print(said, highlight=False)
        return
    others = escape(plain(", ".join(h for h in tb.hosts if h != home)))
    home = escape(plain(home))
    if not others:
        console.print(f"{said} (on {home})", highlight=False)
    elif verb in ("down", "up"):
        console.print(f"{said} (on {home}; {others}: its link ends and the routes there too)", highlight=False)
    else:
        console.print(f"{said} (on {home}; recorded on {others} too)", highlight=False)


def register(app: typer.Typer) -> None:
    node_app = typer.Typer(help="Fail, restart or slow down a node of a running testbed.", no_args_is_help=True)
    app.add_typer(node_app, name="node")

    def act(name: Optional[str], verb: str, node: str, cpus: float | None = None) -> tuple[object, int | None]:
        from testbed.handle import open_testbed

        require_root(f"testbed node {verb}")
        tb = open_testbed(name)
        return tb, tb.node(verb, node, cpus)

    @node_app.command("down")
    def down(node: str, name: Optional[str] = NameOption) -> None:
        """A switch: all its links down. A worker: its container stopped, and its links down."""
        tb, _ = act(name, "down", node)
        _done(tb, node, "down", f"{node}: down")

    @node_app.command("up")
    def up(node: str, name: Optional[str] = NameOption) -> None:
        """Undo node down / crash: the worker started again, its links up."""
        tb, _ = act(name, "up", node)
        _done(tb, node, "up", f"{node}: up")

    @node_app.command("crash")
    def crash(node: str, name: Optional[str] = NameOption) -> None:
        """kill -9 of every process in a worker (its links stay up)."""
        tb, n = act(name, "crash", node)
        _done(tb, node, "crash", f"{node}: crashed ({n} processes killed)")

    @node_app.command("slow")
    def slow(node: str, cpus: float = typer.Option(..., "--cpus", help="CPU quota, e.g. 0.2 (a straggler)."),
             name: Optional[str] = NameOption) -> None:
        """Make a worker a straggler: cap its CPU through cgroups."""
        tb, _ = act(name, "slow", node, cpus)
        _done(tb, node, "slow", f"{node}: limited to {cpus:g} CPUs")

    @node_app.command("restore")
    def restore(node: str, name: Optional[str] = NameOption) -> None:
        """Undo node slow: the worker's CPU limit back to the topology's."""
        tb, _ = act(name, "restore", node)
        _done(tb, node, "restore", f"{node}: CPU limit restored")
