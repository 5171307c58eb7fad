"""The reference model: how long a collective takes on the emulated cluster. Pure.

What a run is judged against (`testbed report`'s verdict, `make fidelity`, the
main job). Given a topology (its links' nominal profiles), its routing plan,
the ranks (the worker of each rank, in rank order), a collective, a message
size and the backend, it predicts the time the emulated cluster needs.

An algorithm is a list of phases; a phase is a set of concurrent flows
(rank -> rank, bytes), repeated `count` times. One phase takes

    the slowest flow's trips x path delay + max(alpha x messages, time to move its bytes)

A message's software cost is paid while its bytes are on the wire: alpha is
measured on small messages, where it is mostly the ranks' wake-ups, and a step
whose transfer outlasts it does not pay it again (measured: 1 MiB steps took
the links' time, docs/fidelity.md). gloo's ring all_reduce pays a segment's
cost after the wire as well (see its algorithm below).

- alpha: the software cost of one message (a send and the matching receive,
  wake-ups included), calibrated on this machine with two ranks on their own
  cores (`MachineConstants`).
- path delay: the sum of the nominal delays of the link directions on the
  flow's path (what the topology file asks for, not what the emulation adds),
  paid twice for gloo (its receiver first tells the sender it is ready: a
  round trip per message), once for NCCL (PATH_TRIPS).
- moving the bytes: a smooth maximum (a 6-norm, fitted on this machine
  between 1 and 10 Gbit/s) of the flow's network time and its host time.
  Network: the flow's bytes over its max-min fair share of every directed link
  on its path, at the link's TCP goodput (payload per frame: (mtu - 52) /
  (mtu + 14)). Host: beta, the calibrated cost per byte of one rank with its
  own core, times the flows the rank sends at once, charged on the bytes it
  sends (all_gather: on its whole output, which gloo copies whatever n is).

So an oversubscribed core or a dumbbell's bottleneck is modelled, not only
the host link. ECMP: each (sender, receiver) pair is one TCP connection
(gloo and NCCL's socket transport keep one per peer) that the kernel hashes
onto one of the equal-cost paths. Where that choice matters, every placement
is evaluated (or a seeded sample of them when there are too many): `lo_s` and
`hi_s` bound the prediction, `time_s` is the median placement, what a random
hash gives most often.

Algorithms (what the backends do, from their sources):
  gloo  all_reduce: ring, reduce-scatter then all-gather, rank r sends to r-1,
        2(n-1) steps of S/n (fewer messages for fewer than 2(n-1) elements:
        _gloo_ring_messages). A step's bytes go in k segments of at most 1 MiB
        (k >= 2, gloo_segments), two in flight: a segment's software cost
        (alpha / 2) is paid while the other is on the wire, so a step takes
        max(transfer + alpha/2, k alpha/2 + transfer/k), not alpha + transfer.
        all_gather: ring to r+1, n-1 steps of S/n (S is
        the gathered size). reduce_scatter: gloo runs a full all_reduce of the
        input S. broadcast: binomial tree, ceil(log2 n) rounds of the whole S.
        all_to_all: every rank posts its n-1 sends of S/n at once; a pair's two
        directions take turns (two phases, _gloo_all_to_all) where it sends
        GLOO_TURNS_BYTES or more each way. barrier:
        dissemination, ceil(log2 n) rounds of empty messages. send_recv: one
        flow of S.
  nccl  ring for all_reduce (2(n-1) steps of S/n, to r+1), all_gather and
        reduce_scatter (n-1 steps of S/n); broadcast a pipelined ring;
        all_to_all every send at once, both directions together; the rest as
        gloo. NCCL's tree, NVLS and CollNet algorithms are not modelled.
Message sizes follow nccl-tests: all_gather's S is the output, reduce_scatter's
the input, all_to_all's one rank's whole buffer.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from testbed.topology.fairness import max_min_rates
from testbed.topology.model import Topology
from testbed.topology.plan import NetworkPlan
from testbed.topology.units import format_size

# How many times a message's path delay is paid: gloo's TCP transport sends data only once the
# receiver has said it posted the buffer (a notice, then the data: one round trip; measured here
# over a 5 ms link, every gloo collective step and send took ~10 ms); NCCL's receivers post
# ahead (one way).
PATH_TRIPS = {"gloo": 2, "nccl": 1}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv", "barrier")
BACKENDS = ("gloo", "nccl")
SMOOTH_P = 6.0             # the smooth maximum's norm (see the module text)
EXHAUSTIVE_PLACEMENTS = 512  # evaluate every ECMP placement up to this many
SAMPLED_PLACEMENTS = 96      # otherwise a seeded sample of this many,
GREEDY_MAX_PAIRS = 64        # plus a greedy best and worst placement when this few connections choose
TCP_IP_HEADERS = 52        # IPv4 20 + TCP 20 + timestamps 12
ETH_HEADER = 14


class ModelError(ValueError):
    """The model cannot answer (an unknown collective, a rank without a path)."""


@dataclass(frozen=True)
class MachineConstants:
    """What this machine's software costs, measured (testbed.jobs.calibration).

    alpha_s and beta_s_per_byte are all_reduce's; `ops` holds each collective's own pair where
    it was measured (an all_gather copies more than it reduces, a send does neither), and
    `for_op` falls back to all_reduce's for the others.
    """

    alpha_s: float                 # software cost of one message, seconds
    beta_s_per_byte: float         # host cost per byte one rank sends, s/B (0: the host is never the limit)
    source: str = "uncalibrated"   # where the numbers come from, printed with every prediction
    ops: tuple[tuple[str, float, float], ...] = ()   # (collective, alpha_s, beta_s_per_byte)
    spread: float = 0.0            # the calibration's relative standard error over its repetitions (0: unknown)
    beta_slow_s_per_byte: float = 0.0   # the slowest per-byte cost this boot measured (0: beta's): auto plans for it

    @property
    def planning_beta(self) -> float:
        """The per-byte cost `auto` plans this machine's host work for: the slow end of what was measured
        (calibrations of one boot put it 0.79-1.36 ns/B apart; docs/fidelity.md), never below beta."""
        return max(self.beta_s_per_byte, self.beta_slow_s_per_byte)

    def for_op(self, op: str) -> tuple[float, float]:
        for name, a, b in self.ops:
            if name == op:
                return a, b
        return self.alpha_s, self.beta_s_per_byte

    def describe(self) -> str:
        rate = "no host cost" if self.beta_s_per_byte <= 0 else f"host {8 / self.beta_s_per_byte / 1e9:.2f} Gbit/s per rank"
        more = f", {len(self.ops)} collectives measured" if self.ops else ""
        spread = f", spread +-{100 * self.spread:.0f}%" if self.spread else ""
        if self.beta_s_per_byte > 0 and self.planning_beta > self.beta_s_per_byte * 1.005:
            spread += f", slowest this boot {8 / self.planning_beta / 1e9:.2f} Gbit/s per rank"
        return f"all_reduce: alpha {self.alpha_s * 1e6:.0f} us/message, {rate}{more}{spread} ({self.source})"

    def to_json(self) -> dict[str, Any]:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte, "source": self.source,
                "ops": {name: {"alpha_s": a, "beta_s_per_byte": b} for name, a, b in self.ops},
                "spread": self.spread, "beta_slow_s_per_byte": self.beta_slow_s_per_byte}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MachineConstants":
        ops = tuple((str(k), float(v["alpha_s"]), float(v["beta_s_per_byte"]))
                    for k, v in (data.get("ops") or {}).items())
        spread = data.get("spread") or 0.0
        slow = data.get("beta_slow_s_per_byte") or 0.0
        return cls(alpha_s=float(data["alpha_s"]), beta_s_per_byte=float(data["beta_s_per_byte"]),
                   source=str(data.get("source", "uncalibrated")), ops=ops,
                   spread=float(spread) if isinstance(spread, (int, float)) and 0 <= spread < 10 else 0.0,
                   beta_slow_s_per_byte=float(slow) if isinstance(slow, (int, float)) and 0 <= slow < 1e-3 else 0.0)


# A network-only model (no software cost, no host limit): what the links alone allow.
NETWORK_ONLY = MachineConstants(alpha_s=0.0, beta_s_per_byte=0.0, source="links only")


def host_beta(host_rate: float | str | None) -> float | None:
    """The host cost per byte a topology declares (Topology.host_rate): 0 for network-bound hosts
    (the default), 8 / rate for a rate per rank, None for "this-machine" (the calibrated cost)."""
    if host_rate is None or host_rate == "network-bound":
        return 0.0
    if host_rate == "this-machine":
        return None
    return 8.0 / float(host_rate)


def describe_hosts(host_rate: float | str | None) -> str:
    if host_rate is None or host_rate == "network-bound":
        return "network-bound hosts (no host cost per byte)"
    if host_rate == "this-machine":
        return "hosts like this machine (one core per rank, calibrated)"
    return f"hosts moving {float(host_rate) / 1e9:.3g} Gbit/s per rank"


def for_hosts(constants: MachineConstants, host_rate: float | str | None) -> MachineConstants:
    """The constants the model judges with on a topology's declared hosts: this machine's per-message
    cost (alpha: what every message costs here, dilated or not), the declared host cost per byte."""
    beta = host_beta(host_rate)
    if beta is None:
        return constants
    return MachineConstants(constants.alpha_s, beta, f"{constants.source}; {describe_hosts(host_rate)}",
                            tuple((op, a, beta) for op, a, _ in constants.ops), constants.spread)


def with_alpha(constants: MachineConstants, alpha_s: float, spread: float, source: str) -> MachineConstants:
    """The constants with all_reduce's per-message cost replaced (a run's own measurement); each other
    collective's alpha keeps its calibrated ratio to all_reduce's."""
    scale = alpha_s / constants.alpha_s if constants.alpha_s > 0 else 1.0
    ops = tuple((op, (a * scale if constants.alpha_s > 0 else alpha_s), b) for op, a, b in constants.ops)
    where = f"alpha {source}; {constants.source}" if source else constants.source
    return MachineConstants(alpha_s, constants.beta_s_per_byte, where, ops, spread)


@dataclass(frozen=True)
class Flow:
    src: int          # rank
    dst: int          # rank
    nbytes: float     # on the wire
    host_bytes: float | None = None   # what the sender's host cost is charged on (None: nbytes)

    @property
    def host(self) -> float:
        return self.nbytes if self.host_bytes is None else self.host_bytes


@dataclass(frozen=True)
class Phase:
    flows: tuple[Flow, ...]
    count: int = 1         # how many times the phase repeats (ring steps)
    messages: float = 1.0  # messages a rank sends per repetition (alpha is paid per message; gloo's
    #                        small all_reduce sends fewer than one per step: see _gloo_ring_messages)
    segments: int = 0      # gloo's ring: the segments a step's bytes go in, two in flight (0: one
    #                        message, its software cost under its transfer: the longer of the two)


@dataclass(frozen=True)
class Prediction:
    op: str
    nbytes: int
    ranks: int
    backend: str
    time_s: float            # the median ECMP placement
    lo_s: float              # the best placement
    hi_s: float              # the worst placement
    latency_s: float         # path delays and what alpha adds beyond the transfer (in time_s)
    bandwidth_s: float       # bytes over shares (in time_s)
    bottleneck: str          # what limits the slowest flow of the heaviest phase
    placements: str          # "single path", "all N placements", "N sampled of M"
    constants: MachineConstants
    delay_s: float = 0.0     # the path delays in latency_s: the links' declared delays, exact (the rest is alpha's)

    @property
    def software_s(self) -> float:
        """alpha's part of latency_s: what it adds beyond the transfer it runs under (how far alpha's
        uncertainty moves the time is not this where alpha and the transfer are close: the
        verdict predicts again with alpha at either end of its spread)."""
        return max(0.0, self.latency_s - self.delay_s)

    @property
    def bounded(self) -> bool:
        return self.hi_s > self.lo_s * (1 + 1e-9)

    def error(self, measured_s: float) -> float:
        """Relative error of a measurement against the model: 0 inside [lo, hi], else from the nearer bound."""
        if measured_s < self.lo_s:
            return measured_s / self.lo_s - 1 if self.lo_s > 0 else 0.0
        if measured_s > self.hi_s:
            return measured_s / self.hi_s - 1 if self.hi_s > 0 else math.inf
        return 0.0

    def describe(self) -> str:
        span = f" (ECMP bounds {self.lo_s * 1e3:.3g}-{self.hi_s * 1e3:.3g} ms)" if self.bounded else ""
        return (f"{self.op} {format_size(self.nbytes)} on {self.ranks} ranks ({self.backend}): {self.time_s * 1e3:.3g} ms"
                f"{span}; latency {self.latency_s * 1e3:.3g} ms, bandwidth {self.bandwidth_s * 1e3:.3g} ms, "
                f"limited by {self.bottleneck}; {self.constants.describe()}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["constants"] = self.constants.to_json()
        return d


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw = algbw x this: what each rank's link carries relative to S/t."""
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


# -- algorithms --------------------------------------------------------------------------------------------


def phases(op: str, nbytes: float, n: int, backend: str = "gloo", root: int = 0) -> list[Phase]:
    """The phases the backend's algorithm runs for one collective of `nbytes` on `n` ranks."""
    if op not in COLLECTIVES:
        raise ModelError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")
    if backend not in BACKENDS:
        raise ModelError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if n < 1:
        raise ModelError("a collective needs at least one rank")
    if op == "send_recv":
        if n < 2:
            raise ModelError("send_recv needs two ranks")
        return [Phase((Flow(0, 1, nbytes),))]
    if n == 1:
        return []
    S = float(nbytes)

    def ring(step: int, chunk: float, count: int) -> Phase:
        return Phase(tuple(Flow(r, (r + step) % n, chunk) for r in range(n)), count=count)

    if op == "barrier":
        rounds = math.ceil(math.log2(n))
        return [Phase(tuple(Flow(r, (r + (1 << i)) % n, 0.0) for r in range(n))) for i in range(rounds)]
    if op == "all_to_all":
        return _gloo_all_to_all(S, n) if backend == "gloo" and S / n >= GLOO_TURNS_BYTES else [_all_at_once(S, n)]
    if backend == "gloo":
        if op in ("all_reduce", "reduce_scatter"):
            if S <= 0:
                return []   # gloo returns at once for an empty buffer
            return [Phase(ring(-1, S / n, 2 * (n - 1)).flows, count=2 * (n - 1),
                          messages=_gloo_ring_messages(S, n), segments=gloo_segments(S, n))]
        if op == "all_gather":   # host work: copies of the whole output, whatever n (measured here)
            return [Phase(tuple(Flow(r, (r + 1) % n, S / n, S / (n - 1)) for r in range(n)), count=n - 1)]
        if op == "broadcast":
            return _binomial_broadcast(S, n, root)
    else:  # nccl
        if op == "all_reduce":
            return [ring(+1, S / n, 2 * (n - 1))]
        if op in ("all_gather", "reduce_scatter"):
            return [ring(+1, S / n, n - 1)]
        if op == "broadcast":  # pipelined chain root -> root+1 -> ...: the data once, the latency n-1 times
            chain = tuple(Flow((root + i) % n, (root + i + 1) % n, S) for i in range(n - 1))
            return [Phase(chain), Phase(tuple(Flow(f.src, f.dst, 0.0) for f in chain[:1]), count=n - 2)] \
                if n > 2 else [Phase(chain)]
    raise ModelError(f"{op} is not modelled for {backend}")


# From what a pair sends each way in one gloo all_to_all, its two directions take turns. Measured on a
# 2-worker 10 Gbit/s star at s = 6.2 (real time, whole calls): 512 KiB each way took one direction's
# time, 2 MiB 1.69x it, 8 MiB 2x. Where the boundary comes from (the kernel's socket buffers, the
# ranks' stagger) is not pinned down, and across a 5 ms WAN link 8 MiB each way went together once
# (docs/fidelity.md).
GLOO_TURNS_BYTES = 2 << 20


def _all_at_once(S: float, n: int) -> Phase:
    """all_to_all with every send in flight together: n-1 flows of S/n from each rank."""
    return Phase(tuple(Flow(r, (r + i) % n, S / n) for r in range(n) for i in range(1, n)), messages=n - 1)


def _gloo_all_to_all(S: float, n: int) -> list[Phase]:
    """gloo's all_to_all: a pair's two directions take turns. Rank r posts, for i = 1..n-1, its send
    to r+i and then its receive from r-i. A send goes out once the peer's "ready to receive" notice
    has come, and that notice travels on the pair's one connection behind whatever data is already
    queued there. So for a pair a, b = a+i with i < n-i, a's data to b goes first (b announced its
    receive in round i, before its own send in round n-i), and b's data to a waits until a's notice,
    posted in round n-i behind a's data, arrives: two phases, each direction in one. Where i = n-i
    the pair races; the lower rank is taken to go first. Measured here on a 2-worker star: the two
    directions alternate at the link's full rate, never both at once (docs/fidelity.md). Ranks that
    arrive together send every notice before any data, and the directions go together; that is what
    was measured below GLOO_TURNS_BYTES each way (phases() decides by it)."""
    forward, backward = [], []
    for a in range(n):
        for i in range(1, n):
            b = (a + i) % n
            first = i < n - i or (2 * i == n and a < b)
            (forward if first else backward).append(Flow(a, b, S / n))
    half = (n - 1) / 2   # each phase pays half of a rank's n-1 messages
    return [Phase(tuple(forward), messages=half), Phase(tuple(backward), messages=half)]


GLOO_ELEMENT_BYTES = 4   # float32, what DDP and the benchmarks reduce (the model sees bytes, not dtypes)


def _gloo_ring_messages(S: float, n: int) -> float:
    """Messages per ring step a rank of gloo's all_reduce sends, relative to one per step.

    gloo cuts the buffer into 2n segments (two in flight per rank), sends 2(n-1) of them per
    phase, and sends nothing for a segment past the buffer's end. A buffer of e < 2(n-1) elements
    has e segments of one element, so its busiest rank sends e per phase, not 2(n-1): on 16 ranks
    an 8-byte all_reduce measured 1.2-2.2 ms where a message per step gave 23 ms. The data still
    passes every hop of the ring in turn, so the path delays stay 2(n-1)."""
    elements = math.ceil(S / GLOO_ELEMENT_BYTES)
    return min(elements, 2 * (n - 1)) / (2 * (n - 1))


GLOO_MAX_SEGMENT = 1 << 20   # gloo's allreduce.cc: kMaxSegmentSize


def gloo_segments(S: float, n: int) -> int:
    """How many segments each ring step of gloo's all_reduce sends: gloo cuts the buffer into
    max(2n, ceil(S / 1 MiB)) segments, rounded up to a multiple of n, and a step moves one rank's
    share of them, at least 2, with two in flight."""
    total = max(2 * n, math.ceil(S / GLOO_MAX_SEGMENT))
    return math.ceil(total / n)


def _binomial_broadcast(S: float, n: int, root: int) -> list[Phase]:
    """gloo's broadcast: a binomial tree over virtual ranks v = (rank - root) mod n. In round i
    every v < 2^i that holds the data sends the whole S to v + 2^i. gloo posts a rank's sends
    at once, but one I/O thread writes them in order, and measured here the tree takes about
    ceil(log2 n) rounds of S (concurrent sends sharing the root's link were 1.6x too slow)."""
    out = []
    for i in range(math.ceil(math.log2(n))):
        flows = tuple(Flow((v + root) % n, (v + (1 << i) + root) % n, S) for v in range(1 << i) if v + (1 << i) < n)
        out.append(Phase(flows))
    return out


# -- the network: directed links, paths, shares ------------------------------------------------------------


def goodput(mtu: int) -> float:
    """TCP payload per byte on the wire (IPv4, timestamps, Ethernet header as HTB counts it)."""
    return (mtu - TCP_IP_HEADERS) / (mtu + ETH_HEADER)


@dataclass
class _Net:
    capacity: dict[tuple[str, str], float]   # directed link -> payload bytes/s (inf: unshaped)
    delay: dict[tuple[str, str], float]      # directed link -> seconds
    choices: dict[tuple[str, str], list[tuple[tuple[str, str], ...]]] = field(default_factory=dict)

    def options(self, plan: NetworkPlan, a: str, b: str) -> list[tuple[tuple[str, str], ...]]:
        """The ECMP choices of worker a -> worker b, each as the directed links it crosses."""
        key = (a, b)
        if key not in self.choices:
            if a == b:
                self.choices[key] = [()]
            else:
                paths = plan.paths(a, b)
                if not paths:
                    raise ModelError(f"no route from {a} to {b}")
                self.choices[key] = [tuple(zip(p, p[1:])) for p in paths]
        return self.choices[key]


def _net(topo: Topology) -> _Net:
    cap: dict[tuple[str, str], float] = {}
    delay: dict[tuple[str, str], float] = {}
    for link in topo.links:
        for u, v, prof in ((link.a, link.b, link.ab), (link.b, link.a, link.ba)):
            bw = prof.bandwidth_bps
            cap[(u, v)] = math.inf if bw is None else bw / 8 * goodput(prof.mtu)
            delay[(u, v)] = prof.delay_s
    return _Net(cap, delay)


def _smooth_max(x: float, y: float) -> float:
    if x == 0 or y == 0:
        return max(x, y)
    return (x ** SMOOTH_P + y ** SMOOTH_P) ** (1 / SMOOTH_P)


def _link_name(link: tuple[str, str]) -> str:
    return f"{link[0]}->{link[1]}"


def _phase_time(phase: Phase, routes: Sequence[tuple[tuple[str, str], ...]], net: _Net, alpha: float, beta: float,
                trips: int) -> tuple[float, float, float, float, str]:
    """(time, latency part, bandwidth part, the path delays in the latency part, bottleneck) of one
    repetition of a phase; a message crosses its path `trips` times before its data is in (gloo: 2,
    see PATH_TRIPS)."""
    flows = phase.flows
    net_rates = max_min_rates(routes, net.capacity)
    sending: dict[int, int] = {}
    for f in flows:
        sending[f.src] = sending.get(f.src, 0) + 1
    slowest, lat_of, bw_of, why = -1.0, 0.0, 0.0, "nothing (no data)"
    for f, route, rate in zip(flows, routes, net_rates):
        t_net = 0.0 if rate == math.inf else f.nbytes / rate
        t_host = f.host * beta * sending[f.src]
        moving = _smooth_max(t_net, t_host)
        delay = trips * sum(net.delay[l] for l in route)
        t = delay + moving
        if t > slowest:
            slowest, lat_of, bw_of = t, delay, moving
            if f.nbytes == 0:
                why = "latency (empty messages)"
            elif t_host >= t_net and t_host > 0:
                why = (f"host (rank {f.src}: {sending[f.src]} flow(s) at "
                       f"{8 / (beta * sending[f.src]) / 1e9:.3g} Gbit/s of host work)")
            elif t_net == 0:
                why = "nothing (unshaped links, no host cost)"
            else:
                tight = min((l for l in route if net.capacity[l] != math.inf),
                            key=lambda l: net.capacity[l], default=None)
                why = f"link share {8 * rate / 1e9:.3g} Gbit/s" + (f" (on {_link_name(tight)})" if tight else "")
    software = alpha * phase.messages
    if phase.segments >= 2 and phase.messages >= 1 and bw_of > 0:
        # gloo's ring: a step's bytes go in k segments, two in flight, and one thread pays each
        # segment's software cost (alpha / 2: alpha, measured on small messages, is a step of two).
        # One segment's cost is paid while the other is on the wire: the step takes the wire's
        # time and the last segment's cost, or, when the software is the slower, k costs and one
        # segment's transfer (docs/fidelity.md, "gloo's two segments in flight")
        k, a = phase.segments, alpha / 2
        step = max(bw_of + a, k * a + bw_of / k)
        return lat_of + step, lat_of + step - bw_of, bw_of, lat_of, why
    # one message a step: its software cost runs while its bytes move (the module text)
    step = max(software, bw_of)
    return lat_of + step, lat_of + step - bw_of, bw_of, lat_of, why


def predict(topo: Topology, plan: NetworkPlan, op: str, nbytes: int, rank_workers: Sequence[str],
            constants: MachineConstants, backend: str = "gloo", root: int = 0, seed: int = 0,
            placements: int | None = None) -> Prediction:
    """The emulated cluster's time for one collective (see the module text).

    placements: evaluate at most this many ECMP placements (default: every one up to
    EXHAUSTIVE_PLACEMENTS, else a sample of SAMPLED_PLACEMENTS and two greedy ones); 1 is a
    quick estimate from the first path of every connection."""
    n = len(rank_workers)
    for w in rank_workers:
        if w not in topo.nodes or not topo.nodes[w].is_worker:
            raise ModelError(f"rank on {w!r}, which is not a worker of {topo.name}")
    ph = phases(op, nbytes, n, backend, root)
    alpha, beta = constants.for_op(op)
    net = _net(topo)
    pairs = sorted({(rank_workers[f.src], rank_workers[f.dst]) for p in ph for f in p.flows})
    options = {pair: net.options(plan, *pair) for pair in pairs}
    free = [pair for pair in pairs if len(options[pair]) > 1]
    total = math.prod(len(options[p]) for p in free) if free else 1

    cache: dict[tuple, tuple[float, float, float, str, float]] = {}

    def evaluate(choice: dict[tuple[str, str], int]) -> tuple[float, float, float, str, float]:
        key = tuple(choice.get(p, 0) for p in free)
        if key not in cache:
            t_all = lat = bw = delays = 0.0
            worst_phase = (-1.0, "nothing")
            for p in ph:
                routes = [options[(rank_workers[f.src], rank_workers[f.dst])]
                          [choice.get((rank_workers[f.src], rank_workers[f.dst]), 0)] for f in p.flows]
                t, l_, b, d, why = _phase_time(p, routes, net, alpha, beta, PATH_TRIPS[backend])
                t_all += t * p.count
                lat += l_ * p.count
                bw += b * p.count
                delays += d * p.count
                if b * p.count > worst_phase[0]:
                    worst_phase = (b * p.count, why)
            cache[key] = (t_all, lat, bw, worst_phase[1], delays)
        return cache[key]

    if placements is not None and total > placements:
        rng = random.Random(seed)
        choices = [{}] + [{p: rng.randrange(len(options[p])) for p in free} for _ in range(placements - 1)]
        how = f"{len(choices)} ECMP placement(s) of {_big(total)}"
    elif total <= EXHAUSTIVE_PLACEMENTS:
        choices = [dict(zip(free, combo)) for combo in itertools.product(*(range(len(options[p])) for p in free))]
        how = "single path" if total == 1 else f"all {total} ECMP placements"
    else:
        rng = random.Random(seed)
        choices = [{p: rng.randrange(len(options[p])) for p in free} for _ in range(SAMPLED_PLACEMENTS)]
        if len(free) <= GREEDY_MAX_PAIRS:
            choices += _greedy(free, options, evaluate)
        how = f"{len(choices)} ECMP placements sampled of {_big(total)}"
    results = sorted((evaluate(ch) for ch in choices), key=lambda r: r[0])
    mid = results[(len(results) - 1) // 2]
    return Prediction(op=op, nbytes=int(nbytes), ranks=n, backend=backend, time_s=mid[0], lo_s=results[0][0],
                      hi_s=results[-1][0], latency_s=mid[1], bandwidth_s=mid[2], bottleneck=mid[3], placements=how,
                      constants=constants, delay_s=mid[4])


def _greedy(free: list, options: dict, evaluate) -> list[dict]:
    """Two placements built one connection at a time: each choice the best (resp. worst) so far."""
    out = []
    for pick in (min, max):
        choice: dict = {}
        for pair in free:
            choice[pair] = pick(range(len(options[pair])), key=lambda i: evaluate({**choice, pair: i})[0])
        out.append(choice)
    return out


def _big(x: int) -> str:
    return str(x) if x < 10**6 else f"~10^{int(math.log10(x))}"


def cost_terms(op: str, nbytes: float, n: int = 2, backend: str = "gloo") -> tuple[float, float]:
    """(messages, bytes) a collective costs on n ranks when only software and host limit it:
    time = messages x alpha + bytes x beta. What the calibration divides its measurements by. (The
    model takes the longer of a step's software and its bytes where it has one message, not their
    sum: on the calibration's smallest size the bytes' host time is ~0.5% of alpha, which the
    additive fit takes off alpha, within the calibration's own spread.)"""
    messages = nbytes_total = 0.0
    for p in phases(op, nbytes, n, backend):
        messages += p.count * p.messages
        nbytes_total += p.count * max((f.host for f in p.flows), default=0.0)
    return messages, nbytes_total


def ring_time(n: int, nbytes: float, bandwidth_bps: float, alpha_s: float = 0.0) -> float:
    """The textbook ring all_reduce: 2(n-1) alpha + 2(n-1)/n S/B (B in bit/s, the link's raw rate)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * nbytes / (bandwidth_bps / 8)
