"""The `testbed` command line. Thin: each verb is a module of this package
with a `register(app)` function; the work happens in the layers below.

Verbs are registered by name in VERBS and imported only when used, so
`testbed --help` imports no verb at all and `testbed ls` imports one: the
line `--help` shows for a verb is its summary here (tests/test_cli_imports.py
checks it against the verb's own help)."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import typer
from typer.core import TyperCommand, TyperGroup

from testbed.cli.common import run_app


class Verb(NamedTuple):
    module: str   # testbed.cli.<module>, whose register(app) registers this verb
    summary: str  # the line `testbed --help` shows


# Adding a verb: a module with register(app), and one line here.
VERBS: dict[str, Verb] = {
    "attach": Verb("attach", "Open an interactive shell inside NODE (a worker or a switch). "
                             "Exiting the shell leaves the node running."),
    "calibrate": Verb("calibrate", "Measure (or show) the reference model's constants for this machine "
                                   "(kept per boot)."),
    "capture": Verb("capture", "Capture the packets of one link end in pcap format, to a file or to stdout."),
    "cleanup": Verb("cleanup", "Remove what dead testbeds left behind (half-built or half-gone); "
                               "healthy testbeds are kept."),
    "cp": Verb("cp", "Copy files or directories between the host and nodes: `testbed cp w3:/tmp/out.txt .`, "
                     "`testbed cp ./data w0:/tmp/`, `testbed cp w0:/a w1:/b`."),
    "doctor": Verb("doctor", "Probe the kernel and machine: netem, HTB, TAP delay line, BPF loss, Docker, GPUs, "
                             "latency floor."),
    "down": Verb("down", "Bring a testbed down and remove everything it made."),
    "events": Verb("events", "Print the testbed's events from the start: up, link and node changes, partitions, "
                             "scenario steps, runs and their verdicts (-f: keep following)."),
    "exec": Verb("exec", "Run CMD inside NODE with stdin/stdout/stderr passed through; exit with its status."),
    "install": Verb("install", "Install this controller's testbed (its version, its dependencies' versions) on "
                               "the hosts of a hosts file, over SSH."),
    "logs": Verb("logs", "Show the output of the jobs started in NODE (-f: keep following it)."),
    "ls": Verb("ls", "List the testbeds that are up."),
    "part": Verb("part", "One host's side of a testbed over several hosts (run by the controller over SSH)."),
    "partition": Verb("partition", "Split the workers into groups that cannot reach each other."),
    "heal": Verb("partition", "Undo `testbed partition`."),
    "ps": Verb("ps", "List the processes running in each worker (or the NODEs named)."),
    "report": Verb("report", "Iteration times, throughput, bytes per link tier, the collectives against the "
                             "model, the verdict."),
    "run": Verb("run", "Start CMD on every selected worker the torchrun way; logs and probe data go to "
                       "runs/<time>-<testbed>/."),
    "stacks": Verb("stacks", "Show the Python stack of every rank of the running job, grouped by identical "
                             "stacks (py-spy)."),
    "status": Verb("status", "Show a running testbed: nodes with addresses, links with their shaping and state."),
    "topo": Verb("topo", "Validate a topology and describe it (counts, tiers, bisection, oversubscription); "
                         "builds nothing."),
    "up": Verb("up", "Build a testbed from TOPOLOGY and leave it running."),
    "version": Verb("version", "Print testbed's version."),
    "link": Verb("link", "Show and change the links of a running testbed (takes effect at once)."),
    "node": Verb("node", "Fail, restart or slow down a node of a running testbed."),
    "scenario": Verb("scenario", "Scenario files: a timeline of faults played against a running job."),
    "top": Verb("top", "Watch a running testbed live: per link direction rate, utilisation, queue and drops; "
                       "workers' CPU and memory; the running job's step."),
    "graph": Verb("graph", "Serve a live web page of a testbed: link utilisation, what is down, step times, events."),
}


def load_verb(name: str) -> Any:
    """The click command of one verb, built from its module alone (the others stay unimported)."""
    verb = VERBS[name]
    module = importlib.import_module(f"{__name__}.{verb.module}")
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
    help="A cluster in a box for distributed training: emulated datacenter networks, "
         "containers and real training jobs on one machine.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """A cluster in a box for distributed training: emulated datacenter networks,
    containers and real training jobs on one machine."""


def main() -> None:
    run_app(app)
