"""testbed stacks: where every rank of the running job is, grouped by identical stacks.

A testbed over several hosts: from the controller, the agent of every host that holds workers (those
of --workers, when given) is asked at once (testbed.handle); their ranks are merged (testbed.jobs.stacks.
merge_hosts) and identical stacks grouped across hosts, each group with its count of ranks per host
("3 ranks (0, 2-3) [h1: 1, h2: 2] in all_reduce"); --json adds each rank's `host` (PIDs are each
host's). A host that fails is named on stderr with why, the others still shown, and the exit status
is 1.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, err_console, require_root


def stacks_cmd(name: Optional[str] = NameOption,
               workers: Optional[str] = typer.Option(None, "--workers", "-w", help="Only the ranks on these "
                                                     "workers (comma list)."),
               depth: int = typer.Option(12, "--depth", help="Innermost frames shown per group."),
               as_json: bool = typer.Option(False, "--json", help="Every rank's stack as JSON.")) -> None:
    """Show the Python stack of every rank of the running job, grouped by identical stacks (py-spy).

    "15 ranks (0-6, 8-15) in all_reduce" and "1 rank (7)" in the data loader read at a glance; the
    collective is named from the stack. Ranks are read from outside and not stopped for long.
    `testbed run` and scenarios save the same into the run directory (stacks.txt) when they
    declare a job hung or timed out. Over several hosts: every host's ranks, identical stacks
    grouped across hosts with a count per host ("[h1: 1, h2: 2]"; a "host" per rank with --json)."""
    from rich.text import Text

    from testbed.handle import open_testbed
    from testbed.jobs import stacks
    from testbed.terminal import inert

    require_root("testbed stacks")
    tb = open_testbed(name)
    keep = {w.strip() for w in workers.split(",") if w.strip()} if workers else None
    got, failed = tb.stacks(keep)
    for host, why in failed.items():   # (a host's words: text, never markup)
        err_console.print(Text.assemble((host, "red"), ": ", inert(why)))
    if as_json:
        print(json.dumps(stacks.to_json(got), indent=1))
    elif not got:
        console.print(f"no rank of a job is running on testbed {tb.name!r} (testbed run starts one)")
    else:
        console.print(inert(stacks.render(got, depth=depth)), highlight=False, markup=False)
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("stacks")(stacks_cmd)
