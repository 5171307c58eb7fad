#!/usr/bin/env python3
"""DDP training of a small CNN on synthetic data, launched the torchrun way.

A plain script that knows nothing of testbed: it reads RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment (torchrun or
`testbed run` set them), uses nccl when CUDA is present and gloo otherwise,
prints its loss, and at the end checks that every rank holds identical
parameters (exit status 3 if not).

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class TinyCNN(nn.Module):
    """About 5k parameters for 16x16 RGB images (width scales it)."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def synthetic_batch(gen: torch.Generator, teacher: torch.Tensor, batch: int, size: int, device):
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(1)  # a learnable labelling
    return x.to(device), y.to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    ap.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    t0 = time.time()
    dist.init_process_group(backend, rank=rank, world_size=world)
    if rank == 0:
        print(f"init {backend} world_size={world} in {time.time() - t0:.2f}s", flush=True)

    torch.manual_seed(0)
    model = TinyCNN(args.width).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(3 * args.image_size ** 2, 10, generator=torch.Generator().manual_seed(7))

    t_start = time.time()
    for step in range(1, args.steps + 1):
        x, y = synthetic_batch(gen, teacher, args.batch_size, args.image_size, device)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    elapsed = time.time() - t_start

    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).to(device)
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    identical = bool(torch.equal(hi, lo))
    checksum = float(flat.double().sum())
    print(f"rank {rank}: params={nparams} checksum={checksum:.10f} identical={identical}", flush=True)
    if rank == 0:
        sps = args.steps * args.batch_size * world / elapsed if elapsed > 0 else 0.0
        print(f"done: {args.steps} steps in {elapsed:.2f}s ({sps:.0f} samples/s); "
              f"parameters {'IDENTICAL' if identical else 'DIFFER'} on all {world} ranks", flush=True)
    dist.destroy_process_group()
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
