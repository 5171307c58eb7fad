"""testbed scenario plan|run FILE: a timeline of faults played against a job on a running testbed."""

from __future__ import annotations

import json
from typing import Optional

import typer

from testbed.cli.common import NameOption, console, require_root, resolve_name


def _topology_for_plan(scenario, name: Optional[str], topology: Optional[str]):
    """(topology, dilation): --topology, else the running testbed (--name or the only one; one over
    several hosts: the controller's record), else the scenario's own `topology:` field."""
    from testbed.faults import control
    from testbed import store
    from testbed.cluster import controller
    from testbed.topology.loader import load_topology

    if topology:
        t = load_topology(topology)
        return t, 1.0
    local = store.list_names()
    up = local + [n for n in controller.list_names() if n not in local]
    if name or len(up) == 1 or not scenario.topology:
        target = resolve_name(name, clusters=True)
        if _spread(target):
            from testbed.topology.model import Topology

            doc = controller.load(target)
            return Topology.from_json(doc["topology"]), float(doc.get("time_dilation") or 1.0)
        h = control.Handle(target)
        return h.topo, h.dilation
    return scenario.load_topology(), 1.0


def _spread(name: str) -> bool:
    """A testbed over several hosts, driven from here (only the controller's record is here)."""
    from testbed.faults.hosts_player import spans_hosts

    return spans_hosts(name)


def _host_verb(sc: typer.Typer, verb: str, what: str, fn_name: str) -> None:
    """A hidden verb the controller of a testbed over several hosts runs on each host during
    `scenario run`: --data JSON in, one JSON line out (testbed.faults.hosts_player)."""

    @sc.command(verb, hidden=True, help=what)
    def host_cmd(name: str = typer.Option(..., "--name", "-n"),
                 data: str = typer.Option("{}", "--data", help="JSON from the controller")) -> None:
        from testbed.faults import hosts_player

        require_root(f"testbed scenario {verb}")
        target = resolve_name(name)   # this host's own part
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise typer.BadParameter(f"--data: not JSON ({e})") from None
        typer.echo(json.dumps(getattr(hosts_player, fn_name)(target, doc)))


def register(app: typer.Typer) -> None:
    sc = typer.Typer(help="Scenario files: a timeline of faults played against a running job.",
                     no_args_is_help=True)
    app.add_typer(sc, name="scenario")

    @sc.command("plan")
    def plan_cmd(file: str = typer.Argument(..., help="The scenario YAML file."),
                 name: Optional[str] = NameOption,
                 topology: Optional[str] = typer.Option(None, "--topology", "-t",
                                                        help="Plan against this topology instead of a running "
                                                             "testbed."),
                 as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        """Resolve the timeline (random picks included) and print it; changes nothing.

        The same file and seed always give the same plan.
        """
        from testbed.faults.scenario import load_scenario, plan_scenario

        scenario = load_scenario(file)
        topo, dilation = _topology_for_plan(scenario, name, topology)
        plan = plan_scenario(scenario, topo, dilation)
        if as_json:
            typer.echo(json.dumps(plan.to_json(), indent=1))
        else:
            typer.echo(plan.format())

    @sc.command("run")
    def run_cmd(file: str = typer.Argument(..., help="The scenario YAML file."),
                name: Optional[str] = NameOption,
                hang_after: Optional[str] = typer.Option(None, "--hang-after",
                                                         help="No step progress for this long: hung (e.g. 30s)."),
                timeout: Optional[str] = typer.Option(None, "--timeout", help="End the run after this long."),
                quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not stream the ranks' output.")) -> None:
        """Run the scenario's job on the running testbed and play its events against it.

        Brings nothing up. Writes events.jsonl, scenario.json and scenario.png into the run directory;
        leaves the testbed as the topology describes it. Exit status: 0 completed, 1 failed, 124 hung.
        On a testbed over several hosts the job runs as `testbed run` does there, and every host
        applies each step to what it holds.
        """
        from testbed.faults.control import FaultError
        from testbed.faults.player import play
        from testbed.faults.scenario import load_scenario
        from testbed.topology.units import parse_time

        def secs(value, opt):
            if value is None:
                return None
            try:
                return parse_time(value)
            except ValueError as e:
                raise FaultError(f"{opt}: {e} (got {value!r})") from None

        ha, to = secs(hang_after, "--hang-after"), secs(timeout, "--timeout")
        scenario = load_scenario(file)
        require_root("testbed scenario run")
        name = resolve_name(name, clusters=True)
        echo = (lambda line: console.print(line, highlight=False, markup=False)) if not quiet else \
            (lambda line: console.print(line, highlight=False, markup=False) if line.startswith("[scenario]")
             else None)
        if _spread(name):   # every step applied by every host to what it holds (testbed.faults.hosts_player)
            from testbed.faults import hosts_player

            res = hosts_player.play(name, scenario, hang_after=ha, timeout=to, echo=echo)
        else:
            res = play(name, scenario, hang_after=ha, timeout=to, echo=echo)
        colour = {"completed": "green", "failed": "red", "hung": "yellow"}[res.outcome]
        console.print(f"[bold {colour}]{res.outcome}[/]" + (f": {res.error}" if res.error else ""),
                      highlight=False)
        console.print(f"run directory: {res.run_dir}  (events.jsonl, scenario.json, scenario.png)",
                      highlight=False)
        raise typer.Exit(res.exit_code)

    _host_verb(sc, "host-check", "(scenario run over several hosts) check the steps against this host's part.",
               "check_here")
    _host_verb(sc, "host-apply", "(scenario run over several hosts) apply steps to this host's part at their "
                                 "times.", "apply_here")
    _host_verb(sc, "host-follow", "(scenario run over several hosts) apply the batches of steps the controller "
                                  "sends on the lifeline, each at its time.", "follow_here")
    _host_verb(sc, "host-restore", "(scenario run over several hosts) this host's part back as the topology "
                                   "describes it.", "restore_here")
