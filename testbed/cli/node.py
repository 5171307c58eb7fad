"""testbed node down|up|crash|slow|restore NODE: fail, restart and slow down nodes of a running testbed."""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import NameOption, console, require_root, resolve_name


def register(app: typer.Typer) -> None:
    node_app = typer.Typer(help="Fail, restart or slow down a node of a running testbed.", no_args_is_help=True)
    app.add_typer(node_app, name="node")

    @node_app.command("down")
    def down(node: str, name: Optional[str] = NameOption) -> None:
        """A switch: all its links down. A worker: its container stopped, and its links down."""
        from testbed.faults import control

        require_root("testbed node down")
        control.node_down(resolve_name(name), node)
        console.print(f"{node}: down", highlight=False)

    @node_app.command("up")
    def up(node: str, name: Optional[str] = NameOption) -> None:
        """Undo node down / crash: the worker started again, its links up."""
        from testbed.faults import control

        require_root("testbed node up")
        control.node_up(resolve_name(name), node)
        console.print(f"{node}: up", highlight=False)

    @node_app.command("crash")
    def crash(node: str, name: Optional[str] = NameOption) -> None:
        """kill -9 of every process in a worker (its links stay up)."""
        from testbed.faults import control

        require_root("testbed node crash")
        n = control.node_crash(resolve_name(name), node)
        console.print(f"{node}: crashed ({n} processes killed)", highlight=False)

    @node_app.command("slow")
    def slow(node: str, cpus: float = typer.Option(..., "--cpus", help="CPU quota, e.g. 0.2 (a straggler)."),
             name: Optional[str] = NameOption) -> None:
        """Make a worker a straggler: cap its CPU through cgroups."""
        from testbed.faults import control

        require_root("testbed node slow")
        control.node_slow(resolve_name(name), node, cpus)
        console.print(f"{node}: limited to {cpus:g} CPUs", highlight=False)

    @node_app.command("restore")
    def restore(node: str, name: Optional[str] = NameOption) -> None:
        """Undo node slow: the worker's CPU limit back to the topology's."""
        from testbed.faults import control

        require_root("testbed node restore")
        control.node_restore(resolve_name(name), node)
        console.print(f"{node}: CPU limit restored", highlight=False)
