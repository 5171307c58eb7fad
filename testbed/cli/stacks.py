"""testbed stacks: where every rank of the running job is, grouped by identical stacks.

A testbed over several hosts: from the controller, `stacks --json` runs at once on every host that
holds workers (those of --workers, when given); their ranks are merged (testbed.jobs.stacks.
merge_hosts) and identical stacks grouped across hosts, each group with its count of ranks per host
("3 ranks (0, 2-3) [h1: 1, h2: 2] in all_reduce"); --json adds each rank's `host` (PIDs are each
host's). A host that fails is named on stderr with why, the others still shown, and the exit status
is 1.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, console, err_console, require_root, resolve_name


def _across_hosts(tb: str, workers: set[str] | None) -> tuple[list[Any], bool]:
    """`stacks --json` on the hosts of testbed `tb` that hold its workers (those in `workers`), at
    once: (their ranks merged, whether a host failed: said on stderr)."""
    from testbed.cluster import controller
    from testbed.errors import TestbedError
    from testbed.jobs import stacks

    doc = controller.load(tb)
    placement: dict[str, str] = doc["placement"]
    kinds = {n.get("name"): n.get("kind") for n in (doc.get("topology") or {}).get("nodes") or []}
    chosen = [n for n in placement if kinds.get(n, "worker") == "worker" and (workers is None or n in workers)]
    one_each: dict[str, str] = {}   # host -> a worker it holds (run_on_node_host finds the host by it)
    for n in chosen:
        one_each.setdefault(placement[n], n)
    results: dict[str, Any] = {}

    def one(host: str, node: str) -> None:
        try:
            results[host] = controller.run_on_node_host(tb, node, ["stacks", "--json", "--name", tb], timeout=120)
        except Exception as exc:  # noqa: BLE001 - that host's failure, reported with the others
            results[host] = exc

    threads = [threading.Thread(target=one, args=hw, daemon=True) for hw in one_each.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    by_host, failed = {}, False
    for host in one_each:
        r = results.get(host)
        try:
            if r is None:
                raise TestbedError("no answer")
            if isinstance(r, Exception):
                raise r
            if r.rc != 0:
                lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
                raise TestbedError(lines[-1].removeprefix("error: ") if lines else f"exit status {r.rc}")
            by_host[host] = stacks.from_json(json.loads(r.stdout), host)
        except Exception as exc:  # noqa: BLE001 - named with why; the other hosts are still shown
            failed = True
            err_console.print(f"[red]{host}:[/] {exc}", highlight=False)
    got = stacks.merge_hosts(by_host, placement)
    if workers is not None:
        got = [s for s in got if s.worker in workers]
    return got, failed


def stacks_cmd(name: Optional[str] = NameOption,
               workers: Optional[str] = typer.Option(None, "--workers", "-w", help="Only the ranks on these "
                                                     "workers (comma list)."),
               depth: int = typer.Option(12, "--depth", help="Innermost frames shown per group."),
               as_json: bool = typer.Option(False, "--json", help="Every rank's stack as JSON.")) -> None:
    """Show the Python stack of every rank of the running job, grouped by identical stacks (py-spy).

    "15 ranks (0-6, 8-15) in all_reduce" and "1 rank (7)" in the data loader read at a glance; the
    collective is named from the stack. Ranks are read from outside and not stopped for long.
    `testbed run` and scenarios save the same into the run directory (stacks.txt) when they
    declare a job hung or timed out. Over several hosts: every host's ranks, identical stacks
    grouped across hosts with a count per host ("[h1: 1, h2: 2]"; a "host" per rank with --json)."""
    from testbed.cli.attach import spread
    from testbed.jobs import stacks

    require_root("testbed stacks")
    name = resolve_name(name, clusters=True)
    keep = {w.strip() for w in workers.split(",") if w.strip()} if workers else None
    failed = False
    if spread(name):
        got, failed = _across_hosts(name, keep)
    else:
        got = stacks.take(name)
        if keep is not None:
            got = [s for s in got if s.worker in keep]
    if as_json:
        print(json.dumps(stacks.to_json(got), indent=1))
    elif not got:
        console.print(f"no rank of a job is running on testbed {name!r} (testbed run starts one)")
    else:
        console.print(stacks.render(got, depth=depth), highlight=False, markup=False)
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("stacks")(stacks_cmd)
