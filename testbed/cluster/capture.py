"""`testbed capture` of a testbed over several hosts, from its controller: the captured end resolved
from the controller's record, and the capture run on the host that holds it (`testbed capture ...
--write -` there), its pcap stream written here as it comes, byte for byte."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from testbed.observe.capture_file import Say


def resolve(name: str, a: str, b: str | None, at: str | None, direction: str) -> Any:
    """The Target of a capture on a testbed over several hosts, from the controller's record: the
    link and the end, checked here (an unknown node or link is refused before any host is asked).
    The interface names are the network plan's, which every host builds from the same topology;
    the end's host has the rest (link state, delay line, dilation)."""
    from testbed.cluster import controller
    from testbed.observe.capture_target import resolve
    from testbed.topology.model import Topology
    from testbed.topology.plan import plan_network

    doc = controller.load(name)
    plan = plan_network(Topology.from_json(doc["topology"]))
    links = [{"endpoints": [lp.a.node, lp.b.node], "ifnames": [lp.a.ifname, lp.b.ifname]} for lp in plan.links]
    return resolve(name, a, b, at=at, direction=direction, st={"topology": doc["topology"], "links": links})


def capture_to(name: str, target: Any, write: str, args: list[str], until: str, say: Say) -> int:
    """capture on a testbed over several hosts: `testbed capture ... -w -` on the host that holds the
    captured end (a cut link's end, its VXLAN device, like any other), its pcap stream written here
    as it comes, byte for byte, to the file or to stdout; what the host said on stderr passed on when
    it ends. A Ctrl-C here (SIGTERM, SIGHUP too) is passed on through the lifeline: the capture there
    ends as on a Ctrl-C at its terminal, flushes its last packets, and its status comes back. A file
    here always ends on a whole record (valid pcap), whatever happens to the connection. The exit
    status."""
    from testbed.cluster import controller
    from testbed.errors import TestbedError
    from testbed.observe import capture as cap
    from testbed.topology.units import format_size

    host = controller.host_of(name, target.node)
    where = "stdout" if write == "-" else write
    say(f"capturing {target.describe()} on host {host} ({target.node}'s), to {where} here: {until}; Ctrl-C stops",
        None)
    counter = cap.PcapCounter()
    state: dict[str, Any] = {"out": None, "whole_at": 0, "closed": False, "failed": None, "stopping": False}

    def stop_there() -> None:   # as a Ctrl-C here: the lifeline is cut, the capture there stops
        if not state["stopping"]:
            state["stopping"] = True
            os.kill(os.getpid(), signal.SIGINT)

    def on_stdout(data: bytes) -> None:
        if state["closed"] or state["failed"]:
            return
        try:
            if state["out"] is None:   # opened at the first bytes: a refusal there leaves no file here
                state["out"] = sys.stdout.buffer if write == "-" else open(write, "wb")
            state["out"].write(data)
            state["out"].flush()
        except (BrokenPipeError, ConnectionResetError):
            state["closed"] = True
            stop_there()
        except OSError as exc:
            state["failed"] = f"writing the capture to {where} failed: {exc}"
            stop_there()
        else:
            try:
                counter.feed(data)
            except TestbedError:
                pass   # (not pcap: written as it came all the same; the host's status says what went wrong)
            if counter.whole:
                state["whole_at"] = counter.bytes

    def said(message: str) -> None:   # a Ctrl-C here, being passed on
        if not state["stopping"]:
            state["stopping"] = True
            say(message, None)

    old = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        r = controller.run_on_node_host(name, target.node, ["capture", *args, "--write", "-", "--name", name],
                                        lifeline=True, progress=said, on_stdout=on_stdout)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        out = state["out"]
        if out is not None and out is not sys.stdout.buffer:
            if not counter.whole and state["whole_at"]:   # cut short (the connection went): whole records only
                out.truncate(state["whole_at"])
            out.close()
    sys.stderr.write(r.stderr)
    sys.stderr.flush()
    if state["closed"]:   # nothing more can go to stdout; keep Python's exit quiet (as on one host)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if state["out"] is not None or state["closed"]:   # (a refusal there wrote nothing here)
        say(f"{counter.packets} packet(s) ({format_size(counter.bytes)}) from host {host} to {where}"
            + ("; the reader of the output went away: the capture there was stopped" if state["closed"] else ""),
            None)
    if state["failed"]:
        say(f"[bold red]error:[/] {state['failed']}", None)
        return 1
    return 0 if r.rc == 0 else (r.rc if r.rc > 0 else 1)
