"""`testbed run`: run an unmodified training command across the workers, measured."""

from __future__ import annotations

from typing import List, Optional

import typer

from testbed.cli.common import NameOption, console, resolve_name


def _run_over_hosts(name: str, cmd: List[str], workers: str, nproc_per_node: int, port: Optional[int],
                    timeout: Optional[float], env: dict, real: Optional[str], record_ops: bool,
                    replay: Optional[str], no_probe: bool, real_clock: bool, grace: float) -> None:
    """A testbed over several hosts: every host runs its workers' ranks (`testbed run --this-host-only`
    there, the same master and port), their run directories come back here, merged, and are
    reported and judged as one run."""
    from testbed.cli.common import err_console, fail
    from testbed.cluster import controller

    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if replay and cmd:
        fail("--replay runs no command: give either a command or --replay", 2)
    if not cmd and not replay:
        fail("nothing to run: give a command after --", 2)
    if replay and (real is not None or record_ops):
        fail("--replay plays a recorded run to phantoms only: no --real, no --record-ops", 2)
    chosen = None if workers == "all" else [w.strip() for w in workers.split(",") if w.strip()]
    def show(host: str, line: str) -> None:   # the ranks' lines as they come ("[w2:r2] ..." say whose)
        if line.startswith("[testbed]"):
            line = f"[testbed {host}]{line[len('[testbed]'):]}"
        console.print(line, highlight=False, markup=False, soft_wrap=True)

    if (real is not None or record_ops) and no_probe:
        fail("--real and --record-ops need the probe (it announces and records the collectives): drop --no-probe", 2)
    result = controller.run_job(name, cmd, workers=chosen, nproc_per_node=nproc_per_node, port=port,
                                timeout=timeout, env=env, probe=not no_probe, real_clock=real_clock, grace=grace,
                                progress=lambda m: err_console.print(m, highlight=False), on_output=show,
                                real=None if real is None else [w.strip() for w in real.split(",") if w.strip()],
                                record_ops=record_ops, replay=replay)
    from testbed.report import report as make_report

    text, a, _plots = make_report(result["run_dir"], plots=False)
    console.print(text, highlight=False, markup=False)
    for host, why in result.get("problems", {}).items():
        err_console.print(f"[red]{host}:[/] {why}", highlight=False)
    rd = result["run_dir"]
    console.print(f"run directory: {rd}  (testbed report {rd})", highlight=False)
    if result["rc"] != 0:
        raise typer.Exit(result["rc"] if 0 < result["rc"] < 256 else 1)


def _host_part_hooks(mirror_relay: bool) -> dict:
    """--this-host-only: the ranks' lines and (--mirror-relay) the leader's announcements share this
    process's stdout, which the controller reads line by line: one writer at a time."""
    import sys
    import threading

    from testbed.cli import common
    from testbed.jobs import relay

    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    hooks: dict = {"echo": say}
    if mirror_relay:
        hooks["relay_send"] = lambda line: say(relay.PREFIX + line.decode(errors="replace"))
        hooks["relay_listen"] = common.on_lifeline_input
    return hooks


def _tell_start(run_dir) -> None:
    """--this-host-only: the controller learns where this host's run lives as it starts."""
    import json

    print(json.dumps({"started": str(run_dir)}), flush=True)


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
        this_host_only: bool = typer.Option(False, "--this-host-only", hidden=True,
                                            help="(the controller's) one host's ranks of a run over several hosts; "
                                                 "prints the run directory as JSON, no report"),
        mirror_relay: bool = typer.Option(False, "--mirror-relay", hidden=True,
                                          help="(the controller's, with --this-host-only --real) the leader's "
                                               "announcements go out on stdout, or come in on the lifeline"),
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
                            replay, no_probe, real_clock, grace)
            return
        cluster = cluster_from_state(target)
        # one host's part of a run over several hosts: the controller judges it with its own constants
        machine = None if this_host_only else \
            calibration.constants_or_none(progress=lambda m: err_console.print(m, highlight=False))
        hooks = _host_part_hooks(mirror_relay) if this_host_only else {}
        result = run(cluster, cmd or [], workers=workers, nproc_per_node=nproc_per_node, master=master, port=port,
                     timeout=timeout, env=extra, probe=not no_probe, grace=grace, machine=machine,
                     emulated_clock=not real_clock,
                     real=[w.strip() for w in real.split(",") if w.strip()] if real is not None else None,
                     record_ops=record_ops, replay=replay, this_host_only=this_host_only,
                     on_start=_tell_start if this_host_only else None, **hooks)
        if this_host_only:
            import json

            print(json.dumps({"run_dir": str(result.run_dir), "rc": result.rc}))
            raise typer.Exit(result.rc)
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
