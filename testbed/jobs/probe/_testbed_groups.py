"""A job's process groups wrapped in Python: what the probe times and the phantoms' mirror announces.

c10d lets a backend be a Python ProcessGroup (Backend.register_backend). A
`WrappedGroup` holds the real group (`inner`, gloo's) and is what the job gets
from init_process_group and new_group: an all_reduce reaches a Python method
first, whoever issues it (the script through torch.distributed, DDP's reducer
in C++).

- `TimedGroup` (the probe without phantoms, `wrap_silently`): gloo is the
  group's own backend, so every operation takes c10d's usual way to it, and
  each all_reduce passes the probe's timer (`time_allreduces`) on its way.
  DDP then issues its buckets through a method the probe times and keeps its
  own path, where the division by the world size is fused with the copy into
  the bucket; a comm hook loses that path and costs about 4% of a step
  (README.md, "The probe's cost").
- `MirrorGroup` (_testbed_mirror.py) announces each operation to the phantoms
  before running it; its all_reduces pass the same timer.

A timed all_reduce hands DDP a Work whose future completes once the probe has
noted the completion: DDP waits for the record, as it waited for a comm hook's.

Not wrapped (DDP's buckets are then timed with a comm hook): other backends,
a backend-less init_process_group where an accelerator is there, and jobs under
TORCH_DISTRIBUTED_DEBUG=DETAIL (c10d's checking wrapper skips Python groups).

Standard library and torch only: it runs inside the user's job.
"""

from __future__ import annotations

import functools
import os

BACKEND = "testbed_mirror"   # the wrapped groups' backend name; get_backend says "gloo", as the job asked

_timer = None     # the probe's: _timer(group, tensors) before an all_reduce; what it returns, if not None, gets the work
_wrapped = None   # the WrappedGroup class, made once torch is imported
_work = None      # the Work class of a timed all_reduce
_all_work = None  # the Work class of a coalesced operation done one tensor at a time
_installed = False


def time_allreduces(timer) -> None:
    """The probe's timer for the wrapped groups' all_reduces (see WrappedGroup._timed_allreduce):
    timer(group, tensors) returns None, or a function that takes the all_reduce's Work and returns
    the one to hand back (`then`)."""
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

        def _timed_allreduce(self, tensors, *args, **kwargs):
            # (every overload of ProcessGroup.allreduce: a list and options, or one tensor and op=)
            timer = _timer
            timed = timer(self, tensors) if timer is not None else None
            work = self.inner.allreduce(tensors, *args, **kwargs)
            return work if timed is None else timed(work)

    _wrapped = WrappedGroup
    return WrappedGroup


def then(work, callback):
    """A Work that completes once callback() ran after `work` completed (on the backend's thread):
    whoever waits for it (DDP's reducer) waits for the callback too."""
    from torch._C import _distributed_c10d as C

    global _work
    if _work is None:
        class ThenWork(C.Work):
            def __init__(self, inner, fut):
                super().__init__()
                self.inner, self.fut = inner, fut

            def wait(self, timeout=None):
                ok = self.inner.wait() if timeout is None else self.inner.wait(timeout)
                self.fut.wait()
                return ok

            def get_future(self):
                return self.fut

            def is_completed(self):
                return self.fut.done()

            def result(self):
                return self.fut.value()

        _work = ThenWork

    def done(fut):
        callback()
        return fut.value()

    return _work(work, work.get_future().then(done))


# The methods torch looks up in Python on a Python group (PyProcessGroup's overrides), by their name
# on ProcessGroup -> on gloo's Backend. Where a group has none of its own, torch runs its own C++
# method with the GIL held, and a gloo thread that frees a tensor Python still knows takes the GIL
# while holding gloo's lock: the job deadlocks (seen with the final barrier of a torchrun DDP job,
# and within a few dozen functional collectives). gloo's methods release the GIL. The two coalesced
# ones, which gloo's Backend offers in Python only one tensor at a time, are `_each`'s.
FORWARDED = {"broadcast": "broadcast", "allgather": "allgather", "allreduce_coalesced": "allreduce_coalesced",
             "reduce_scatter": "reduce_scatter", "all_to_all_single": "alltoall_base", "barrier": "barrier",
             "send": "send", "recv": "recv", "shutdown": "shutdown", "abort": "abort"}
ONE_AT_A_TIME = {"all_gather_single_coalesced": "_allgather_base",
                 "reduce_scatter_single_coalesced": "_reduce_scatter_base",
                 # (torch before 2.13's renames looks these names up instead)
                 "allgather_into_tensor_coalesced": "_allgather_base",
                 "reduce_scatter_tensor_coalesced": "_reduce_scatter_base"}


def _timed_class(torch, dist):
    class TimedGroup(wrapped_class(dist)):
        """A job's gloo group without phantoms: gloo is its backend (every operation takes c10d's
        way to it), its all_reduces pass the probe's timer."""

        def __init__(self, inner, gid: int):
            super().__init__(inner, gid)
            self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, inner)

        def allreduce(self, tensors, *args, **kwargs):
            return self._timed_allreduce(tensors, *args, **kwargs)

    for name, theirs in FORWARDED.items():
        setattr(TimedGroup, name, _forwarder(name, theirs))
    for name, theirs in ONE_AT_A_TIME.items():
        setattr(TimedGroup, name, _each(name, theirs))
    return TimedGroup


def _forwarder(name, theirs):
    def forward(self, *args, **kwargs):
        return getattr(self.inner, theirs)(*args, **kwargs)

    forward.__name__ = name
    return forward


def _each(name, theirs):
    """A coalesced operation as gloo's one-tensor method, pair by pair in order (every rank issues
    them in the same order, as gloo's own coalesced form does), behind one Work."""
    def each(self, outputs, inputs, opts=None):
        same_length(name, outputs, inputs)
        one = getattr(self.inner, theirs)
        works = [one(o, i) if opts is None else one(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[0] if len(works) == 1 else all_of(works, list(outputs))

    each.__name__ = name
    return each


def same_length(name: str, outputs, inputs) -> None:
    """A coalesced operation's pairs: refused before anything is sent (or announced), as gloo's own
    coalesced form refuses them."""
    if len(outputs) != len(inputs):
        raise ValueError(f"{name}: {len(outputs)} outputs for {len(inputs)} inputs")


def all_of(works, outputs):
    """One Work that is complete when every one of `works` is; its result is `outputs`, and so is its
    future's value where each of `works` has a future (gloo's one-tensor reduce_scatter has none,
    as its own coalesced form has none)."""
    import torch
    from torch._C import _distributed_c10d as C

    global _all_work
    if _all_work is None:
        class AllWork(C.Work):
            def __init__(self, works, outputs):
                super().__init__()
                self.works, self.outputs = works, outputs

            def wait(self, timeout=None):
                return all([w.wait() if timeout is None else w.wait(timeout) for w in self.works])

            def is_completed(self):
                return all(w.is_completed() for w in self.works)

            def result(self):
                return self.outputs

            def get_future(self):
                outputs = self.outputs
                return torch.futures.collect_all([w.get_future() for w in self.works]).then(lambda _: outputs)

        _all_work = AllWork

    return _all_work(works, outputs)


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


def _accelerator(torch) -> bool:
    """Whether c10d would give a backend-less init_process_group an accelerator's backend too."""
    acc = getattr(torch, "accelerator", None)
    try:
        return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()
    except Exception:
        return True   # (when in doubt, the job's groups stay as c10d makes them)


def wraps(torch, backend, device_id, environ=os.environ) -> bool:
    """Whether a job's init_process_group(backend, device_id=...) gets TimedGroups: a gloo job's
    (see the module text for the others)."""
    if environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        return False
    if backend is None:
        return device_id is None and not _accelerator(torch)
    return str(backend).lower() in ("gloo", "cpu:gloo")


def wrap_silently(torch) -> None:
    """Without phantoms: a gloo job's init_process_group makes TimedGroups (and so does new_group,
    whose groups take the default group's backend unless they name one). Other jobs are made as
    they ask (see the module text). Once."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    orig_init = c10d.init_process_group
    made: list = []   # the backend is registered with c10d the first time a job asks for gloo

    @functools.wraps(orig_init)
    def init_process_group(backend=None, *args, **kwargs):
        if not wraps(torch, backend, kwargs.get("device_id")):
            return orig_init(backend, *args, **kwargs)
        if not made:
            TimedGroup = _timed_class(torch, dist)

            def create(store, rank, size, timeout):
                return TimedGroup(dist.ProcessGroupGloo(store, rank, size, timeout), 0)

            dist.Backend.register_backend(BACKEND, create, devices=["cpu"])
            patch_get_backend({BACKEND: "gloo"})
            made.append(TimedGroup)
        return orig_init(BACKEND, *args, **kwargs)

    replace(orig_init, init_process_group)
