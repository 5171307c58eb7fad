#!/usr/bin/env python3
"""The seed's own case, N times, as a user runs it: a 2-worker 10 Gbit/s star at the default (auto)
dilation, `testbed run -- python examples/train_ddp.py --model mlp --steps 30` (DDP's default
buckets: two per step, in flight together), its verdict, and each DDP bucket's class against the
model with the links shared (what the verdict judges), the model alone (what it judged before
testbed.report.sharing) and the links alone; and the iteration against the same steps with each
collective at the model's time (testbed.report.iteration: the issue's "iteration within 3%").

    sudo .venv/bin/python bench/seed_ddp_trials.py --trials 5 --fresh

--fresh removes the boot's calibration before each trial (as after a reboot). Each trial brings the
testbed up anew and takes it down after. Results append to bench/results/seed_ddp_trials.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from mainjob_trials import append_series   # bench/ is this script's directory on sys.path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "seed_ddp_trials.json"
NAME = "seedtrial"
TB = str(REPO / ".venv" / "bin" / "testbed")
JOB = ["python", "examples/train_ddp.py", "--model", "mlp", "--steps", "30"]


def trial(fresh: bool) -> dict:
    cal = Path(os.environ.get("TESTBED_CALIBRATION_FILE", "/run/testbed/.calibration.json"))
    if fresh:
        cal.unlink(missing_ok=True)
    env = {**os.environ, "COLUMNS": "1000"}
    t0 = time.perf_counter()
    up = subprocess.run([TB, "up", "topologies/star.yaml", "--set", "params.n=2", "--name", NAME], cwd=REPO,
                        capture_output=True, text=True, timeout=900, env=env)
    if up.returncode != 0:
        return {"error": "up: " + (up.stderr or up.stdout)[-2000:]}
    try:
        r = subprocess.run([TB, "run", "--name", NAME, "--", *JOB], cwd=REPO, capture_output=True, text=True,
                           timeout=900, env=env)
    finally:
        subprocess.run([TB, "down", NAME], cwd=REPO, capture_output=True, timeout=300)
    out: dict = {"rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 1), "load1_after": os.getloadavg()[0]}
    line = next((x for x in r.stdout.splitlines() if x.startswith("run directory: ")), None)
    if line is None:
        out["error"] = (r.stderr or r.stdout)[-2000:]
        return out
    run = REPO / line.split("run directory: ", 1)[1].split()[0]
    summary = json.loads((run / "summary.json").read_text())
    v = summary.get("verdict") or {}
    out.update(run=run.name, status=v.get("status"), reasons=v.get("reasons"),
               dilation=(summary.get("time_dilation") or {}).get("factor"), calibration=v.get("constants"))
    out["classes"] = [{"mib": round(c["nbytes"] / 2 ** 20, 2), "count": c["count"],
                       "measured_ms": round(c["measured_s"] * 1e3, 3), "model_ms": round(c["model_s"] * 1e3, 3),
                       "alone_ms": round(c.get("alone_s", 0.0) * 1e3, 3), "links_ms": round(c["links_s"] * 1e3, 3),
                       "error": round(c["error"], 4),
                       "error_alone": round(c["measured_s"] / c["alone_s"] - 1, 4) if c.get("alone_s") else None,
                       "status": c["status"]}
                      for c in v.get("classes") or [] if c["op"] == "all_reduce"]
    it = next((c for c in v.get("checks") or [] if c.get("name") == "steps"), None)
    m = re.search(r"iteration p50 ([\d.]+) ms \(rank \d+\), ([+-][\d.]+)% against ([\d.]+) ms", (it or {}).get("detail", ""))
    if m:   # the steps against the same steps with the model's communication (testbed/report/iteration.py)
        out["iteration"] = {"measured_ms": float(m[1]), "expected_ms": float(m[3]), "error": float(m[2]) / 100}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--fresh", action="store_true", help="remove the boot's calibration before each trial")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (sudo)")
    series = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "fresh": a.fresh,
              "job": " ".join(JOB), "load_before": os.getloadavg(),
              "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip(), "trials": []}
    for i in range(a.trials):
        t = trial(a.fresh)
        series["trials"].append(t)
        buckets = ", ".join(f"{c['mib']} MiB {c['measured_ms']} ms against {c['model_ms']} ({100 * c['error']:+.1f}%; "
                            f"alone {c['alone_ms']}: {100 * (c['error_alone'] or 0):+.1f}%)"
                            for c in t.get("classes") or [] if c["count"] > 3)
        it = t.get("iteration")
        print(f"trial {i + 1}/{a.trials}: {t.get('status')} s={t.get('dilation')} rc={t.get('rc')} "
              f"{buckets}{'; ' + t['error'][-300:] if t.get('error') else ''}"
              + (f"; iteration {it['measured_ms']} ms against {it['expected_ms']} ({100 * it['error']:+.1f}%)" if it else "")
              + f"; load {t.get('load1_after', 0):.1f}", flush=True)
    statuses = [t.get("status") for t in series["trials"]]
    series["faithful"] = statuses.count("faithful")
    errs = [c["error"] for t in series["trials"] for c in t.get("classes") or [] if c["count"] > 3]
    print(f"faithful {series['faithful']}/{len(statuses)}" + (
        f"; the buckets' error median {100 * statistics.median(errs):+.1f}%, range {100 * min(errs):+.1f}.."
        f"{100 * max(errs):+.1f}%" if errs else ""))
    its = [t["iteration"]["error"] for t in series["trials"] if t.get("iteration")]
    if its:
        series["iteration_within_3pct"] = sum(abs(e) <= 0.03 for e in its)
        print(f"iteration within 3% of the expected in {series['iteration_within_3pct']}/{len(its)} "
              f"({', '.join(f'{100 * e:+.1f}%' for e in its)})")
    append_series(OUT, series)
    return 0


if __name__ == "__main__":
    sys.exit(main())
