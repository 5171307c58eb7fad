"""testbed ps [NODE...]: the processes of each worker (or switch) (testbed.observe.processes).

A testbed over several hosts: each host lists its own nodes; from the
controller, the hosts that hold the nodes asked for (every host without NODEs)
are asked at once (testbed.handle) and their rows are merged, with a HOST
column (a `host` key with --json). PIDs are each host's. A host that does not
answer is named on stderr with why, the others still shown, and the exit
status is 1.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, err_console


def register(app: typer.Typer) -> None:
    @app.command(help="List the processes running in each worker (or the NODEs named).")
    def ps(nodes: Optional[list[str]] = typer.Argument(None, help="Nodes to show (default: every worker)."),
           all_nodes: bool = typer.Option(False, "--all", "-a", help="Switches too."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
           name: Optional[str] = NameOption) -> None:
        from rich.table import Table
        from rich.text import Text

        from testbed.handle import open_testbed
        from testbed.terminal import inert

        tb = open_testbed(name)
        rows, failed = tb.ps(list(nodes or []), all_nodes)
        for host, why in failed.items():   # (a host's words, a job's command lines: text, never markup)
            err_console.print(Text.assemble((host, "red"), ": ", inert(why)))
        if as_json:
            typer.echo(json.dumps(rows, indent=1))
            if failed:
                raise typer.Exit(1)
            return
        hosts = bool(tb.hosts)
        t = Table(box=None, header_style="bold")
        for col in ("NODE", *(("HOST",) if hosts else ()), "PID", "NSPID", "USER", "RSS", "CPU", "COMMAND"):
            t.add_column(col, justify="right" if col in ("PID", "NSPID", "RSS", "CPU") else "left",
                         overflow="fold" if col == "COMMAND" else None)
        for r in rows:
            rss = f"{r['rss_bytes'] / 2**20:.0f}M" if r["rss_bytes"] is not None else "-"
            t.add_row(r["node"], *((r.get("host") or "-",) if hosts else ()), str(r["pid"]), str(r["nspid"] or "-"),
                      Text(inert(r["user"] or "-")), rss, f"{r['cpu_s']:.1f}s" if r["cpu_s"] is not None else "-",
                      Text(inert(r["command"])))
        console.print(t)
        if not rows:
            console.print("no processes", style="dim")
        if failed:
            raise typer.Exit(1)
