"""Placement: which host of a hosts file each node of a topology runs on. Pure: no I/O.

`place(topo, hosts, pins)` assigns every node (workers and switches) to a host so that

- the workers fit: on each host the workers' cores (a worker's `cpus`, or 1), GPUs (its `gpus`)
  and memory (its `memory`, if it declares one; a host that declares none is not limited) stay
  within the host's `capacity`; switches take no capacity (their forwarding is not modelled);
- pins (node -> host, given by the user) are kept;
- the bandwidth of the cut links (links whose ends are on different hosts; both directions'
  bandwidth added) is as small as the search finds, and among cuts of equal bandwidth the one
  that cuts links farther from the workers (core before aggregation before access links), so
  racks and pods stay whole;
- every switch sits on a host that holds at least as much of its link bandwidth as any other
  (ties go to the host with fewer switches).

If the hosts cannot hold the workers, TopologyError says which resource is short and by how much.

The search behind "partition" (racks kept whole, several starting partitions, local improvement)
is testbed.cluster.placement_search; the units and costs it works on, placement_problem; what
`place` returns, placement_result.

`place(..., method="round-robin")` is the naive baseline (workers dealt to hosts in turn, as
far as capacity allows; switches dealt in turn), kept for comparison.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from testbed.cluster.hosts import Hosts
from testbed.cluster.placement_problem import EPS, ZERO, Vec, fits, host_capacities, link_weights, node_demand, vec_add
from testbed.cluster.placement_result import CutLink, HostLoad, Placement
from testbed.cluster.placement_search import search
from testbed.errors import TopologyError
from testbed.topology.model import Topology

__all__ = ["place", "parse_pins", "METHODS"]

METHODS = ("partition", "round-robin")
RESOURCES = ("cores", "gpus", "memory")


# -- pins ------------------------------------------------------------------------------------------------


def parse_pins(texts: Iterable[str]) -> dict[str, str]:
    """["NODE=HOST", ...] (the CLI's --pin) -> {node: host}; a malformed or repeated pin is refused."""
    pins: dict[str, str] = {}
    for text in texts:
        node, sep, host = text.partition("=")
        node, host = node.strip(), host.strip()
        if not sep or not node or not host:
            raise TopologyError("expected NODE=HOST, e.g. --pin w0=gpu-a", path="--pin", value=text)
        if node in pins and pins[node] != host:
            raise TopologyError(f"{node} is pinned twice ({pins[node]} and {host})", path="--pin", value=text)
        pins[node] = host
    return pins


# -- place -----------------------------------------------------------------------------------------------


def _fmt(resource: str, x: float) -> str:
    if resource == "memory":
        from testbed.topology.units import format_size

        return format_size(x)
    return f"{x:g} {resource}" if resource == "cores" else f"{x:g} GPUs"


def _check_capacity(topo: Topology, hosts: Hosts, caps: list[Vec], demand: Mapping[str, Vec],
                    pins: Mapping[str, int]) -> None:
    """Refuse, naming the shortfall, what no placement can do."""
    src = hosts.source
    for i, res in enumerate(RESOURCES):
        need = sum(demand[w][i] for w in topo.workers)
        have = sum(c[i] for c in caps)
        if need > have + EPS:
            raise TopologyError(f"the hosts cannot hold the workers: they need {_fmt(res, need)}, the hosts have "
                                f"{_fmt(res, have)} in all ({_fmt(res, need - have)} short)", file=src,
                                path=f"hosts[*].capacity.{res}")
        for w in topo.workers:
            biggest = max(range(len(caps)), key=lambda h: caps[h][i])
            if demand[w][i] > caps[biggest][i] + EPS:
                raise TopologyError(f"worker {w} needs {_fmt(res, demand[w][i])}, more than any host has (the most: "
                                    f"{_fmt(res, caps[biggest][i])} on {hosts.hosts[biggest].name})", file=src,
                                    path=f"hosts[*].capacity.{res}")
        for h, host in enumerate(hosts):
            pinned = sum(demand[w][i] for w in topo.workers if pins.get(w) == h)
            if pinned > caps[h][i] + EPS:
                raise TopologyError(f"the workers pinned to {host.name} need {_fmt(res, pinned)}, it has "
                                    f"{_fmt(res, caps[h][i])}", path="--pin",
                                    value=sorted(w for w in topo.workers if pins.get(w) == h))


def _round_robin(topo: Topology, caps: list[Vec], demand: Mapping[str, Vec],
                 pins: Mapping[str, int]) -> dict[str, int] | None:
    used = [ZERO for _ in caps]
    for n, h in pins.items():
        used[h] = vec_add(used[h], demand[n])
    out: dict[str, int] = dict(pins)
    next_worker = next_switch = 0
    for name, node in topo.nodes.items():
        if name in pins:
            continue
        if node.is_worker:
            order = [(next_worker + i) % len(caps) for i in range(len(caps))]
            host = next((h for h in order if fits(used[h], demand[name], caps[h])), None)
            if host is None:
                return None
            used[host] = vec_add(used[host], demand[name])
            next_worker = host + 1
        else:
            host = next_switch % len(caps)
            next_switch += 1
        out[name] = host
    return out


def place(topo: Topology, hosts: Hosts, pins: Mapping[str, str] | None = None, *,
          method: str = "partition") -> Placement:
    """Assign every node of `topo` to a host of `hosts` (see the module's doc). `pins`: node -> host name.

    TopologyError when a pin names an unknown node or host, or the hosts cannot hold the workers.
    """
    if method not in METHODS:
        raise TopologyError(f"unknown placement method; known: {', '.join(METHODS)}", value=method)
    pins = dict(pins or {})
    index = {h.name: i for i, h in enumerate(hosts)}
    for node, host in pins.items():
        if node not in topo.nodes:
            raise TopologyError(f"no node {node!r} in topology {topo.name}", path="--pin", value=f"{node}={host}")
        if host not in index:
            raise TopologyError(f"no host {host!r} in the hosts file (hosts: {', '.join(index)})", file=hosts.source,
                                path="--pin", value=f"{node}={host}")
    pin_index = {node: index[host] for node, host in pins.items()}
    caps = host_capacities(hosts)
    demand = {n: node_demand(topo, n) for n in topo.nodes}
    _check_capacity(topo, hosts, caps, demand, pin_index)

    start = None
    if method == "round-robin":
        by_node = _round_robin(topo, caps, demand, pin_index)
    else:
        found = search(topo, caps, demand, pin_index, link_weights(topo))
        by_node, start = found if found is not None else (None, None)
    if by_node is None:
        room = ", ".join(f"{h.name}: {h.capacity.cores} cores, {h.capacity.gpus} GPUs" for h in hosts)
        raise TopologyError(f"the workers do not pack onto the hosts (each worker whole on one host; hosts: {room})",
                            file=hosts.source, path="hosts[*].capacity")
    return _result(topo, hosts, caps, demand, by_node, method, start, pins)


def _result(topo: Topology, hosts: Hosts, caps: list[Vec], demand: Mapping[str, Vec], by_node: Mapping[str, int],
            method: str, start: str | None, pins: dict[str, str]) -> Placement:
    names = [h.name for h in hosts]
    assignment = {n: names[by_node[n]] for n in topo.nodes}
    cut = tuple(CutLink(i, link.a, link.b, link.tier, assignment[link.a], assignment[link.b],
                        link.ab.bandwidth_bps, link.ba.bandwidth_bps)
                for i, link in enumerate(topo.links) if assignment[link.a] != assignment[link.b])
    loads = []
    for h, host in enumerate(hosts):
        mine = [n for n in topo.nodes if by_node[n] == h]
        workers = tuple(n for n in mine if topo.nodes[n].is_worker)
        used = ZERO
        for w in workers:
            used = vec_add(used, demand[w])
        loads.append(HostLoad(host.name, workers, tuple(n for n in mine if topo.nodes[n].is_switch),
                              round(used[0], 6), host.capacity.cores, used[1], host.capacity.gpus, int(used[2]),
                              host.capacity.memory))
    return Placement(assignment, cut, tuple(loads), method, start, pins)
