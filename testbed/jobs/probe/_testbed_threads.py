"""A rank's communication threads ahead of its own work on the worker's cores (imported in ranks by
_testbed_probe, in phantoms by testbed.jobs.phantom, in the launcher by testbed.jobs.supervise;
standard library only).

gloo's device loop (the thread "gloo_tcp_loop") polls its sockets level-triggered. When a message
arrives before the torch worker thread ("pt_gloo_runloop") has posted the operation it belongs to,
the loop goes back to epoll, is woken again at once, and spins until that thread runs. Where a
rank's threads share a core, the worker thread can wait behind the spinner until the scheduler's
tick (4 ms at HZ=250): on a 2-rank star 24-38% of the 1 KiB and 64 KiB all_reduces took 2 ms or
more instead of 0.2-0.6 ms (docs/fidelity.md, "Small messages under time-sharing"). GPU servers
never meet it: their ranks have cores to spare, and their compute is on the device.

So gloo's worker threads come first (nice -20), then its device loop (-1), then the job's own
threads (its compute, 0): the spinner yields to the thread it waits for, and the bytes of a DDP
bucket move ahead of backward's compute, as on a GPU server. Nice weighs threads only against the
worker's own: each worker is a CPU group of its own. A worker's processes may not lower a nice (no
CAP_SYS_NICE, RLIMIT_NICE 0), so the launcher starts a rank at START_NICE and the rank raises every
other thread: order() after init_process_group and each new_group. Threads made later come from
the job's thread at 0 and stay there: a later group's threads are not ahead (the record says so),
nor in a rank started at 0 (a Docker worker: `docker exec` gives no nice). A thread the init made
and that has not named itself yet keeps START_NICE: it is the backend's.
"""

from __future__ import annotations

import os
import time

# thread name, as torch and gloo name them -> nice
NICE = {"pt_gloo_runloop": -20, "gloo_tcp_loop": -1}
JOB_NICE = 0                      # every other thread of the rank: the job's own
START_NICE = min(NICE.values())   # what the launcher starts a rank at
ENV = "TESTBED_COMM_THREADS"      # "1": the launcher starts the rank at START_NICE and the rank orders its threads
SETTLE_S = 0.05                   # how long the threads a call made get to name themselves (they do at their start)


def threads() -> dict[int, str]:
    """This process's threads: tid -> name (threads that end meanwhile are left out)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                out[int(tid)] = f.read(64).strip()
        except (OSError, ValueError):
            continue
    return out


def settled(before: set[int]) -> dict[int, str]:
    """threads(), once the threads made since `before` have named themselves (torch's worker threads
    do as they start, which can be after the call that made them returned), or after SETTLE_S."""
    me = threads().get(os.getpid(), "")
    deadline = time.monotonic() + SETTLE_S
    while True:
        names = threads()
        if all(n != me for t, n in names.items() if t not in before) or time.monotonic() > deadline:
            return names
        time.sleep(0.001)


def plan(found: dict[int, tuple[str, int]], made: set[int]) -> dict[int, int]:
    """tid -> the nice to set, from {tid: (name, nice now)}. gloo's threads get theirs. The other
    threads a process-group call made (`made`) are the backend's too (a worker thread may not have
    named itself yet): they keep the nice they started at. Any other thread below JOB_NICE goes up
    to it (never down: a thread the job raised keeps its nice)."""
    out = {}
    for tid, (name, now) in sorted(found.items()):
        if name in NICE:
            want = NICE[name]
        elif tid in made:
            continue
        else:
            want = max(now, JOB_NICE)
        if want != now:
            out[tid] = want
    return out


def order(before: set[int]) -> dict:
    """After a process-group call: set the nice of this process's threads per plan(), the threads
    not in `before` (threads() taken before the call) being the ones the call made. Returns the
    probe's record of it: {"set": {thread name: count}, "refused": why}."""
    if os.environ.get(ENV) != "1":
        return {"set": {}, "refused": f"{ENV} is not 1"}
    names = settled(before)
    found = {}
    for tid, name in names.items():
        try:
            found[tid] = (name, os.getpriority(os.PRIO_PROCESS, tid))
        except OSError:
            continue
    out: dict = {"set": {}}
    for tid, nice in plan(found, set(found) - set(before)).items():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            out["refused"] = (f"{names[tid]} to nice {nice} from {found[tid][1]}: a worker's process may only "
                              "raise its nice, and this one started too high")
            continue
        except OSError:   # the thread ended meanwhile
            continue
        out["set"][names[tid]] = out["set"].get(names[tid], 0) + 1
    return out
