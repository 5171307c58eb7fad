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

HOST_TIMEOUT_S = 300.0


def _hosts_to_clean() -> tuple[dict[tuple[Any, ...], tuple[Any, dict[str, Any], list[str]]], list[str]]:
    """The hosts of every testbed over several hosts recorded here, each once:
    key -> (hosts-file entry, the record it came from, the testbeds on it); and the records that
    could not be read (said, not fatal)."""
    from testbed.cluster import controller

    hosts: dict[tuple[Any, ...], tuple[Any, dict[str, Any], list[str]]] = {}
    bad = []
    for name in controller.list_names():
        try:
            doc = controller.load(name)
        except Exception as exc:  # noqa: BLE001 - one broken record does not stop the others
            bad.append(f"testbed {name}: its controller record cannot be read ({exc})")
            continue
        by_name = {h.name: h for h in doc["_hosts"]}
        for hn in [h for h in doc.get("hosts", {}) if h in by_name] or sorted(set(doc["placement"].values())):
            h = by_name[hn]
            key = (str(h.target), tuple(h.testbed_argv))   # the same machine under two testbeds: once
            if key in hosts:
                hosts[key][2].append(name)
            else:
                hosts[key] = (h, doc, [name])
    return hosts, bad


def _clean_hosts() -> bool:
    """`testbed cleanup` on the hosts of the testbeds over several hosts; prints per host. False if a
    host failed or could not be reached."""
    import threading

    from testbed.cluster.remote import SshHost

    hosts, bad = _hosts_to_clean()
    for line in bad:
        err_console.print(f"[yellow]{plain(line)}[/]", highlight=False)
    if not hosts:
        return not bad
    results: dict[tuple[Any, ...], Any] = {}

    def one(key: tuple[Any, ...]) -> None:
        h, doc, _ = hosts[key]
        ctl = SshHost(h, known_hosts=doc.get("known_hosts"))
        try:
            results[key] = ctl.run([*h.testbed_argv, "cleanup"], timeout=HOST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - that host's failure, reported with the others
            results[key] = exc
        finally:
            ctl.close()

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in hosts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = not bad
    for key, (h, _doc, names) in hosts.items():
        ok = _print_host(f"{h.name} ({', '.join(names)})", results.get(key)) and ok
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
    from testbed import lifecycle
    from testbed.cluster import controller

    require_root("testbed cleanup")
    removed = lifecycle.cleanup()
    if not removed:
        console.print("nothing to clean up" + (" here" if controller.list_names() else ""))
    for name, what in removed:
        console.print(f"removed {name}: {what}")
    if controller.list_names() and not _clean_hosts():
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("cleanup")(cleanup_cmd)
