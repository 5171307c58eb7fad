"""testbed exec NODE [--name NAME] -- CMD ...: run a command inside a node."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from testbed.cli import common
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
    target = resolve_name(name)
    from testbed import store
    from testbed.cluster import controller

    if controller.exists(target) and not store.exists(target):
        # on the node's host; its output comes back when it ends (stdin is not passed on); a Ctrl-C
        # here reaches the command there as SIGINT
        r = controller.run_on_node_host(target, node, ["exec", node, "--name", target, "--", *cmd], lifeline=True,
                                        progress=lambda m: common.err_console.print(m, highlight=False))
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        raise typer.Exit(r.rc if r.rc >= 0 else 1)
    st = lifecycle.load(target)
    argv = lifecycle.exec_argv(st, node, cmd)
    sys.stdout.flush()
    sys.stderr.flush()
    if common.lifeline:
        raise typer.Exit(_run_on_a_lifeline(argv))
    try:
        os.execvp(argv[0], argv)  # the command's status, signals and stdio are the caller's
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc}", 127)


def _run_on_a_lifeline(argv: list[str]) -> int:
    """For a controller on another host: argv as a child in a process group of its own (its stdin
    empty: ours is the lifeline), and the controller's Ctrl-C passed on to that group as SIGINT, as a
    terminal passes one to its foreground group (nsenter forks into a worker's PID namespace and
    does not forward signals: the group reaches the command). Nobody is left to press it twice: a
    group still there INTERRUPT_GRACE_S later gets SIGTERM, then SIGKILL."""
    import signal
    import subprocess
    import time

    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, process_group=0)
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc}", 127)
    group = proc.pid
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not _signal_group(group, sig):
                break
            end = time.monotonic() + INTERRUPT_GRACE_S
            while time.monotonic() < end and _signal_group(group, 0):
                proc.poll()   # (the leader is reaped once it ends; its group lives while members do)
                time.sleep(0.05)
            if not _signal_group(group, 0):
                break
        rc = proc.wait()
    return rc if rc >= 0 else 128 - rc


def _signal_group(pgid: int, sig: int) -> bool:
    """killpg; False when the group has no process left (0: only ask)."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


INTERRUPT_GRACE_S = 10.0


def register(app: typer.Typer) -> None:
    app.command("exec")(exec_cmd)
