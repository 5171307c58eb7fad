"""testbed exec NODE [--name NAME] -- CMD ...: run a command inside a node.

On this host, this process becomes the command: its stdio, status and signals are the caller's.
Over several hosts, the node's host's agent runs it (stdin is not passed on), its output comes back
as it comes, and a Ctrl-C here interrupts it there (testbed.agent.commands)."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from testbed.cli import common
from testbed.cli.common import fail


def exec_cmd(
    node: str = typer.Argument(..., help="A worker or a switch."),
    cmd: List[str] = typer.Argument(None, metavar="-- CMD ...", help="The command and its arguments."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="The testbed (default: the only one up)."),
) -> None:
    """Run CMD inside NODE with stdin/stdout/stderr passed through; exit with its status."""
    from testbed.handle import open_testbed

    cmd = list(cmd or [])
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        fail("no command given: testbed exec NODE -- CMD ...", 2)
    tb = open_testbed(name)

    def out(fd: int, text: str) -> None:   # (over several hosts: the command's output as it comes)
        stream = sys.stdout if fd == 1 else sys.stderr
        stream.write(text)
        stream.flush()

    raise typer.Exit(tb.exec(node, cmd, out, progress=lambda m: common.err_console.print(m, highlight=False)))


def register(app: typer.Typer) -> None:
    app.command("exec")(exec_cmd)
