"""Packet capture on one end of a link: tcpdump inside the node's network namespace, pcap out.

`testbed capture A B` (the CLI: testbed/cli/capture.py) resolves a link of a running testbed
to one interface in one namespace (`resolve`), runs tcpdump there writing pcap to a pipe, and
copies the stream to a file or to its own stdout (`Capture`), counting packets as they pass.

The process. One chain, started in a session of its own (a Ctrl-C at the terminal reaches the
CLI, not tcpdump, so the CLI decides how the capture ends):

    setpriv --pdeathsig INT  nsenter --net=/run/netns/tb-NAME-NODE  timeout -s INT -k 5 T  tcpdump ...

setpriv and nsenter exec into what follows them, so our child is `timeout`, and tcpdump is
timeout's only child. The parent-death signal sits on `timeout` (tcpdump's own drop of
privileges and capabilities clears one set on it): if the caller dies, even by SIGKILL, timeout
gets SIGINT and passes it on, so tcpdump ends and nothing outlives the capture. `timeout` also
enforces the duration by itself (T; 0 = none). Both processes are named by (PID, start) through
testbed.procs; a stop is SIGINT to tcpdump (it then flushes its last packets and exits), and
every exit path (`close`, also on errors) ends whatever still runs, TERM then KILL, by those refs.
The parent-death signal fires when the *thread* that started the capture exits: start it from
a thread that outlives it (the CLI's main thread).

tcpdump runs with -U (each packet written as it is captured: a reader such as
`wireshark -k -i -` sees it live) and --immediate-mode (libpcap hands packets over at once;
without it they wait up to a second in the kernel's ring and a stop loses them). Docker workers
need nothing special: their network namespace is bound at /run/netns/tb-NAME-NODE as well.

What a capture on one end of a link sees (docs/observability.md has the long form):

- The kernel shows packet sockets outgoing packets as the device transmits them, i.e. after
  the egress qdisc; incoming ones as they arrive, before anything else on the receiving end.
  Shaping lives on each end's egress (HTB rate, netem delay, the BPF loss filter), so packets
  sent from the captured end are seen after their rate limit, queueing, netem delay, and only
  if the loss filter let them through; received packets are seen at arrival.
- A delay line (kernels without netem) replaces the veth by two TAP devices, one per end, with
  a delay-line engine between them: HTB shapes each TAP's egress as above, then the engine holds
  the frame for the delay. On the sending end a packet is seen before the delay, on the
  receiving end after it: the two ends' timestamps differ by the link's delay.
- Segmentation offload (TSO/GSO) stays on: TCP appears as frames up to 64 KiB, larger than
  the MTU; the checksums of locally sent packets are not filled in (tcpdump -v says "incorrect").
- Timestamps are the host's clock: under time dilation s, intervals are s times the emulated
  cluster's.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable

from testbed import procs
from testbed.errors import CapabilityError, StateError, TestbedError
from testbed.net import netns
from testbed.observe.capture_target import CaptureError, Target
from testbed.topology.units import format_size

DEFAULT_COUNT = 10_000
DEFAULT_DURATION_S = 60.0
START_TIMEOUT_S = 10.0
DRAIN_S = 5.0            # after a stop: how long tcpdump may take to flush and exit before TERM/KILL
KILL_AFTER_S = 5         # timeout(1) -k: KILL tcpdump this long after its INT at the duration
READ_SIZE = 1 << 20
TOOLS = ("tcpdump", "nsenter", "setpriv", "timeout")
APT = "apt-get install -y tcpdump"   # nsenter, setpriv: util-linux; timeout: coreutils (both essential)

# pcap file headers: microsecond and nanosecond timestamps, as written on either byte order
PCAP_MAGICS = {b"\xd4\xc3\xb2\xa1": "<", b"\xa1\xb2\xc3\xd4": ">", b"\x4d\x3c\xb2\xa1": "<", b"\xa1\xb2\x3c\x4d": ">"}


# -- the pcap stream ----------------------------------------------------------------------------------------------


class PcapCounter:
    """Counts the records of a pcap stream fed in arbitrary chunks (no copy of the packets)."""

    def __init__(self) -> None:
        self.head = b""         # the part of a header (file: 24 bytes, record: 16) read so far
        self.skip = 0           # packet bytes still to pass
        self.endian: str | None = None
        self.packets = 0
        self.bytes = 0

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        pos, n = 0, len(data)
        while pos < n:
            if self.skip:
                step = min(self.skip, n - pos)
                self.skip -= step
                pos += step
                continue
            need = (24 if self.endian is None else 16) - len(self.head)
            self.head += data[pos:pos + need]
            pos += need
            if len(self.head) < (24 if self.endian is None else 16):
                return
            if self.endian is None:
                endian = PCAP_MAGICS.get(self.head[:4])
                if endian is None:
                    raise TestbedError(f"tcpdump wrote no pcap stream (it began with {self.head[:4].hex()})")
                self.endian = endian
            else:
                self.packets += 1
                self.skip = struct.unpack_from(self.endian + "I", self.head, 8)[0]
            self.head = b""

    @property
    def whole(self) -> bool:
        """The stream so far ends on a record boundary, after the file header."""
        return self.endian is not None and not self.skip and not self.head


# -- the capture process ------------------------------------------------------------------------------------------

_STAT = re.compile(r"^(\d+) packets? (captured|received by filter|dropped by kernel)")


@dataclass
class Result:
    packets: int                 # records in the stream written
    bytes: int                   # bytes of pcap written (headers included)
    elapsed_s: float
    reason: str                  # "count", "duration", "stopped", "output closed", "output failed", "ended",
                                 # "error" (tcpdump failed: the interface went away, it was killed)
    returncode: int | None
    captured: int | None = None  # tcpdump's own counts (None when it printed none)
    received: int | None = None
    dropped: int | None = None
    messages: list[str] = field(default_factory=list)   # what else tcpdump said


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
        if kids:
            return kids
    except (OSError, ValueError):
        pass
    return [p for p in procs.pids(include_self=False) if _parent(p) == pid]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class Capture:
    """A running tcpdump on one Target: start(), run(out) until it ends, close() always.

    Use as a context manager; stop() (from a signal handler or another thread) ends it cleanly.
    """

    def __init__(self, target: Target, *, count: int = DEFAULT_COUNT, duration_s: float = DEFAULT_DURATION_S,
                 snaplen: int | None = None, bpf: str | None = None):
        if count < 0:
            raise CaptureError(f"--count must be 0 (no limit) or more (got {count})")
        if duration_s < 0:
            raise CaptureError(f"--duration must be 0 (no limit) or more (got {duration_s:g})")
        if snaplen is not None and snaplen < 0:
            raise CaptureError(f"--snaplen must be 0 (whole packets) or more (got {snaplen})")
        self.target = target
        self.count = count
        self.duration_s = duration_s
        self.snaplen = snaplen
        self.bpf = bpf.strip() if bpf and bpf.strip() else None
        self.proc: subprocess.Popen | None = None
        self.chain: procs.ProcRef | None = None     # timeout(1): our child
        self.tcpdump: procs.ProcRef | None = None   # its child
        self.counter = PcapCounter()
        self.started_at: float | None = None
        self._wake_r = self._wake_w = -1
        self._stop_reason: str | None = None
        self._err = b""
        self._messages: list[str] = []
        self._stats: dict[str, int] = {}

    # -- the command --
    def argv(self, tools: dict[str, str] | None = None) -> list[str]:
        t = self.target
        tools = tools or {name: name for name in TOOLS}
        dur = f"{self.duration_s:.3f}s" if self.duration_s else "0"
        cmd = [tools["setpriv"], "--pdeathsig", "INT",
               tools["nsenter"], f"--net={netns.path(t.netns)}",
               tools["timeout"], "-s", "INT", "-k", str(KILL_AFTER_S), dur,
               tools["tcpdump"], "-i", t.ifname, "-w", "-", "-U", "--immediate-mode", "-n"]
        if self.count:
            cmd += ["-c", str(self.count)]
        if self.snaplen is not None:
            cmd += ["-s", str(self.snaplen)]
        if t.direction:
            cmd += ["-Q", t.direction]
        if self.bpf:
            cmd += ["--", self.bpf]
        return cmd

    # -- life cycle --
    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start tcpdump; return once it listens (errors: CaptureError for a bad filter, CapabilityError
        without tcpdump, TestbedError for anything else it says; nothing is left running)."""
        missing = missing_tools()
        if missing:
            raise CapabilityError(f"packet capture needs {', '.join(missing)}, not installed here: {APT}"
                                  + ("" if missing == ["tcpdump"] else " (and util-linux, coreutils)"))
        t = self.target
        if not netns.exists(t.netns):
            raise StateError(f"namespace {t.netns} of {t.node} is gone (testbed half-removed? try `testbed "
                             f"status {t.testbed}`)")
        tools = {name: shutil.which(name) or name for name in TOOLS}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(self.argv(tools), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
            self.chain = procs.ref(self.proc.pid)
            self._wait_listening(timeout)
            self.started_at = time.monotonic()
        except BaseException:
            self.close()
            raise

    def _wait_listening(self, timeout: float) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TestbedError(f"tcpdump did not start listening on {self.target.describe()} within "
                                   f"{timeout:g} s" + self._said())
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                ready = sel.select(min(left, 0.2))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:   # it exited before listening: an error (bad filter, no interface)
                    self.proc.wait(timeout=DRAIN_S)
                    self._take_err(final=True)
                    msg = "; ".join(self._messages) or f"exit status {self.proc.returncode}"
                    if self.bpf and re.search(r"filter|syntax|illegal|parse|unknown", msg, re.IGNORECASE):
                        raise CaptureError(f"--filter {self.bpf!r}: {msg}")
                    raise TestbedError(f"tcpdump could not capture on {self.target.describe()} in "
                                       f"{self.target.netns}: {msg}")
                self._err += chunk
                if self._take_err():
                    break
        self._find_tcpdump()

    def _find_tcpdump(self) -> None:
        """The tcpdump process: the chain's child, running tcpdump in the target's namespace."""
        assert self.chain is not None
        ns_path = netns.path(self.target.netns)
        for _ in range(200):
            for pid in _children(self.chain.pid):
                r = procs.ref(pid)
                if r is not None and _comm(pid) == "tcpdump" and procs.in_netns(r, ns_path):
                    self.tcpdump = r
                    return
            time.sleep(0.005)
        # not found (it listens, so it runs): stops then go through the chain, which passes INT on

    def _take_err(self, final: bool = False) -> bool:
        """Split what tcpdump said into lines; True once it said it listens."""
        listening = False
        *lines, rest = self._err.split(b"\n")
        self._err = rest
        if final and rest:
            lines.append(rest)
            self._err = b""
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            m = _STAT.match(line)
            if m:
                self._stats[m.group(2)] = int(m.group(1))
            elif line.startswith("tcpdump: listening on"):
                listening = True
            else:
                self._messages.append(line.removeprefix("tcpdump: "))
        return listening

    def _said(self) -> str:
        return (": " + "; ".join(self._messages)) if self._messages else ""

    def stop(self, reason: str = "stopped") -> None:
        """Ask the capture to end (safe from a signal handler or another thread)."""
        if self._stop_reason is None:
            self._stop_reason = reason
        try:
            os.write(self._wake_w, b"x")
        except OSError:   # full (a stop is pending already) or closed (over)
            pass

    def _interrupt(self) -> None:
        """SIGINT to tcpdump (it flushes and exits); through the chain if tcpdump was not found."""
        r = self.tcpdump if self.tcpdump is not None else self.chain
        if r is not None:
            procs.signal_ref(r, signal.SIGINT)

    def run(self, out: BinaryIO, progress: Callable[[int, int, float], None] | None = None,
            every: float = 0.5) -> Result:
        """Copy the pcap stream to `out` until tcpdump ends (count, duration, stop(), an error).

        `progress(packets, bytes, elapsed_s)` is called about every `every` seconds and at the end."""
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        assert self.started_at is not None
        out_fd, err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        open_fds = {out_fd, err_fd}
        sel = selectors.DefaultSelector()
        for fd in (out_fd, err_fd, self._wake_r):
            sel.register(fd, selectors.EVENT_READ)
        interrupted_at: float | None = None
        writing = True
        next_progress = time.monotonic() + every
        try:
            while open_fds:
                now = time.monotonic()
                if self._stop_reason is not None and interrupted_at is None:
                    interrupted_at = now
                    self._interrupt()
                if interrupted_at is not None and now - interrupted_at > DRAIN_S:
                    self._end_processes()    # it did not exit: TERM, KILL; the pipes then close
                    interrupted_at = float("inf")
                wait = max(0.0, next_progress - now) if progress else 1.0
                for key, _ in sel.select(min(wait, 0.5)):
                    fd = key.fd
                    if fd == self._wake_r:
                        try:
                            os.read(fd, 4096)
                        except BlockingIOError:
                            pass
                        continue
                    chunk = os.read(fd, READ_SIZE)
                    if not chunk:
                        sel.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    if fd == err_fd:
                        self._err += chunk
                        self._take_err()
                    elif writing:
                        self.counter.feed(chunk)
                        try:
                            out.write(chunk)
                            out.flush()
                        except (BrokenPipeError, ConnectionResetError):
                            writing = False
                            self.stop("output closed")
                        except OSError as exc:
                            writing = False
                            self._messages.append(f"writing the capture failed: {exc}")
                            self.stop("output failed")
                if progress and time.monotonic() >= next_progress:
                    progress(self.counter.packets, self.counter.bytes, time.monotonic() - self.started_at)
                    next_progress = time.monotonic() + every
            try:
                rc = self.proc.wait(timeout=DRAIN_S)
            except subprocess.TimeoutExpired:
                self._end_processes()
                rc = self.proc.wait(timeout=DRAIN_S)
        finally:
            sel.close()
        self._take_err(final=True)
        elapsed = time.monotonic() - self.started_at
        if progress:
            progress(self.counter.packets, self.counter.bytes, elapsed)
        if self._stop_reason is not None:
            reason = self._stop_reason
        elif rc == 124:
            reason = "duration"
        elif rc == 0 and self.count and self._stats.get("captured", self.counter.packets) >= self.count:
            reason = "count"
        elif rc == 0:
            reason = "ended"
        else:
            reason = "error"
        return Result(packets=self.counter.packets, bytes=self.counter.bytes, elapsed_s=elapsed, reason=reason,
                      returncode=rc, captured=self._stats.get("captured"),
                      received=self._stats.get("received by filter"), dropped=self._stats.get("dropped by kernel"),
                      messages=list(self._messages))

    def _end_processes(self) -> list[procs.ProcRef]:
        refs = [r for r in (self.tcpdump, self.chain) if r is not None]
        return procs.stop(refs)

    def close(self) -> None:
        """End whatever still runs (TERM, then KILL, by PID and start time), reap, close the pipes.
        After `run` nothing runs any more; on an error path the pipes close first, so a tcpdump
        blocked writing to them ends at once."""
        if self.proc is not None:
            for f in (self.proc.stdout, self.proc.stderr):
                if f is not None:
                    f.close()
            self._end_processes()
            try:
                self.proc.wait(timeout=DRAIN_S)
            except subprocess.TimeoutExpired:   # pragma: no cover - survived KILL (uninterruptible sleep)
                pass
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1


def describe_result(res: Result, target: Target, where: str, count: int, duration_s: float) -> list[str]:
    """The summary lines for stderr."""
    failed = "tcpdump failed" + ("" if res.messages else f" ({_status(res.returncode)})")
    why = {"count": f"--count {count} reached",
           "duration": f"--duration {duration_s:g} s reached",
           "stopped": "stopped",
           "output closed": "the reader of the output went away",
           "output failed": "writing the output failed",
           "ended": "tcpdump ended",
           "error": failed}.get(res.reason, res.reason)
    lines = [(f"{res.packets} packet(s) ({format_size(res.bytes)}) from {target.node} {target.ifname} in "
              f"{res.elapsed_s:.1f} s to {where}; {why}")]
    if res.dropped:
        lines.append(f"warning: the kernel dropped {res.dropped} packet(s) the capture could not keep up with: "
                     f"capture less (--snaplen 128 keeps the headers, or narrow --filter)")
    for m in res.messages:
        lines.append(f"tcpdump: {m}")
    return lines


def _status(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc is not None and rc > 128:   # timeout(1) reports its child's death by signal N as 128+N
        try:
            return f"tcpdump killed by {signal.Signals(rc - 128).name}"
        except ValueError:
            pass
    return f"exit status {rc}"


def parse_duration(value: str | float) -> float:
    """--duration: seconds ('90', '90s', '500ms'), minutes ('2m', '2min') or hours ('1h'); 0: no limit."""
    from testbed.topology.units import parse_time

    text = str(value).strip().lower()
    for suffix, scale in (("min", 60.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix) and not text.endswith("ms"):
            try:
                seconds = float(text[: -len(suffix)].strip()) * scale
            except ValueError:
                break
            if seconds >= 0:
                return seconds
            break
    try:
        return parse_time(text)
    except ValueError as exc:
        raise CaptureError(f"--duration: {exc} (got {value!r}; e.g. 30s, 500ms, 5m, or 0 for no limit)") from None
