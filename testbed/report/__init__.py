"""Tables and plots of a run directory (see testbed.jobs.run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

# A calibration measured again differs from the one a run recorded when one of all_reduce's constants
# moved by more than both calibrations' spreads and this floor.
RECHECK_FLOOR = 0.05


def report(run: str | Path, plots: bool = True, expected_iteration_s: float | None = None,
           recheck: Callable[[str], None] | None = None) -> tuple[str, dict[str, Any], list[Path]]:
    """Analyse RUN, judge it, write report.txt (+ PNGs) and the verdict into summary.json;
    return (text, analysis with "verdict", plot paths).

    recheck: when the run contradicts the calibration it recorded, measure the calibration again
    (progress through this callable) and judge with it (see judge_checked)."""
    from testbed.jobs import rundir
    from testbed.report import analyze as analyze_mod
    from testbed.report.analyze import analyze
    from testbed.report.tables import render
    from testbed.report.verdict import judge

    run = Path(run)
    a = analyze(run)
    if recheck is not None:
        v = judge_checked(run, expected_iteration_s, a, recheck)
    else:
        v = judge(run, expected_iteration_s=expected_iteration_s, analysis=a)
    a["verdict"] = v
    summary = rundir.read_json(run / "summary.json", {}) or {}
    summary["verdict"] = v.to_json()
    rundir.write_json(run / "summary.json", summary)
    a["events"] = analyze_mod.run_events(run)
    text = render(a)
    groups = bool(summary.get("groups"))   # a run of replica groups: their steps and quorum over time
    if groups:
        from testbed.report import quorum

        ft = quorum.section(run)
        text += f"\n\n{ft}" if ft else ""
    rundir.write_bytes(run / "report.txt", (text + "\n").encode())
    made: list[Path] = []
    if plots:
        from testbed.report import plots as p

        made.append(p.step_times(a, run / "step_times.png"))
        topo = rundir.read_json(run / "topology.json")
        if topo and a["links"]:
            made.append(p.links(a, topo, run / "links.png"))
        if groups:
            png = quorum.plot(run)
            made += [png] if png else []
    return text, a, made


def judge_checked(run: Path, expected_iteration_s: float | None, analysis: dict[str, Any],
                  progress: Callable[[str], None]) -> Any:
    """The verdict, with the calibration checked when the run contradicts it.

    A collective class that decides the verdict and is off the model may mean that the emulation
    missed, or that the constants it was judged with were measured at a bad moment. So the
    calibration is measured again (calibration.get(refresh=True): it waits for a quiet machine and
    keeps only a clean one). If it moved beyond the spreads, the run is judged with the new one
    and the verdict says so; if not, the miss stands, and the verdict says the check confirmed it."""
    from testbed.jobs import calibration, rundir
    from testbed.report.run_constants import RUN_ALPHA
    from testbed.report.verdict import MATERIAL, judge
    from testbed.topology.reference import MachineConstants

    v = judge(run, expected_iteration_s=expected_iteration_s, analysis=analysis)
    machine = analysis["summary"].get("machine")
    if not machine or v.status != "not faithful" or not any(r.status == "off" and r.share >= MATERIAL
                                                             for r in v.classes):
        return v   # (an inconclusive run shared the machine: a calibration now would wait for it too)
    host_rate = (rundir.read_json(run / "topology.json", {}) or {}).get("host_rate")
    if RUN_ALPHA in (v.constants or "") and host_rate != "this-machine":
        return v   # the model used no calibrated number: the run measured its alpha, the hosts are declared
    recorded = MachineConstants.from_json(machine)
    progress("the run contradicts the calibration it was judged with: measuring the calibration again ...")
    try:
        cal = calibration.get(refresh=True, progress=progress)
    except calibration.CalibrationError as exc:
        v.reasons.append(f"the calibration could not be checked after the run: {exc}")
        return v
    if not cal.kept:   # no better evidence than the recorded one: judge with what the run had
        v.reasons.append(f"the calibration could not be checked after the run: the new one was not kept "
                         f"({cal.why_not_kept})")
        return v
    fresh = cal.constants()
    moved = max(abs(fresh.alpha_s / recorded.alpha_s - 1), abs(fresh.beta_s_per_byte / recorded.beta_s_per_byte - 1))
    bound = max(RECHECK_FLOOR, recorded.spread + fresh.spread)
    what = (f"alpha {recorded.alpha_s * 1e6:.0f} -> {fresh.alpha_s * 1e6:.0f} us, beta "
            f"{recorded.beta_s_per_byte * 1e9:.3f} -> {fresh.beta_s_per_byte * 1e9:.3f} ns/B")
    if moved <= bound:
        v.reasons.append(f"the calibration was measured again after the run and agrees ({what}, within "
                         f"+-{100 * bound:.0f}%): the constants are not the cause")
        return v
    v2 = judge(run, expected_iteration_s=expected_iteration_s, analysis=analysis, machine=fresh)
    v2.reasons.append(f"judged with a calibration measured after the run: the one it recorded was contradicted "
                      f"and has moved by {100 * moved:.0f}% ({what}; spreads +-{100 * bound:.0f}%)")
    return v2


def tell_verdict(name: str, run_dir: Path, verdict: Any) -> None:
    """The verdict of a run, into its testbed's event stream."""
    from testbed import events
    from testbed.jobs import rundir

    run_id = (rundir.read_json(run_dir / "summary.json", {}) or {}).get("run_id")
    events.emit(name, "verdict", f"run {run_id}: {verdict.status}" + (f": {verdict.reasons[0]}" if verdict.reasons else ""),
                run_id=run_id, status=verdict.status, run_dir=str(run_dir))

