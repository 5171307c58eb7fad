"""The delay-line engine: one process that serves many delay lines.

A delay line joins two TAP devices (testbed.net.delayline makes them, one in each node's
namespace) and holds every frame for its direction's delay (+ jitter) before writing it to the
other TAP. One engine multiplexes many lines; delayline starts a few per testbed (about one per
CPU) instead of a process per line: a k=16 fat-tree at auto dilation has 3,072 delayed links.

Started as `python -m testbed.net.delayline_main CONFIG` with one end of a SOCK_SEQPACKET
socketpair, the channel: each "add" message on it carries a line's link id and profiles, and the
line's two TAP descriptors (SCM_RIGHTS). For each line the engine binds the line's own control
socket (dl-LINK.sock: set, stats, remove; one JSON line per connection) and writes the line's pid
file (dl-LINK.pid: the engine's PID and start ticks), so what worked per link before (the monitor,
faults, `testbed link`, the second proof of teardown) works unchanged. Its own pid file is
dle-PID.pid, written first thing (cleanup finds an engine that has no line yet).

Timing. Descriptors wait in epoll (no limit at 1,024 like select). Each direction's frames leave
in FIFO order (jitter never lets a frame overtake the one before), so only the head of each
direction's queue is in the timer heap. The process sleeps in epoll_wait with no timeout and a
timerfd armed SPIN_S before the earliest due time (absolute CLOCK_MONOTONIC, time.monotonic's
clock), then spins the rest: epoll's own timeout is in milliseconds, a timerfd fires at the
nanosecond asked (no timer slack), and the wake-up after it is what the spin hides
(bench/delay_engine.py --timers measures the choices). It runs at the lowest real-time priority,
like the per-link helpers it replaces: it is the wire, and a frame it sends late is a longer delay.

Lifetime. The engine outlives the `up` that started it (it is named by its pid files before its
parent may die), ends on TERM (removing its files), when its last line is removed, or when its
parent closes the channel before giving it a line. A line whose TAP fails (EBADFD, ENODEV) is
dropped alone; a deleted namespace does not end one (the TAP's descriptor keeps it alive).

Standard library and testbed.procs/safeio only (an engine is ready 96-173 ms after its spawn here).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import heapq
import json
import os
import random
import re
import resource
import select
import signal
import socket
import time
from typing import Any, Callable

from testbed import procs, safeio
from testbed.net.timerfd import Timer

VNET_HDR_LEN = 10
READ_SIZE = 65536 + 512
# Turns, so that a line the engine cannot keep up with does not hold the others back: frames read from
# one TAP before the others, and due frames, get their turn; frames sent per direction before the TAPs
# are read again (a 64 KiB frame's write runs the receiving stack, ~50-100 us). An idle line beside an
# iperf3 flow in the same engine, p99 RTT at 2 ms asked: 15.2 ms sending a direction's whole backlog at
# once, 3.7-5.5 ms with 16 and 16, 2.9-4.1 ms with 8 and 4 (the old helpers: 2.8-3.8 ms).
READ_BATCH = 8
RELEASE_BATCH = 4
MAX_QUEUED_BYTES = 256 * 1024 * 1024          # held per direction; beyond it frames are dropped
MAX_ENGINE_QUEUED_BYTES = 1024 * 1024 * 1024  # held per engine (3,000 lines must not add up to all memory)
LATE_BUCKETS = 24      # lateness histogram: bucket i counts frames sent 2^(i-1)..2^i microseconds late
FILES_PER_LINE = 3     # two TAPs and the control socket
BASE_FILES = 64        # the engine's own: std streams, epoll, timerfd, channel, control connections
MAX_CONNS = 32         # control connections open at once (each a file)
CONN_TIMEOUT_S = 2.0   # a control client that sends no whole line in this time is dropped
MSG_MAX = 65536
MAX_DELAY_S = 3600.0
CLOSERS = 32           # threads closing TAPs at once (_Closer)
# The timer fires this early and the engine spins the rest: a sleeping process wakes ~45-50 us after
# its timerfd fires here (bench/delay_engine.py --timers: median 45-49 us late, as select's was),
# which at auto dilation is the size of a link's whole delay. Spinning the last 50 us took the
# median to ~1 us late for ~30 us more CPU a wake.
SPIN_S = 50e-6
LINK_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

_PR_SET_PDEATHSIG = 1


def capacity(files: int) -> int:
    """How many lines an engine whose open-files limit is `files` can serve."""
    return max(0, (files - BASE_FILES) // FILES_PER_LINE)


# -- lines and their directions -------------------------------------------------------------------

def _seconds(prof: Any, key: str) -> float:
    v = float(prof.get(key, 0.0)) if isinstance(prof, dict) else 0.0
    if not 0.0 <= v <= MAX_DELAY_S:   # (NaN fails both)
        raise ValueError(f"{key} {v!r}: between 0 and {MAX_DELAY_S:g} s")
    return v


class Direction:
    __slots__ = ("line", "name", "src", "dst", "key", "delay", "jitter", "queue", "queued_bytes", "last_due",
                 "frames", "bytes", "drops", "late", "late_max")

    def __init__(self, line: "Line", name: str, src: int, dst: int, key: int, prof: dict[str, float]):
        self.line: Line | None = line      # None once the line is removed (its heap entry is skipped)
        self.name, self.src, self.dst, self.key = name, src, dst, key
        self.queue: collections.deque = collections.deque()   # (due, frame), due times non-decreasing
        self.queued_bytes = 0
        self.last_due = 0.0
        self.frames = self.bytes = self.drops = 0
        self.late = [0] * LATE_BUCKETS   # how late frames left against their schedule (the verdict reads it)
        self.late_max = 0.0
        self.set(prof)

    def set(self, prof: dict[str, float]) -> None:
        delay, jitter = _seconds(prof, "delay_s"), _seconds(prof, "jitter_s")
        self.delay, self.jitter = delay, jitter

    def sent_late(self, seconds: float) -> None:
        us = max(0, int(seconds * 1e6))
        self.late[min(us.bit_length(), LATE_BUCKETS - 1)] += 1
        if seconds > self.late_max:
            self.late_max = seconds

    def stats(self) -> dict[str, Any]:
        return {"delay_s": self.delay, "jitter_s": self.jitter, "frames": self.frames, "bytes": self.bytes,
                "drops": self.drops, "queued": len(self.queue), "late_hist_us_log2": list(self.late),
                "late_max_s": self.late_max}


class Line:
    def __init__(self, link_id: str, fa: int, fb: int, lsock: socket.socket, keys: tuple[int, int],
                 ab: dict[str, float], ba: dict[str, float]):
        self.link_id, self.fa, self.fb, self.lsock = link_id, fa, fb, lsock
        self.control, self.pid_file = f"dl-{link_id}.sock", f"dl-{link_id}.pid"
        self.dirs = {"ab": Direction(self, "ab", fa, fb, keys[0], ab),
                     "ba": Direction(self, "ba", fb, fa, keys[1], ba)}


class _Closer:
    """Closes TAP descriptors from a pool of threads. On a TAP's last close the kernel unregisters
    its device and then waits for an RCU grace period outside its lock: ~23 ms a TAP one by one
    here, ~1.2 ms a TAP from 32 threads at once (200 TAPs: 4.6 s against 0.25 s). One by one, an
    engine of 3,000 lines would take over two minutes to end."""

    def __init__(self) -> None:
        self.pool: Any = None

    def close(self, fds: list[int], wait: bool) -> None:
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(CLOSERS, thread_name_prefix="close")
        done = [self.pool.submit(_close_quietly, fd) for fd in fds]
        if wait:
            for f in done:
                f.result()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class _Conn:
    __slots__ = ("sock", "line", "deadline", "buf")

    def __init__(self, sock: socket.socket, line: Line, deadline: float):
        self.sock, self.line, self.deadline, self.buf = sock, line, deadline, b""


# -- the engine -----------------------------------------------------------------------------------

class Engine:
    def __init__(self, directory: str, channel: socket.socket, own_pid_file: str, spin: float = SPIN_S):
        self.dir, self.channel, self.own_pid_file, self.spin = directory, channel, own_pid_file, spin
        self.me = f"{os.getpid()} {procs.start_ticks(os.getpid()) or 0}\n".encode()
        self.ep = select.epoll()
        self.timer = Timer()
        self.heap: list[tuple[float, int, Direction]] = []
        self.taps: dict[int, Direction] = {}          # TAP fd -> the direction its frames take
        self.handlers: dict[int, Callable[[int, int], None]] = {}
        self.lines: dict[str, Line] = {}
        self.conns: dict[int, _Conn] = {}
        self.queued = 0
        self.served = 0
        self.next_key = 0
        self.done = False
        self.closer = _Closer()
        self._watch(self.timer.fd, lambda fd, ev: self.timer.fired())
        self._watch(channel.fileno(), self.on_channel)

    def _watch(self, fd: int, handler: Callable[[int, int], None]) -> None:
        self.handlers[fd] = handler
        self.ep.register(fd, select.EPOLLIN)

    def _unwatch(self, fd: int) -> None:
        self.handlers.pop(fd, None)
        self.taps.pop(fd, None)
        try:
            self.ep.unregister(fd)
        except (OSError, ValueError):
            pass

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        heap, taps, handlers, timer, spin = self.heap, self.taps, self.handlers, self.timer, self.spin
        now_fn, wait = time.monotonic, self.ep.poll
        while not self.done:
            soon = False
            if heap:
                due = heap[0][0]
                if due - now_fn() <= spin:   # the last microseconds: spin (SPIN_S), then send
                    while now_fn() < due:
                        pass
                    self.release()
                soon = bool(heap) and heap[0][0] - now_fn() <= spin
            timer.arm(heap[0][0] - spin if heap else None)
            try:   # (the next frame due at once: look at the TAPs without sleeping, then spin again)
                events = wait(0 if soon else -1)
            except InterruptedError:
                continue
            for fd, ev in events:
                d = taps.get(fd)
                if d is not None:
                    self.pull(d, ev)
                    if heap and heap[0][0] <= now_fn():   # a busy TAP does not hold back due frames
                        self.release()
                    continue
                h = handlers.get(fd)
                if h is not None:
                    h(fd, ev)
            if self.conns:
                self.expire_conns()

    def pull(self, d: Direction, ev: int) -> None:
        """Read up to READ_BATCH frames from d's TAP and schedule them."""
        heap, q = self.heap, d.queue
        now_fn, read, uniform = time.monotonic, os.read, random.uniform
        for _ in range(READ_BATCH):
            try:
                frame = read(d.src, READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EBADFD, errno.ENODEV, errno.EFAULT) or ev & (select.EPOLLERR | select.EPOLLHUP):
                    self.remove(d.line, f"its TAP failed ({exc.strerror})")
                return
            if not frame:
                return
            delay = d.delay
            if d.jitter:
                delay = max(0.0, delay + uniform(-d.jitter, d.jitter))
            if delay <= 0 and not q:
                self.send(d, frame, None)
                continue
            n = len(frame)
            if d.queued_bytes + n > MAX_QUEUED_BYTES or self.queued + n > MAX_ENGINE_QUEUED_BYTES:
                d.drops += 1
                continue
            due = now_fn() + delay
            if due < d.last_due:
                due = d.last_due          # FIFO: never overtake the previous frame
            d.last_due = due
            if not q:
                heapq.heappush(heap, (due, d.key, d))
            q.append((due, frame))
            d.queued_bytes += n
            self.queued += n

    def release(self) -> None:
        """Send the frames that are due: one per direction in turn, so that the backlog of a line
        the engine cannot keep up with does not hold up another line's frame (with a direction's
        whole backlog at a time, an idle line beside an iperf3 flow saw 15 ms of RTT at p99)."""
        heap = self.heap
        now = time.monotonic()
        turn = []
        while heap and heap[0][0] <= now:
            d = heapq.heappop(heap)[2]
            if d.line is not None:
                turn.append(d)
        for _ in range(RELEASE_BATCH):
            more = []
            for d in turn:
                q = d.queue
                due, frame = q.popleft()
                d.queued_bytes -= len(frame)
                self.queued -= len(frame)
                self.send(d, frame, due)
                if q and q[0][0] <= now:
                    more.append(d)
                elif q:
                    heapq.heappush(heap, (q[0][0], d.key, d))
            turn = more
            if not turn:
                break
        for d in turn:   # still due: after a look at the TAPs (their frames are stamped when read)
            heapq.heappush(heap, (d.queue[0][0], d.key, d))

    @staticmethod
    def send(d: Direction, frame: bytes, due: float | None) -> None:
        if due is not None:
            d.sent_late(time.monotonic() - due)
        try:
            os.write(d.dst, frame)
        except OSError:   # the peer TAP is down (EIO) or gone: the frame is lost
            d.drops += 1
            return
        d.frames += 1
        d.bytes += len(frame) - VNET_HDR_LEN

    # -- lines ------------------------------------------------------------------------------------
    def add(self, cfg: dict[str, Any], fa: int, fb: int) -> None:
        lid = str(cfg.get("link_id"))
        if not LINK_ID.fullmatch(lid):
            raise ValueError(f"link id {lid!r}: letters, digits, '.', '_', '-'")
        if lid in self.lines:
            raise ValueError(f"link {lid} is served already")
        ab, ba = cfg.get("ab") or {}, cfg.get("ba") or {}
        for fd in (fa, fb):
            os.set_blocking(fd, False)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            line = Line(lid, fa, fb, lsock, (self.next_key, self.next_key + 1), ab, ba)
            self.next_key += 2
            try:
                os.unlink(line.control)   # (relative: the engine's cwd is the state directory)
            except FileNotFoundError:
                pass
            lsock.bind(line.control)   # a short relative name: sun_path holds 108 bytes
            lsock.listen(8)
            safeio.write_beneath(self.dir, line.pid_file, self.me)
        except BaseException:
            if lsock.getsockname():
                _unlink(f"dl-{lid}.sock")
            lsock.close()
            raise
        self.lines[lid] = line
        self.served += 1
        for d in line.dirs.values():
            self.taps[d.src] = d
            self.ep.register(d.src, select.EPOLLIN)
        self._watch(lsock.fileno(), lambda fd, ev, line=line: self.on_accept(line))

    def remove(self, line: Line | None, why: str | None = None, wait: bool = False) -> None:
        """Stop serving `line`; wait: until its TAPs are gone (a caller will look for them)."""
        if line is None or self.lines.get(line.link_id) is not line:
            return
        if why:
            print(f"delay line {line.link_id}: removed, {why}", flush=True)
        del self.lines[line.link_id]
        for d in line.dirs.values():
            d.line = None
            self.queued -= d.queued_bytes
            d.queue.clear()
        for fd in (line.fa, line.fb, line.lsock.fileno()):
            self._unwatch(fd)
        self.closer.close([line.fa, line.fb], wait)
        line.lsock.close()
        for c in [c for c in self.conns.values() if c.line is line]:
            self.close_conn(c)
        _unlink(line.control, line.pid_file)
        if not self.lines:
            self.done = True   # the last line is gone: so is the engine

    # -- the channel (from the process that starts lines) -----------------------------------------
    def on_channel(self, fd: int, ev: int) -> None:
        try:
            msg, fds, flags, _ = socket.recv_fds(self.channel, MSG_MAX, 2)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg, fds, flags = b"", [], 0
        if not msg:   # the parent closed it (or is gone): no more lines will come
            for extra in fds:
                os.close(extra)
            self._unwatch(fd)
            self.channel.close()
            self.channel = None
            if not self.lines:
                self.done = True
            return
        try:
            if flags & socket.MSG_CTRUNC or len(fds) != 2:
                raise OSError(errno.EMFILE, f"the line's two TAP descriptors did not arrive (got {len(fds)}; "
                                            "the engine's open-files limit?)")
            self.add(json.loads(msg), fds[0], fds[1])
            fds = []
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            for extra in fds:
                os.close(extra)
        try:
            self.channel.send(json.dumps(reply).encode())
        except OSError:
            pass

    # -- control connections ----------------------------------------------------------------------
    def on_accept(self, line: Line) -> None:
        try:
            sock, _ = line.lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            print(f"delay line {line.link_id}: control accept: {exc}", flush=True)
            return
        if len(self.conns) >= MAX_CONNS:
            self.close_conn(min(self.conns.values(), key=lambda c: c.deadline))
        sock.setblocking(False)
        c = _Conn(sock, line, time.monotonic() + CONN_TIMEOUT_S)
        self.conns[sock.fileno()] = c
        self._watch(sock.fileno(), self.on_conn)

    def on_conn(self, fd: int, ev: int) -> None:
        c = self.conns.get(fd)
        if c is None:
            return
        try:
            chunk = c.sock.recv(MSG_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        c.buf += chunk
        if b"\n" not in c.buf:
            if not chunk or len(c.buf) > MSG_MAX:
                self.close_conn(c)
            return
        line = c.line
        remove = False
        try:
            msg = json.loads(c.buf.split(b"\n", 1)[0])
            cmd = msg.get("cmd") if isinstance(msg, dict) else None
            if cmd == "set":
                for name in ("ab", "ba"):
                    if msg.get(name) is not None:
                        line.dirs[name].set(msg[name])
                reply: dict[str, Any] = {"ok": True}
            elif cmd == "stats":
                reply = {"ok": True, **{n: d.stats() for n, d in line.dirs.items()}}
            elif cmd == "remove":
                remove = True
                reply = {"ok": True, "engine_exits": len(self.lines) == 1}
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if remove:   # before the answer: once told, the caller may look for the TAPs (gone)
            c.line = None   # (remove() closes the line's connections, but this one answers)
            self.remove(line, wait=True)
        try:
            c.sock.send(json.dumps(reply).encode() + b"\n")   # small: fits the socket's buffer
        except OSError:
            pass
        self.close_conn(c)

    def close_conn(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        self.conns.pop(fd, None)
        self._unwatch(fd)
        c.sock.close()

    def expire_conns(self) -> None:
        now = time.monotonic()
        for c in [c for c in self.conns.values() if c.deadline < now]:
            self.close_conn(c)

    def close(self) -> None:
        """On the way out: every line's TAPs (all at once: _Closer), then its files, then the
        engine's own pid file."""
        lines = list(self.lines.values())
        self.closer.close([fd for line in lines for fd in (line.fa, line.fb)], wait=True)
        self.closer.shutdown()
        for line in lines:
            _unlink(line.control, line.pid_file)
        _unlink(self.own_pid_file)


def _unlink(*names: str) -> None:
    for name in names:
        try:
            os.unlink(name)
        except OSError:
            pass


# -- the process ----------------------------------------------------------------------------------

def _raise_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (three per line); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        try:
            hard = int(open("/proc/sys/fs/nr_open").read())
        except (OSError, ValueError):
            hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        return hard
    except (OSError, ValueError):
        return soft


def _network_priority() -> None:
    """Run ahead of the ranks: the engine is the emulated wire, and a frame it sends late is a
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


def serve(cfg: dict[str, Any]) -> None:
    """The engine process (python -m testbed.net.delayline_main CONFIG)."""
    # First of all, say who we are where cleanup looks: a parent killed right after starting us
    # (kill -9 of `up`) must not leave an engine that nothing names. Until the pid file is there,
    # we die with the parent (PDEATHSIG); a parent already gone (we were reparented while Python
    # started) means nobody will record us, and a cleanup may already have run: end now.
    libc = ctypes.CDLL(None, use_errno=True)
    parent = cfg.get("parent")
    if parent:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(parent):
            os._exit(0)
    directory = str(cfg["dir"])
    os.chdir(directory)   # control sockets are bound by short relative names
    own = f"dle-{os.getpid()}.pid"
    me = f"{os.getpid()} {procs.start_ticks(os.getpid()) or 0}\n".encode()
    safeio.write_beneath(directory, own, me)
    if parent:   # named now: outlive `up`, as the wire must (a kill before this line is ours too)
        libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    files = _raise_files_limit()
    _network_priority()
    channel = socket.socket(fileno=int(cfg["channel"]))
    channel.setblocking(False)
    engine = Engine(directory, channel, own, float(cfg.get("spin_s", SPIN_S)))

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: a second must not cut the closing short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        channel.send(json.dumps({"ready": True, "capacity": capacity(files)}).encode())
        engine.run()
    finally:
        engine.close()
