"""Four workers share one GPU and run an NCCL all_reduce across the emulated links.

Run on a machine with an NVIDIA GPU, as root:

    PYTHONPATH=. .venv/bin/python tests/gpu/check_nccl_shared_gpu.py      (or with pytest)

It brings up a star (4 workers, gpus: 1 each, one switch) with GPU sharing
allowed, so all four land on GPU 0; each worker runs one rank of
torch.distributed (backend nccl, NCCL_DEBUG=INFO) and all_reduces a tensor.
It passes when the sum is right and NCCL's log shows 4 nodes (not 4 local
ranks: the distinct NCCL_HOSTID per worker) and NET/Socket as the transport
(the bytes crossed our links, not SHM or P2P). Without a GPU, torch with CUDA
or root it says SKIP and exits 0 (pytest: skipped).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKERS = 4

RANK_CODE = r"""
import os, torch, torch.distributed as dist
dist.init_process_group("nccl", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
torch.cuda.set_device(0)
x = torch.full((1 << 20,), float(dist.get_rank() + 1), device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
print("RESULT", x[0].item(), torch.cuda.get_device_name(0), flush=True)
dist.destroy_process_group()
"""


def why_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    from testbed.runtime import gpu

    if not gpu.discover():
        return "no NVIDIA GPU (nvidia-smi finds none)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return "torch has no CUDA/NCCL here"
    return None


def star(name: str):
    from testbed.topology.model import Link, LinkProfile, Node, Topology

    nodes = {f"w{i}": Node(f"w{i}", "worker", gpus=1) for i in range(WORKERS)}
    nodes["s0"] = Node("s0", "switch")
    prof = LinkProfile(bandwidth_bps=10_000_000_000)
    links = [Link(f"w{i}", "s0", "edge", prof, prof) for i in range(WORKERS)]
    return Topology(name, nodes, links).validate()


def run_check() -> None:
    from testbed import lifecycle
    from testbed import node_exec
    from testbed.runtime import gpu
    from testbed.runtime.env import worker_env

    name = "gpu" + uuid.uuid4().hex[:6]
    topo = star(name)
    plan = gpu.plan_topology(topo, allow_sharing=True)
    assert len({g[0].uuid for g in plan.assignment.values()}) <= max(1, len(plan.devices))
    st = lifecycle.up(topo, name)
    try:
        ports = {lp["a"]["node"]: lp["a"]["ifname"] for lp in st["plan"]["links"]}
        ports.update({lp["b"]["node"]: lp["b"]["ifname"] for lp in st["plan"]["links"]})
        procs = []
        for i in range(WORKERS):
            w = f"w{i}"
            env = worker_env(name, w, [ports.get(w, "eth0")], gpu_env=plan.env(w))
            env.update(RANK=str(i), WORLD_SIZE=str(WORKERS), MASTER_ADDR="w0", MASTER_PORT="29511",
                       NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", PYTHONUNBUFFERED="1")
            # a single GPU shared by all: pin every worker to it
            env["CUDA_VISIBLE_DEVICES"] = plan.env(w)["CUDA_VISIBLE_DEVICES"]
            argv = node_exec.exec_argv(st, w, [sys.executable, "-c", RANK_CODE], env=env)
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outs.append((p.returncode, out))
    finally:
        lifecycle.down(name)
    expect = float(sum(range(1, WORKERS + 1)))
    text = "\n".join(o for _, o in outs)
    for i, (rc, out) in enumerate(outs):
        assert rc == 0, f"rank {i} failed ({rc}):\n{out[-4000:]}"
        m = re.search(r"RESULT (\S+)", out)
        assert m and float(m.group(1)) == expect, f"rank {i}: wrong result:\n{out[-2000:]}"
    assert re.search(r"nNodes %d\b" % WORKERS, text), "NCCL did not see 4 nodes:\n" + text[-4000:]
    assert "NET/Socket" in text, "NCCL did not use NET/Socket:\n" + text[-4000:]
    assert "Duplicate GPU" not in text
    print(f"OK: {WORKERS} workers on {len(plan.used)} GPU(s), all_reduce = {expect}, nNodes {WORKERS}, NET/Socket")


def test_nccl_shared_gpu():
    import pytest

    reason = why_skip()
    if reason:
        pytest.skip(reason)
    run_check()


if __name__ == "__main__":
    reason = why_skip()
    if reason:
        print(f"SKIP: {reason}")
        sys.exit(0)
    run_check()
