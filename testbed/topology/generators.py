"""Topology generators: fat-tree, leaf-spine, dumbbell, star. Pure functions.

Each generator is ``function(params, tiers, worker) -> (nodes, links)``:

- ``params``: the user's parameters (missing ones take the spec's defaults;
  unknown or ill-typed ones raise TopologyError with path ``params.NAME``).
- ``tiers``: tier name -> LinkProfile (both directions), or an (ab, ba) pair
  of LinkProfiles where ``ab`` shapes traffic going *up* the tree (from the
  host/edge/leaf/s0 end to the switch/agg/spine/s1 end). Missing tiers take
  the spec's ``tier_defaults``.
- ``worker``: Node keyword arguments every worker gets (gpus, cpus,
  memory_bytes, image).

Node names are part of the interface (users write them in job specs and fault
scripts), so they are fixed here and tested: workers are always ``w0..wN-1``.
Nodes come back workers first, then switches tier by tier, in a stable order;
links come back lowest tier first, each with ``a`` the lower end.

Built-in tier defaults: every tier 10gbit with 2us delay (a fast datacenter
fabric whose delays are below the emulation floor, so no delay element is
needed), except the dumbbell's ``core`` bottleneck: 1gbit, 2us.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

from testbed.errors import TopologyError
from testbed.topology.model import Link, LinkProfile, Node

TierProfile = Union[LinkProfile, tuple[LinkProfile, LinkProfile]]
GeneratorFn = Callable[[Mapping[str, Any], Mapping[str, TierProfile], Mapping[str, Any]],
                       tuple[dict[str, Node], list[Link]]]

FAST = LinkProfile(bandwidth_bps=10 * 10**9, delay_s=2e-6)
BOTTLENECK = LinkProfile(bandwidth_bps=1 * 10**9, delay_s=2e-6)


@dataclass(frozen=True)
class GeneratorSpec:
    name: str
    function: GeneratorFn
    tiers: tuple[str, ...]
    defaults: dict[str, Any]                    # param name -> default value (None: optional, unset)
    tier_defaults: dict[str, LinkProfile] = field(default_factory=dict)
    description: str = ""

    def generate(self, params: Mapping[str, Any] | None = None, tiers: Mapping[str, TierProfile] | None = None,
                 worker: Mapping[str, Any] | None = None) -> tuple[dict[str, Node], list[Link]]:
        return self.function(params or {}, tiers or {}, worker or {})


# -- helpers ----------------------------------------------------------------------------------------------


def _params(params: Mapping[str, Any], defaults: Mapping[str, Any], generator: str) -> dict[str, Any]:
    """Defaults merged with `params`; unknown names refused (a typo would silently do nothing)."""
    if not isinstance(params, Mapping):
        raise TopologyError("params must be a mapping", path="params", value=params)
    for name in params:
        if name not in defaults:
            allowed = ", ".join(defaults) or "none"
            raise TopologyError(f"unknown parameter for {generator}; allowed: {allowed}",
                                path=f"params.{name}", value=name)
    return {**defaults, **params}


def _int_param(p: Mapping[str, Any], name: str, minimum: int) -> int:
    value = p[name]
    # bool is an int in Python; `k: yes` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an integer", path=f"params.{name}", value=value)
    if value < minimum:
        raise TopologyError(f"{name} must be >= {minimum}", path=f"params.{name}", value=value)
    return value


def _tier(tiers: Mapping[str, TierProfile], name: str, spec_defaults: Mapping[str, LinkProfile]
          ) -> tuple[LinkProfile, LinkProfile]:
    prof = tiers.get(name, spec_defaults.get(name, FAST))
    if isinstance(prof, LinkProfile):
        return prof, prof
    ab, ba = prof
    return ab, ba


def _link(a: str, b: str, tier: str, profile: tuple[LinkProfile, LinkProfile]) -> Link:
    return Link(a=a, b=b, tier=tier, ab=profile[0], ba=profile[1])


def _worker(name: str, worker: Mapping[str, Any]) -> Node:
    return Node(name=name, kind="worker", **worker)


def _switch(name: str) -> Node:
    return Node(name=name, kind="switch")


# -- generators --------------------------------------------------------------------------------------------


def fat_tree(params: Mapping[str, Any], tiers: Mapping[str, TierProfile], worker: Mapping[str, Any]
             ) -> tuple[dict[str, Node], list[Link]]:
    """The k-ary fat-tree of Al-Fares et al. (SIGCOMM 2008).

    k pods, each with k/2 edge and k/2 aggregation switches; (k/2)^2 cores;
    k/2 hosts per edge switch: k^3/4 workers, 5k^2/4 switches, 3k^3/4 links.
    Core i connects to agg{p}-{i // (k/2)} in every pod p.
    """
    p = _params(params, FAT_TREE.defaults, "fat-tree")
    k = _int_param(p, "k", 2)
    if k % 2:
        raise TopologyError("k must be even", path="params.k", value=k)
    half = k // 2
    host, edge_agg, agg_core = (_tier(tiers, t, FAT_TREE.tier_defaults) for t in FAT_TREE.tiers)

    workers: dict[str, Node] = {}
    edges: dict[str, Node] = {}
    aggs: dict[str, Node] = {}
    cores = {f"core{i}": _switch(f"core{i}") for i in range(half * half)}
    host_links: list[Link] = []
    ea_links: list[Link] = []
    ac_links: list[Link] = []
    for pod in range(k):
        for i in range(half):
            edge = f"edge{pod}-{i}"
            edges[edge] = _switch(edge)
            for _ in range(half):  # workers numbered pod by pod, edge by edge
                w = f"w{len(workers)}"
                workers[w] = _worker(w, worker)
                host_links.append(_link(w, edge, "host", host))
        for j in range(half):
            agg = f"agg{pod}-{j}"
            aggs[agg] = _switch(agg)
        for i in range(half):
            for j in range(half):
                ea_links.append(_link(f"edge{pod}-{i}", f"agg{pod}-{j}", "edge-agg", edge_agg))
        for j in range(half):
            for c in range(j * half, (j + 1) * half):
                ac_links.append(_link(f"agg{pod}-{j}", f"core{c}", "agg-core", agg_core))
    return {**workers, **edges, **aggs, **cores}, host_links + ea_links + ac_links


def leaf_spine(params: Mapping[str, Any], tiers: Mapping[str, TierProfile], worker: Mapping[str, Any]
               ) -> tuple[dict[str, Node], list[Link]]:
    """`leaves` leaf switches each with `hosts_per_leaf` workers, every leaf joined to every spine.

    With `oversubscription` r the uplink bandwidth (both directions) is set so that
    hosts_per_leaf * host_bw / (spines * uplink_bw) == r, overriding the tier's bandwidth.
    """
    p = _params(params, LEAF_SPINE.defaults, "leaf-spine")
    leaves = _int_param(p, "leaves", 1)
    spines = _int_param(p, "spines", 1)
    hpl = _int_param(p, "hosts_per_leaf", 1)
    host = _tier(tiers, "host", LEAF_SPINE.tier_defaults)
    up = _tier(tiers, "leaf-spine", LEAF_SPINE.tier_defaults)

    ratio = p["oversubscription"]
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0 \
                or ratio == float("inf"):
            raise TopologyError("oversubscription must be a positive number", path="params.oversubscription",
                                value=ratio)
        host_bw = host[0].bandwidth_bps
        if host_bw is None:
            raise TopologyError("oversubscription needs a host tier bandwidth", path="tiers.host.bandwidth",
                                value=None)
        uplink_bw = max(1, round(hpl * host_bw / (spines * ratio)))
        up = (up[0].with_changes(bandwidth_bps=uplink_bw), up[1].with_changes(bandwidth_bps=uplink_bw))

    workers: dict[str, Node] = {}
    leaf_nodes = {f"leaf{i}": _switch(f"leaf{i}") for i in range(leaves)}
    spine_nodes = {f"spine{i}": _switch(f"spine{i}") for i in range(spines)}
    host_links: list[Link] = []
    up_links: list[Link] = []
    for leaf in range(leaves):
        for _ in range(hpl):
            w = f"w{len(workers)}"
            workers[w] = _worker(w, worker)
            host_links.append(_link(w, f"leaf{leaf}", "host", host))
        for s in range(spines):
            up_links.append(_link(f"leaf{leaf}", f"spine{s}", "leaf-spine", up))
    return {**workers, **leaf_nodes, **spine_nodes}, host_links + up_links


def dumbbell(params: Mapping[str, Any], tiers: Mapping[str, TierProfile], worker: Mapping[str, Any]
             ) -> tuple[dict[str, Node], list[Link]]:
    """`left` workers on switch s0, `right` on s1, one `core` bottleneck link s0-s1 (ab: s0 -> s1)."""
    p = _params(params, DUMBBELL.defaults, "dumbbell")
    left = _int_param(p, "left", 1)
    right = _int_param(p, "right", 1)
    host = _tier(tiers, "host", DUMBBELL.tier_defaults)
    core = _tier(tiers, "core", DUMBBELL.tier_defaults)
    workers = {f"w{i}": _worker(f"w{i}", worker) for i in range(left + right)}
    links = [_link(f"w{i}", "s0" if i < left else "s1", "host", host) for i in range(left + right)]
    links.append(_link("s0", "s1", "core", core))
    return {**workers, "s0": _switch("s0"), "s1": _switch("s1")}, links


def star(params: Mapping[str, Any], tiers: Mapping[str, TierProfile], worker: Mapping[str, Any]
         ) -> tuple[dict[str, Node], list[Link]]:
    """`n` workers on one switch s0."""
    p = _params(params, STAR.defaults, "star")
    n = _int_param(p, "n", 1)
    host = _tier(tiers, "host", STAR.tier_defaults)
    workers = {f"w{i}": _worker(f"w{i}", worker) for i in range(n)}
    links = [_link(w, "s0", "host", host) for w in workers]
    return {**workers, "s0": _switch("s0")}, links


FAT_TREE = GeneratorSpec("fat-tree", fat_tree, ("host", "edge-agg", "agg-core"), {"k": 4},
                         {"host": FAST, "edge-agg": FAST, "agg-core": FAST},
                         "k-ary fat-tree (Al-Fares): k^3/4 workers")
LEAF_SPINE = GeneratorSpec("leaf-spine", leaf_spine, ("host", "leaf-spine"),
                           {"leaves": 4, "spines": 2, "hosts_per_leaf": 4, "oversubscription": None},
                           {"host": FAST, "leaf-spine": FAST},
                           "two-tier Clos: every leaf joined to every spine")
DUMBBELL = GeneratorSpec("dumbbell", dumbbell, ("host", "core"), {"left": 2, "right": 2},
                         {"host": FAST, "core": BOTTLENECK},
                         "two switches joined by one bottleneck link")
STAR = GeneratorSpec("star", star, ("host",), {"n": 4}, {"host": FAST},
                     "n workers on one switch")

GENERATORS: dict[str, GeneratorSpec] = {g.name: g for g in (FAT_TREE, LEAF_SPINE, DUMBBELL, STAR)}
