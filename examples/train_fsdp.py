#!/usr/bin/env python3
"""FSDP (fully_shard) training of an MLP on synthetic data: parameters sharded over the ranks.

Each step all-gathers every layer's parameters before its forward and backward
(all_gather_into_tensor) and reduce-scatters its gradients (reduce_scatter_tensor), the
traffic pattern of FSDP and ZeRO-3. A plain script: it reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT from the environment (torchrun or `testbed run` set
them) and uses gloo on CPU, nccl with CUDA.

    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 10
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    dims = [args.hidden] * (args.layers + 1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims, dims[1:])]).to(device)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    nparams = sum(p.numel() for p in model.parameters()) * world   # each rank holds a shard
    if rank == 0:
        print(f"fsdp: {args.layers} layers of {args.hidden}, {nparams} parameters over {world} ranks", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, args.hidden, generator=gen).to(device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step == 1 or step == args.steps):
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps in {time.time() - t0:.2f}s", flush=True)
    dist.barrier()   # every rank done before any tears gloo down (its teardown races otherwise)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
