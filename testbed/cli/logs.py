"""testbed logs NODE [-f]: the output of the jobs started in a node (testbed.observe.logs).

Jobs write their output under the node's log directory,
/run/testbed/NAME/logs/NODE/ (TESTBED_LOG_DIR inside the worker; see
testbed/runtime/env.py), one file per job. This prints every non-empty file
there, oldest first, with a `==> file <==` header when there are several;
with -f it keeps following them, new files included, until Ctrl-C.

A testbed over several hosts: the logs are read by the agent of the node's
host (testbed.handle), and come back as they are read; with -f a Ctrl-C here
ends the stream there.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from testbed import terminal
from testbed.cli.common import NameOption


def register(app: typer.Typer) -> None:
    @app.command(help="Show the output of the jobs started in NODE (-f: keep following it).")
    def logs(node: str = typer.Argument(..., help="The worker (or switch) whose logs to show."),
             follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output until Ctrl-C."),
             tail: Optional[int] = typer.Option(None, "--tail", help="Only the last N lines of each file."),
             name: Optional[str] = NameOption) -> None:
        from testbed.cli.common import err_console
        from testbed.handle import open_testbed

        tb = open_testbed(name)

        def out(text: str) -> None:   # (made inert where it was read; again here: a host may be hostile)
            sys.stdout.write(terminal.inert(text))
            sys.stdout.flush()

        shown, d = tb.logs(node, out, follow=follow, tail=tail)
        if not shown and not follow:
            err_console.print(f"no output from jobs in {node} yet (they write to {terminal.inert(d)})", highlight=False,
                              markup=False)
