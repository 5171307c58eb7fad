"""A capture on this host written to a file or to stdout (`testbed capture`): what it says as it
goes (on stderr, never stdout: stdout may be the pcap stream), its start and end in the testbed's
events, and its exit status. The capture itself: testbed.observe.capture."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

Say = Callable[[str, str | None], None]   # (line, style or None): a line for stderr


def capture_to(name: str, target: Any, write: str, *, count: int, duration_s: float, snaplen: int | None,
               bpf: str | None, say: Say) -> int:
    """Capture `target` (a resolved link end) into `write` (a file, or - for stdout) until its
    bounds, a Ctrl-C, SIGTERM or SIGHUP; every way it ends leaves a valid pcap. The exit status."""
    from testbed import events
    from testbed.observe import capture as cap
    from testbed.topology.units import format_size

    where = "stdout" if write == "-" else write
    c = cap.Capture(target, count=count, duration_s=duration_s, snaplen=snaplen, bpf=bpf)
    old: dict[int, Any] = {}

    def on_signal(signum: int, _frame: Any) -> None:
        c.stop("stopped")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, on_signal)
    out = None
    live = sys.stderr.isatty()
    file = None if write == "-" else os.path.abspath(write)
    try:
        with c:
            c.start()
            out = sys.stdout.buffer if write == "-" else open(write, "wb")
            say(f"capturing {target.describe()} to {where}: {until(count, duration_s)}; Ctrl-C stops", None)
            for note in target.notes():
                say(f"  note: {note}", "dim")

            def progress(packets: int, nbytes: int, elapsed: float) -> None:
                sys.stderr.write(f"\r  {packets} packet(s), {format_size(nbytes)}, {elapsed:.0f} s ")
                sys.stderr.flush()

            events.emit(name, "capture", f"capture of {target.describe()} to {file or where} started",
                        file=file, node=target.node)
            res = c.run(out, progress=progress if live else None)
            events.emit(name, "capture", f"capture of {target.describe()} ended ({res.reason}): {res.packets} packet(s) "
                        f"to {file or where}", file=file, packets=res.packets)
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
    for i, line in enumerate(cap.describe_result(res, target, where, count, duration_s)):
        say(line, None if i == 0 else "yellow")
    if res.reason == "error":
        from testbed import store
        from testbed.net import netns

        gone = not store.exists(name) or not netns.exists(target.netns)
        why = (f"testbed {name} went away" if gone else
               f"the capture went away (testbed {name} brought down? {target.node} crashed?)")
        say(f"{why}; {where} holds what came before, as valid pcap", None)
    return 1 if res.reason in ("error", "output failed") else 0


def until(count: int, duration_s: float) -> str:
    """'until 10000 packets or 60 s' (or 'no limit')."""
    bounds = [f"{count} packets" if count else "", f"{duration_s:g} s" if duration_s else ""]
    return "until " + " or ".join(x for x in bounds if x) if any(bounds) else "no limit"
