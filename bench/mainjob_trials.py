#!/usr/bin/env python3
"""The main job as a new user meets it, N times: `python -m testbed.mainjob TOPO` as a whole process.

Each trial brings the testbed up anew and takes it down after. --fresh removes the boot's calibration
first (as after a reboot: the trial calibrates); --burners N runs N CPU-bound processes for the first
--burn-s seconds of each trial (a machine doing something else while the user starts). Each trial
records the verdict, the all_reduce class against the model and the links alone, the dilation, and
the process's wall time.

    sudo .venv/bin/python bench/mainjob_trials.py --trials 5 --fresh
    sudo .venv/bin/python bench/mainjob_trials.py --trials 5 --fresh --burners 2 --burn-s 25

Results append to bench/results/mainjob_trials.json (one object per series).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "mainjob_trials.json"
NAME = "mjtrial"


def _burn(until: float) -> None:
    x = 0
    while time.time() < until:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _newest_run(before: set[str]) -> Path | None:
    runs = REPO / "runs"
    new = [p for p in runs.iterdir() if p.name not in before and p.name.endswith(NAME)] if runs.is_dir() else []
    return max(new, key=lambda p: p.stat().st_mtime) if new else None


def trial(topo: str, fresh: bool, burners: int, burn_s: float) -> dict:
    py = str(REPO / ".venv" / "bin" / "python")
    cal = Path(os.environ.get("TESTBED_CALIBRATION_FILE", "/run/testbed/.calibration.json"))
    if fresh:
        cal.unlink(missing_ok=True)
    before = {p.name for p in (REPO / "runs").iterdir()} if (REPO / "runs").is_dir() else set()
    procs = [multiprocessing.Process(target=_burn, args=(time.time() + burn_s,)) for _ in range(burners)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    # COLUMNS: the console's lines unwrapped, so that the ones read below are whole
    r = subprocess.run([py, "-m", "testbed.mainjob", topo, "--name", NAME], cwd=REPO, capture_output=True,
                       text=True, timeout=1800, env={**os.environ, "COLUMNS": "1000"})
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    subprocess.run([str(REPO / ".venv" / "bin" / "testbed"), "down", NAME], cwd=REPO, capture_output=True,
                   timeout=300)
    out: dict = {"rc": r.returncode, "wall_s": round(wall, 1), "load1_after": os.getloadavg()[0]}
    run = _newest_run(before)
    if run is None:
        out["error"] = (r.stderr or r.stdout)[-2000:]
        return out
    summary = json.loads((run / "summary.json").read_text())
    v = summary.get("verdict") or {}
    out.update(run=run.name, status=v.get("status"), reasons=v.get("reasons"),
               dilation=(summary.get("time_dilation") or summary.get("dilation")),
               calibration=v.get("constants"))
    big = [c for c in v.get("classes") or [] if c["op"] == "all_reduce"]
    big.sort(key=lambda c: -c["share"])
    if big:
        c = big[0]
        out["all_reduce"] = {"mib": round(c["nbytes"] / 2 ** 20, 1), "count": c["count"],
                             "measured_ms": round(c["measured_s"] * 1e3, 2), "model_ms": round(c["model_s"] * 1e3, 2),
                             "links_ms": round(c["links_s"] * 1e3, 2), "error": round(c["error"], 4),
                             "tolerance": round(c["tolerance"], 4), "status": c["status"]}
    for line in r.stdout.splitlines():
        if "expected iteration on the emulated cluster" in line and "measured" in line:
            out["iteration_line"] = line.strip()
        if line.startswith("compute per step"):   # the slowest rank's own work, what it was made of
            out["compute_line"] = line.strip()
        if line.startswith("rank 0's median step:"):   # all_reduce against the model, the rest against one rank
            out["step_split_line"] = line.strip()
        if line.startswith("time dilation") or "dilation" in line.lower() and " s=" in line:
            out.setdefault("dilation_line", line.strip())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topo", default="fat-tree")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--fresh", action="store_true", help="remove the boot's calibration before each trial")
    ap.add_argument("--burners", type=int, default=0)
    ap.add_argument("--burn-s", type=float, default=25.0)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (sudo)")
    series = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "topo": a.topo,
              "fresh": a.fresh, "burners": a.burners, "burn_s": a.burn_s, "load_before": os.getloadavg(),
              "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip(), "trials": []}
    for i in range(a.trials):
        t = trial(a.topo, a.fresh, a.burners, a.burn_s)
        series["trials"].append(t)
        ar = t.get("all_reduce") or {}
        print(f"trial {i + 1}/{a.trials}: {t.get('status')} rc={t['rc']} wall {t['wall_s']} s, all_reduce "
              f"{ar.get('mib')} MiB {ar.get('measured_ms')} ms against model {ar.get('model_ms')} ms "
              f"({100 * ar.get('error', float('nan')):+.1f}%, tol {100 * ar.get('tolerance', float('nan')):.1f}%), "
              f"links {ar.get('links_ms')} ms; load {t['load1_after']:.1f}", flush=True)
        if t.get("iteration_line"):
            print("   ", t["iteration_line"], flush=True)
    statuses = [t.get("status") for t in series["trials"]]
    errs = [t["all_reduce"]["error"] for t in series["trials"] if t.get("all_reduce")]
    series["faithful"] = statuses.count("faithful")
    print(f"faithful {statuses.count('faithful')}/{len(statuses)}; all_reduce error median "
          f"{100 * statistics.median(errs):+.1f}% range {100 * min(errs):+.1f}..{100 * max(errs):+.1f}%" if errs else "")
    append_series(OUT, series)
    return 0


def append_series(out: Path, series: dict) -> None:
    """Add one series to a results file that lists every series measured."""
    doc = json.loads(out.read_text()) if out.exists() else []
    doc.append(series)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
