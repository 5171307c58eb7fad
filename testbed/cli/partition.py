"""testbed partition A,B,.. C,D,.. and testbed heal."""

from __future__ import annotations

from typing import List, Optional

import typer

from testbed.cli.common import NameOption, console, forward_to_hosts, require_root, resolve_name


def _spread(name: str) -> bool:
    from testbed import store
    from testbed.cluster import controller

    return controller.exists(name) and not store.exists(name)


def register(app: typer.Typer) -> None:
    @app.command("partition")
    def partition(groups: List[str] = typer.Argument(..., metavar="GROUP...",
                                                     help="Comma-separated nodes, e.g. w0,w1 w2,w3"),
                  name: Optional[str] = NameOption) -> None:
        """Split the workers into groups that cannot reach each other.

        A switch stands for the workers attached to it; workers in no group form one more group
        (so `testbed partition w0` isolates w0). Undo with `testbed heal`.
        """
        from testbed.faults import control

        require_root("testbed partition")
        split = [[x.strip() for x in g.split(",") if x.strip()] for g in groups]
        target = resolve_name(name, clusters=True)
        if _spread(target):
            forward_to_hosts(target)   # every host: each drops at its own workers, from the same groups
            return
        resolved = control.partition(target, split)
        console.print("partitioned: " + " | ".join(",".join(g) for g in resolved), highlight=False)

    @app.command("heal")
    def heal(name: Optional[str] = NameOption) -> None:
        """Undo `testbed partition`."""
        from testbed.faults import control

        require_root("testbed heal")
        target = resolve_name(name, clusters=True)
        if _spread(target):
            forward_to_hosts(target)
            return
        healed = control.heal(target)
        console.print("healed" if healed else "no partition to heal")
