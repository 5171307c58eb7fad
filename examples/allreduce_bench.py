#!/usr/bin/env python3
"""An nccl-tests-like all_reduce sweep: time per message size, algbw and busbw.

Launched the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). For
each size (bytes, float32 elements) it runs --warmup untimed and --iters
timed all_reduces and reports, like nccl-tests' all_reduce_perf:
  algbw = S / t          busbw = algbw * 2(n-1)/n
Sizes: --min-bytes to --max-bytes, times --factor each step.

    torchrun --nproc-per-node 4 examples/allreduce_bench.py --max-bytes 64M
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", default="1K")
    ap.add_argument("--max-bytes", default="16M")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--json", default=None, help="also write the results here (rank 0)")
    args = ap.parse_args()

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world)

    sizes, size = [], max(4, parse_size(args.min_bytes))
    while size <= parse_size(args.max_bytes):
        sizes.append(size)
        size *= args.factor
    bus = 2 * (world - 1) / world if world > 1 else 1.0
    if rank == 0:
        print(f"# all_reduce sum float32, {backend}, {world} ranks, {args.iters} iters, {args.warmup} warmup")
        print(f"# {'size(B)':>12} {'count':>11} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
              f" {'busbw(Gbit/s)':>14}", flush=True)
    results = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(t)
        dist.barrier()
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(t)
        if use_cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.iters
        # the slowest rank defines the time, as in nccl-tests
        dtt = torch.tensor([dt], dtype=torch.float64, device=device)
        dist.all_reduce(dtt, op=dist.ReduceOp.MAX)
        dt = float(dtt)
        algbw = nbytes / dt
        row = {"bytes": nbytes, "count": nbytes // 4, "time_s": dt, "algbw_Bps": algbw, "busbw_Bps": algbw * bus}
        results.append(row)
        if rank == 0:
            print(f"  {nbytes:>12} {nbytes // 4:>11} {dt * 1e6:>12.1f} {algbw / 1e9:>12.4f} "
                  f"{algbw * bus / 1e9:>12.4f} {algbw * bus * 8 / 1e9:>14.4f}", flush=True)
    if rank == 0:
        print(f"# avg busbw (largest size): {results[-1]['busbw_Bps'] * 8 / 1e9:.4f} Gbit/s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "backend": backend, "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
