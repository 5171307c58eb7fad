"""One host's part of a testbed spread over several hosts. Pure.

Every host keeps the whole topology and the whole routing plan (addresses,
MACs, routes and VNIs are derived from the testbed's name and topology, so
every host computes the same ones); a part says which nodes this host builds
and how its ends of the cut links reach the other hosts. A host builds its
nodes as a single-host `up` would and turns its end of each cut link into a
VXLAN device (testbed.net.tunnels) where the local link would have had its
veth end; faults and status then act on what is local.

The controller (testbed.cluster.controller) makes one Part per host from the
placement and sends it as JSON; the host trusts nothing in it: `from_json`
checks every field and `check_against` checks it against the topology.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from testbed.net.tunnels import TunnelEnd, vni
from testbed.topology.model import Topology
from testbed.topology.plan import NetworkPlan


@dataclass(frozen=True)
class Part:
    host: str                                  # this host's name in the hosts file
    nodes: frozenset[str]                      # the nodes this host builds
    tunnels: tuple[TunnelEnd, ...] = ()        # this host's ends of the cut links
    # link index -> the underlay's own one-way latency (s) between the link's hosts: a delayed cut
    # link's shaping adds only the rest, so traffic sees the configured delay
    underlay_s: Mapping[int, float] = field(default_factory=dict)

    def local(self, node: str) -> bool:
        return node in self.nodes

    def tunnel(self, link_index: int) -> TunnelEnd | None:
        return next((t for t in self.tunnels if t.link == link_index), None)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "nodes": sorted(self.nodes), "tunnels": [t.to_json() for t in self.tunnels],
                "underlay_s": {str(k): v for k, v in sorted(self.underlay_s.items())}}

    @classmethod
    def from_json(cls, data: Any) -> Part:
        if not isinstance(data, dict):
            raise ValueError(f"part: expected a mapping (got {type(data).__name__})")
        extra = set(data) - {"host", "nodes", "tunnels", "underlay_s"}
        if extra:
            raise ValueError(f"part: unknown field {sorted(extra)[0]!r}")
        host, nodes, tunnels, under = data.get("host"), data.get("nodes"), data.get("tunnels", []), \
            data.get("underlay_s", {})
        if not isinstance(host, str) or not host:
            raise ValueError(f"part.host: expected a host name (got {host!r})")
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ValueError(f"part.nodes: expected a list of node names (got {nodes!r:.80})")
        if not isinstance(tunnels, list):
            raise ValueError(f"part.tunnels: expected a list (got {tunnels!r:.80})")
        ends = []
        for i, t in enumerate(tunnels):
            try:
                ends.append(TunnelEnd.from_json(t))
            except ValueError as exc:
                raise ValueError(f"part.tunnels[{i}]: {exc}") from None
        if not isinstance(under, dict):
            raise ValueError(f"part.underlay_s: expected a mapping (got {under!r:.80})")
        underlay: dict[int, float] = {}
        for k, v in under.items():
            if not (isinstance(k, str) and k.isdigit()) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not 0 <= v < 10:
                raise ValueError(f"part.underlay_s[{k!r}]: expected link index -> seconds in [0, 10) (got {v!r})")
            underlay[int(k)] = float(v)
        return cls(host, frozenset(nodes), tuple(ends), underlay)

    def check_against(self, topo: Topology, plan: NetworkPlan, testbed: str) -> None:
        """ValueError unless this part fits the topology: known nodes, and exactly one end per cut
        link of this host, with the plan's interface name, MAC and VNI."""
        from testbed.names import mac_for

        unknown = sorted(self.nodes - set(topo.nodes))
        if unknown:
            raise ValueError(f"part.nodes: {unknown[0]!r} is not a node of the topology")
        if not self.nodes:
            raise ValueError("part.nodes: empty (a host with nothing to build is left out of the testbed)")
        want = {}
        for lp in plan.links:
            a_here, b_here = self.local(lp.a.node), self.local(lp.b.node)
            if a_here != b_here:
                side, port = ("a", lp.a) if a_here else ("b", lp.b)
                want[lp.index] = (port.node, port.ifname, mac_for(testbed, f"l{lp.index}{side}"),
                                  vni(testbed, lp.index))
        got = {t.link: (t.node, t.ifname, t.mac, t.vni) for t in self.tunnels}
        for i in sorted(set(want) | set(got)):
            if want.get(i) != got.get(i):
                link = topo.links[i] if 0 <= i < len(topo.links) else None
                what = f"{link.a}-{link.b}" if link else f"#{i}"
                raise ValueError(f"part.tunnels: link {what} (#{i}): expected {want.get(i)}, got {got.get(i)}")


def cut_link_indices(topo: Topology, host_of: Mapping[str, str]) -> list[int]:
    return [i for i, link in enumerate(topo.links) if host_of[link.a] != host_of[link.b]]


def make_parts(testbed: str, topo: Topology, plan: NetworkPlan, host_of: Mapping[str, str],
               underlays: Mapping[str, str], underlay_s: Mapping[frozenset[str], float] | None = None,
               ) -> dict[str, Part]:
    """host name -> its Part, for every host that builds at least one node.

    host_of: node -> host (the placement); underlays: host -> underlay address; underlay_s:
    {host pair} -> measured one-way underlay latency (s)."""
    from testbed.names import mac_for

    for h, addr in underlays.items():
        ipaddress.ip_address(addr)   # ValueError on a bad address, before anything else
    nodes: dict[str, set[str]] = {}
    for node in topo.nodes:
        nodes.setdefault(host_of[node], set()).add(node)
    tunnels: dict[str, list[TunnelEnd]] = {h: [] for h in nodes}
    lat: dict[str, dict[int, float]] = {h: {} for h in nodes}
    for lp in plan.links:
        ha, hb = host_of[lp.a.node], host_of[lp.b.node]
        if ha == hb:
            continue
        mtu = max(topo.links[lp.index].ab.mtu, topo.links[lp.index].ba.mtu)
        for side, port, here, there in (("a", lp.a, ha, hb), ("b", lp.b, hb, ha)):
            tunnels[here].append(TunnelEnd(testbed=testbed, link=lp.index, node=port.node, ifname=port.ifname,
                                           mac=mac_for(testbed, f"l{lp.index}{side}"), mtu=mtu,
                                           vni=vni(testbed, lp.index), local=underlays[here],
                                           remote=underlays[there]))
            if underlay_s is not None and frozenset((ha, hb)) in underlay_s:
                lat[here][lp.index] = underlay_s[frozenset((ha, hb))]
    return {h: Part(h, frozenset(ns), tuple(tunnels[h]), lat[h]) for h, ns in nodes.items()}
