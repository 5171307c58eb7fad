"""testbed capture A [B] [-w FILE|-]: the packets of one link end, in pcap format (testbed.observe.capture).

A testbed over several hosts: the capture runs on the host that holds the captured end (its
output to stdout there), and its pcap stream comes back as it is written, to the file or the
stdout here; a Ctrl-C here ends the capture there (its lifeline, as for exec and logs -f).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, err_console, require_root, resolve_name


def _check_writable(path: str) -> None:
    from testbed.observe.capture import CaptureError

    p = Path(path)
    if p.is_dir():
        raise CaptureError(f"-w {path}: is a directory; name a file (e.g. {p / 'capture.pcap'})")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CaptureError(f"-w {path}: directory {parent} does not exist")
    if not os.access(p if p.exists() else parent, os.W_OK):
        raise CaptureError(f"-w {path}: not writable")


def capture(
    a: str = typer.Argument(..., metavar="A", help="A node: one end of the link (or the node whose interface B is)."),
    b: Optional[str] = typer.Argument(None, metavar="B",
                                      help="The other end, or an interface of A (eth0, ...); omitted: A's only link."),
    at: Optional[str] = typer.Option(None, "--at", help="The end whose interface is captured (default: A)."),
    direction: str = typer.Option("both", "--direction", "-d",
                                  help="both; in or out (seen from --at); A->B, B->A, or with node names "
                                       "(quoted): 'w0->edge0-0'."),
    write: Optional[str] = typer.Option(None, "--write", "-w", metavar="FILE|-",
                                        help="pcap file to write, or - for stdout (the default when stdout is a "
                                             "pipe; refused on a terminal)."),
    count: int = typer.Option(10_000, "--count", "-c", help="Stop after this many packets; 0: no limit."),
    duration: str = typer.Option("60s", "--duration", help="Stop after this long (30s, 5m); 0: no limit."),
    bpf: Optional[str] = typer.Option(None, "--filter", "-f", metavar="BPF",
                                      help="A tcpdump/pcap filter expression, e.g. 'tcp port 29500'."),
    snaplen: Optional[int] = typer.Option(None, "--snaplen", "-s",
                                          help="Bytes kept of each packet (default: all; 128 keeps the headers)."),
    name: Optional[str] = NameOption,
) -> None:
    """Capture the packets of one link end in pcap format, to a file or to stdout.

    The link: A B (the link between nodes A and B, as `testbed link` names it), A IFNAME (one
    of A's interfaces: eth0, ...) or A alone (its only link). The interface captured is A's end
    (--at B: the other end's). Bounded by default: 10000 packets or 60 s, whichever comes
    first; --count 0 --duration 0 for no limit. Ctrl-C ends it and leaves a valid pcap file.
    Progress and the summary go to stderr, never to stdout. On a testbed over several hosts it
    runs on the host that holds the captured end, and the pcap stream comes back here as it comes.

      testbed capture w0 edge0-0 -w w0.pcap
      testbed capture w0 edge0-0 -w - | tcpdump -n -r -
      testbed capture w0 edge0-0 --direction 'w0->edge0-0' -f icmp | wireshark -k -i -

    What the capture sees: packets sent from the captured end after its shaping (the egress
    HTB rate and queue, netem's delay, loss drops: dropped packets are not seen), packets
    received at arrival. On a delay line (kernels without netem) the delay sits between the
    two ends' interfaces: the sending end sees a packet before the delay, the receiving end
    after it. Segmentation offload is on: TCP shows frames larger than the MTU (up to 64 KiB).
    Timestamps are the host's clock: under time dilation s, intervals are s times the emulated
    ones. More in docs/observability.md.
    """
    from testbed import events
    from testbed.observe import capture as cap
    from testbed.topology.units import format_size

    duration_s = cap.parse_duration(duration)
    if count < 0:
        raise cap.CaptureError(f"--count must be 0 (no limit) or more (got {count})")
    require_root("testbed capture")
    name = resolve_name(name)
    from testbed.cli.attach import spread

    across = spread(name)
    target = _resolve_across_hosts(name, a, b, at, direction) if across else \
        cap.resolve(name, a, b, at=at, direction=direction)
    if write is None:
        if sys.stdout.isatty():
            raise cap.CaptureError("stdout is a terminal: write to a file (-w FILE.pcap) or pipe the pcap stream "
                                   f"(testbed capture {a} {b or ''} | tcpdump -n -r -)".replace("  ", " "))
        write = "-"
    elif write == "-" and sys.stdout.isatty():
        raise cap.CaptureError("-w -: stdout is a terminal; pipe it (| tcpdump -n -r -, | wireshark -k -i -) "
                               "or write to a file (-w FILE.pcap)")
    elif write != "-":
        _check_writable(write)
    where = "stdout" if write == "-" else write
    if across:
        bounds = [f"{count} packets" if count else "", f"{duration_s:g} s" if duration_s else ""]
        _across_hosts(name, target, write, [a, *([b] if b is not None else []), *(["--at", at] if at else []),
                                            "--direction", direction, "--count", str(count), "--duration", duration,
                                            *(["--filter", bpf] if bpf is not None else []),
                                            *(["--snaplen", str(snaplen)] if snaplen is not None else [])],
                      "until " + " or ".join(x for x in bounds if x) if any(bounds) else "no limit")
        return

    c = cap.Capture(target, count=count, duration_s=duration_s, snaplen=snaplen, bpf=bpf)
    old: dict[int, Any] = {}

    def on_signal(signum: int, _frame: Any) -> None:
        c.stop("stopped")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, on_signal)
    out = None
    live = sys.stderr.isatty()
    try:
        with c:
            c.start()
            out = sys.stdout.buffer if write == "-" else open(write, "wb")
            bounds = [f"{count} packets" if count else "", f"{duration_s:g} s" if duration_s else ""]
            until = "until " + " or ".join(x for x in bounds if x) if any(bounds) else "no limit"
            err_console.print(f"capturing {target.describe()} to {where}: {until}; Ctrl-C stops",
                              highlight=False)
            for note in target.notes():
                err_console.print(f"  note: {note}", highlight=False, style="dim")

            def progress(packets: int, nbytes: int, elapsed: float) -> None:
                sys.stderr.write(f"\r  {packets} packet(s), {format_size(nbytes)}, {elapsed:.0f} s ")
                sys.stderr.flush()

            events.emit(name, "capture", f"capture of {target.describe()} to {os.path.abspath(where) if write != '-' else where} started",
                        file=None if write == "-" else os.path.abspath(write), node=target.node)
            res = c.run(out, progress=progress if live else None)
            events.emit(name, "capture", f"capture of {target.describe()} ended ({res.reason}): {res.packets} packet(s) "
                        f"to {os.path.abspath(where) if write != '-' else where}",
                        file=None if write == "-" else os.path.abspath(write), packets=res.packets)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if out is not None and out is not sys.stdout.buffer:
            out.close()
    if live:
        sys.stderr.write("\n")
    if res.reason == "output closed":   # nothing more can go to stdout; keep Python's exit quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    lines = cap.describe_result(res, target, where, count, duration_s)
    for i, line in enumerate(lines):
        err_console.print(line, highlight=False, style=None if i == 0 else "yellow")
    if res.reason == "error":
        from testbed import store
        from testbed.net import netns

        gone = not store.exists(name) or not netns.exists(target.netns)
        why = (f"testbed {name} went away" if gone else
               f"the capture went away (testbed {name} brought down? {target.node} crashed?)")
        err_console.print(f"{why}; {where} holds what came before, as valid pcap", highlight=False)
    if res.reason in ("error", "output failed"):
        raise typer.Exit(1)


def _resolve_across_hosts(name: str, a: str, b: Optional[str], at: Optional[str], direction: str) -> Any:
    """The Target of a capture on a testbed over several hosts, from the controller's record: the
    link and the end, checked here (an unknown node or link is refused before any host is asked).
    The interface names are the network plan's, which every host builds from the same topology;
    the end's host has the rest (link state, delay line, dilation)."""
    from testbed.cluster import controller
    from testbed.observe import capture as cap
    from testbed.topology.model import Topology
    from testbed.topology.plan import plan_network

    doc = controller.load(name)
    plan = plan_network(Topology.from_json(doc["topology"]))
    links = [{"endpoints": [lp.a.node, lp.b.node], "ifnames": [lp.a.ifname, lp.b.ifname]} for lp in plan.links]
    return cap.resolve(name, a, b, at=at, direction=direction, st={"topology": doc["topology"], "links": links})


def _across_hosts(name: str, target: Any, write: str, args: list[str], until: str) -> None:
    """capture on a testbed over several hosts: `testbed capture ... -w -` on the host that holds the
    captured end (a cut link's end, its VXLAN device, like any other), its pcap stream written here
    as it comes, byte for byte, to the file or to stdout; what the host said on stderr passed on when
    it ends. A Ctrl-C here (SIGTERM, SIGHUP too) is passed on through the lifeline: the capture there
    ends as on a Ctrl-C at its terminal, flushes its last packets, and its status comes back. A file
    here always ends on a whole record (valid pcap), whatever happens to the connection."""
    from testbed.cluster import controller
    from testbed.errors import TestbedError
    from testbed.observe import capture as cap
    from testbed.topology.units import format_size

    host = controller.host_of(name, target.node)
    where = "stdout" if write == "-" else write
    err_console.print(f"capturing {target.describe()} on host {host} ({target.node}'s), to {where} here: "
                      f"{until}; Ctrl-C stops", highlight=False)
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
            err_console.print(message, highlight=False)

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
        err_console.print(f"{counter.packets} packet(s) ({format_size(counter.bytes)}) from host {host} to {where}"
                          + ("; the reader of the output went away: the capture there was stopped"
                             if state["closed"] else ""), highlight=False)
    if state["failed"]:
        err_console.print(f"[bold red]error:[/] {state['failed']}", highlight=False)
        raise typer.Exit(1)
    if r.rc != 0:
        raise typer.Exit(r.rc if r.rc > 0 else 1)


def register(app: typer.Typer) -> None:
    app.command("capture")(capture)
