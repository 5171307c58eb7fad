"""The main job (`make testbed TOPO=fat-tree`): up, train across every worker, report.

    python -m testbed.jobs.mainjob TOPO [--name NAME] [--steps N]

Brings the topology up unless a testbed of that name is up already, runs
examples/train_ddp.py on every worker (one gloo/nccl rank each) with a
progress bar fed by the probe, prints the summary table, writes the plots,
and leaves the testbed up (printing how to attach and how to tear down).
Defaults are sized for 16 ranks on a 2-core machine: a ~4k-parameter CNN on
16x16 images, 20 steps of batch 16.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_STEPS = 20
DEFAULT_BATCH = 16


def _count_steps(probe_dir: Path) -> int:
    f = probe_dir / "rank-0.jsonl"
    try:
        return f.read_bytes().count(b'"ev":"step"')
    except OSError:
        return 0


def main(topo: str, name: str | None = None, steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from testbed import lifecycle
    from testbed.jobs.run import cluster_from_state, run
    from testbed.net import state
    from testbed.report import report
    from testbed.topology.loader import load_topology

    console = Console()
    t0 = time.time()
    topology = load_topology(topo)
    name = name or topology.name
    if state.exists(name):
        console.print(f"testbed [bold]{name}[/] is up already: using it")
    else:
        console.print(f"bringing up [bold]{name}[/] ({len(topology.workers)} workers, "
                      f"{len(topology.switches)} switches, {len(topology.links)} links) ...")
        lifecycle.up(topology, name)
        console.print(f"up in {time.time() - t0:.1f} s")
    cluster = cluster_from_state(name)
    cmd = [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", str(steps), "--batch-size", str(batch),
           "--log-every", str(max(1, steps // 4))]
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
            result = run(cluster, cmd, echo=echo, on_start=lambda rd: rd_box.__setitem__("rd", rd),
                         workdir=str(REPO), base_dir=str(REPO), timeout=600)
        finally:
            done.set()
            th.join(1)
        progress.update(task, completed=_count_steps(result.run_dir / "probe"))
    console.print(f"run finished with status {result.rc} in {time.time() - t_run:.1f} s")
    text, _a, plots = report(result.run_dir)
    console.print(text, highlight=False, markup=False)
    for p in plots:
        console.print(f"plot: {p}", highlight=False)
    console.print(f"\nThe testbed [bold]{name}[/] is still up.\n"
                  f"  attach to a worker:  testbed attach {cluster.workers[0]} --name {name}\n"
                  f"  run something:       testbed run --name {name} -- python examples/allreduce_bench.py\n"
                  f"  tear it down:        testbed down {name}   (or: make down)\n"
                  f"total {time.time() - t0:.1f} s")
    return result.rc


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.jobs.mainjob", description=__doc__.splitlines()[0])
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
