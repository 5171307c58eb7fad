"""Time dilation (DESIGN.md "Fidelity", after DieCast).

When several ranks time-share one GPU (or one CPU core), every rank computes
s times slower than it would alone. To keep the emulated cluster's ratio of
compute to communication, the network is slowed by the same factor: links
run at bandwidth/s with delay*s (and jitter*s), and every time measured in
the run is divided by s before it is reported. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import replace

from testbed.topology.model import LinkProfile, Topology


def dilate(profile: LinkProfile, s: float) -> LinkProfile:
    """The profile a link runs at under dilation factor s (>= 1).

    Bandwidth is divided by s (unshaped links stay unshaped: there is no rate to
    scale), delay and jitter are multiplied by s; loss, queue and MTU are kept.
    """
    s = float(s)
    if not math.isfinite(s) or s < 1:
        raise ValueError(f"time dilation factor must be a finite number >= 1 (got {s!r})")
    if s == 1:
        return profile
    bw = profile.bandwidth_bps
    if bw is not None:
        bw = max(1, int(round(bw / s)))
    return profile.with_changes(bandwidth_bps=bw, delay_s=profile.delay_s * s, jitter_s=profile.jitter_s * s)


def auto_factor(n_ranks: int, n_gpus: int, n_cpus: int) -> float:
    """The factor `time_dilation: auto` picks: how many ranks share each compute device.

    With GPUs the device is a GPU, without them a CPU core. Never below 1 (a
    machine with more devices than ranks runs in real time).
    """
    if n_ranks < 0 or n_gpus < 0 or n_cpus < 0:
        raise ValueError("counts must be >= 0")
    if n_ranks == 0:
        return 1.0
    devices = n_gpus if n_gpus > 0 else max(1, n_cpus)
    return max(1.0, n_ranks / devices)


def resolve(setting: float | str | None, n_ranks: int, n_gpus: int, n_cpus: int) -> float:
    """A topology's / CLI's `time_dilation` setting (None, a number or "auto") as a factor."""
    if setting is None:
        return 1.0
    if isinstance(setting, str):
        if setting.strip().lower() == "auto":
            return auto_factor(n_ranks, n_gpus, n_cpus)
        setting = float(setting)
    s = float(setting)
    if not math.isfinite(s) or s < 1:
        raise ValueError(f"time dilation factor must be >= 1 or 'auto' (got {setting!r})")
    return s


def undilate(seconds: float, s: float) -> float:
    """A time measured under dilation s, as the emulated cluster would see it."""
    return seconds / s


def dilate_topology(topo: Topology, s: float) -> Topology:
    """The topology whose links run dilated by s (the same object when s == 1)."""
    if s == 1:
        return topo
    links = [replace(link, ab=dilate(link.ab, s), ba=dilate(link.ba, s)) for link in topo.links]
    return replace(topo, links=links)
