"""A torchft replica group: data-parallel training that goes on when other replica groups fail.

Run it as the groups of a testbed run, beside a torchft lighthouse (see docs/fault-tolerance.md):

    testbed run --job examples/torchft.job.yaml

or by hand:

    testbed run --service "lighthouse=w0 torchft_lighthouse --min_replicas 1 --bind [::]:29510" \\
                --group "g0=w1 python examples/train_torchft.py" \\
                --group "g1=w2 python examples/train_torchft.py" \\
                -e TORCHFT_LIGHTHOUSE=http://{addr:lighthouse}:29510 --restarts 3

Each group is its own torch world (MASTER_ADDR/PORT, RANK, WORLD_SIZE come from the launcher); its
rank 0 hosts the group's TCPStore unless torchrun's agent already does. The replica id is the
group's name (TESTBED_GROUP). Groups agree on a quorum through the lighthouse every step; a group
that falls behind (restarted, or cut off by a partition) heals from a peer's checkpoint over HTTP.

What it prints for the report (testbed/report/quorum.py), from each group's rank 0:
    testbed-ft {"t": ..., "group": "g0", "step": 12, "quorum_id": 3, "participants": 2, "committed": true}
    testbed-ft {"t": ..., "group": "g0", "final": true, "step": 200, "digest": "<sha256 of the weights>"}

At the end every group's rank 0 leaves the digest of its weights in $TESTBED_JOB_DIR (a folder
every worker sees) and waits for every group's (--groups, TESTBED_GROUPS by default): it exits 1 if
they differ, 3 if not all came within --check-wait.

--hook torchft keeps torchft's own DDP comm hook, which crashes the survivor of a failure during
an allreduce in torchft 0.2.0 (`assert fut._fut`); the default hook reports the error to the
manager instead, so the step is not committed and the next quorum goes on without the lost group.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn, optim
from torch.distributed import TCPStore

from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

def say(**record) -> None:
    # the wall clock, real: under time dilation the probe slows time.time() (not clock_gettime), and
    # the report lays these lines beside the run's events, which are in real time
    print("testbed-ft " + json.dumps({"t": time.clock_gettime(time.CLOCK_REALTIME), **record}), flush=True)


class SafeDDP(DistributedDataParallel):
    """torchft's DDP with a comm hook that survives a failed allreduce: the error goes to the
    manager (the step is not committed) and the bucket comes back as it was."""

    @staticmethod
    def _comm_hook(state: Manager, bucket):
        try:
            work = state.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
        except Exception as exc:   # the quorum or the allreduce failed: this step is lost
            state.report_error(exc)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def same_weights(group: str, mine: str, groups: int, folder: str | None, wait_s: float) -> bool | None:
    """Each group's rank 0 leaves its weights' digest in `folder` (TESTBED_JOB_DIR: every worker
    sees it) and waits for every group's: True if all are equal, None if not all came within
    wait_s (a group never finished: nothing to compare with) or there is no folder.

    Out of band on purpose: a last collective would meet a group that is still training (one that
    rejoined late) in the same process group, and gloo aborts the process on a size mismatch."""
    if not folder or groups < 2:
        return None
    tmp = os.path.join(folder, f".digest-{group}.tmp")
    with open(tmp, "w") as f:
        f.write(mine)
    os.replace(tmp, os.path.join(folder, f"digest-{group}"))
    deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + wait_s
    while True:
        found = {}
        for n in os.listdir(folder):
            if n.startswith("digest-"):
                with open(os.path.join(folder, n)) as f:
                    found[n] = f.read()
        if len(found) >= groups:
            return len(set(found.values())) == 1
        if time.clock_gettime(time.CLOCK_MONOTONIC) > deadline:
            return None
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="committed steps to train")
    ap.add_argument("--step-time", type=float, default=0.05, help="seconds of pretend compute per step")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds an allreduce or commit may take")
    ap.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds a quorum may take (a group "
                    "cut off from the lighthouse waits this long before it fails)")
    ap.add_argument("--hook", choices=("safe", "torchft"), default="safe")
    ap.add_argument("--groups", type=int, default=int(os.environ.get("TESTBED_GROUPS") or 1),
                    help="replica groups that must end with the same weights (default: TESTBED_GROUPS)")
    ap.add_argument("--check-wait", type=float, default=120.0, help="seconds to wait for every group "
                    "in the final weight check")
    ap.add_argument("--check-dir", default=os.environ.get("TESTBED_JOB_DIR"),
                    help="a folder every group sees, for the weight check (default: TESTBED_JOB_DIR)")
    args = ap.parse_args()

    group = os.environ.get("TESTBED_GROUP") or os.environ.get("REPLICA_GROUP_ID", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        print("train_torchft: set TORCHFT_LIGHTHOUSE (e.g. -e TORCHFT_LIGHTHOUSE=http://{addr:lighthouse}:29510)",
              file=sys.stderr)
        return 2
    store = None
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store = TCPStore(addr, port, is_master=True, wait_for_workers=False)   # this group's store

    torch.manual_seed(0)   # every group starts from the same weights (init_sync makes sure anyway)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    inner = optim.SGD(model.parameters(), lr=0.01)

    def load_state(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=load_state,
                      state_dict=state, replica_id=group, timeout=timeout,
                      quorum_timeout=timedelta(seconds=args.quorum_timeout),
                      hostname=os.environ.get("TESTBED_ADDR", addr), store_addr=addr, store_port=port,
                      rank=rank, world_size=world)
    ddp = (SafeDDP if args.hook == "safe" else DistributedDataParallel)(manager, model)
    opt = OptimizerWrapper(manager, inner)
    loss_fn = nn.MSELoss()
    gen = torch.Generator().manual_seed(1000 + rank)   # a group's ranks see different data, groups the same
    print(f"train_torchft: group {group} rank {rank}/{world}, store {addr}:{port}, "
          f"lighthouse {os.environ['TORCHFT_LIGHTHOUSE']}", flush=True)

    while manager.current_step() < args.steps:
        x = torch.randn(args.batch, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()                  # starts this step's quorum
        loss = loss_fn(ddp(x), y)
        loss.backward()                  # the gradients' allreduce across the groups in the quorum
        time.sleep(args.step_time)
        before = manager.current_step()
        opt.step()                       # commits only if every group's allreduce went through
        if rank == 0:
            say(group=group, step=manager.current_step(), quorum_id=getattr(manager, "_quorum_id", None),
                participants=manager.num_participants(), committed=manager.current_step() > before,
                loss=round(loss.item(), 6))

    trained, mine = manager.current_step(), digest(model)
    manager.shutdown(wait=False)
    ok = same_weights(group, mine, args.groups, args.check_dir, args.check_wait) if rank == 0 else None
    if rank == 0:
        say(group=group, final=True, step=trained, digest=mine, same_weights=ok)
    del store
    if ok is False:
        print(f"train_torchft: group {group} ends with weights unlike its peers'", file=sys.stderr, flush=True)
        return 1
    if ok is None and rank == 0 and args.check_dir and args.groups > 1:
        print(f"train_torchft: group {group} could not compare its weights with all {args.groups} groups "
              f"within {args.check_wait:g}s", file=sys.stderr, flush=True)
        return 3
    print(f"train_torchft: group {group} done at step {trained}"
          + (", same weights as the other groups" if ok else ", weights not compared"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
