"""testbed capture A [B] [-w FILE|-]: the packets of one link end, in pcap format (testbed.observe.capture).

A testbed over several hosts: the capture runs on the host that holds the captured end (its
output to stdout there), and its pcap stream comes back as it is written, to the file or the
stdout here; a Ctrl-C here ends the capture there (testbed.cluster.capture, through testbed.handle).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from testbed.cli.common import NameOption, err_console, require_root


def _check_writable(path: str) -> None:
    from testbed.observe.capture_target import CaptureError

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
    from testbed.handle import open_testbed
    from testbed.observe import capture as cap
    from testbed.observe.capture_target import CaptureError

    duration_s = cap.parse_duration(duration)
    if count < 0:
        raise CaptureError(f"--count must be 0 (no limit) or more (got {count})")
    require_root("testbed capture")
    tb = open_testbed(name)
    target = tb.capture_target(a, b, at, direction)
    if write is None:
        if sys.stdout.isatty():
            raise CaptureError("stdout is a terminal: write to a file (-w FILE.pcap) or pipe the pcap stream "
                                   f"(testbed capture {a} {b or ''} | tcpdump -n -r -)".replace("  ", " "))
        write = "-"
    elif write == "-" and sys.stdout.isatty():
        raise CaptureError("-w -: stdout is a terminal; pipe it (| tcpdump -n -r -, | wireshark -k -i -) "
                               "or write to a file (-w FILE.pcap)")
    elif write != "-":
        _check_writable(write)

    def say(line: str, style: Optional[str]) -> None:
        err_console.print(line, highlight=False, style=style)

    raise typer.Exit(tb.capture(target, write, a=a, b=b, at=at, direction=direction, count=count, duration=duration,
                                duration_s=duration_s, snaplen=snaplen, bpf=bpf, say=say))


def register(app: typer.Typer) -> None:
    app.command("capture")(capture)
