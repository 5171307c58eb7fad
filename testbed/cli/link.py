"""testbed link show|set|down|up|reset: change a running testbed's links (see testbed.faults.control)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, forward_to_hosts, require_root, resolve_name
from testbed.topology.units import format_profile

DirectionOption = typer.Option("both", "--direction", "-d",
                               help="both, A->B (traffic from A to B), B->A, or with node names: w0->edge0-0.")


def _spread(name: str) -> bool:
    """A testbed over several hosts (here only its controller's record): the command goes to its hosts,
    each changing what it holds (its link ends, its switches' routes)."""
    from testbed import store
    from testbed.cluster import controller

    return controller.exists(name) and not store.exists(name)


def register(app: typer.Typer) -> None:
    link_app = typer.Typer(help="Show and change the links of a running testbed (takes effect at once).",
                           no_args_is_help=True)
    app.add_typer(link_app, name="link")

    @link_app.command("show")
    def show(name: Optional[str] = NameOption,
             as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
             changed: bool = typer.Option(False, "--changed", help="Only links that are down or changed.")) -> None:
        """Every link: state, and the profile it runs at now (emulated units)."""
        from rich.table import Table

        from testbed.faults import control

        name = resolve_name(name, clusters=True)
        if _spread(name):
            forward_to_hosts(name, every=False)   # every host keeps the same link records
            return
        links = control.link_show(name)
        if changed:
            links = [l for l in links if l["state"] != "up" or l["changed"]]
        if as_json:
            typer.echo(json.dumps(links, indent=1))
            return
        t = Table(title=f"links of {name}")
        for col in ("#", "A", "B", "tier", "state", "A->B", "B->A"):
            t.add_column(col)
        for l in links:
            st = l["state"] + (f" ({', '.join(l['down_by'])})" if l["state"] == "down" else "")
            st += " *" if l["changed"] else ""
            t.add_row(str(l["index"]), l["endpoints"][0], l["endpoints"][1], l["tier"], st,
                      format_profile(l["ab"]), format_profile(l["ba"]))
        console.print(t)
        console.print("* profile changed from the topology's (testbed link reset A B)", style="dim")

    @link_app.command("set")
    def set_(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
             bandwidth: Optional[str] = typer.Option(None, "--bandwidth", help="e.g. 1gbit, 100mbit"),
             delay: Optional[str] = typer.Option(None, "--delay", help="one-way, e.g. 5ms"),
             jitter: Optional[str] = typer.Option(None, "--jitter", help="e.g. 1ms"),
             loss: Optional[str] = typer.Option(None, "--loss", help="e.g. 1% (or a fraction)"),
             queue: Optional[str] = typer.Option(None, "--queue", help="packets"),
             direction: str = DirectionOption, name: Optional[str] = NameOption) -> None:
        """Change a link's bandwidth/delay/jitter/loss/queue (scaled by the testbed's time dilation)."""
        from testbed.faults import control
        from testbed.faults.scenario import ScenarioError, format_changes, parse_direction, parse_link_changes

        raw = {k: v for k, v in (("bandwidth", bandwidth), ("delay", delay), ("jitter", jitter),
                                 ("loss", loss), ("queue", queue)) if v is not None}
        try:
            changes = parse_link_changes(raw, path="")
            # also accept the node names: --direction w0->edge0-0
            named = {f"{a}->{b}": "A->B", f"{b}->{a}": "B->A"}
            direction = named.get(direction.replace(" ", ""), direction)
            direction = parse_direction(direction, path="--direction")
        except ScenarioError as e:
            raise control.FaultError(f"--{e.path.lstrip('.')}: {e.reason} (got {e.value!r})"
                                     if e.path and e.path != "--direction" else str(e)) from None
        require_root("testbed link set")
        name = resolve_name(name, clusters=True)
        if _spread(name):
            forward_to_hosts(name)
            return
        link = control.link_set(name, a, b, changes, direction)
        console.print(f"{a} <-> {b}: {format_changes(changes)}"
                      f"{'' if direction == 'both' else f' ({direction})'}; now "
                      f"A->B {format_profile(link['ab'])}, B->A {format_profile(link['ba'])}", highlight=False)

    @link_app.command("down")
    def down(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
             name: Optional[str] = NameOption) -> None:
        """Take a link down (both ends); ECMP fails over where there is another path."""
        from testbed.faults import control

        require_root("testbed link down")
        name = resolve_name(name, clusters=True)
        if _spread(name):
            forward_to_hosts(name)
            return
        went = control.link_down(name, a, b)
        console.print(f"{a} <-> {b}: down" + ("" if went else " (it was down already)"), highlight=False)

    @link_app.command("up")
    def up(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
           name: Optional[str] = NameOption) -> None:
        """Bring a link downed with `link down` back up."""
        from testbed.faults import control

        require_root("testbed link up")
        name = resolve_name(name, clusters=True)
        if _spread(name):
            forward_to_hosts(name)
            return
        left = control.link_up(name, a, b)
        console.print(f"{a} <-> {b}: " + (f"still down ({', '.join(left)})" if left else "up"), highlight=False)

    @link_app.command("reset")
    def reset(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
              name: Optional[str] = NameOption) -> None:
        """A link back to the topology's profile, and up."""
        from testbed.faults import control

        require_root("testbed link reset")
        name = resolve_name(name, clusters=True)
        if _spread(name):
            forward_to_hosts(name)
            return
        control.link_reset(name, a, b)
        console.print(f"{a} <-> {b}: reset to the topology's profile", highlight=False)
