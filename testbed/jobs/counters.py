"""Link counters: bytes and packets per interface of every node, read from the host.

A link's a->b bytes are what left a's port on it (tx), or, when that side
cannot be read, what arrived at b's port (rx). Interface names come from the
network plan (a node's i-th link is eth<i>).
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from testbed.net import names
from testbed.topology.model import Topology


def _read_ns(ns: str) -> dict[str, dict[str, int]]:
    try:
        out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    result = {}
    for dev in json.loads(out.stdout or "[]"):
        st = dev.get("stats64") or dev.get("stats") or {}
        rx, tx = st.get("rx", {}), st.get("tx", {})
        result[dev["ifname"]] = {"rx_bytes": rx.get("bytes", 0), "tx_bytes": tx.get("bytes", 0),
                                 "rx_packets": rx.get("packets", 0), "tx_packets": tx.get("packets", 0),
                                 "rx_dropped": rx.get("dropped", 0), "tx_dropped": tx.get("dropped", 0)}
    return result


def snapshot(testbed: str, nodes: list[str], netns_of: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{"t": wall time, "nodes": {node: {ifname: counters}}} for every node's namespace."""
    netns_of = netns_of or {}
    t = time.time()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda n: _read_ns(netns_of.get(n) or names.netns(testbed, n)), nodes))
    return {"t": t, "nodes": dict(zip(nodes, results))}


def link_bytes(topo: Topology, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per link: index, endpoints, tier, bytes a->b and b->a between two snapshots."""
    from testbed.topology.plan import ifname

    counters: dict[str, int] = {n: 0 for n in topo.nodes}
    out = []
    b_nodes, a_nodes = before.get("nodes", {}), after.get("nodes", {})

    def delta(node: str, ifn: str, key: str) -> int | None:
        x, y = b_nodes.get(node, {}).get(ifn), a_nodes.get(node, {}).get(ifn)
        if x is None or y is None:
            return None
        return max(0, y[key] - x[key])

    for i, link in enumerate(topo.links):
        ia, ib = ifname(counters[link.a]), ifname(counters[link.b])
        counters[link.a] += 1
        counters[link.b] += 1
        ab = delta(link.a, ia, "tx_bytes")
        if ab is None:
            ab = delta(link.b, ib, "rx_bytes")
        ba = delta(link.b, ib, "tx_bytes")
        if ba is None:
            ba = delta(link.a, ia, "rx_bytes")
        out.append({"index": i, "a": link.a, "b": link.b, "tier": link.tier, "bytes_ab": ab or 0,
                    "bytes_ba": ba or 0, "bandwidth_ab": link.ab.bandwidth_bps, "bandwidth_ba": link.ba.bandwidth_bps,
                    "measured": ab is not None or ba is not None})
    return out
