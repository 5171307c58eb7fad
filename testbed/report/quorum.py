"""A run of groups (testbed.jobs.groups), seen as a fault-tolerant job: each replica group's committed
steps and the quorum over time, with the run's events marked.

Sources, all in the run directory:
  summary.json           the groups (name, kind, workers, restarts used, failures)
  probe/rank-<g>_<r>.jsonl  each rank's optimizer steps (the probe: a torchft group's inner
                         optimizer steps only when the step is committed)
  logs/<worker>.log      what the training script says of its quorum, one line per step from the
                         group's rank 0: `testbed-ft {"t", "group", "step", "quorum_id",
                         "participants", "committed"}`, and at its end `testbed-ft {"final": true,
                         "step", "digest", "same_weights"}` (examples/train_torchft.py prints them;
                         any script may)
  testbed-events.jsonl   the testbed's events of the run's span (faults, scenario steps, restarts)

    text = section(run_dir)      # None when the run had no groups
    png = plot(run_dir)          # quorum.png
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from testbed import safeio
from testbed.jobs import rundir

PREFIX = "testbed-ft "
LOG_READ_MAX = 64 << 20
RECORDS_MAX = 200_000          # per run: a job printing more is cut here
_LINE = re.compile(r"^\[([^\]]{1,80})\] testbed-ft (\{.*\})\s*$")
EVENT_KINDS = ("link", "node", "partition", "scenario", "run")


def groups_of(run: Path) -> list[dict[str, Any]]:
    summary = rundir.read_json(Path(run) / "summary.json", {}) or {}
    gs = summary.get("groups") if isinstance(summary, dict) else None
    return [g for g in gs if isinstance(g, dict) and isinstance(g.get("name"), str)] if isinstance(gs, list) else []


def ft_records(run: Path) -> list[dict[str, Any]]:
    """Every `testbed-ft {...}` line of the workers' logs, as records with a time and a group."""
    out: list[dict[str, Any]] = []
    logs = Path(run) / "logs"
    for f in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        try:   # written by the job: a link or a FIFO is passed over
            text = safeio.read_text(f, LOG_READ_MAX)
        except (OSError, safeio.Unsafe):
            continue
        for line in text.splitlines():
            if PREFIX not in line:
                continue
            m = _LINE.match(line)
            if not m:
                continue
            try:
                rec = json.loads(m.group(2))
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("t"), (int, float)) and isinstance(rec.get("group"), str):
                rec["label"] = m.group(1)
                out.append(rec)
                if len(out) >= RECORDS_MAX:
                    return sorted(out, key=lambda r: r["t"])
    return sorted(out, key=lambda r: r["t"])


def group_steps(run: Path, group: str) -> list[float]:
    """Wall times of the committed steps of the group's rank 0 (its probe file)."""
    from testbed.report.analyze import load_probe

    recs = load_probe(Path(run)).get(f"{group}_0", [])
    return [float(r["t"]) for r in recs if r.get("ev") == "step" and isinstance(r.get("t"), (int, float))]


def quorum_changes(records: list[dict[str, Any]], group: str) -> list[tuple[float, Any, Any]]:
    """(t, quorum id, participants) each time the group's view of the quorum changed."""
    out: list[tuple[float, Any, Any]] = []
    for r in records:
        if r["group"] != group or r.get("final"):
            continue
        q = (r.get("quorum_id"), r.get("participants"))
        if not out or out[-1][1:] != q:
            out.append((float(r["t"]), *q))
    return out


def marks(run: Path) -> list[dict[str, Any]]:
    """The events worth a line: faults, group restarts, and a scenario's steps where no fault
    was recorded beside them (a scenario's step and the fault it made are one event)."""
    from testbed.report.analyze import run_events

    evs = [e for e in run_events(Path(run)) if e.get("kind") in EVENT_KINDS
           and not (e["kind"] == "run" and ("started:" in e["what"] or " ended:" in e["what"]
                                             or ": step " in e["what"]))
           and not (e["kind"] == "scenario" and (" started:" in e["what"] or " ended:" in e["what"]))]
    faults = [float(e["t"]) for e in evs if e["kind"] in ("link", "node", "partition")]
    return [e for e in evs if e["kind"] != "scenario" or not any(abs(float(e["t"]) - t) < 1.0 for t in faults)]


def step_line(run: Path, group: str, records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(t, step) of a group: the manager's step from its lines (a healed group jumps to its peers'),
    else the count of its rank 0's committed steps from the probe."""
    mine = [(float(r["t"]), float(r["step"])) for r in records if r["group"] == group and not r.get("final")
            and r.get("committed") is not False and isinstance(r.get("step"), (int, float))]
    return mine or [(t, float(i)) for i, t in enumerate(group_steps(run, group), 1)]


def section(run: str | Path) -> str | None:
    run = Path(run)
    groups = groups_of(run)
    if not groups:
        return None
    records = ft_records(run)
    summary = rundir.read_json(run / "summary.json", {}) or {}
    t0 = float(summary.get("started") or 0.0)
    lines = ["replica groups", f"  {'group':<12} {'kind':<8} {'workers':<16} {'steps':>6} {'restarts':>8}  end"]
    finals: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("final"):
            finals[r["group"]] = r
    for g in groups:
        name = g["name"]
        steps = len(group_steps(run, name)) if g.get("kind") == "group" else None
        fin = finals.get(name)
        end = ""
        if fin is not None:
            same = {True: "same weights as the others", False: "WEIGHTS DIFFER", None: "weights not compared"}
            end = f"step {fin.get('step')}, digest {str(fin.get('digest'))[:12]}, {same.get(fin.get('same_weights'), '?')}"
        lines.append(f"  {name:<12} {g.get('kind', '?'):<8} {','.join(g.get('workers') or []):<16} "
                     f"{'' if steps is None else steps:>6} {g.get('restarts_used', 0):>8}  {end}")
        for f in g.get("failures") or []:
            if isinstance(f, dict) and isinstance(f.get("t"), (int, float)):
                lines.append(f"    {f['t'] - t0:8.2f}s  {f.get('label')} failed (status {f.get('rc')}): started again")
    digests = {str(f.get("digest")) for f in finals.values()}
    if len(finals) > 1:
        lines.append("  final weights: " + ("identical in every group" if len(digests) == 1
                                            else f"{len(digests)} different digests among {len(finals)} groups"))
    changes = [(t, g["name"], q, n) for g in groups for t, q, n in quorum_changes(records, g["name"])]
    evs = [(float(e["t"]), "", "event", e["what"]) for e in marks(run)]
    if changes:
        lines.append("quorum over time (as each group saw it) and events")
        for t, name, q, n in sorted(changes + evs):
            if q == "event":
                lines.append(f"  {t - t0:8.2f}s  ** {n}")
            else:
                lines.append(f"  {t - t0:8.2f}s  {name:<12} quorum {q}: {n} participant(s)")
    return "\n".join(lines)


def plot(run: str | Path, out: Path | None = None) -> Path | None:
    """quorum.png: each group's step (top; a healed group jumps to its peers') and the participants
    of its quorum (bottom) over the run's time, events as vertical lines."""
    run = Path(run)
    groups = [g for g in groups_of(run) if g.get("kind") == "group"]
    if not groups:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from testbed.report.plots import _save

    summary = rundir.read_json(run / "summary.json", {}) or {}
    t0 = float(summary.get("started") or 0.0)
    records = ft_records(run)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(2, 1))
    for g in groups:
        pts = step_line(run, g["name"], records)
        top.plot([t - t0 for t, _ in pts], [n for _, n in pts], ".", ms=4 if g is groups[0] else 2, label=g["name"])
        ch = quorum_changes(records, g["name"])
        if ch:
            # a group's view ends where it failed (the line breaks there) and at its last line
            last = max(float(r["t"]) for r in records if r["group"] == g["name"])
            fails = sorted(float(f["t"]) for f in g.get("failures") or [] if isinstance(f, dict)
                           and isinstance(f.get("t"), (int, float)))
            xs, ys = [], []
            for t, _, n in ch:
                while fails and fails[0] <= t:
                    xs += [fails[0] - t0, fails[0] - t0]
                    ys += [ys[-1] if ys else n, float("nan")]
                    fails.pop(0)
                xs.append(t - t0)
                ys.append(n)
            xs.append(last - t0)
            ys.append(ys[-1])
            bottom.step(xs, ys, where="post", lw=1.2, label=g["name"])
    for ax in (top, bottom):
        for e in marks(run):
            x = float(e["t"]) - t0
            ax.axvline(x, color="tab:red" if e["kind"] != "run" else "tab:gray", lw=0.8, alpha=0.6)
    ymin, ymax = top.get_ylim()
    xmin, xmax = top.get_xlim()
    prev = None
    for e in sorted(marks(run), key=lambda e: float(e["t"])):
        x = float(e["t"]) - t0
        near = prev is not None and x - prev[0] < 0.02 * (xmax - xmin)
        y, va = (ymin, "bottom") if near and prev[1] == "top" else (ymax, "top")   # close ones: one up, one down
        what = re.sub(r"^run [0-9a-f]+: ", "", e["what"])
        top.annotate(what[:60], (x, y), rotation=90, fontsize=6, va=va, ha="right")
        prev = (x, va)
    from matplotlib.ticker import MaxNLocator

    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("step (the manager's)")
    top.legend(fontsize=7, loc="upper left")
    top.set_title(f"replica groups of {run.name}", fontsize=9)
    bottom.set_ylabel("quorum size")
    bottom.set_xlabel("time since the run started (s, wall)")
    bottom.grid(alpha=0.3)
    if any(quorum_changes(records, g["name"]) for g in groups):
        bottom.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out = out or run / "quorum.png"
    _save(fig, out)
    plt.close(fig)
    return out
