#!/usr/bin/env python3
"""DDP training of a small CNN (or an MLP with tens of MiB of gradients) on synthetic data, the torchrun way.

A plain script that knows nothing of testbed: it reads RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the environment (torchrun or
`testbed run` set them), uses nccl when CUDA is present and gloo otherwise,
prints its loss, and at the end checks that every rank holds identical
parameters (exit status 3 if not; --no-check skips it: with `testbed run
--real`, phantom ranks contribute zeros to large gradients, so the ranks'
parameters differ by design).

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class MLP(nn.Module):
    """A multi-layer perceptron on flattened images: `layers` hidden layers of `hidden` units."""

    def __init__(self, in_features: int, hidden: int = 1536, layers: int = 3, classes: int = 10):
        super().__init__()
        sizes = [in_features] + [hidden] * layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.out = nn.Linear(sizes[-1], classes)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


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
    ap.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                    help="cnn: ~5k parameters (width scales it); mlp: --layers x --hidden, tens of MiB")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--bucket-cap-mb", type=int, default=None, help="DDP's bucket size (default: DDP's 25 MiB)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the final check that every rank holds identical parameters")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--step-cpu", action="store_true",
                    help="rank 0 prints the median CPU time of a step (all of this process's threads)")
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
    if args.model == "mlp":
        model = MLP(3 * args.image_size ** 2, args.hidden, args.layers).to(device)
    else:
        model = TinyCNN(args.width).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model {args.model}: {nparams} parameters ({nparams * 4 / 2 ** 20:.1f} MiB of gradients)", flush=True)
    ddp = DDP(model, device_ids=[device.index] if use_cuda else None, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(3 * args.image_size ** 2, 10, generator=torch.Generator().manual_seed(7))

    t_start = time.time()
    step_cpu = []
    for step in range(1, args.steps + 1):
        c0 = time.process_time()   # (CPU time: no clock a probe or a busy machine bends)
        x, y = synthetic_batch(gen, teacher, args.batch_size, args.image_size, device)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_cpu.append(time.process_time() - c0)
        if rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    elapsed = time.time() - t_start
    if args.step_cpu and rank == 0:
        print(f"step cpu: median {1e3 * statistics.median(step_cpu):.3f} ms over {len(step_cpu)} steps", flush=True)

    if args.no_check:
        if rank == 0:
            sps = args.steps * args.batch_size * world / elapsed if elapsed > 0 else 0.0
            print(f"done: {args.steps} steps in {elapsed:.2f}s ({sps:.0f} samples/s); parameters not compared",
                  flush=True)
        dist.barrier()   # every rank done before any tears gloo down (its teardown races otherwise)
        dist.destroy_process_group()
        return 0
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
    dist.barrier()   # every rank done before any tears gloo down (its teardown races otherwise)
    dist.destroy_process_group()
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
