"""`testbed calibrate`: this machine's constants for the reference model (once per boot), and their history."""

from __future__ import annotations

import json
import time

import typer

from testbed.cli.common import console, err_console


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate(
        refresh: bool = typer.Option(False, "--refresh", help="Measure again even if this boot has a calibration."),
        history: bool = typer.Option(False, "--history", help="Show every calibration this machine took "
                                                              "(kept or not, with the conditions), measure nothing."),
        as_json: bool = typer.Option(False, "--json", help="Print the calibration (or the history) as JSON."),
    ) -> None:
        """Measure (or show) the reference model's constants for this machine (kept per boot).

        What one message and one byte cost a gloo rank here, per collective: `auto` dilation and
        every run's verdict use them. Measuring brings up a 2-worker star for ~25 s; on a busy
        machine it waits for quiet (at most 30 s) and measures again when others disturbed it. A
        calibration whose repetitions spread too far is not kept: it serves 10 minutes, then the
        next command measures again."""
        from testbed.jobs import calibration

        if history:
            _show_history(calibration, as_json)
            return
        cal = calibration.get(refresh=refresh, progress=lambda m: err_console.print(m, highlight=False, markup=False, soft_wrap=True))
        if as_json:
            print(json.dumps({**cal.to_json(), "file": str(calibration.cache_file())}, indent=1))
            return
        for line in cal.lines():
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        console.print(f"{'kept for this boot' if cal.kept else 'provisional'} in {calibration.cache_file()}; "
                      "history: testbed calibrate --history", highlight=False, markup=False, soft_wrap=True)


def _show_history(calibration, as_json: bool) -> None:
    from testbed.net.capabilities import boot_id

    recs = calibration.history()
    if as_json:
        print(json.dumps({"file": str(calibration.history_file()), "calibrations": recs}, indent=1))
        return
    if not recs:
        console.print(f"no calibration taken yet ({calibration.history_file()})", highlight=False, markup=False, soft_wrap=True)
        return
    this_boot = boot_id()

    def pct(v) -> str:
        return "-" if not isinstance(v, (int, float)) else f"{100 * v:.0f}%"

    hdr = (f"{'when':>19} {'boot':>5} {'try':>3} {'busy before':>11} {'others':>6} {'steal':>5} {'spread':>7} "
           f"{'alpha us':>8} {'beta ns/B':>9}  kept")
    console.print(hdr, highlight=False, markup=False, soft_wrap=True)
    for r in recs:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["measured_at"]))
        spread = r.get("spread")
        a, b = r.get("alpha_s"), r.get("beta_s_per_byte")
        kept = "yes" if r.get("kept") else f"no: {r.get('why_not_kept') or '?'}"
        console.print(f"{when:>19} {'this' if r.get('boot_id') == this_boot else 'other':>5} {r.get('attempt', '-'):>3} "
                      f"{pct(r.get('busy_before')):>11} {pct(r.get('foreign')):>6} {pct(r.get('steal')):>5} "
                      f"{('+-' + pct(spread)) if isinstance(spread, (int, float)) else 'wide':>7} "
                      f"{a * 1e6 if isinstance(a, (int, float)) else float('nan'):>8.0f} "
                      f"{b * 1e9 if isinstance(b, (int, float)) else float('nan'):>9.3f}  {kept}",
                      highlight=False, markup=False, soft_wrap=True)
    console.print(f"({calibration.history_file()}; only this boot's kept calibration is ever used)",
                  highlight=False, markup=False, soft_wrap=True)
