"""A job's process groups wrapped in Python: what the probe times and the phantoms' mirror announces.

c10d lets a backend be a Python ProcessGroup (Backend.register_backend). A
`WrappedGroup` holds the real group (`inner`, gloo's) and is what the job gets
from init_process_group and new_group: every operation reaches a Python method
first, whoever issues it (the script through torch.distributed, DDP's reducer
in C++, functional collectives by the group's name).

- `TimedGroup` (the probe without phantoms, `wrap_silently`): each all_reduce
  passes the probe's timer (`time_allreduces`), everything else goes straight
  to gloo. DDP then issues its buckets through a method the probe times and
  keeps its own path, where the division by the world size is fused with the
  copy into the bucket; a comm hook loses that path and costs about 4% of a
  step (README.md, "The probe's cost").
- `MirrorGroup` (_testbed_mirror.py) announces each operation to the phantoms
  before running it; its all_reduces pass the same timer.

Standard library and torch only: it runs inside the user's job.
"""

from __future__ import annotations

import functools

BACKEND = "testbed_mirror"   # the wrapped groups' backend name; get_backend says "gloo", as the job asked

_timer = None     # the probe's: _timer(group, tensors) before an all_reduce; what it returns, if not None, gets the work
_wrapped = None   # the WrappedGroup class, made once torch is imported
_installed = False

# What a TimedGroup hands to the gloo group it wraps: the methods c10d's Python side calls on a
# group, and those C++ reaches a Python group through (DDP's reducer, functional collectives), by
# their name on ProcessGroup -> on gloo's Backend. An operation not named here fails as it would on
# any Python group, with c10d's error, rather than reaching gloo around the wrapper.
FORWARDED = {"broadcast": "broadcast", "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
             "allreduce_coalesced": "allreduce_coalesced", "reduce_scatter": "reduce_scatter",
             "all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
             "reduce": "reduce", "gather": "gather", "scatter": "scatter", "all_to_all_single": "alltoall_base",
             "alltoall": "alltoall", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
             "send": "send", "recv": "recv", "recv_anysource": "recv_anysource",
             "_start_coalescing": "_start_coalescing", "_end_coalescing": "_end_coalescing",
             "set_timeout": "set_timeout"}


def time_allreduces(timer) -> None:
    """The probe's timer for the wrapped groups' all_reduces (see WrappedGroup._timed_allreduce)."""
    global _timer
    _timer = timer


def times(pg) -> bool:
    """Whether pg is a wrapped group whose all_reduces the probe's timer sees."""
    return _timer is not None and _wrapped is not None and isinstance(pg, _wrapped)


def wrapped_class(dist):
    """The base of every wrapper (made once: `times` recognizes its instances)."""
    global _wrapped
    if _wrapped is not None:
        return _wrapped

    class WrappedGroup(dist.ProcessGroup):
        """A Python ProcessGroup around a real one (`inner`)."""

        def __init__(self, inner, gid: int):
            super().__init__(inner.rank(), inner.size())
            self.inner = inner
            self.gid = gid

        def getBackendName(self):
            return BACKEND

        def shutdown(self):
            # destroy_process_group shuts a group down: the gloo group inside goes then too, as it
            # would without the wrapper (not at the interpreter's exit, after its peers left)
            self.inner.shutdown()

        def abort(self):
            self.inner.abort()

        @property
        def group_name(self):
            # a group made by a backend plugin has no name of its own; c10d's table knows it
            # (DeviceMesh, FSDP2 and functional collectives look groups up by name)
            return dist.distributed_c10d._world.pg_names.get(self, "")

        def _timed_allreduce(self, tensors, opts):
            timer = _timer
            timed = timer(self, tensors) if timer is not None else None
            work = self.inner.allreduce(tensors, opts)
            if timed is not None:
                timed(work)
            return work

    _wrapped = WrappedGroup
    return WrappedGroup


def _timed_class(torch, dist):
    from torch._C import _distributed_c10d as C   # the operations' option classes

    cpu = torch.device("cpu")

    class TimedGroup(wrapped_class(dist)):
        """A job's gloo group without phantoms: its all_reduces pass the probe's timer, everything
        else goes straight to gloo."""

        def allreduce(self, tensors, opts=None):
            return self._timed_allreduce(tensors, opts or C.AllreduceOptions())

        @property
        def _device_types(self):
            return [cpu]

        def _get_backend(self, device):
            # what c10d asks a group for its backend (object collectives, coalescing, splits): gloo's
            if torch.device(device).type != "cpu":
                raise RuntimeError(f"testbed probe: a gloo group has no backend for {device}")
            return self.inner

    for name, theirs in FORWARDED.items():
        setattr(TimedGroup, name, _forwarder(name, theirs))
    return TimedGroup


def _forwarder(name, theirs):
    def forward(self, *args, **kwargs):
        return getattr(self.inner, theirs)(*args, **kwargs)

    forward.__name__ = name
    return forward


def replace(orig, new) -> None:
    """torch.distributed's function `orig` (as c10d and the package both hold it) becomes `new`."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for mod in (c10d, dist):
        if getattr(mod, orig.__name__, None) is orig:
            setattr(mod, orig.__name__, new)


def patch_get_backend(names: dict) -> None:
    """get_backend says what the job asked for (names: our backend's name -> the job's)."""
    import torch.distributed.distributed_c10d as c10d

    orig = c10d.get_backend

    @functools.wraps(orig)
    def get_backend(group=None):
        b = orig(group)
        return names.get(str(b), b)

    replace(orig, get_backend)


def wrap_silently(torch) -> None:
    """Without phantoms: a gloo job's init_process_group makes TimedGroups (and so does new_group,
    whose groups take the default group's backend unless they name one). Other backends, and
    c10d's "cpu:gloo,cuda:nccl" default where a GPU is there, are made as the job asks. Once."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    TimedGroup = _timed_class(torch, dist)

    def create(store, rank, size, timeout):
        return TimedGroup(dist.ProcessGroupGloo(store, rank, size, timeout), 0)

    dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
    orig_init = c10d.init_process_group

    @functools.wraps(orig_init)
    def init_process_group(backend=None, *args, **kwargs):
        name = str(backend).lower() if backend is not None else None
        plain_gloo = name in ("gloo", "cpu:gloo") or (
            name is None and kwargs.get("device_id") is None and not torch.cuda.is_available())
        return orig_init(BACKEND if plain_gloo else backend, *args, **kwargs)

    replace(orig_init, init_process_group)
    patch_get_backend({BACKEND: "gloo"})
