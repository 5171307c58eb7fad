"""testbed topo FILE: validate a topology and describe it, building nothing.

FILE is a bare name in topologies/ (``fat-tree``), a path to a YAML file, a
Mininet custom-topology file (``my.py``, ``my.py:NAME,ARG,KEY=VALUE``) or one of
Mininet's built-in topologies (``mininet:tree,depth=2,fanout=2``); see
testbed.topology.mininet_import.

With ``--hosts HOSTS.yaml`` (and ``--pin NODE=HOST``) it also shows where each
node would run across those hosts and which links would be cut
(testbed.cluster.placement; docs/multi-host.md), still building nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from testbed.cli.common import console, err_console


def _bw(bps: float | None) -> str:
    from testbed.topology.units import format_bandwidth

    if bps is None:
        return "unshaped"
    if bps == float("inf"):
        return "unshaped"
    return format_bandwidth(bps)


def route_counts(topo, plan) -> dict[str, Any]:
    """How many routes each switch gets (the plan summarises them): the total, what one route per foreign
    worker subnet would be, min/median/max per switch layer (hops to the nearest worker), per switch."""
    from statistics import median

    from testbed.topology.analysis import switch_layers

    per_switch = {sw: len(plan.routes[sw]) for sw in topo.switches}
    layer_of = switch_layers(topo)
    layers: dict[int | None, list[int]] = {}
    for sw, n in per_switch.items():
        layers.setdefault(layer_of.get(sw), []).append(n)
    return {
        "total": sum(per_switch.values()),
        "unsummarised": sum(len(plan.subnets) - (sw in plan.subnets) for sw in topo.switches),
        "layers": [{"layer": lay, "switches": len(ns), "min": min(ns), "median": median(ns), "max": max(ns)}
                   for lay, ns in sorted(layers.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))],
        "per_switch": per_switch,
    }


def topology_json(topo, plan=None) -> dict[str, Any]:
    """The --json document: name, workers, switches, links (a->b profile, reverse if asymmetric), addresses,
    routes (route_counts)."""
    from testbed.topology.plan import plan_network

    plan = plan or plan_network(topo)
    links = []
    for link in topo.links:
        entry: dict[str, Any] = {"endpoints": [link.a, link.b], "tier": link.tier, **link.ab.to_json()}
        if not link.symmetric:
            entry["reverse"] = link.ba.to_json()
        links.append(entry)
    return {
        "name": topo.name,
        "workers": topo.workers,
        "switches": topo.switches,
        "links": links,
        "addresses": {node: plan.addresses(node) for node in topo.nodes},
        "routes": route_counts(topo, plan),
    }


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    if x == float("inf"):
        return "inf (unshaped downlinks)"
    return f"{x:.3g}:1"


def describe(topo, warnings: list[str], plan=None) -> None:
    from rich.table import Table

    from testbed.topology import analysis

    c = analysis.counts(topo)
    gen = f", generator {topo.generator} {topo.params}" if topo.generator else ""
    console.print(f"[bold]{topo.name}[/] ({topo.source or 'built-in'}{gen})", highlight=False)
    line = f"{c['workers']} workers, {c['switches']} switches, {c['links']} links, {c['tiers']} tiers"
    if c["gpus"]:
        line += f", {c['gpus']} GPUs"
    console.print(line, highlight=False)

    table = Table(title="link profiles per tier (both directions)", title_justify="left")
    for col in analysis.TIER_COLUMNS:
        table.add_column(col, justify="right" if col == "links" else "left")
    for row in analysis.tier_rows(topo):
        cells = row.cells()
        if row.asymmetric:
            cells[1] += f" ({row.asymmetric} asym.)"
        table.add_row(*cells)
    console.print(table)

    b = analysis.bisection(topo)
    how = {"formula": "closed form", "exhaustive": "exact, all bipartitions",
           "heuristic": "upper bound, heuristic bipartitions", "trivial": "fewer than 2 workers"}[b.method]
    text = f"bisection bandwidth: {_bw(b.bps) if b.method != 'trivial' else '-'} ({how})"
    if b.per_worker_bps is not None:
        text += f", {_bw(b.per_worker_bps)} per worker of a half"
    console.print(text, highlight=False)

    rows = analysis.oversubscription(topo)
    if rows:
        ot = Table(title="oversubscription per switch layer (downlink / uplink capacity)", title_justify="left")
        for col in ("layer", "switches", "down -> up tiers", "down", "up", "ratio", "worst switch"):
            ot.add_column(col)
        for r in rows:
            ot.add_row(str(r.layer), str(len(r.switches)), r.name, _bw(r.down_bps), _bw(r.up_bps) if r.up_bps else "-",
                       _ratio(r.ratio), _ratio(r.max_ratio))
        console.print(ot)

    if plan is not None and plan.subnets:
        nets = [s.network for s in plan.subnets.values()]
        console.print(f"worker subnets: {len(nets)} ({nets[0]}{' .. ' + nets[-1] if len(nets) > 1 else ''})",
                      highlight=False)
    if plan is not None and topo.switches:
        r = route_counts(topo, plan)
        console.print(f"routes: {r['total']} on {len(topo.switches)} switches (summarised; one per foreign "
                      f"worker subnet: {r['unsummarised']})", highlight=False)
        rt = Table(title="routes per switch, by switch layer", title_justify="left")
        for col in ("layer", "switches", "min", "median", "max"):
            rt.add_column(col, justify="left" if col == "layer" else "right")
        for row in r["layers"]:
            rt.add_row(str(row["layer"] if row["layer"] is not None else "no worker"), str(row["switches"]),
                       str(row["min"]), f"{row['median']:g}", str(row["max"]))
        console.print(rt)
    e = analysis.ecmp_summary(topo)
    if e.histogram:
        hist = ", ".join(f"{paths} path{'s' if paths != 1 else ''}: {pairs} pairs"
                         for paths, pairs in sorted(e.histogram.items()))
        console.print(f"ECMP between racks: {hist}", highlight=False)
    extra = []
    if e.same_switch_pairs:
        extra.append(f"{e.same_switch_pairs} worker pairs share a switch")
    if e.unreachable_pairs:
        extra.append(f"[yellow]{e.unreachable_pairs} worker pairs have no switch path[/]")
    if extra:
        console.print("; ".join(extra), highlight=False)
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)


def _compact(names: list[str]) -> str:
    """w0, w1, ..., w7, edge0-0 -> 'w0..w7, edge0-0': runs of 3 or more consecutive numbers shortened."""
    import re

    out: list[str] = []
    run: list[tuple[str, int, str]] = []

    def flush() -> None:
        if len(run) >= 3:
            out.append(f"{run[0][2]}..{run[-1][2]}")
        else:
            out.extend(name for _, _, name in run)
        run.clear()

    for name in names:
        m = re.match(r"^(.*?)(\d+)$", name)
        if m and run and run[-1][0] == m.group(1) and run[-1][1] + 1 == int(m.group(2)):
            run.append((m.group(1), int(m.group(2)), name))
            continue
        flush()
        if m:
            run.append((m.group(1), int(m.group(2)), name))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


CUT_LINKS_LISTED = 40   # more cut links than this are summarised per host pair and tier (--json lists all)


def describe_placement(hosts, placement, baseline_bps: int | None) -> None:
    """The placement as tables: per host (nodes, capacity used), the cut links, the total cut bandwidth."""
    from rich.table import Table

    from testbed.topology.units import format_size

    by_name = {h.name: h for h in hosts}
    ht = Table(title=f"placement on {len(hosts)} hosts ({hosts.source or 'hosts file'})", title_justify="left")
    for col in ("host", "ssh", "underlay", "workers", "switches", "cores", "GPUs", "memory"):
        ht.add_column(col, justify="right" if col in ("cores", "GPUs", "memory") else "left", overflow="fold")
    for load in placement.loads:
        h = by_name[load.host]
        memory = (f"{format_size(load.memory_used)} / {format_size(load.memory)}" if load.memory is not None
                  else (f"{format_size(load.memory_used)} / -" if load.memory_used else "-"))
        ht.add_row(load.host, str(h.target), h.underlay,
                   f"{len(load.workers)}: {_compact(list(load.workers))}" if load.workers else "0",
                   f"{len(load.switches)}: {_compact(list(load.switches))}" if load.switches else "0",
                   f"{load.cores_used:g} / {load.cores}", f"{load.gpus_used} / {load.gpus}", memory)
    console.print(ht)
    if placement.pins:
        console.print("pinned: " + ", ".join(f"{n}={h}" for n, h in placement.pins.items()), highlight=False)

    cut = placement.cut_links
    if cut and len(cut) <= CUT_LINKS_LISTED:
        ct = Table(title=f"cut links ({len(cut)}): VXLAN tunnels between hosts at `up --hosts`",
                   title_justify="left")
        for col in ("link", "tier", "hosts", "a->b", "b->a"):
            ct.add_column(col)
        for link in cut:
            ct.add_row(f"{link.a} - {link.b}", link.tier, f"{link.host_a} - {link.host_b}", _bw(link.ab_bps),
                       _bw(link.ba_bps))
        console.print(ct)
    elif cut:
        groups: dict[tuple[str, str, str], list] = {}
        for link in cut:
            pair = tuple(sorted((link.host_a, link.host_b)))
            groups.setdefault((pair[0], pair[1], link.tier), []).append(link)
        ct = Table(title=f"cut links ({len(cut)}) by host pair and tier (--json lists each)", title_justify="left")
        for col in ("hosts", "tier", "links", "bandwidth (both directions)"):
            ct.add_column(col, justify="right" if col == "links" else "left")
        for (a, b, tier), links in sorted(groups.items()):
            shaped = sum(bw for link in links for bw in (link.ab_bps, link.ba_bps) if bw is not None)
            unshaped = sum(1 for link in links if link.bandwidth_bps is None)
            ct.add_row(f"{a} - {b}", tier, str(len(links)),
                       _bw(shaped) + (f" + {unshaped} unshaped" if unshaped else ""))
        console.print(ct)
    text = f"cut bandwidth: {_bw(placement.cut_bps) if cut else '0'} (both directions) over {len(cut)} links"
    if placement.unshaped_cut:
        text += f", {placement.unshaped_cut} of them unshaped (not counted)"
    if baseline_bps is not None and cut:
        text += f"; dealing nodes round-robin would cut {_bw(baseline_bps)}"
    console.print(text, highlight=False)


def placement_of(topo, hosts_file: Path, pin: list[str]):
    """(hosts, placement, round-robin's cut bandwidth or None) for `topo` on the hosts of `hosts_file`."""
    from testbed.errors import TopologyError
    from testbed.cluster.hosts import load_hosts
    from testbed.cluster.placement import parse_pins, place

    hosts = load_hosts(hosts_file)
    placement = place(topo, hosts, parse_pins(pin))
    try:
        baseline: int | None = place(topo, hosts, placement.pins, method="round-robin").cut_bps
    except TopologyError:  # dealing in turn can fail to pack where the partitioner does not
        baseline = None
    return hosts, placement, baseline


def register(app: typer.Typer) -> None:
    @app.command("topo")
    def topo_cmd(
        file: str = typer.Argument(..., metavar="FILE",
                                   help="A topology: name in topologies/, .yaml path, Mininet .py[:NAME,ARGS] "
                                        "or mininet:NAME[,ARGS]."),
        set_: Optional[List[str]] = typer.Option(None, "--set", "-s", metavar="PATH=VALUE",
                                                 help="Override a field, e.g. params.k=6 or "
                                                      "tiers.host.bandwidth=1gbit (repeatable)."),
        as_json: bool = typer.Option(False, "--json", help="Print the topology as JSON (nodes, links, "
                                                           "addresses) and nothing else."),
        png: Optional[Path] = typer.Option(None, "--png", metavar="OUT", help="Draw the topology to OUT (PNG)."),
        hosts_file: Optional[Path] = typer.Option(None, "--hosts", metavar="HOSTS.yaml",
                                                  help="Also place the nodes on these hosts and show the cut links "
                                                       "(docs/multi-host.md); builds nothing."),
        pin: Optional[List[str]] = typer.Option(None, "--pin", metavar="NODE=HOST",
                                                help="With --hosts: run NODE on HOST (repeatable)."),
    ) -> None:
        """Validate a topology and describe it (counts, tiers, bisection, oversubscription); builds nothing."""
        from testbed.topology.mininet_import import load_any

        from testbed.topology.plan import plan_network

        if pin and hosts_file is None:
            from testbed.errors import TopologyError

            raise TopologyError("needs --hosts (the hosts to pin nodes to)", path="--pin", value=pin[0])
        topo, warnings = load_any(file, list(set_ or []))
        plan = plan_network(topo)  # the address plan is part of validity (a pool can be too small)
        placed = placement_of(topo, hosts_file, list(pin or [])) if hosts_file is not None else None
        if as_json:
            doc = topology_json(topo, plan)
            if placed is not None:
                hosts, placement, baseline = placed
                doc["hosts"] = hosts.to_json()
                doc["placement"] = {**placement.to_json(), "round_robin_cut_bps": baseline}
            for w in warnings:
                err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
            typer.echo(json.dumps(doc, indent=2))
        else:
            describe(topo, warnings, plan)
            if placed is not None:
                describe_placement(*placed)
        if png is not None:
            from testbed.report.draw import draw_topology

            out = draw_topology(topo, png)
            (err_console if as_json else console).print(f"drew {out}", highlight=False)
