"""testbed sweep [SPEC.yaml] [--grid KEY=V1,V2 ...]: a what-if experiment, a run with its verdict per point."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from testbed.cli.common import console, err_console, fail, require_root

EPILOG = ("Parameters: a topology override path (params.k, tiers.host.delay, ...), link.FIELD (bandwidth, delay, "
          "jitter, loss, queue: every tier), dilation, scenario, job.steps, job.batch_size, job.args. "
          "Example: testbed sweep examples/sweep-bandwidth.yaml; testbed sweep --topology star "
          "--grid link.bandwidth=1gbit,5gbit --repeats 2 --dry-run. docs/sweep.md has the file format.")


def _document(spec: Optional[str], topology: Optional[str], grid: List[str], points: List[str], sets: List[str],
              **fields) -> tuple[dict, Optional[str], Path]:
    """The sweep document: the file's, with the command line's options over it."""
    from testbed.sweep.spec import CLI_SOURCE, data_from_options

    data: dict = {}
    source, base = CLI_SOURCE, Path(".")
    if spec:
        from testbed.errors import TopologyError
        from testbed.topology.loader import parse_yaml

        try:
            text = Path(spec).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TopologyError("sweep file not found", file=spec) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise TopologyError(f"cannot read the file: {exc}", file=spec) from None
        data = parse_yaml(text, spec)
        if not isinstance(data, dict):
            from testbed.sweep.spec import sweep_from_data

            sweep_from_data(data, spec)   # says what is wrong with it
        source, base = spec, Path(spec).parent
    elif not topology:
        fail("give a sweep file (testbed sweep SPEC.yaml) or --topology with --grid or --point", 2)
    extra = data_from_options(topology or data.get("topology", ""), grid, points, [], **fields)
    extra.pop("set")   # (added to the file's below)
    for key in ("grid", "points"):
        if key in extra:   # the command line's grid or points replace the file's
            data.pop("grid", None)
            data.pop("points", None)
    job = {**(data.get("job") or {}), **(extra.pop("job", None) or {})} if isinstance(data.get("job") or {}, dict) \
        else extra.pop("job", None)
    data.update(extra)
    if job:
        data["job"] = job
    if sets:
        data["set"] = list(data.get("set") or []) + list(sets)
    return data, source, base


def _dry_run(plan, directory: Path) -> None:
    from rich.table import Table

    from testbed import lifecycle
    from testbed.jobs import calibration
    from testbed.sweep.plan import estimate_seconds, format_duration
    from testbed.sweep.runner import predict_builds
    from testbed.sweep.table import load_rows
    from testbed.topology.dilation import choose
    from testbed.topology.plan import plan_network

    cal = calibration.cached()
    machine = cal.constants() if cal is not None else None
    runs = plan.runs
    done = load_rows(directory, [r.key for r in runs]) if directory.is_dir() else {}
    left = [r for r in runs if r.key not in done]
    builds = predict_builds(plan, runs, machine, lifecycle.cores())
    sw = plan.sweep
    t = Table(title=f"sweep {sw.name}: {len(plan.points)} point(s) x {sw.repeats} repeat(s) = {len(runs)} run(s), "
                    f"testbed {sw.testbed}", title_justify="left")
    for col in ("point", *sw.swept, "workers", "dilation", "testbed", "runs done"):
        t.add_column(col, justify="right" if col in ("workers", "runs done") else "left")
    first = {}
    for run, build in zip(runs, builds):
        first.setdefault(run.point.id, build)
    for p in plan.points:
        topo = plan.topology(p)
        try:
            s = choose(p.dilation if p.dilation != "none" else None, topo, plan_network(topo), n_gpus=0,
                       n_cpus=lifecycle.cores(), constants=machine).factor
            dil = f"{p.dilation} ({s:g})" if p.dilation == "auto" else p.dilation
        except ValueError:
            dil = p.dilation
        n_done = sum(1 for r in runs if r.point is p and r.key in done)
        t.add_row(p.id, *[str(p.value(k)) for k in sw.swept], str(len(topo.workers)), dil,
                  "fresh up" if first[p.id] else "in place", f"{n_done}/{sw.repeats}")
    console.print(t)
    job = "the main job (compute on one dedicated rank, then examples/train_ddp.py on every worker)" if sw.job.main \
        else " ".join(sw.job.command or ())
    console.print(f"job: {job}" + (f", {sw.job.steps} steps" if sw.job.main else ""), highlight=False)
    left_builds = predict_builds(plan, left, machine, lifecycle.cores())
    measured = [r["wall_s"] for r in done.values() if isinstance(r.get("wall_s"), (int, float))]
    est = estimate_seconds(plan, left, left_builds, measured)
    how = (f"from this directory's {len(measured)} run(s) done" if measured else
           "a rough guess from this project's 2-core machine")
    console.print(f"{len(left)} run(s) to do, estimated {format_duration(est)} ({how}"
                  f"{'' if machine else '; not calibrated yet: add the calibration, ~1-3 min'}); "
                  f"results in {directory}", highlight=False)
    from testbed.sweep.runner import Directory

    held = Directory(directory, plan).read_state() if directory.is_dir() else {}
    if held and held.get("fingerprint") != plan.fingerprint():
        console.print(f"[yellow]{directory} holds another sweep ({held.get('name')!r})[/]: running this one needs "
                      "another --dir, or --restart to start afresh there", highlight=False)
    if not machine and any(p.dilation == "auto" for p in plan.points):
        console.print("auto dilation is shown without the traffic term: this boot is not calibrated yet", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("sweep", epilog=EPILOG)
    def sweep_cmd(
        spec: Optional[str] = typer.Argument(None, help="A sweep file (YAML, docs/sweep.md). Options below "
                                                        "replace its fields."),
        topology: Optional[str] = typer.Option(None, "--topology", "-t", help="The topology (as `testbed up` takes "
                                                                             "it), without a sweep file."),
        grid: List[str] = typer.Option([], "--grid", "-g", metavar="KEY=V1,V2,...",
                                       help="Sweep KEY over these values; several --grid: every combination."),
        point: List[str] = typer.Option([], "--point", "-p", metavar="'KEY=V;KEY=V'",
                                        help="One point of a list of points (repeatable; instead of --grid)."),
        sets: List[str] = typer.Option([], "--set", help="A topology override every point starts from (repeatable)."),
        dilation: Optional[str] = typer.Option(None, "--time-dilation", help="auto (default), none or a factor."),
        scenario: Optional[str] = typer.Option(None, "--scenario", help="A scenario file played at every point "
                                                                          "(its own job runs)."),
        command: Optional[str] = typer.Option(None, "--command", help="Run this command instead of the main job, "
                                                                        "e.g. 'python examples/train_ddp.py'."),
        steps: Optional[int] = typer.Option(None, "--steps", help="The main job's steps (default 20)."),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", help="The main job's batch per rank (32)."),
        args: Optional[str] = typer.Option(None, "--args", help="Arguments added to the job's command line."),
        repeats: Optional[int] = typer.Option(None, "--repeats", "-r", help="Runs per point (default 1)."),
        name: Optional[str] = typer.Option(None, "--name", help="The sweep's name (default: the file's name)."),
        testbed_name: Optional[str] = typer.Option(None, "--testbed", help="The testbed's name (default sweep-NAME)."),
        directory: Optional[str] = typer.Option(None, "--dir", "-d", help="The sweep directory (default "
                                                                         "sweeps/NAME); running again continues it."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the points and an estimated duration; run "
                                                               "nothing."),
        restart: bool = typer.Option(False, "--restart", help="Forget the results in the directory; start afresh."),
        keep_up: bool = typer.Option(False, "--keep-up", help="Leave the last point's testbed up at the end."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the ranks' output."),
    ) -> None:
        """Run a what-if experiment: one judged run per point of a grid or list of topology, link, dilation, scenario and job settings; a table and plots.

        Each point is run --repeats times, each run judged like `testbed run` (the verdict).

        A point that changes only link profiles (and keeps the dilation `up` would choose) has the running testbed's links reconfigured in place; any other change brings the testbed down and up again.

        Results: DIR/table.csv, DIR/table.json, DIR/iteration.png (DIR/heatmap.png for two parameters). Running the same command again continues an interrupted sweep; Ctrl-C keeps what is done.
        """
        from testbed.sweep.plan import make_plan
        from testbed.sweep.runner import Directory, Runner, default_directory
        from testbed.sweep.spec import sweep_from_data

        job = {"command": command, "steps": steps, "batch_size": batch_size, "args": args}
        data, source, base = _document(spec, topology, grid, point, sets, job=job, repeats=repeats, name=name,
                                       testbed=testbed_name, dilation=dilation, scenario=scenario)
        sweep = sweep_from_data(data, source, base)
        plan = make_plan(sweep)
        where = Path(directory) if directory else default_directory(plan)
        if dry_run:
            _dry_run(plan, where)
            return
        require_root("testbed sweep")
        d = Directory(where, plan)
        d.open(restart=restart)
        say = lambda m: err_console.print(m, highlight=False, markup=False)   # noqa: E731
        echo = (lambda line: console.print(line, highlight=False, markup=False)) if verbose else None
        try:
            out = Runner(plan, d, say=say, echo=echo, keep_up=keep_up).run()
        finally:
            d.close()
        _summary(out, where, plan)
        if out.status == "interrupted":
            raise typer.Exit(130)


def _counts(verdicts: list) -> str:
    """['faithful', 'inconclusive', 'faithful'] -> '2 faithful, 1 inconclusive'."""
    from collections import Counter

    return ", ".join(f"{n} {v or '-'}" for v, n in Counter(verdicts).most_common())


def _summary(out, where: Path, plan) -> None:
    from rich.table import Table

    from testbed.sweep.table import TABLE_JSON, summary_by_point
    import json

    try:
        rows = json.loads((where / TABLE_JSON).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        rows = []
    t = Table(title=f"sweep {plan.sweep.name}: {out.done} of {out.total} runs ({out.status}); iteration: "
                    "emulated, the median of the repeats", title_justify="left")
    for col in ("point", *plan.sweep.swept, "runs", "iteration ms [spread]", "expected ms", "verdicts"):
        t.add_column(col, justify="left" if col in ("point", "verdicts") else "right",
                     min_width=16 if col == "verdicts" else None)
    for s in summary_by_point(rows):
        med, lo, hi, exp = s["median_ms"], s["min_ms"], s["max_ms"], s["expected_ms"]
        it = "-" if med is None else (f"{med:.1f}" if s["runs"] < 2 else f"{med:.1f} [{lo:.1f}-{hi:.1f}]")
        t.add_row(s["point"], *[str(s["params"].get(k)) for k in plan.sweep.swept], str(s["runs"]), it,
                  f"{exp:.1f}" if exp is not None else "-", _counts(s["verdicts"]))
    console.print(t)
    loads = [r["loadavg"] for r in rows if isinstance(r.get("loadavg"), (int, float))]
    others = [r["other_work"] for r in rows if isinstance(r.get("other_work"), (int, float))]
    if loads or others:   # every number above is this machine's at that load: said with them
        console.print("the machine while the runs ran: "
                      + (f"1-minute load {min(loads):.1f}-{max(loads):.1f} at their starts" if loads else "")
                      + (", " if loads and others else "")
                      + (f"other work took {100 * min(others):.0f}-{100 * max(others):.0f}% of the CPUs" if others
                         else ""), highlight=False)
    for f in out.files:
        console.print(f"  {f}", highlight=False)
    if out.status == "interrupted":
        console.print(f"interrupted: {out.done} of {out.total} runs kept; run the same command again to continue",
                      highlight=False)
