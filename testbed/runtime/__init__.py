"""Where a worker's processes live: one interface, several backends (netns, docker)."""

from __future__ import annotations

from testbed.runtime.base import Runtime

DEFAULT_RUNTIME = "netns"
RUNTIMES = ("netns", "docker")


def get_runtime(kind: str, testbed: str, *, net_admin: bool = False) -> Runtime:
    """The runtime backend `kind` for testbed `testbed`. net_admin: workers get CAP_NET_ADMIN (a job
    can then change or remove its own links' shaping); without it they cannot touch tc."""
    from testbed.errors import TestbedError

    if kind == "netns":
        from testbed.runtime.netns import NetnsRuntime

        return NetnsRuntime(testbed, net_admin=net_admin)
    if kind == "docker":
        from testbed.runtime.docker import DockerRuntime

        return DockerRuntime(testbed, net_admin=net_admin)
    raise TestbedError(f"unknown runtime {kind!r}: choose one of {', '.join(RUNTIMES)}")
