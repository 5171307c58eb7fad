"""testbed status [NAME] [--json]: nodes, addresses and links of a running testbed."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.table import Table

from testbed.cli.common import console, fail, print_dilation


def _fmt_bw(b):
    from testbed.topology.units import format_bandwidth

    return "unshaped" if b is None else format_bandwidth(b)


def _fmt_t(seconds):
    from testbed.topology.units import format_time

    return format_time(seconds)


def status_cmd(
    name_arg: Optional[str] = typer.Argument(None, metavar="[NAME]", help="The testbed (default: the only one up)."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="The testbed (same as NAME)."),
    as_json: bool = typer.Option(False, "--json", help="Print the status document as JSON (indented on a "
                                 "terminal, one line into a pipe or file)."),
) -> None:
    """Show a running testbed: nodes with addresses, links with their shaping and state."""
    from testbed.handle import open_testbed

    if name_arg and name and name_arg != name:
        fail(f"two different names given ({name_arg}, {name})", 2)
    doc = open_testbed(name_arg or name).status()
    if "hosts" in doc:   # spread over several hosts: each host's part
        _hosts_status(doc, as_json)
        return
    if as_json:
        _print_json(doc)
        return
    console.print(f"[bold]{doc['name']}[/]: {doc['status']} ({doc['topology']}, runtime {doc['runtime']}, "
                  f"since {doc['created']})")
    if doc.get("net_admin"):
        console.print("  [yellow]workers have CAP_NET_ADMIN[/] (up --net-admin): a job can change its links' shaping")
    for m in doc.get("missing", [])[:10]:
        console.print(f"  [red]missing:[/] {m}")
    nt = Table(title="nodes", title_justify="left")
    for col in ("node", "kind", "addresses"):
        nt.add_column(col)
    for n in doc["nodes"]:
        nt.add_row(n["name"], n["kind"], ", ".join(n["addresses"]))
    console.print(nt)
    lt = Table(title="links", title_justify="left")
    for col in ("#", "endpoints", "tier", "bandwidth", "delay", "jitter", "loss", "queue", "state"):
        lt.add_column(col)
    for link in doc["links"]:
        lt.add_row(str(link["index"]), " - ".join(link["endpoints"]), link["tier"], _fmt_bw(link["bandwidth_bps"]),
                   _fmt_t(link["delay_s"]), _fmt_t(link["jitter_s"]), f"{link['loss'] * 100:g}%",
                   str(link["queue"] or "auto"),
                   (link["state"] if link["state"] == "up" else f"[red]{link['state']}[/]")
                   + (" [yellow](changed)[/]" if link.get("changed") else "")
                   + (" [yellow](asymmetric)[/]" if link.get("reverse") else ""))
    console.print(lt)
    print_dilation(doc)
    faults = doc.get("faults") or {}
    if faults.get("partition"):
        console.print(f"[red]partitioned:[/] {faults['partition']} (testbed heal)")
    for node, rec in (faults.get("nodes") or {}).items():
        console.print(f"[yellow]{node}:[/] {rec}")


def _print_json(doc: dict) -> None:
    """Indented for a reader; one line for a program: json encodes with an indent in Python, not in
    its C encoder (k=16: 0.11 s against 0.04 s, of a 0.5 s budget)."""
    print(json.dumps(doc, indent=1 if sys.stdout.isatty() else None))


def _hosts_status(doc: dict, as_json: bool) -> None:
    """A testbed over several hosts: each host's part (nodes, missing pieces) or why it is lost. What
    a host said is shown as text, never as markup."""
    from rich.text import Text

    from testbed.terminal import inert

    if as_json:
        _print_json(doc)
        return
    console.print(f"[bold]{doc['name']}[/]: {doc['status']} on {len(doc['hosts'])} hosts, "
                  f"{len(doc['cut_links'])} link(s) between hosts (VXLAN)")
    t = Table(title="hosts", title_justify="left")
    for col in ("host", "state", "nodes", "links down", "missing"):
        t.add_column(col)
    placement = doc["placement"]
    for host, st in doc["hosts"].items():
        nodes = [n for n, h in placement.items() if h == host]
        if "lost" in st:
            t.add_row(Text(host), Text("lost", style="red"), str(len(nodes)), "-", Text(inert(st["lost"][:120])))
            continue
        links = st.get("links") if isinstance(st.get("links"), list) else []
        down = sum(1 for link in links if not isinstance(link, dict) or link.get("state") != "up")
        missing = st.get("missing", [])
        t.add_row(Text(host), Text(inert(st.get("status", "?"))), str(len(nodes)), str(down),
                  Text(inert("; ".join(missing[:3])), style="red") if missing else "")
    console.print(t)
    nt = Table(title="nodes", title_justify="left")
    for col in ("node", "host"):
        nt.add_column(col)
    for n, h in list(placement.items())[:40]:
        nt.add_row(Text(n), Text(h))
    if len(placement) > 40:
        nt.caption = f"... and {len(placement) - 40} more (--json)"
    console.print(nt)


def register(app: typer.Typer) -> None:
    app.command("status")(status_cmd)
