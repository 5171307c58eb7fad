"""testbed events [-f] [--json]: what changed in a testbed, from `up` on.

A testbed over several hosts: each host keeps its own stream (what it changed on its part). From the
controller, every host's agent is asked at once (testbed.handle) and their events are printed merged
in time order (each host's clock), with the host of each (a HOST column; a `host` field with --json).
With -f, every host's events stream back and each is printed as it arrives, in arrival order (not
re-sorted: an event of a distant host may show a little after a later one of a near host), until
Ctrl-C (every host's stream then ends) or `testbed down`. A host that fails or cannot be reached
is named on stderr with why, the others still shown; the exit status is then 1 (with -f too: a host
that could not be followed, not the Ctrl-C that ends it).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, console, err_console
from testbed.terminal import inert

HEADER = "TIME          {host:<{w}}  KIND      WHAT"


def _print(rec: dict[str, Any], as_json: bool, width: int | None) -> None:
    from testbed import events

    if as_json:
        print(json.dumps(rec), flush=True)
    else:
        console.print(inert(events.describe(rec, host_width=width)), highlight=False, markup=False, soft_wrap=True)


def events_cmd(name: Optional[str] = NameOption,
               follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until "
                                                                         "Ctrl-C or `testbed down`."),
               as_json: bool = typer.Option(False, "--json", help="One JSON object per line, as stored."),
               kind: Optional[str] = typer.Option(None, "--kind", help="Only these kinds (comma list): "
                                                  "up, down, link, node, partition, scenario, run, verdict, capture.")) -> None:
    """Print the testbed's events from the start: up, link and node changes, partitions, scenario steps, runs and their verdicts (-f: keep following).

    Runs report their start, step milestones (1, 10, 100, ... and every 1,000th) and end. Stored
    in /run/testbed/NAME/events.jsonl while the testbed is up; --json prints the records as stored.
    Over several hosts: every host's events merged in time order, with a HOST column (a "host"
    field with --json); with -f, each as it arrives from its host."""
    from rich.text import Text

    from testbed import events
    from testbed.errors import TestbedError
    from testbed.handle import open_testbed
    from testbed.handle.base import Note

    kinds = None
    if kind:
        kinds = sorted({k.strip() for k in kind.split(",") if k.strip()})
        bad = sorted(set(kinds) - set(events.KINDS))
        if bad:
            raise TestbedError(f"--kind {','.join(bad)}: not an event kind ({', '.join(events.KINDS)})")
    tb = open_testbed(name)
    width = max(4, *(len(h) for h in tb.hosts)) if tb.hosts else None
    if width is not None and not as_json:
        console.print(HEADER.format(host="HOST", w=width), style="bold", highlight=False)
    failed = False
    got = tb.events(kinds, follow)
    try:
        for rec in got:
            if not isinstance(rec, Note):
                _print(rec, as_json, width)
            elif rec.failed:   # (a host's words: text, never markup)
                failed = True
                err_console.print(Text.assemble((inert(rec.host or "here"), "red"), ": ", inert(rec.text)))
            else:
                err_console.print(inert(f"{rec.host}: {rec.text}" if rec.host else rec.text), highlight=False,
                                  markup=False)
    except KeyboardInterrupt:   # the end of -f
        pass
    finally:
        got.close()
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("events")(events_cmd)
