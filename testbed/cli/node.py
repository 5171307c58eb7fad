"""testbed node down|up|crash|slow|restore NODE: fail, restart and slow down nodes of a running testbed.

A testbed over several hosts: a node's faults change its links, and so the
routes of switches on every host, and every host keeps the node's fault record
(faults.nodes). The command goes to every host at once; each acts on what it
holds (testbed.faults.control: the node's processes and cgroup only on its
host, a link end where it is, the routes of its own switches). What the node's
host says is printed, or each host that failed and why (exit 1).
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, console, err_console, require_root, resolve_name
from testbed.terminal import plain


def _check(name: str, node: str, verb: str) -> str:
    """The host of `node` in testbed `name` (over several hosts), after the checks the hosts would make
    (a known node; crash and slow act on workers): refused here, before any host is asked."""
    from testbed.cluster import controller
    from testbed.faults.control import FaultError
    from testbed.topology.model import Topology

    doc = controller.load(name)
    topo = Topology.from_json(doc["topology"])
    n = topo.nodes.get(node)
    if n is None or node not in doc["placement"]:
        some = ", ".join(list(topo.nodes)[:12]) + (" ..." if len(topo.nodes) > 12 else "")
        raise FaultError(f"node: testbed {name!r} has no node {node!r} (nodes: {some})")
    if verb == "crash" and not n.is_worker:
        raise FaultError(f"node: {node} is a switch; crash acts on workers (use `node down` for a switch)")
    if verb == "slow" and not n.is_worker:
        raise FaultError(f"node: {node} is a switch; slow acts on workers")
    return doc["placement"][node]


def _across_hosts(name: str, node: str, verb: str, extra: list[str] | None = None) -> None:
    """`testbed node VERB NODE` on every host of testbed `name` at once."""
    from testbed.cluster import controller

    home = _check(name, node, verb)
    results: dict[str, Any] = controller.run_on_every_host(name, ["node", verb, node, *(extra or []), "--name", name])
    failed = {h: r for h, r in results.items() if isinstance(r, Exception) or r.rc != 0}

    def why(r: Any) -> str:
        return str(r) if isinstance(r, Exception) else \
            (r.stderr.strip() or r.stdout.strip() or f"exit status {r.rc}").removeprefix("error: ")

    if failed:
        for h, r in results.items():
            if h in failed:
                err_console.print(f"[red]{plain(h)}:[/] {plain(why(r))}", highlight=False)
            else:
                err_console.print(f"{plain(h)}: {plain(r.stdout.strip())}", highlight=False)
        raise typer.Exit(1)
    # what hosts said is shown as written: never markup, never escape sequences (testbed.terminal)
    said = plain(results[home].stdout.strip() if home in results else f"{node}: {verb}")
    others = plain(", ".join(h for h in results if h != home))
    if not others:
        console.print(f"{said} (on {plain(home)})", highlight=False)
    elif verb in ("down", "up"):
        console.print(f"{said} (on {plain(home)}; {others}: its link ends and the routes there too)", highlight=False)
    else:
        console.print(f"{said} (on {plain(home)}; recorded on {others} too)", highlight=False)


def register(app: typer.Typer) -> None:
    node_app = typer.Typer(help="Fail, restart or slow down a node of a running testbed.", no_args_is_help=True)
    app.add_typer(node_app, name="node")

    def target(name: Optional[str], verb: str) -> tuple[str, bool]:
        from testbed.cli.attach import spread

        tb = resolve_name(name, clusters=True, verb=f"testbed node {verb}")
        return tb, spread(tb)

    @node_app.command("down")
    def down(node: str, name: Optional[str] = NameOption) -> None:
        """A switch: all its links down. A worker: its container stopped, and its links down."""
        from testbed.faults import control

        require_root("testbed node down")
        tb, across = target(name, "down")
        if across:
            return _across_hosts(tb, node, "down")
        control.node_down(tb, node)
        console.print(f"{node}: down", highlight=False)

    @node_app.command("up")
    def up(node: str, name: Optional[str] = NameOption) -> None:
        """Undo node down / crash: the worker started again, its links up."""
        from testbed.faults import control

        require_root("testbed node up")
        tb, across = target(name, "up")
        if across:
            return _across_hosts(tb, node, "up")
        control.node_up(tb, node)
        console.print(f"{node}: up", highlight=False)

    @node_app.command("crash")
    def crash(node: str, name: Optional[str] = NameOption) -> None:
        """kill -9 of every process in a worker (its links stay up)."""
        from testbed.faults import control

        require_root("testbed node crash")
        tb, across = target(name, "crash")
        if across:
            return _across_hosts(tb, node, "crash")
        n = control.node_crash(tb, node)
        console.print(f"{node}: crashed ({n} processes killed)", highlight=False)

    @node_app.command("slow")
    def slow(node: str, cpus: float = typer.Option(..., "--cpus", help="CPU quota, e.g. 0.2 (a straggler)."),
             name: Optional[str] = NameOption) -> None:
        """Make a worker a straggler: cap its CPU through cgroups."""
        from testbed.faults import control

        require_root("testbed node slow")
        tb, across = target(name, "slow")
        if across:
            if not (cpus > 0):
                raise control.FaultError(f"--cpus must be positive (got {cpus})")
            return _across_hosts(tb, node, "slow", ["--cpus", repr(cpus)])
        control.node_slow(tb, node, cpus)
        console.print(f"{node}: limited to {cpus:g} CPUs", highlight=False)

    @node_app.command("restore")
    def restore(node: str, name: Optional[str] = NameOption) -> None:
        """Undo node slow: the worker's CPU limit back to the topology's."""
        from testbed.faults import control

        require_root("testbed node restore")
        tb, across = target(name, "restore")
        if across:
            return _across_hosts(tb, node, "restore")
        control.node_restore(tb, node)
        console.print(f"{node}: CPU limit restored", highlight=False)
