"""testbed down [NAME | --all]: remove a running testbed."""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import console, err_console, fail, require_root, resolve_name


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
    target = resolve_name(name_arg or name, clusters=True)
    from testbed.cluster import controller

    if controller.exists(target) and not lifecycle.store.exists(target):
        left = controller.down(target, progress=lambda m: err_console.print(m, highlight=False))
        if left:
            fail(f"testbed {target} is down except on: " + "; ".join(f"{h}: {why}" for h, why in left.items())
                 + f". Run `testbed down {target}` again once they are reachable.", 1)
        console.print(f"testbed {target} is down on every host")
        return
    for note in lifecycle.down(target):
        err_console.print(f"[yellow]warning:[/] {note}", highlight=False)
    console.print(f"testbed {target} is down")


def register(app: typer.Typer) -> None:
    app.command("down")(down_cmd)
