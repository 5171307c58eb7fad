"""The emulated hosts' processes: which are provably ours, and starting, signalling and reaping them.

A process is ours when it sees our marker file (/run/.testbed-emulated-host, in a host's private
/run: the record's token and the host's name), or when it lives in one of our hosts' network
namespaces (a chrooted process, such as sshd's pre-authentication child, cannot see the marker).
Never by its name. Signals go through testbed.procs, by (PID, start).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from testbed import procs
from testbed.cluster.emulate_record import MARKER, EmulatedRecord
from testbed.cluster.emulate_underlay import link_alias
from testbed.net import netns

CHILDREN: dict[int, subprocess.Popen] = {}   # processes this process started: reaped when they end


def marker_of(pid: int) -> str | None:
    """What /run/.testbed-emulated-host says in the mount namespace of `pid` (None: no such file)."""
    try:
        with open(f"/proc/{pid}/root{MARKER}") as fh:
            return fh.read(200)
    except OSError:
        return None


def marked(pid: int, token: str, host: str) -> bool:
    """`pid` sees the marker of host `host` of the record with `token`."""
    return (marker_of(pid) or "").split()[:2] == [token, host]


def our_netns_inodes(emu: EmulatedRecord, host: str | None = None) -> set[int]:
    """Inodes of our hosts' network namespaces (of `host` only, if given) that are still named in
    /run/netns and carry our alias: while named there, the namespace lives and its inode is its own."""
    out = set()
    for h in emu.hosts:
        if host is not None and h.name != host:
            continue
        ino = netns.inode(h.netns)
        if ino is not None and link_alias("lo", h.netns) == emu.alias:
            out.add(ino)
    return out


def our_pids(token: str, host: str | None = None, netns_inodes: set[int] = frozenset()) -> list[int]:
    """Processes proven ours: they see our marker (of `host`, or of any of our hosts), or they are in
    one of `netns_inodes` (see the module's docstring)."""
    out = []
    for pid in procs.pids(include_self=False):
        words = (marker_of(pid) or "").split()
        mark = bool(words) and words[0] == token and (host is None or words[1:2] == [host])
        if mark or (netns_inodes and procs.ns_inode(pid, "net") in netns_inodes):
            out.append(pid)
    return out


def exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def reap(pid: int, wait_s: float = 0.0) -> bool:
    """Collect `pid` if it is our child and has ended (waiting up to wait_s); True when it is gone."""
    proc = CHILDREN.get(pid)
    if proc is not None:
        try:
            proc.wait(timeout=wait_s if wait_s > 0 else 0.001)
        except subprocess.TimeoutExpired:
            return False
        CHILDREN.pop(pid, None)
        return True
    end = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:   # not our child: whoever is its parent reaps it
            return procs.start_ticks(pid) is None   # gone, or a zombie
        if done:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def send(refs: list[procs.ProcRef], sig: int) -> None:
    """`sig` to each process that is still the one found (a PID reused since is left alone)."""
    for r in refs:
        procs.signal_ref(r, sig)


def refs(pids: list[int]) -> list[procs.ProcRef]:
    """The processes `pids` that are alive now, by (PID, start)."""
    return [r for r in map(procs.ref, pids) if r is not None]


def spawn(argv: list[str], log: Path, **kw: Any) -> subprocess.Popen:
    """Start a long-lived process in its own session (it outlives this one), output to `log`."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=kw.pop("stdout", fh), stderr=fh,
                                start_new_session=True, close_fds=True, **kw)
    CHILDREN[proc.pid] = proc
    return proc


def log_tail(path: Path, n: int = 5) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


def kill_ours(emu: EmulatedRecord, problems: list[str], timeout: float = 10.0) -> None:
    """SIGKILL every process proven ours (our_pids), until none is left."""
    end = time.monotonic() + timeout
    inodes = our_netns_inodes(emu)
    while True:
        found = refs(our_pids(emu.token, netns_inodes=inodes))
        if not found:
            break
        if time.monotonic() >= end:
            problems.append(f"processes still running after {timeout:g} s: "
                            f"{', '.join(str(r.pid) for r in found[:20])}")
            break
        send(found, signal.SIGKILL)
        for r in found:
            reap(r.pid, 0.5)
    for pid, proc in list(CHILDREN.items()):   # our children that ended already (sshd stopped earlier)
        if proc.poll() is not None:
            CHILDREN.pop(pid, None)
