"""A testbed on this host: the agent's operations, called in process (testbed.agent.ops)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from testbed.agent import ops
from testbed.errors import TestbedError
from testbed.handle.base import Note, RunDone, RunOptions, Testbed


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

    def exec(self, node: str, cmd: list[str], out: Callable[[int, str], None],
             progress: Callable[[str], None] = lambda _m: None) -> int:
        import os
        import sys

        from testbed import lifecycle
        from testbed import node_exec

        argv = node_exec.exec_argv(lifecycle.load(self.name), node, cmd)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvp(argv[0], argv)  # the command's status, signals and stdio are the caller's
        except OSError as exc:
            raise CannotRun(f"cannot run {argv[0]}: {exc}") from None
        raise CannotRun("exec returned")   # (never: execvp replaces this process or raises)

    def attach(self, node: str, say: Callable[[str], None] = lambda _m: None) -> int:
        import subprocess

        from testbed import lifecycle
        from testbed import node_exec

        st = lifecycle.load(self.name)
        rt, rec, kind = node_exec.node_target(st, node)
        if kind == "worker" and rt.kind != "bare":
            return rt.attach(node, rec)
        # a plain namespace has the host's hostname: say where the shell is in its prompt
        argv = rt.exec_argv(node, rec, ["/bin/bash", "--norc", "-i"], tty=True,
                            env={"PS1": f"[{self.name}:{node}] \\w\\$ ", "TESTBED_NODE": node})
        return subprocess.call(argv)

    def capture_target(self, a: str, b: str | None, at: str | None, direction: str) -> Any:
        from testbed.observe.capture_target import resolve

        return resolve(self.name, a, b, at=at, direction=direction)

    def capture(self, target: Any, write: str, *, a: str, b: str | None, at: str | None, direction: str, count: int,
                duration: str, duration_s: float, snaplen: int | None, bpf: str | None,
                say: Callable[[str, str | None], None]) -> int:
        from testbed.observe.capture_file import capture_to

        return capture_to(self.name, target, write, count=count, duration_s=duration_s, snaplen=snaplen, bpf=bpf,
                          say=say)

    def cp(self, src: str, dst: str) -> int:
        from testbed.node_files import copy_here

        copy_here(self.name, src, dst)
        return 0

    def graph_source(self) -> Any:
        from testbed.observe.graph import LocalSource

        return LocalSource(self.name)

    def run(self, cmd: list[str], options: RunOptions = RunOptions(), *, say: Callable[[str], None] = lambda _m: None,
            on_output: Callable[[str, str], None] | None = None) -> RunDone:
        from testbed.jobs import calibration
        from testbed.jobs.run import run as run_job
        from testbed.jobs.target import cluster_from_state

        o = options
        cluster = cluster_from_state(self.name)
        machine = calibration.constants_or_none(progress=say)
        result = run_job(cluster, cmd, workers=o.workers, nproc_per_node=o.nproc_per_node, master=o.master,
                         port=o.port, timeout=o.timeout, env=dict(o.env), probe=o.probe, grace=o.grace,
                         machine=machine, emulated_clock=not o.real_clock, real=o.real, record_ops=o.record_ops,
                         replay=o.replay, job=o.job)
        return RunDone(result.run_dir, result.rc, result.summary)

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

class CannotRun(TestbedError):
    """The command could not be started: exit status 127, as a shell says it."""

    exit_code = 127
