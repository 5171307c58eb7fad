"""testbed attach NODE: an interactive shell inside a worker (or a switch).

Leaving the shell (exit, Ctrl-D) leaves the node running: the shell is one
more process entered into the node's namespaces, not the node's init.

A testbed over several hosts: the controller's SSH sessions carry no
terminal, so `attach` there runs ssh(1) -t to the node's host with the hosts
file's key and port and the testbed's known hosts (testbed.handle.hosts;
testbed.cluster.ssh_command writes the command).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from testbed.cli.common import NameOption, require_root


def register(app: typer.Typer) -> None:
    @app.command(help="Open an interactive shell inside NODE (a worker or a switch). "
                      "Exiting the shell leaves the node running.")
    def attach(node: str = typer.Argument(..., help="The worker or switch to enter."),
               name: Optional[str] = NameOption) -> None:
        from testbed.cli.common import err_console
        from testbed.handle import open_testbed

        require_root("attach")
        tb = open_testbed(name)
        if not tb.hosts and not sys.stdin.isatty():
            err_console.print("note: stdin is not a terminal; for one command use "
                              f"`testbed exec {node} -- CMD`", highlight=False)
        raise typer.Exit(tb.attach(node, say=lambda m: err_console.print(m, highlight=False, soft_wrap=True)))
