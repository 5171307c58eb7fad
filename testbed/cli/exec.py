"""testbed exec NODE [--name NAME] -- CMD ...: run a command inside a node."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from testbed.cli.common import fail, resolve_name


def exec_cmd(
    node: str = typer.Argument(..., help="A worker or a switch."),
    cmd: List[str] = typer.Argument(None, metavar="-- CMD ...", help="The command and its arguments."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="The testbed (default: the only one up)."),
) -> None:
    """Run CMD inside NODE with stdin/stdout/stderr passed through; exit with its status."""
    from testbed import lifecycle

    cmd = list(cmd or [])
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        fail("no command given: testbed exec NODE -- CMD ...", 2)
    target = resolve_name(name, clusters=True)
    from testbed import store
    from testbed.cluster import controller

    if controller.exists(target) and not store.exists(target):
        # on the node's host; its output comes back when it ends (stdin is not passed on)
        r = controller.run_on_node_host(target, node, ["exec", node, "--name", target, "--", *cmd])
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        raise typer.Exit(r.rc if r.rc >= 0 else 1)
    st = lifecycle.load(target)
    argv = lifecycle.exec_argv(st, node, cmd)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)  # the command's status, signals and stdio are the caller's
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc}", 127)


def register(app: typer.Typer) -> None:
    app.command("exec")(exec_cmd)
