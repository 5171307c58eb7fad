"""testbed topo FILE: validate a topology and describe it, building nothing.

FILE is a bare name in topologies/ (``fat-tree``), a path to a YAML file, a
Mininet custom-topology file (``my.py``, ``my.py:NAME,ARG,KEY=VALUE``) or one of
Mininet's built-in topologies (``mininet:tree,depth=2,fanout=2``); see
testbed.topology.mininet_import.
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
    ) -> None:
        """Validate a topology and describe it (counts, tiers, bisection, oversubscription); builds nothing."""
        from testbed.topology.mininet_import import load_any

        from testbed.topology.plan import plan_network

        topo, warnings = load_any(file, list(set_ or []))
        plan = plan_network(topo)  # the address plan is part of validity (a pool can be too small)
        if as_json:
            doc = topology_json(topo, plan)
            for w in warnings:
                err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
            typer.echo(json.dumps(doc, indent=2))
        else:
            describe(topo, warnings, plan)
        if png is not None:
            from testbed.report.draw import draw_topology

            out = draw_topology(topo, png)
            (err_console if as_json else console).print(f"drew {out}", highlight=False)
