"""`testbed doctor`: what this machine can emulate, and what to install for the rest."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from testbed.cli.common import console


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(as_json: bool = typer.Option(False, "--json", help="Print the capabilities as JSON.")) -> None:
        """Probe the kernel and machine: netem, HTB, TAP delay line, BPF loss, Docker, GPUs, latency floor."""
        from testbed.net.capabilities import probe

        caps = probe(measure_floor=True, refresh=True)
        if as_json:
            print(json.dumps(caps.to_json(), indent=2, sort_keys=True))
            return
        table = Table(title=f"testbed doctor (kernel {caps.kernel})")
        table.add_column("capability")
        table.add_column("found")
        table.add_column("what it enables / what to install")
        for name, found, what in caps.rows():
            table.add_row(name, "[green]yes[/]" if found else "[red]no[/]", what)
        console.print(table)
        if caps.netem:
            console.print("delay/jitter/loss: sch_netem")
        elif caps.tun:
            console.print("delay/jitter: userspace delay line (no sch_netem); loss: "
                          + ("cls_bpf" if caps.bpf else "[red]unavailable[/]"))
        else:
            console.print("[red]delay/jitter unavailable[/]: install sch_netem or enable /dev/net/tun")
        from testbed.jobs import calibration

        cal = calibration.cached()
        if cal is None:
            console.print("reference model: not calibrated on this boot (testbed calibrate; `auto` dilation "
                          "and `testbed run` do it when needed)")
        else:
            console.print("reference model constants (testbed calibrate --refresh to measure again):")
            for line in cal.lines():
                console.print(f"  {line}", highlight=False)
