"""testbed cleanup: remove leftovers of testbeds whose CLI died, and nothing else.

On the controller of testbeds over several hosts it also runs `testbed
cleanup` on every host of every such testbed whose record is here (once per
host, at once), and reports per host: each removes what dead testbeds left
there and keeps healthy parts, exactly as on one host.
"""

from __future__ import annotations

from typing import Any

import typer

from testbed.cli.common import console, err_console, require_root
from testbed.terminal import inert, plain

def _clean_hosts() -> bool:
    """`testbed cleanup` on the hosts of the testbeds over several hosts; prints per host. False if a
    host failed or could not be reached."""
    from testbed.handle.everywhere import clean_hosts

    results, bad = clean_hosts()
    for line in bad:
        err_console.print(f"[yellow]{plain(line)}[/]", highlight=False)
    ok = not bad
    for label, r in results:
        ok = _print_host(label, r) and ok
    return ok


def _print_host(label: str, r: Any) -> bool:
    """What one host's cleanup said (False: it failed), shown as written: a host's words are never
    markup or escape sequences (testbed.terminal)."""
    if isinstance(r, Exception) or r is None or r.rc != 0:
        why = str(r) if not hasattr(r, "rc") else \
            (r.stderr.strip() or r.stdout.strip() or f"exit status {r.rc}").removeprefix("error: ")
        err_console.print(f"[red]host {plain(label)}:[/] {plain(why)}", highlight=False)
        return False
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()] or ["nothing to clean up"]
    for ln in lines:
        console.print(f"host {inert(label)}: {inert(ln)}", highlight=False, markup=False)
    return True


def cleanup_cmd() -> None:
    """Remove what dead testbeds left behind (half-built or half-gone); healthy testbeds are kept.

    On the controller of testbeds over several hosts, on every one of their hosts too."""
    from testbed.cleanup import cleanup
    from testbed.handle.everywhere import spread_names

    require_root("testbed cleanup")
    removed = cleanup()
    if not removed:
        console.print("nothing to clean up" + (" here" if spread_names() else ""))
    for name, what in removed:
        console.print(f"removed {name}: {what}")
    if spread_names() and not _clean_hosts():
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("cleanup")(cleanup_cmd)
