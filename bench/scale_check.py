#!/usr/bin/env python3
"""Does a big fat-tree work, as a user would check it? (issue #13: k=16 on one machine)

    sudo .venv/bin/python bench/scale_check.py              # k=16: 1,024 workers, 320 switches
    sudo .venv/bin/python bench/scale_check.py --k 8 --pairs 50

Each step runs `.venv/bin/testbed` as a process, as a user would, under a private state root:
`up fat-tree --set params.k=K --time-dilation none`; ping between PAIRS random worker pairs in
different pods (inside the workers' namespaces); `link down` and `link up` of an
edge-aggregation link (the process's time; then a ping across it); `status --json`; memory
(MemAvailable before and after `up`, per node; the worker inits' RSS and PSS); `down`. Prints
one line per step and writes bench/results/scale_check.json. Exit status 1 if a pair did not
reach, or a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / ".venv" / "bin" / "testbed"
RESULTS = REPO / "bench" / "results" / "scale_check.json"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    return time.perf_counter() - t, r


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def ping(ns: str, addr: str) -> bool:
    r = subprocess.run(["ip", "netns", "exec", ns, "ping", "-c1", "-W2", "-q", addr], capture_output=True)
    return r.returncode == 0


def init_memory(name: str, st: dict) -> dict[str, float]:
    """RSS and PSS (MiB) of the worker inits, from /proc (psutil's memory_full_info needs the same)."""
    import psutil

    rss, pss, n = 0, 0, 0
    for rec in (st.get("runtime") or {}).get("workers", {}).values():
        pid = rec.get("pid")
        try:
            info = psutil.Process(int(pid)).memory_full_info()
        except (psutil.Error, TypeError, ValueError):
            continue
        rss, pss, n = rss + info.rss, pss + info.pss, n + 1
    return {"inits": n, "rss_mib": rss / n / 2**20 if n else 0.0, "pss_mib": pss / n / 2**20 if n else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("scale_check builds a testbed: run it as root", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="tb-scale-", dir="/run"))
    env = {**os.environ, "TESTBED_STATE_DIR": str(root)}
    name, k, ok = f"scale{args.k}", args.k, True
    out: dict = {"k": k, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_at_start": os.getloadavg()[0]}

    def step(what: str, value: str) -> None:
        print(f"{what:<34} {value}", flush=True)

    mem0 = mem_available()
    t, r = timed([str(TESTBED), "up", "fat-tree", "--name", name, "--set", f"params.k={k}",
                  "--time-dilation", "none"], env)
    if r.returncode != 0:
        print(r.stdout[-2000:] + r.stderr[-2000:], file=sys.stderr)
        return 1
    try:
        st = json.loads((root / name / "state.json").read_text())
        from testbed.topology.model import Topology
        from testbed.topology.plan import plan_network

        topo = Topology.from_json(st["topology"])
        plan = plan_network(topo)
        mem1 = mem_available()
        out.update(up_s=t, nodes=len(topo.nodes), workers=len(topo.workers), switches=len(topo.switches),
                   links=len(topo.links), timings=st.get("timings"),
                   routes=sum(len(plan.routes[s]) for s in topo.switches),
                   mem_per_node_mib=(mem0 - mem1) / len(topo.nodes) / 2**20, **init_memory(name, st))
        step("up", f"{t:.1f} s ({len(topo.workers)} workers, {len(topo.switches)} switches, "
                   f"{len(topo.links)} links, {out['routes']} routes)")
        step("memory", f"{out['mem_per_node_mib']:.2f} MiB per node (MemAvailable); a worker's init "
                       f"RSS {out['rss_mib']:.1f} MiB, PSS {out['pss_mib']:.1f} MiB")

        per_pod = (k // 2) ** 2
        rng = random.Random(args.seed)
        pairs = []
        while len(pairs) < args.pairs:
            a, b = rng.sample(range(len(topo.workers)), 2)
            if a // per_pod != b // per_pod:
                pairs.append((f"w{a}", f"w{b}"))
        netns = {w: st["runtime"]["workers"][w]["netns"] for w in topo.workers}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            reached = list(pool.map(lambda p: ping(netns[p[0]], plan.worker_address(p[1])), pairs))
        out.update(pairs=len(pairs), reached=sum(reached), pairs_s=time.perf_counter() - t0)
        ok &= all(reached)
        step("worker pairs across pods", f"{sum(reached)} of {len(pairs)} reach ({out['pairs_s']:.1f} s)")

        edge, agg = "edge3-1" if k > 6 else "edge1-1", "agg3-0" if k > 6 else "agg1-0"
        for verb in ("down", "up"):
            t, r = timed([str(TESTBED), "link", verb, "--name", name, edge, agg], env)
            ok &= r.returncode == 0
            out[f"link_{verb}_s"] = t
            step(f"link {verb} {edge} {agg}", f"{t:.2f} s (rc {r.returncode})")
        across = ping(netns["w0"], plan.worker_address(f"w{len(topo.workers) - 1}"))
        ok &= across
        step("ping after the link change", "ok" if across else "FAILED")
        t, r = timed([str(TESTBED), "status", name, "--json"], env)
        out["status_json_s"] = t
        step("status --json", f"{t:.2f} s")
    finally:
        t, r = timed([str(TESTBED), "down", name], env)
        out.update(down_s=t, down_rc=r.returncode)
        step("down", f"{t:.2f} s (rc {r.returncode})")
        subprocess.run([str(TESTBED), "cleanup"], env=env, capture_output=True)
        if r.returncode == 0:
            shutil.rmtree(root, ignore_errors=True)   # our private state root, made above
        else:
            print(f"state root kept for `TESTBED_STATE_DIR={root} testbed cleanup`", file=sys.stderr)
    out["ok"] = bool(ok)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
