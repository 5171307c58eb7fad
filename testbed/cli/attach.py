"""testbed attach NODE: an interactive shell inside a worker (or a switch).

Leaving the shell (exit, Ctrl-D) leaves the node running: the shell is one
more process entered into the node's namespaces, not the node's init.

A testbed over several hosts: the controller's SSH sessions carry no
terminal, so `attach` there runs ssh(1) -t to the node's host with the hosts
file's key and port and the testbed's known hosts (ssh_argv() writes it; `cp`
prints such commands).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer

from testbed.cli.common import NameOption, require_root, resolve_name
from testbed.errors import StateError, TestbedError


class AcrossHosts(TestbedError):
    """A verb that does not run across hosts from the controller: says what to run instead. Exit 2."""

    exit_code = 2


def spread(name: str) -> bool:
    """Testbed `name` spans several hosts and only its controller's record is here: verbs go to its hosts."""
    from testbed import store
    from testbed.cluster import controller

    return controller.exists(name) and not store.exists(name)


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
    import os

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
    import shlex

    remote = [*host.testbed_argv, *argv]
    if host.target.user not in (None, "root"):
        remote = ["sudo", *remote]
    return ["ssh", *(["-t"] if tty else []), *ssh_options(doc, host), ssh_login(host), shlex.join(remote)]


def ssh_command(doc: dict[str, Any], host: Any, argv: list[str], *, tty: bool = False) -> str:
    """ssh_argv as one line to print."""
    import shlex

    return shlex.join(ssh_argv(doc, host, argv, tty=tty))


def attach_node(st: dict[str, Any], node: str) -> int:
    from testbed.lifecycle import node_target

    rt, rec, kind = node_target(st, node)
    if kind == "worker" and rt.kind != "bare":
        return rt.attach(node, rec)
    # a plain namespace has the host's hostname: say where the shell is in its prompt
    import subprocess

    argv = rt.exec_argv(node, rec, ["/bin/bash", "--norc", "-i"], tty=True,
                        env={"PS1": f"[{st['name']}:{node}] \\w\\$ ", "TESTBED_NODE": node})
    return subprocess.call(argv)


def _attach_across_hosts(tb: str, node: str) -> None:
    """The shell on the node's host, through ssh(1) with the hosts file's key, port and the testbed's
    known hosts: a terminal all the way (the controller's own SSH sessions carry none)."""
    import os
    import shlex
    import shutil

    from testbed.cli.common import err_console

    doc, host = node_host(tb, node)
    argv = ssh_argv(doc, host, ["attach", node, "--name", tb], tty=True)
    line = shlex.join(argv)
    if shutil.which("ssh") is None:
        raise AcrossHosts(f"{node} is on host {host.name} of testbed {tb}; attaching there needs ssh(1) "
                          f"(Debian: apt-get install openssh-client), then run `{line}`")
    err_console.print(f"{node} is on host {host.name}: {line}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("ssh", argv)   # the shell's status, signals and terminal are the user's


def register(app: typer.Typer) -> None:
    @app.command(help="Open an interactive shell inside NODE (a worker or a switch). "
                      "Exiting the shell leaves the node running.")
    def attach(node: str = typer.Argument(..., help="The worker or switch to enter."),
               name: Optional[str] = NameOption) -> None:
        from testbed import lifecycle

        require_root("attach")
        tb = resolve_name(name)
        if spread(tb):
            _attach_across_hosts(tb, node)
        st = lifecycle.load(tb)
        if not sys.stdin.isatty():
            from testbed.cli.common import err_console

            err_console.print("note: stdin is not a terminal; for one command use "
                              f"`testbed exec {node} -- CMD`", highlight=False)
        raise typer.Exit(attach_node(st, node))
