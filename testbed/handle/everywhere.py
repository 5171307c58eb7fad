"""What concerns every testbed this machine knows, on this host and spread over hosts alike: the
list of those up (`testbed ls`), and the cleanup of what dead ones left (`testbed cleanup`, on this
host and on every host of a testbed over several hosts whose controller this is)."""

from __future__ import annotations

import threading
from typing import Any

HOST_CLEANUP_TIMEOUT_S = 300.0


def up_rows() -> list[dict[str, Any]]:
    """One row per testbed up: name, status, topology, workers, switches, links, runtime, created (a
    testbed over several hosts: its controller's record; one that cannot be read is listed as such)."""
    from testbed.status import list_testbeds
    from testbed.cluster import controller

    rows = list_testbeds()
    local = {r.get("name") for r in rows}
    for name in controller.list_names():
        if name in local:
            continue
        try:
            doc = controller.load(name)
        except Exception as exc:  # noqa: BLE001 - a broken record is listed, not fatal
            rows.append({"name": name, "status": f"unreadable ({exc})"})
            continue
        topo = doc.get("topology") or {}
        nodes = topo.get("nodes", [])
        rows.append({"name": name, "status": f"{doc.get('status')} on {len(doc.get('hosts', {}))} hosts",
                     "topology": topo.get("name", ""), "workers": sum(1 for n in nodes if n.get("kind") == "worker"),
                     "switches": sum(1 for n in nodes if n.get("kind") == "switch"),
                     "links": len(topo.get("links", [])), "runtime": "hosts", "created": doc.get("created")})
    return rows


def spread_names() -> list[str]:
    """The testbeds over several hosts whose controller this is."""
    from testbed.cluster import controller

    return controller.list_names()


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


def clean_hosts() -> tuple[list[tuple[str, Any]], list[str]]:
    """`testbed cleanup` on every host of the testbeds over several hosts recorded here, each host
    once, all at once: ([(label "HOST (TESTBEDS)", its RemoteResult or the exception)], the records
    that could not be read)."""
    from testbed.cluster.remote import SshHost

    hosts, bad = _hosts_to_clean()
    results: dict[tuple[Any, ...], Any] = {}

    def one(key: tuple[Any, ...]) -> None:
        h, doc, _ = hosts[key]
        ctl = SshHost(h, known_hosts=doc.get("known_hosts"))
        try:
            results[key] = ctl.run([*h.testbed_argv, "cleanup"], timeout=HOST_CLEANUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - that host's failure, reported with the others
            results[key] = exc
        finally:
            ctl.close()

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in hosts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [(f"{h.name} ({', '.join(names)})", results.get(key)) for key, (h, _doc, names) in hosts.items()], bad
