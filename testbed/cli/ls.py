"""testbed ls: the testbeds that are up."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from testbed.cli.common import console


def ls_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the testbeds that are up."""
    from testbed import lifecycle

    from testbed.cluster import controller

    rows = lifecycle.list_testbeds()
    local = {r.get("name") for r in rows}
    for name in controller.list_names():
        if name not in local:
            try:
                doc = controller.load(name)
            except Exception as exc:  # noqa: BLE001 - a broken record is listed, not fatal
                rows.append({"name": name, "status": f"unreadable ({exc})"})
                continue
            topo = doc.get("topology") or {}
            rows.append({"name": name, "status": f"{doc.get('status')} on {len(doc.get('hosts', {}))} hosts",
                         "topology": topo.get("name", ""), "workers": sum(1 for n in topo.get("nodes", [])
                                                                          if n.get("kind") == "worker"),
                         "switches": sum(1 for n in topo.get("nodes", []) if n.get("kind") == "switch"),
                         "links": len(topo.get("links", [])), "runtime": "hosts", "created": doc.get("created")})
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
