"""The typer app of the `testbed` command line: the root group that imports a verb's module
when the verb runs (testbed/cli/__init__.py holds the verbs table, the root's help and --version)."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from testbed.cli.verbs import SUMMARY, VERBS, VERSION_HELP


def load_verb(name: str) -> Any:
    """The click command of one verb, built from its module alone (the others stay unimported)."""
    verb = VERBS[name]
    module = importlib.import_module(f"testbed.cli.{verb.module}")
    scratch = typer.Typer(add_completion=False)
    module.register(scratch)
    command = typer.main.get_group(scratch).commands.get(name)
    if command is None:
        raise LookupError(f"testbed.cli.{verb.module}.register() registers no verb {name!r}")
    command.short_help = verb.summary
    return command


def _help_flag_is_false(command: Any, ctx: Any) -> None:
    # typer leaves an absent --help flag at None, and coercing None builds a pydantic
    # TypeAdapter (~80 ms of imports) on every run; False is what the flag means.
    option = command.get_help_option(ctx)
    if option is not None and option.default is None:
        option.default = False
    for sub in getattr(command, "commands", {}).values():
        _help_flag_is_false(sub, ctx)


class _Unloaded(TyperCommand):
    """A verb not imported yet: its name and summary, enough for listings and suggestions."""


class _Verbs(TyperGroup):
    """The root group: lists VERBS by their summaries, imports a verb's module when it runs."""

    _listing = False

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for name, verb in VERBS.items():
            self.commands.setdefault(name, _Unloaded(name=name, short_help=verb.summary))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = self.commands.get(cmd_name)
        if isinstance(command, _Unloaded) and not self._listing:  # listing needs only the summary
            command = load_verb(cmd_name)
            _help_flag_is_false(command, ctx)
            self.commands[cmd_name] = command
        return command

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None and option.default is None:
            option.default = False
        return option

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="testbed",
    cls=_Verbs,
    help=SUMMARY,
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from testbed import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                       help=VERSION_HELP)) -> None:
    """A cluster in a box for distributed training: emulated datacenter networks,
    containers and real training jobs on one machine."""
