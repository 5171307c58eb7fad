#!/usr/bin/env python3
"""gloo's threads ahead of the job's own (testbed/jobs/probe/_testbed_threads.py), on and off,
interleaved on one testbed as a user brings it up: a 2-worker 10 Gbit/s star at the default (auto)
dilation. Each round runs, with TESTBED_COMM_THREADS=0 (the baseline: the ranks' threads as they
start) and with the default (on), in turns:

  small  python -m testbed.jobs.collectives_bench --ops all_reduce,broadcast --sizes 1K,64K
  ddp    python examples/train_ddp.py --model mlp --steps 30          (the seed's own case)

and prints, per class, the share of instances that took 2 ms or more (a scheduler tick: the spin
the module's docstring describes), the mean instance time, and the DDP buckets against the model
with the run's verdict; then on/off ratios from the same rounds.

    sudo .venv/bin/python bench/comm_threads.py --rounds 3

Results append to bench/results/comm_threads.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from mainjob_trials import append_series  # noqa: E402

OUT = REPO / "bench" / "results" / "comm_threads.json"
NAME = "commthreads"
TB = str(REPO / ".venv" / "bin" / "testbed")
JOBS = {
    "small": ["python", "-m", "testbed.jobs.collectives_bench", "--ops", "all_reduce,broadcast", "--sizes",
              "1K,64K", "--budget", "1", "--min-iters", "3", "--max-iters", "2000"],
    "ddp": ["python", "examples/train_ddp.py", "--model", "mlp", "--steps", "30"],
}
STALL_S = 0.002   # an instance this long (real time) waited a scheduler tick: 0.2-0.6 ms without one


def one(job: str, on: bool) -> dict:
    env = {**os.environ, "COLUMNS": "1000"}
    argv = [TB, "run", "--name", NAME, *([] if on else ["--env", "TESTBED_COMM_THREADS=0"]), "--", *JOBS[job]]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("run directory: ")), None)
    if r.returncode != 0 or line is None:
        return {"job": job, "on": on, "error": (r.stderr or r.stdout)[-1500:]}
    run = REPO / line.split("run directory: ", 1)[1].split()[0]
    return {"job": job, "on": on, "run": run.name, **measure(run)}


def measure(run: Path) -> dict:
    from testbed.report.analyze import LATENCY_OP, load_probe
    from testbed.report.instances import instances, recording_ranks

    summary = json.loads((run / "summary.json").read_text())
    world = int(summary.get("world_size") or 0)
    by_class = {}
    for key, xs in instances(load_probe(run), world, recording_ranks(summary, world)).items():
        if key[0] == LATENCY_OP or len(xs) < 10:
            continue
        times = [i["end"] - i["start"] for i in xs]
        by_class[f"{key[0]} {key[1]}"] = {"n": len(times), "stalled": sum(t >= STALL_S for t in times) / len(times),
                                          "mean_ms": 1e3 * statistics.fmean(times)}
    v = summary.get("verdict") or {}
    buckets = {f"{c['op']} {c['nbytes']}": round(c["error"], 4) for c in v.get("classes") or []
               if c["op"] == "all_reduce" and c["count"] > 3}
    return {"status": v.get("status"), "dilation": (summary.get("time_dilation") or {}).get("factor"),
            "classes": by_class, "model_error": buckets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (sudo)")
    series = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load_before": os.getloadavg(),
              "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip(), "runs": []}
    up = subprocess.run([TB, "up", "topologies/star.yaml", "--set", "params.n=2", "--name", NAME], cwd=REPO,
                        capture_output=True, text=True, timeout=900)
    if up.returncode != 0:
        sys.exit("up failed: " + (up.stderr or up.stdout)[-2000:])
    t0 = time.time()
    try:
        for i in range(a.rounds):
            for job in JOBS:
                for on in ((False, True) if i % 2 == 0 else (True, False)):
                    r = one(job, on)
                    series["runs"].append(r)
                    if "error" in r:
                        print(f"round {i + 1} {job} {'on' if on else 'off'}: failed: {r['error'][-300:]}", flush=True)
                        continue
                    cls = ", ".join(f"{k} {100 * c['stalled']:.0f}% stalled, {c['mean_ms']:.2f} ms"
                                    for k, c in sorted(r["classes"].items()) if job == "small")
                    err = ", ".join(f"{k}: {100 * e:+.1f}%" for k, e in sorted(r["model_error"].items())
                                    if job == "ddp")
                    print(f"round {i + 1} {job:5} {'on ' if on else 'off'} s={r['dilation']} {r['status']}: "
                          f"{cls}{err}", flush=True)
    finally:
        subprocess.run([TB, "down", NAME], cwd=REPO, capture_output=True, timeout=300)
    series["seconds"] = round(time.time() - t0, 1)
    ok = [r for r in series["runs"] if "error" not in r]
    summary = {}
    for job in JOBS:
        for on in (False, True):
            rs = [r for r in ok if r["job"] == job and r["on"] == on]
            keys = sorted({k for r in rs for k in r["classes"]})
            summary[f"{job} {'on' if on else 'off'}"] = {
                "faithful": sum(r["status"] == "faithful" for r in rs), "runs": len(rs),
                "stalled": {k: statistics.median(r["classes"][k]["stalled"] for r in rs if k in r["classes"])
                            for k in keys},
                "mean_ms": {k: statistics.median(r["classes"][k]["mean_ms"] for r in rs if k in r["classes"])
                            for k in keys},
                "model_error": {k: sorted(r["model_error"][k] for r in rs if k in r["model_error"])
                                for k in sorted({k for r in rs for k in r["model_error"]})}}
    series["summary"] = summary
    for job in JOBS:
        off, on = summary[f"{job} off"], summary[f"{job} on"]
        print(f"{job}: faithful {on['faithful']}/{on['runs']} on, {off['faithful']}/{off['runs']} off")
        for k in on["mean_ms"]:
            if k in off["mean_ms"]:
                print(f"  {k}: stalled {100 * on['stalled'][k]:.1f}% on, {100 * off['stalled'][k]:.1f}% off; "
                      f"mean {on['mean_ms'][k]:.3f} ms on, {off['mean_ms'][k]:.3f} off (on/off {on['mean_ms'][k] / off['mean_ms'][k]:.2f})")
        for k in on["model_error"]:
            print(f"  {k} against the model: on {[f'{100 * e:+.1f}%' for e in on['model_error'][k]]}, "
                  f"off {[f'{100 * e:+.1f}%' for e in off['model_error'].get(k, [])]}")
    append_series(OUT, series)
    return 0


if __name__ == "__main__":
    sys.exit(main())
