"""What the tests of a testbed over several hosts share: emulated hosts (testbed/cluster/emulate.py,
with the controller's record in a state root of its own), the `two-sides` topology pinned so that its
s0-s1 link crosses them, the CLI run as a process, commands on a host, processes found in /proc.

The fixtures made of these are in tests/conftest.py, one copy for every module: `emu` (emulated_hosts,
two hosts unless the module's `emulated_options` fixture asks for others) and `line` (up_line on them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import requires
from testbed.cluster import emulate
from waiting import tcp_sockets, wait_for

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY = REPO / "topologies" / "two-sides.yaml"   # s0-s1, 1 Gbit/s, is the link between the hosts
LINE = TOPOLOGY.read_text()
PINS = ["--pin", "w0=h1", "--pin", "w1=h1", "--pin", "s0=h1", "--pin", "w2=h2", "--pin", "w3=h2", "--pin", "s1=h2"]


def emulated_hosts(tmp_path_factory, n: int = 2, *, env: Mapping[str, str] | None = None,
                   **create: Any) -> Iterator[emulate.Emulated]:
    """N emulated hosts (emulate.create's other keywords in `create`; 8 cores each unless `cores`
    says otherwise), the controller's record in a state root of its own (TESTBED_STATE_DIR) and
    `env` set while they live. Afterwards emulate.destroy removes what their record names and proves
    its own (namespaces and the veth by their alias, processes, keys and files; containers with
    Docker), nothing else. Skipped without root and sshd (a failure where they are required:
    tests/requires.py)."""
    requires.need("sshd")
    create.setdefault("cores", 8)
    state = tmp_path_factory.mktemp("controller")   # the controller's own state root (0700, root's)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESTBED_STATE_DIR", str(state))
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        with emulate.emulated(n, tmp_path_factory.mktemp("emu") / "hosts", **create) as e:
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


def up_line(emu, prefix: str, topology: Path = TOPOLOGY) -> Iterator[str]:
    """The pinned two-sides testbed (`topology`: TOPOLOGY or a variant of it with the same nodes) over
    both hosts, named PREFIX + 6 hex digits; down afterwards, and no namespace of it left on either host."""
    from testbed.cluster import controller

    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    tb("up", str(topology), "--name", name, "--hosts", str(emu.hosts_file), "--known-hosts", str(emu.known_hosts),
       "--time-dilation", "none", *PINS)
    try:
        yield name
    finally:
        if controller.exists(name):
            tb("down", name, check=False)
        for host in ("h1", "h2"):
            assert not [ns for ns in on_host(emu, host, "ip", "netns", "list").stdout.split() if name in ns]


def host_state(emu, host: str, name: str) -> dict:
    """Testbed `name`'s local state on `host` (its own /run), read there."""
    return json.loads(on_host(emu, host, "cat", f"/run/testbed/{name}/state.json").stdout)


def remote_tops(name: str) -> list[str]:
    """Command lines of the hosts' agents of testbed `name` still running (`testbed agent NAME`: while a
    top runs, the one streaming it; the emulated hosts share this machine's PID namespace, so their
    processes are seen in /proc here)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            except OSError:
                continue
            if argv[-2:] == ["agent", name]:
                found.append(" ".join(argv))
    return found


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


def iperf3_server(line: str, worker: str, port: int, seconds: int = 60) -> subprocess.Popen:
    """`iperf3 -s -1 -p PORT` on a worker of the testbed `line` through `testbed exec`, returned
    once it listens (its socket seen in its namespace): no fixed head start."""
    marker = f"iperf3 -s -1 -p {port}"
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "exec", worker, "--name", line, "--", "timeout",
                             str(seconds), *marker.split()], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or any(tcp_sockets(p, port, "LISTEN") for p in pids_with(marker)),
                 timeout=60, what=f"iperf3's server on {worker} to listen on port {port}")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    assert proc.poll() is None, f"iperf3's server on {worker} exited with {proc.returncode}"
    return proc


def iperf3_connections(port: int) -> int:
    """Established connections at the iperf3 server started by iperf3_server on `port` (its control
    connection, then one per stream)."""
    return max((tcp_sockets(p, port, "ESTABLISHED") for p in pids_with(f"iperf3 -s -1 -p {port}")), default=0)
