"""testbed scenario plan|run FILE: a timeline of faults played against a job on a running testbed."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, console, require_root
from testbed.terminal import inert, plain


def _topology_for_plan(scenario, name: Optional[str], topology: Optional[str]):
    """(topology, dilation): --topology, else the running testbed (--name or the only one; one over
    several hosts: the controller's record), else the scenario's own `topology:` field."""
    from testbed.handle import open_testbed, up_names
    from testbed.topology.loader import load_topology

    if topology:
        t = load_topology(topology)
        return t, 1.0
    local, spread = up_names()
    if name or len(local + spread) == 1 or not scenario.topology:
        tb = open_testbed(name)
        return tb.topology(), tb.dilation()
    return scenario.load_topology(), 1.0


def _print_outcome(res: Any) -> None:
    """The run's outcome line and its expectations. res.error may be a rank's line: `[/tmp]` in it
    is text, not a closing tag, and its escape sequences are shown, not sent (testbed.terminal)."""
    colour = {"completed": "green", "failed": "red", "hung": "yellow"}[res.outcome]
    console.print(f"[bold {colour}]{res.outcome}[/]" + (f": {plain(res.error)}" if res.error else ""),
                  highlight=False)
    _print_verdicts(res.expectations)


def _print_verdicts(verdicts) -> None:
    """One line per expectation, then how many were met."""
    from testbed.faults.expect import MARKS

    if not verdicts:
        return
    colour = {True: "green", False: "red", None: "yellow"}
    for v in verdicts:
        # one line each, however narrow the terminal (a CI log is read, and searched, line by line)
        console.print(f"[bold {colour[v.ok]}]{MARKS[v.ok]:<10}[/]  {plain(v.expect)}  ->  {plain(v.detail)}",
                      highlight=False, soft_wrap=True)
    met = sum(v.ok is True for v in verdicts)
    console.print(f"[bold {'green' if met == len(verdicts) else 'red'}]expectations: {met} of {len(verdicts)} met[/]",
                  highlight=False)


def _check_junit_path(path: Path) -> None:
    """Before anything starts: --junit FILE can be written (its folder exists; it is no folder itself)."""
    from testbed.errors import TestbedError

    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise TestbedError(f"--junit {path}: the folder {parent} does not exist")
    if path.is_dir():
        raise TestbedError(f"--junit {path}: is a folder, not a file")


def _write_junit(path: Path, scenario, res, elapsed: float) -> None:
    """The verdicts as JUnit XML, written next to FILE and renamed over it (a link planted at FILE is
    replaced, never followed). Without an `expect:` block the run's outcome is the one testcase."""
    from testbed.faults.expect import Verdict, junit_xml

    verdicts = res.expectations
    if not res.judged:
        verdicts = [Verdict("outcome: completed (no expect: in the file)", res.outcome == "completed", None,
                            f"outcome {res.outcome}" + (f" ({res.error})" if res.error else ""))]
    data = junit_xml(scenario.name, verdicts, time_s=elapsed,
                     properties={"source": scenario.source, "outcome": res.outcome, "run_dir": res.run_dir})
    from testbed.errors import TestbedError

    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
    except OSError as e:
        raise TestbedError(f"--junit {path}: cannot write there: {e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise TestbedError(f"--junit {path}: cannot write it: {e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    console.print(f"JUnit XML: {path}", highlight=False, markup=False)


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
        from testbed.faults.scenario_loader import load_scenario
        from testbed.faults.scenario_planner import plan_scenario

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
                quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not stream the ranks' output."),
                junit: Optional[Path] = typer.Option(None, "--junit", metavar="FILE",
                                                     help="Write the expectations' verdicts as JUnit XML (one "
                                                          "testcase each) for a CI system.")) -> None:
        """Run the scenario's job on the running testbed and play its events against it.

        Brings nothing up. Writes events.jsonl, scenario.json and scenario.png into the run directory;
        leaves the testbed as the topology describes it. The file's `expect:` items are judged after
        the run, one line each (met, NOT MET, NOT JUDGED with the measured value).

        Exit status with an `expect:` block: 0 when every expectation is met, 1 when one is not (or
        could not be judged). Without one: 0 completed, 1 failed, 124 hung. 2: a bad file (nothing
        started). On a testbed over several hosts the job runs as `testbed run` does there, and every
        host applies each step to what it holds.
        """
        from testbed.faults.control import FaultError
        from testbed.faults.scenario_loader import load_scenario
        from testbed.handle import open_testbed
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
        if junit is not None:
            _check_junit_path(junit)
        require_root("testbed scenario run")
        tb = open_testbed(name)
        started = time.monotonic()
        # ranks' and hosts' lines: shown as written, never as markup or escape sequences (testbed.terminal)
        echo = (lambda line: console.print(inert(line), highlight=False, markup=False)) if not quiet else \
            (lambda line: console.print(inert(line), highlight=False, markup=False) if line.startswith("[scenario]")
             else None)
        res = tb.play(scenario, hang_after=ha, timeout=to, echo=echo)
        _print_outcome(res)
        console.print(f"run directory: {res.run_dir}  (events.jsonl, scenario.json, scenario.png)",
                      highlight=False, markup=False)
        if junit is not None:
            _write_junit(junit, scenario, res, time.monotonic() - started)
        raise typer.Exit(res.exit_code)

    @sc.command("judge")
    def judge_cmd(file: str = typer.Argument(..., help="The scenario YAML file (its expect: block)."),
                  run_dir: Path = typer.Argument(..., help="The run directory of a `scenario run` of it."),
                  junit: Optional[Path] = typer.Option(None, "--junit", metavar="FILE",
                                                       help="Write the verdicts as JUnit XML.")) -> None:
        """Judge the file's expectations again on a finished run (after editing them); runs nothing.

        Exit status: 0 when every expectation is met, 1 otherwise, 2 for a bad file or a run
        directory that is not this scenario's.
        """
        from testbed.faults.expect import judge, run_facts
        from testbed.faults.player import PlayResult
        from testbed.faults.scenario import ScenarioError
        from testbed.faults.scenario_loader import load_scenario
        from testbed.jobs import rundir

        scenario = load_scenario(file)
        if junit is not None:
            _check_junit_path(junit)
        doc = rundir.read_json(run_dir / "scenario.json")
        if not isinstance(doc, dict) or not isinstance(doc.get("plan"), dict):
            raise ScenarioError("no scenario.json of a scenario run there", file=str(run_dir / "scenario.json"))
        if doc.get("scenario") != scenario.name:
            raise ScenarioError(f"the run played scenario {doc.get('scenario')!r}, not this file's",
                                file=file, path="name", value=scenario.name)
        ran = {int(st.get("event", -1)) for st in doc["plan"].get("steps") or [] if isinstance(st, dict)}
        if ran - set(range(len(scenario.events))):
            raise ScenarioError(f"the run had events this file does not ({len(scenario.events)} here)",
                                file=file, path="events")
        if not scenario.expect:
            raise ScenarioError("the file has no expect: block: nothing to judge", file=file, path="expect")
        verdicts = judge(scenario.expect, run_facts(run_dir, doc))
        _print_verdicts(verdicts)
        res = PlayResult(str(doc.get("outcome")), doc.get("error"), run_dir, expectations=verdicts, judged=True)
        if junit is not None:
            _write_junit(junit, scenario, res, 0.0)
        raise typer.Exit(res.exit_code)
