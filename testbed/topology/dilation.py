"""Time dilation (DESIGN.md "Fidelity", after DieCast), and how its factor is chosen.

When several ranks time-share one GPU (or one CPU core), every rank computes
s times slower than it would alone. To keep the emulated cluster's ratio of
compute to communication, the network is slowed by the same factor: links
run at bandwidth/s with delay*s (and jitter*s), each worker's CPU share is
capped at 1/s of what it asks for, and every time measured in the run is
divided by s before it is reported. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from testbed.topology.model import LinkProfile, Topology
from testbed.topology.plan import NetworkPlan
from testbed.topology.reference import MachineConstants, describe_hosts, for_hosts, host_beta, predict


def dilate(profile: LinkProfile, s: float) -> LinkProfile:
    """The profile a link runs at under dilation factor s (>= 1).

    Bandwidth is divided by s (unshaped links stay unshaped: there is no rate to
    scale), delay and jitter are multiplied by s; loss, queue and MTU are kept. A
    default queue is sized here, on the link as declared: the same bytes take s
    times longer to drain at bandwidth/s, the same time once undilated, so the
    queue is the declared link's whatever s is (sized after dilating, its 1 ms
    floor would shrink it by s).
    """
    s = float(s)
    if not math.isfinite(s) or s < 1:
        raise ValueError(f"time dilation factor must be a finite number >= 1 (got {s!r})")
    if s == 1:
        return profile
    bw = profile.bandwidth_bps
    if bw is not None:
        bw = max(1, int(round(bw / s)))
    return profile.with_changes(bandwidth_bps=bw, delay_s=profile.delay_s * s, jitter_s=profile.jitter_s * s,
                                queue=profile.queue_packets())


# The share of the CPUs the emulated traffic may plan on. 1: beta already holds the kernel's forwarding
# work (the calibration measures it through a bridge); measured here, 16 ranks at s = 8 on 2 cores kept
# up with the links (docs/fidelity.md), so a margin would only slow every run down.
HEADROOM = 1.0
BIG_MESSAGE = 256 << 20
# Declared hosts (Topology.host_rate) are emulated by dilating until this machine's host work per byte
# takes at most 1/HOST_MARGIN of the time the model gives the bytes. 3, not 1.5: while a job computes
# beside its collectives (DDP's buckets during backward) its compute takes about half of the worker's
# CPU cap from gloo's threads; at 1.5 the seed's 2-worker DDP case was NOT FAITHFUL 5 times of 5, at 3
# FAITHFUL 5 of 5, and the main job's s doubles (docs/fidelity.md, "auto's margin").
HOST_MARGIN = 3.0


def auto_factor(n_ranks: int, n_gpus: int, n_cpus: int) -> float:
    """What compute needs: how many ranks share each compute device.

    With GPUs the device is a GPU, without them a CPU core. Never below 1 (a
    machine with more devices than ranks runs in real time).
    """
    if n_ranks < 0 or n_gpus < 0 or n_cpus < 0:
        raise ValueError("counts must be >= 0")
    if n_ranks == 0:
        return 1.0
    devices = n_gpus if n_gpus > 0 else max(1, n_cpus)
    return max(1.0, n_ranks / devices)


def network_factor(topo: Topology, plan: NetworkPlan, rank_workers: list[str], n_cpus: int,
                   constants: MachineConstants) -> tuple[float, float]:
    """What the traffic needs: (factor, cores of host work) for data-parallel traffic at full rate.

    Every rank runs a ring all_reduce of a large message at the rate the reference model gives it
    on this topology with its declared hosts (Topology.host_rate). Moving those bytes keeps
    load = sum over ranks of rate x beta cores of this machine busy (beta: this machine's
    calibrated cost per byte: copies, the reduction, the kernel's TCP path through every hop,
    measured through a bridge). At dilation s the links run s times slower, so the machine must
    supply load / s cores. For declared hosts (network-bound, or a rate) that host work must stay
    HOST_MARGIN times below the bytes' time, so that the hosts measured are the hosts declared;
    for "this-machine" it may take all of it (the model charges it).
    """
    n = len(rank_workers)
    if n < 2 or constants.beta_s_per_byte <= 0:
        return 1.0, 0.0
    declared = for_hosts(constants, topo.host_rate)
    p = predict(topo, plan, "all_reduce", BIG_MESSAGE, rank_workers, declared, placements=1)   # `up` waits
    if p.bandwidth_s <= 0:
        return 1.0, 0.0
    load = _host_load(n, n, p.bandwidth_s, constants)
    margin = 1.0 if host_beta(topo.host_rate) is None else HOST_MARGIN
    return max(1.0, margin * load / (max(1, n_cpus) * HEADROOM)), load


def _rate_text(constants: MachineConstants) -> str:
    now = f"{8 / constants.beta_s_per_byte / 1e9:.2f} Gbit/s per rank, calibrated"
    if constants.planning_beta <= constants.beta_s_per_byte * 1.005:
        return now
    return f"{now}; {8 / constants.planning_beta / 1e9:.2f} at the slowest measured this boot, planned for"


def _host_load(ranks_here: int, n: int, bandwidth_s: float, constants: MachineConstants) -> float:
    """Cores of this machine's host work that `ranks_here` of n ranks need to all_reduce BIG_MESSAGE
    in bandwidth_s (what the model gives the bytes), at the slowest per-byte cost this boot measured."""
    return ranks_here * 2 * (n - 1) / n * BIG_MESSAGE / bandwidth_s * constants.planning_beta


@dataclass(frozen=True)
class Choice:
    """The dilation factor a testbed runs at, and why."""

    factor: float
    setting: str                   # "auto", "fixed" or "none"
    compute: float                 # the factor compute needs (ranks per device)
    network: float | None          # the factor the traffic needs (None: not known, uncalibrated)
    reasons: tuple[str, ...]
    cap_divisor: float | None = None   # a capped worker gets its CPUs / this (None: / factor)

    @property
    def cap_cpu(self) -> bool:
        """Above what sharing the CPUs slows compute by, each worker's CPU is capped (cap_cores):
        compute then slows by s / rank_cores (DieCast's rule when that is s), at the price of
        coarser scheduling (docs/fidelity.md)."""
        return self.factor > self.compute * 1.01

    @property
    def cap_cores(self) -> float:
        """What a capped worker's CPUs are multiplied by: 1/s for a fixed factor (compute slows by
        s); for auto on CPUs (phantoms or not), 1 / (ranks per core), its share of this machine's
        cores: auto raised s above what compute needs so that the ranks have the CPU to move their
        bytes at the links' rate, and a cap of 1/s would take that CPU away again (each rank would
        move bytes at one core's rate here, whatever s: docs/fidelity.md, "The CPU cap decided
        the collectives")."""
        return 1.0 / (self.cap_divisor or self.factor)

    @property
    def rank_cores(self) -> float:
        """The cores of this machine a worker CPU gives its rank in emulated time: s x its cap, 1
        when not capped (sharing the cores already slows it by s)."""
        return self.factor * self.cap_cores if self.cap_cpu else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"factor": self.factor, "setting": self.setting, "compute": self.compute, "network": self.network,
                "cap_cpu": self.cap_cpu, "cap_divisor": self.cap_divisor, "rank_cores": self.rank_cores,
                "reasons": list(self.reasons)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Choice":
        divisor = data.get("cap_divisor")
        return cls(float(data["factor"]), str(data.get("setting", "fixed")), float(data.get("compute") or 1.0),
                   None if data.get("network") is None else float(data["network"]),
                   tuple(str(r) for r in data.get("reasons") or ()),
                   float(divisor) if isinstance(divisor, (int, float)) and divisor >= 1 else None)


def rank_cores(dilation: dict[str, Any] | None) -> float:
    """Choice.rank_cores of a recorded choice (a state's or a run's `dilation`); 1 when there is none
    or it is not one (the record comes from disk)."""
    try:
        return Choice.from_json(dilation).rank_cores if isinstance(dilation, dict) else 1.0
    except (KeyError, TypeError, ValueError):
        return 1.0


def spread(workers: list[str], ranks: int) -> list[str]:
    """Where `ranks` ranks go: one per worker spread evenly over them (every pod, every leaf) while
    there are fewer ranks than workers, else round-robin (several per worker)."""
    n = len(workers)
    if ranks <= n:
        return [workers[i * n // ranks] for i in range(ranks)]
    return [workers[i % n] for i in range(ranks)]


def _round_up(x: float) -> float:
    return math.ceil(x * 10 - 1e-9) / 10


def choose(setting: float | str | None, topo: Topology, plan: NetworkPlan, n_gpus: int, n_cpus: int,
           constants: MachineConstants | None = None, ranks: int | None = None,
           real_ranks: int | None = None) -> Choice:
    """The factor for a `time_dilation` setting (None, a number, "none" or "auto"), with its reasons.

    auto: the smallest factor at which the run is network-bound rather than CPU-bound: the larger
    of what compute needs (ranks per GPU, or per core) and what the traffic needs (network_factor),
    rounded up to a tenth. Without calibrated constants only compute is accounted for. ranks: how
    many ranks the jobs will run, spread over the workers (default: one on every worker).
    real_ranks: how many of them compute (`testbed run --real`: the others are phantoms, which
    compute nothing but still send); compute counts these, the traffic counts all ranks.
    """
    workers = topo.workers
    if ranks is not None and ranks < 1:
        raise ValueError(f"ranks must be >= 1 (got {ranks})")
    rank_workers = list(workers) if ranks is None else spread(workers, ranks)
    devices = f"{n_gpus} GPU(s)" if n_gpus else f"{n_cpus} CPU core(s)"
    if real_ranks is not None and not 1 <= real_ranks <= len(rank_workers):
        raise ValueError(f"real ranks must be between 1 and the {len(rank_workers)} ranks (got {real_ranks})")
    computing = len(rank_workers) if real_ranks is None else real_ranks
    compute = auto_factor(computing, n_gpus, n_cpus)
    how = "one per worker" if ranks is None else f"as asked, over {len(set(rank_workers))} worker(s)"
    why_compute = f"{len(rank_workers)} ranks ({how}) share {devices}: compute needs s >= {compute:.3g}"
    if real_ranks is not None:
        why_compute = (f"{real_ranks} of {len(rank_workers)} ranks ({how}) compute, the others are phantoms; "
                       f"{real_ranks} share {devices}: compute needs s >= {compute:.3g}")
    if setting is None or (isinstance(setting, str) and setting.strip().lower() in ("none", "off")):
        why = [why_compute] if compute > 1 else []
        return Choice(1.0, "none", compute, None, tuple(["no dilation (real time)", *why]))
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        reasons = [why_compute]
        network = None
        if constants is None:
            reasons.append("traffic not accounted for: the machine is not calibrated (testbed calibrate)")
        else:
            network, load = network_factor(topo, plan, rank_workers, n_cpus, constants)
            reasons.append(f"data-parallel traffic at full rate keeps {load:.2g} core(s) busy moving bytes "
                           f"(this machine: {_rate_text(constants)}) "
                           f"against {n_cpus} core(s); to emulate {describe_hosts(topo.host_rate)}"
                           f"{'' if host_beta(topo.host_rate) is None else f' with a {HOST_MARGIN:g}x margin'}"
                           f": the network needs s >= {network:.3g}")
        s = _round_up(max(1.0, compute, network or 1.0))
        # on CPUs, a rank keeps its share of the cores that s was raised for (Choice.cap_cores); phantom
        # runs too, now that they measure their own per-message cost (the probe's burst, mirrored)
        share = not n_gpus
        return _with_cap_reason(Choice(s, "auto", compute, network, tuple(reasons),
                                       cap_divisor=auto_factor(len(rank_workers), 0, n_cpus) if share else None))
    try:
        s = float(setting)
    except (TypeError, ValueError):
        raise ValueError(f"time dilation must be a number >= 1, 'auto' or 'none' (got {setting!r})") from None
    if not math.isfinite(s) or s < 1:
        raise ValueError(f"time dilation factor must be >= 1, 'auto' or 'none' (got {setting!r})")
    reasons = [f"fixed at {s:g}"] + ([why_compute] if compute > 1 else [])
    return _with_cap_reason(Choice(s, "fixed", compute, None, tuple(reasons)))


@dataclass(frozen=True)
class Machine:
    """One machine of a testbed over several hosts (hosts with one boot id share it: emulated hosts)."""

    hosts: tuple[str, ...]
    workers: tuple[str, ...]                 # the workers placed on its hosts: one rank each
    cores: int
    gpus: int
    constants: MachineConstants | None       # its calibration, if it has one this boot

    @property
    def name(self) -> str:
        return "+".join(self.hosts)


def choose_over_machines(setting: float | str | None, topo: Topology, plan: NetworkPlan,
                         machines: list[Machine]) -> Choice:
    """choose() for a testbed over several machines, one factor for all of them: compute and traffic
    are accounted per machine (its ranks per device; its ranks' share of the data-parallel traffic,
    at its calibrated per-byte cost, against its cores) and the most loaded machine decides."""
    ranked = [m for m in machines if m.workers]
    compute, why_compute = 1.0, []
    for m in ranked:
        c = auto_factor(len(m.workers), m.gpus, m.cores)
        devices = f"{m.gpus} GPU(s)" if m.gpus else f"{m.cores} CPU core(s)"
        why_compute.append(f"{m.name}: {len(m.workers)} ranks share {devices}: compute needs s >= {c:.3g}")
        compute = max(compute, c)
    loaded = [w for w in why_compute if not w.endswith("s >= 1")]
    if setting is None or (isinstance(setting, str) and setting.strip().lower() in ("none", "off")):
        return Choice(1.0, "none", compute, None, ("no dilation (real time)", *loaded))
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        reasons, network = list(why_compute), None
        workers = list(topo.workers)
        n = len(workers)
        for m in ranked:
            if m.constants is None:
                reasons.append(f"{m.name}: traffic not accounted for: not calibrated this boot "
                               "(testbed calibrate there)")
                continue
            if n < 2 or m.constants.beta_s_per_byte <= 0:
                continue
            p = predict(topo, plan, "all_reduce", BIG_MESSAGE, workers, for_hosts(m.constants, topo.host_rate),
                        placements=1)
            if p.bandwidth_s <= 0:
                continue
            load = _host_load(len(m.workers), n, p.bandwidth_s, m.constants)
            margin = 1.0 if host_beta(topo.host_rate) is None else HOST_MARGIN
            need = max(1.0, margin * load / (max(1, m.cores) * HEADROOM))
            reasons.append(f"{m.name}: its ranks' data-parallel traffic at full rate keeps {load:.2g} core(s) busy "
                           f"against {m.cores} core(s): the network needs s >= {need:.3g}")
            network = max(network or 1.0, need)
        s = _round_up(max(1.0, compute, network or 1.0))
        cpus_only = not any(m.gpus for m in ranked)
        return _with_cap_reason(Choice(s, "auto", compute, network, tuple(reasons),
                                       cap_divisor=compute if cpus_only else None))
    try:
        s = float(setting)
    except (TypeError, ValueError):
        raise ValueError(f"time dilation must be a number >= 1, 'auto' or 'none' (got {setting!r})") from None
    if not math.isfinite(s) or s < 1:
        raise ValueError(f"time dilation factor must be >= 1, 'auto' or 'none' (got {setting!r})")
    return _with_cap_reason(Choice(s, "fixed", compute, None, (f"fixed at {s:g}", *loaded)))


CPU_CAP_FLOOR = 0.001   # cores: the kernel's least CPU quota, 1 ms per 1 s period (runtime/cgroups.cfs)


def _with_cap_reason(choice: Choice) -> Choice:
    if not choice.cap_cpu:
        return choice
    divisor = 1 / choice.cap_cores
    if choice.rank_cores > 1.0001:
        why = (f"s = {choice.factor:g} is above the {choice.compute:.3g} that sharing the CPUs gives, for the "
               f"traffic: each worker's CPU is capped at 1/{divisor:.3g} of its cores, its share of this "
               f"machine, so that its rank has {choice.rank_cores:.2f} of this machine's cores in emulated time "
               f"to move its bytes (a cap of 1/{choice.factor:g} would leave it one core's rate here, below the "
               f"links'); its compute then runs {choice.rank_cores:.2f}x as fast as on one core here")
    else:
        why = (f"s = {choice.factor:g} is above the {choice.compute:.3g} that sharing the CPUs gives: each "
               f"worker's CPU is capped at 1/{divisor:g} of its cores so that compute slows by {choice.factor:g} too")
    if choice.cap_cores < CPU_CAP_FLOOR:
        why += (f"; but the kernel caps a group at {CPU_CAP_FLOOR:g} core at the least, so a one-core worker's "
                f"compute slows by {1 / CPU_CAP_FLOOR:g}, not {divisor:g}: it runs "
                f"{divisor * CPU_CAP_FLOOR:.2f}x faster than asked (fewer workers, or "
                "more CPUs per worker, keep it exact)")
    return replace(choice, reasons=choice.reasons + (why,))


def undilate(seconds: float, s: float) -> float:
    """A time measured under dilation s, as the emulated cluster would see it."""
    return seconds / s


def dilate_topology(topo: Topology, s: float, cap_cpu: bool = False, cap_cores: float | None = None) -> Topology:
    """The topology the kernel builds under dilation s (the same object when s == 1).

    Links run at bandwidth/s and delay*s. cap_cpu: every worker also gets cap_cores (default
    1/s) of its CPUs (`cpus`, one core when unset: a rank's own core, as the calibration measures
    it), for a factor above what sharing the machine already slows compute by (Choice.cap_cpu,
    Choice.cap_cores).
    """
    if s == 1:
        return topo
    links = [replace(link, ab=dilate(link.ab, s), ba=dilate(link.ba, s)) for link in topo.links]
    nodes = topo.nodes
    if cap_cpu:
        share = cap_cores if cap_cores is not None else 1.0 / s
        nodes = {name: replace(n, cpus=(n.cpus or 1.0) * share) if n.is_worker else n for name, n in nodes.items()}
    return replace(topo, links=links, nodes=nodes)
