"""`testbed run`: run an unmodified training command across the workers, measured."""

from __future__ import annotations

from typing import List, Optional

import typer

from testbed.cli.common import NameOption, console, resolve_name
from testbed.terminal import inert, plain


def _say_ranks(run_dir, summary: Optional[dict] = None) -> None:
    """With phantoms: which ranks were real and which phantoms ("ranks: 1 real (0 on w0), 3 phantoms
    (1-3)"), from the run's summary (read from run_dir when not given: the controller's merge)."""
    from pathlib import Path

    from testbed.jobs import rundir
    from testbed.jobs.phantom_ranks import ranks_line

    if summary is None:   # (a run directory ranks could write into: read bounded, never a FIFO or a link)
        summary = rundir.read_json(Path(run_dir) / "summary.json")
    line = ranks_line(summary) if isinstance(summary, dict) else None
    if line:
        console.print(inert(line), highlight=False, markup=False, soft_wrap=True)


def _show_line(host: str, line: str) -> None:
    """A rank's line from a host, as it comes ("[w2:r2] ..." says whose): shown as written, never as
    markup or escape sequences (testbed.terminal); the host's own lines say which host."""
    if line.startswith("[testbed]"):
        line = f"[testbed {host}]{line[len('[testbed]'):]}"
    console.print(inert(line), highlight=False, markup=False, soft_wrap=True)


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


def _tell_start(run_dir, _probe_dir) -> None:
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
        group: List[str] = typer.Option([], "--group", "-g", help='A group: "NAME=WORKERS CMD..." (WORKERS a comma '
                                        "list), a torch world of its own (its MASTER_ADDR/PORT, RANK, WORLD_SIZE); "
                                        "repeat for more groups. CMD then goes inside the quotes, not after --"),
        service: List[str] = typer.Option([], "--service", help='A service beside the groups: "NAME=WORKERS CMD..." '
                                          "(a lighthouse); stopped once every group is done"),
        restarts: int = typer.Option(0, "--restarts", help="A --group that fails is started again (all its ranks, "
                                     "once its workers are up) up to N times"),
        job: Optional[str] = typer.Option(None, "--job", help="A job file (YAML: groups:, services:, env:) "
                                          "instead of --group/--service; a YAML file given as the command is one "
                                          "too. See docs/fault-tolerance.md"),
        this_host_only: bool = typer.Option(False, "--this-host-only", hidden=True,
                                            help="(the controller's) one host's ranks of a run over several hosts; "
                                                 "prints the run directory as JSON, no report"),
        mirror_relay: bool = typer.Option(False, "--mirror-relay", hidden=True,
                                          help="(the controller's, with --this-host-only --real) the leader's "
                                               "announcements go out on stdout, or come in on the lifeline"),
    ) -> None:
        """Start CMD on every selected worker the torchrun way; logs and probe data go to runs/<time>-<testbed>/.

        Or different commands on different workers: a torchft lighthouse on w0 and
        replica groups on the others, each group its own torch world (--group,
        --service, --job FILE; see docs/fault-tolerance.md). {addr:NAME} in a command
        or an --env value is NAME's address on the emulated network.

        At the end the run is judged against the reference model and what was sampled while it ran
        (CPUs, queues, delay lines): faithful, not faithful (with the reasons in numbers and what to
        change) or unverified."""
        from testbed.cli.common import err_console, require_root
        from testbed.errors import RunError
        from testbed.jobs.run import run
        from testbed.jobs.target import cluster_from_state

        require_root("testbed run")
        extra = {}
        for kv in env:
            if "=" not in kv:
                raise RunError(f"--env wants K=V (got {kv!r})")
            k, v = kv.split("=", 1)
            extra[k] = v
        from testbed.jobs import groups as groups_mod

        cmd = list(cmd or [])
        if cmd[:1] == ["--"]:
            cmd = cmd[1:]
        the_job = None
        if job is not None and (group or service):
            raise RunError("give either --job FILE or --group/--service, not both")
        if job is not None:
            the_job = groups_mod.load(job)
        elif group or service:
            the_job = groups_mod.from_cli(group, service, restarts=restarts, nproc_per_node=nproc_per_node)
        elif restarts:
            raise RunError("--restarts is for groups (--group or --job): a plain run is one torch world; use "
                           "torchrun's --max-restarts for it")
        if cmd and the_job is not None:
            raise RunError("with --group/--service/--job the commands are the groups': nothing after --")
        real_list = [w.strip() for w in real.split(",") if w.strip()] if real is not None else None
        if this_host_only:   # a controller's: one host's ranks of a run over several hosts (its own state)
            result = run(cluster_from_state(resolve_name(name)), cmd, workers=workers, nproc_per_node=nproc_per_node,
                         master=master, port=port, timeout=timeout, env=extra, probe=not no_probe, grace=grace,
                         machine=None, emulated_clock=not real_clock, real=real_list, record_ops=record_ops,
                         replay=replay, this_host_only=True, on_start=_tell_start, job=the_job,
                         **_host_part_hooks(mirror_relay))
            import json

            print(json.dumps({"run_dir": str(result.run_dir), "rc": result.rc}))
            raise typer.Exit(result.rc)
        from testbed.handle import open_testbed
        from testbed.handle.base import RunOptions

        tb = open_testbed(name)
        options = RunOptions(workers=workers, nproc_per_node=nproc_per_node, master=master, port=port, timeout=timeout,
                             env=extra, probe=not no_probe, grace=grace, real_clock=real_clock, real=real_list,
                             record_ops=record_ops, replay=replay, job=the_job)
        done = tb.run(cmd, options, say=lambda m: err_console.print(inert(m), highlight=False, markup=False),
                      on_output=_show_line)
        from testbed.report import report as make_report
        from testbed.report import tell_verdict

        if tb.hosts:   # a run over several hosts: its whole report (every host's ranks), and each host's trouble
            text, _a, _plots = make_report(done.run_dir, plots=False)
            console.print(inert(text), highlight=False, markup=False)
            _say_ranks(done.run_dir)
            for host, why in done.problems.items():   # (a host's words in them: never markup)
                err_console.print(f"[red]{plain(host)}:[/] {plain(why)}", highlight=False)
            console.print(f"run directory: {done.run_dir}  (testbed report {done.run_dir})", highlight=False,
                          markup=False)
            raise typer.Exit(done.rc if 0 < done.rc < 256 else (0 if done.rc == 0 else 1))
        text, a, plots = make_report(done.run_dir, plots=report,
                                     recheck=lambda m: err_console.print(m, highlight=False, markup=False))
        tell_verdict(tb.name, done.run_dir, a["verdict"])
        if report:
            console.print(text, highlight=False, markup=False)
            for p in plots:
                console.print(f"plot: {p}", highlight=False, markup=False)
        else:
            console.print("\n".join(a["verdict"].lines()), highlight=False, markup=False)
        summary = done.summary or {}
        if summary.get("groups") and not report:   # (the report has them) its groups' steps and quorum
            from testbed.report import quorum

            ft = quorum.section(done.run_dir)
            if ft:
                console.print(ft, highlight=False, markup=False)
            png = quorum.plot(done.run_dir)
            if png:
                console.print(f"plot: {png}", highlight=False, markup=False)
        _say_ranks(done.run_dir, done.summary)
        console.print(f"run directory: {done.run_dir}  (testbed report {done.run_dir})", highlight=False,
                      markup=False)
        raise typer.Exit(done.rc)
