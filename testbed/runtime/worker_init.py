"""The init of a netns worker, and the spawner that starts a batch of them.

Standard library only, and nothing of the testbed package: the runtime
(testbed/runtime/netns.py) runs this file by its path, without site or venv,
as

    testbed-init -S -P /path/to/worker_init.py spawn

(argv[0] is "testbed-init"; the interpreter is sys.executable). The spawner
reads the batch on stdin, a JSON list of {"node", "log", "cfg"}, and forks the
bootstrap of every worker (a fork costs far less than a Python start per
worker). Each bootstrap is two stages:

- stage A joins the worker's cgroups and network namespace, unshares the mount,
  UTS, PID (and IPC) namespaces and forks stage B, which is PID 1 of the new
  PID namespace; A reports "pid N" (B's host PID) and exits;
- stage B names itself ("testbed-init NODE" in /proc/PID/cmdline, "tb-init"
  as comm), builds the mount namespace (setup_mounts), sets the hostname,
  narrows its capabilities to the worker's set (drop_capabilities), reports
  "ok" (or "error ...") and becomes the init loop (init_loop): it reaps orphans
  and on SIGTERM ends the worker's processes and exits.

The spawner prints "NODE pid N", "NODE ok" and "NODE error ..." lines once
every bootstrap has reported.

The mount namespace: the host's filesystem, rslave; /etc/hosts, /etc/hostname
and /etc/resolv.conf bound from the worker's files; its own /proc and a
read-only /sys; /proc/sys (but /proc/sys/net, the worker's own) and
/proc/sysrq-trigger read-only; the cgroup filesystem read-only; a private
/tmp (and /dev/shm, /dev/mqueue) that still shows the host dirs listed in
"keep"; and over the testbed's state root an empty read-only tmpfs with only
what workers need bound back at the same paths ("state_binds": the runs'
exchange folder, the worker's log and config dirs, MPS dirs), so that nothing
in a worker can read or write the state testbed acts on as root.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

TITLE = "testbed-init"      # argv[0] of the spawner; "testbed-init NODE" for each init
INIT_COMM = "tb-init"       # comm (ps -o comm, top) of an init
SPAWN_COMM = "tb-spawn"     # comm of the spawner

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE, MS_PRIVATE = 32, 4096, 16384, 1 << 19, 1 << 18
MNT_DETACH = 2
NETNS_DIR = "/run/netns"
PR_SET_NAME, PR_CAPBSET_READ, PR_CAPBSET_DROP = 15, 23, 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Capabilities by number (linux/capability.h), named as setpriv(1) names them.
CAP_NAMES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid",
    "setpcap", "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw",
    "ipc_lock", "ipc_owner", "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct",
    "sys_admin", "sys_boot", "sys_nice", "sys_resource", "sys_time", "sys_tty_config", "mknod",
    "lease", "audit_write", "audit_control", "setfcap", "mac_override", "mac_admin", "syslog",
    "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore",
)
# What a worker's processes may keep: Docker's default set. Not net_admin (a job could remove its
# own links' shaping) unless the testbed asks for it; never sys_admin (mount/umount: the hidden
# state dir), sys_module, sys_boot, sys_time, ... Not sys_ptrace either: root in a worker can still
# trace the worker's own processes (same user, no capability they lack: py-spy, gdb work), but not
# a process entering the worker with the host's capabilities in the moment before setpriv drops
# them (sys_ptrace would lift that check).
WORKER_CAPS = (
    "chown", "dac_override", "fsetid", "fowner", "mknod", "net_raw", "setgid", "setuid", "setfcap",
    "setpcap", "net_bind_service", "sys_chroot", "kill", "audit_write",
)

# What an item's "cfg" must hold (parse_items checks it), with the type of each value.
CONFIG_KEYS = {
    "netns": str, "cgroup_procs": list, "hostname": str, "share_ipc": bool, "log": str,
    "grace": (int, float), "keep": list, "binds": list, "caps": list, "state_root": str,
    "state_binds": list,
}


# -- pure helpers (tested in-process) ----------------------------------------------------------------


def worker_caps(net_admin: bool = False) -> list[str]:
    """The capability names a worker keeps: WORKER_CAPS, plus net_admin when asked for."""
    return [*WORKER_CAPS, "net_admin"] if net_admin else list(WORKER_CAPS)


def cap_mask(names: list[str] | tuple[str, ...]) -> int:
    """The bit mask of capability names (as /proc/PID/status shows CapBnd, CapEff)."""
    mask = 0
    for n in names:
        mask |= 1 << CAP_NAMES.index(n)
    return mask


def parse_items(text: str | bytes) -> list[dict]:
    """The spawner's input: a JSON list of {"node", "log", "cfg"}; ValueError (not JSON) or
    TypeError (not that) otherwise."""
    items = json.loads(text)
    if not isinstance(items, list):
        raise TypeError("the batch is not a list")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("node"), str) or not it["node"] \
                or not isinstance(it.get("log"), str) or not isinstance(it.get("cfg"), dict):
            raise TypeError(f"item {i} is not a {{node, log, cfg}} record")
        for key, kind in CONFIG_KEYS.items():
            if not isinstance(it["cfg"].get(key), kind):
                raise TypeError(f"item {i} ({it['node']}): cfg.{key} missing or not a {kind}")
        unknown = [c for c in it["cfg"]["caps"] if c not in CAP_NAMES]
        if unknown:
            raise ValueError(f"item {i} ({it['node']}): unknown capabilities {unknown}")
    return items


def arg_area(stat: str) -> tuple[int, int]:
    """(arg_start, arg_end) from the text of /proc/PID/stat: fields 48 and 49 (proc(5))."""
    fields = stat.rsplit(")", 1)[1].split()    # fields from the 3rd on (the name may hold spaces)
    if len(fields) < 47:
        raise ValueError("/proc/PID/stat has no arg_start/arg_end (kernel < 3.5)")
    start, end = int(fields[45]), int(fields[46])
    if not 0 < start < end:
        raise ValueError(f"no argument area ({start}, {end})")
    return start, end


def title_bytes(title: str, size: int) -> bytes | None:
    """What to write over an argument area of `size` bytes so that /proc/PID/cmdline reads
    "TITLE\\0": the title (cut to fit), a NUL, NUL padding and a last byte that is not NUL (the
    kernel's mark of a rewritten title: it then shows the area up to the first NUL). None if
    the area has no room for even one character."""
    if size < 3:
        return None
    raw = title.encode(errors="replace")[:size - 2]
    return raw + b"\0" * (size - len(raw) - 1) + b" "


def unescape_mountinfo(field: str) -> str:
    r"""A path as /proc/PID/mountinfo writes it (space, tab, newline, backslash as \ooo)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str) -> list[tuple[str, str]]:
    """(mount point, per-mount options) of every line of a mountinfo text, in order."""
    out = []
    for line in mountinfo.splitlines():
        f = line.split()
        if len(f) >= 6:
            out.append((unescape_mountinfo(f[4]), f[5]))
    return out


def kept_flags(opts: str) -> int:
    """The nosuid/nodev/noexec flags of a mount's option string (a read-only remount keeps them)."""
    table = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    flags = 0
    for o in opts.split(","):
        flags |= table.get(o, 0)
    return flags


def is_within(path: str, base: str) -> bool:
    """path is base or lies below it (both normalized, absolute)."""
    path, base = os.path.normpath(path), os.path.normpath(base)
    return path == base or path.startswith(base.rstrip("/") + "/")


# -- system calls -------------------------------------------------------------------------------------

_libc = None


def libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                              ctypes.c_char_p]
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libc = lib
    return _libc


def check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    check(libc().mount(enc(src), enc(dst), enc(fstype), flags, enc(data)),
          f"mount {fstype or src} on {dst}")


def bind(src: str, dst: str, *, read_only: bool = False, recursive: bool = False) -> None:
    """Bind src on dst; read_only: then remount it read-only (keeping nosuid/nodev/noexec)."""
    mount(src, dst, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        remount_read_only(dst)


def remount_read_only(path: str) -> None:
    """Make the mount at `path` read-only (this mount only, not the ones below it)."""
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    st = os.statvfs(path)
    for st_flag, ms_flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        if st.f_flag & st_flag:
            flags |= ms_flag
    mount(None, path, None, flags)


def set_comm(name: str) -> None:
    """The process's comm (what ps -o comm and top show; 15 bytes at most)."""
    buf = ctypes.create_string_buffer(name.encode()[:15])
    libc().prctl(PR_SET_NAME, ctypes.cast(buf, ctypes.c_void_p).value or 0, 0, 0, 0)


def set_title(title: str) -> bool:
    """Make /proc/self/cmdline read `title`, by overwriting the process's original argument area
    (its bounds are in /proc/self/stat) through /proc/self/mem. Best effort: False if it failed.
    The interpreter keeps its own copy of argv, so sys.argv is unchanged."""
    try:
        with open("/proc/self/stat") as f:
            start, end = arg_area(f.read())
        data = title_bytes(title, end - start)
        if data is None:
            return False
        fd = os.open("/proc/self/mem", os.O_RDWR)
        try:
            return os.pwrite(fd, data, start) == len(data)
        finally:
            os.close(fd)
    except (OSError, ValueError, OverflowError):
        return False


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _capget() -> tuple[int, int]:
    """(effective, permitted) of this process."""
    hdr, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    check(libc().capget(ctypes.byref(hdr), data), "capget")
    return (data[0].effective | data[1].effective << 32, data[0].permitted | data[1].permitted << 32)


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return len(CAP_NAMES) - 1


def drop_capabilities(keep: list[str]) -> None:
    """Drop every capability but `keep` from the bounding set (so that no descendant, and nothing
    executed, can have them) and from this process's own sets; empty its inheritable set."""
    want = cap_mask(keep)
    for cap in range(last_cap() + 1):
        if not want >> cap & 1 and libc().prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1:
            check(libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap} from the bounding set")
    eff, perm = _capget()
    hdr, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    for i in (0, 1):
        data[i].effective = (eff & want) >> (32 * i) & 0xFFFFFFFF
        data[i].permitted = (perm & want) >> (32 * i) & 0xFFFFFFFF
        data[i].inheritable = 0
    check(libc().capset(ctypes.byref(hdr), data), "capset")


# -- the worker ------------------------------------------------------------------------------------------


def say(msg: str) -> None:
    os.write(1, (msg + "\n").encode())


def open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def drop_netns_mounts() -> None:
    """Detach our copy of /run/netns and the namespace mounts under it. A worker needs none of
    them, and as a slave of the host's shared /run/netns it would receive every namespace mount
    made after it: each switch of a k=16 fat-tree's was copied into 1,024 workers (50 ms a
    switch), and a copy pins its namespace after `down`."""
    with open("/proc/self/mountinfo") as fh:
        if not any(mp == NETNS_DIR for mp, _opts in mount_points(fh.read())):
            return
    mount(None, NETNS_DIR, None, MS_REC | MS_PRIVATE)   # the detach must not travel back
    check(libc().umount2(NETNS_DIR.encode(), MNT_DETACH), f"umount {NETNS_DIR}")


def setup_mounts(cfg: dict) -> int:
    """Build the worker's mount namespace (see the module's docstring); returns an fd of its init
    log, opened before the state root is hidden. Runs in stage B, after unshare(CLONE_NEWNS)."""
    mount(None, "/", None, MS_REC | MS_SLAVE)
    drop_netns_mounts()
    # what lies in the state dir (maybe under /tmp, in tests) is opened before /tmp is replaced
    # and the state root hidden
    logfd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for src, dst in cfg["binds"]:
        if os.path.isfile(dst):
            mount(src, dst, None, MS_BIND)
    state = [(path, bool(rw), open_dir(path)) for path, rw in sorted(cfg["state_binds"])
             if is_within(path, cfg["state_root"]) and os.path.isdir(path)]
    cg = open_dir("/sys/fs/cgroup") if os.path.isdir("/sys/fs/cgroup") else None

    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # the kernel's knobs are the host's (but /proc/sys/net: the worker's own network namespace)
    bind("/proc/sys", "/proc/sys", recursive=True)
    bind("/proc/sys/net", "/proc/sys/net", recursive=True)
    remount_read_only("/proc/sys")
    if os.path.exists("/proc/sysrq-trigger"):
        bind("/proc/sysrq-trigger", "/proc/sysrq-trigger", read_only=True)
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    if cg is not None:
        try:
            mount(f"/proc/self/fd/{cg}", "/sys/fs/cgroup", None, MS_BIND | MS_REC)
        except OSError:
            pass
        os.close(cg)
        # read-only inside the worker: a job must not lift its own limits (or anyone's); joining
        # the worker's group happens from the host, before a process enters (exec_argv)
        with open("/proc/self/mountinfo") as fh:
            points = mount_points(fh.read())
        for mp, opts in points:
            if is_within(mp, "/sys/fs/cgroup"):
                mount(None, mp, None, MS_BIND | MS_REMOUNT | MS_RDONLY | kept_flags(opts))

    # host dirs the worker must keep seeing though they are under /tmp (the project, a test's tmp)
    keep = [(k, open_dir(k)) for k in cfg["keep"] if k.startswith("/tmp/") and os.path.isdir(k)]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for k, kfd in keep:
        os.makedirs(k, exist_ok=True)
        mount(f"/proc/self/fd/{kfd}", k, None, MS_BIND | MS_REC)
        os.close(kfd)

    hide_state_root(cfg["state_root"], state)

    if not cfg["share_ipc"]:
        if os.path.isdir("/dev/shm"):
            mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        if os.path.isdir("/dev/mqueue"):
            try:
                mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass
    return logfd


def hide_state_root(root: str, binds: list[tuple[str, bool, int]]) -> None:
    """Cover the state root with an empty tmpfs, bind back `binds` ((path, writable, fd of the
    host dir)) at their paths, and make the tmpfs read-only: the rest of the state is neither
    visible nor writable (a write there fails instead of vanishing). After /tmp is replaced: the
    root may lie under it. Closes the fds."""
    if os.path.normpath(root) == "/":
        raise ValueError("the state root is /: it cannot be hidden")
    try:
        os.makedirs(root, mode=0o755, exist_ok=True)
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755")
        for path, _rw, _fd in binds:
            os.makedirs(path, mode=0o755, exist_ok=True)
        for path, rw, fd in binds:
            bind(f"/proc/self/fd/{fd}", path, read_only=not rw, recursive=True)
        remount_read_only(root)
    finally:
        for _path, _rw, fd in binds:
            os.close(fd)


def bootstrap(cfg: dict, title: str) -> None:
    """Stage A (see the module's docstring). In the caller: reports and exits; never returns."""
    try:
        for f in cfg["cgroup_procs"]:
            with open(f, "w") as fh:
                fh.write(str(os.getpid()))
        fd = cfg.get("netns_fd")   # opened by the spawner before it shed /run/netns
        if fd is None:
            fd = os.open(cfg["netns"], os.O_RDONLY)
        check(libc().setns(fd, CLONE_NEWNET), "setns " + cfg["netns"])
        os.close(fd)
        check(libc().unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWPID | (0 if cfg["share_ipc"] else CLONE_NEWIPC)),
              "unshare")
        pid = os.fork()
    except Exception as exc:  # noqa: BLE001 - whatever failed is reported, then this process ends
        say(f"error {exc}")
        os._exit(1)
    if pid:
        say(f"pid {pid}")
        os._exit(0)
    stage_b(cfg, title)


def stage_b(cfg: dict, title: str) -> None:
    """PID 1 of the worker: set it up, report, run the init loop; never returns."""
    try:
        set_comm(INIT_COMM)
        set_title(title)
        os.setsid()
        os.umask(0o022)
        logfd = setup_mounts(cfg)
        host = cfg["hostname"].encode()
        check(libc().sethostname(host, len(host)), "sethostname")
        try:    # the OOM killer of a worker's memory cgroup must pick its hog, not its init
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("-1000")
        except OSError:
            pass    # no CAP_SYS_RESOURCE (a container): the init is small and rarely picked
        os.chdir("/")
        # last: the init needs none of the rest, and keeping more than its processes get would
        # make it worth attacking
        drop_capabilities(cfg["caps"])
    except Exception as exc:  # noqa: BLE001 - whatever failed is reported, then this process ends
        say(f"error {exc}")
        os._exit(1)
    say("ok")
    nul = os.open("/dev/null", os.O_RDONLY)
    os.dup2(nul, 0)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    os.close(logfd)
    os.close(nul)
    init_loop(float(cfg["grace"]))


def reap() -> None:
    """Collect every child that has exited (orphans of the worker included)."""
    while True:
        try:
            p, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if p == 0:
            return


def _others() -> bool:
    try:
        os.kill(-1, 0)
        return True
    except ProcessLookupError:
        return False


def init_loop(grace: float) -> None:
    """Reap orphans until SIGTERM/SIGINT, then end every process of the PID namespace (SIGTERM,
    `grace` seconds, SIGKILL) and exit. Only as PID 1 of a PID namespace (kill(-1) must not reach
    the host's processes)."""
    if os.getpid() != 1:
        raise RuntimeError("the init loop runs only as PID 1 of its own PID namespace")
    sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    while True:
        s = signal.sigwait(sigs)
        if s == signal.SIGCHLD:
            reap()
        elif s in (signal.SIGTERM, signal.SIGINT):
            break
    try:
        os.kill(-1, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap()
        if not _others():
            break
        time.sleep(0.01)
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os._exit(0)


# -- the spawner ---------------------------------------------------------------------------------------


def shed_netns_mounts(items: list[dict]) -> dict[str, int]:
    """Open every worker's network namespace, then move this spawner into a mount namespace of its
    own without /run/netns: each worker's unshare(CLONE_NEWNS) copies the spawner's mount tree, and
    with the host's it would copy a mount per namespace (1,344 at k=16, into each of 1,024 workers).
    Mounts stay slaves of the host's (a worker's slaves pass to the host's when the spawner's
    namespace goes). Returns node -> namespace fd; {} (and nothing shed) if that cannot be done."""
    fds: dict[str, int] = {}
    try:
        for it in items:
            fds[it["node"]] = os.open(it["cfg"]["netns"], os.O_RDONLY | os.O_CLOEXEC)
        check(libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    except OSError:
        for fd in fds.values():
            os.close(fd)
        return {}
    mount(None, "/", None, MS_REC | MS_SLAVE)
    drop_netns_mounts()
    return fds


def spawn(items: list[dict], start=bootstrap, netns_fds: dict[str, int] | None = None) -> list[str]:
    """Fork start(cfg, title) for every item, its stdout a pipe and its stderr the item's log;
    return what each reported, as "NODE LINE" lines in the items' order. netns_fds: each node's
    network namespace, already open (a worker keeps only its own)."""
    netns_fds = netns_fds or {}
    pipes: list[tuple[str, int, int]] = []
    for it in items:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                for _, rr, _ in pipes:
                    os.close(rr)
                for node, fd in netns_fds.items():   # another worker's would pin its namespace
                    if node == it["node"]:
                        it["cfg"]["netns_fd"] = fd
                    else:
                        os.close(fd)
                os.setsid()
                os.dup2(w, 1)
                os.close(w)
                log = os.open(it["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log, 2)
                os.close(log)
                start(it["cfg"], f"{TITLE} {it['node']}")
            finally:
                os._exit(1)
        os.close(w)
        pipes.append((it["node"], r, pid))
    out: list[str] = []
    for node, r, pid in pipes:
        chunks = []
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        out += [f"{node} {line}" for line in b"".join(chunks).decode(errors="replace").splitlines()]
    return out


def main(argv: list[str]) -> int:
    """`spawn`: read the batch on stdin, start it, print the reports (see the module's docstring)."""
    if argv != ["spawn"]:
        sys.stderr.write(f"usage: {TITLE} -S -P {os.path.abspath(__file__)} spawn < BATCH.json\n")
        return 2
    set_comm(SPAWN_COMM)
    try:
        items = parse_items(sys.stdin.buffer.read())
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"{TITLE}: bad batch: {exc}\n")
        return 2
    lines = spawn(items, netns_fds=shed_netns_mounts(items))
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
