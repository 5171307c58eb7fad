"""A phantom rank: computes nothing, puts the job's real collective traffic on the network.

`testbed run --real w0 -- CMD` runs CMD on the real workers' ranks and this
module on every other rank, with the same environment a real rank gets
(RANK, WORLD_SIZE, MASTER_ADDR/PORT, the worker's interface and cgroup). The
lowest real rank announces each operation of its process groups before it
runs it (probe/_testbed_mirror.py) on this phantom's FIFO
(TESTBED_PHANTOM_IN); the phantom joins the same process group with the same
backend and issues the same operation with a zero buffer of the same size and
dtype, so it takes its part in the real algorithm (gloo's ring, its tree) and
every emulated link carries the job's real bytes.

How late a phantom reads each announcement (its wall clock minus the real
rank's, both the host's clock) is kept and written at the end to
TESTBED_PHANTOM_STATS, for the run's summary.

Mirrors what data-parallel jobs issue: all_reduce (DDP's buckets, its
parameter verification and broadcast, the bucket rebuild), broadcast,
all_gather, all_gather_into_tensor and reduce_scatter_tensor (as FSDP and
ZeRO issue them), reduce_scatter, reduce, gather, scatter, all_to_all_single,
barrier, new_group. Point-to-point (send/recv) cannot be mirrored: the real
rank fails with a message saying so.

NCCL jobs (experimental, not yet run on a GPU; tests/gpu/check_phantoms_nccl.py
checks it): with TESTBED_PHANTOM_NCCL=1 in the environment, a phantom told of
an nccl init joins with nccl and keeps its buffers on the CUDA device its
worker was given (CUDA_VISIBLE_DEVICES comes with the worker; LOCAL_RANK picks
among them, as a torchrun script does).

    python -m testbed.jobs.phantom     (started by testbed run; no arguments)
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from typing import Any

READ_TIMEOUT_S = 600.0     # no announcement for this long: the real rank is gone
POOL_PER_SIZE = 8          # free buffers kept per (size, dtype, device)
NCCL_GATE = "TESTBED_PHANTOM_NCCL"   # "1": NCCL jobs are mirrored too (experimental; _testbed_mirror.py)


class PhantomError(RuntimeError):
    pass


def _readable(fd: int, timeout: float) -> bool:
    """fd has data (or its end) within `timeout` s. poll, not select: a rank of a big job can
    hold descriptors above select's 1,024."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(max(0, math.ceil(timeout * 1000))))


def _lines(fd: int, timeout: float):
    """The FIFO's lines as they come; PhantomError after `timeout` s without one."""
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line
        if not _readable(fd, timeout):
            raise PhantomError(f"no announcement from the real rank for {timeout:g} s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise PhantomError("the real rank's channel closed")
        buf += chunk


def cuda_index(environ: Any, count: int) -> int:
    """This phantom's CUDA device among the `count` its worker sees: LOCAL_RANK's, as a torchrun
    script picks it (one rank per worker: the worker's GPU)."""
    if count < 1:
        raise PhantomError(f"backend 'nccl' but this phantom sees no CUDA device (CUDA_VISIBLE_DEVICES="
                           f"{environ.get('CUDA_VISIBLE_DEVICES')!r}): give the workers GPUs (gpus: in the topology)")
    return int(environ.get("LOCAL_RANK") or 0) % count


def join_backend(msg: dict[str, Any], torch: Any, environ: Any) -> tuple[str, Any]:
    """The backend to join the real rank's process group with, and the device of this phantom's
    buffers (None: the CPU's default, as for gloo). Sets the CUDA device for nccl."""
    backend = msg.get("backend")
    if backend == "gloo":
        return "gloo", None
    if backend != "nccl":
        raise PhantomError(f"backend {backend!r}: phantoms mirror gloo jobs only")
    if environ.get(NCCL_GATE) != "1":
        raise PhantomError(f"backend 'nccl': phantoms mirror NCCL jobs only with {NCCL_GATE}=1 (experimental)")
    if not torch.distributed.is_nccl_available():
        raise PhantomError(f"backend 'nccl' but this phantom's torch {torch.__version__} has no NCCL")
    torch.cuda.set_device(cuda_index(environ, torch.cuda.device_count() if torch.cuda.is_available() else 0))
    return "nccl", torch.device("cuda", torch.cuda.current_device())


class Mirror:
    """Replays announced operations on this rank's process groups."""

    def __init__(self, torch: Any, dist: Any, device: Any = None):
        from torch._C import _distributed_c10d as options   # the operations' option classes

        self.torch, self.dist, self.opts = torch, dist, options
        self.device = device                               # the default group's buffers' (None: CPU)
        self.devices: dict[int, Any] = {0: device}         # group id -> its buffers' device
        self.groups: dict[int, Any] = {}
        self.rank = dist.get_rank()
        self.ops = 0
        self.probe_ops = 0   # of them, the probe's own (its burst): not numbered among the job's
        self.late: list[float] = []
        self.pending: list[tuple[Any, str, Any]] = []   # (work, what it is, its buffers: kept alive)
        self.pool: dict[tuple[int, str, str], list[Any]] = {}   # (elements, dtype, device) -> free zero buffers
        self.warnings: list[str] = []

    def group(self, gid: int) -> Any:
        if gid == 0:
            return self.dist.distributed_c10d._get_default_group()
        if gid not in self.groups:
            raise PhantomError(f"operation on group {gid}, which no new_group announced")
        return self.groups[gid]

    def zeros(self, n: int, dtype: str, device: Any = None) -> Any:
        """A zero buffer, from the pool when one of that size is free (a fresh one costs page
        faults: time the phantom would spend late at the next collective)."""
        free = self.pool.get((int(n), dtype, "cpu" if device is None else str(device)))
        if free:
            return free.pop()
        return self.torch.zeros(int(n), dtype=getattr(self.torch, dtype), device=device)

    def _release(self, buffers: Any) -> None:
        """Zero a completed operation's buffers and keep them (what came back is the real rank's)."""
        if isinstance(buffers, (list, tuple)):
            for b in buffers:
                self._release(b)
        elif buffers is not None and hasattr(buffers, "zero_"):
            buffers.zero_()
            key = (int(buffers.numel()), str(buffers.dtype).replace("torch.", ""), str(buffers.device))
            free = self.pool.setdefault(key, [])
            if len(free) < POOL_PER_SIZE:
                free.append(buffers)

    def reduction(self, opts: Any, msg: dict[str, Any]) -> Any:
        """opts with the real rank's reduction (a MAX with a phantom's SUM would mix them)."""
        red = msg.get("red") or "SUM"
        if red not in ("SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "AVG"):
            raise PhantomError(f"reduction {red!r} cannot be mirrored")
        opts.reduceOp = getattr(self.dist.ReduceOp, red)
        return opts

    def filled(self, data: str, counts: list[int], dtype: str, device: Any = None) -> list[Any]:
        """The real rank's small tensors, from the announcement (see _testbed_mirror._data)."""
        import base64

        flat = self.torch.frombuffer(bytearray(base64.b64decode(data)), dtype=getattr(self.torch, dtype))
        if flat.numel() != sum(counts):
            raise PhantomError(f"an announcement carries {flat.numel()} elements for {sum(counts)}")
        parts = flat.split([int(n) for n in counts])
        return [t.clone() for t in parts] if device is None else [t.to(device) for t in parts]

    def new_group(self, msg: dict[str, Any]) -> None:
        ranks = msg.get("ranks")
        backend = msg.get("backend")   # an NCCL job's groups say theirs (a gloo side group's buffers: CPU)
        if backend is None:
            self.groups[int(msg["g"])] = self.dist.new_group(ranks)
        else:
            self.groups[int(msg["g"])] = self.dist.new_group(ranks, backend=backend)
            self.devices[int(msg["g"])] = None if backend == "gloo" else self.device
        leader = os.environ.get("TESTBED_PHANTOM_LEADER")
        if ranks is not None and leader is not None and int(leader) not in ranks:
            self.warnings.append(f"group {msg['g']} (ranks {', '.join(map(str, ranks))}) has no real rank: "
                                 "what the job runs on it is not mirrored")

    def op(self, msg: dict[str, Any]) -> None:
        d, name = self.dist, msg["op"]
        self.late.append(time.time() - float(msg.get("t", time.time())))
        pg = self.group(int(msg["g"]))
        if pg == d.GroupMember.NON_GROUP_MEMBER or pg is None:
            return   # the real rank's group does not include this phantom
        dev = self.devices.get(int(msg["g"]), self.device)
        ts: list[Any] = []
        extra: Any = None    # other buffers of the call, kept alive until it completes
        if name != "barrier":
            dtype = msg["dtype"]
            ts = self.filled(msg["data"], msg["n"], dtype, dev) if msg.get("data") else \
                [self.zeros(n, dtype, dev) for n in msg["n"]]
        me, size = pg.rank(), pg.size()
        if name == "allreduce":
            work = pg.allreduce(ts, self.reduction(self.opts.AllreduceOptions(), msg))
        elif name == "allreduce_coalesced":
            work = pg.allreduce_coalesced(ts, self.reduction(self.opts.AllreduceCoalescedOptions(), msg))
        elif name == "broadcast":
            o = self.opts.BroadcastOptions()
            o.rootRank, o.rootTensor = int(msg["root"]), int(msg.get("root_tensor", 0))
            work = pg.broadcast(ts, o)
        elif name == "allgather":
            extra = [[self.zeros(t.numel(), dtype, dev) for _ in range(size)] for t in ts]
            work = pg.allgather(extra, ts, self.opts.AllgatherOptions())
        elif name == "reduce_scatter":
            extra = [[self.zeros(t.numel(), dtype, dev) for _ in range(size)] for t in ts]
            work = pg.reduce_scatter(ts, extra, self.reduction(self.opts.ReduceScatterOptions(), msg))
        elif name == "allgather_single":
            extra = self.zeros(ts[0].numel() * size, dtype, dev)
            work = pg._allgather_base(extra, ts[0], self.opts.AllgatherOptions())
        elif name == "reduce_scatter_single":
            extra = self.zeros(ts[0].numel() * size, dtype, dev)
            work = pg._reduce_scatter_base(ts[0], extra, self.reduction(self.opts.ReduceScatterOptions(), msg))
        elif name == "reduce":
            o = self.reduction(self.opts.ReduceOptions(), msg)
            o.rootRank = int(msg["root"])
            work = pg.reduce(ts, o)
        elif name == "gather":
            o = self.opts.GatherOptions()
            o.rootRank = int(msg["root"])
            extra = [[self.zeros(t.numel(), dtype, dev) for _ in range(size)] for t in ts] if me == o.rootRank else []
            work = pg.gather(extra, ts, o)
        elif name == "scatter":
            o = self.opts.ScatterOptions()
            o.rootRank = int(msg["root"])
            extra = [[self.zeros(t.numel(), dtype, dev) for _ in range(size)] for t in ts] if me == o.rootRank else []
            work = pg.scatter(ts, extra, o)
        elif name == "alltoall_base":
            extra = self.zeros(msg["out_n"], dtype, dev)
            work = pg.alltoall_base(extra, ts[0], list(msg["out_splits"]), list(msg["in_splits"]),
                                    self.opts.AllToAllOptions())
        elif name == "barrier":
            work = pg.barrier(self.opts.BarrierOptions())
        else:
            raise PhantomError(f"cannot mirror operation {name!r}")
        # Issued, not waited for: the real rank may have several in flight (DDP's buckets run
        # while backward goes on); the backend runs them in the order issued, as on the real rank.
        self.ops += 1
        if msg.get("probe"):
            self.probe_ops += 1
        number = f"the probe's own #{self.probe_ops}" if msg.get("probe") else f"#{self.ops - self.probe_ops}"
        what = (f"{name} {number} on group {msg['g']} "
                f"({', '.join(str(n) for n in msg.get('n', []))} elements of {msg.get('dtype')})")
        self.pending.append((work, what, (ts, extra)))
        while self.pending and self.pending[0][0].is_completed():
            self._wait(self.pending.pop(0))

    def _wait(self, item: tuple[Any, str, Any]) -> None:
        work, what, buffers = item
        try:
            work.wait()
        except Exception as exc:
            raise PhantomError(f"{what} failed: {exc}") from exc
        self._release(buffers)

    def drain(self) -> None:
        while self.pending:
            self._wait(self.pending.pop(0))
        if self.device is not None:
            self.torch.cuda.synchronize()   # NCCL's wait() only orders streams: done before the group goes


def _write_stats(mirror: Mirror | None, error: str | None) -> None:
    path = _mine(os.environ.get("TESTBED_PHANTOM_STATS"))
    if not path:
        return
    late = sorted(mirror.late) if mirror else []
    doc = {"rank": int(os.environ.get("RANK", "-1")), "ops": mirror.ops if mirror else 0, "error": error,
           "warnings": mirror.warnings[:20] if mirror else [],
           "announce_late_s": {"n": len(late), "mean": sum(late) / len(late) if late else None,
                               "p50": late[len(late) // 2] if late else None, "max": late[-1] if late else None}}
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _mine(path: str | None) -> str | None:
    """A path the launcher gave every local rank of a torchrun agent: {LOCAL_RANK} is this one's."""
    return None if path is None else path.replace("{LOCAL_RANK}", os.environ.get("LOCAL_RANK", "0"))


def main() -> int:
    channel = _mine(os.environ.get("TESTBED_PHANTOM_IN"))
    if not channel:
        sys.stderr.write("testbed phantom: TESTBED_PHANTOM_IN is not set (testbed run --real starts phantoms)\n")
        return 2
    fd = os.open(channel, os.O_RDWR)    # never sees EOF while the real rank has not started
    import torch   # now, while the real rank starts too (a second or two)
    import torch.distributed as dist
    mirror: Mirror | None = None
    error = None
    try:
        lines = _lines(fd, READ_TIMEOUT_S)
        for raw in lines:
            msg = json.loads(raw)
            ev = msg.get("ev")
            if ev == "init":
                backend, device = join_backend(msg, torch, os.environ)
                if isinstance(msg.get("rank"), int) and msg["rank"] >= 0:   # under torchrun only it knows
                    os.environ.setdefault("TESTBED_PHANTOM_LEADER", str(msg["rank"]))
                dist.init_process_group(backend)
                mirror = Mirror(torch, dist, device)
            elif mirror is None:
                raise PhantomError(f"{ev!r} before the real rank's init_process_group")
            elif ev == "new_group":
                mirror.new_group(msg)
            elif ev == "op":
                mirror.op(msg)
            elif ev == "end":
                break
        if mirror is not None:
            mirror.drain()
            mirror.dist.destroy_process_group()
        return 0
    except PhantomError as exc:
        error = str(exc)
        sys.stderr.write(f"testbed phantom rank {os.environ.get('RANK')}: {exc}\n")
        return 1
    finally:
        _write_stats(mirror, error)
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
