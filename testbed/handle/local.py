"""A testbed on this host: the agent's operations, called in process (testbed.agent.ops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testbed.agent import ops
from testbed.handle.base import Testbed


class LocalTestbed(Testbed):
    def __init__(self, name: str):
        self.name = name

    def status(self) -> dict[str, Any]:
        return ops.status(self.name)

    def down(self, progress: Callable[[str], None] = lambda _m: None) -> list[str]:
        from testbed import lifecycle

        return lifecycle.down(self.name)

    def link_show(self) -> list[dict[str, Any]]:
        return ops.link_show(self.name)

    def link_set(self, a: str, b: str, changes: dict[str, Any], direction: str = "both") -> dict[str, Any]:
        return ops.link_set(self.name, a, b, changes, direction)

    def link_down(self, a: str, b: str) -> bool:
        return ops.link_down(self.name, a, b)

    def link_up(self, a: str, b: str) -> list[str]:
        return ops.link_up(self.name, a, b)

    def link_reset(self, a: str, b: str) -> None:
        ops.link_reset(self.name, a, b)

    def partition(self, groups: list[list[str]]) -> list[list[str]]:
        return ops.partition(self.name, groups)

    def heal(self) -> bool:
        return ops.heal(self.name)

    def node(self, verb: str, node: str, cpus: float | None = None) -> int | None:
        return ops.node(self.name, verb, node, cpus)

    def ps(self, nodes: list[str], all_nodes: bool = False) -> tuple[list[dict[str, Any]], dict[str, str]]:
        return ops.ps(self.name, nodes, all_nodes), {}
