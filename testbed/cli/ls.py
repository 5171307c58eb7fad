"""testbed ls: the testbeds that are up."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from testbed.cli.common import console


def ls_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the testbeds that are up."""
    from testbed.handle.everywhere import up_rows

    rows = up_rows()
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    if not rows:
        console.print("no testbed is up (testbed up TOPOLOGY)")
        return
    t = Table()
    for col in ("name", "status", "topology", "workers", "switches", "links", "runtime", "created"):
        t.add_column(col)
    for r in rows:
        t.add_row(*(str(r.get(c, "")) for c in ("name", "status", "topology", "workers", "switches", "links",
                                               "runtime", "created")))
    console.print(t)


def register(app: typer.Typer) -> None:
    app.command("ls")(ls_cmd)
