"""Collectives in flight together share the network: the model's time for each, given when the job
launched it and what else was in flight. Pure.

DDP launches a bucket's all_reduce as soon as backward has filled it and waits for all of them
only before the optimizer's step, so its buckets overlap one another. gloo runs up to two
collectives of one process group at once (ProcessGroupGloo's two worker threads), NCCL one per
group (one stream); the rest wait their turn. Collectives running at the same time split the links:
each moves at 1/n of the rate it would have alone (processor sharing), its time alone being the
reference model's prediction for it. Before this, each bucket was judged against its time alone:
the seed's two-worker DDP job came out at 1.39x and 1.65x that (docs/fidelity.md).

Which launches may share comes from how the job launched them, never from the model alone: a
collective launched asynchronously stays in flight while the job goes on, so whatever the job
launches before it ends (measured) runs beside it, and where the run shows the job went on
without waiting for it, so does whatever it launches before the model says it would end. A
blocking collective returns before its rank launches the next, so it shares only with the
asynchronous ones the run shows it launched beside, and blocking collectives on their own never
overlap, however much longer the model makes them than they ran. Left: inside a group of launches
that overlap, a blocking collective the model makes longer than it ran may share with an
asynchronous one launched after it returned (the model would have launched that one later).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

# how many collectives of one process group run at once (ProcessGroupGloo's default worker threads;
# NCCL's one stream per group)
LANES = {"gloo": 2, "nccl": 1}
MAX_PASSES = 32   # a report stays bounded whatever the ranks recorded; real runs settle in one or two


@dataclass(frozen=True)
class Launch:
    start: float          # when the last rank launched it (emulated seconds)
    end: float            # when the last rank saw it complete, as measured (emulated seconds)
    alone: float          # the model's time for it alone on the network (seconds, >= 0)
    group: str            # its process group: lanes are per group, the links are everyone's
    asynchronous: bool    # launched without waiting for it (DDP's buckets, async_op=True)


def shared_times(launches: Sequence[Launch], lanes: int) -> list[float]:
    """The model's time for each launch (same order): its time alone, or longer where it waited for
    a lane of its group or shared the links with others in flight. Never shorter than alone."""
    if lanes < 1:
        raise ValueError(f"lanes must be at least 1, not {lanes}")
    bad = next((x for x in launches if not all(map(math.isfinite, (x.start, x.end, x.alone)))), None)
    if bad is not None:
        raise ValueError(f"a launch's times must be finite numbers: {bad}")
    times = [x.alone for x in launches]
    for _ in range(MAX_PASSES):   # until the groups that share stop growing (each pass only joins)
        out = [x.alone for x in launches]
        for cluster in _clusters(launches, times):
            if len(cluster) > 1:
                t0 = launches[cluster[0]].start   # times from the cluster's start keep their precision
                members = [Launch(launches[i].start - t0, launches[i].end - t0, launches[i].alone,
                                  launches[i].group, launches[i].asynchronous) for i in cluster]
                for i, t in _simulate(members, lanes).items():
                    out[cluster[i]] = max(t, launches[cluster[i]].alone)
        if out == times:
            break
        times = out
    return times


def _clusters(launches: Sequence[Launch], times: Sequence[float]) -> list[list[int]]:
    """Indices of launches that may have run together, each list in launch order. times: each
    launch's model time so far (alone, then shared), for how long the model keeps it in flight.

    The model keeps an asynchronous launch in flight past its measured end only where the run
    shows the job went on without waiting for it (something else launched before it ended): a job
    that waits at once (`async_op=True` then `.wait()`) looks in the records like one whose
    collective ended early, and its loop must not be made to overlap."""
    order = sorted(range(len(launches)), key=lambda i: (launches[i].start, i))
    starts = [launches[i].start for i in order]
    clusters: list[list[int]] = []
    open_any = open_blocking = -math.inf   # until when an asynchronous member may still run beside a launch
    for i in order:
        x = launches[i]
        horizon = open_any if x.asynchronous else open_blocking
        if clusters and x.start < horizon:
            clusters[-1].append(i)
        else:
            clusters.append([i])
            open_any = open_blocking = -math.inf
        if x.asynchronous:
            went_on = bisect.bisect_left(starts, x.end) > bisect.bisect_right(starts, x.start)
            open_any = max(open_any, x.end, x.start + times[i] if went_on else x.end)
            open_blocking = max(open_blocking, x.end)
    return clusters


def _simulate(members: list[Launch], lanes: int) -> dict[int, float]:
    """Processor sharing with at most `lanes` running per group, the rest first come, first served:
    member index -> its time from launch to completion."""
    arrivals = deque(sorted(range(len(members)), key=lambda i: (members[i].start, i)))
    waiting: dict[str, deque[int]] = {}
    running: dict[int, float] = {}   # member -> its work left (seconds alone)
    done: dict[int, float] = {}
    t = members[arrivals[0]].start
    while True:
        while arrivals and members[arrivals[0]].start <= t:
            i = arrivals.popleft()
            waiting.setdefault(members[i].group, deque()).append(i)
        for group, queue in waiting.items():
            busy = sum(1 for j in running if members[j].group == group)
            while queue and busy < lanes:
                j = queue.popleft()
                running[j] = members[j].alone
                busy += 1
        finished = [j for j, left in running.items() if left <= 1e-12 * max(1.0, members[j].alone)]
        if finished:   # lanes freed at t: admit again before time moves on
            for j in finished:
                done[j] = t - members[j].start
                del running[j]
            continue
        if not running:
            if not arrivals:
                return done
            t = members[arrivals[0]].start
            continue
        n = len(running)
        step = min(running.values()) * n
        arrive = bool(arrivals) and members[arrivals[0]].start - t < step
        if arrive:
            step = members[arrivals[0]].start - t
        for j in running:
            running[j] -= step / n
        t = members[arrivals[0]].start if arrive else t + step   # exactly there: no step lost to rounding
