"""testbed events [-f] [--json]: what changed in a testbed, from `up` on."""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, err_console, resolve_name


def events_cmd(name: Optional[str] = NameOption,
               follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until "
                                                                         "Ctrl-C or `testbed down`."),
               as_json: bool = typer.Option(False, "--json", help="One JSON object per line, as stored."),
               kind: Optional[str] = typer.Option(None, "--kind", help="Only these kinds (comma list): "
                                                  "up, down, link, node, partition, scenario, run, verdict, capture.")) -> None:
    """Print the testbed's events from the start: up, link and node changes, partitions, scenario steps, runs and their verdicts (-f: keep following).

    Runs report their start, step milestones (1, 10, 100, ... and every 1,000th) and end. Stored
    in /run/testbed/NAME/events.jsonl while the testbed is up; --json prints the records as stored."""
    from testbed import events
    from testbed.errors import TestbedError

    name = resolve_name(name)
    kinds = None
    if kind:
        kinds = {k.strip() for k in kind.split(",") if k.strip()}
        bad = sorted(kinds - set(events.KINDS))
        if bad:
            raise TestbedError(f"--kind {','.join(bad)}: not an event kind ({', '.join(events.KINDS)})")
    skipped = [0]
    try:
        for rec in events.read(name, follow=follow, skipped=skipped):
            if kinds and rec["kind"] not in kinds:
                continue
            if as_json:
                print(json.dumps(rec), flush=True)
            else:
                console.print(events.describe(rec), highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        pass
    if skipped[0]:
        err_console.print(f"{skipped[0]} line(s) of {events.path(name)} are not events and were skipped")


def register(app: typer.Typer) -> None:
    app.command("events")(events_cmd)
