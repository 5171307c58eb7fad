"""The main job (`make testbed TOPO=fat-tree`): up, train across every worker, report, judge.

    python -m testbed.mainjob TOPO [--name NAME] [--steps N] [--batch-size B]

1. This machine's constants (testbed.jobs.calibration; measured once per boot).
2. The testbed, at calibrated `auto` dilation, unless one of that name is up.
3. The training: examples/train_ddp.py on every worker (one gloo/nccl rank
   each), an MLP with ~23 MiB of gradients in one DDP bucket, so each step is
   compute, then one all_reduce; a progress bar fed by the probe.
4. The report and the verdict, with the expected iteration time: the compute
   every step waits for (step_compute: per step, the own work of the rank that
   did the most, in CPU seconds from one all_reduce to the next; the median
   over steps) plus the reference model's all_reduce of the gradients on this
   topology (testbed.topology.reference). The iteration check then judges
   what the emulation adds to a step: the all_reduce, and any time a rank
   could run but was not run.

Why the slowest rank's CPU seconds (since 2026-12-06): every step waits for
the last rank to reach the all_reduce. In the k=4 fat-tree main job that rank
had done the most work in 14-18 of 18 steps (31-77 ms against the median
rank's 29-42 ms, the extra kernel time in page faults), and its wall time was
within 2.6 ms of its CPU time, so the wait is the rank's own work, not this
machine's scheduling. The median rank's compute (the term until then) left
that wait out: iterations came out +12-23% (docs/fidelity.md). Before
2026-12-03 the term was one rank alone, whose compute depends on whether this
VM's CPUs idle.

The testbed stays up (it says how to attach and how to tear down). Layer:
above testbed.jobs and testbed.report, beside the CLI.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STEPS = 20
DEFAULT_BATCH = 32
MODEL_ARGS = ["--model", "mlp", "--hidden", "1536", "--layers", "3", "--bucket-cap-mb", "64"]
def _count_steps(probe_dir: Path) -> int:
    f = probe_dir / "rank-0.jsonl"
    try:
        return f.read_bytes().count(b'"ev":"step"')
    except OSError:
        return 0


def _split(recs: list[dict[str, Any]], s: float) -> dict[str, float] | None:
    """One rank's median step (emulated seconds) split into its DDP all_reduces (from its own
    launch to completion: waiting for the last rank included) and the rest (compute, the
    optimizer). The first step is warm-up."""
    ends = [r["t"] for r in recs if r.get("ev") == "step"]
    colls = [r for r in recs if r.get("ev") == "coll" and r.get("src") == "ddp"]
    steps = []
    for a, b in zip(ends[1:], ends[2:]):
        comm = sum(float(c.get("dur") or 0.0) for c in colls if a < c["t"] < b)
        steps.append(((b - a) / s, comm / s, (b - a - comm) / s))
    if not steps:
        return None
    return {"iteration_s": statistics.median(x for x, _, _ in steps), "comm_s": statistics.median(c for _, c, _ in steps),
            "rest_s": statistics.median(r for _, _, r in steps)}


def measured_split(run_dir: Path, s: float) -> dict[str, float] | None:
    """Rank 0's median step split into DDP's all_reduces and the rest: where a miss against the
    expected iteration is."""
    from testbed.report.analyze import load_probe

    return _split(load_probe(run_dir).get("0") or [], s)


def own_work(recs: list[dict[str, Any]], s: float) -> dict[int, dict[str, float]]:
    """Step n -> one rank's own work between its all_reduces: from the completion of its last DDP
    bucket of step n-1 to the launch of its first bucket of step n (the optimizer, then forward and
    backward). `wall_s`: emulated seconds; `cpu_s`: the process's CPU seconds, which under its cap
    take 1/rank_cores emulated seconds each when it waits for nothing (run_cores); `sys_s`, `faults`, `gc_s`: of them
    in the kernel, minor page faults, Python's garbage collector (the probe's "w" readings; steps
    without them are left out). From step 3: the first two are warm-up (the optimizer's first
    step makes its state: 45 MiB of page faults in the main job)."""
    from testbed.report.analyze import finite

    ends = sorted(float(r["t"]) for r in recs if r.get("ev") == "step" and finite(r.get("t")))
    # records come from ranks: one without a finite time and duration is left out, not trusted
    colls = [r for r in recs if r.get("ev") == "coll" and r.get("src") == "ddp" and finite(r.get("t"))
             and finite(r.get("dur"))]
    out: dict[int, dict[str, float]] = {}
    for n in range(3, len(ends) + 1):
        prev = [c for c in colls if ends[n - 3] < c["t"] < ends[n - 2]]
        cur = [c for c in colls if ends[n - 2] < c["t"] < ends[n - 1]]
        if not prev or not cur:
            continue
        try:
            done = max(prev, key=lambda c: float(c["t"]) + float(c["dur"]))
            launch = min(cur, key=lambda c: float(c["t"]))
            a, b = done["w_done"], launch["w"]
            x = {"wall_s": (float(launch["t"]) - float(done["t"]) - float(done["dur"])) / s,
                 "cpu_s": float(b[0]) - float(a[0]), "sys_s": float(b[1]) - float(a[1]),
                 "faults": float(b[2]) - float(a[2]), "gc_s": float(b[3]) - float(a[3])}
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if all(math.isfinite(v) for v in x.values()):
            out[n] = x
    return out


def step_compute(run_dir: Path, s: float) -> dict[str, float] | None:
    """The compute every step waits for: per step, the own work of the rank that did the most (in CPU
    seconds: see own_work), the median over steps (`compute_s`). Beside it, for the report: the
    median rank's (`typical_s`); what the slowest one's work was made of (`sys_s`, `faults`,
    `gc_s`, medians over steps); and how much later the last rank arrived than that work explains
    (`lag_s`: the longest wall time less the most CPU time, per step: time a rank could run but was
    not run, this machine's time-sharing).
    A real cluster waits for its slowest rank too; one whose compute is CPU work at this machine's
    speed is what the testbed emulates."""
    from testbed.report.analyze import load_probe

    per_rank = [w for w in (own_work(recs, s) for recs in load_probe(run_dir).values()) if w]
    if not per_rank:
        return None
    steps = sorted(set.intersection(*(set(w) for w in per_rank)))
    if not steps:
        return None
    cores = run_cores(run_dir)   # CPU seconds -> emulated seconds
    slowest = [max((w[n] for w in per_rank), key=lambda x: x["cpu_s"]) for n in steps]
    typical = [statistics.median(w[n]["cpu_s"] for w in per_rank) for n in steps]
    med = lambda key: statistics.median(x[key] for x in slowest)   # noqa: E731
    return {"compute_s": med("cpu_s") / cores, "typical_s": statistics.median(typical) / cores,
            "sys_s": med("sys_s") / cores, "faults": med("faults"), "gc_s": med("gc_s") / cores,
            "lag_s": statistics.median(max(w[n]["wall_s"] for w in per_rank) - x["cpu_s"] / cores
                                       for n, x in zip(steps, slowest)),
            "ranks": len(per_rank), "steps": len(steps), "rank_cores": cores}


def run_cores(run_dir: Path) -> float:
    """The cores of this machine each rank of the run had in emulated time (run_constants.recorded_rank_cores)."""
    from testbed.jobs import rundir
    from testbed.report.run_constants import recorded_rank_cores

    summary = rundir.read_json(Path(run_dir) / "summary.json")
    return recorded_rank_cores(summary if isinstance(summary, dict) else {})


def compute_line(c: dict[str, float]) -> str:
    cores = c.get("rank_cores", 1.0)
    per = "" if cores <= 1.0001 else f", at {cores:.2f} of this machine's cores per rank"
    return (f"compute per step {c['compute_s'] * 1e3:.1f} ms: the slowest of {c['ranks']:.0f} ranks' own work "
            f"(CPU time from one all_reduce to the next{per}, median of {c['steps']:.0f} steps; the median rank "
            f"{c['typical_s'] * 1e3:.1f} ms; the slowest one's kernel time {c['sys_s'] * 1e3:.1f} ms, "
            f"{c['faults']:.0f} page faults, garbage collection {c['gc_s'] * 1e3:.1f} ms; the last arrival "
            f"{c['lag_s'] * 1e3:.1f} ms later than that work explains)")


def main(topo: str, name: str | None = None, steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from testbed import lifecycle
    from testbed.jobs import calibration
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed import store
    from testbed.report import report, tell_verdict
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network
    from testbed.topology.reference import predict

    console = Console()
    t0 = time.time()
    machine = calibration.get(progress=lambda m: console.print(m, highlight=False)).constants()
    topology = load_topology(topo)
    name = name or topology.name
    if store.exists(name):
        console.print(f"testbed [bold]{name}[/] is up already: using it")
    else:
        console.print(f"bringing up [bold]{name}[/] ({len(topology.workers)} workers, "
                      f"{len(topology.switches)} switches, {len(topology.links)} links) ...")
        t_up = time.time()
        lifecycle.up(topology, name, time_dilation=topology.time_dilation or "auto", machine=machine)
        console.print(f"up in {time.time() - t_up:.1f} s")
    st = lifecycle.load(name)
    from testbed.cli.common import print_dilation

    print_dilation(st)
    cluster = cluster_from_state(name)
    cmd = [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", str(steps), "--batch-size", str(batch),
           "--log-every", str(max(1, steps // 4)), *MODEL_ARGS]

    console.print(f"training on {len(cluster.workers)} ranks: {' '.join(cmd[1:])}")
    rd_box: dict[str, Path] = {}
    done = threading.Event()
    with Progress(TextColumn("[bold]train_ddp"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("steps", total=steps)

        def poll() -> None:
            while not done.wait(0.5):
                if "rd" in rd_box:
                    progress.update(task, completed=_count_steps(rd_box["rd"] / "probe"))

        def echo(line: str) -> None:
            if line.startswith(("[w0:r0]", "[testbed]")) and "socket.cpp" not in line:
                progress.console.print(line, highlight=False, markup=False)

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        t_run = time.time()
        try:
            result = run(cluster, cmd, echo=echo, on_start=lambda rd, _probe: rd_box.__setitem__("rd", rd),
                         workdir=str(REPO), base_dir=str(REPO), timeout=600, machine=machine)
        finally:
            done.set()
            th.join(1)
        progress.update(task, completed=_count_steps(result.run_dir / "probe"))
    console.print(f"run finished with status {result.rc} in {time.time() - t_run:.1f} s")

    s = float(st.get("time_dilation") or 1.0)
    compute = step_compute(result.run_dir, s) if result.rc == 0 else None
    expected = expected_iteration(result.run_dir, cluster, compute["compute_s"], machine, predict, plan_network) \
        if compute else None
    text, analysis, plots = report(result.run_dir, expected_iteration_s=expected["iteration_s"] if expected else None,
                                   recheck=lambda m: console.print(m, highlight=False, markup=False))
    tell_verdict(cluster.name, result.run_dir, analysis["verdict"])
    console.print(text, highlight=False, markup=False)
    if expected:
        p50s = [r["iter_p50_s"] for r in analysis["ranks"] if r.get("iter_p50_s")]
        it = statistics.median(p50s) if p50s else None
        console.print(f"\n{compute_line(compute)}", highlight=False)
        console.print(f"expected iteration on the emulated cluster: {expected['iteration_s'] * 1e3:.1f} ms = compute "
                      f"{compute['compute_s'] * 1e3:.1f} ms (the slowest rank's own) + all_reduce of "
                      f"{expected['bytes'] / 2 ** 20:.1f} MiB on {len(cluster.workers)} ranks "
                      f"{expected['comm_s'] * 1e3:.1f} ms (reference model)"
                      + (f"; measured {it * 1e3:.1f} ms ({100 * (it / expected['iteration_s'] - 1):+.1f}%)" if it else ""),
                      highlight=False)
        split = measured_split(result.run_dir, s)
        if split:
            console.print(f"rank 0's median step: all_reduce {split['comm_s'] * 1e3:.1f} ms (model "
                          f"{expected['comm_s'] * 1e3:.1f}), the rest "
                          f"{split['rest_s'] * 1e3:.1f} ms", highlight=False)
    for p in plots:
        console.print(f"plot: {p}", highlight=False)
    from testbed.cli.common import testbed_command

    tb = testbed_command()
    console.print(f"\nThe testbed [bold]{name}[/] is still up.\n"
                  f"  attach to a worker:  {tb} attach {cluster.workers[0]} --name {name}\n"
                  f"  run something:       {tb} run --name {name} -- python -m testbed.jobs.collectives_bench\n"
                  f"  tear it down:        {tb} down {name}   (or: make down)\n"
                  f"total {time.time() - t0:.1f} s", highlight=False, soft_wrap=True)
    return result.rc


def expected_iteration(run_dir: Path, cluster: Any, compute_s: float, machine: Any, predict: Any,
                       plan_network: Any) -> dict[str, float] | None:
    """Compute per step plus the model's time for the all_reduces DDP made in one step (its buckets)."""
    from testbed.report.analyze import load_probe

    recs = load_probe(run_dir).get("0") or []
    steps = [r for r in recs if r.get("ev") == "step"]
    if len(steps) < 3:
        return None
    t_a, t_b = steps[-2]["t"], steps[-1]["t"]   # the buckets of the last full step
    buckets = [int(r["bytes"]) for r in recs if r.get("ev") == "coll" and r.get("src") == "ddp" and t_a < r["t"] < t_b]
    if not buckets:
        return None
    from testbed.report.run_constants import run_constants

    plan = plan_network(cluster.topology)
    model = run_constants(run_dir, machine, cluster.topology, cluster.workers)
    comm = sum(predict(cluster.topology, plan, "all_reduce", b, cluster.workers, model).time_s for b in buckets)
    return {"iteration_s": compute_s + comm, "comm_s": comm, "bytes": float(sum(buckets))}


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.mainjob", description=__doc__.splitlines()[0])
    ap.add_argument("topo", nargs="?", default="fat-tree")
    ap.add_argument("--name", default=None)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    args = ap.parse_args(argv)
    from testbed.errors import TestbedError

    try:
        return main(args.topo, args.name, args.steps, args.batch_size)
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(cli())
