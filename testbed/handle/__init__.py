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


def resolve(name: str | None, *, across_hosts: bool = True, verb: str = "this command") -> str:
    """The testbed a command acts on: NAME, or the only one that is up. across_hosts=False: the verb
    does not work on a testbed over several hosts, and such a testbed is refused with a sentence
    saying what to do instead."""
    local, spread = up_names()
    if not name:
        up = local + spread
        if not up:
            raise StateError("no testbed is up: start one with `testbed up TOPOLOGY`")
        if len(up) > 1:
            raise StateError(f"{len(up)} testbeds are up ({', '.join(up)}): say which with --name")
        name = up[0]
    if name in spread:
        if across_hosts:
            return name
        raise StateError(f"testbed {name!r} spans several hosts, and {verb} does not work across hosts yet "
                         f"(up, down, status, ls, exec, link, run, node, partition, heal, logs, ps, top, graph, "
                         f"events, stacks, capture, scenario, cp and cleanup do; attach runs ssh to the node's host): "
                         f"run it on the node's host (`testbed status {name}` shows where each node is)")
    if name not in local:
        up = local + spread
        hint = f"; up: {', '.join(up)}" if up else "; none is up (testbed up TOPOLOGY)"
        raise StateError(f"no testbed named {name!r} is up{hint}")
    return name


def open_testbed(name: str | None, *, verb: str = "this command") -> Testbed:
    """The handle of testbed NAME (or of the only one up)."""
    from testbed import store

    name = resolve(name, verb=verb)
    if store.exists(name):
        from testbed.handle.local import LocalTestbed

        return LocalTestbed(name)
    from testbed.handle.hosts import HostsTestbed

    return HostsTestbed(name)
