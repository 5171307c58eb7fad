"""What makes an emulated host reachable: its holder (the process that keeps its namespaces) and its sshd.

The holder runs testbed/cluster/hostside/emulated_holder.sh in the host's network namespace and new
mount and UTS namespaces; sshd (Debian's /usr/sbin/sshd, our configuration under DIR/hN/) is
started inside the holder's namespaces, and may be stopped and started again (the host becomes
unreachable, then reachable) while the holder keeps the host alive.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from testbed import procs
from testbed.cluster import hostside
from testbed.cluster.emulate_processes import (exe, log_tail, marked, our_netns_inodes, our_pids, reap, refs, send,
                                               spawn)
from testbed.cluster.emulate_record import HOST_DOCKER_SOCKET, LOGIN_HOMES, EmulatedHost, EmulatedRecord
from testbed.errors import StateError, TestbedError

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
READY_TIMEOUT_S = 15.0
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"   # the holder's and sshd's PATH: their environment is given, not inherited

# The holder's program (what it is given, what it does): testbed/cluster/hostside/emulated_holder.sh.
_HOLDER_SCRIPT = hostside.text("emulated_holder.sh")


def run(argv: list[str], what: str | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """argv run to its end; TestbedError with the last line it said when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise TestbedError(f"{what or ' '.join(argv)}: {why[-1] if why else f'exit status {proc.returncode}'}")
    return proc


def keygen(path: Path, comment: str) -> None:
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], "ssh-keygen")


def start_holder(emu: EmulatedRecord, h: EmulatedHost) -> None:
    """The process that keeps the host's mount and UTS namespaces (and its /run) alive."""
    log = h.path / "holder.log"
    env = {"PATH": _PATH, "TB_HOST": h.name, "TB_MARK": f"{emu.token} {h.name}"}
    if emu.login_user:
        env.update(TB_ETC=str(h.path / "etc"), TB_HOME=str(h.path / "home"), TB_HOMES=LOGIN_HOMES)
    if emu.docker_socket:
        stage = h.path / "docker.sock"
        stage.touch(mode=0o600)
        env.update(TB_DOCKER=emu.docker_socket, TB_DOCKER_STAGE=str(stage), TB_DOCKER_AT=HOST_DOCKER_SOCKET)
    proc = spawn(["nsenter", f"--net=/run/netns/{h.netns}", "--", "unshare", "--mount", "--uts",
                  "--propagation", "private", "--", "/bin/sh", "-c", _HOLDER_SCRIPT], log,
                 stdout=subprocess.PIPE, env=env)
    h.holder_pid = proc.pid
    emu.save()
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if line.strip() != b"ready":
        reap(proc.pid, 2.0)
        raise TestbedError(f"emulated host {h.name}: its namespaces could not be set up: {log_tail(log)}")


def _sshd_config(emu: EmulatedRecord, h: EmulatedHost) -> Path:
    d = h.path
    text = f"""# sshd of emulated host {h.name} ({emu.alias}); made by testbed.cluster.emulate
ListenAddress {h.address}:{SSH_PORT}
HostKey {d / 'ssh_host_ed25519_key'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {emu.authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
HostbasedAuthentication no
# PAM as Debian's own sshd: without it sshd refuses root outright where root's password is locked
# ("!" in /etc/shadow, as in the stock-kernel VM), whatever the key
UsePAM yes
# DIR may lie under /tmp (world-writable): StrictModes would refuse our authorized_keys there
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
PermitUserEnvironment no
MaxSessions 64
MaxStartups 64:30:128
LoginGraceTime 30
LogLevel INFO
Subsystem sftp internal-sftp
"""
    if emu.login_user:
        # sshd reads a user's keys as that user, who cannot reach DIR (root's): its own copy, in its home
        text += (f"# the login user's keys: a copy in its home (sshd reads them as the user)\n"
                 f"Match User {emu.login_user}\n"
                 f"    AuthorizedKeysFile {emu.login_home}/.ssh/authorized_keys\n")
    path = d / "sshd_config"
    path.write_text(text)
    return path


def _sshd_alive(emu: EmulatedRecord, h: EmulatedHost) -> bool:
    pid = h.sshd_pid
    return (pid is not None and exe(pid) == SSHD and procs.start_ticks(pid) is not None
            and marked(pid, emu.token, h.name))


def _wait_listening(address: str, pid: int, log: Path, name: str, timeout: float = READY_TIMEOUT_S) -> None:
    end = time.monotonic() + timeout
    while True:
        if procs.start_ticks(pid) is None:   # gone, or a zombie
            reap(pid)
            raise TestbedError(f"emulated host {name}: sshd exited at start: {log_tail(log)}")
        try:
            with socket.create_connection((address, SSH_PORT), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() >= end:
            raise TestbedError(f"emulated host {name}: sshd does not accept connections at {address}:{SSH_PORT} "
                               f"after {timeout:g} s: {log_tail(log)}")
        time.sleep(0.05)


def start_sshd(emu: EmulatedRecord, name: str) -> None:
    """Start host `name`'s sshd (again) inside its namespaces; returns once it accepts connections."""
    h = emu.host(name)
    if _sshd_alive(emu, h):
        return
    if h.holder_pid is None or not marked(h.holder_pid, emu.token, h.name):
        raise StateError(f"emulated host {name} is gone (its namespaces' holder process is not running)")
    config = _sshd_config(emu, h)
    enter = ["nsenter", f"--target={h.holder_pid}", "--net", "--mount", "--uts", "--"]
    env = {"PATH": _PATH}
    run([*enter, SSHD, "-t", "-f", str(config)], f"emulated host {name}: sshd -t (config check)", env=env)
    log = h.path / "sshd.log"
    # nsenter without --pid execs sshd itself: the PID is sshd's
    proc = spawn([*enter, SSHD, "-D", "-e", "-f", str(config)], log, env=env)
    h.sshd_pid = proc.pid
    emu.save()
    _wait_listening(h.address, proc.pid, log, name)


def stop_sshd(emu: EmulatedRecord, name: str, *, sessions: bool = True) -> None:
    """Stop host `name`'s sshd, so that it becomes unreachable over SSH; sessions=True also ends
    the SSH sessions open on it (an open connection then fails too, as if the host went away).
    What runs on the host otherwise keeps running; start_sshd brings it back."""
    h = emu.host(name)
    found = refs([p for p in our_pids(emu.token, h.name, our_netns_inodes(emu, h.name)) if exe(p) == SSHD])
    listener = [r for r in found if r.pid == h.sshd_pid]
    targets = listener + ([r for r in found if r.pid != h.sshd_pid] if sessions else [])
    send(targets, signal.SIGTERM)
    end = time.monotonic() + 3.0
    left = targets
    while left and time.monotonic() < end:
        left = [r for r in left if not reap(r.pid)]
        if left:
            time.sleep(0.02)
    send(left, signal.SIGKILL)
    for r in left:
        reap(r.pid, 2.0)
    h.sshd_pid = None
    emu.save()
