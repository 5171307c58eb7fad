"""The operations a host carries out on the part of a testbed it holds, by name.

Each is a plain function of the testbed's name and its arguments, returning what the wire carries
(JSON values): the handle of a testbed on this host calls them directly, the agent after reading
a request (testbed.agent.protocol). On a host of a testbed over several hosts each one acts on what
that host holds: a link's ends there, the routes of its switches, a worker's processes on its own
host; every host keeps the whole record (faults.nodes, the links' states), so every host is asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

NODE_VERBS = ("down", "up", "crash", "slow", "restore")
COMMAND_MAX = 8192   # of a process's command line, in `ps`


def status(name: str) -> dict[str, Any]:
    from testbed.status import status as status_document

    return status_document(name)


def link_show(name: str) -> list[dict[str, Any]]:
    from testbed.faults import control

    return control.link_show(name)


def link_set(name: str, a: str, b: str, changes: dict[str, Any], direction: str) -> dict[str, Any]:
    from testbed.faults import control

    link = control.link_set(name, a, b, changes, direction)
    return {"ab": link["ab"], "ba": link["ba"]}


def link_down(name: str, a: str, b: str) -> bool:
    from testbed.faults import control

    return control.link_down(name, a, b)


def link_up(name: str, a: str, b: str) -> list[str]:
    from testbed.faults import control

    return control.link_up(name, a, b)


def link_reset(name: str, a: str, b: str) -> None:
    from testbed.faults import control

    control.link_reset(name, a, b)


def partition(name: str, groups: list[list[str]]) -> list[list[str]]:
    from testbed.faults import control

    return control.partition(name, groups)


def heal(name: str) -> bool:
    from testbed.faults import control

    return control.heal(name)


def node(name: str, verb: str, node: str, cpus: float | None = None) -> int | None:
    """`node VERB NODE`: crash says how many processes it killed; the others say nothing."""
    from testbed.faults import control

    if verb == "down":
        control.node_down(name, node)
    elif verb == "up":
        control.node_up(name, node)
    elif verb == "crash":
        return control.node_crash(name, node)
    elif verb == "slow":
        if cpus is None:
            raise control.FaultError("node slow: --cpus is missing")
        control.node_slow(name, node, cpus)
    elif verb == "restore":
        control.node_restore(name, node)
    else:
        raise control.FaultError(f"node: no verb {verb!r} ({', '.join(NODE_VERBS)})")
    return None


def ps(name: str, nodes: list[str], all_nodes: bool = False) -> list[dict[str, Any]]:
    """The processes of the nodes named that this host holds (default: its workers; all_nodes:
    switches too)."""
    from testbed.observe import processes

    rows = processes.ps(name, nodes, all_nodes)
    for row in rows:   # (what the wire carries of a command line: protocol.ProcessRow)
        row["command"] = row["command"][:COMMAND_MAX]
    return rows


def stacks(name: str) -> list[dict[str, Any]]:
    """Every rank's stack on this host (testbed.jobs.stacks.to_json)."""
    from testbed.jobs import stacks as rank_stacks

    return rank_stacks.to_json(rank_stacks.take(name))


def events(name: str, kinds: list[str] | None, follow: bool, emit: Callable[[dict[str, Any]], None],
           stop: threading.Event | None = None) -> dict[str, Any]:
    """This host's events of testbed `name` (of `kinds`), each passed to emit(record); with follow,
    the new ones too, until `stop` or the testbed goes down. Returns how many lines were skipped."""
    from testbed import events as stream
    from testbed.errors import StateError
    from testbed.store import exists

    if not exists(name):
        raise StateError(f"no testbed named {name!r} is up here")
    skipped = [0]
    for rec in stream.read(name, follow=follow, skipped=skipped, stop=stop):
        if kinds is None or rec["kind"] in kinds:
            emit(rec)
    return {"skipped": skipped[0]}


class _Pieces:
    """A binary stream whose every write is passed on as text (what testbed.observe.logs.show writes:
    whole characters, made inert)."""

    def __init__(self, emit: Callable[[str], None]):
        self._emit = emit

    def write(self, data: bytes) -> int:
        if data:
            self._emit(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        pass


def logs(name: str, node: str, follow: bool, tail: int | None, emit: Callable[[str], None],
         stop: threading.Event | None = None) -> dict[str, Any]:
    """The output of the jobs in `node`, which this host holds, each piece passed to emit(text); with
    follow, what comes next too, until `stop`. Returns how many files were shown, and where."""
    from testbed.observe.logs import node_logs

    shown, d = node_logs(name, node, follow=follow, lines=tail, out=_Pieces(emit), stop=stop)  # type: ignore[arg-type]
    return {"shown": shown, "directory": str(d)}


def top(name: str, interval: float, runs: str | None, emit: Callable[[dict[str, Any]], None],
        stop: threading.Event | None = None) -> dict[str, Any]:
    """A top document of this host's part every `interval` s (testbed.observe.top), each passed to
    emit(doc), until `stop`. Returns how many it sampled."""
    from testbed.observe.top import Top

    n = 0
    with Top(name, interval, runs) as sampler:
        while stop is None or not stop.is_set():
            emit(sampler.sample())
            n += 1
    return {"samples": n}
