"""What a topology offers, computed without building it. Pure functions of a Topology.

- `counts`: workers, switches, links, tiers, GPUs.
- `tier_rows`: one row per link tier with its link profile(s), formatted.
- `bisection`: the bisection bandwidth, i.e. the smallest total capacity of the
  links one must cut to split the *workers* into two halves (sizes floor(n/2)
  and ceil(n/2)); switches may fall on either side. A link's capacity is the
  smaller of its two directions' bandwidths (so the figure holds in both
  directions); an unshaped link (bandwidth None) is infinite, and a topology
  whose every balanced cut crosses only unshaped links has bisection None.
  How it is computed (the `method` field says which):

  * ``formula``: generated fat-tree (k^3/8 * the slowest tier's bandwidth) or
    leaf-spine with an even number of leaves (min(n/2 * host, leaves/2 *
    spines * uplink)), when every link of a tier has the same bandwidth.
  * ``exhaustive``: up to 12 workers every balanced bipartition is tried. Exact.
  * ``heuristic``: otherwise a set of candidate bipartitions is tried (the
    worker order, which generators number rack by rack; workers ordered by
    hop distance from a few seed workers; each improved by pairwise swaps while
    the graph is small). The result is an upper bound on the true bisection
    (the exact problem is NP-hard); on regular fabrics it is usually exact.

  Each bipartition's cut is exact: a max-flow/min-cut between the two worker
  halves (networkx), which places the switches optimally.
- `oversubscription`: per switch layer (a switch's layer is its hop distance
  to the nearest worker: 1 = top-of-rack/edge/leaf, 2 = aggregation/spine,
  ...), downlink capacity (toward workers, measured upward) divided by uplink
  capacity (upward). A link between two switches of the same layer (a
  dumbbell's bottleneck, a ring) counts as an uplink of both. 1.0 is
  non-blocking; 4.0 means 4:1. A layer without uplinks (the top) has no ratio.
- `ecmp_summary`: for every pair of workers on different access switches, the
  number of equal-cost shortest switch paths between their access switches
  (the routing plan's definition, see plan.NetworkPlan.ecmp_paths).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from testbed.topology.model import Link, LinkProfile, Topology
from testbed.topology.plan import hop_distances
from testbed.topology.units import format_bandwidth, format_time

__all__ = ["counts", "tier_rows", "TierRow", "Bisection", "bisection", "OversubRow", "oversubscription",
           "EcmpSummary", "ecmp_summary", "switch_layers", "access_switch", "link_capacity", "describe"]

INF = math.inf
EXHAUSTIVE_MAX_WORKERS = 12


# -- counts and tiers --------------------------------------------------------------------------------------


def counts(topo: Topology) -> dict[str, int]:
    return {
        "workers": len(topo.workers),
        "switches": len(topo.switches),
        "links": len(topo.links),
        "tiers": len(topo.tiers()),
        "gpus": sum(n.gpus for n in topo.nodes.values()),
    }


@dataclass(frozen=True)
class TierRow:
    tier: str
    links: int
    bandwidth: str
    delay: str
    jitter: str
    loss: str
    queue: str
    mtu: str
    asymmetric: int = 0   # links of this tier whose two directions differ

    def cells(self) -> list[str]:
        return [self.tier, str(self.links), self.bandwidth, self.delay, self.jitter, self.loss, self.queue,
                self.mtu]


TIER_COLUMNS = ("tier", "links", "bandwidth", "delay", "jitter", "loss", "queue", "mtu")


def _fmt_loss(x: float) -> str:
    return "0" if x == 0 else f"{x * 100:.6g}%"


def _fmt_values(values: Iterable[Any], fmt) -> str:
    """One value, a short list, or 'min..max' of the distinct values (None first: 'unshaped'/'auto')."""
    distinct = sorted(set(values), key=lambda v: (v is not None, v if v is not None else 0))
    if len(distinct) <= 3:
        return ", ".join(fmt(v) for v in distinct)
    return f"{fmt(distinct[0])}..{fmt(distinct[-1])} ({len(distinct)} values)"


def tier_rows(topo: Topology) -> list[TierRow]:
    """One row per tier (in first-appearance order); both directions of every link count."""
    rows = []
    for tier in topo.tiers():
        links = list(topo.iter_links(tier))
        profiles = [p for link in links for p in (link.ab, link.ba)]
        rows.append(TierRow(
            tier=tier,
            links=len(links),
            bandwidth=_fmt_values((p.bandwidth_bps for p in profiles),
                                  lambda v: "unshaped" if v is None else format_bandwidth(v)),
            delay=_fmt_values((p.delay_s for p in profiles), format_time),
            jitter=_fmt_values((p.jitter_s for p in profiles), format_time),
            loss=_fmt_values((p.loss for p in profiles), _fmt_loss),
            queue=_fmt_values((p.queue for p in profiles), lambda v: "auto" if v is None else str(v)),
            mtu=_fmt_values((p.mtu for p in profiles), str),
            asymmetric=sum(1 for link in links if not link.symmetric),
        ))
    return rows


# -- graph helpers -----------------------------------------------------------------------------------------


def _bw(p: LinkProfile) -> float:
    return INF if p.bandwidth_bps is None else float(p.bandwidth_bps)


def link_capacity(link: Link) -> float:
    """The smaller direction's bandwidth in bit/s (inf when unshaped)."""
    return min(_bw(link.ab), _bw(link.ba))


def switch_layers(topo: Topology) -> dict[str, int]:
    """Hop distance of every node to its nearest worker (workers 0). Nodes no worker reaches are absent."""
    adj: dict[str, list[str]] = {n: [] for n in topo.nodes}
    for link in topo.links:
        adj[link.a].append(link.b)
        adj[link.b].append(link.a)
    return hop_distances(adj, topo.workers)


def access_switch(topo: Topology) -> dict[str, str]:
    """Worker -> the switch of its first access link (link order), as the address plan chooses it."""
    out: dict[str, str] = {}
    for link in topo.links:
        ka, kb = topo.nodes[link.a].kind, topo.nodes[link.b].kind
        if ka == "worker" and kb == "switch":
            out.setdefault(link.a, link.b)
        elif kb == "worker" and ka == "switch":
            out.setdefault(link.b, link.a)
    return out


# -- bisection ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bisection:
    bps: float | None              # None: every balanced cut crosses only unshaped links
    method: str                    # "formula" | "exhaustive" | "heuristic" | "trivial"
    exact: bool
    halves: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # a bipartition achieving it

    @property
    def per_worker_bps(self) -> float | None:
        """Bisection bandwidth per worker of the smaller half (full bisection: the host link rate)."""
        return None if self.bps is None or not self.halves or not self.halves[0] else self.bps / len(self.halves[0])

    def to_json(self) -> dict[str, Any]:
        return {"bps": self.bps, "method": self.method, "exact": self.exact,
                "halves": [list(h) for h in self.halves] if self.halves else None}


def _tier_bandwidth(topo: Topology, tier: str) -> float | None:
    """The capacity shared by every link of `tier`, or None if they differ (or the tier is empty)."""
    caps = {link_capacity(link) for link in topo.iter_links(tier)}
    return caps.pop() if len(caps) == 1 else None


def _formula(topo: Topology) -> Bisection | None:
    params = topo.params or {}
    workers = topo.workers
    half = (tuple(workers[: len(workers) // 2]), tuple(workers[len(workers) // 2:]))
    if topo.generator == "fat-tree":
        k = params.get("k")
        bws = [_tier_bandwidth(topo, t) for t in ("host", "edge-agg", "agg-core")]
        if not isinstance(k, int) or k < 2 or any(b is None for b in bws) or len(workers) != k ** 3 // 4:
            return None
        slowest = min(bws)
        bps = None if slowest == INF else k ** 3 / 8 * slowest
        return Bisection(bps, "formula", True, half)
    if topo.generator == "leaf-spine":
        leaves, spines, hpl = (params.get(p) for p in ("leaves", "spines", "hosts_per_leaf"))
        host, up = _tier_bandwidth(topo, "host"), _tier_bandwidth(topo, "leaf-spine")
        if not all(isinstance(v, int) for v in (leaves, spines, hpl)) or host is None:
            return None
        if len(workers) != leaves * hpl:
            return None
        if leaves == 1:
            bps = len(workers) // 2 * host
        elif leaves % 2 == 0 and up is not None:
            bps = min(leaves * hpl / 2 * host, leaves / 2 * spines * up)
        else:
            return None
        return Bisection(None if bps == INF else bps, "formula", True, half)
    return None


class _Cutter:
    """Min cut between two worker sets by max-flow on the capacity graph."""

    def __init__(self, topo: Topology):
        import networkx as nx

        self.nx = nx
        g = nx.DiGraph()
        g.add_nodes_from(topo.nodes)
        for link in topo.links:
            cap = link_capacity(link)
            for u, v in ((link.a, link.b), (link.b, link.a)):
                if g.has_edge(u, v):  # cannot happen in a validated topology; keep the larger sum anyway
                    g[u][v]["capacity"] += cap
                elif cap == INF:
                    g.add_edge(u, v)  # no capacity attribute: infinite for networkx
                else:
                    g.add_edge(u, v, capacity=cap)
        self.g = g

    def cut(self, a: Iterable[str], b: Iterable[str]) -> float:
        g = self.g.copy()
        for w in a:
            g.add_edge("__src__", w)
        for w in b:
            g.add_edge(w, "__dst__")
        try:
            value, _ = self.nx.minimum_cut(g, "__src__", "__dst__")
        except self.nx.NetworkXUnbounded:
            return INF
        return float(value)


def _distance_order(topo: Topology, seed: str, workers: list[str]) -> list[str]:
    import networkx as nx

    dist = nx.single_source_shortest_path_length(topo.graph(), seed)
    index = {w: i for i, w in enumerate(workers)}
    return sorted(workers, key=lambda w: (dist.get(w, math.inf), index[w]))


def _improve(cutter: _Cutter, a: list[str], b: list[str], value: float, budget: int) -> tuple[float, list, list]:
    """Pairwise swaps that lower the cut, first improvement, at most `budget` evaluations."""
    improved = True
    while improved and budget > 0:
        improved = False
        for i, j in itertools.product(range(len(a)), range(len(b))):
            if budget <= 0:
                break
            na, nb = a.copy(), b.copy()
            na[i], nb[j] = b[j], a[i]
            budget -= 1
            v = cutter.cut(na, nb)
            if v < value:
                a, b, value, improved = na, nb, v, True
                break
    return value, a, b


def bisection(topo: Topology, method: str = "auto") -> Bisection:
    """The bisection bandwidth of the workers (see the module docstring). `method`: auto, formula,
    exhaustive or heuristic (formula falls back to auto when it does not apply)."""
    workers = topo.workers
    n = len(workers)
    if n < 2:
        return Bisection(None, "trivial", True, None)
    if method in ("auto", "formula"):
        found = _formula(topo)
        if found is not None:
            return found
    cutter = _Cutter(topo)
    h = n // 2
    best: tuple[float, tuple[str, ...], tuple[str, ...]] | None = None

    def consider(a: Iterable[str], b: Iterable[str], value: float | None = None) -> None:
        nonlocal best
        a, b = tuple(a), tuple(b)
        v = cutter.cut(a, b) if value is None else value
        if best is None or v < best[0]:
            best = (v, a, b)

    if method == "exhaustive" or (method in ("auto", "formula") and n <= EXHAUSTIVE_MAX_WORKERS):
        # Even n: fix workers[0] in the first half (the halves are interchangeable). Odd n: the
        # smaller half is any h workers.
        pool = workers[1:] if n % 2 == 0 else workers
        for combo in itertools.combinations(pool, h - 1 if n % 2 == 0 else h):
            a = (workers[0], *combo) if n % 2 == 0 else combo
            chosen = set(a)
            consider(a, [w for w in workers if w not in chosen])
        kind, exact = "exhaustive", True
    else:
        orders = [workers, list(reversed(workers))]
        seeds = [workers[0], workers[-1], workers[n // 2]]
        orders += [_distance_order(topo, s, workers) for s in seeds]
        candidates = []
        for order in orders:
            a, b = list(order[:h]), list(order[h:])
            candidates.append((cutter.cut(a, b), a, b))
        candidates.sort(key=lambda c: c[0])
        for value, a, b in candidates:
            consider(a, b, value)
        if len(topo.nodes) <= 200:  # local improvement while it is cheap
            value, a, b = candidates[0]
            value, a, b = _improve(cutter, a, b, value, budget=120)
            consider(a, b, value)
        kind, exact = "heuristic", False
    assert best is not None
    value, a, b = best
    return Bisection(None if value == INF else value, kind, exact, (a, b))


# -- oversubscription --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OversubRow:
    layer: int                     # hop distance to the nearest worker
    switches: tuple[str, ...]
    down_tiers: tuple[str, ...]
    up_tiers: tuple[str, ...]
    down_bps: float                # sum over the layer (inf if any downlink is unshaped)
    up_bps: float
    ratio: float | None            # down/up for the layer as a whole; None: no uplinks or unshaped
    max_ratio: float | None        # the worst single switch of the layer

    @property
    def name(self) -> str:
        return "/".join(self.down_tiers) + " -> " + ("/".join(self.up_tiers) or "(top)")

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "switches": len(self.switches), "down_tiers": list(self.down_tiers),
                "up_tiers": list(self.up_tiers), "down_bps": _json_num(self.down_bps),
                "up_bps": _json_num(self.up_bps), "ratio": self.ratio, "max_ratio": self.max_ratio}


def _json_num(x: float) -> float | None:
    return None if x == INF else x


def _ratio(down: float, up: float) -> float | None:
    if up == 0 or (down == INF and up == INF):
        return None
    if up == INF:
        return 0.0
    return down / up  # inf when the downlinks are unshaped and the uplinks are not


def oversubscription(topo: Topology) -> list[OversubRow]:
    """Downlink/uplink capacity per switch layer, bottom up (see the module docstring)."""
    layer = switch_layers(topo)
    per: dict[int, dict[str, Any]] = {}
    for sw in topo.switches:
        if sw not in layer:
            continue
        down = up = 0.0
        dt: dict[str, None] = {}
        ut: dict[str, None] = {}
        for link in topo.links_of(sw):
            other = link.other(sw)
            lo = layer.get(other)
            if lo is None:
                continue
            if lo < layer[sw]:  # traffic coming up from below into sw
                down += _bw(link.profile_from(other))
                dt.setdefault(link.tier)
            else:  # traffic leaving sw upward (or sideways, to a switch of the same layer)
                up += _bw(link.profile_from(sw))
                ut.setdefault(link.tier)
        row = per.setdefault(layer[sw], {"switches": [], "down": 0.0, "up": 0.0, "dt": {}, "ut": {},
                                          "ratios": []})
        row["switches"].append(sw)
        row["down"] += down
        row["up"] += up
        row["dt"].update(dt)
        row["ut"].update(ut)
        row["ratios"].append(_ratio(down, up))
    rows = []
    for lay in sorted(per):
        r = per[lay]
        ratios = [x for x in r["ratios"] if x is not None]
        rows.append(OversubRow(lay, tuple(r["switches"]), tuple(r["dt"]), tuple(r["ut"]), r["down"], r["up"],
                               _ratio(r["down"], r["up"]), max(ratios) if ratios else None))
    return rows


# -- ECMP --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EcmpSummary:
    histogram: dict[int, int] = field(default_factory=dict)  # paths -> unordered worker pairs
    same_switch_pairs: int = 0   # pairs behind one access switch (one path, through it)
    unreachable_pairs: int = 0   # pairs with no switch path (or a worker without an access switch)

    @property
    def min(self) -> int | None:
        return min(self.histogram) if self.histogram else None

    @property
    def max(self) -> int | None:
        return max(self.histogram) if self.histogram else None

    def to_json(self) -> dict[str, Any]:
        return {"histogram": {str(k): v for k, v in sorted(self.histogram.items())}, "min": self.min,
                "max": self.max, "same_switch_pairs": self.same_switch_pairs,
                "unreachable_pairs": self.unreachable_pairs}


def _path_counts(adj: dict[str, list[str]], src: str) -> dict[str, int]:
    dist = {src: 0}
    count = {src: 1}
    queue = deque([src])
    while queue:
        u = queue.popleft()
        for v in adj[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                count[v] = 0
                queue.append(v)
            if dist[v] == dist[u] + 1:
                count[v] += count[u]
    return count


def ecmp_summary(topo: Topology) -> EcmpSummary:
    """Equal-cost path counts between workers on different access switches (grouped per switch pair)."""
    acc = access_switch(topo)
    racks = Counter(acc.values())
    adj: dict[str, list[str]] = {s: [] for s in topo.switches}
    for link in topo.links:
        if topo.nodes[link.a].is_switch and topo.nodes[link.b].is_switch:
            adj[link.a].append(link.b)
            adj[link.b].append(link.a)
    hist: Counter[int] = Counter()
    unreachable = 0
    same = sum(c * (c - 1) // 2 for c in racks.values())
    switches = list(racks)
    for i, s in enumerate(switches):
        counts_from = _path_counts(adj, s)
        for d in switches[i + 1:]:
            pairs = racks[s] * racks[d]
            paths = counts_from.get(d, 0)
            if paths:
                hist[paths] += pairs
            else:
                unreachable += pairs
    n = len(topo.workers)
    no_switch = n - len(acc)
    unreachable += no_switch * (n - no_switch) + no_switch * (no_switch - 1) // 2
    return EcmpSummary(dict(hist), same, unreachable)


# -- all at once -------------------------------------------------------------------------------------------


def describe(topo: Topology) -> dict[str, Any]:
    """Everything above as JSON-ready data."""
    return {
        "counts": counts(topo),
        "tiers": [dict(zip(TIER_COLUMNS, row.cells()), asymmetric=row.asymmetric) for row in tier_rows(topo)],
        "bisection": bisection(topo).to_json(),
        "oversubscription": [row.to_json() for row in oversubscription(topo)],
        "ecmp": ecmp_summary(topo).to_json(),
    }
