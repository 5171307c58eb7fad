"""What the hosts of a testbed over several hosts answer its controller, made one: why a host's
command failed (one line), every host's `events --json` parsed, and their events merged in time
order. `testbed events` and the graph page across hosts (testbed.cluster.graph) both read
the hosts' answers through it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def merge(by_host: Mapping[str, Iterable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every host's events as one list in time order, each a copy with its `host`. Equal times keep
    the hosts' order as given, and each host's events keep their own order (a stable merge)."""
    keyed = []
    for i, (host, recs) in enumerate(by_host.items()):
        for j, rec in enumerate(recs):
            keyed.append((rec["t"], i, j, {**rec, "host": host}))
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


def why(res: Any) -> str:
    """One line: why a host's command failed (its exception, or its last line of stderr)."""
    if isinstance(res, BaseException):
        return str(res) or type(res).__name__
    lines = [ln.strip() for ln in (res.stderr or res.stdout or "").splitlines() if ln.strip()]
    return lines[-1].removeprefix("error: ") if lines else f"exit status {res.rc}"


def parse_answers(results: Mapping[str, Any]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], dict[str, str]]:
    """Every host's answer to `events --json` (a RemoteResult or the exception): (host -> its events,
    host -> why it failed, host -> what it said on stderr although it did not fail)."""
    from testbed import events

    got: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    said: dict[str, str] = {}
    for host, r in results.items():
        if isinstance(r, BaseException) or r is None or r.rc != 0:
            failed[host] = "no answer" if r is None else why(r)
            continue
        recs, bad = [], 0
        for line in r.stdout.splitlines():
            rec = events.parse(line.encode())
            if rec is not None:
                recs.append(rec)
            elif line.strip():
                bad += 1
        got[host] = recs
        notes = [ln.strip() for ln in (r.stderr or "").splitlines() if ln.strip()]
        if bad:
            notes.append(f"{bad} line(s) of its output are not events and were skipped")
        if notes:
            said[host] = "; ".join(notes)
    return got, failed, said
