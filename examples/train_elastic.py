"""Elastic data-parallel training under torchrun: survives a node that crashes and comes back.

    testbed run -e TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 -- torchrun --nnodes=2:3 --max-restarts=3 \\
        --rdzv-conf=last_call_timeout=2 examples/train_elastic.py --steps 300

(see docs/fault-tolerance.md; the variable works around a torch 2.13 hang when a node joins a
running job). When a node crashes, the surviving ranks' next collective fails,
their torchrun agents stop them, meet again at the rendezvous without the lost node (at least MIN
nodes) and start them again: this script then resumes from the last checkpoint. When the node is
up again, `testbed run` starts its agent again; the running agents see a node waiting, and the
job re-forms with it.

The checkpoint (model, optimizer, step) is written by rank 0 every --every steps into
$TESTBED_JOB_DIR (a folder every worker sees during the run; --checkpoint to choose another),
written to a temporary name and renamed, so a crash never leaves half a file.

Prints, from rank 0: `elastic: step N world W restart R` every --log-every steps and at each
(re)start, then at the end `elastic: done step N checksum C identical=True|False` (every rank's
weights compared through an all_gather). Exits 1 if the ranks' weights differ.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def checksum(model: nn.Module) -> float:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return float(int(h.hexdigest()[:12], 16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-time", type=float, default=0.05, help="seconds of pretend compute per step")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may take")
    args = ap.parse_args()

    ckpt = args.checkpoint or os.path.join(os.environ.get("TESTBED_JOB_DIR", "."), "elastic.pt")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if os.path.exists(ckpt):   # every rank loads the same file: the job goes on where it was saved
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])
    ddp = DDP(model)
    loss_fn = nn.MSELoss()
    if rank == 0:
        print(f"elastic: step {step} world {world} restart {restart} (started)", flush=True)

    while step < args.steps:
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()   # the gradients' all_reduce
        time.sleep(args.step_time)
        opt.step()
        step += 1
        if rank == 0 and step % args.every == 0:
            tmp = f"{ckpt}.tmp"
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        if rank == 0 and step % args.log_every == 0:
            print(f"elastic: step {step} world {world} restart {restart}", flush=True)

    mine = torch.tensor([checksum(model)], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    same = all(t.item() == mine.item() for t in every)
    if rank == 0:
        print(f"elastic: done step {step} world {world} checksum {mine.item():.0f} identical={same}", flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
