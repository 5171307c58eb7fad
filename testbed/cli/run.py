"""`testbed run`: run an unmodified training command across the workers, measured."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from testbed.cli.common import NameOption, console, resolve_name


def _run_over_hosts(name: str, cmd: List[str], workers: str, nproc_per_node: int, port: Optional[int],
                    timeout: Optional[float], env: dict, real: Optional[str], record_ops: bool,
                    replay: Optional[str]) -> None:
    """A testbed over several hosts: one rank per worker, started on the workers' hosts; their output is
    gathered here. The probe, report and verdict are not built across hosts yet (said, not hidden)."""
    from testbed.cli.common import err_console, fail
    from testbed.cluster import controller

    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        fail("nothing to run: give a command after --", 2)
    if nproc_per_node != 1 or real is not None or record_ops or replay:
        fail("across hosts, `testbed run` starts one rank per worker: --nproc-per-node, --real, --record-ops and "
             "--replay are not built for several hosts yet", 2)
    chosen = None if workers == "all" else [w.strip() for w in workers.split(",") if w.strip()]
    err_console.print("[yellow]across hosts:[/] the ranks run and their output comes back; the probe, the report "
                      "and the verdict are not built for several hosts yet", highlight=False)
    summary = controller.run_job(name, cmd, workers=chosen, port=port, timeout=timeout, env=env,
                                 progress=lambda m: err_console.print(m, highlight=False))
    bad = [r for r in summary["ranks"] if r["rc"] != 0]
    for r in bad[:4]:
        tail = (Path(summary["run_dir"]) / "logs" / f"{r['worker']}.log").read_text().strip().splitlines()[-8:]
        err_console.print(f"[red]rank {r['rank']} ({r['worker']} on {r['host']}) exited {r['rc']}:[/]\n  "
                          + "\n  ".join(tail), highlight=False)
    console.print(f"run {'completed' if not bad else 'failed'}: {len(summary['ranks'])} rank(s) on "
                  f"{', '.join(summary['hosts'])} in {summary['wall_s']:.1f} s; logs in {summary['run_dir']}",
                  highlight=False)
    if bad:
        raise typer.Exit(summary["rc"] if summary["rc"] > 0 else 1)


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def run_cmd(
        cmd: Optional[List[str]] = typer.Argument(None, help="The command (after --), e.g. python train.py or "
                                                             "torchrun train.py"),
        name: Optional[str] = NameOption,
        workers: str = typer.Option("all", "--workers", "-w", help="all, or a comma list: w0,w3"),
        nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Ranks per worker"),
        master: Optional[str] = typer.Option(None, "--master", help="Worker hosting the rendezvous (default: first)"),
        port: Optional[int] = typer.Option(None, "--port", help="MASTER_PORT (default: random 20000-29999)"),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop every rank after T seconds (exit 124)"),
        env: List[str] = typer.Option([], "--env", "-e", help="K=V added to every rank's environment"),
        no_probe: bool = typer.Option(False, "--no-probe", help="Do not inject the measurement probe (nor the "
                                                                "emulated clock; the verdict then has no collectives)"),
        real_clock: bool = typer.Option(False, "--real-clock", help="Keep the ranks' clocks real under dilation "
                                                                    "(the probe slows them by the factor otherwise)"),
        grace: float = typer.Option(5.0, "--grace", help="Seconds the others get after a rank fails"),
        report: bool = typer.Option(False, "--report", help="Print the whole report when the run ends "
                                                            "(the verdict is always printed)"),
        real: Optional[str] = typer.Option(None, "--real", help="Only these workers (comma list) run CMD; every "
                                           "other rank is a phantom that computes nothing and mirrors the real "
                                           "rank's collectives, so the links carry the job's real traffic "
                                           "(gloo, data-parallel jobs)"),
        record_ops: bool = typer.Option(False, "--record-ops", help="Record the first rank's collectives (probe/ops-N.jsonl) "
                                        "for a later --replay (gloo jobs; runs with --real always record)"),
        replay: Optional[str] = typer.Option(None, "--replay", help="Replay a recorded run (its directory or "
                                             "ops-N.jsonl) with every rank a phantom: the job's traffic without "
                                             "the job, e.g. on another topology or under a scenario"),
    ) -> None:
        """Start CMD on every selected worker the torchrun way; logs and probe data go to runs/<time>-<testbed>/.

        At the end the run is judged against the reference model and what was sampled while it ran
        (CPUs, queues, delay lines): faithful, not faithful (with the reasons in numbers and what to
        change) or unverified."""
        from testbed.cli.common import err_console, require_root
        from testbed.jobs import calibration
        from testbed.jobs.run import RunError, cluster_from_state, run

        require_root("testbed run")
        extra = {}
        for kv in env:
            if "=" not in kv:
                raise RunError(f"--env wants K=V (got {kv!r})")
            k, v = kv.split("=", 1)
            extra[k] = v
        target = resolve_name(name, clusters=True)
        from testbed import store
        from testbed.cluster import controller

        if controller.exists(target) and not store.exists(target):
            _run_over_hosts(target, cmd or [], workers, nproc_per_node, port, timeout, extra, real, record_ops,
                            replay)
            return
        cluster = cluster_from_state(target)
        machine = calibration.constants_or_none(progress=lambda m: err_console.print(m, highlight=False))
        result = run(cluster, cmd or [], workers=workers, nproc_per_node=nproc_per_node, master=master, port=port,
                     timeout=timeout, env=extra, probe=not no_probe, grace=grace, machine=machine,
                     emulated_clock=not real_clock,
                     real=[w.strip() for w in real.split(",") if w.strip()] if real is not None else None,
                     record_ops=record_ops, replay=replay)
        from testbed.report import report as make_report

        text, a, plots = make_report(result.run_dir, plots=report)
        from testbed.report import tell_verdict

        tell_verdict(cluster.name, result.run_dir, a["verdict"])
        if report:
            console.print(text, highlight=False, markup=False)
            for p in plots:
                console.print(f"plot: {p}", highlight=False)
        else:
            console.print("\n".join(a["verdict"].lines()), highlight=False, markup=False)
        console.print(f"run directory: {result.run_dir}  (testbed report {result.run_dir})", highlight=False)
        raise typer.Exit(result.rc)
