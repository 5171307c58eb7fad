"""Several hosts made out of this machine, reached over SSH exactly as real ones (CI, and users without servers).

    python -m testbed.cluster.emulate up --hosts 2 --dir DIR [--underlay-mtu 9000] [--cores 2]
        [--login-user NAME [--sudo nopasswd|none] [--sudo HOST=none]] [--docker-socket PATH]
    python -m testbed.cluster.emulate down --dir DIR
    python -m testbed.cluster.emulate stop-sshd --dir DIR h1      # h1 becomes unreachable
    python -m testbed.cluster.emulate start-sshd --dir DIR h1

or create(n, workdir) -> Emulated, destroy(workdir), and emulated(n, workdir) as a context manager
(a pytest fixture: ``with emulated(2, tmp_path) as emu: yield emu``). Needs root, iproute2,
util-linux (unshare, nsenter) and openssh-server (/usr/sbin/sshd; no system sshd needs to run);
sudo for a login user who may use it.

Each emulated host hN (N = 1..n) is:

- a network namespace tbh<id>-hN (id: 6 random hex digits, kept in DIR) with lo and eth0, its
  underlay interface;
- a mount namespace with a private tmpfs on /run (so /run/netns, /run/testbed and /run/sshd are
  its own: namespaces and testbeds made on one host are invisible to the others and to this
  machine, and vanish with the host) and a UTS namespace (hostname = hN). A holder process
  (`sleep infinity`) keeps these namespaces alive while sshd is stopped;
- its own sshd (Debian's /usr/sbin/sshd -D -e, our config under DIR/hN/: ListenAddress = its
  underlay address, its own host key, keys only, root login with a key, PAM as Debian configures it) running in those
  namespaces, so every command that arrives over SSH lands inside the host.

The underlay is a bridge in a namespace of its own (tbh<id>-u) joining each host's eth0
(198.18.X.N/24, X from the id: parallel instances differ; MTU 9000 by default so a VXLAN tunnel
carrying 1500-byte frames fits) and a veth from this machine's root namespace (tbh<id>c,
198.18.X.254): the controller, an ordinary process here, reaches each host's sshd at its underlay
address as it would a real host. Only addresses inside namespaces made here are ever contacted.

DIR holds the client key (id_ed25519, one for all hosts, authorised on each), known_hosts (each
host's key at its underlay address), hosts.yaml (a valid hosts file: ssh root@ADDR, that key, the
underlay address, capacity cores, and `testbed:` where the hosts schema has it) and emulated.json
(everything destroy needs, and "testbed": the command that runs testbed on a host: this checkout's
venv, by absolute path, as the hosts share its filesystem).

A login user (create(login_user=NAME), --login-user NAME): hosts.yaml logs in as NAME@ADDR, and
testbed runs commands as root through `sudo -n` (testbed/cluster/remote.py). NAME exists on the
hosts only, never in this machine's /etc: the holder binds, in the host's mount namespace, its
own copies of /etc/passwd, /etc/group and /etc/shadow (this machine's, plus NAME with a uid (= gid)
free here and the password "*": no password, not locked), of /etc/hosts (plus "127.0.1.1 hN":
sudo resolves the host's name) and of /etc/sudoers.d (this machine's, plus "NAME ALL=(ALL)
NOPASSWD: ALL" where sudo is "nopasswd"; "none": no rule, so sudo -n refuses), all kept in DIR/hN/etc.
Its home is DIR/hN/home/NAME, bound on the host's /run/home (NAME could not reach it under DIR,
which is root's), with a copy of the client key: sshd reads a user's keys as that user.

A shared Docker daemon (create(docker_socket=PATH), --docker-socket PATH, e.g. scripts/dockerd.sh's
socket): the holder binds PATH on the host's /run/docker.sock, where the Docker SDK and CLI look
by default (sshd and sudo pass no DOCKER_HOST), so the hosts' Docker workers are containers of
this machine's daemon. That daemon resolves the containers' bind mounts in this machine's
filesystem, where a host's /run is not, and each host's testbed labels its containers with its
state root: so each host keeps its testbed state in DIR/hN/state (TESTBED_STATE_DIR, set by the
`testbed:` command of hosts.yaml), not in its /run/testbed, and the hosts' containers stay apart.
The hosts keep the socket they were made with: a daemon started again afterwards is not theirs.

Shared among the emulated hosts and this machine, unlike real hosts: the kernel (modules,
sysctls outside net.*, limits, time), /sys (so /sys/class/net lists this machine's interfaces, not
the host's; `ip netns exec` remounts it per namespace as usual) and the cgroup filesystem (a
host's cgroups are the machine's), /proc/sys outside net, the PID space (ps on a host shows every
process of the machine), /dev (and /dev/shm), and the whole filesystem outside /run: /tmp, /var,
/etc (but for a login user's files above), this checkout, and a Docker daemon given to them.
Private to each: its network stack (interfaces, addresses, routes, firewall, net.* sysctls), /run,
its hostname, its sshd.

Ownership is provable: every namespace's lo and the root-side veth carry the alias
"testbed-emulated <token>" (a random token kept in DIR), and every process of a host sees the
file /run/.testbed-emulated-host holding that token and the host's name, which no process outside
the hosts can see (it lives in their private /run). destroy ends exactly the processes that see it
(sshd, the holder, anything started over SSH, workers that kept the host's /run), then removes the
containers on a shared Docker daemon labelled with one of the hosts' state roots (under DIR), the
namespaces and the veth it can prove are ours, then our files: never anything else, and never by
process name. The binds a host's holder made vanish with its mount namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import ipaddress
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed import procs
from testbed.cluster import hostside
from testbed.errors import CapabilityError, StateError, TestbedError

__all__ = ["Emulated", "EmulatedHost", "create", "destroy", "emulated", "load", "main", "start_sshd", "stop_sshd"]

PREFIX = "tbh"
STATE_FILE = "emulated.json"
MARKER = "/run/.testbed-emulated-host"
SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
UNDERLAY = ipaddress.ip_network("198.18.0.0/15")   # RFC 2544 benchmarking space: 512 /24s
CONTROLLER_HOST = 254
DEFAULT_MTU = 9000
DEFAULT_CORES = 2
READY_TIMEOUT_S = 15.0
LOCK_DIR = "/run/lock"   # flocked while an instance picks its /24 and builds
_UNSAFE = set(" \t\n\"'%\\#")   # characters a path must not have in an sshd_config line
SUDO_MODES = ("nopasswd", "none")
LOGIN_UIDS = range(50000, 60000)   # the login user's uid (= gid): the first free on this machine
LOGIN_HOMES = "/run/home"          # in each host: its DIR/hN/home, where the login user's home is
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
HOST_DOCKER_SOCKET = "/run/docker.sock"   # in each host: the Docker SDK's default, /var/run/docker.sock

_CHILDREN: dict[int, subprocess.Popen] = {}   # processes this process started: reaped when they end


# -- records ----------------------------------------------------------------------------------------------


@dataclass
class EmulatedHost:
    name: str
    address: str
    netns: str
    dir: str
    holder_pid: int | None = None
    sshd_pid: int | None = None
    sudo: str | None = None          # with a login user: "nopasswd" (it may sudo -n anything) or "none"

    @property
    def path(self) -> Path:
        return Path(self.dir)


@dataclass
class Emulated:
    """A set of emulated hosts (see the module's docstring), as recorded in DIR/emulated.json."""

    workdir: str
    id: str
    token: str
    subnet: str
    mtu: int
    cores: int
    testbed: list[str]
    hosts: list[EmulatedHost] = field(default_factory=list)
    made_workdir: bool = False
    login_user: str | None = None    # hosts.yaml logs in as this user (None: root), uid = gid = login_uid
    login_uid: int | None = None
    docker_socket: str | None = None   # this machine's Docker daemon socket, seen by each host at /run/docker.sock

    # -- names and paths

    @property
    def dir(self) -> Path:
        return Path(self.workdir)

    @property
    def alias(self) -> str:
        return f"testbed-emulated {self.token}"

    @property
    def underlay_netns(self) -> str:
        return f"{PREFIX}{self.id}-u"

    @property
    def root_veth(self) -> str:
        return f"{PREFIX}{self.id}c"

    @property
    def controller_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[CONTROLLER_HOST])

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def hosts_file(self) -> Path:
        return self.dir / "hosts.yaml"

    @property
    def authorized_keys(self) -> Path:
        return self.dir / "authorized_keys"

    @property
    def login(self) -> str:
        """Who hosts.yaml logs in as."""
        return self.login_user or "root"

    @property
    def login_home(self) -> str:
        """The login user's home directory, as a host sees it."""
        return f"{LOGIN_HOMES}/{self.login_user}"

    def state_root(self, h: EmulatedHost) -> str | None:
        """Where testbed keeps its state on host `h`: None for its own /run/testbed, else (with a
        shared Docker daemon) a directory under its DIR (see the module's docstring)."""
        return str(h.path / "state") if self.docker_socket else None

    def host(self, name: str) -> EmulatedHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no emulated host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    # -- use

    def load_hosts(self) -> Any:
        """DIR/hosts.yaml, validated (testbed.cluster.hosts.Hosts)."""
        from testbed.cluster.hosts import load_hosts

        return load_hosts(self.hosts_file)

    def controls(self, **kw: Any) -> list[Any]:
        """An SshHost per host, checking host keys against DIR/known_hosts (kw: SshHost's options)."""
        from testbed.cluster.remote import SshHost

        kw.setdefault("known_hosts", self.known_hosts)
        return [SshHost(h, **kw) for h in self.load_hosts()]

    def stop_sshd(self, name: str) -> None:
        stop_sshd(self, name)

    def start_sshd(self, name: str) -> None:
        start_sshd(self, name)

    def destroy(self) -> None:
        destroy(self.dir)

    # -- the record

    def save(self) -> None:
        path = self.dir / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Emulated:
        hosts = [EmulatedHost(**h) for h in data.pop("hosts", [])]
        return cls(**data, hosts=hosts)


def load(workdir: str | Path) -> Emulated | None:
    """The emulated hosts recorded in `workdir`, or None when there are none."""
    path = Path(workdir) / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable ({exc})") from None
    return Emulated.from_json(data)


# -- small tools ------------------------------------------------------------------------------------------


def _run(argv: list[str], what: str | None = None, **kw: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise TestbedError(f"{what or ' '.join(argv)}: {why[-1] if why else f'exit status {proc.returncode}'}")
    return proc


def _ip(*args: str, ns: str | None = None) -> str:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return _run(argv).stdout


def _netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def _link_alias(dev: str, ns: str | None = None) -> str | None:
    """The alias of `dev` ("" when it has none), None when there is no such device."""
    argv = ["ip", *(["-n", ns] if ns else []), "-j", "link", "show", "dev", dev]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return None
    try:
        links = json.loads(proc.stdout or "[]")
    except ValueError:
        return None
    return (links[0].get("ifalias") or "") if links else None


def _marker_of(pid: int) -> str | None:
    """What /run/.testbed-emulated-host says in the mount namespace of `pid` (None: no such file)."""
    try:
        with open(f"/proc/{pid}/root{MARKER}") as fh:
            return fh.read(200)
    except OSError:
        return None


def _ns_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of a namespace file: equal for two paths exactly when it is the same namespace."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _our_netns_inodes(emu: Emulated, host: str | None = None) -> set[tuple[int, int]]:
    """Inodes of our hosts' network namespaces (of `host` only, if given) that are still named in
    /run/netns and carry our alias: while named there, the namespace lives and its inode is its own."""
    out = set()
    for h in emu.hosts:
        if host is not None and h.name != host:
            continue
        ino = _ns_id(f"/run/netns/{h.netns}")
        if ino is not None and _link_alias("lo", h.netns) == emu.alias:
            out.add(ino)
    return out


def _our_pids(token: str, host: str | None = None,
              netns_inodes: set[tuple[int, int]] = frozenset()) -> list[int]:
    """Processes proven ours: they see our marker (of `host`, or of any of our hosts), or they are in
    one of `netns_inodes` (a chrooted process, such as sshd's pre-authentication child, cannot see
    the marker: it is found by its network namespace)."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        words = (_marker_of(pid) or "").split()
        marked = bool(words) and words[0] == token and (host is None or words[1:2] == [host])
        if marked or (netns_inodes and _ns_id(f"/proc/{pid}/ns/net") in netns_inodes):
            out.append(pid)
    return out


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _reap(pid: int, wait_s: float = 0.0) -> bool:
    """Collect `pid` if it is our child and has ended (waiting up to wait_s); True when it is gone."""
    proc = _CHILDREN.get(pid)
    if proc is not None:
        try:
            proc.wait(timeout=wait_s if wait_s > 0 else 0.001)
        except subprocess.TimeoutExpired:
            return False
        _CHILDREN.pop(pid, None)
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


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _spawn(argv: list[str], log: Path, **kw: Any) -> subprocess.Popen:
    """Start a long-lived process in its own session (it outlives this one), output to `log`."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=kw.pop("stdout", fh), stderr=fh,
                                start_new_session=True, close_fds=True, **kw)
    _CHILDREN[proc.pid] = proc
    return proc


def _log_tail(path: Path, n: int = 5) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


# -- pieces -----------------------------------------------------------------------------------------------


def _pick_subnet(tries: int = 64) -> tuple[str, ipaddress.IPv4Network]:
    """A fresh id and its /24 of the underlay space, overlapping no route or address here."""
    used: list[Any] = []
    proc = subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                          check=False)
    for r in json.loads(proc.stdout or "[]") if proc.returncode == 0 else []:
        dst = r.get("dst", "default")
        if dst != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    proc = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=False)
    for link in json.loads(proc.stdout or "[]") if proc.returncode == 0 else []:
        for a in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{a['local']}/{a.get('prefixlen', 32)}", strict=False))
    names = _netns_names()
    subnets = list(UNDERLAY.subnets(new_prefix=24))
    for _ in range(tries):
        ident = secrets.token_hex(3)
        net = subnets[int(ident, 16) % len(subnets)]
        if any(n.overlaps(net) for n in used) or any(x.startswith(PREFIX + ident) for x in names):
            continue
        return ident, net
    raise StateError(f"no free /24 in {UNDERLAY} for the underlay (every one tried is routed here)")


def _new_netns(name: str, alias: str) -> None:
    _ip("netns", "add", name)
    _ip("link", "set", "dev", "lo", "alias", alias, ns=name)
    _ip("link", "set", "dev", "lo", "up", ns=name)


def _keygen(path: Path, comment: str) -> None:
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], "ssh-keygen")


# The holder's program (what it is given, what it does): testbed/cluster/hostside/emulated_holder.sh.
_HOLDER_SCRIPT = hostside.text("emulated_holder.sh")


def _start_holder(emu: Emulated, h: EmulatedHost) -> None:
    """The process that keeps the host's mount and UTS namespaces (and its /run) alive."""
    log = h.path / "holder.log"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TB_HOST": h.name, "TB_MARK": f"{emu.token} {h.name}"}
    if emu.login_user:
        env.update(TB_ETC=str(h.path / "etc"), TB_HOME=str(h.path / "home"), TB_HOMES=LOGIN_HOMES)
    if emu.docker_socket:
        stage = h.path / "docker.sock"
        stage.touch(mode=0o600)
        env.update(TB_DOCKER=emu.docker_socket, TB_DOCKER_STAGE=str(stage), TB_DOCKER_AT=HOST_DOCKER_SOCKET)
    proc = _spawn(["nsenter", f"--net=/run/netns/{h.netns}", "--", "unshare", "--mount", "--uts",
                   "--propagation", "private", "--", "/bin/sh", "-c", _HOLDER_SCRIPT], log,
                  stdout=subprocess.PIPE, env=env)
    h.holder_pid = proc.pid
    emu.save()
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if line.strip() != b"ready":
        _reap(proc.pid, 2.0)
        raise TestbedError(f"emulated host {h.name}: its namespaces could not be set up: {_log_tail(log)}")


def _sshd_config(emu: Emulated, h: EmulatedHost) -> Path:
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


def _free_login_uid() -> int:
    """A uid free on this machine that is also free as a gid (the login user's own group)."""
    used = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for uid in LOGIN_UIDS:
        if uid not in used:
            return uid
    raise StateError(f"no uid free in {LOGIN_UIDS.start}-{LOGIN_UIDS.stop - 1} for the login user")


def _copy_as(src: str, dst: Path, extra: str = "") -> None:
    """`src` copied to `dst` with its mode and owner, `extra` (a line) appended."""
    st = os.stat(src)
    text = Path(src).read_bytes()
    if extra:
        text += (b"" if not text or text.endswith(b"\n") else b"\n") + extra.encode() + b"\n"
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(text)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))


def _make_login(emu: Emulated, h: EmulatedHost) -> None:
    """Host `h`'s login user, in files under DIR/hN that the holder binds in the host's mount
    namespace only: etc/passwd, group and shadow (this machine's, plus the user), etc/hosts (plus
    the host's name), etc/sudoers.d (this machine's, plus its NOPASSWD rule when h.sudo says so)
    and home/NAME with the client key."""
    user, uid = emu.login_user, emu.login_uid
    assert user and uid is not None
    etc = h.path / "etc"
    etc.mkdir(mode=0o755)
    _copy_as("/etc/passwd", etc / "passwd", f"{user}:x:{uid}:{uid}:testbed emulated host login:{emu.login_home}:/bin/sh")
    _copy_as("/etc/group", etc / "group", f"{user}:x:{uid}:")
    # "*": no password can match, and the account is not locked ("!" is: sshd would refuse the key)
    _copy_as("/etc/shadow", etc / "shadow", f"{user}:*:::::::")
    # the host's name, as Debian's installer writes it (sudo warns on every command when it cannot be resolved)
    _copy_as("/etc/hosts", etc / "hosts", f"127.0.1.1\t{h.name}")
    if os.path.isdir("/etc/sudoers.d"):
        sudoers = etc / "sudoers.d"
        sudoers.mkdir(mode=0o755)
        for entry in sorted(os.listdir("/etc/sudoers.d")):
            src = os.path.join("/etc/sudoers.d", entry)
            if os.path.isfile(src) and not os.path.islink(src):
                _copy_as(src, sudoers / entry)
        if h.sudo == "nopasswd":
            rule = sudoers / f"zz-testbed-emulated-{user}"   # read last: it is not overridden
            fd = os.open(rule, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o440)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"# made by testbed.cluster.emulate for host {h.name}\n{user} ALL=(ALL) NOPASSWD: ALL\n")
    homes = h.path / "home"
    homes.mkdir(mode=0o755)
    home = homes / user
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, parents=True)
    keys = ssh / "authorized_keys"
    keys.write_text(emu.authorized_keys.read_text())
    keys.chmod(0o600)
    for p in (home, ssh, keys):
        os.chown(p, uid, uid)
    home.chmod(0o755)


def _sshd_alive(emu: Emulated, h: EmulatedHost) -> bool:
    pid = h.sshd_pid
    return (pid is not None and _exe(pid) == SSHD and procs.start_ticks(pid) is not None
            and (_marker_of(pid) or "").split()[:2] == [emu.token, h.name])


def _wait_listening(address: str, pid: int, log: Path, name: str, timeout: float = READY_TIMEOUT_S) -> None:
    end = time.monotonic() + timeout
    while True:
        if procs.start_ticks(pid) is None:   # gone, or a zombie
            _reap(pid)
            raise TestbedError(f"emulated host {name}: sshd exited at start: {_log_tail(log)}")
        try:
            with socket.create_connection((address, SSH_PORT), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() >= end:
            raise TestbedError(f"emulated host {name}: sshd does not accept connections at {address}:{SSH_PORT} "
                               f"after {timeout:g} s: {_log_tail(log)}")
        time.sleep(0.05)


def start_sshd(emu: Emulated, name: str) -> None:
    """Start host `name`'s sshd (again) inside its namespaces; returns once it accepts connections."""
    h = emu.host(name)
    if _sshd_alive(emu, h):
        return
    if h.holder_pid is None or (_marker_of(h.holder_pid) or "").split()[:2] != [emu.token, h.name]:
        raise StateError(f"emulated host {name} is gone (its namespaces' holder process is not running)")
    config = _sshd_config(emu, h)
    enter = ["nsenter", f"--target={h.holder_pid}", "--net", "--mount", "--uts", "--"]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    _run([*enter, SSHD, "-t", "-f", str(config)], f"emulated host {name}: sshd -t (config check)", env=env)
    log = h.path / "sshd.log"
    # nsenter without --pid execs sshd itself: the PID is sshd's
    proc = _spawn([*enter, SSHD, "-D", "-e", "-f", str(config)], log, env=env)
    h.sshd_pid = proc.pid
    emu.save()
    _wait_listening(h.address, proc.pid, log, name)


def stop_sshd(emu: Emulated, name: str, *, sessions: bool = True) -> None:
    """Stop host `name`'s sshd, so that it becomes unreachable over SSH; sessions=True also ends
    the SSH sessions open on it (an open connection then fails too, as if the host went away).
    What runs on the host otherwise keeps running; start_sshd brings it back."""
    h = emu.host(name)
    pids = [p for p in _our_pids(emu.token, h.name, _our_netns_inodes(emu, h.name)) if _exe(p) == SSHD]
    listener = [p for p in pids if p == h.sshd_pid]
    targets = listener + ([p for p in pids if p != h.sshd_pid] if sessions else [])
    _signal(targets, signal.SIGTERM)
    end = time.monotonic() + 3.0
    left = targets
    while left and time.monotonic() < end:
        left = [p for p in left if not _reap(p)]
        if left:
            time.sleep(0.02)
    _signal(left, signal.SIGKILL)
    for p in left:
        _reap(p, 2.0)
    h.sshd_pid = None
    emu.save()


# -- create / destroy -------------------------------------------------------------------------------------


def _testbed_command() -> list[str]:
    """How a host runs testbed: this checkout's venv (the hosts share this filesystem)."""
    exe = Path(os.path.abspath(sys.executable))
    script = exe.parent / "testbed"
    return [str(script)] if script.is_file() and os.access(script, os.X_OK) else [str(exe), "-m", "testbed"]


def _preflight(workdir: Path) -> None:
    if os.geteuid() != 0:
        raise CapabilityError("emulated hosts need root (namespaces, veths, sshd)")
    for tool, pkg in ((SSHD, "openssh-server"), ("ssh-keygen", "openssh-client"), ("nsenter", "util-linux"),
                      ("unshare", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            raise CapabilityError(f"emulated hosts need {tool}: apt-get install {pkg}")
    bad = _UNSAFE & set(str(workdir))
    if bad:
        raise TestbedError(f"{workdir}: the directory of emulated hosts must not contain {''.join(sorted(bad))!r} "
                           "(its paths go into sshd's configuration)")


def _sudo_modes(names: list[str], sudo: str | Mapping[str, str]) -> dict[str, str]:
    """Each host's sudo mode: `sudo` for all, or host -> mode (a host not named: nopasswd)."""
    modes = ({n: sudo for n in names} if isinstance(sudo, str)
             else {n: sudo.get(n, SUDO_MODES[0]) for n in names})
    if not isinstance(sudo, str) and set(sudo) - set(names):
        raise TestbedError(f"--sudo names no such host: {', '.join(sorted(set(sudo) - set(names)))}")
    bad = sorted({m for m in modes.values() if m not in SUDO_MODES})
    if bad:
        raise TestbedError(f"--sudo: {', '.join(bad)} is not one of {', '.join(SUDO_MODES)}")
    return modes


def _check_login_user(user: str, modes: dict[str, str]) -> None:
    if not _USER_RE.match(user) or user == "root":
        raise TestbedError(f"--login-user {user!r}: a user name (lowercase letters, digits, '_', '-'), not root")
    for lookup, what in ((pwd.getpwnam, "a user"), (grp.getgrnam, "a group")):
        try:
            lookup(user)
        except KeyError:
            continue
        raise TestbedError(f"--login-user {user}: {what} of that name exists on this machine; the emulated "
                           "hosts add their own (pick another name)")
    if "nopasswd" in modes.values() and (shutil.which("sudo") is None or not os.path.isdir("/etc/sudoers.d")):
        raise CapabilityError("a login user with sudo needs sudo (and /etc/sudoers.d): apt-get install sudo")


def _check_docker_socket(path: str) -> str:
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TestbedError(f"--docker-socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise TestbedError(f"--docker-socket {path}: not a socket")
    if os.path.realpath("/var/run") != "/run":
        raise CapabilityError("--docker-socket: /var/run is not /run here, so the hosts' Docker clients would "
                              f"not find the socket at {HOST_DOCKER_SOCKET}")
    return path


def create(n: int, workdir: str | Path, *, underlay_mtu: int = DEFAULT_MTU, cores: int = DEFAULT_CORES,
           names: list[str] | None = None, login_user: str | None = None,
           sudo: str | Mapping[str, str] = "nopasswd", docker_socket: str | None = None) -> Emulated:
    """Make `n` emulated hosts recorded in `workdir` (made if missing); see the module's docstring.
    login_user: hosts.yaml logs in as this user (made on each host only), who runs commands as root
    through sudo when sudo says "nopasswd" (for all hosts, or host -> mode; "none": no sudo rule).
    docker_socket: this machine's Docker daemon socket, which every host then sees as its own.
    On any failure everything made so far is removed before the error is raised."""
    if not 1 <= n <= 253:
        raise TestbedError(f"--hosts must be 1-253 (got {n})")
    if not 1280 <= underlay_mtu <= 65535:
        raise TestbedError(f"the underlay MTU must be 1280-65535 (got {underlay_mtu})")
    names = list(names) if names else [f"h{i}" for i in range(1, n + 1)]
    if len(names) != n or len(set(names)) != n:
        raise TestbedError(f"need {n} distinct host names (got {names})")
    modes = _sudo_modes(names, sudo)
    if login_user is not None:
        _check_login_user(login_user, modes)
    if docker_socket is not None:
        docker_socket = _check_docker_socket(docker_socket)
    workdir = Path(os.path.abspath(workdir))
    _preflight(workdir)
    if (workdir / STATE_FILE).exists():
        raise StateError(f"{workdir} already holds emulated hosts: python -m testbed.cluster.emulate down "
                         f"--dir {workdir} first")
    made = not workdir.exists()
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        with _subnet_lock():   # two instances made at once must not pick the same /24
            return _create(n, workdir, names, underlay_mtu, cores, made, login_user,
                           modes if login_user else {}, docker_socket)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):   # only when nothing was left in it
                workdir.rmdir()
        raise


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """An exclusive flock on a directory every instance can open (no lock file is left behind)."""
    import fcntl

    fd = os.open(LOCK_DIR if os.path.isdir(LOCK_DIR) else "/run", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _create(n: int, workdir: Path, names: list[str], underlay_mtu: int, cores: int, made: bool,
            login_user: str | None, modes: dict[str, str], docker_socket: str | None) -> Emulated:
    ident, net = _pick_subnet()
    emu = Emulated(workdir=str(workdir), id=ident, token=secrets.token_hex(16), subnet=str(net), mtu=underlay_mtu,
                   cores=cores, testbed=_testbed_command(), made_workdir=made, login_user=login_user,
                   login_uid=_free_login_uid() if login_user else None, docker_socket=docker_socket)
    for i, name in enumerate(names, start=1):
        emu.hosts.append(EmulatedHost(name=name, address=str(net[i]), netns=f"{PREFIX}{ident}-{name}",
                                      dir=str(workdir / name), sudo=modes.get(name)))
    emu.save()   # from here on, destroy(workdir) knows what to remove
    try:
        _build(emu)
    except BaseException:
        with contextlib.suppress(Exception):   # the original error is the one to report
            destroy(workdir)
        raise
    return emu


def _build(emu: Emulated) -> None:
    mtu, plen = str(emu.mtu), ipaddress.ip_network(emu.subnet).prefixlen
    _keygen(emu.key, f"testbed-emulated-{emu.id}")
    emu.authorized_keys.write_text(Path(str(emu.key) + ".pub").read_text())
    emu.authorized_keys.chmod(0o600)

    u = emu.underlay_netns
    _new_netns(u, emu.alias)
    _ip("link", "add", "br0", "mtu", mtu, "type", "bridge", ns=u)
    _ip("link", "set", "dev", "br0", "up", ns=u)
    # this machine's end: the controller reaches the hosts through it
    c = emu.root_veth
    _ip("link", "add", c, "mtu", mtu, "type", "veth", "peer", "name", "ctl", "mtu", mtu, "netns", u)
    _ip("link", "set", "dev", c, "alias", emu.alias)
    with contextlib.suppress(OSError):   # no IPv6 chatter from this machine onto the underlay
        Path(f"/proc/sys/net/ipv6/conf/{c}/disable_ipv6").write_text("1")
    _ip("addr", "add", f"{emu.controller_address}/{plen}", "dev", c)
    _ip("link", "set", "dev", c, "up")
    _ip("link", "set", "dev", "ctl", "master", "br0", "up", ns=u)

    known = []
    for i, h in enumerate(emu.hosts, start=1):
        h.path.mkdir(mode=0o700, exist_ok=True)
        _new_netns(h.netns, emu.alias)
        port = f"p{i}"
        _ip("link", "add", port, "mtu", mtu, "type", "veth", "peer", "name", "eth0", "mtu", mtu, "netns", h.netns,
            ns=u)
        _ip("link", "set", "dev", port, "master", "br0", "up", ns=u)
        _ip("addr", "add", f"{h.address}/{plen}", "dev", "eth0", ns=h.netns)
        _ip("link", "set", "dev", "eth0", "up", ns=h.netns)
        _keygen(h.path / "ssh_host_ed25519_key", f"{h.name}.emulated-{emu.id}")
        if emu.login_user:
            _make_login(emu, h)
        if emu.state_root(h):
            Path(emu.state_root(h)).mkdir(mode=0o700)
        _start_holder(emu, h)
        start_sshd(emu, h.name)
        pub = (h.path / "ssh_host_ed25519_key.pub").read_text().split()
        known.append(f"{h.address} {pub[0]} {pub[1]}\n")
    emu.known_hosts.write_text("".join(known))
    _write_hosts_file(emu)
    emu.save()


def _write_hosts_file(emu: Emulated) -> None:
    import shlex

    import yaml

    from testbed.cluster.hosts import Host

    doc = {"description": f"{len(emu.hosts)} emulated hosts on this machine ({PREFIX}{emu.id}; "
                          f"python -m testbed.cluster.emulate down --dir {emu.dir})",
           "hosts": [{"name": h.name, "ssh": f"{emu.login}@{h.address}", "key": str(emu.key), "agent": False,
                      "underlay": h.address, "capacity": {"cores": emu.cores}, "labels": {"emulated": "true"}}
                     for h in emu.hosts]}
    if "testbed" in Host.model_fields:   # hosts files that name the remote testbed command
        for h, entry in zip(emu.hosts, doc["hosts"]):
            root = emu.state_root(h)
            entry["testbed"] = shlex.join(["env", f"TESTBED_STATE_DIR={root}", *emu.testbed] if root else emu.testbed)
    head = (f"# Emulated hosts made by testbed.cluster.emulate: namespaces on this machine, not servers.\n"
            f"# Host keys: {emu.known_hosts}. testbed on each host: {' '.join(emu.testbed)} "
            f"(also in {STATE_FILE}).\n")
    emu.hosts_file.write_text(head + yaml.safe_dump(doc, sort_keys=False))
    emu.load_hosts()   # what we wrote must be a valid hosts file


def _kill_ours(emu: Emulated, problems: list[str], timeout: float = 10.0) -> None:
    """SIGKILL every process proven ours (_our_pids), until none is left."""
    end = time.monotonic() + timeout
    inodes = _our_netns_inodes(emu)
    while True:
        pids = [p for p in _our_pids(emu.token, netns_inodes=inodes) if procs.start_ticks(p) is not None]
        if not pids:
            break
        if time.monotonic() >= end:
            problems.append(f"processes still running after {timeout:g} s: {', '.join(map(str, pids[:20]))}")
            break
        _signal(pids, signal.SIGKILL)
        for p in pids:
            _reap(p, 0.5)
    for pid, proc in list(_CHILDREN.items()):   # our children that ended already (sshd stopped earlier)
        if proc.poll() is not None:
            _CHILDREN.pop(pid, None)


def _remove_containers(emu: Emulated, problems: list[str]) -> None:
    """Worker containers the hosts' testbeds left on the shared Docker daemon: those labelled with a
    state root of ours (a directory under DIR, which only our hosts use). Nothing when the daemon
    is gone."""
    import docker

    roots = [r for r in (emu.state_root(h) for h in emu.hosts) if r]
    try:
        client = docker.DockerClient(base_url=f"unix://{emu.docker_socket}", timeout=30)
        client.ping()
    except Exception:  # noqa: BLE001 - no daemon there (any more): no container of ours runs
        return
    try:
        for root in roots:
            for c in client.containers.list(all=True, filters={"label": ["testbed.owner=testbed",
                                                                          f"testbed.state_root={root}"]}):
                if (c.labels or {}).get("testbed.state_root") == root:
                    c.remove(force=True, v=True)
    except Exception as exc:  # noqa: BLE001 - reported with the rest
        problems.append(f"Docker containers of the hosts (label testbed.state_root under {emu.dir}): {exc}")
    finally:
        client.close()


def destroy(workdir: str | Path) -> None:
    """Remove the emulated hosts recorded in `workdir`: their processes, namespaces, the veth and
    our files (see the module's docstring for how each is proven ours). Idempotent: nothing recorded,
    nothing done. Raises TestbedError listing what could not be removed, after trying everything."""
    workdir = Path(os.path.abspath(workdir))
    emu = load(workdir)
    if emu is None:
        return
    problems: list[str] = []
    _kill_ours(emu, problems)
    if emu.docker_socket:
        _remove_containers(emu, problems)

    c = emu.root_veth
    alias = _link_alias(c)
    if alias == emu.alias:
        try:
            _ip("link", "del", "dev", c)
        except TestbedError as exc:
            problems.append(f"veth {c}: {exc}")
    elif alias is not None:
        problems.append(f"veth {c} is not ours (alias {alias!r}): left alone")

    recorded = [h.netns for h in emu.hosts] + [emu.underlay_netns]
    present = _netns_names()
    for ns in recorded + sorted(x for x in present if x.startswith(f"{PREFIX}{emu.id}-") and x not in recorded):
        if ns not in present:
            continue
        alias = _link_alias("lo", ns)
        if alias != emu.alias:
            problems.append(f"namespace {ns} is not ours (lo alias {alias!r}): left alone")
            continue
        try:
            _ip("netns", "del", ns)
        except TestbedError as exc:
            problems.append(f"namespace {ns}: {exc}")

    for h in emu.hosts:
        shutil.rmtree(h.path, ignore_errors=True)
    for f in (emu.key, Path(str(emu.key) + ".pub"), emu.authorized_keys, emu.known_hosts, emu.hosts_file):
        f.unlink(missing_ok=True)
    if problems:
        raise TestbedError(f"emulated hosts in {workdir} not fully removed (run down again):\n  "
                           + "\n  ".join(problems))
    (workdir / STATE_FILE).unlink(missing_ok=True)
    if emu.made_workdir:
        with contextlib.suppress(OSError):   # not empty: someone else's files, kept
            workdir.rmdir()


@contextlib.contextmanager
def emulated(n: int, workdir: str | Path, **kw: Any) -> Iterator[Emulated]:
    """create(n, workdir, **kw), destroyed when the block ends (also on errors)."""
    emu = create(n, workdir, **kw)
    try:
        yield emu
    finally:
        destroy(workdir)


# -- command line -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.cluster.emulate",
                                 description="Emulated hosts (namespaces + sshd) on this machine, for multi-host "
                                             "testbeds without servers.")
    sub = ap.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="make N emulated hosts; writes DIR/hosts.yaml")
    up.add_argument("--hosts", type=int, required=True, help="how many hosts (1-253)")
    up.add_argument("--dir", required=True, help="where keys, configs, hosts.yaml and the record go")
    up.add_argument("--underlay-mtu", type=int, default=DEFAULT_MTU, help=f"MTU of the underlay (default {DEFAULT_MTU})")
    up.add_argument("--cores", type=int, default=DEFAULT_CORES,
                    help=f"capacity cores of each host in hosts.yaml (default {DEFAULT_CORES})")
    up.add_argument("--login-user", metavar="NAME",
                    help="hosts.yaml logs in as NAME (made on each host only, not here), not as root")
    up.add_argument("--sudo", action="append", default=[], metavar="[HOST=]MODE",
                    help="with --login-user: nopasswd (the default: NAME may sudo -n anything) or none (no sudo "
                         "rule), for every host or, as HOST=MODE, for one (repeatable)")
    up.add_argument("--docker-socket", metavar="PATH",
                    help="this machine's Docker daemon socket (e.g. from scripts/dockerd.sh), bound on each "
                         f"host's {HOST_DOCKER_SOCKET}: the hosts' Docker workers use that daemon")
    down = sub.add_parser("down", help="remove the emulated hosts recorded in DIR")
    down.add_argument("--dir", required=True)
    for verb in ("stop-sshd", "start-sshd"):
        p = sub.add_parser(verb, help=f"{verb.split('-')[0]} one host's sshd (unreachable / reachable again)")
        p.add_argument("--dir", required=True)
        p.add_argument("host")
    args = ap.parse_args(argv)
    try:
        if args.verb == "up":
            if args.sudo and not args.login_user:
                raise TestbedError("--sudo goes with --login-user")
            every, per = SUDO_MODES[0], {}
            for word in args.sudo:
                host, eq, mode = word.rpartition("=")
                if eq:
                    per[host] = mode
                else:
                    every = mode
            sudo = {**{f"h{i}": every for i in range(1, args.hosts + 1)}, **per} if per else every
            emu = create(args.hosts, args.dir, underlay_mtu=args.underlay_mtu, cores=args.cores,
                         login_user=args.login_user, sudo=sudo, docker_socket=args.docker_socket)
            for h in emu.hosts:
                how = f", sudo {h.sudo}" if h.sudo else ""
                print(f"{h.name}: {emu.login}@{h.address} (namespace {h.netns}, sshd pid {h.sshd_pid}{how})")
            print(f"hosts file: {emu.hosts_file}\nknown hosts: {emu.known_hosts}\n"
                  f"testbed on the hosts: {' '.join(emu.testbed)}\n"
                  f"down: python -m testbed.cluster.emulate down --dir {emu.dir}")
        elif args.verb == "down":
            destroy(args.dir)
        else:
            emu = load(args.dir)
            if emu is None:
                raise StateError(f"no emulated hosts recorded in {args.dir}")
            (start_sshd if args.verb == "start-sshd" else stop_sshd)(emu, args.host)
    except (TestbedError, KeyError) as exc:
        print(f"error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
