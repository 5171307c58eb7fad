"""ssh(1) and scp(1) command lines that reach a host of a testbed as its controller does: the hosts
file's key and port, and the known-hosts file the testbed was brought up with. For what needs a
terminal all the way (`attach` over several hosts: the controller's own SSH sessions carry none) and
for the commands testbed prints for a user to run."""

from __future__ import annotations

import os
import shlex
from typing import Any

from testbed.errors import StateError


def node_host(name: str, node: str) -> tuple[dict[str, Any], Any]:
    """(the controller's record, the hosts-file entry of the host that holds `node`) of testbed `name`."""
    from testbed.cluster import controller

    doc = controller.load(name)
    host = doc["placement"].get(node)
    if host is None:
        nodes = list(doc["placement"])
        raise StateError(f"testbed {name!r} has no node {node!r}; nodes: {', '.join(nodes[:12])}"
                         f"{' ...' if len(nodes) > 12 else ''}")
    return doc, next(h for h in doc["_hosts"] if h.name == host)


def ssh_options(doc: dict[str, Any], host: Any, *, scp: bool = False) -> list[str]:
    """ssh(1) / scp(1) options that reach `host` as the controller does: its key, its port, the
    known-hosts file the testbed was brought up with."""
    t = host.target
    opts: list[str] = []
    if host.key:
        opts += ["-i", os.path.expanduser(host.key)]
        if not host.uses_agent:
            opts += ["-o", "IdentitiesOnly=yes"]
    if t.port != 22:
        opts += ["-P" if scp else "-p", str(t.port)]
    if doc.get("known_hosts"):
        opts += ["-o", f"UserKnownHostsFile={os.path.abspath(os.path.expanduser(doc['known_hosts']))}"]
    return opts


def ssh_login(host: Any, *, scp: bool = False) -> str:
    """user@address as ssh takes it (scp wants an IPv6 address in brackets)."""
    t = host.target
    addr = f"[{t.address}]" if scp and ":" in t.address else t.address
    return f"{t.user}@{addr}" if t.user else addr


def ssh_argv(doc: dict[str, Any], host: Any, argv: list[str], *, tty: bool = False) -> list[str]:
    """The ssh(1) command that runs `testbed ARGV` on `host` (as root: `sudo` for another user)."""
    remote = [*host.testbed_argv, *argv]
    if host.target.user not in (None, "root"):
        remote = ["sudo", *remote]
    return ["ssh", *(["-t"] if tty else []), *ssh_options(doc, host), ssh_login(host), shlex.join(remote)]


def ssh_command(doc: dict[str, Any], host: Any, argv: list[str], *, tty: bool = False) -> str:
    """ssh_argv as one line to print."""
    return shlex.join(ssh_argv(doc, host, argv, tty=tty))
