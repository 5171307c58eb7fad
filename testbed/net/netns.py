"""Network namespace helpers: create, delete, enter, list; fast.

Namespaces are made the way iproute2 makes them (a bind mount of the
namespace on /run/netns/NAME, /run/netns itself a shared mount point) but
without a subprocess per namespace: the calling thread unshare()s a fresh
network namespace, bind-mounts it and setns()es back. Work inside a namespace
(sysctls through /proc/sys/net, one IPRoute socket bound to it) happens after
`enter()`; netlink sockets stay bound to the namespace they were opened in.

Network namespaces are per thread, so entering one changes only the calling
thread; `enter()` always returns to the namespace the thread came from.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from testbed import procs

T = TypeVar("T")

NETNS_RUN_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_lock = threading.Lock()
_run_dir_ready = False


class NetnsError(OSError):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise NetnsError(e, f"{what}: {os.strerror(e)}")


def setns(fd: int) -> None:
    _check(_libc.setns(fd, CLONE_NEWNET), "setns")


def path(name: str) -> Path:
    return NETNS_RUN_DIR / name


def exists(name: str) -> bool:
    return os.path.exists(f"{NETNS_RUN_DIR}/{name}")   # (not Path: `status` asks for each of k=16's 1,344)


def list_names(prefix: str = "") -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_RUN_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def _ensure_run_dir() -> None:
    """Make /run/netns a shared mount point, as `ip netns add` does.

    Shared propagation means a later umount reaches copies of the mount in other
    mount namespaces (containers started with unshare --mount), so a deleted
    namespace really goes away.
    """
    global _run_dir_ready
    if _run_dir_ready:
        return
    NETNS_RUN_DIR.mkdir(parents=True, exist_ok=True)
    d = str(NETNS_RUN_DIR).encode()
    if _libc.mount(b"none", d, None, MS_SHARED | MS_REC, None) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # not a mount point yet: bind it onto itself
            _check(_libc.mount(d, d, b"none", MS_BIND | MS_REC, None), "mount --bind /run/netns")
            _check(_libc.mount(b"none", d, None, MS_SHARED | MS_REC, None), "mount --make-shared /run/netns")
        else:
            _check(-1, "mount --make-shared /run/netns")
    _run_dir_ready = True


def _self_ns_path() -> str:
    return f"/proc/self/task/{threading.get_native_id()}/ns/net"


@contextlib.contextmanager
def enter(name: str | int) -> Iterator[None]:
    """Run the block with the calling thread inside namespace `name` (or an open fd)."""
    home = os.open(_self_ns_path(), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if isinstance(name, int):
            setns(name)
        else:
            fd = os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns(fd)
            finally:
                os.close(fd)
        try:
            yield
        finally:
            setns(home)
    finally:
        os.close(home)


def run_in_netns(ns: str | None, fn: Callable[[], T]) -> T:
    """Run fn() in a short-lived thread that has entered network namespace `ns`.

    setns(2) acts on the calling thread only, so the caller's own namespace is
    never changed (the builder may itself be sitting in a node's namespace).
    Sockets and TUN devices opened by fn belong to `ns`. ns None: fn runs in
    whatever namespace a fresh thread inherits (the process's).
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            if ns is not None:
                fd = os.open(path(ns), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    setns(fd)
                finally:
                    os.close(fd)
            result["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            result["error"] = exc

    t = threading.Thread(target=target, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class Home:
    """The namespace this thread started in, to return to cheaply between many enters."""

    def __init__(self) -> None:
        self.fd = os.open(_self_ns_path(), os.O_RDONLY | os.O_CLOEXEC)

    def back(self) -> None:
        setns(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Home":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.back()
        finally:
            self.close()


def create(name: str, sysctls: dict[str, str] | None = None, home: Home | None = None) -> None:
    """Create namespace `name`; with `sysctls` ({"net/ipv4/ip_forward": "1"}), set them inside it.

    Refuses (FileExistsError) a name that exists: we never adopt someone else's namespace.
    """
    _ensure_run_dir()
    target = path(name)
    fd = os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    os.close(fd)
    own_home = home is None
    h = home or Home()
    try:
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            try:
                _check(_libc.mount(_self_ns_path().encode(), str(target).encode(), b"none", MS_BIND, None),
                       f"mount --bind {target}")
                if sysctls:
                    write_sysctls(sysctls)
            finally:
                h.back()
        except BaseException:
            _libc.umount2(str(target).encode(), MNT_DETACH)
            with contextlib.suppress(OSError):
                target.unlink()
            raise
    finally:
        if own_home:
            h.close()


def write_sysctls(sysctls: dict[str, str]) -> None:
    """Write sysctls of the namespace the calling thread is in (keys relative to /proc/sys)."""
    for key, value in sysctls.items():   # (os-level: Python's file objects cost 3x, ~1,500 writes at k=8)
        fd = os.open(f"/proc/sys/{key}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)


def read_sysctl(key: str) -> str:
    with open(f"/proc/sys/{key}") as f:
        return f.read().strip()


def delete(name: str) -> bool:
    """Remove namespace `name` (idempotent). The kernel frees it once no process is left in it."""
    target = path(name)
    rc = _libc.umount2(str(target).encode(), MNT_DETACH)
    if rc != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        _check(rc, f"umount {target}")
    try:
        target.unlink()
    except FileNotFoundError:
        return rc == 0
    return True


def inode(name: str) -> int | None:
    try:
        return os.stat(path(name)).st_ino
    except OSError:
        return None


def pids_in(names: list[str]) -> dict[int, str]:
    """PIDs of processes (host view) whose network namespace is one of `names` -> that name."""
    inodes = {}
    for n in names:
        ino = inode(n)
        if ino is not None:
            inodes[ino] = n
    return {pid: inodes[ino] for pid, ino in procs.pids_in_ns("net", inodes, include_self=False).items()}
