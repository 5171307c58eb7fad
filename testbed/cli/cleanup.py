"""testbed cleanup: remove leftovers of testbeds whose CLI died, and nothing else."""

from __future__ import annotations

import typer

from testbed.cli.common import console, require_root


def cleanup_cmd() -> None:
    """Remove what dead testbeds left behind (half-built or half-gone); healthy testbeds are kept."""
    from testbed import lifecycle

    require_root("testbed cleanup")
    removed = lifecycle.cleanup()
    if not removed:
        console.print("nothing to clean up")
        return
    for name, what in removed:
        console.print(f"removed {name}: {what}")


def register(app: typer.Typer) -> None:
    app.command("cleanup")(cleanup_cmd)
