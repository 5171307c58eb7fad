"""`testbed report RUN`: the table and the plots of a run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from testbed.cli.common import console


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        run: Optional[Path] = typer.Argument(None, help="A run directory (default: the latest under ./runs)"),
        no_plots: bool = typer.Option(False, "--no-plots", help="Only the table"),
    ) -> None:
        """Iteration times, throughput, bytes per link tier, the collectives against the model, the verdict.

        Writes report.txt and PNG plots into the run directory and the verdict (faithful, not
        faithful with the reasons, or unverified) into its summary.json."""
        from testbed.errors import TestbedError
        from testbed.jobs import rundir
        from testbed.report import report

        run = run or rundir.latest()
        if run is None or not (Path(run) / "summary.json").is_file():
            raise TestbedError(f"not a run directory: {run or './runs (empty)'}")
        text, _a, plots = report(run, plots=not no_plots)
        console.print(text, highlight=False, markup=False)
        for p in plots:
            console.print(f"wrote {p}", highlight=False)
