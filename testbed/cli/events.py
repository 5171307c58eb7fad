"""testbed events [-f] [--json]: what changed in a testbed, from `up` on.

A testbed over several hosts: each host keeps its own stream (what it changed on its part). From the
controller, `events --json` runs on every host at once and their events are printed merged in time
order (each host's clock), with the host of each (a HOST column; a `host` field with --json). With -f,
every host's `events -f --json` streams back and each event is printed as it arrives, in arrival order
(not re-sorted: an event of a distant host may show a little after a later one of a near host), until
Ctrl-C (every host's `events -f` then ends) or `testbed down`. A host that fails or cannot be reached
is named on stderr with why, the others still shown; the exit status is then 1 (with -f too: a host
that could not be followed, not the Ctrl-C that ends it).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, console, err_console, resolve_name
from testbed.terminal import inert, plain
from testbed.observe.answers import merge, parse_answers, why  # noqa: F401 (merge, parse_answers: tests too)

HEADER = "TIME          {host:<{w}}  KIND      WHAT"


def _hosts_argv(tb: str, kind: str | None, follow: bool) -> list[str]:
    return ["events", "--json", "--name", tb, *(["--kind", kind] if kind else []), *(["-f"] if follow else [])]


def _host_names(tb: str) -> list[str]:
    from testbed.cluster import controller

    doc = controller.load(tb)
    return list(doc.get("hosts") or {}) or list(dict.fromkeys(doc["placement"].values()))


def _print(rec: dict[str, Any], as_json: bool, width: int) -> None:
    from testbed import events

    if as_json:
        print(json.dumps(rec), flush=True)
    else:
        console.print(inert(events.describe(rec, host_width=width)), highlight=False, markup=False, soft_wrap=True)


def _across_hosts(tb: str, kind: str | None, as_json: bool) -> bool:
    """Every host's events of testbed `tb`, merged in time order; True if a host failed (said on stderr)."""
    from testbed.cluster import controller

    hosts = _host_names(tb)
    results = controller.run_on_every_host(tb, _hosts_argv(tb, kind, False), timeout=120)
    got, failed, said = parse_answers({h: results.get(h) for h in hosts})
    for host, text in said.items():
        err_console.print(f"{inert(host)}: {inert(text)}", highlight=False, markup=False)
    width = max(4, *(len(h) for h in hosts)) if hosts else 4
    if not as_json:
        console.print(HEADER.format(host="HOST", w=width), style="bold", highlight=False)
    for rec in merge(got):
        _print(rec, as_json, width)
    for host, text in failed.items():
        err_console.print(f"[red]{plain(host)}:[/] {plain(text)}", highlight=False)
    return bool(failed)


def _follow_across_hosts(tb: str, kind: str | None, as_json: bool) -> bool:
    """Every host's `events -f --json` of testbed `tb`, each event printed as it arrives (arrival
    order), until Ctrl-C or every host's stream ends; True if a host failed (said on stderr as it
    ended; not the end a Ctrl-C here asked for)."""
    from testbed import events
    from testbed.cluster import controller

    hosts = _host_names(tb)
    width = max(4, *(len(h) for h in hosts)) if hosts else 4
    lock = threading.Lock()
    interrupted = threading.Event()
    failed: set[str] = set()
    skipped: dict[str, int] = {}

    def on_line(host: str, line: str) -> None:
        rec = events.parse(line.encode())
        with lock:
            if rec is None:
                if line.strip():
                    skipped[host] = skipped.get(host, 0) + 1
                return
            _print({**rec, "host": host}, as_json, width)

    def on_end(host: str, res: Any) -> None:
        ok = not isinstance(res, BaseException) and res is not None and \
            (res.rc == 0 or (interrupted.is_set() and res.rc == 130))   # (a Ctrl-C as it was starting)
        with lock:
            if not ok:
                failed.add(host)
                err_console.print(f"[red]{plain(host)}:[/] {plain(why(res)) if res is not None else 'no answer'}",
                                  highlight=False)
            elif res.rc == 0 and res.stderr.strip():
                err_console.print(inert(f"{host}: {'; '.join(res.stderr.strip().splitlines())}"), highlight=False,
                                  markup=False)

    def progress(msg: str) -> None:   # (only said on a Ctrl-C: the hosts are being told)
        interrupted.set()
        err_console.print(msg, highlight=False, markup=False)

    if not as_json:
        console.print(HEADER.format(host="HOST", w=width), style="bold", highlight=False)
    try:
        controller.stream_on_every_host(tb, _hosts_argv(tb, kind, True), on_line, progress=progress, on_end=on_end)
    except KeyboardInterrupt:   # a second Ctrl-C: stop waiting for the hosts
        interrupted.set()
    with lock:
        for host, n in skipped.items():
            err_console.print(f"{host}: {n} line(s) of its output were not events and were skipped", highlight=False)
        return bool(failed)


def events_cmd(name: Optional[str] = NameOption,
               follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until "
                                                                         "Ctrl-C or `testbed down`."),
               as_json: bool = typer.Option(False, "--json", help="One JSON object per line, as stored."),
               kind: Optional[str] = typer.Option(None, "--kind", help="Only these kinds (comma list): "
                                                  "up, down, link, node, partition, scenario, run, verdict, capture.")) -> None:
    """Print the testbed's events from the start: up, link and node changes, partitions, scenario steps, runs and their verdicts (-f: keep following).

    Runs report their start, step milestones (1, 10, 100, ... and every 1,000th) and end. Stored
    in /run/testbed/NAME/events.jsonl while the testbed is up; --json prints the records as stored.
    Over several hosts: every host's events merged in time order, with a HOST column (a "host"
    field with --json); with -f, each as it arrives from its host."""
    from testbed import events
    from testbed.cli.attach import spread
    from testbed.errors import TestbedError

    name = resolve_name(name, clusters=True)
    kinds = None
    if kind:
        kinds = {k.strip() for k in kind.split(",") if k.strip()}
        bad = sorted(kinds - set(events.KINDS))
        if bad:
            raise TestbedError(f"--kind {','.join(bad)}: not an event kind ({', '.join(events.KINDS)})")
    if spread(name):
        failed = (_follow_across_hosts if follow else _across_hosts)(name, kind, as_json)
        if failed:
            raise typer.Exit(1)
        return
    skipped = [0]
    try:
        for rec in events.read(name, follow=follow, skipped=skipped):
            if kinds and rec["kind"] not in kinds:
                continue
            if as_json:
                print(json.dumps(rec), flush=True)
            else:
                console.print(inert(events.describe(rec)), highlight=False, markup=False, soft_wrap=True)
    except KeyboardInterrupt:
        pass
    if skipped[0]:
        err_console.print(f"{skipped[0]} line(s) of {events.path(name)} are not events and were skipped")


def register(app: typer.Typer) -> None:
    app.command("events")(events_cmd)
