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
import json
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from testbed.cluster.emulate_login import SUDO_MODES, check_login_user, free_login_uid, make_login, sudo_modes
from testbed.cluster.emulate_processes import kill_ours
from testbed.cluster.emulate_record import HOST_DOCKER_SOCKET, PREFIX, STATE_FILE, EmulatedHost, EmulatedRecord
from testbed.cluster.emulate_sshd import SSHD, keygen, start_holder, start_sshd, stop_sshd
from testbed.cluster.emulate_underlay import (delete_link, delete_netns, link_alias, make_underlay, netns_names,
                                              pick_subnet, plug_host)
from testbed.errors import CapabilityError, StateError, TestbedError

__all__ = ["Emulated", "EmulatedHost", "create", "destroy", "emulated", "load", "main", "start_sshd", "stop_sshd"]

DEFAULT_MTU = 9000
DEFAULT_CORES = 2
LOCK_DIR = "/run/lock"   # flocked while an instance picks its /24 and builds
_UNSAFE = set(" \t\n\"'%\\#")   # characters a path must not have in an sshd_config line


class Emulated(EmulatedRecord):
    """A set of emulated hosts (see the module's docstring), as recorded in DIR/emulated.json."""

    def stop_sshd(self, name: str) -> None:
        stop_sshd(self, name)

    def start_sshd(self, name: str) -> None:
        start_sshd(self, name)

    def destroy(self) -> None:
        destroy(self.dir)


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


# -- create -----------------------------------------------------------------------------------------------


def _testbed_command() -> list[str]:
    """How a host runs testbed: this checkout's venv (the hosts share this filesystem)."""
    exe = Path(os.path.abspath(sys.executable))
    script = exe.parent / "testbed"
    return [str(script)] if script.is_file() and os.access(script, os.X_OK) else [str(exe), "-m", "testbed"]


def _preflight(workdir: Path) -> None:
    if os.geteuid() != 0:
        raise CapabilityError("emulated hosts need root (namespaces, veths, sshd)")
    # (ip: the holder sets its lo up with it)
    for tool, pkg in ((SSHD, "openssh-server"), ("ssh-keygen", "openssh-client"), ("nsenter", "util-linux"),
                      ("unshare", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            raise CapabilityError(f"emulated hosts need {tool}: apt-get install {pkg}")
    bad = _UNSAFE & set(str(workdir))
    if bad:
        raise TestbedError(f"{workdir}: the directory of emulated hosts must not contain {''.join(sorted(bad))!r} "
                           "(its paths go into sshd's configuration)")


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
    modes = sudo_modes(names, sudo)
    if login_user is not None:
        check_login_user(login_user, modes)
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
    ident, net = pick_subnet()
    emu = Emulated(workdir=str(workdir), id=ident, token=secrets.token_hex(16), subnet=str(net), mtu=underlay_mtu,
                   cores=cores, testbed=_testbed_command(), made_workdir=made, login_user=login_user,
                   login_uid=free_login_uid() if login_user else None, docker_socket=docker_socket)
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
    keygen(emu.key, f"testbed-emulated-{emu.id}")
    emu.authorized_keys.write_text(Path(str(emu.key) + ".pub").read_text())
    emu.authorized_keys.chmod(0o600)
    make_underlay(emu)

    known = []
    for i, h in enumerate(emu.hosts, start=1):
        h.path.mkdir(mode=0o700, exist_ok=True)
        plug_host(emu, h, f"p{i}")
        keygen(h.path / "ssh_host_ed25519_key", f"{h.name}.emulated-{emu.id}")
        if emu.login_user:
            make_login(emu, h)
        if emu.state_root(h):
            Path(emu.state_root(h)).mkdir(mode=0o700)
        start_holder(emu, h)
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


# -- destroy ----------------------------------------------------------------------------------------------


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
    kill_ours(emu, problems)
    if emu.docker_socket:
        _remove_containers(emu, problems)

    c = emu.root_veth
    alias = link_alias(c)
    if alias == emu.alias:
        try:
            delete_link(c)
        except TestbedError as exc:
            problems.append(f"veth {c}: {exc}")
    elif alias is not None:
        problems.append(f"veth {c} is not ours (alias {alias!r}): left alone")

    recorded = [h.netns for h in emu.hosts] + [emu.underlay_netns]
    present = netns_names()
    for ns in recorded + sorted(x for x in present if x.startswith(f"{PREFIX}{emu.id}-") and x not in recorded):
        if ns not in present:
            continue
        alias = link_alias("lo", ns)
        if alias != emu.alias:
            problems.append(f"namespace {ns} is not ours (lo alias {alias!r}): left alone")
            continue
        try:
            delete_netns(ns)
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
