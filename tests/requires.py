"""What a test needs from the machine, and whether a missing piece may skip it or must fail it.

Every skip for a missing tool goes through here, so that a machine which should have the tool
(CI) cannot pass by skipping:

    pytestmark = [pytest.mark.requires("sshd")]        # a module, a class or a test
    requires.need("tcpdump")                            # inside a test or fixture
    requires.need("tun", why="delay lines need TAP devices")

Without the tool the test skips, saying what is missing and how to install it. With the tool's
require flag set, it fails instead:

    TESTBED_REQUIRE=iperf3,tun      these tools (comma- or space-separated)
    TESTBED_REQUIRE_IPERF3=1        one tool (TESTBED_REQUIRE_DOCKER and _NETEM predate the list)
    TESTBED_REQUIRE=all             every tool below except those of another kind of machine
                                    (netem, gpu), and any other skip fails too unless its reason
                                    names such a machine (see MACHINE_BOUND): what .ci/run sets

Keep this module light (no torch, no testbed imports at module level): the stock-kernel VM
stage imports it through conftest.py.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from functools import lru_cache
from typing import Callable

import pytest


def _which(*names: str) -> Callable[[], bool]:
    return lambda: all(shutil.which(n) for n in names)


def _module(name: str) -> Callable[[], bool]:
    def ok() -> bool:
        import importlib.util

        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    return ok


def _root() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        from testbed.net import netns

        name = f"tbprobe-test-{uuid.uuid4().hex[:8]}"
        netns.create(name)
        netns.delete(name)
        return True
    except Exception:
        return False


def _sshd() -> bool:
    from testbed.cluster import emulate

    return os.geteuid() == 0 and os.path.exists(emulate.SSHD) and bool(shutil.which("ssh-keygen")) \
        and bool(shutil.which("ssh"))


def _cgroups() -> bool:
    from testbed.runtime import cgroups

    try:
        return cgroups.hierarchy() is not None
    except Exception:
        return False


def _netem() -> bool:
    from testbed.net import capabilities

    return os.geteuid() == 0 and capabilities.probe().netem


def _gpu() -> bool:
    return bool(shutil.which("nvidia-smi")) and os.path.exists("/dev/nvidia0")


# tool -> (is it there?, what it is / how to get it)
TOOLS: dict[str, tuple[Callable[[], bool], str]] = {
    "root": (_root, "root and network namespaces (run as root)"),
    "cgroups": (_cgroups, "a cgroup filesystem (cpu, memory controllers)"),
    "tun": (lambda: os.path.exists("/dev/net/tun"), "/dev/net/tun (delay lines are TAP devices)"),
    "iperf3": (_which("iperf3"), "iperf3 (apt-get install iperf3)"),
    "ping": (_which("ping"), "ping (apt-get install iputils-ping)"),
    "tcpdump": (_which("tcpdump"), "tcpdump (apt-get install tcpdump)"),
    "nft": (_which("nft"), "nftables (apt-get install nftables)"),
    "shellcheck": (_which("shellcheck"), "shellcheck (apt-get install shellcheck)"),
    "chromium": (lambda: bool(shutil.which("chromium") or shutil.which("chromium-browser")),
                 "Debian's chromium (apt-get install chromium)"),
    "sshd": (_sshd, "root, openssh-server and openssh-client (emulated hosts each run an sshd)"),
    "scp": (_which("scp"), "scp (apt-get install openssh-client)"),
    "sudo": (lambda: bool(shutil.which("sudo")) and os.path.isdir("/etc/sudoers.d"),
             "sudo with /etc/sudoers.d (apt-get install sudo)"),
    "setpriv": (_which("setpriv"), "setpriv (util-linux)"),
    "unshare": (_which("unshare", "nsenter"), "unshare and nsenter (util-linux)"),
    "docker": (lambda: True, "a Docker daemon and the worker image (scripts/dockerd.sh start; make image)"),
    "pexpect": (_module("pexpect"), "pexpect (pip install -e '.[test]')"),
    "mininet": (_module("mininet.topo"), "mininet (a dependency: pip install -e .)"),
    "chakra": (_module("chakra.schema.protobuf.et_def_pb2"), "mlc-chakra (pip install -e '.[test]')"),
    "torchft": (_module("torchft"), "torchft (pip install -e '.[ft]')"),
    "py-spy": (_which("py-spy"), "py-spy (a dependency: pip install -e .)"),
    "wheelhouse": (lambda: True, "a package index pip can reach (testbed install builds a wheelhouse)"),
    "netem": (_netem, "sch_netem in the running kernel (make test-kernel boots one that has it)"),
    "gpu": (_gpu, "an NVIDIA GPU"),
}

# Tools of another kind of machine: TESTBED_REQUIRE=all does not ask for them, and a skip whose
# reason matches this is never turned into a failure by it (make test-kernel and the GPU checks
# run those tests where they can pass).
MACHINE_BOUND = ("netem", "gpu")
MACHINE_BOUND_REASON = re.compile(r"netem|\bGPU|CUDA|nvidia", re.IGNORECASE)


def _flags() -> set[str]:
    raw = os.environ.get("TESTBED_REQUIRE", "")
    return {t for t in re.split(r"[\s,]+", raw.strip().lower()) if t}


def strict() -> bool:
    """TESTBED_REQUIRE=all: no skip may pass silently (other than a machine-bound one)."""
    return "all" in _flags()


def required(tool: str) -> bool:
    """Must this tool be there (a skip for it fails)?"""
    if tool not in TOOLS:
        raise KeyError(f"unknown tool {tool!r}: add it to tests/requires.py TOOLS")
    if os.environ.get(f"TESTBED_REQUIRE_{tool.upper().replace('-', '_')}") == "1":
        return True
    flags = _flags()
    return tool in flags or ("all" in flags and tool not in MACHINE_BOUND)


@lru_cache(maxsize=None)
def available(tool: str) -> bool:
    check, _ = TOOLS[tool]
    return bool(check())


def reason(tool: str, why: str = "") -> str:
    what = TOOLS[tool][1]
    return f"needs {what}" + (f": {why}" if why else "")


def need(tool: str, ok: bool | None = None, why: str = "", module: bool = False) -> None:
    """Skip the test unless `tool` is there (`ok`, when given, is the caller's own check);
    fail instead when the tool is required (its flag, or TESTBED_REQUIRE=all). module: called
    while a test module is imported (skips the whole module)."""
    if tool not in TOOLS:
        raise KeyError(f"unknown tool {tool!r}: add it to tests/requires.py TOOLS")
    there = available(tool) if ok is None else ok
    if there:
        return
    msg = reason(tool, why)
    if required(tool):
        flag = "TESTBED_REQUIRE=" + os.environ.get("TESTBED_REQUIRE", "") if _flags() else \
            f"TESTBED_REQUIRE_{tool.upper().replace('-', '_')}=1"
        pytest.fail(f"{msg} ({flag} is set, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(msg, allow_module_level=module)
