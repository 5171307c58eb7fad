"""Tables and plots of a run directory (see testbed.jobs.run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def report(run: str | Path, plots: bool = True, expected_iteration_s: float | None = None
           ) -> tuple[str, dict[str, Any], list[Path]]:
    """Analyse RUN, judge it, write report.txt (+ PNGs) and the verdict into summary.json;
    return (text, analysis with "verdict", plot paths)."""
    from testbed.jobs import rundir
    from testbed.report.analyze import analyze
    from testbed.report.tables import render
    from testbed.report.verdict import judge

    run = Path(run)
    a = analyze(run)
    v = judge(run, expected_iteration_s=expected_iteration_s, analysis=a)
    a["verdict"] = v
    summary = rundir.read_json(run / "summary.json", {}) or {}
    summary["verdict"] = v.to_json()
    rundir.write_json(run / "summary.json", summary)
    a["events"] = run_events(run)
    text = render(a)
    (run / "report.txt").write_text(text + "\n")
    made: list[Path] = []
    if plots:
        from testbed.report import plots as p

        made.append(p.step_times(a, run / "step_times.png"))
        topo = rundir.read_json(run / "topology.json")
        if topo and a["links"]:
            made.append(p.links(a, topo, run / "links.png"))
    return text, a, made


def run_events(run: Path) -> list[dict[str, Any]]:
    """The testbed's events of the run's span (testbed-events.jsonl, kept by `testbed run`): link and
    node changes, captures, scenario steps. Lines that are not events are passed over."""
    from testbed import events

    try:
        data = (run / "testbed-events.jsonl").read_bytes()
    except OSError:
        return []
    return [e for e in map(events.parse, data.splitlines()) if e is not None]


def tell_verdict(name: str, run_dir: Path, verdict: Any) -> None:
    """The verdict of a run, into its testbed's event stream."""
    from testbed import events
    from testbed.jobs import rundir

    run_id = (rundir.read_json(run_dir / "summary.json", {}) or {}).get("run_id")
    events.emit(name, "verdict", f"run {run_id}: {verdict.status}" + (f": {verdict.reasons[0]}" if verdict.reasons else ""),
                run_id=run_id, status=verdict.status, run_dir=str(run_dir))

