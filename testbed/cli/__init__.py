"""The `testbed` command line. Thin: each verb is a module of this package
with a `register(app)` function; the work happens in the layers below."""

from __future__ import annotations

import importlib
import pkgutil

import typer

from testbed.cli.common import run_app

app = typer.Typer(
    name="testbed",
    help="A cluster in a box for distributed training: emulated datacenter networks, "
         "containers and real training jobs on one machine.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_NOT_VERBS = {"common"}


@app.callback()
def _root() -> None:
    """A cluster in a box for distributed training: emulated datacenter networks,
    containers and real training jobs on one machine."""



def _register_verbs() -> None:
    # One module per verb (containerlab's layout): adding a verb never edits this file.
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _NOT_VERBS or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_verbs()


def main() -> None:
    run_app(app)
