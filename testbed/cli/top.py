"""testbed top [--name NAME] [--sort util|drops|queue] [--tier TIER] [--once] [--json] [--interval S]:
a live view of a running testbed's links, workers and job (testbed.observe.top samples them).

A testbed over several hosts: every host's agent samples its own part at once, and the
controller merges their latest documents into one of the same shape (testbed.cluster.top),
with each worker's and link direction's host; a host that fails or does not answer is shown as
such. Ctrl-C stops every host's top (testbed.handle gives the sampler, here or over hosts)."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, console, fail, require_root


def _bits(bps: float | None) -> str:
    if bps is None:
        return "-"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g}{unit}"
    return f"{bps:.0f}bit"


def _bytes(n: float | None) -> str:
    from testbed.topology.units import format_size

    return "-" if n is None else format_size(n)


def _short_bytes(n: float | None) -> str:
    """1536 -> '1.5K', 3e6 -> '2.9M' (binary multiples, as the queue column's room allows)."""
    if n is None:
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _util(u: float | None) -> str:
    if u is None:
        return "-"
    text = f"{u * 100:.0f}%"
    return f"[red]{text}[/]" if u >= 0.9 else f"[yellow]{text}[/]" if u >= 0.5 else text


def time_line(doc: dict[str, Any]) -> str:
    s = doc["dilation"]
    if s == 1:
        return "real time (no time dilation): rates as the wire sees them"
    return (f"emulated time: dilation {s:g}, the kernel runs links at bandwidth/{s:g}; rates are the wire's "
            f"x{s:g}, utilisation is against the profile's bandwidth, step times divided by {s:g}")


def run_line(run: dict[str, Any] | None) -> str:
    if run is None:
        return "no run active (testbed run)"
    where = run["dir"] or f"run {run['run_id']}"
    if run["step"] is None:
        return f"run {where}: {run['ranks']} rank file(s), no step finished yet"
    text = f"run {where}: step {run['step']}"
    if run["step_min"] is not None and run["step_min"] != run["step"]:
        text += f" (slowest rank at {run['step_min']})"
    text += f", last step {_ms(run['last_step_s'])}"
    if run["last_step_max_s"] is not None and run["last_step_max_s"] != run["last_step_s"]:
        text += f" (slowest {_ms(run['last_step_max_s'])})"
    if run["last_step_age_s"] is not None:
        text += f", {run['last_step_age_s']:.0f} s ago"
    if run["ranks_ended"]:
        text += f", {run['ranks_ended']}/{run['ranks']} ranks ended"
    if len(run.get("hosts") or ()) > 1:
        text += f" (ranks on {', '.join(run['hosts'])})"
    return text


def render(doc: dict[str, Any], sort: str, tier: str | None, height: int | None = None) -> Any:
    """The view of one sample: a header, the link directions busiest first, the workers, the run.
    With a height (the live view), only the busiest rows that fit; without, all of them."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from testbed.observe.top import select

    rows = select(doc["links"], sort, tier)
    workers = sorted(doc["workers"], key=lambda w: -1.0 if w["cpu"] is None else w["cpu"], reverse=True)
    l_rows, w_rows = len(rows), len(workers)
    spread = "hosts" in doc          # a testbed over several hosts (testbed.cluster.top)
    troubles = host_lines(doc) if spread else []
    if height is not None:
        room = max(6, height - 12 - len(troubles))   # header, run line, two tables' titles, headers and rules
        w_rows = min(w_rows, max(2, room // 4))
        l_rows = min(l_rows, max(3, room - w_rows))
    down = sum(1 for l in doc["links"] if l["state"] not in ("up", "unknown")) // 2
    if doc["interval_s"] is None or doc["read_s"] is None:   # (across hosts: none has a reading yet)
        timing = "no reading yet"
    else:
        timing = f"{doc['interval_s']:.1f} s between readings, a reading took {doc['read_s'] * 1e3:.0f} ms"
    head = Text.from_markup(
        f"[bold]{doc['testbed']}[/]: {len(doc['links']) // 2} links"
        + (f" over {len(doc['hosts'])} hosts" if spread else "")
        + (f" ([red]{down} down[/])" if down else "")
        + f", {len(rows)} directions{f' of tier {tier}' if tier else ''} by {sort}; {timing}"
        + ("; Ctrl-C quits" if height is not None else ""))

    def table(title: str, shown: int, total: int) -> Table:
        more = f" (busiest {shown} of {total})" if shown < total else ""
        return Table(title=title + more, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                     padding=(0, 1), collapse_padding=True)

    lt = table("links", l_rows, len(rows))
    for col in ("link", "tier", *(("host",) if spread else ()), "state", "rate", "of", "util", "queue", "drops",
                "ovlim"):
        lt.add_column(col, justify="left" if col in ("link", "tier", "host", "state") else "right", no_wrap=True)
    for l in rows[:l_rows]:
        queue = "-" if l["backlog_bytes"] is None else f"{_short_bytes(l['backlog_bytes'])}/{l['backlog_packets']}p"
        lt.add_row(l["name"], l["tier"], *((link_host(l),) if spread else ()),
                   l["state"] if l["state"] == "up" else f"[red]{l['state']}[/]",
                   _bits(l["rate_bps"]), _bits(l["bandwidth_bps"]) if l["bandwidth_bps"] else "unshaped",
                   _util(l["util"]), queue, f"[red]{l['drops']}[/]" if l["drops"] else _count(l["drops"]),
                   _count(l["overlimits"]))
    wt = table("workers", w_rows, len(workers))
    for col in ("worker", *(("host",) if spread else ()), "state", "cpu", "memory"):
        wt.add_column(col, justify="left" if col in ("worker", "host", "state") else "right", no_wrap=True)
    for w in workers[:w_rows]:
        wt.add_row(w["name"], *((w.get("host") or "-",) if spread else ()),
                   w["state"] if w["state"] == "up" else f"[red]{w['state']}[/]",
                   "-" if w["cpu"] is None else f"{w['cpu'] * 100:.0f}%", _bytes(w["memory_bytes"]))
    return Group(head, *(Text.from_markup(t) for t in troubles), Text(time_line(doc), style="dim"), lt, wt,
                 Text(run_line(doc["run"])))


def link_host(l: dict[str, Any]) -> str:
    """Where a direction is measured: its sending end's host ('h1>h2': a cut link, a tunnel to h2)."""
    src, dst = l.get("host") or "-", l.get("to_host") or "-"
    return src if src == dst else f"{src}>{dst}"


def host_lines(doc: dict[str, Any]) -> list[str]:
    """One line (markup) per host of a testbed over several hosts that is not answering as it should."""
    colour = {"failed": "red", "stale": "yellow", "waiting": "yellow"}
    return [f"[{colour.get(st['state'], 'red')}]{h}: {st['state']}[/]: {escape(st.get('why') or '')}"
            for h, st in (doc.get("hosts") or {}).items() if st["state"] != "ok"]


def escape(text: str) -> str:
    from rich.markup import escape as esc

    return esc(text)


def top_cmd(
    name: Optional[str] = NameOption,
    sort: Optional[str] = typer.Option(None, "--sort", "-s", help="Busiest first by: util (the view's default), "
                                                                  "drops or queue (backlog); --json keeps "
                                                                  "topology order unless given."),
    tier: Optional[str] = typer.Option(None, "--tier", "-t", help="Only the links of this tier (host, edge-agg, ...)."),
    once: bool = typer.Option(False, "--once", help="Print one sample (after one interval) and exit."),
    as_json: bool = typer.Option(False, "--json", help="JSON documents instead of the view: one per interval, "
                                                       "one line each (with --once: one, indented)."),
    interval: float = typer.Option(1.0, "--interval", "-i", min=0.1, help="Seconds between refreshes."),
    runs: Optional[str] = typer.Option(None, "--runs", help="Where `testbed run` keeps its run directories "
                                                            "(default: ./runs; across hosts: a directory on "
                                                            "the hosts)."),
) -> None:
    """Watch a running testbed live: per link direction rate, utilisation, queue and drops; workers'
    CPU and memory; the running job's step.

    Rates and step times are the emulated cluster's (under time dilation s: the wire's x s, as
    `testbed status` and `testbed report` show them). Counters are read through one netlink
    socket per namespace; `--once --json` prints one sample for scripts (fields: pydoc
    testbed.observe.top). A testbed over several hosts: every host's top at once, merged into one
    view (fields: pydoc testbed.cluster.top)."""
    from testbed.handle import open_testbed
    from testbed.observe.top import SORT_KEYS

    if sort is not None and sort not in SORT_KEYS:
        fail(f"--sort {sort!r}: use one of {', '.join(SORT_KEYS)}", 2)
    require_root("testbed top")
    tb = open_testbed(name)
    live = not (as_json or once)
    top = tb.top(interval, runs, live=live)
    said: dict[str, str] = {}

    def tell(doc: dict[str, Any]) -> None:
        """Each host's trouble on stderr (the view shows it itself), once; again when it changes."""
        from rich.text import Text

        from testbed.cli.common import err_console
        from testbed.terminal import inert

        for h, st in (doc.get("hosts") or {}).items():
            line = "" if st["state"] in ("ok", "stale") else f"{st['state']}: {st.get('why') or ''}"
            if line and said.get(h) != line:
                err_console.print(Text.assemble((inert(h), "red"), ": ", inert(line)))
            said[h] = line

    try:
        if tier is not None and tier not in top.tiers:
            fail(f"--tier {tier!r}: testbed {tb.name} has tiers {', '.join(top.tiers)}", 2)
        if live:
            _live(top, sort or "util", tier)
            return
        while True:
            doc = top.sample()
            hosts = doc.get("hosts")   # (over several hosts: each host's state)
            if once:
                top.close()   # (every host's top stopped: a host that had failed says why now)
                doc = top.settle(doc)
            if hosts is not None and not any(st["t"] is not None for st in hosts.values()):   # no reading
                tell(doc)
                raise typer.Exit(1)
            if as_json:
                tell(doc)
            _emit(doc, sort, tier, once, as_json)
            if once:
                if hosts is not None and any(st["state"] in ("failed", "waiting") for st in hosts.values()):
                    raise typer.Exit(1)
                return
    except KeyboardInterrupt:
        return
    except BrokenPipeError:   # `testbed top --json | head -3`: the reader has what it wanted
        _quiet_stdout()
        return
    finally:
        top.close()


def _emit(doc: dict[str, Any], sort: Optional[str], tier: Optional[str], once: bool, as_json: bool) -> None:
    """One sample printed: the JSON document (its links sorted and filtered as asked) or the view."""
    from testbed.observe.top import select

    if as_json:
        if tier is not None or sort is not None:
            doc["links"] = select(doc["links"], sort, tier) if sort else \
                [l for l in doc["links"] if l["tier"] == tier]
        print(json.dumps(doc, indent=1 if once else None), flush=True)
    else:
        console.print(render(doc, sort or "util", tier))


def _quiet_stdout() -> None:
    import os
    import sys

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit's flush


def _live(top: Any, sort: str, tier: str | None) -> None:
    from rich.live import Live
    from rich.text import Text

    with Live(Text(f"{top.name}: first reading, {top.interval:g} s ..."), console=console, screen=True,
              auto_refresh=False, transient=True) as live:
        while True:
            doc = top.sample()
            live.update(render(doc, sort, tier, console.size.height), refresh=True)


def register(app: typer.Typer) -> None:
    app.command("top")(top_cmd)
