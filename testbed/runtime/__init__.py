"""Where a worker's processes live: one interface, several backends (netns, docker)."""

from __future__ import annotations

from testbed.runtime.base import Runtime

DEFAULT_RUNTIME = "netns"
RUNTIMES = ("netns", "docker")


def get_runtime(kind: str, testbed: str) -> Runtime:
    """The runtime backend `kind` for testbed `testbed`."""
    from testbed.errors import TestbedError

    if kind == "netns":
        from testbed.runtime.netns import NetnsRuntime

        return NetnsRuntime(testbed)
    if kind == "docker":
        from testbed.runtime.docker import DockerRuntime

        return DockerRuntime(testbed)
    raise TestbedError(f"unknown runtime {kind!r}: choose one of {', '.join(RUNTIMES)}")
