"""Phantom ranks of NCCL jobs (TESTBED_PHANTOM_NCCL=1, experimental): what can be checked without a GPU.

The gate and its refusals on both sides (the real rank's mirror, the phantom), that the gloo path
announces exactly what it did before with the variable set, and the pieces of the NCCL path that
run on the CPU. The NCCL run itself: tests/gpu/check_phantoms_nccl.py, on a GPU machine.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "testbed" / "jobs" / "probe"


def _mirror_module():
    """The mirror as the ranks load it (a top-level module beside the probe), without installing it."""
    spec = importlib.util.spec_from_file_location("_testbed_mirror_under_test", PROBE / "_testbed_mirror.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_")}
    env.update(PYTHONPATH=f"{PROBE}{os.pathsep}{REPO}", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", **extra)
    return env


def _job(code: str, trace: Path, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    """Run `code` with the mirror installed as the probe installs it, recording its announcements in `trace`."""
    head = "import torch, _testbed_mirror\n_testbed_mirror.install(torch)\nimport torch.distributed as dist\n"
    return subprocess.run([sys.executable, "-c", head + code], env=_env(TESTBED_OPS_TRACE=str(trace), **extra),
                          capture_output=True, text=True, timeout=timeout)


def _lines(trace: Path) -> list[dict]:
    return [json.loads(x) for x in trace.read_text().splitlines()]


# -- the real rank's side ------------------------------------------------------------------------------------

def test_the_backend_gate():
    m = _mirror_module()
    for b in (None, "gloo", "GLOO", "cpu:gloo"):
        assert m.job_backend(b, {}) == "gloo" and m.job_backend(b, {"TESTBED_PHANTOM_NCCL": "1"}) == "gloo"
    assert m.job_backend("nccl", {"TESTBED_PHANTOM_NCCL": "1"}) == "nccl"
    assert m.job_backend("cuda:nccl", {"TESTBED_PHANTOM_NCCL": "1"}) == "nccl"
    for b, env in (("nccl", {}), ("nccl", {"TESTBED_PHANTOM_NCCL": "0"}), ("mpi", {"TESTBED_PHANTOM_NCCL": "1"}),
                   ("cpu:gloo,cuda:nccl", {"TESTBED_PHANTOM_NCCL": "1"})):
        with pytest.raises(RuntimeError, match="mirror gloo jobs only") as e:
            m.job_backend(b, env)
        assert "TESTBED_PHANTOM_NCCL=1" in str(e.value) and "tests/gpu/check_phantoms_nccl.py" in str(e.value)


def test_an_nccl_jobs_side_groups_keep_their_backend():
    m = _mirror_module()
    assert m._new_group_backend(None) == (m.BACKEND_NCCL, "nccl")   # the default group's
    assert m._new_group_backend("nccl") == (m.BACKEND_NCCL, "nccl")
    assert m._new_group_backend("gloo") == (m.BACKEND, "gloo")
    assert m._new_group_backend(m.BACKEND) == (m.BACKEND, "gloo")
    with pytest.raises(RuntimeError, match="cannot be mirrored"):
        m._new_group_backend("mpi")


INIT_NCCL = ("import datetime\n"
             "try:\n"
             "    dist.init_process_group('nccl', rank=0, world_size=2, timeout=datetime.timedelta(seconds=30))\n"
             "except RuntimeError as exc:\n"
             "    print('REFUSED', exc)\n")


def test_nccl_is_refused_without_the_variable(tmp_path):
    res = _job(INIT_NCCL, tmp_path / "ops.jsonl")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "REFUSED testbed phantoms mirror gloo jobs only (this job asked for backend 'nccl')" in out, out
    assert "An unverified path for backend 'nccl' exists behind TESTBED_PHANTOM_NCCL=1" in out
    assert "tests/gpu/check_phantoms_nccl.py checks it on a GPU machine" in out
    assert [x["ev"] for x in _lines(tmp_path / "ops.jsonl")] == ["end"]   # no init: no phantom waits


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the refusal is for one without")
def test_the_variable_without_cuda_is_a_clear_error_before_the_rendezvous(tmp_path):
    """World size 2 and no peer: an init that got as far as the rendezvous would wait there until the
    30 s timeout; the refusal comes at once, and the phantoms are told nothing but the end."""
    t0 = time.monotonic()
    res = _job(INIT_NCCL, tmp_path / "ops.jsonl", TESTBED_PHANTOM_NCCL="1")
    assert time.monotonic() - t0 < 25
    assert res.returncode == 0, res.stderr[-2000:]
    assert "REFUSED testbed phantoms: TESTBED_PHANTOM_NCCL=1 and backend 'nccl', but this rank's torch" in res.stdout
    assert "sees no CUDA device" in res.stdout or "has no NCCL" in res.stdout, res.stdout
    assert [x["ev"] for x in _lines(tmp_path / "ops.jsonl")] == ["end"]


GLOO_JOB = ("dist.init_process_group('gloo', rank=0, world_size=1)\n"
            "dist.all_reduce(torch.ones(10))\n"
            "g = dist.new_group([0])\n"
            "dist.broadcast(torch.arange(5), 0, group=g)\n"
            "dist.all_gather_into_tensor(torch.zeros(100000), torch.ones(100000))\n"
            "dist.barrier()\n"
            "print('BACKENDS', dist.get_backend(), dist.get_backend(g))\n"
            "dist.destroy_process_group()\n")


def test_the_gloo_path_announces_the_same_with_the_variable_set(tmp_path):
    """The same gloo job with and without TESTBED_PHANTOM_NCCL=1 announces the same lines (times
    aside): the NCCL path leaves gloo jobs as they were."""
    runs = []
    for i, extra in enumerate(({}, {"TESTBED_PHANTOM_NCCL": "1"})):
        trace = tmp_path / f"ops-{i}.jsonl"
        res = _job(GLOO_JOB, trace, RANK="0", WORLD_SIZE="1", **extra)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "BACKENDS gloo gloo" in res.stdout
        runs.append([{k: v for k, v in x.items() if k != "t"} for x in _lines(trace)])
    assert runs[0] == runs[1]
    assert [x.get("op", x["ev"]) for x in runs[0]] == ["init", "allreduce", "new_group", "broadcast",
                                                       "allgather_single", "barrier", "end"]
    assert runs[0][0]["backend"] == "gloo" and "backend" not in runs[0][2]


def test_the_nccl_group_looks_like_an_nccl_group_to_c10d():
    """NcclMirrorGroup answers c10d's Python questions as an NCCL group does (here around a gloo
    backend, as this machine has no NCCL): object collectives would stage their bytes on the GPU."""
    import datetime

    import torch
    import torch.distributed as dist

    m = _mirror_module()
    Mirror = m._make_group_class(dist, m.groups.wrapped_class(dist))
    Nccl = m._make_nccl_group_class(torch, Mirror)
    inner = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    g = Nccl(inner, 3)
    assert g._device_types == [torch.device("cuda")]
    assert g._get_backend(torch.device("cuda")) is inner and g._get_backend("cuda:0") is inner
    with pytest.raises(RuntimeError, match="no backend for cpu"):
        g._get_backend(torch.device("cpu"))
    assert g._get_backend_name() == m.BACKEND_NCCL and g.gid == 3   # through c10d's C++ side
    assert dist.distributed_c10d._get_object_coll_device(g) == "cuda"
    plain = Mirror(inner, 0)   # the gloo path's group: no device types of its own, as before
    assert plain._device_types == [] and dist.distributed_c10d._get_object_coll_device(plain) == "cpu"


NCCL_THROUGH_C10D = """
import datetime
# No NCCL here: ProcessGroupNCCL is stood in for by gloo, so that what c10d does with the
# mirror's NCCL backend (its registration, creator, groups, announcements) runs on the CPU.
class Options:
    pass
def FakeNccl(store, rank, size, options):
    FakeNccl.made.append(options)
    return dist.ProcessGroupGloo(store, rank, size, options._timeout)
FakeNccl.Options, FakeNccl.made = Options, []
dist.ProcessGroupNCCL = FakeNccl
_testbed_mirror.require_cuda = lambda torch: None
dist.init_process_group(rank=0, world_size=1, device_id=torch.device("cuda", 0))
dist.all_reduce(torch.ones(10))
side = dist.new_group([0], None, "gloo")
sub = dist.new_group([0], device_id=torch.device("cuda", 0))
dist.all_reduce(torch.ones(3), group=sub)
dist.broadcast(torch.ones(2), 0, group=side)
print("BACKENDS", dist.get_backend(), dist.get_backend(side), dist.get_backend(sub))
print("DEVICES", dist.distributed_c10d._get_object_coll_device(), dist.distributed_c10d._get_object_coll_device(side))
print("OPTIONS", [(o.group_name, o.global_ranks_in_group, o.is_high_priority_stream) for o in FakeNccl.made])
dist.destroy_process_group()
"""


def test_an_nccl_job_goes_through_c10d_as_the_mirrors_nccl_backend(tmp_path):
    """init_process_group with a CUDA device_id (nccl, as c10d picks it) and new_group, through
    c10d's plugin path with the NCCL process group stood in for: the default group and a subgroup
    are NcclMirrorGroups created with c10d's options and connected lazily (no device_id reaches
    c10d), a gloo side group stays gloo, and every group's backend is announced for the phantoms."""
    trace = tmp_path / "ops.jsonl"
    res = _job(NCCL_THROUGH_C10D, trace, RANK="0", WORLD_SIZE="1", TESTBED_PHANTOM_NCCL="1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "BACKENDS nccl gloo nccl" in res.stdout, res.stdout
    assert "DEVICES cuda cpu" in res.stdout, res.stdout
    made = ast.literal_eval(res.stdout.split("OPTIONS ", 1)[1].splitlines()[0])
    assert [(m[1], m[2]) for m in made] == [([], False), ([0], False)] and len({m[0] for m in made}) == 2
    lines = [{k: v for k, v in x.items() if k not in ("t", "data")} for x in _lines(trace)]
    assert lines == [
        {"ev": "init", "backend": "nccl", "world": 1, "rank": 0},
        {"ev": "op", "op": "allreduce", "g": 0, "dtype": "float32", "n": [10], "red": "SUM"},
        {"ev": "new_group", "g": 1, "ranks": [0], "backend": "gloo"},
        {"ev": "new_group", "g": 2, "ranks": [0], "backend": "nccl"},
        {"ev": "op", "op": "allreduce", "g": 2, "dtype": "float32", "n": [3], "red": "SUM"},
        {"ev": "op", "op": "broadcast", "g": 1, "dtype": "float32", "n": [2], "root": 0, "root_tensor": 0},
        {"ev": "end"}], lines


# -- the phantom's side --------------------------------------------------------------------------------------

def test_a_phantom_takes_its_workers_gpu_by_local_rank():
    from testbed.jobs.phantom import PhantomError, cuda_index

    assert cuda_index({}, 1) == 0
    assert cuda_index({"LOCAL_RANK": "0"}, 4) == 0
    assert cuda_index({"LOCAL_RANK": "3"}, 4) == 3
    assert cuda_index({"LOCAL_RANK": "5"}, 2) == 1   # more local ranks than GPUs: shared, as torchrun scripts do
    with pytest.raises(PhantomError, match="sees no CUDA device.*CUDA_VISIBLE_DEVICES=''"):
        cuda_index({"CUDA_VISIBLE_DEVICES": ""}, 0)


def test_a_phantom_joins_nccl_only_behind_the_variable():
    import torch

    from testbed.jobs.phantom import PhantomError, join_backend

    assert join_backend({"backend": "gloo"}, torch, {"TESTBED_PHANTOM_NCCL": "1"}) == ("gloo", None)
    with pytest.raises(PhantomError, match="phantoms mirror gloo jobs only"):
        join_backend({"backend": "mpi"}, torch, {"TESTBED_PHANTOM_NCCL": "1"})
    with pytest.raises(PhantomError, match="only with TESTBED_PHANTOM_NCCL=1"):
        join_backend({"backend": "nccl"}, torch, {})
    if not torch.cuda.is_available():
        with pytest.raises(PhantomError, match="has no NCCL|sees no CUDA device"):
            join_backend({"backend": "nccl"}, torch, {"TESTBED_PHANTOM_NCCL": "1"})


def _phantom(tmp_path: Path, lines: list[dict], **extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The phantom module, alone (world size 1), fed `lines` on its FIFO; its result and stats."""
    fifo, stats = tmp_path / "rank-0.fifo", tmp_path / "stats.json"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)
    try:
        os.write(fd, b"".join(json.dumps(x).encode() + b"\n" for x in lines))
        env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", TESTBED_PHANTOM_IN=str(fifo),
                   TESTBED_PHANTOM_STATS=str(stats), **extra)
        res = subprocess.run([sys.executable, "-m", "testbed.jobs.phantom"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    return res, json.loads(stats.read_text())


def test_a_phantom_told_of_an_nccl_job_without_cuda_fails_at_once(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    t0 = time.monotonic()
    res, stats = _phantom(tmp_path, [{"ev": "init", "backend": "nccl", "t": time.time(), "world": 1, "rank": 0}],
                          TESTBED_PHANTOM_NCCL="1")
    assert res.returncode == 1 and time.monotonic() - t0 < 60
    assert "testbed phantom rank 0: backend 'nccl' but this phantom" in res.stderr, res.stderr[-2000:]
    assert "backend 'nccl'" in stats["error"] and stats["ops"] == 0


def test_a_phantom_makes_side_groups_of_the_announced_backend(tmp_path):
    """An NCCL job's announcements name each group's backend: a gloo side group is made with gloo
    and mirrored with CPU buffers (here the whole job is gloo: no GPU)."""
    t = time.time()
    res, stats = _phantom(tmp_path, [
        {"ev": "init", "backend": "gloo", "t": t, "world": 1, "rank": 0},
        {"ev": "new_group", "g": 1, "ranks": [0], "backend": "gloo"},
        {"ev": "op", "op": "allreduce", "g": 1, "t": t, "dtype": "float32", "n": [1000], "red": "SUM"},
        {"ev": "op", "op": "allreduce", "g": 1, "t": t, "dtype": "float32", "n": [1000], "red": "SUM"},
        {"ev": "op", "op": "allgather_single", "g": 0, "t": t, "dtype": "int64", "n": [3], "data": "AQAAAAAAAAACAAAAAAAAAAMAAAAAAAAA"},
        {"ev": "end", "t": t}])
    assert res.returncode == 0, res.stderr[-3000:]
    assert stats["ops"] == 3 and stats["error"] is None
