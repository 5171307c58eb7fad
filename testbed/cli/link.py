"""testbed link show|set|down|up|reset: change a running testbed's links (see testbed.faults.control)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, on_hosts, require_root
from testbed.topology.units import format_profile

DirectionOption = typer.Option("both", "--direction", "-d",
                               help="both, A->B (traffic from A to B), B->A, or with node names: w0->edge0-0.")



def register(app: typer.Typer) -> None:
    link_app = typer.Typer(help="Show and change the links of a running testbed (takes effect at once).",
                           no_args_is_help=True)
    app.add_typer(link_app, name="link")

    @link_app.command("show")
    def show(name: Optional[str] = NameOption,
             as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
             changed: bool = typer.Option(False, "--changed", help="Only links that are down or changed.")) -> None:
        """Every link: state, and the profile it runs at now (emulated units)."""
        from rich.markup import escape
        from rich.table import Table

        from testbed.handle import open_testbed

        tb = open_testbed(name)
        links = tb.link_show()
        if changed:
            links = [l for l in links if l["state"] != "up" or l["changed"]]
        if as_json:
            typer.echo(json.dumps(links, indent=1))
            return
        t = Table(title=f"links of {tb.name}")
        for col in ("#", "A", "B", "tier", "state", "A->B", "B->A"):
            t.add_column(col)
        for l in links:
            st = l["state"] + (f" ({', '.join(l['down_by'])})" if l["state"] == "down" else "")
            st += " *" if l["changed"] else ""
            t.add_row(str(l["index"]), l["endpoints"][0], l["endpoints"][1], escape(l["tier"]), escape(st),
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
        from testbed.handle import open_testbed
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
        tb = open_testbed(name)
        link = tb.link_set(a, b, changes, direction)
        console.print(f"{a} <-> {b}: {format_changes(changes)}"
                      f"{'' if direction == 'both' else f' ({direction})'}; now "
                      f"A->B {format_profile(link['ab'])}, B->A {format_profile(link['ba'])}{on_hosts(tb)}",
                      highlight=False)

    @link_app.command("down")
    def down(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
             name: Optional[str] = NameOption) -> None:
        """Take a link down (both ends); ECMP fails over where there is another path."""
        from testbed.handle import open_testbed

        require_root("testbed link down")
        tb = open_testbed(name)
        went = tb.link_down(a, b)
        console.print(f"{a} <-> {b}: down" + ("" if went else " (it was down already)") + on_hosts(tb),
                      highlight=False)

    @link_app.command("up")
    def up(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
           name: Optional[str] = NameOption) -> None:
        """Bring a link downed with `link down` back up."""
        from testbed.handle import open_testbed

        require_root("testbed link up")
        tb = open_testbed(name)
        left = tb.link_up(a, b)
        console.print(f"{a} <-> {b}: " + (f"still down ({', '.join(left)})" if left else "up") + on_hosts(tb),
                      highlight=False)

    @link_app.command("reset")
    def reset(a: str = typer.Argument(..., metavar="A"), b: str = typer.Argument(..., metavar="B"),
              name: Optional[str] = NameOption) -> None:
        """A link back to the topology's profile, and up."""
        from testbed.handle import open_testbed

        require_root("testbed link reset")
        tb = open_testbed(name)
        tb.link_reset(a, b)
        console.print(f"{a} <-> {b}: reset to the topology's profile{on_hosts(tb)}", highlight=False)
