"""testbed install --hosts HOSTS.yaml [--host h1,h2] [--prefix /opt/testbed] [--python python3]
[--known-hosts FILE] [--trust-new-host-keys] [--force]: put this controller's testbed on the hosts.

The work is testbed.cluster.install's (see its docstring): a wheelhouse built here once (this
testbed's wheel from its clone, and its dependencies at the versions installed here), streamed over
SSH to every selected host at once into a venv PREFIX/VERSION, with PREFIX/bin/testbed pointing
at it. Prints a line per host as it goes, a table at the end, and the `testbed:` line each host's
entry in the hosts file needs to use it. Exit status: 0 when every selected host is ready, 1 when
one is not (its reason in the table), 2 for options or a setup that cannot work at all.
"""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import console, err_console, fail

DEFAULT_PREFIX = "/opt/testbed"


def install_cmd(
    hosts_file: str = typer.Option(..., "--hosts", metavar="HOSTS.yaml",
                                   help="The hosts file (docs/multi-host.md): whom to install on, over SSH."),
    only: list[str] = typer.Option([], "--host", metavar="H1,H2",
                                   help="Only these hosts of the file (comma-separated, repeatable; default: all)."),
    prefix: str = typer.Option(DEFAULT_PREFIX, "--prefix", metavar="DIR",
                               help="Where on the hosts: the venv goes to DIR/VERSION, DIR/bin/testbed points to "
                                    "it. An absolute path; nothing outside it is touched there."),
    python: str = typer.Option("python3", "--python", metavar="PYTHON",
                               help="The hosts' Python that makes the venv: a command on their PATH or a path; "
                                    "3.11 like this controller's, >= 3.11.4, with venv (python3-venv)."),
    known_hosts: Optional[str] = typer.Option(None, "--known-hosts", metavar="FILE",
                                              help="The SSH host keys to accept (default: ~/.ssh/known_hosts); "
                                                   "other keys are refused."),
    trust_new_host_keys: bool = typer.Option(False, "--trust-new-host-keys",
                                             help="Accept hosts whose key is not known yet (and remember it)."),
    force: bool = typer.Option(False, "--force", help="Install again where this version is installed already."),
) -> None:
    """Install this controller's testbed (its version, its dependencies' versions) on the hosts of a hosts
    file, over SSH.

    Builds a wheelhouse here once (testbed's wheel from this clone, and a wheel of each dependency at
    the version installed here; kept in ~/.cache/testbed, or TESTBED_CACHE_DIR), then, on every
    selected host at once: checks its Python, streams the wheelhouse to it, makes the venv
    PREFIX/VERSION with `pip install --no-index` from it, and points PREFIX/bin/testbed at it. A host
    that has this version already is left alone (--force: installed again). The hosts need nothing
    from a package index. Afterwards, set `testbed: PREFIX/bin/testbed` in each host's entry of the
    hosts file (the lines to set are printed)."""
    import time

    from rich.table import Table
    from rich.text import Text

    from testbed.cluster import install
    from testbed.cluster.hosts import load_hosts
    from testbed.errors import InstallRefused

    t0 = time.monotonic()
    try:
        prefix = install.check_prefix(prefix)
        python = install.check_python(python)
    except InstallRefused as exc:
        fail(str(exc), 2)
    hosts = load_hosts(hosts_file)
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    by_name = {h.name: h for h in hosts.hosts}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        fail(f"--host: {', '.join(unknown)} not in {hosts_file} (it has {', '.join(by_name)})", 2)
    chosen = [by_name[n] for n in dict.fromkeys(names)] if names else list(hosts.hosts)
    build = install.prepare()

    def say(message: str) -> None:
        err_console.print(message, highlight=False, markup=False)

    def make_wheelhouse(b: install.Build) -> install.Wheelhouse:
        with err_console.status("building the wheelhouse (pip wheel) ...", spinner="dots"):
            return install.wheelhouse(b, say)

    outcomes = install.install(chosen, prefix=prefix, python=python, known_hosts=known_hosts,
                               trust_new=trust_new_host_keys, force=force, build=build, progress=say,
                               make_wheelhouse=make_wheelhouse)
    table = Table(title=f"testbed {build.version} in {prefix} ({time.monotonic() - t0:.1f} s)", title_justify="left")
    for col in ("host", "result", "Python", "time", "details"):
        table.add_column(col, justify="right" if col == "time" else "left")
    colour = {"installed": "green", "already installed": "green", "refused": "red", "failed": "red",
              "unreachable": "red"}
    for out in outcomes:
        detail = Text(out.why + "".join(f"\n  {ln}" for ln in out.details))
        table.add_row(out.host, Text(out.state, style=colour.get(out.state, "red")), out.python or "-",
                      f"{out.seconds:.1f} s", detail)
    console.print(table, highlight=False)
    ready = [out.host for out in outcomes if out.ready]
    lines = {h.name: install.hosts_file_line(prefix, h.testbed_argv) for h in chosen if h.name in ready}
    lines = {n: line for n, line in lines.items() if line is not None}
    if lines:
        console.print(f"to use it, set in {hosts_file}:", highlight=False)
        for n, line in lines.items():
            console.print(f"  host {n}:  testbed: {line}    (now: {by_name[n].testbed})", highlight=False,
                          soft_wrap=True, markup=False)
    if len(ready) != len(outcomes):
        not_ready = [out.host for out in outcomes if not out.ready]
        err_console.print(f"[bold red]error:[/] not ready: {', '.join(not_ready)} (see above)", highlight=False)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("install")(install_cmd)
