"""`testbed calibrate`: this machine's constants for the reference model (once per boot)."""

from __future__ import annotations

import json

import typer

from testbed.cli.common import console, err_console


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate(
        refresh: bool = typer.Option(False, "--refresh", help="Measure again even if this boot has a calibration."),
        as_json: bool = typer.Option(False, "--json", help="Print the calibration as JSON."),
    ) -> None:
        """Measure (or show) the reference model's constants for this machine (kept per boot).

        What one message and one byte cost a gloo rank here, per collective: `auto` dilation and
        every run's verdict use them. Measuring brings up a 2-worker star for ~10 s: run it on a
        quiet machine."""
        from testbed.jobs import calibration

        cal = calibration.get(refresh=refresh, progress=lambda m: err_console.print(m, highlight=False))
        if as_json:
            print(json.dumps({**cal.to_json(), "file": str(calibration.cache_file())}, indent=1))
            return
        for line in cal.lines():
            console.print(line, highlight=False)
        console.print(f"kept for this boot in {calibration.cache_file()}", highlight=False)
