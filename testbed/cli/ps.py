"""testbed ps [NODE...]: the processes of each worker (or switch).

A worker's processes are those in its PID namespace (netns runtime: the
init's; docker: the container's); a node without one (a switch, the bare
runtime) shows the processes in its network namespace. PID is the host's,
NSPID the one the node sees.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import typer

from testbed import procs
from testbed.cli.common import NameOption, console, resolve_name


def processes(st: dict[str, Any], nodes: list[str]) -> list[dict[str, Any]]:
    """One row per process: node, pid, nspid, user, rss, cpu seconds, command."""
    import psutil

    from testbed.cli.attach import node_target
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


def register(app: typer.Typer) -> None:
    @app.command(help="List the processes running in each worker (or the NODEs named).")
    def ps(nodes: Optional[list[str]] = typer.Argument(None, help="Nodes to show (default: every worker)."),
           all_nodes: bool = typer.Option(False, "--all", "-a", help="Switches too."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
           name: Optional[str] = NameOption) -> None:
        from rich.table import Table

        from testbed import lifecycle
        from testbed.errors import StateError

        tb = resolve_name(name)
        st = lifecycle.load(tb)
        topo_nodes = st.get("topology", {}).get("nodes", [])
        known = [n["name"] for n in topo_nodes]
        if nodes:
            bad = [n for n in nodes if n not in known]
            if bad:
                raise StateError(f"testbed {tb!r} has no node {bad[0]!r}")
            chosen = list(nodes)
        else:
            chosen = [n["name"] for n in topo_nodes if all_nodes or n["kind"] == "worker"]
        rows = processes(st, chosen)
        if as_json:
            console.print_json(json.dumps(rows))
            return
        t = Table(box=None, header_style="bold")
        for col in ("NODE", "PID", "NSPID", "USER", "RSS", "CPU", "COMMAND"):
            t.add_column(col, justify="right" if col in ("PID", "NSPID", "RSS", "CPU") else "left",
                         overflow="fold" if col == "COMMAND" else None)
        for r in rows:
            rss = f"{r['rss_bytes'] / 2**20:.0f}M" if r["rss_bytes"] is not None else "-"
            t.add_row(r["node"], str(r["pid"]), str(r["nspid"] or "-"), r["user"] or "-", rss,
                      f"{r['cpu_s']:.1f}s" if r["cpu_s"] is not None else "-", r["command"])
        console.print(t)
        if not rows:
            console.print("no processes", style="dim")
