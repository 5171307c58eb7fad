"""`testbed doctor`: what this machine can emulate, and what to install for the rest."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from testbed.cli.common import console


def _findings(scale: str, cached: bool) -> tuple[Any, Any, list[Any]]:
    """(capabilities, the --for topology or None, its limit checks)."""
    import shlex

    from testbed.net import limits
    from testbed.net.capabilities import probe
    from testbed.topology.loader import load_topology

    words = shlex.split(scale)
    overrides = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
    topo = load_topology(words[0], overrides) if words else None
    checked = limits.check(len(topo.nodes), len(topo.workers)) if topo is not None else []
    return probe(measure_floor=True, refresh=not cached), topo, checked


def _underlay_filter() -> dict[str, Any]:
    """Whether this host can filter its tunnel ends' underlay (nft in the host's namespace): every
    host a cut link joins needs it, and `up --hosts` refuses a host without it before building."""
    from testbed.net import underlay_filter

    why = underlay_filter.usable()
    return {"ok": why is None, "why": why}


def report(scale: str = "", cached: bool = True) -> dict[str, Any]:
    """`doctor --json`'s document (also what `part up --check` answers for a controller)."""
    caps, topo, checked = _findings(scale, cached)
    return {**caps.to_json(), "underlay_filter": _underlay_filter(), "limits": {
        "for": scale, "nodes": len(topo.nodes) if topo else None,
        "checks": [{"name": c.name, "have": c.have, "need": c.need, "ok": c.ok, "blocks_up": c.hard,
                    "fix": c.fix} for c in checked]}}


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(as_json: bool = typer.Option(False, "--json", help="Print the capabilities as JSON."),
               scale: str = typer.Option("fat-tree --set params.k=16", "--for",
                                         help="Check the machine's limits (namespaces, open files, PIDs, "
                                              "memory) for this topology (as `testbed up` takes it, with "
                                              "--set overrides after it; '' for none)."),
               cached: bool = typer.Option(False, "--cached",
                                           help="Use the kernel probe cached this boot (by `up` or an earlier "
                                                "doctor) when there is one, instead of probing again.")) -> None:
        """Probe the kernel and machine: netem, HTB, TAP delay line, BPF loss, Docker, GPUs, latency floor."""
        if as_json:
            print(json.dumps(report(scale, cached), indent=2, sort_keys=True))
            return
        caps, topo, checked = _findings(scale, cached)
        table = Table(title=f"testbed doctor (kernel {caps.kernel})")
        table.add_column("capability")
        table.add_column("found")
        table.add_column("what it enables / what to install")
        for name, found, what in caps.rows():
            table.add_row(name, "[green]yes[/]" if found else "[red]no[/]", what)
        uf = _underlay_filter()
        table.add_row("nft (underlay filter)", "[green]yes[/]" if uf["ok"] else "[red]no[/]",
                      escape("multi-host (up --hosts): a VXLAN end takes frames from its peer host only; needed "
                             "on every host a cut link joins" + ("" if uf["ok"] else f". {uf['why']}")))
        console.print(table)
        if caps.netem:
            console.print("delay/jitter/loss: sch_netem")
        elif caps.tun:
            console.print("delay/jitter: userspace delay line (no sch_netem); loss: "
                          + ("cls_bpf" if caps.bpf else "[red]unavailable[/]"))
        else:
            console.print("[red]delay/jitter unavailable[/]: install sch_netem or enable /dev/net/tun")
        if topo is not None:
            lt = Table(title=f"limits for {scale} ({len(topo.workers)} workers, {len(topo.nodes)} nodes)")
            for col in ("limit", "here", "needed", "fix"):
                lt.add_column(col)
            for c in checked:
                mark = "[green]" if c.ok else ("[red]" if c.hard else "[yellow]")
                lt.add_row(c.name, f"{mark}{'?' if c.have is None else c.have}[/]", str(c.need),
                           "" if c.ok else c.fix)
            console.print(lt)
        from testbed.jobs import calibration

        cal = calibration.cached()
        if cal is None:
            console.print("reference model: not calibrated on this boot (testbed calibrate; `auto` dilation "
                          "and `testbed run` do it when needed)")
        else:
            console.print("reference model constants (testbed calibrate --refresh to measure again):")
            for line in cal.lines():
                console.print(f"  {line}", highlight=False)
