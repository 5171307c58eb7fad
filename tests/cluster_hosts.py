"""What the tests of a testbed over several hosts share: two emulated hosts (testbed/cluster/emulate.py,
with the controller's record in a state root of its own), the `two-sides` topology pinned so that its
s0-s1 link crosses them, the CLI run as a process, commands on a host, processes found in /proc.

A test module makes its fixtures from these: `emu` from emulated_hosts, `line` from up_line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.cluster import emulate

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY = REPO / "topologies" / "two-sides.yaml"   # s0-s1, 1 Gbit/s, is the link between the hosts
LINE = TOPOLOGY.read_text()
PINS = ["--pin", "w0=h1", "--pin", "w1=h1", "--pin", "s0=h1", "--pin", "w2=h2", "--pin", "w3=h2", "--pin", "s1=h2"]
CAN_EMULATE = os.geteuid() == 0 and Path(emulate.SSHD).exists() and shutil.which("ssh-keygen") is not None \
    and shutil.which("ssh") is not None
NEEDS = "needs root, openssh-server and -client"


def emulated_hosts(tmp_path_factory) -> Iterator[emulate.Emulated]:
    """Two emulated hosts, the controller's record in a state root of its own (TESTBED_STATE_DIR)."""
    state = tmp_path_factory.mktemp("controller")   # the controller's own state root (0700, root's)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESTBED_STATE_DIR", str(state))
        with emulate.emulated(2, tmp_path_factory.mktemp("emu") / "hosts", cores=8) as e:
            yield e


def tb(*args: str, cwd: Path = REPO, timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """`testbed ARGS` as a process, the way a user runs it (in `cwd`)."""
    r = subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=cwd, env={**os.environ, "COLUMNS": "250"}, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"testbed {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def on_host(emu, host: str, *argv: str, check: bool = True):
    ctl = next(c for c in emu.controls() if c.name == host)
    try:
        return ctl.run(list(argv), check=check)
    finally:
        ctl.close()


def up_line(emu, prefix: str) -> Iterator[str]:
    """The pinned two-sides testbed over both hosts, named PREFIX + 6 hex digits; down afterwards,
    and no namespace of it left on either host."""
    from testbed.cluster import controller

    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(emu.hosts_file), "--known-hosts", str(emu.known_hosts),
       "--time-dilation", "none", *PINS)
    try:
        yield name
    finally:
        if controller.exists(name):
            tb("down", name, check=False)
        for host in ("h1", "h2"):
            assert not [ns for ns in on_host(emu, host, "ip", "netns", "list").stdout.split() if name in ns]


def pids_with(marker: str, start: bool = False) -> list[int]:
    """PIDs of processes whose command line holds `marker` (start: begins with it). The emulated
    hosts share this machine's PID namespace, so their processes are seen here."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                line = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if line.startswith(marker) if start else marker in line:
                found.append(int(d.name))
    return [p for p in found if p != os.getpid()]
