"""The userspace delay line: delay and jitter on kernels without sch_netem.

A delayed link is not a veth pair but two TAP devices, one in each node's
namespace, carrying the interface names the builder asked for, joined by a
helper process (`python -m testbed.net.delayline_main`) that reads frames
from one TAP, holds each for the delay (+ jitter, FIFO order kept) and writes
it to the other TAP; both directions, each with its own profile.

TAPs are opened with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR and TUNSETOFFLOAD, so
GSO frames (up to 64 KiB) cross whole: a single Python process moves >10
Gbit/s. The builder treats the TAPs like veth ends (addresses, bridge
enslaving, up, HTB through shaping.apply on each TAP's egress: bandwidth and
queue then live in the kernel, before the delay). Loss goes through
shaping.apply too (cls_bpf), not here.

One helper process per delayed link (chosen over one per testbed: a crash or
a stop affects one link, pids map 1:1 to links in the state file, and an idle
helper costs nothing, it sleeps in select). The TAPs are not persistent: they
vanish when the helper's fds close, i.e. when it exits. Files under
state_dir: dl-<link_id>.pid, dl-<link_id>.sock (control), dl-<link_id>.log.

Control channel: a unix stream socket; one JSON line per connection:
{"cmd": "set", "ab": {profile}, "ba": {profile}} or {"cmd": "stats"}.

Timing: the loop sleeps in select(2) (microsecond timeouts; epoll rounds to
milliseconds) with the timer slack set to 1 us, so a 1 ms delay is held
~1.0x ms, not 2 ms; it runs at the lowest real-time priority, so ranks that
time-share the CPUs do not make it send late (the run's verdict reads how
late it was).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from testbed import procs
from testbed.net.netns import run_in_netns

IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN, TUN_F_USO4, TUN_F_USO6 = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
SIOCSIFMTU = 0x8922
VNET_HDR_LEN = 10
READ_SIZE = 65536 + 512
MAX_QUEUED_BYTES = 256 * 1024 * 1024   # per direction; beyond it frames are dropped
_PR_SET_PDEATHSIG = 1


def open_tap(name: str, mtu: int | None = None) -> int:
    """Create TAP `name` in the calling thread's namespace; returns the (non-blocking) fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
        base = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN
        try:
            fcntl.ioctl(fd, TUNSETOFFLOAD, base | TUN_F_USO4 | TUN_F_USO6)
        except OSError:
            fcntl.ioctl(fd, TUNSETOFFLOAD, base)  # kernels before 6.2 have no USO
        if mtu:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                fcntl.ioctl(s.fileno(), SIOCSIFMTU, struct.pack("16si20x", name.encode(), mtu))
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class DelayLink:
    pid: int
    start: int        # clock ticks since boot: with the PID, names the helper (testbed.procs)
    link_id: str
    ns_a: str
    if_a: str
    ns_b: str
    if_b: str
    control: str
    pid_file: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DelayLink":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def _profile_json(p: Any) -> dict[str, float]:
    if p is None:
        return {"delay_s": 0.0, "jitter_s": 0.0}
    if isinstance(p, dict):
        return {"delay_s": float(p.get("delay_s", 0.0)), "jitter_s": float(p.get("jitter_s", 0.0))}
    return {"delay_s": float(p.delay_s), "jitter_s": float(p.jitter_s)}


def start_delay_link(testbed: str, link_id: str | int, ns_a: str, if_a: str, ns_b: str, if_b: str,
                     profile_ab: Any, profile_ba: Any, mtu: int | None, state_dir: str | os.PathLike,
                     timeout: float = 10.0) -> DelayLink:
    """Create TAP if_a in ns_a and if_b in ns_b, start the helper joining them; return when ready.

    The TAPs are left down and unaddressed: the builder configures them like veth ends.
    """
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    lid = str(link_id)
    control = state / f"dl-{lid}.sock"
    pid_file = state / f"dl-{lid}.pid"
    log = state / f"dl-{lid}.log"
    try:
        control.unlink()
    except FileNotFoundError:
        pass
    fa = run_in_netns(ns_a, lambda: open_tap(if_a, mtu))
    fb = -1
    rd = wr = -1
    try:
        fb = run_in_netns(ns_b, lambda: open_tap(if_b, mtu))
        rd, wr = os.pipe()
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cfg = {"testbed": testbed, "link_id": lid, "fd_a": fa, "fd_b": fb, "ready_fd": wr,
               "control": str(control), "ab": _profile_json(profile_ab), "ba": _profile_json(profile_ba),
               "pid_file": str(pid_file), "parent": os.getpid()}
        with open(log, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "testbed.net.delayline_main", json.dumps(cfg)],
                                    pass_fds=(fa, fb, wr), stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=logf, start_new_session=True, env=env, close_fds=True)
        os.close(wr)
        wr = -1
        ready, _, _ = select.select([rd], [], [], timeout)
        msg = os.read(rd, 16) if ready else b""
        if msg != b"R":
            try:
                proc.kill()
                proc.wait(2)
            except Exception:
                pass
            tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
            raise RuntimeError(f"delay line {lid} did not start: {tail}")
        start = procs.start_ticks(proc.pid) or 0   # the helper wrote its pid file itself, first thing
        proc.returncode = 0  # we never wait on it here; stop() reaps it
        return DelayLink(pid=proc.pid, start=start, link_id=lid, ns_a=ns_a, if_a=if_a, ns_b=ns_b, if_b=if_b,
                         control=str(control), pid_file=str(pid_file))
    finally:
        for fd in (fa, fb, rd, wr):
            if fd >= 0:
                os.close(fd)


def stop(target: "DelayLink | procs.ProcRef", timeout: float = 3.0) -> bool:
    """End a helper we started (by PID and start time, never by name); its TAPs vanish with it.
    True if it is gone."""
    link = target if isinstance(target, DelayLink) else None
    ref = procs.ProcRef(link.pid, link.start) if link else target
    left = procs.stop([ref], term_wait=timeout, kill_wait=timeout)
    if link:
        for p in (link.pid_file, link.control):
            try:
                os.unlink(p)
            except OSError:
                pass
    return not left


def read_pid_file(pf: Path) -> procs.ProcRef | None:
    """The helper a pid file names ("PID START"), or None if the file says anything else."""
    try:
        pid, start = (int(x) for x in pf.read_text().split())
    except (OSError, ValueError):
        return None
    return procs.ProcRef(pid, start) if pid > 0 and start >= 0 else None


def stop_all(state_dir: str | os.PathLike) -> int:
    """Stop every helper with a pid file under state_dir (cleanup after a crash). Returns how many."""
    n = 0
    for pf in Path(state_dir).glob("dl-*.pid"):
        ref = read_pid_file(pf)
        if ref is not None and procs.alive(ref) and stop(ref):
            n += 1
        for p in (pf, pf.with_suffix(".sock")):
            try:
                p.unlink()
            except OSError:
                pass
    return n


def _request(target: "DelayLink | str", msg: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    path = target.control if isinstance(target, DelayLink) else str(target)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        if len(path.encode()) < 100:
            s.connect(path)
        else:  # sun_path holds 108 bytes: reach long paths through an fd on the directory
            dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                s.connect(f"/proc/self/fd/{dfd}/{os.path.basename(path)}")
            finally:
                os.close(dfd)
        s.sendall(json.dumps(msg).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data or b"{}")
    if not reply.get("ok"):
        raise RuntimeError(f"delay line refused {msg.get('cmd')}: {reply.get('error')}")
    return reply


def update(target: "DelayLink | str", profile_ab: Any, profile_ba: Any) -> dict[str, Any]:
    """Change delay/jitter of both directions at run time (frames already held keep their time)."""
    return _request(target, {"cmd": "set", "ab": _profile_json(profile_ab), "ba": _profile_json(profile_ba)})


def stats(target: "DelayLink | str") -> dict[str, Any]:
    """Counters of the helper per direction: frames/bytes forwarded and dropped, current profile,
    and how late held frames left (late_hist_us_log2: bucket i counts 2^(i-1)..2^i us late)."""
    return _request(target, {"cmd": "stats"})


def lateness_mean(hist: list[int]) -> float | None:
    """The mean of a lateness histogram, in seconds (each bucket at the middle of its range)."""
    total = sum(hist)
    if total <= 0:
        return None
    return sum(n * (0.0 if i == 0 else 0.75 * (1 << i)) for i, n in enumerate(hist)) / total / 1e6


def lateness_percentile(hist: list[int], q: float) -> float | None:
    """The q-th percentile (0-100) of a lateness histogram, in seconds (a bucket's upper edge)."""
    total = sum(hist)
    if total <= 0:
        return None
    need = total * q / 100
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= need:
            return (1 << i) / 1e6 if i else 0.0
    return (1 << (len(hist) - 1)) / 1e6


# -- the helper process ------------------------------------------------------------------

LATE_BUCKETS = 24   # lateness histogram: bucket i counts frames sent 2^(i-1)..2^i microseconds late


class _Direction:
    __slots__ = ("name", "src", "dst", "delay", "jitter", "queue", "queued_bytes", "last_due",
                 "frames", "bytes", "drops", "late", "late_max")

    def __init__(self, name: str, src: int, dst: int, prof: dict[str, float]):
        self.name, self.src, self.dst = name, src, dst
        self.queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.last_due = 0.0
        self.frames = self.bytes = self.drops = 0
        self.late = [0] * LATE_BUCKETS   # how late frames left against their schedule (the verdict reads it)
        self.late_max = 0.0
        self.set(prof)

    def set(self, prof: dict[str, float]) -> None:
        self.delay = max(0.0, float(prof.get("delay_s", 0.0)))
        self.jitter = max(0.0, float(prof.get("jitter_s", 0.0)))

    def sent_late(self, seconds: float) -> None:
        us = int(seconds * 1e6)
        self.late[min(us.bit_length(), LATE_BUCKETS - 1)] += 1
        if seconds > self.late_max:
            self.late_max = seconds

    def stats(self) -> dict[str, Any]:
        return {"delay_s": self.delay, "jitter_s": self.jitter, "frames": self.frames, "bytes": self.bytes,
                "drops": self.drops, "queued": len(self.queue), "late_hist_us_log2": list(self.late),
                "late_max_s": self.late_max}


def serve(cfg: dict[str, Any]) -> None:
    """The helper's loop (runs in the child; stdlib only)."""
    # First of all, say who we are where cleanup looks: a parent killed right after starting us
    # (kill -9 of `up`) must not leave a helper that nothing names. Until the pid file is there,
    # we die with the parent (PDEATHSIG); a parent already gone (we were reparented while Python
    # started) means nobody will record us, and a cleanup may already have run: end now.
    libc = ctypes.CDLL(None, use_errno=True)
    parent = cfg.get("parent")
    if parent:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(parent):
            os._exit(0)
    pf = cfg.get("pid_file")
    if pf:
        with open(pf + ".tmp", "w") as fh:
            fh.write(f"{os.getpid()} {procs.start_ticks(os.getpid()) or 0}\n")
        os.replace(pf + ".tmp", pf)
    if parent:   # named now: outlive `up`, as a helper must (a kill before this line is ours too)
        libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    try:  # 1 us timer slack: select() wakes when asked, not up to 50 us later
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)
    except Exception:
        pass
    _network_priority()
    fa, fb = int(cfg["fd_a"]), int(cfg["fd_b"])
    for fd in (fa, fb):
        os.set_blocking(fd, False)
    dirs = {fa: _Direction("ab", fa, fb, cfg["ab"]), fb: _Direction("ba", fb, fa, cfg["ba"])}
    by_name = {d.name: d for d in dirs.values()}
    control = cfg["control"]
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd_dir, base = os.path.split(control)
    os.chdir(cwd_dir or ".")     # bind a short relative name: sun_path is 108 bytes
    lsock.bind(base)
    lsock.listen(8)
    lsock.setblocking(False)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    os.write(int(cfg["ready_fd"]), b"R")
    os.close(int(cfg["ready_fd"]))

    readers = [fa, fb, lsock.fileno()]
    now_fn = time.monotonic
    uniform = random.uniform
    read, write = os.read, os.write
    try:
        while True:
            # 1. send what is due
            now = now_fn()
            timeout = None
            for d in dirs.values():
                q = d.queue
                while q and q[0][0] <= now:
                    due, frame = q.popleft()
                    d.queued_bytes -= len(frame)
                    try:
                        write(d.dst, frame)
                        d.frames += 1
                        d.bytes += len(frame) - VNET_HDR_LEN
                        d.sent_late(now - due)
                    except OSError:   # peer TAP down (EIO) or full: the frame is lost
                        d.drops += 1
                if q:
                    wait = q[0][0] - now
                    timeout = wait if timeout is None else min(timeout, wait)
            # 2. wait for frames, a control message or the next due time
            try:
                ready, _, _ = select.select(readers, [], [], timeout)
            except InterruptedError:
                continue
            if not ready:
                continue
            now = now_fn()
            for fd in ready:
                if fd == lsock.fileno():
                    _control(lsock, by_name)
                    continue
                d = dirs[fd]
                for _ in range(256):
                    try:
                        frame = read(fd, READ_SIZE)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno in (errno.EBADFD, errno.ENODEV):
                            raise SystemExit(0)   # the TAP's namespace is gone: so is the link we emulate
                        break
                    if not frame:
                        break
                    delay = d.delay
                    if d.jitter:
                        delay = max(0.0, delay + uniform(-d.jitter, d.jitter))
                    if delay <= 0 and not d.queue:
                        try:
                            write(d.dst, frame)
                            d.frames += 1
                            d.bytes += len(frame) - VNET_HDR_LEN
                        except OSError:
                            d.drops += 1
                        continue
                    if d.queued_bytes + len(frame) > MAX_QUEUED_BYTES:
                        d.drops += 1
                        continue
                    due = now + delay
                    if due < d.last_due:
                        due = d.last_due          # FIFO: never overtake the previous frame
                    d.last_due = due
                    d.queue.append((due, frame))
                    d.queued_bytes += len(frame)
    finally:
        try:
            os.unlink(base)
        except OSError:
            pass
        pf = cfg.get("pid_file")
        if pf:
            try:
                os.unlink(pf)
            except OSError:
                pass


def _network_priority() -> None:
    """Run ahead of the ranks: the helper is the emulated wire, and a frame it sends late is a
    longer delay than the link has. The lowest real-time priority (SCHED_FIFO 1) wakes it on
    time on a CPU that time-shares ranks (the kernel still keeps 5% of each second for other
    tasks); where that is not allowed, the highest nice level."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        except OSError:
            pass


def _control(lsock: socket.socket, by_name: dict[str, _Direction]) -> None:
    try:
        conn, _ = lsock.accept()
    except BlockingIOError:
        return
    with conn:
        conn.settimeout(1.0)
        try:
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            msg = json.loads(data)
            if msg.get("cmd") == "set":
                for name in ("ab", "ba"):
                    if msg.get(name) is not None:
                        by_name[name].set(msg[name])
                reply: dict[str, Any] = {"ok": True}
            elif msg.get("cmd") == "stats":
                reply = {"ok": True, **{n: d.stats() for n, d in by_name.items()}}
            else:
                reply = {"ok": False, "error": f"unknown command {msg.get('cmd')!r}"}
        except Exception as exc:
            reply = {"ok": False, "error": str(exc)}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass
