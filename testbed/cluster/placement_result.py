"""What a placement is: each node's host, the links cut between hosts and what each host carries.

Made by testbed.cluster.placement.place; `to_json` is the "placement" of `testbed topo --hosts --json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CutLink", "HostLoad", "Placement"]


@dataclass(frozen=True)
class CutLink:
    """A link whose ends are on different hosts: a tunnel once multi-host `up` exists."""

    index: int                     # in topo.links
    a: str
    b: str
    tier: str
    host_a: str
    host_b: str
    ab_bps: int | None             # None: unshaped
    ba_bps: int | None

    @property
    def bandwidth_bps(self) -> int | None:
        """Both directions added; None when either is unshaped."""
        if self.ab_bps is None or self.ba_bps is None:
            return None
        return self.ab_bps + self.ba_bps

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "endpoints": [self.a, self.b], "tier": self.tier,
                "hosts": [self.host_a, self.host_b], "ab_bps": self.ab_bps, "ba_bps": self.ba_bps,
                "bandwidth_bps": self.bandwidth_bps}


@dataclass(frozen=True)
class HostLoad:
    """What one host carries, against what it has."""

    host: str
    workers: tuple[str, ...]
    switches: tuple[str, ...]
    cores_used: float
    cores: int
    gpus_used: int
    gpus: int
    memory_used: int               # bytes of the workers that declare memory
    memory: int | None             # None: the host declares none (not limited)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "workers": list(self.workers), "switches": list(self.switches),
                "cores_used": self.cores_used, "cores": self.cores, "gpus_used": self.gpus_used,
                "gpus": self.gpus, "memory_used": self.memory_used, "memory": self.memory}


@dataclass(frozen=True)
class Placement:
    assignment: dict[str, str]     # node -> host, in the topology's node order
    cut_links: tuple[CutLink, ...]
    loads: tuple[HostLoad, ...]    # in the hosts file's order
    method: str                    # "partition" | "round-robin"
    start: str | None = None       # the starting partition that won (partition only)
    pins: dict[str, str] = field(default_factory=dict)

    def host_of(self, node: str) -> str:
        return self.assignment[node]

    def nodes_on(self, host: str) -> list[str]:
        return [n for n, h in self.assignment.items() if h == host]

    @property
    def cut_bps(self) -> int:
        """Total bandwidth of the cut links (both directions), unshaped directions not counted."""
        return sum(bw for link in self.cut_links for bw in (link.ab_bps, link.ba_bps) if bw is not None)

    @property
    def unshaped_cut(self) -> int:
        """How many cut links have an unshaped direction (not in cut_bps)."""
        return sum(1 for link in self.cut_links if link.bandwidth_bps is None)

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "start": self.start, "pins": dict(self.pins),
                "nodes": dict(self.assignment), "hosts": [load.to_json() for load in self.loads],
                "cut_links": [link.to_json() for link in self.cut_links], "cut_bps": self.cut_bps,
                "unshaped_cut_links": self.unshaped_cut}
