"""What every CLI verb shares: the console, error handling, name resolution."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

from testbed import lifeline as stdin_lifeline
from testbed.terminal import plain

from testbed.errors import TestbedError

console = Console()
err_console = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {plain(message)}", highlight=False)
    raise typer.Exit(code)


LIFELINE_ENV = stdin_lifeline.ENV
lifeline = False   # this process was started by a controller with its stdin as the lifeline (verbs read it here)
on_lifeline_input = stdin_lifeline.on_input   # (the lifeline itself is a leaf: layers below the CLI read it too)


def _watch_lifeline() -> None:
    global lifeline
    lifeline = stdin_lifeline.watch()


def run_app(app: typer.Typer) -> None:
    """Run the app; user errors become one message and their exit status, never a traceback."""
    command = typer.main.get_command(app)
    try:
        _watch_lifeline()   # (inside: a lifeline cut while this process starts is an interrupt too)
        # standalone mode: click prints usage errors and exits with their status itself.
        command.main(prog_name="testbed", standalone_mode=True)
    except TestbedError as exc:   # (its text may hold a path, a host's words: never markup)
        err_console.print(f"[bold red]error:[/] {plain(str(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except OSError as exc:  # a path the user gave that cannot be read or written, a missing tool
        err_console.print(f"[bold red]error:[/] {plain(str(exc))}", highlight=False)
        sys.exit(1)


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise TestbedError(f"{what} needs root (network namespaces and tc): run it with sudo")


def resolve_name(name: str | None) -> str:
    """The testbed a command acts on: NAME, or the only one that is up (testbed.handle.resolve)."""
    from testbed.handle import resolve

    return resolve(name)


def on_hosts(tb: Any) -> str:
    """" (on h1, h2)" after what a change says, for a testbed over several hosts (every host made it)."""
    from rich.markup import escape

    return f" (on {escape(plain(', '.join(tb.hosts)))})" if tb.hosts else ""


def testbed_command() -> str:
    """`testbed` as the user can type it in next commands we print: a fresh clone has it only in
    the venv, so the venv's script by its path (relative to the working directory when it is
    below it), unless that same script is what PATH finds; `sudo` in front after sudo."""
    import shutil

    script = Path(sys.executable).parent / "testbed"
    on_path = shutil.which("testbed")
    if not script.exists():
        word = "testbed" if on_path else f"{sys.executable} -m testbed"
    elif on_path and os.path.samefile(on_path, script):
        word = "testbed"
    else:
        rel = os.path.relpath(script, Path.cwd())
        word = rel if not rel.startswith("..") else str(script)
    if os.geteuid() == 0 and os.environ.get("SUDO_USER"):
        word = f"sudo {word}"
    return word


NameOption = typer.Option(None, "--name", "-n", help="The testbed to act on (default: the only one up).")


def print_dilation(st: dict[str, Any]) -> None:
    """The factor a testbed runs at and why (up and status)."""
    choice = st.get("dilation") or {}
    factor = st.get("time_dilation") or 1.0
    how = choice.get("setting", "fixed" if factor != 1.0 else "none")
    if factor != 1.0:
        console.print(f"time dilation: {factor:g} ({how}): links run at bandwidth/{factor:g} and delay*{factor:g}, "
                      f"reports and the probe's clock divide time by {factor:g}; tables show nominal profiles")
    else:
        console.print(f"time dilation: 1 ({how}): real time")
    for reason in choice.get("reasons") or []:
        console.print(f"  {reason}", highlight=False)
