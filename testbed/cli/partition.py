"""testbed partition A,B,.. C,D,.. and testbed heal."""

from __future__ import annotations

from typing import List, Optional

import typer

from testbed.cli.common import NameOption, console, on_hosts, require_root


def register(app: typer.Typer) -> None:
    @app.command("partition")
    def partition(groups: List[str] = typer.Argument(..., metavar="GROUP...",
                                                     help="Comma-separated nodes, e.g. w0,w1 w2,w3"),
                  name: Optional[str] = NameOption) -> None:
        """Split the workers into groups that cannot reach each other.

        A switch stands for the workers attached to it; workers in no group form one more group
        (so `testbed partition w0` isolates w0). Undo with `testbed heal`.
        """
        from testbed.handle import open_testbed

        require_root("testbed partition")
        split = [[x.strip() for x in g.split(",") if x.strip()] for g in groups]
        tb = open_testbed(name)   # (over several hosts: each drops at its own workers, from the same groups)
        resolved = tb.partition(split)
        console.print("partitioned: " + " | ".join(",".join(g) for g in resolved) + on_hosts(tb), highlight=False)

    @app.command("heal")
    def heal(name: Optional[str] = NameOption) -> None:
        """Undo `testbed partition`."""
        from testbed.handle import open_testbed

        require_root("testbed heal")
        tb = open_testbed(name)
        healed = tb.heal()
        console.print(("healed" if healed else "no partition to heal") + on_hosts(tb))
