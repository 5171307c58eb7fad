"""The userspace delay line: delay and jitter on kernels without sch_netem.

A delayed link is not a veth pair but two TAP devices, one in each node's
namespace, carrying the interface names the builder asked for, joined by a
delay-line engine (testbed.net.delay_engine) that reads frames from one TAP,
holds each for the delay (+ jitter, FIFO order kept) and writes it to the
other TAP; both directions, each with its own profile.

TAPs are opened with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR and TUNSETOFFLOAD, so
GSO frames (up to 64 KiB) cross whole: a single Python process moves >10
Gbit/s. The builder treats the TAPs like veth ends (addresses, bridge
enslaving, up, HTB through shaping.apply on each TAP's egress: bandwidth and
queue then live in the kernel, before the delay). Loss goes through
shaping.apply too (cls_bpf), not here.

Engines, not a process per link: a k=16 fat-tree at auto dilation has 3,072
delayed links, and a helper per link meant 3,072 Python processes (one
`select` each). start_delay_link opens the line's TAPs here, in the nodes'
namespaces, and hands their descriptors to an engine of the testbed (SCM_RIGHTS
over the engine's channel): one engine per CPU this process may use (at most
ENGINES_CAP), more only when an engine's open-files limit is full (three per
line). Engines live in the root namespace; the TAPs are not persistent, so a
line's TAPs vanish when its engine closes them (the line is removed, or the
engine ends).

Per link, as before, so the state, the monitor, faults and teardown work by
link: dl-<link_id>.pid names the engine serving it ("PID START"), and
dl-<link_id>.sock is the line's control socket, one JSON line per connection:
{"cmd": "set", "ab": {profile}, "ba": {profile}}, {"cmd": "stats"} or
{"cmd": "remove"}. An engine's own pid file is dle-<PID>.pid; they all log
to dle.log. Stopping the engine a record names (teardown) stops every line
it serves; stop(DelayLink) removes one line (and its engine with its last).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed import procs, safeio
from testbed.net import netns

IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN, TUN_F_USO4, TUN_F_USO6 = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
SIOCSIFMTU = 0x8922
ENGINE_LOG = "dle.log"
TAP_DEFAULT_MTU = 1500   # what the kernel gives a new TAP (ether_setup)
REPLY_MAX = 1 << 16


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
        if mtu and mtu != TAP_DEFAULT_MTU:   # (a change of MTU runs the kernel's notifier chain: skip a no-op)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                fcntl.ioctl(s.fileno(), SIOCSIFMTU, struct.pack("16si20x", name.encode(), mtu))
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class DelayLink:
    pid: int
    start: int        # clock ticks since boot: with the PID, names the engine (testbed.procs)
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


# -- the engines this process started --------------------------------------------------------------

@dataclass
class _Engine:
    ref: procs.ProcRef
    channel: socket.socket     # our end: "add" messages with the TAPs' descriptors
    capacity: int              # lines its open-files limit holds
    lines: int = 0


@dataclass
class _Registry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_dir: dict[str, list[_Engine]] = field(default_factory=dict)


_engines = _Registry()
ENGINES_MAX: int | None = None   # engines per testbed before lines share them (None: this process's CPUs,
ENGINES_CAP = 8                  # at most ENGINES_CAP: ~20 MiB each, and a 64-core machine's k=4 needs no 48)
ENGINE_SPIN_S: float | None = None   # how early the engines' timer fires (None: delay_engine.SPIN_S; a bench knob)


class _Gone(Exception):
    """The engine ended before it answered (its last line was just removed, or it was killed)."""


def engines_max() -> int:
    if ENGINES_MAX:
        return ENGINES_MAX
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, ENGINES_CAP))


def _spawn(testbed: str, directory: str, timeout: float) -> _Engine:
    return _ready(*_launch(testbed, directory), directory, timeout)


def _launch(testbed: str, directory: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start an engine process; _ready waits for it (several can start at once)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    logfd = safeio.open_beneath(directory, ENGINE_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cfg = {"testbed": testbed, "dir": directory, "channel": theirs.fileno(), "parent": os.getpid(),
               **({} if ENGINE_SPIN_S is None else {"spin_s": ENGINE_SPIN_S})}
        proc = subprocess.Popen([sys.executable, "-m", "testbed.net.delayline_main", json.dumps(cfg)],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=logfd,
                                stderr=logfd, start_new_session=True, env=env, close_fds=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
        os.close(logfd)
    return proc, ours


def _ready(proc: subprocess.Popen, ours: socket.socket, directory: str, timeout: float) -> _Engine:
    ours.settimeout(timeout)   # (socket timeouts wait in poll(2): any descriptor number works)
    try:
        ready = json.loads(ours.recv(REPLY_MAX) or b"{}")
    except (OSError, ValueError):
        ready = {}
    start = procs.start_ticks(proc.pid)
    if not ready.get("ready") or start is None:
        ours.close()
        try:
            proc.kill()
            proc.wait(2)
        except Exception:
            pass
        raise RuntimeError(f"the delay-line engine did not start: {_log_tail(directory)}")
    proc.returncode = 0   # never waited on here: stop() reaps it
    return _Engine(procs.ProcRef(proc.pid, start), ours, int(ready.get("capacity") or 0))


def _log_tail(directory: str) -> str:
    try:
        size = os.stat(os.path.join(directory, ENGINE_LOG)).st_size
        return safeio.read_text(os.path.join(directory, ENGINE_LOG), 800) if size <= 800 else \
            safeio.read_regular(os.path.join(directory, ENGINE_LOG), 800, size - 800).decode(errors="replace")
    except (OSError, safeio.Unsafe):
        return "(no log)"


def _engine_for(testbed: str, directory: str, timeout: float) -> _Engine:
    """The engine the next line goes to: a new one until there is one per CPU (or all are full),
    then the one serving fewest lines."""
    engines = []
    for e in _engines.by_dir.get(directory, []):
        if procs.alive(e.ref):
            engines.append(e)
        else:
            e.channel.close()
    _engines.by_dir[directory] = engines
    room = [e for e in engines if e.lines < e.capacity]
    if room and len(engines) >= engines_max():
        return min(room, key=lambda e: e.lines)
    engine = _spawn(testbed, directory, timeout)
    if engine.capacity < 1:
        procs.stop([engine.ref])
        engine.channel.close()
        raise RuntimeError("the delay-line engine's open-files limit holds no line: raise the hard limit "
                           "(ulimit -Hn, or LimitNOFILE= for a service)")
    engines.append(engine)
    return engine


def _add(engine: _Engine, cfg: dict[str, Any], fa: int, fb: int) -> None:
    try:
        socket.send_fds(engine.channel, [json.dumps(cfg).encode()], [fa, fb])
        data = engine.channel.recv(REPLY_MAX)
    except socket.timeout:
        raise RuntimeError(f"the delay-line engine (pid {engine.ref.pid}) did not answer") from None
    except (BrokenPipeError, ConnectionResetError):
        raise _Gone from None
    if not data:
        raise _Gone
    reply = json.loads(data)
    if not reply.get("ok"):
        raise RuntimeError(f"delay line {cfg['link_id']}: the engine refused it: {reply.get('error')}")


def _forget(ref: procs.ProcRef, line_gone: bool = False, engine_gone: bool = False) -> None:
    with _engines.lock:
        for engines in _engines.by_dir.values():
            for e in list(engines):
                if e.ref == ref:
                    e.lines -= int(line_gone)
                    if engine_gone:
                        engines.remove(e)
                        e.channel.close()


def start_delay_link(testbed: str, link_id: str | int, ns_a: str, if_a: str, ns_b: str, if_b: str,
                     profile_ab: Any, profile_ba: Any, mtu: int | None, state_dir: str | os.PathLike,
                     timeout: float = 10.0) -> DelayLink:
    """Create TAP if_a in ns_a and if_b in ns_b and hand them to an engine of the testbed (started
    if needed); return once the engine serves them (its pid file and control socket exist).

    The TAPs are left down and unaddressed: the builder configures them like veth ends.
    """
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    directory = os.path.abspath(state)
    lid = str(link_id)
    control = state / f"dl-{lid}.sock"
    pid_file = state / f"dl-{lid}.pid"
    with netns.enter(ns_a):   # (this thread only, and back: cheaper than a thread per TAP)
        fa = open_tap(if_a, mtu)
    fb = -1
    try:
        with netns.enter(ns_b):
            fb = open_tap(if_b, mtu)
        cfg = {"cmd": "add", "link_id": lid, "ab": _profile_json(profile_ab), "ba": _profile_json(profile_ba)}
        with _engines.lock:
            for attempt in range(2):
                engine = _engine_for(testbed, directory, timeout)
                try:
                    _add(engine, cfg, fa, fb)
                    break
                except _Gone:   # it ended between our look and the message: a fresh one, once
                    _engines.by_dir[directory].remove(engine)
                    engine.channel.close()
                    if attempt:
                        raise RuntimeError(f"delay line {lid}: its engine ended at once: {_log_tail(directory)}") \
                            from None
            engine.lines += 1
        return DelayLink(pid=engine.ref.pid, start=engine.ref.start, link_id=lid, ns_a=ns_a, if_a=if_a,
                         ns_b=ns_b, if_b=if_b, control=str(control), pid_file=str(pid_file))
    finally:
        for fd in (fa, fb):   # the engine holds its own copies now
            if fd >= 0:
                os.close(fd)


@dataclass(frozen=True)
class LineSpec:
    """One line for start_delay_links: what start_delay_link takes, less the testbed and directory."""
    link_id: str
    ns_a: str
    if_a: str
    ns_b: str
    if_b: str
    profile_ab: Any
    profile_ba: Any
    mtu: int | None = None


def start_delay_links(testbed: str, specs: list[LineSpec], state_dir: str | os.PathLike, *,
                      on_started: Any = None, timeout: float = 10.0, window: int = 32) -> list[DelayLink]:
    """start_delay_link for many lines (a build): the engines needed are started together, and each
    engine is handed up to `window` lines before its first answer is awaited, so opening TAPs here
    and taking them on there overlap (one round trip per line took ~1 ms; a k=8 fat-tree has 384).
    on_started(DelayLink) is called as each engine confirms a line. Raises RuntimeError for the
    first line refused; lines already handed over are the engines' (teardown's stop_all ends them)."""
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    directory = os.path.abspath(state)
    out: list[DelayLink] = []
    waiting: dict[int, list[tuple[LineSpec, _Engine]]] = {}   # id(engine) -> lines sent, not yet answered
    with _engines.lock:
        _spawn_up_to(testbed, directory, min(engines_max(), len(specs)), timeout)
        try:
            for spec in specs:
                room = [e for e in _engines.by_dir[directory] if e.lines < e.capacity]
                engine = min(room, key=lambda e: e.lines) if room else _engine_for(testbed, directory, timeout)
                queue = waiting.setdefault(id(engine), [])
                if len(queue) >= window:
                    out.append(_answered(queue.pop(0), directory, on_started))
                _send_line(engine, spec, directory)
                engine.lines += 1
                queue.append((spec, engine))
        except BaseException:
            _drain(waiting, directory, on_started, out)   # what the engines took is recorded, then the error
            raise
        failed = _drain(waiting, directory, on_started, out)
    if failed is not None:
        raise failed
    return out


def _drain(waiting: dict[int, list[tuple[LineSpec, "_Engine"]]], directory: str, on_started: Any,
           out: list[DelayLink]) -> BaseException | None:
    """Every answer still due; the first failure among them (returned, not raised)."""
    first = None
    for queue in waiting.values():
        while queue:
            try:
                out.append(_answered(queue.pop(0), directory, on_started))
            except Exception as exc:
                first = first or exc
    return first


def _spawn_up_to(testbed: str, directory: str, n: int, timeout: float) -> None:
    """Start engines for this directory until n are alive, all at once (each takes ~0.1 s to start)."""
    engines = [e for e in _engines.by_dir.get(directory, []) if procs.alive(e.ref)]
    launched = [_launch(testbed, directory) for _ in range(n - len(engines))]
    try:
        while launched:
            engine = _ready(*launched.pop(0), directory, timeout)
            if engine.capacity < 1:
                procs.stop([engine.ref])
                engine.channel.close()
                raise RuntimeError("the delay-line engine's open-files limit holds no line: raise the hard limit "
                                   "(ulimit -Hn, or LimitNOFILE= for a service)")
            engines.append(engine)
    finally:
        for proc, ours in launched:   # (a failure above) the rest end with their channel, before any line
            ours.close()
        _engines.by_dir[directory] = engines


def _send_line(engine: _Engine, spec: LineSpec, directory: str) -> None:
    with netns.enter(spec.ns_a):
        fa = open_tap(spec.if_a, spec.mtu)
    fb = -1
    try:
        with netns.enter(spec.ns_b):
            fb = open_tap(spec.if_b, spec.mtu)
        cfg = {"cmd": "add", "link_id": spec.link_id, "ab": _profile_json(spec.profile_ab),
               "ba": _profile_json(spec.profile_ba)}
        try:
            socket.send_fds(engine.channel, [json.dumps(cfg).encode()], [fa, fb])
        except socket.timeout:
            raise RuntimeError(f"the delay-line engine (pid {engine.ref.pid}) did not take line {spec.link_id}") \
                from None
        except (BrokenPipeError, ConnectionResetError):
            raise RuntimeError(f"delay line {spec.link_id}: its engine ended: {_log_tail(directory)}") from None
    finally:
        for fd in (fa, fb):   # in flight, the engine's copies keep the TAPs
            if fd >= 0:
                os.close(fd)


def _answered(sent: tuple[LineSpec, _Engine], directory: str, on_started: Any) -> DelayLink:
    spec, engine = sent
    try:
        data = engine.channel.recv(REPLY_MAX)
    except socket.timeout:
        raise RuntimeError(f"the delay-line engine (pid {engine.ref.pid}) did not answer") from None
    except (BrokenPipeError, ConnectionResetError):
        data = b""
    if not data:
        raise RuntimeError(f"delay line {spec.link_id}: its engine ended: {_log_tail(directory)}")
    reply = json.loads(data)
    if not reply.get("ok"):
        raise RuntimeError(f"delay line {spec.link_id}: the engine refused it: {reply.get('error')}")
    link = DelayLink(pid=engine.ref.pid, start=engine.ref.start, link_id=spec.link_id, ns_a=spec.ns_a,
                     if_a=spec.if_a, ns_b=spec.ns_b, if_b=spec.if_b,
                     control=os.path.join(directory, f"dl-{spec.link_id}.sock"),
                     pid_file=os.path.join(directory, f"dl-{spec.link_id}.pid"))
    if on_started is not None:
        on_started(link)
    return link


def _open_files(ref: procs.ProcRef) -> int | None:
    try:
        return len(os.listdir(f"/proc/{ref.pid}/fd")) if procs.alive(ref) else None
    except OSError:
        return None


def _end(refs: list[procs.ProcRef], timeout: float) -> list[procs.ProcRef]:
    """TERM engines and wait for them to end; those still there after `timeout` s that closed no
    file meanwhile get KILL. An ending engine closes its TAPs first (~1.2 ms each, 32 at a time:
    seconds for thousands of lines), and a KILL then would leave the rest to the kernel one by one
    (~23 ms each), so the wait goes on while the engine's count of open files falls. The engines
    still alive at the end are returned."""
    refs = [r for r in refs if procs.signal_ref(r, signal.SIGTERM)]
    files = {r: _open_files(r) for r in refs}
    left: list[procs.ProcRef] = []
    while refs:
        refs = procs.wait_gone(refs, timeout)
        now = {r: _open_files(r) for r in refs}
        stuck = [r for r in refs if now[r] is None or files[r] is None or now[r] >= files[r]]
        for r in stuck:
            procs.signal_ref(r, signal.SIGKILL)
        left += procs.wait_gone(stuck, timeout)
        refs, files = [r for r in refs if r not in stuck], now
    return left


def stop_engines(refs: list[procs.ProcRef], timeout: float = 3.0) -> list[procs.ProcRef]:
    """End these engines together (teardown: each closes its TAPs at once, not one engine after the
    other); returns those still running."""
    left = _end(list(refs), timeout)
    for ref in refs:
        _forget(ref, engine_gone=ref not in left)
    return left


def stop(target: "DelayLink | procs.ProcRef", timeout: float = 3.0) -> bool:
    """A DelayLink: remove that line from its engine (the engine ends with its last line); its
    TAPs vanish. A ProcRef: end that engine, and every line it serves (teardown). Processes are
    named by PID and start time, never by name. True if the line (or engine) is gone."""
    if not isinstance(target, DelayLink):
        left = _end([target], timeout)
        _forget(target, engine_gone=not left)
        return not left
    link = target
    ref = procs.ProcRef(link.pid, link.start)
    named = read_pid_file(Path(link.pid_file))
    gone = not procs.alive(ref) or named is None and not os.path.lexists(link.control)   # (removed before)
    if not gone and named == ref:   # a second proof before acting
        gone = True
        try:
            reply = _request(link.control, {"cmd": "remove"}, timeout)
            if reply.get("engine_exits"):
                procs.wait_gone([ref], timeout)
            _forget(ref, line_gone=True, engine_gone=bool(reply.get("engine_exits")))
        except (OSError, ValueError, RuntimeError):   # it does not answer: the whole engine goes
            gone = not _end([ref], timeout)
            _forget(ref, engine_gone=gone)
    for p in (link.pid_file, link.control) if gone else ():
        try:
            os.unlink(p)
        except OSError:
            pass
    return gone


def read_pid_file(pf: Path) -> procs.ProcRef | None:
    """The engine a pid file names ("PID START"), or None if the file says anything else."""
    try:
        pid, start = (int(x) for x in safeio.read_regular(pf, 64).split())
    except (OSError, ValueError, safeio.Unsafe):
        return None
    return procs.ProcRef(pid, start) if pid > 0 and start >= 0 else None


def stop_all(state_dir: str | os.PathLike) -> int:
    """Stop every engine a pid file under state_dir names (cleanup after a crash), and remove
    the files. Returns how many engines were stopped."""
    d = Path(state_dir)
    files = sorted(d.glob("dl-*.pid")) + sorted(d.glob("dle-*.pid"))
    refs = {ref for ref in (read_pid_file(pf) for pf in files) if ref is not None and procs.alive(ref)}
    left = _end(list(refs), 3.0)
    for ref in refs:
        _forget(ref, engine_gone=ref not in left)
    for pf in files:
        for p in (pf, pf.with_suffix(".sock")):
            try:
                p.unlink()
            except OSError:
                pass
    return len(refs) - len(left)


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
        while not data.endswith(b"\n") and len(data) <= REPLY_MAX:
            chunk = s.recv(REPLY_MAX)
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
    """Counters of one line per direction: frames/bytes forwarded and dropped, current profile,
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


def serve(cfg: dict[str, Any]) -> None:
    """The engine process's body (python -m testbed.net.delayline_main CONFIG)."""
    from testbed.net.delay_engine import serve as run

    run(cfg)
