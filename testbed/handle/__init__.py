"""One handle for a running testbed, wherever it lives: `open_testbed(NAME)`.

A testbed on this host and one spread over several hosts answer the same methods
(testbed.handle.base.Testbed): the CLI asks the handle, never where the testbed lives. Which one
a name is: a testbed is spread over hosts when this machine holds only its controller's record
(testbed.cluster.controller) and no state of its own for it.
"""

from __future__ import annotations

from testbed.errors import StateError
from testbed.handle.base import Testbed

__all__ = ["Testbed", "open_testbed", "resolve", "up_names"]


def up_names() -> tuple[list[str], list[str]]:
    """The testbeds that are up: (those with their state here, those spread over hosts)."""
    from testbed import store
    from testbed.cluster import controller

    local = store.list_names()
    return local, [n for n in controller.list_names() if n not in local]


def resolve(name: str | None) -> str:
    """The testbed a command acts on: NAME, or the only one that is up (here or over hosts)."""
    local, spread = up_names()
    up = local + spread
    if not name:
        if not up:
            raise StateError("no testbed is up: start one with `testbed up TOPOLOGY`")
        if len(up) > 1:
            raise StateError(f"{len(up)} testbeds are up ({', '.join(up)}): say which with --name")
        return up[0]
    if name not in up:
        hint = f"; up: {', '.join(up)}" if up else "; none is up (testbed up TOPOLOGY)"
        raise StateError(f"no testbed named {name!r} is up{hint}")
    return name


def open_testbed(name: str | None) -> Testbed:
    """The handle of testbed NAME (or of the only one up)."""
    from testbed import store

    name = resolve(name)
    if store.exists(name):
        from testbed.handle.local import LocalTestbed

        return LocalTestbed(name)
    from testbed.handle.hosts import HostsTestbed

    return HostsTestbed(name)
