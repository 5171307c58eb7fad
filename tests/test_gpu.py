"""GPU discovery, assignment and worker environment, against fake device lists (no GPU needed)."""

from __future__ import annotations

import subprocess

import pytest

from testbed.runtime import gpu
from testbed.runtime.env import worker_env
from testbed.runtime.gpu import Gpu, GpuError, GpuPlan

QUERY = """0, GPU-aaaa1111-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559, 00000000:18:00.0
1, GPU-bbbb2222-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559, 00000000:2A:00.0
"""
LIST = """GPU 0: NVIDIA H200 (UUID: GPU-1111)
  MIG 1g.18gb     Device  0: (UUID: MIG-xxxx)
GPU 1: NVIDIA H200 (UUID: GPU-2222)
"""


def devs(n: int, mem: int | None = 80000) -> list[Gpu]:
    return [Gpu(index=i, uuid=f"GPU-{i:04d}", name="Fake", memory_mib=mem) for i in range(n)]


def test_parse_query_and_list():
    g = gpu.parse_query(QUERY)
    assert [x.index for x in g] == [0, 1]
    assert g[1].uuid.startswith("GPU-bbbb") and g[1].memory_mib == 81559 and g[1].pci_bus_id == "00000000:2A:00.0"
    l = gpu.parse_list(LIST)
    assert [(x.index, x.uuid, x.name) for x in l] == [(0, "GPU-1111", "NVIDIA H200"), (1, "GPU-2222", "NVIDIA H200")]
    assert gpu.parse_query("") == [] and gpu.parse_list("No devices were found") == []


def test_discover_with_a_fake_nvidia_smi():
    def run(argv, **kw):
        if "-L" in argv:
            return subprocess.CompletedProcess(argv, 0, LIST, "")
        return subprocess.CompletedProcess(argv, 0, QUERY, "")

    assert len(gpu.discover(run=run, environ={})) == 2
    # the host's CUDA_VISIBLE_DEVICES restricts (and orders) what the testbed may use
    only = gpu.discover(run=run, environ={"CUDA_VISIBLE_DEVICES": "1"})
    assert [x.index for x in only] == [1]
    by_uuid = gpu.discover(run=run, environ={"CUDA_VISIBLE_DEVICES": "GPU-bbbb2222,GPU-aaaa1111"})
    assert [x.index for x in by_uuid] == [1, 0]

    def failing(argv, **kw):
        raise FileNotFoundError(argv[0])

    assert gpu.discover(run=failing, environ={}) == []

    def list_only(argv, **kw):
        return subprocess.CompletedProcess(argv, 0 if "-L" in argv else 9, LIST if "-L" in argv else "", "")

    assert [x.uuid for x in gpu.discover(run=list_only, environ={})] == ["GPU-1111", "GPU-2222"]


def test_exclusive_when_enough():
    a = gpu.assign({"w0": 1, "w1": 2, "w2": 0}, devs(4))
    assert [g.index for g in a["w0"]] == [0] and [g.index for g in a["w1"]] == [1, 2] and a["w2"] == []
    for policy in gpu.POLICIES:
        a = gpu.assign({f"w{i}": 1 for i in range(4)}, devs(4), policy)
        assert sorted(a[w][0].index for w in a) == [0, 1, 2, 3]


def test_oversubscription_refused_without_sharing():
    with pytest.raises(GpuError, match="--allow-gpu-sharing"):
        gpu.assign({f"w{i}": 1 for i in range(4)}, devs(1))
    with pytest.raises(GpuError, match="no NVIDIA GPU"):
        gpu.assign({"w0": 1}, [], allow_sharing=True)
    with pytest.raises(GpuError, match="asks for 3 GPUs"):
        gpu.assign({"w0": 3}, devs(2), allow_sharing=True)
    assert gpu.assign({"w0": 0}, []) == {"w0": []}
    assert GpuError.exit_code == 3


def test_round_robin_and_packed_sharing():
    req = {f"w{i}": 1 for i in range(6)}
    rr = gpu.assign(req, devs(2), "round-robin", allow_sharing=True)
    assert [rr[f"w{i}"][0].index for i in range(6)] == [0, 1, 0, 1, 0, 1]
    pk = gpu.assign(req, devs(2), "packed", allow_sharing=True)
    assert [pk[f"w{i}"][0].index for i in range(6)] == [0, 0, 0, 1, 1, 1]
    # many workers, one GPU: everyone shares it
    one = gpu.assign({f"w{i}": 1 for i in range(16)}, devs(1), allow_sharing=True)
    assert {one[w][0].index for w in one} == {0}
    # multi-GPU workers always get distinct devices, under both policies
    for policy in gpu.POLICIES:
        a = gpu.assign({"a": 2, "b": 2, "c": 2}, devs(3), policy, allow_sharing=True)
        for w, gs in a.items():
            assert len({g.uuid for g in gs}) == 2, (policy, w, gs)
        load = gpu.sharers(a)
        assert sum(len(v) for v in load.values()) == 6
        if policy == "round-robin":
            assert sorted(len(v) for v in load.values()) == [2, 2, 2]


def test_plan_env_and_mps_limits():
    p = gpu.plan({"w0": 1, "w1": 1, "w2": 1, "w3": 1, "cpu": 0}, sharing="mps", devices=devs(1, mem=80000))
    assert p.mps and p.oversubscribed
    mps_rec = {"pipe_dir": "/run/testbed/x/mps/pipe", "log_dir": "/run/testbed/x/mps/log"}
    e = p.env("w2", mps_rec)
    assert e["CUDA_VISIBLE_DEVICES"] == "GPU-0000"
    assert e["CUDA_MPS_PIPE_DIRECTORY"] == "/run/testbed/x/mps/pipe"
    assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert e["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20000M"
    assert p.env("cpu", mps_rec)["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_MPS_PIPE_DIRECTORY" not in p.env("cpu", mps_rec)
    # JSON round trip (the state file keeps the plan)
    q = GpuPlan.from_json(p.to_json())
    assert q.env("w2", mps_rec) == e
    assert p.summary() == ["GPU 0 Fake (GPU-0000): w0 w1 w2 w3"]
    # without MPS: time-slicing, no MPS variables; planning a CPU topology never calls nvidia-smi
    t = gpu.plan({"w0": 1, "w1": 1}, allow_sharing=True, devices=devs(1))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in t.env("w0")
    assert gpu.plan({"w0": 0}).devices == []


def test_mps_limits_multi_gpu_worker():
    d = devs(2, mem=1000)
    share = {"GPU-0000": ["a", "b"], "GPU-0001": ["a", "b", "c", "d"]}
    e = gpu.mps_limits(d, share)
    assert e == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=500M,1=250M"}


def test_worker_env_for_nccl_and_gloo():
    p = gpu.plan({"w0": 1, "w1": 1}, allow_sharing=True, devices=devs(1))
    e0 = worker_env("tb", "w0", ["eth0", "eth1"], cpus=2.5, gpu_env=p.env("w0"))
    e1 = worker_env("tb", "w1", ["eth0"], gpu_env=p.env("w1"))
    assert e0["NCCL_SOCKET_IFNAME"] == "=eth0,eth1" and e0["GLOO_SOCKET_IFNAME"] == "eth0"
    assert e0["NCCL_IB_DISABLE"] == "1"
    assert e0["NCCL_HOSTID"] != e1["NCCL_HOSTID"]
    assert e0["CUDA_VISIBLE_DEVICES"] == e1["CUDA_VISIBLE_DEVICES"] == "GPU-0000"
    assert e0["OMP_NUM_THREADS"] == "2" and "OMP_NUM_THREADS" not in e1
    assert e0["TESTBED_NODE"] == "w0" and e0["TESTBED_LOG_DIR"].endswith("/tb/logs/w0")
    assert worker_env("tb", "w9", ["eth0"])["CUDA_VISIBLE_DEVICES"] == ""


def test_plan_topology_uses_policy_and_sharing():
    from testbed.topology.model import Link, LinkProfile, Node, Topology

    nodes = {f"w{i}": Node(f"w{i}", "worker", gpus=1) for i in range(4)}
    nodes["s"] = Node("s", "switch")
    links = [Link(f"w{i}", "s", "edge", LinkProfile(), LinkProfile()) for i in range(4)]
    topo = Topology("t", nodes, links, gpu_policy="packed")
    with pytest.raises(GpuError):
        gpu.plan_topology(topo, devices=devs(2))
    p = gpu.plan_topology(topo, allow_sharing=True, devices=devs(2))
    assert [p.assignment[f"w{i}"][0].index for i in range(4)] == [0, 0, 1, 1]
    topo.gpu_sharing = "mps"
    assert gpu.plan_topology(topo, devices=devs(2)).mps
