"""The runtime interface: how a worker's processes are placed and reached.

Lifecycle during `testbed up` (the orchestrator in testbed/lifecycle.py):
  1. prepare_netns(node, netns) for every worker: make the named network
     namespace /run/netns/<netns> exist (netns runtime: a plain `ip netns add`;
     docker: start the container with no network and bind its namespace there).
  2. the data plane builds links, addresses, routes and shaping in it.
  3. start(node, netns, env, hosts): start the worker's long-lived init
     (hostname = node name, /etc/hosts with every worker, private /tmp, limits).
During `down`: remove(node) for every worker, then the data plane teardown.

All state a runtime needs later (PIDs, container ids) it records through
`record()` into the testbed's state, so that commands in other shells
(exec, attach, cleanup) work from the state file alone.
"""

from __future__ import annotations

import abc
import subprocess
from typing import Any, Callable, Mapping, Sequence

from testbed.topology.model import Node


class PendingStart:
    """Workers being started: finish() -> their records (in order); abort() undoes the start."""

    def __init__(self, finish: Callable[[], list[dict[str, Any]]], abort: Callable[[], None],
                 records: list[dict[str, Any]] | None = None):
        self.finish = finish
        self.abort = abort
        self.records = records or []  # what is known already (for the state: cleanup after kill -9)


class Runtime(abc.ABC):
    kind: str = "?"

    def __init__(self, testbed: str):
        self.testbed = testbed

    # -- lifecycle -------------------------------------------------------------
    @abc.abstractmethod
    def prepare_netns(self, node: Node, netns: str) -> None:
        """Make network namespace `netns` exist for worker `node` (before links are built)."""

    @abc.abstractmethod
    def start(self, node: Node, netns: str, env: Mapping[str, str], hosts: Mapping[str, str]) -> dict[str, Any]:
        """Start the worker's init; return what must be recorded to reach it later (pid, id)."""

    @abc.abstractmethod
    def remove(self, node: str, record: Mapping[str, Any]) -> None:
        """Stop and remove everything of this worker (idempotent; tolerates half-made workers)."""

    # -- batches (backends override these where overlapping the work pays) ------
    def begin_start_many(self, items: Sequence[tuple[Node, str, Mapping[str, str], Mapping[str, str]]]
                         ) -> "PendingStart":
        """Start workers in the background while the caller builds the fabric; the returned
        handle's finish() waits for them (-> records), abort() removes them. Default: all the
        work happens in finish()."""
        return PendingStart(finish=lambda: self.start_many(items), abort=lambda: None)

    def prepare_many(self, items: Sequence[tuple[Node, str]]) -> None:
        for node, netns in items:
            self.prepare_netns(node, netns)

    def start_many(self, items: Sequence[tuple[Node, str, Mapping[str, str], Mapping[str, str]]]) -> list[dict[str, Any]]:
        return [self.start(*item) for item in items]

    def remove_many(self, items: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        for node, record in items:
            self.remove(node, record)

    # -- reaching a worker -----------------------------------------------------
    @abc.abstractmethod
    def exec_argv(self, node: str, record: Mapping[str, Any], argv: Sequence[str], *,
                  env: Mapping[str, str] | None = None, tty: bool = False, workdir: str | None = None) -> list[str]:
        """The host command line that runs argv inside the worker (for subprocess)."""

    def exec(self, node: str, record: Mapping[str, Any], argv: Sequence[str], **kw: Any) -> int:
        """Run argv inside the worker with stdio passed through; return its exit status."""
        return subprocess.call(self.exec_argv(node, record, argv, **kw))

    def attach(self, node: str, record: Mapping[str, Any]) -> int:
        """An interactive shell inside the worker; leaving it leaves the worker running."""
        return self.exec(node, record, ["/bin/bash", "-l"], tty=True)

    @abc.abstractmethod
    def pid(self, node: str, record: Mapping[str, Any]) -> int | None:
        """PID (host view) of the worker's init, or None if it is not running."""

    # -- control (faults, stragglers) ------------------------------------------
    def stop(self, node: str, record: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def kill(self, node: str, record: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def restart(self, node: str, record: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def set_limits(self, node: str, record: Mapping[str, Any], *, cpus: float | None = None,
                   memory_bytes: int | None = None) -> None:
        raise NotImplementedError
