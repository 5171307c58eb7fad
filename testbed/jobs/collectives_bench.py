#!/usr/bin/env python3
"""An nccl-tests-like sweep of torch.distributed collectives: time per message size, algbw, busbw.

A plain script (stdlib and torch only; it imports nothing of testbed), shipped
with testbed so that every worker has it: the calibration and `make fidelity`
run it, and so can you:

    testbed run -- python -m testbed.jobs.collectives_bench --ops all --sizes 1K,1M,16M
    torchrun --nproc-per-node 4 -m testbed.jobs.collectives_bench --ops all_reduce,all_gather

Launched the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). For
each collective and size it runs --warmup untimed calls, then back-to-back
timed calls, and reports the slowest rank's time per call, as nccl-tests does:
  algbw = S / t          busbw = algbw x (2(n-1)/n all_reduce; (n-1)/n all_gather,
                                          reduce_scatter, all_to_all; 1 otherwise)
S is nccl-tests' size: all_gather's output, reduce_scatter's input, the whole
buffer of all_to_all; send_recv sends S from rank 0 to rank 1 (other ranks idle).
The number of timed calls adapts so that each size takes about --budget
seconds (at least --min-iters, at most --max-iters); --repeat R measures each
size R times (JSON: every repetition in "times_s", their median in "time_s").
--pin-cpu puts rank r on the r-th CPU this process may use (all its threads), so that
every rank has a core of its own, as the calibration measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n}.get(op, 1.0)


def make_call(op: str, nbytes: int, rank: int, n: int, device):
    """A no-argument function that runs one collective of S = nbytes (rounded to whole float32s per rank)."""
    per = max(1, nbytes // 4 // n)          # elements per rank's share
    whole = per * n
    if op == "all_reduce":
        t = torch.ones(max(1, nbytes // 4), device=device)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.ones(max(1, nbytes // 4), device=device)
        return lambda: dist.broadcast(t, 0)
    if op == "all_gather":
        inp, out = torch.ones(per, device=device), torch.empty(whole, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
        return lambda: gather(out, inp)
    if op == "reduce_scatter":
        inp, out = torch.ones(whole, device=device), torch.empty(per, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if op == "all_to_all":
        inp, out = torch.ones(whole, device=device), torch.empty(whole, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "send_recv":
        t = torch.ones(max(1, nbytes // 4), device=device)
        if rank == 0:
            return lambda: dist.send(t, 1)
        if rank == 1:
            return lambda: dist.recv(t, 0)
        return lambda: None
    raise SystemExit(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def pin_to_own_cpu(rank: int) -> int:
    """Run every thread of this process on one CPU, the rank-th of those it may use (mod their number)."""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, ValueError):
            pass   # a thread that ended meanwhile
    return cpu


def slowest(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="all_reduce", help=f"comma list or 'all': {', '.join(OPS)}")
    ap.add_argument("--sizes", default="1K,64K,1M,16M", help="comma list of sizes (K, M, G suffixes)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=50)
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per size (of this process's clock)")
    ap.add_argument("--repeat", type=int, default=1, help="measure each size this many times")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--json", default=None, help="rank 0 writes the results here")
    ap.add_argument("--pin-cpu", action="store_true",
                    help="rank r runs on the r-th CPU this process may use: a core of its own per rank")
    args = ap.parse_args()

    rank, n = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.pin_cpu:
        pin_to_own_cpu(rank)
    use_cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=n)
    ops = OPS if args.ops == "all" else tuple(o.strip() for o in args.ops.split(",") if o.strip())
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    if rank == 0:
        print(f"# {backend}, {n} ranks; time per call of the slowest rank", flush=True)
        print(f"# {'collective':>14} {'size(B)':>12} {'iters':>6} {'time(us)':>12} {'algbw(GB/s)':>12} "
              f"{'busbw(Gbit/s)':>14}", flush=True)
    results = []
    for op in ops:
        if op == "send_recv" and n < 2:
            continue
        for nbytes in sizes:
            call = make_call(op, nbytes, rank, n, device)
            t0 = time.perf_counter()
            for _ in range(max(1, args.warmup)):
                call()
            sync()
            warm = slowest((time.perf_counter() - t0) / max(1, args.warmup), device)
            iters = int(min(args.max_iters, max(args.min_iters, math.ceil(args.budget / max(warm, 1e-9)))))
            times = []
            for _ in range(max(1, args.repeat)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                sync()
                times.append(slowest((time.perf_counter() - t0) / iters, device))
            dt = sorted(times)[len(times) // 2]
            algbw = nbytes / dt
            row = {"op": op, "bytes": nbytes, "iters": iters, "time_s": dt, "times_s": times, "algbw_Bps": algbw,
                   "busbw_Bps": algbw * bus_factor(op, n)}
            results.append(row)
            if rank == 0:
                print(f"  {op:>14} {nbytes:>12} {iters:>6} {dt * 1e6:>12.1f} {algbw / 1e9:>12.4f} "
                      f"{row['busbw_Bps'] * 8 / 1e9:>14.4f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump({"world_size": n, "backend": backend, "results": results}, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
