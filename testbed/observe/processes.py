"""The processes of a testbed's nodes (`testbed ps`), found by namespace.

A worker's processes are those in its PID namespace (netns runtime: the init's; docker: the
container's); a node without one (a switch, the bare runtime) has the processes in its network
namespace. PID is the host's, NSPID the one the node sees.
"""

from __future__ import annotations

import os
from typing import Any

from testbed import procs
from testbed.errors import StateError


def processes(st: dict[str, Any], nodes: list[str]) -> list[dict[str, Any]]:
    """One row per process: node, pid, nspid, user, rss, cpu seconds, command."""
    import psutil

    from testbed.node_exec import node_target
    from testbed.net import netns

    # node -> (namespace kind, inode)
    keys: dict[tuple[str, int], str] = {}
    for node in nodes:
        rt, rec, _ = node_target(st, node)
        pid = None
        try:
            pid = rt.pid(node, rec)
        except Exception:
            pid = None
        if pid:
            ino = procs.ns_inode(pid, "pid")
            if ino is not None and ino != procs.ns_inode("self", "pid"):
                keys[("pid", ino)] = node
                continue
        ns = rec.get("netns")
        if ns:
            try:
                keys[("net", os.stat(netns.path(ns)).st_ino)] = node
            except OSError:
                pass
    rows = []
    for p in psutil.process_iter(["pid", "username", "cmdline", "name", "memory_info", "cpu_times"]):
        node = None
        for kind in ("pid", "net"):
            ino = procs.ns_inode(p.info["pid"], kind)
            if ino is not None and (kind, ino) in keys:
                node = keys[(kind, ino)]
                break
        if node is None:
            continue
        cmd = p.info["cmdline"] or [f"[{p.info['name']}]"]
        ct = p.info["cpu_times"]
        rows.append({
            "node": node, "pid": p.info["pid"], "nspid": procs.nspid(p.info["pid"]), "user": p.info["username"],
            "rss_bytes": p.info["memory_info"].rss if p.info["memory_info"] else None,
            "cpu_s": round(ct.user + ct.system, 2) if ct else None, "command": " ".join(cmd),
        })
    order = {n: i for i, n in enumerate(nodes)}
    rows.sort(key=lambda r: (order[r["node"]], r["nspid"] or 0, r["pid"]))
    return rows


def ps(name: str, nodes: list[str], all_nodes: bool = False) -> list[dict[str, Any]]:
    """The rows of the nodes named (default: every worker; all_nodes: switches too) that this host
    holds; a node this host does not hold, of a testbed over several hosts, is refused."""
    from testbed import lifecycle

    st = lifecycle.load(name)
    topo_nodes = st.get("topology", {}).get("nodes", [])
    known = [n["name"] for n in topo_nodes]
    part = st.get("part")   # this host's part of a testbed over several hosts: its own nodes
    here = set(known) if part is None else set(part.get("nodes", ()))
    if nodes:
        bad = [n for n in nodes if n not in known]
        if bad:
            raise StateError(f"testbed {name!r} has no node {bad[0]!r}")
        away = [n for n in nodes if n not in here]
        if away:
            raise StateError(f"{away[0]} is not on this host ({part.get('host')}): testbed {name} spans "
                             "several hosts; run it on the controller, which asks each node's host")
        chosen = list(nodes)
    else:
        chosen = [n["name"] for n in topo_nodes if (all_nodes or n["kind"] == "worker") and n["name"] in here]
    return processes(st, chosen)
