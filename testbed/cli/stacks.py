"""testbed stacks: where every rank of the running job is, grouped by identical stacks."""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, require_root, resolve_name


def stacks_cmd(name: Optional[str] = NameOption,
               workers: Optional[str] = typer.Option(None, "--workers", "-w", help="Only the ranks on these "
                                                     "workers (comma list)."),
               depth: int = typer.Option(12, "--depth", help="Innermost frames shown per group."),
               as_json: bool = typer.Option(False, "--json", help="Every rank's stack as JSON.")) -> None:
    """Show the Python stack of every rank of the running job, grouped by identical stacks (py-spy).

    "15 ranks (0-6, 8-15) in all_reduce" and "1 rank (7)" in the data loader read at a glance; the
    collective is named from the stack. Ranks are read from outside and not stopped for long.
    `testbed run` and scenarios save the same into the run directory (stacks.txt) when they
    declare a job hung or timed out."""
    from testbed.jobs import stacks

    require_root("testbed stacks")
    name = resolve_name(name)
    got = stacks.take(name)
    if workers:
        keep = {w.strip() for w in workers.split(",") if w.strip()}
        got = [s for s in got if s.worker in keep]
    if as_json:
        print(json.dumps(stacks.to_json(got), indent=1))
        return
    if not got:
        console.print(f"no rank of a job is running on testbed {name!r} (testbed run starts one)")
        return
    console.print(stacks.render(got, depth=depth), highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("stacks")(stacks_cmd)
