"""The topology model: nodes, links and link profiles. Pure data, no I/O.

A Topology is what every other layer consumes. It is built by the YAML
loader, by a generator or by the Mininet importer, and validated once by
`Topology.validate()`; after that the rest of the code may trust it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Literal

from testbed.errors import TopologyError

NodeKind = Literal["worker", "switch"]
NODE_KINDS: tuple[str, ...] = ("worker", "switch")
HOST_RATE_KINDS: tuple[str, ...] = ("network-bound", "this-machine")   # besides a rate in bit/s

DEFAULT_MTU = 1500
# A link whose profile names no queue gets what a Linux interface queues, 1000 packets, but never
# more than QUEUE_DRAIN_MAX_S of its rate: at 1 Gbit/s 1000 packets are 12 ms of queue, the ACKs of
# the flow one way wait behind the data the other way, and a ring all_reduce across the link ran
# 6-7% slow; 209 packets held it within 1-2% (docs/fidelity.md "A link's default queue"). Never
# less than 1.5 x its bandwidth-delay product over the round trip across it (twice its delay and
# jitter, at least 1 ms), nor QUEUE_FLOOR packets.
LINUX_QUEUE = 1000
QUEUE_DRAIN_MAX_S = 0.0025
QUEUE_FLOOR = 100
QUEUE_RTT_MIN_S = 0.001
UNSHAPED_RATE_BPS = 10_000_000_000   # what an unshaped link's queue is sized for


@dataclass(frozen=True)
class LinkProfile:
    """How one direction of a link behaves.

    bandwidth_bps None means unshaped (as fast as veth goes). queue None means
    "the default for this link" (queue_packets).
    loss is a fraction in [0, 1].
    """

    bandwidth_bps: int | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    queue: int | None = None
    mtu: int = DEFAULT_MTU

    def with_changes(self, **changes: Any) -> "LinkProfile":
        return replace(self, **changes)

    def queue_packets(self) -> int:
        """The link's queue in packets: its own, or the default: LINUX_QUEUE, at most QUEUE_DRAIN_MAX_S
        of the rate, at least 1.5 x the bandwidth-delay product over the round trip and QUEUE_FLOOR."""
        if self.queue:
            return int(self.queue)
        rate, frame_bits = self.bandwidth_bps or UNSHAPED_RATE_BPS, self.mtu * 8
        rtt = max(2 * (self.delay_s + self.jitter_s), QUEUE_RTT_MIN_S)
        bdp = math.ceil(rate * rtt * 1.5 / frame_bits - 1e-6)
        return max(QUEUE_FLOOR, bdp, min(LINUX_QUEUE, math.ceil(rate * QUEUE_DRAIN_MAX_S / frame_bits - 1e-6)))

    def to_json(self) -> dict[str, Any]:
        return {
            "bandwidth_bps": self.bandwidth_bps,
            "delay_s": self.delay_s,
            "jitter_s": self.jitter_s,
            "loss": self.loss,
            "queue": self.queue,
            "mtu": self.mtu,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LinkProfile":
        return cls(**{k: data[k] for k in ("bandwidth_bps", "delay_s", "jitter_s", "loss", "queue", "mtu") if k in data})


@dataclass(frozen=True)
class Node:
    """A worker (a server that runs training) or a switch."""

    name: str
    kind: NodeKind
    gpus: int = 0
    cpus: float | None = None
    memory_bytes: int | None = None
    image: str | None = None

    @property
    def is_worker(self) -> bool:
        return self.kind == "worker"

    @property
    def is_switch(self) -> bool:
        return self.kind == "switch"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "gpus": self.gpus, "cpus": self.cpus,
                "memory_bytes": self.memory_bytes, "image": self.image}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Node":
        return cls(**{k: data[k] for k in ("name", "kind", "gpus", "cpus", "memory_bytes", "image") if k in data})


@dataclass(frozen=True)
class Link:
    """A link between nodes a and b. `ab` shapes traffic a->b, `ba` traffic b->a."""

    a: str
    b: str
    tier: str
    ab: LinkProfile
    ba: LinkProfile

    @property
    def endpoints(self) -> tuple[str, str]:
        return (self.a, self.b)

    def profile_from(self, node: str) -> LinkProfile:
        """The profile of traffic leaving `node` over this link."""
        if node == self.a:
            return self.ab
        if node == self.b:
            return self.ba
        raise KeyError(f"{node} is not an endpoint of {self.a}-{self.b}")

    def other(self, node: str) -> str:
        if node == self.a:
            return self.b
        if node == self.b:
            return self.a
        raise KeyError(f"{node} is not an endpoint of {self.a}-{self.b}")

    @property
    def symmetric(self) -> bool:
        return self.ab == self.ba

    def to_json(self) -> dict[str, Any]:
        return {"endpoints": [self.a, self.b], "tier": self.tier, "ab": self.ab.to_json(), "ba": self.ba.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Link":
        a, b = data["endpoints"]
        return cls(a=a, b=b, tier=data["tier"], ab=LinkProfile.from_json(data["ab"]),
                   ba=LinkProfile.from_json(data["ba"]))


@dataclass
class Topology:
    """A named graph of workers and switches joined by shaped links.

    Options that belong to later layers (runtime, time dilation, GPU policy)
    are carried here so that one file describes one testbed.
    """

    name: str
    nodes: dict[str, Node]
    links: list[Link]
    source: str | None = None          # the file it came from, for error messages
    generator: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    runtime: str | None = None         # "netns" | "docker" | None (the default)
    time_dilation: float | str | None = None   # a factor >= 1, "auto", "none" or None (the caller's default)
    gpu_policy: str = "round-robin"    # "round-robin" | "packed"
    gpu_sharing: str | None = None     # None | "mps"
    address_pool: str | None = None    # worker subnets come from here (None: the plan's default)
    fabric_pool: str | None = None     # switch-to-switch /31s come from here
    # What the workers' hosts cost per byte a rank sends (the reference model's host term): a rate in
    # bit/s per rank, "network-bound" (GPU servers, whose host cost is far below their links': the
    # default) or "this-machine" (the calibrated cost of a rank with one core of this machine).
    host_rate: float | str | None = None

    # -- views ---------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        return [n.name for n in self.nodes.values() if n.is_worker]

    @property
    def switches(self) -> list[str]:
        return [n.name for n in self.nodes.values() if n.is_switch]

    def links_of(self, node: str) -> list[Link]:
        """Links of `node`, in the order of the link list (this order numbers its interfaces)."""
        return [link for link in self.links if node in (link.a, link.b)]

    def neighbors(self, node: str) -> list[str]:
        return [link.other(node) for link in self.links_of(node)]

    def link_between(self, a: str, b: str) -> Link | None:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        return None

    def link_index(self, a: str, b: str) -> int:
        for i, link in enumerate(self.links):
            if {link.a, link.b} == {a, b}:
                return i
        raise KeyError(f"no link between {a} and {b}")

    def tiers(self) -> list[str]:
        seen: dict[str, None] = {}
        for link in self.links:
            seen.setdefault(link.tier, None)
        return list(seen)

    def iter_links(self, tier: str | None = None) -> Iterator[Link]:
        return (link for link in self.links if tier is None or link.tier == tier)

    def graph(self):
        """An undirected networkx Graph: nodes carry `kind`, edges carry `tier` and `index`."""
        import networkx as nx

        g = nx.Graph()
        for node in self.nodes.values():
            g.add_node(node.name, kind=node.kind)
        for i, link in enumerate(self.links):
            g.add_edge(link.a, link.b, tier=link.tier, index=i)
        return g

    # -- validation ----------------------------------------------------------

    def validate(self) -> "Topology":
        """Check the graph-level rules; raise TopologyError naming the field and value."""
        f = self.source
        if not self.name or not isinstance(self.name, str):
            raise TopologyError("a topology needs a name", file=f, path="name", value=self.name)
        if not self.workers:
            raise TopologyError("the topology has no workers", file=f, path="nodes")
        seen_pairs: dict[frozenset[str], int] = {}
        linked: set[str] = set()
        for i, link in enumerate(self.links):
            for end in (link.a, link.b):
                if end not in self.nodes:
                    raise TopologyError("link names an unknown node", file=f,
                                        path=f"links[{i}].endpoints", value=end)
            if link.a == link.b:
                raise TopologyError("a link cannot join a node to itself", file=f,
                                    path=f"links[{i}].endpoints", value=[link.a, link.b])
            pair = frozenset((link.a, link.b))
            if pair in seen_pairs:
                raise TopologyError(f"duplicate link (same endpoints as links[{seen_pairs[pair]}])",
                                    file=f, path=f"links[{i}].endpoints", value=[link.a, link.b])
            seen_pairs[pair] = i
            linked.update(pair)
            for direction, prof in (("a->b", link.ab), ("b->a", link.ba)):
                _validate_profile(prof, f, f"links[{i}]")
        for name in self.workers:
            if name not in linked:
                raise TopologyError("worker has no link", file=f, path=f"nodes.{name}", value=name)
        for node in self.nodes.values():
            if node.gpus < 0:
                raise TopologyError("gpus must be >= 0", file=f, path=f"nodes.{node.name}.gpus", value=node.gpus)
            if node.cpus is not None and node.cpus <= 0:
                raise TopologyError("cpus must be > 0", file=f, path=f"nodes.{node.name}.cpus", value=node.cpus)
            if node.memory_bytes is not None and node.memory_bytes <= 0:
                raise TopologyError("memory must be > 0", file=f, path=f"nodes.{node.name}.memory",
                                    value=node.memory_bytes)
        if self.gpu_policy not in ("round-robin", "packed"):
            raise TopologyError("gpu_policy must be round-robin or packed", file=f, path="gpu_policy",
                                value=self.gpu_policy)
        if self.gpu_sharing not in (None, "mps"):
            raise TopologyError("gpu_sharing must be mps or absent", file=f, path="gpu_sharing",
                                value=self.gpu_sharing)
        if self.runtime not in (None, "netns", "docker"):
            raise TopologyError("runtime must be netns or docker", file=f, path="runtime", value=self.runtime)
        hr = self.host_rate
        if hr is not None and hr not in HOST_RATE_KINDS and (isinstance(hr, bool) or not isinstance(hr, (int, float))
                                                             or not 0 < hr < float("inf")):
            raise TopologyError(f"host_rate must be a rate (e.g. 25gbit), {' or '.join(HOST_RATE_KINDS)}", file=f,
                                path="host_rate", value=hr)
        td = self.time_dilation
        if td is not None and td not in ("auto", "none") and (not isinstance(td, (int, float)) or td < 1):
            raise TopologyError("time_dilation must be a number >= 1, 'auto' or 'none'", file=f,
                                path="time_dilation", value=td)
        return self

    # -- serialisation (the state file keeps a snapshot) ---------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "generator": self.generator,
            "params": self.params,
            "runtime": self.runtime,
            "time_dilation": self.time_dilation,
            "gpu_policy": self.gpu_policy,
            "gpu_sharing": self.gpu_sharing,
            "address_pool": self.address_pool,
            "fabric_pool": self.fabric_pool,
            "host_rate": self.host_rate,
            "nodes": [n.to_json() for n in self.nodes.values()],
            "links": [link.to_json() for link in self.links],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Topology":
        nodes = {n["name"]: Node.from_json(n) for n in data["nodes"]}
        links = [Link.from_json(link) for link in data["links"]]
        keep = {k: data.get(k) for k in ("source", "generator", "runtime", "time_dilation", "gpu_sharing",
                                         "address_pool", "fabric_pool", "host_rate")}
        return cls(name=data["name"], nodes=nodes, links=links, params=data.get("params") or {},
                   gpu_policy=data.get("gpu_policy") or "round-robin", **keep)


def _validate_profile(p: LinkProfile, file: str | None, where: str) -> None:
    if p.bandwidth_bps is not None and p.bandwidth_bps <= 0:
        raise TopologyError("bandwidth must be positive", file=file, path=f"{where}.bandwidth", value=p.bandwidth_bps)
    if p.delay_s < 0:
        raise TopologyError("delay must not be negative", file=file, path=f"{where}.delay", value=p.delay_s)
    if p.jitter_s < 0:
        raise TopologyError("jitter must not be negative", file=file, path=f"{where}.jitter", value=p.jitter_s)
    if not 0 <= p.loss <= 1:
        raise TopologyError("loss must be between 0% and 100%", file=file, path=f"{where}.loss", value=p.loss)
    if p.queue is not None and p.queue <= 0:
        raise TopologyError("queue must be a positive number of packets", file=file, path=f"{where}.queue",
                            value=p.queue)
    if not 68 <= p.mtu <= 65535:
        raise TopologyError("mtu must be between 68 and 65535", file=file, path=f"{where}.mtu", value=p.mtu)
