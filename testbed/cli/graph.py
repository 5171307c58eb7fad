"""testbed graph [--name NAME] [--port P] [--bind ADDR] [--allow-control]: a local web page of a
running testbed (testbed.observe.graph serves it).

A testbed over several hosts: the controller serves the same page, its documents from the hosts
(testbed.cluster.graph, through testbed.handle): every host's top merged, their link records and
events asked every few seconds; each node's host on the page, a host that fails named in its banner;
the page's actions sent to every host, as `testbed link` and `testbed node` do."""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import NameOption, console, err_console, require_root


def graph_cmd(
    name: Optional[str] = NameOption,
    port: Optional[int] = typer.Option(None, "--port", "-p", min=0, max=65535,
                                       help="Port to listen on (default: 8765, or any free port when it is "
                                            "taken; 0: any free port)."),
    bind: str = typer.Option("127.0.0.1", "--bind", help="Address to listen on. Any but a loopback address "
                                                         "requires the random token printed with the URL."),
    allow_control: bool = typer.Option(False, "--allow-control", help="Let the page take links and nodes down "
                                                                      "and up (requires the printed token)."),
    runs: Optional[str] = typer.Option(None, "--runs", help="Where `testbed run` keeps its run directories "
                                                            "(default: ./runs; across hosts: a directory on "
                                                            "the hosts)."),
    interval: float = typer.Option(1.0, "--interval", "-i", min=0.2, help="Seconds between samples."),
    plain_http: bool = typer.Option(False, "--plain-http", help="Allow a --bind that is not loopback: the token "
                                                                "then crosses that network unencrypted."),
) -> None:
    """Serve a live web page of a testbed: link utilisation, what is down, step times, events.

    The topology drawn in tiers, links coloured by live utilisation, downed links and nodes
    marked; hover or click a link for its profile (as `testbed link show` reports it) and
    counters, a worker for its CPU and memory; the running job's step times; the latest events.

    Listens on 127.0.0.1 only unless --bind says otherwise (then every request needs the token
    printed with the URL). Read-only unless --allow-control. Serves until Ctrl-C, or until the
    testbed goes down (the page says so, and the server stops a few seconds later).

    A testbed over several hosts: served from the controller, from every host's `top --json`,
    link records and events; each node's host shown, a host that fails named on the page; the
    page's actions go to every host. Ctrl-C stops every host's top."""
    from testbed.handle import open_testbed
    from testbed.observe.graph import DOWN_GRACE_S, serve
    from testbed.observe.graph_access import check_bind

    bind = check_bind(bind)
    require_root("testbed graph")
    name = open_testbed(name).name

    def ready(url: str) -> None:
        console.print(f"testbed graph: {name} at [bold]{url}[/]", highlight=False, soft_wrap=True)
        notes = ["read-only" if not allow_control else "[yellow]control on[/]: the page can take links and nodes "
                                                          "down and up"]
        if "?token=" in url:
            notes.append("keep the URL to yourself: its token is the key")
        console.print("  " + "; ".join(notes) + "; Ctrl-C stops", highlight=False, soft_wrap=True)

    def log(line: str) -> None:
        console.print(line, highlight=False, soft_wrap=True)

    try:
        why = serve(name, bind=bind, port=port, allow_control=allow_control, runs_dir=runs, interval=interval, plain_http=plain_http,
                    log=log, ready=ready, open_source=lambda n: open_testbed(n).graph_source())
    except KeyboardInterrupt:
        err_console.print("testbed graph: stopped")
        return
    if why == "down":
        err_console.print(f"testbed graph: testbed {name} went down; stopped serving after {DOWN_GRACE_S:g} s")


def register(app: typer.Typer) -> None:
    app.command("graph")(graph_cmd)
