"""The real rank's side of phantom ranks: announce every collective before it runs.

Loaded by the probe when TESTBED_PHANTOM_OUT names the FIFOs of this run's
phantoms (os.pathsep-separated; see testbed/jobs/phantom.py for the other side),
or TESTBED_OPS_TRACE a file to record the same lines in (`testbed run
--record-ops`; `testbed run --replay` plays them back to phantoms only).
The job's gloo process groups are wrapped in a Python ProcessGroup
(`MirrorGroup`): every operation a group runs, whoever issues it (the script
through torch.distributed, DDP's reducer in C++, its constructor's parameter
broadcast and bucket rebuild), first writes one JSON line to every phantom's
FIFO, then runs on the real gloo group. A phantom reads the line and issues
the same operation with a buffer of the same size, so it takes its part in
the real algorithm and the emulated links carry the job's real bytes.

The wrapping is _testbed_groups.py's, which also wraps a gloo job's groups
without phantoms, for the probe to time DDP's buckets.

NCCL jobs (experimental, not yet run on a GPU): with TESTBED_PHANTOM_NCCL=1 in
the ranks' environment, a job's NCCL groups are wrapped the same way
(`NcclMirrorGroup` around a ProcessGroupNCCL) and the phantoms join with nccl
on their worker's GPU; tests/gpu/check_phantoms_nccl.py checks it. Without the
variable an nccl job is refused.

A line: {"ev": "op", "op": NAME, "g": group id, "t": wall time, "dtype": ...,
"n": element counts, ...}; {"ev": "init", "backend"} (before the rendezvous); {"ev":
"new_group", "g": id, "ranks": [...] or null, "backend" (NCCL jobs only: "nccl" or
"gloo")}; {"ev": "end"}. Group ids: 0 is
the default group, then 1, 2, ... in the order new_group is called (every
rank calls it in the same order: torch requires that too).

Standard library and torch only: it runs inside the user's job.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import json
import os
import threading
import time

try:
    import _testbed_groups as groups
except ImportError:   # imported from the package (tests), not from the ranks' PYTHONPATH
    from testbed.jobs.probe import _testbed_groups as groups

BACKEND = groups.BACKEND
BACKEND_NCCL = "testbed_mirror_nccl"   # a backend name of its own: the gloo one stays as it was
NCCL_GATE = "TESTBED_PHANTOM_NCCL"     # "1": NCCL jobs are mirrored too (experimental)
NCCL_NOTE = ("An unverified path for backend 'nccl' exists behind TESTBED_PHANTOM_NCCL=1 "
             "(testbed run -e TESTBED_PHANTOM_NCCL=1 --real ...); tests/gpu/check_phantoms_nccl.py "
             "checks it on a GPU machine.")
_fds: list[int] = []
_lock = threading.Lock()
_tls = threading.local()
_next_group = [1]
_installed = False
_job_backend = None   # "gloo" or "nccl", once the job's init_process_group ran


_trace = None   # TESTBED_OPS_TRACE: the same lines, kept for `testbed run --replay`


def _announce(obj: dict) -> None:
    line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    with _lock:
        for fd in _fds:
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        if _trace is not None and not obj.get("probe"):   # a replay plays the job's operations, not the probe's
            _trace.write(line)


CHECK_TIMEOUT_S = 600.0   # a checking rank waits this long for the leader's matching operation
_check = None             # TESTBED_PHANTOM_CHECK: this rank compares its operations with the leader's


class _Checker:
    """A real rank that is not the leader (`--real-ranks 0,1`): the phantoms mirror the leader, so
    this rank must issue what the leader issues. Each of its operations is compared, group by
    group and in order, with the leader's announcement; a difference raises here, naming both, so
    rank-dependent control flow ends the run with a message instead of hanging the phantoms."""

    _KEYS = ("op", "dtype", "n", "root", "red", "ranks", "probe")

    def __init__(self, path: str, leader: str):
        # O_RDWR: reads wait for data (select) and never see end-of-file while the leader is away
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.leader = leader
        self.buf = b""
        self.pending: dict = {}
        self.count: dict = {}

    def _read(self, deadline: float) -> dict:
        import math
        import select

        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            waiter = select.poll()   # (not select: a rank of a big job can hold descriptors above 1,024)
            waiter.register(self.fd, select.POLLIN)
            if left <= 0 or not waiter.poll(math.ceil(left * 1000)):
                raise TimeoutError
            try:
                self.buf += os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def expect(self, key, mine: dict) -> None:
        counted = (key, bool(mine.get("probe")))   # the job's operations are numbered apart from the probe's
        n = self.count[counted] = self.count.get(counted, 0) + 1
        where = ("the probe's own " if mine.get("probe") else "") + f"operation {n} of group {key}"
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        queue = self.pending.setdefault(key, [])
        while not queue:
            try:
                obj = self._read(deadline)
            except TimeoutError:
                raise RuntimeError(
                    f"testbed phantoms: rank {os.environ.get('RANK', '?')} issued {_describe(mine)} "
                    f"({where}) but rank {self.leader}, which the phantoms mirror, "
                    f"issued nothing there for {CHECK_TIMEOUT_S:g} s: ranks that take different paths "
                    "cannot share phantoms") from None
            ev = obj.get("ev")
            if ev == "op":
                self.pending.setdefault(obj.get("g"), []).append(obj)
            elif ev == "new_group":
                self.pending.setdefault("new_group", []).append({**obj, "op": "new_group"})
        theirs = queue.pop(0)
        if any(theirs.get(k) != mine.get(k) for k in self._KEYS):
            raise RuntimeError(
                f"testbed phantoms: rank {os.environ.get('RANK', '?')} and rank {self.leader} diverge at "
                f"{where}: this rank issues {_describe(mine)}, rank {self.leader} "
                f"(which the phantoms mirror) issued {_describe(theirs)}. Phantoms can only mirror ranks "
                "that issue the same collectives; make every rank with its own sequence a real one")


@contextlib.contextmanager
def probes_own():
    """Around the probe's own collectives (its burst of small all_reduces after init_process_group):
    announced and checked like the job's, and marked, so that neither a checking rank nor a phantom
    numbers them among the job's operations in what it says."""
    _tls.probe = True
    try:
        yield
    finally:
        _tls.probe = False


def _describe(op: dict) -> str:
    sizes = op.get("n")
    what = f"{op.get('op')}"
    if sizes:
        what += f" of {sum(sizes)} {op.get('dtype', '')} element(s)".rstrip()
    if op.get("root") is not None:
        what += f" from root {op['root']}"
    if op.get("ranks") is not None:
        what += f" over ranks {op['ranks']}"
    return what


def _open_channels(spec: str) -> None:
    for path in filter(None, spec.split(os.pathsep)):
        # O_RDWR: never blocks, whether or not the phantom has opened its end yet
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            import fcntl

            fcntl.fcntl(fd, 1031, 1 << 20)   # F_SETPIPE_SZ: room for bursts of announcements
        except OSError:
            pass
        _fds.append(fd)


def _counts(tensors) -> list[int]:
    return [int(t.numel()) for t in tensors]


SMALL_BYTES = 64 * 1024   # payloads up to this size travel with the announcement


def _data(tensors) -> str | None:
    """The tensors' contents (base64) when small: a phantom then sends the real rank's values, so
    that metadata exchanges (DDP's check that every rank has the same parameters, a flag agreed by
    all_reduce) see the job's own data, not zeros."""
    try:
        if sum(t.numel() * t.element_size() for t in tensors) > SMALL_BYTES:
            return None
        import base64
        import ctypes

        raw = b"".join(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size())
                       for c in (t.detach().cpu().contiguous() for t in tensors))
        return base64.b64encode(raw).decode()
    except Exception:
        return None


def _red(opts) -> str:
    """The reduction's name (SUM, MAX, ...): every rank of a reduction must apply the same one."""
    try:
        return opts.reduceOp.op.name
    except Exception:
        return "SUM"


def _dtype(tensors) -> str:
    for t in tensors:
        return str(t.dtype).replace("torch.", "")
    return "float32"


def job_backend(backend, environ=os.environ) -> str:
    """"gloo" or "nccl": what the job's init_process_group asks for, when the mirror can wrap it;
    RuntimeError (the refusal the job dies with) otherwise."""
    name = str(backend).lower() if backend is not None else "gloo"
    if name in ("gloo", "cpu:gloo"):
        return "gloo"
    if name in ("nccl", "cuda:nccl") and environ.get(NCCL_GATE) == "1":
        return "nccl"
    raise RuntimeError(f"testbed phantoms mirror gloo jobs only (this job asked for backend {backend!r}); "
                       "run it without --real, or with gloo. " + NCCL_NOTE)


def require_cuda(torch) -> None:
    """Refuse an NCCL job where this rank's torch cannot run one, before the rendezvous (the
    phantoms then never wait for a group that cannot form)."""
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available():
        return
    what = "has no NCCL" if torch.cuda.is_available() else "sees no CUDA device"
    raise RuntimeError(f"testbed phantoms: {NCCL_GATE}=1 and backend 'nccl', but this rank's torch "
                       f"{torch.__version__} {what} (CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give the workers GPUs (gpus: in the "
                       "topology) and a CUDA build of torch, or run the job with gloo")


def _new_group_backend(backend) -> tuple[str, str]:
    """(our backend name, what the phantoms make) for new_group's backend argument in an NCCL job:
    its side groups may be gloo ones (object collectives on the CPU), mirrored as such."""
    name = str(backend).lower() if backend is not None else "nccl"   # None: the default group's
    if name in ("nccl", "cuda:nccl", BACKEND_NCCL):
        return BACKEND_NCCL, "nccl"
    if name in ("gloo", "cpu:gloo", BACKEND):
        return BACKEND, "gloo"
    raise RuntimeError(f"testbed phantoms: new_group(backend={backend!r}) cannot be mirrored (nccl or gloo only)")


def _make_group_class(dist, WrappedGroup):
    from torch._C import _distributed_c10d as C   # the operations' option classes

    class MirrorGroup(WrappedGroup):
        """A gloo group that announces each operation to the phantoms before running it. gloo is
        not its backend in c10d's sense: an operation it does not announce fails instead of running
        unannounced (the phantoms would wait for it)."""

        def getBackendName(self):
            return BACKEND

        def shutdown(self):
            # destroy_process_group shuts a group down: the gloo group inside goes then too, as it
            # would without the mirror (not at the interpreter's exit, after its peers left)
            self.inner.shutdown()

        def abort(self):
            self.inner.abort()

        @property
        def group_name(self):
            # a group made by a backend plugin has no name of its own; c10d's table knows it
            # (DeviceMesh, FSDP2 and functional collectives look groups up by name)
            return dist.distributed_c10d._world.pg_names.get(self, "")

        def _say(self, op: str, **kw) -> None:
            if getattr(_tls, "probe", False):
                kw["probe"] = True
            if _check is not None:
                _check.expect(self.gid, {"op": op, **kw})
            else:
                _announce({"ev": "op", "op": op, "g": self.gid, "t": time.time(), **kw})

        def allreduce(self, tensors, opts=None):
            opts = opts or C.AllreduceOptions()
            self._say("allreduce", dtype=_dtype(tensors), n=_counts(tensors), data=_data(tensors),
                      red=_red(opts))
            return self._timed_allreduce(tensors, opts)

        def allreduce_coalesced(self, tensors, opts=None):
            opts = opts or C.AllreduceCoalescedOptions()
            self._say("allreduce_coalesced", dtype=_dtype(tensors), n=_counts(tensors), data=_data(tensors),
                      red=_red(opts))
            return self.inner.allreduce_coalesced(tensors, opts)

        def broadcast(self, tensors, opts=None):
            opts = opts or C.BroadcastOptions()
            self._say("broadcast", dtype=_dtype(tensors), n=_counts(tensors), root=opts.rootRank,
                      root_tensor=opts.rootTensor, data=_data(tensors))
            return self.inner.broadcast(tensors, opts)

        def allgather(self, output_lists, input_tensors, opts=None):
            self._say("allgather", dtype=_dtype(input_tensors), n=_counts(input_tensors), data=_data(input_tensors))
            return self.inner.allgather(output_lists, input_tensors, opts or C.AllgatherOptions())

        def reduce_scatter(self, outputs, input_lists, opts=None):
            opts = opts or C.ReduceScatterOptions()
            self._say("reduce_scatter", dtype=_dtype(outputs), n=_counts(outputs), red=_red(opts))
            return self.inner.reduce_scatter(outputs, input_lists, opts)

        def all_gather_single(self, output, input, opts=None):
            # all_gather_into_tensor (FSDP, ZeRO): torch calls this method of the group from Python
            self._say("allgather_single", dtype=_dtype([input]), n=[int(input.numel())], data=_data([input]))
            return self.inner._allgather_base(output, input, opts or C.AllgatherOptions())

        def reduce_scatter_single(self, output, input, opts=None):
            # reduce_scatter_tensor (FSDP's gradients, ZeRO)
            opts = opts or C.ReduceScatterOptions()
            self._say("reduce_scatter_single", dtype=_dtype([output]), n=[int(output.numel())], red=_red(opts))
            return self.inner._reduce_scatter_base(output, input, opts)

        # functional collectives (DTensor, FSDP2, tensor parallelism), one tensor or coalesced, reach
        # these: each pair is announced and run as its one-tensor form, in order, as TimedGroup runs
        # them
        def all_gather_single_coalesced(self, outputs, inputs, opts=None):
            groups.same_length("all_gather_single_coalesced", outputs, inputs)
            works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
            return works[0] if len(works) == 1 else groups.all_of(works, list(outputs))

        def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
            groups.same_length("reduce_scatter_single_coalesced", outputs, inputs)
            works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
            return works[0] if len(works) == 1 else groups.all_of(works, list(outputs))

        # (torch before 2.13's renames looks these names up instead)
        allgather_into_tensor_coalesced = all_gather_single_coalesced
        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

        def reduce(self, tensors, opts=None):
            opts = opts or C.ReduceOptions()
            self._say("reduce", dtype=_dtype(tensors), n=_counts(tensors), root=opts.rootRank, data=_data(tensors),
                      red=_red(opts))
            return self.inner.reduce(tensors, opts)

        def gather(self, output_lists, input_tensors, opts=None):
            opts = opts or C.GatherOptions()
            self._say("gather", dtype=_dtype(input_tensors), n=_counts(input_tensors), root=opts.rootRank,
                      data=_data(input_tensors))
            return self.inner.gather(output_lists, input_tensors, opts)

        def scatter(self, output_tensors, input_lists, opts=None):
            opts = opts or C.ScatterOptions()
            self._say("scatter", dtype=_dtype(output_tensors), n=_counts(output_tensors), root=opts.rootRank)
            return self.inner.scatter(output_tensors, input_lists, opts)

        def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
            # what this rank sends to and receives from each peer: a phantom sends and receives
            # what the real rank does (the pattern of a uniform exchange, as DP jobs make it)
            self._say("alltoall_base", dtype=str(input.dtype).replace("torch.", ""), n=[int(input.numel())],
                      out_n=int(output.numel()), in_splits=list(input_splits), out_splits=list(output_splits))
            return self.inner.alltoall_base(output, input, output_splits, input_splits,
                                            opts or C.AllToAllOptions())

        def barrier(self, opts=None):
            self._say("barrier")
            return self.inner.barrier(opts or C.BarrierOptions())

        def send(self, tensors, dst, tag):
            raise RuntimeError("testbed phantoms: point-to-point send/recv cannot be mirrored (a phantom "
                               "would not know its own peer); run every rank that uses them as a real one")

        def recv(self, tensors, src, tag):
            self.send(tensors, src, tag)

    return MirrorGroup


def _make_nccl_group_class(torch, MirrorGroup):
    cuda = torch.device("cuda")

    class NcclMirrorGroup(MirrorGroup):
        """An NCCL group that announces each operation before running it. To c10d's Python side it
        looks like the NCCL group it wraps (object collectives then stage their bytes on the GPU,
        code asking for its backend gets the ProcessGroupNCCL); nothing is registered in C++, so
        an operation C++ reaches without our Python methods fails instead of running unannounced."""

        def getBackendName(self):
            return BACKEND_NCCL

        @property
        def _device_types(self):
            return [cuda]

        def _get_backend(self, device):
            if torch.device(device).type != "cuda":
                raise RuntimeError(f"testbed phantoms: an NCCL group has no backend for {device}")
            return self.inner

    return NcclMirrorGroup


def _create(dist, MirrorGroup):
    def create(store, rank, size, timeout):
        gid = getattr(_tls, "gid", 0)
        return MirrorGroup(dist.ProcessGroupGloo(store, rank, size, timeout), gid)

    return create


def _create_nccl(dist, NcclMirrorGroup):
    def create(common, options):
        # what c10d gives a plain nccl group: the job's options (pg_options) or its defaults, the
        # group's name and ranks; never split from a parent (the phantoms' groups are not either)
        if options is None:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
        options._timeout = common.timeout
        options.global_ranks_in_group = list(common.global_ranks_in_group)
        options.group_name = common.group_id
        inner = dist.ProcessGroupNCCL(common.store, common.group_rank, common.group_size, options)
        return NcclMirrorGroup(inner, getattr(_tls, "gid", 0))

    return create


def install(torch) -> None:
    """Wrap the job's process groups (from the probe's torch import hook). Once."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if os.environ.get("TESTBED_PHANTOM_CHECK"):
        global _check
        _check = _Checker(os.environ["TESTBED_PHANTOM_CHECK"].replace("{LOCAL_RANK}", os.environ.get("LOCAL_RANK", "0")),
                          os.environ.get("TESTBED_PHANTOM_LEADER", "?"))
    else:
        _open_channels(os.environ.get("TESTBED_PHANTOM_OUT", ""))
    if os.environ.get("TESTBED_OPS_TRACE"):
        global _trace
        _trace = open(os.environ["TESTBED_OPS_TRACE"].replace("{RANK}", os.environ.get("RANK", "0")), "ab")
    MirrorGroup = _make_group_class(dist, groups.wrapped_class(dist))
    dist.Backend.register_backend(BACKEND, _create(dist, MirrorGroup), devices=["cpu"])
    if os.environ.get(NCCL_GATE) == "1":
        # devices=["cuda"] as nccl's own: the group's store keys then carry the prefix the
        # phantoms' real nccl groups use ("cuda/"), so both ends meet in the rendezvous
        dist.Backend.register_backend(BACKEND_NCCL, _create_nccl(dist, _make_nccl_group_class(torch, MirrorGroup)),
                                      extended_api=True, devices=["cuda"])
    orig_init = c10d.init_process_group
    orig_new_group = c10d.new_group

    @functools.wraps(orig_init)
    def init_process_group(backend=None, *args, **kwargs):
        global _job_backend
        device_id = kwargs.get("device_id")
        if backend is None and device_id is not None and getattr(device_id, "type", "cuda") != "cpu":
            backend = "nccl"   # what c10d picks for a CUDA device_id
        kind = job_backend(backend)
        if kind == "nccl":
            require_cuda(torch)
            # connected lazily, as the phantoms' groups are: eagerly (device_id), this rank would wait
            # in NCCL's init for phantoms that wait for its first announcement
            kwargs.pop("device_id", None)
        _job_backend = kind
        _tls.gid = 0
        # before: the phantoms must join the rendezvous this call waits in
        world = kwargs.get("world_size", -1)
        world = int(world if world not in (None, -1) else os.environ.get("WORLD_SIZE", -1))
        _announce({"ev": "init", "backend": kind, "t": time.time(), "world": world,
                   "rank": int(kwargs.get("rank", -1) if kwargs.get("rank", -1) != -1 else os.environ.get("RANK", -1))})
        return orig_init(BACKEND if kind == "gloo" else BACKEND_NCCL, *args, **kwargs)

    @functools.wraps(orig_new_group)
    def new_group(ranks=None, *args, **kwargs):
        gid = _next_group[0]
        _next_group[0] += 1
        said = None if ranks is None else [int(r) for r in ranks]
        if _check is not None:
            _check.expect("new_group", {"op": "new_group", "ranks": said})
        line = {"ev": "new_group", "g": gid, "ranks": said}
        if _job_backend == "nccl":
            # every group of an NCCL job goes through the mirror, gloo side groups included; the
            # phantoms make a group of the same backend
            bound = inspect.signature(orig_new_group).bind(ranks, *args, **kwargs).arguments
            bound["backend"], line["backend"] = _new_group_backend(bound.get("backend"))
            bound.pop("device_id", None)   # lazily connected too (see init_process_group)
            args, kwargs = (), {k: v for k, v in bound.items() if k != "ranks"}
        _announce(line)
        _tls.gid = gid
        try:
            return orig_new_group(ranks, *args, **kwargs)
        finally:
            _tls.gid = 0

    groups.replace(orig_init, init_process_group)
    groups.replace(orig_new_group, new_group)
    groups.patch_get_backend({BACKEND: "gloo", BACKEND_NCCL: "nccl"})
    atexit.register(_end)


def _end() -> None:
    _announce({"ev": "end", "t": time.time()})
    if _trace is not None:
        _trace.close()
