"""A throw-away testbed for tests and benchmarks: the fabric without containers.

Builds the topology's data plane with the net layer's Builder (worker
namespaces made the bare runtime's way: a plain network namespace each),
writes a state file (so `testbed run --name` finds it) and removes
everything on exit, even on failure. Use a unique name per test.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from testbed.jobs.run import Cluster, NsenterExecutor, cluster_from_topology


@contextlib.contextmanager
def scratch_testbed(topo, name: str, *, write_state: bool = True) -> Iterator[Cluster]:
    from testbed.net import builder as b
    from testbed.net import names, netns
    from testbed.net import state as st
    from testbed.net.capabilities import probe
    from testbed.topology.plan import plan_network

    plan = plan_network(topo)
    ns = {n: names.netns(name, n) for n in topo.nodes}
    bld = None
    try:
        for w in topo.workers:
            netns.create(ns[w])
        bld = b.Builder(testbed=name, topo=topo, plan=plan, caps=probe(measure_floor=True))
        bld.build()
        if write_state:
            st.save(name, {"name": name, "topology": topo.to_json(), "plan": plan.to_json(), "status": "up",
                           "runtime": {"kind": "bare", "workers": {w: {"netns": ns[w]} for w in topo.workers}}})
        yield cluster_from_topology(name, topo, NsenterExecutor(ns), netns_of=ns)
    finally:
        every = list(ns.values())
        b.kill_processes_in(every)
        if bld is not None:
            b.stop_delay_lines(bld.delay_lines)
        b.delete_namespaces(every)
        if write_state:
            st.remove(name)


def small_leaf_spine(name: str = "ls", hosts_per_leaf: int = 2, leaves: int = 2, spines: int = 2,
                     host_bw: str = "10gbit", uplink_bw: str = "40gbit"):
    """A leaf-spine topology (loader syntax), small enough for tests."""
    from testbed.topology.loader import load_topology_text

    text = f"""
name: {name}
generator: leaf-spine
params: {{leaves: {leaves}, spines: {spines}, hosts_per_leaf: {hosts_per_leaf}}}
tiers:
  host: {{bandwidth: {host_bw}}}
  leaf-spine: {{bandwidth: {uplink_bw}}}
"""
    return load_topology_text(text, "<scratch>")


def star(name: str = "star", hosts: int = 4, bw: str = "1gbit"):
    from testbed.topology.loader import load_topology_text

    text = f"""
name: {name}
generator: star
params: {{n: {hosts}}}
tiers:
  host: {{bandwidth: {bw}}}
"""
    return load_topology_text(text, "<scratch>")
