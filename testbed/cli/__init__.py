"""The `testbed` command line. Thin: each verb is a module of this package
with a `register(app)` function; the work happens in the layers below.

Verbs are registered by name in VERBS (verbs.py) and imported only when used, so
`testbed --help` imports no verb at all and `testbed ls` imports one: the
line `--help` shows for a verb is its summary here (tests/test_cli_imports.py
checks it against the verb's own help). The root's help and --version are
printed from this table without importing the CLI library (typer, rich:
~150 ms); every other command line goes to the typer app (testbed/cli/app.py)."""

from __future__ import annotations

import sys
from typing import Any

from testbed.cli.verbs import SUMMARY, VERBS, VERSION_HELP, Verb, root_help  # noqa: F401 (the package's names)


def load_verb(name: str) -> Any:
    """The click command of one verb, built from its module alone (the others stay unimported)."""
    from testbed.cli.app import load_verb as load

    return load(name)


def main() -> None:
    args = sys.argv[1:]
    if args in ([], ["--help"], ["-h"]):
        sys.stdout.write(root_help())
        return
    if args in (["--version"], ["-V"]):
        from testbed import __version__

        sys.stdout.write(__version__ + "\n")
        return
    from testbed.cli.app import app
    from testbed.cli.common import run_app

    run_app(app)
