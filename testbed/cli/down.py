"""testbed down [NAME | --all]: remove a running testbed."""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import console, err_console, fail, require_root


def down_cmd(
    name_arg: Optional[str] = typer.Argument(None, metavar="[NAME]", help="The testbed (default: the only one up)."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="The testbed (same as NAME)."),
    all_: bool = typer.Option(False, "--all", help="Bring down every testbed that is up."),
) -> None:
    """Bring a testbed down and remove everything it made."""
    from testbed import lifecycle

    require_root("testbed down")
    if all_:
        if name_arg or name:
            fail("give a NAME or --all, not both", 2)
        done = lifecycle.down_all()
        console.print(f"removed {len(done)} testbed(s){': ' + ', '.join(done) if done else ''}")
        return
    if name_arg and name and name_arg != name:
        fail(f"two different names given ({name_arg}, {name})", 2)
    from testbed.handle import open_testbed

    tb = open_testbed(name_arg or name)
    for note in tb.down(progress=lambda m: err_console.print(m, highlight=False)):
        err_console.print(f"[yellow]warning:[/] {note}", highlight=False)
    console.print(f"testbed {tb.name} is down" + (" on every host" if tb.hosts else ""))


def register(app: typer.Typer) -> None:
    app.command("down")(down_cmd)
