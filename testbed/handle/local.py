"""A testbed on this host: the agent's operations, called in process (testbed.agent.ops)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from testbed.agent import ops
from testbed.handle.base import Note, Testbed


class LocalTestbed(Testbed):
    def __init__(self, name: str):
        self.name = name

    def topology(self) -> Any:
        from testbed.faults import control

        return control.Handle(self.name).topo

    def dilation(self) -> float:
        from testbed.faults import control

        return control.Handle(self.name).dilation

    def play(self, scenario: Any, *, hang_after: float | None = None, timeout: float | None = None,
             echo: Callable[[str], None] | None = None) -> Any:
        from testbed.faults.player import play

        return play(self.name, scenario, hang_after=hang_after, timeout=timeout, echo=echo)

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

    def stacks(self, workers: set[str] | None = None) -> tuple[list[Any], dict[str, str]]:
        from testbed.jobs import stacks

        got = stacks.take(self.name)
        return [s for s in got if workers is None or s.worker in workers], {}

    def events(self, kinds: list[str] | None = None, follow: bool = False) -> Iterator[dict[str, Any] | Note]:
        from testbed import events

        skipped = [0]
        try:
            for rec in events.read(self.name, follow=follow, skipped=skipped):
                if kinds is None or rec["kind"] in kinds:
                    yield rec
        except KeyboardInterrupt:   # (the end of -f)
            pass
        if skipped[0]:
            yield Note(None, f"{skipped[0]} line(s) of {events.path(self.name)} are not events and were skipped")

    def logs(self, node: str, out: Callable[[str], None], follow: bool = False, tail: int | None = None) -> tuple[int, str]:
        end = ops.logs(self.name, node, follow, tail, out)
        return end["shown"], end["directory"]

    def top(self, interval: float, runs: str | None, live: bool = False) -> Any:
        from testbed.observe.top import Top

        return _LocalTop(Top(self.name, interval, runs))


class _LocalTop:
    """testbed.observe.top.Top as the handle's sampler: its tiers read at once (the testbed checked)."""

    def __init__(self, top: Any):
        self._top = top
        self.name, self.interval = top.name, top.interval
        try:
            self.tiers = top.refresh().tiers
        except BaseException:
            top.close()
            raise

    def sample(self) -> dict[str, Any]:
        return self._top.sample()

    def settle(self, doc: dict[str, Any]) -> dict[str, Any]:
        return doc

    def close(self) -> None:
        self._top.close()
