"""testbed ps [NODE...]: the processes of each worker (or switch).

A worker's processes are those in its PID namespace (netns runtime: the
init's; docker: the container's); a node without one (a switch, the bare
runtime) shows the processes in its network namespace. PID is the host's,
NSPID the one the node sees.

A testbed over several hosts: each host lists its own nodes; from the
controller, the command goes to the hosts that hold the nodes asked for (every
host without NODEs) at once and their rows are merged, with a HOST column (a
`host` key with --json). PIDs are each host's.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import typer

from testbed import procs
from testbed.cli.common import NameOption, console, resolve_name
from testbed.errors import StateError, TestbedError


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


def _across_hosts(tb: str, nodes: list[str], all_nodes: bool) -> tuple[list[dict[str, Any]], bool]:
    """`ps --json` on the hosts of testbed `tb` that hold `nodes` (every host: none named) at once: their
    rows merged in topology order, each with its `host`, and whether a host failed (said on stderr)."""
    import threading

    from testbed.cli.common import err_console
    from testbed.cluster import controller

    doc = controller.load(tb)
    placement: dict[str, str] = doc["placement"]
    bad = [n for n in nodes if n not in placement]
    if bad:
        raise StateError(f"testbed {tb!r} has no node {bad[0]!r}")
    flags = ["--json", "--name", tb, *(["--all"] if all_nodes else [])]
    if nodes:
        by_host: dict[str, list[str]] = {}
        for n in nodes:
            by_host.setdefault(placement[n], []).append(n)
        results: dict[str, Any] = {}

        def one(group: list[str]) -> None:
            try:
                results[placement[group[0]]] = controller.run_on_node_host(tb, group[0], ["ps", *group, *flags],
                                                                           timeout=120)
            except Exception as exc:  # noqa: BLE001 - that host's failure, reported with the others
                results[placement[group[0]]] = exc

        threads = [threading.Thread(target=one, args=(g,), daemon=True) for g in by_host.values()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        results = controller.run_on_every_host(tb, ["ps", *flags], timeout=120)
    rows, failed = [], False
    for host, r in sorted(results.items()):
        try:
            if isinstance(r, Exception):
                raise r
            if r.rc != 0:
                raise TestbedError(r.stderr.strip() or r.stdout.strip() or f"exit status {r.rc}")
            got = json.loads(r.stdout)
        except (TestbedError, ValueError) as exc:
            failed = True
            err_console.print(f"[red]{host}:[/] {exc}", highlight=False)
            continue
        rows += [{**row, "host": host} for row in got]
    order = {n: i for i, n in enumerate(placement)}
    rows.sort(key=lambda r: (order.get(r["node"], len(order)), r["nspid"] or 0, r["pid"]))
    return rows, failed


def register(app: typer.Typer) -> None:
    @app.command(help="List the processes running in each worker (or the NODEs named).")
    def ps(nodes: Optional[list[str]] = typer.Argument(None, help="Nodes to show (default: every worker)."),
           all_nodes: bool = typer.Option(False, "--all", "-a", help="Switches too."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
           name: Optional[str] = NameOption) -> None:
        from rich.table import Table

        from testbed import lifecycle

        from testbed.cli.attach import spread

        tb = resolve_name(name, clusters=True)
        failed = False   # a host of a testbed over several hosts did not answer: shown, then exit 1
        if spread(tb):
            rows, failed = _across_hosts(tb, list(nodes or []), all_nodes)
        else:
            st = lifecycle.load(tb)
            topo_nodes = st.get("topology", {}).get("nodes", [])
            known = [n["name"] for n in topo_nodes]
            part = st.get("part")   # this host's part of a testbed over several hosts: its own nodes
            here = set(known) if part is None else set(part.get("nodes", ()))
            if nodes:
                bad = [n for n in nodes if n not in known]
                if bad:
                    raise StateError(f"testbed {tb!r} has no node {bad[0]!r}")
                away = [n for n in nodes if n not in here]
                if away:
                    raise StateError(f"{away[0]} is not on this host ({part.get('host')}): testbed {tb} spans "
                                     "several hosts; run it on the controller, which asks each node's host")
                chosen = list(nodes)
            else:
                chosen = [n["name"] for n in topo_nodes
                          if (all_nodes or n["kind"] == "worker") and n["name"] in here]
            rows = processes(st, chosen)
        if as_json:
            console.print_json(json.dumps(rows))
            if failed:
                raise typer.Exit(1)
            return
        hosts = any("host" in r for r in rows) or spread(tb)
        t = Table(box=None, header_style="bold")
        for col in ("NODE", *(("HOST",) if hosts else ()), "PID", "NSPID", "USER", "RSS", "CPU", "COMMAND"):
            t.add_column(col, justify="right" if col in ("PID", "NSPID", "RSS", "CPU") else "left",
                         overflow="fold" if col == "COMMAND" else None)
        for r in rows:
            rss = f"{r['rss_bytes'] / 2**20:.0f}M" if r["rss_bytes"] is not None else "-"
            t.add_row(r["node"], *((r.get("host") or "-",) if hosts else ()), str(r["pid"]), str(r["nspid"] or "-"),
                      r["user"] or "-", rss, f"{r['cpu_s']:.1f}s" if r["cpu_s"] is not None else "-", r["command"])
        console.print(t)
        if not rows:
            console.print("no processes", style="dim")
        if failed:
            raise typer.Exit(1)
