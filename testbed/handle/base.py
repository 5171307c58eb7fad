"""What every testbed answers, on one host or spread over several (testbed.handle)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunDone:
    """How a run ended: its directory (spread: merged on the controller), its exit status, its
    summary when at hand (None: read it from the directory), and the hosts that had trouble, with why."""
    run_dir: Any
    rc: int
    summary: dict[str, Any] | None = None
    problems: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunOptions:
    """What `testbed run` asks for besides its command (its options; testbed.jobs.run.run says each)."""
    workers: str = "all"                 # "all" or a comma list of workers
    nproc_per_node: int = 1
    master: str | None = None
    port: int | None = None
    timeout: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    probe: bool = True
    grace: float = 5.0
    real_clock: bool = False
    real: list[str] | None = None        # --real: the workers whose ranks run; the others are phantoms
    record_ops: bool = False
    replay: str | None = None
    job: Any = None                      # a job of groups (testbed.jobs.groups): one host only


@dataclass(frozen=True)
class Note:
    """What a host said besides its answer: why it failed (failed), or a remark; host None: here."""
    host: str | None
    text: str
    failed: bool = False


class Testbed(ABC):
    """A running testbed. Over several hosts, each change is made by every host on what it holds,
    and a host that fails makes the call fail with each host's word (testbed.handle.hosts)."""

    name: str
    hosts: tuple[str, ...] = ()   # the hosts it is spread over; () on this host alone

    def host_of(self, node: str) -> str | None:
        """The host that holds `node` (None: this one, the testbed is not spread)."""
        return None

    @abstractmethod
    def topology(self) -> Any:
        """Its topology (testbed.topology.model.Topology)."""

    @abstractmethod
    def dilation(self) -> float:
        """The time dilation factor it runs at (1.0: real time)."""

    @abstractmethod
    def play(self, scenario: Any, *, hang_after: float | None = None, timeout: float | None = None,
             echo: Callable[[str], None] | None = None) -> Any:
        """Run the scenario's job and play its steps against it (testbed.faults.player.PlayResult)."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """The `status --json` document (spread: each host's, under "hosts", or why it is lost)."""

    @abstractmethod
    def down(self, progress: Callable[[str], None] = lambda _m: None) -> list[str]:
        """Take it down everywhere; what is worth a warning."""

    @abstractmethod
    def link_show(self) -> list[dict[str, Any]]:
        """Every link: state, why it is down, its profile now (emulated units)."""

    @abstractmethod
    def link_set(self, a: str, b: str, changes: dict[str, Any], direction: str = "both") -> dict[str, Any]:
        """Change link a-b's profile; its profiles now ({"ab", "ba"})."""

    @abstractmethod
    def link_down(self, a: str, b: str) -> bool:
        """Link a-b down; False if it was down already."""

    @abstractmethod
    def link_up(self, a: str, b: str) -> list[str]:
        """Undo link_down; what still holds it down."""

    @abstractmethod
    def link_reset(self, a: str, b: str) -> None:
        """Link a-b back to the topology's profile, and up."""

    @abstractmethod
    def partition(self, groups: list[list[str]]) -> list[list[str]]:
        """Split the workers into groups; the groups as resolved (switches stand for their workers)."""

    @abstractmethod
    def heal(self) -> bool:
        """Undo partition; False if there was none."""

    @abstractmethod
    def node(self, verb: str, node: str, cpus: float | None = None) -> int | None:
        """`node VERB NODE` (down, up, crash, slow, restore); crash: how many processes it killed."""

    @abstractmethod
    def ps(self, nodes: list[str], all_nodes: bool = False) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The processes of the nodes named (default: every worker; all_nodes: switches too), in
        topology order (spread: each row with its `host`), and the hosts that did not answer, with why."""

    @abstractmethod
    def stacks(self, workers: set[str] | None = None) -> tuple[list[Any], dict[str, str]]:
        """Every rank's stack (testbed.jobs.stacks.RankStack; of `workers` alone), in rank order, and
        the hosts that did not answer, with why."""

    @abstractmethod
    def events(self, kinds: list[str] | None = None, follow: bool = False) -> Iterator[dict[str, Any] | Note]:
        """The events from `up` on (of `kinds`), in time order (spread: each with its `host`); with
        follow, then each new one as it comes (spread: in arrival order), until a Ctrl-C or `down`.
        Notes say what a host said besides, and which failed."""

    @abstractmethod
    def logs(self, node: str, out: Callable[[str], None], follow: bool = False, tail: int | None = None) -> tuple[int, str]:
        """The output of the jobs started in `node`, passed to out(text) as it is read (made inert);
        with follow, what comes next too, until a Ctrl-C. Returns (files shown, where its jobs write)."""

    @abstractmethod
    def top(self, interval: float, runs: str | None, live: bool = False) -> Any:
        """A sampler of its links, workers and job: sample() waits for the next document
        (testbed.observe.top's shape; spread: merged, with each host's state under "hosts"), tiers,
        name, interval, close(), settle(doc) (after close: spread, a host that had failed says so).
        live: for the view (spread: shown sooner with what is there)."""

    @abstractmethod
    def exec(self, node: str, cmd: list[str], out: Callable[[int, str], None],
             progress: Callable[[str], None] = lambda _m: None) -> int:
        """Run cmd inside `node`; its exit status. On this host this process becomes the command (its
        stdio and signals the caller's: it does not return); spread: run on the node's host, its
        output passed to out(fd, text) as it comes, a Ctrl-C here passed on to it there."""

    @abstractmethod
    def attach(self, node: str, say: Callable[[str], None] = lambda _m: None) -> int:
        """An interactive shell inside `node`; its exit status. Spread: ssh(1) -t to the node's host
        (this process becomes it: a terminal all the way), say() tells the command it runs."""

    @abstractmethod
    def graph_source(self) -> Any:
        """Where the web page's documents come from (testbed.observe.graph: LocalSource, or the
        hosts' for a testbed over several hosts)."""

    @abstractmethod
    def capture_target(self, a: str, b: str | None, at: str | None, direction: str) -> Any:
        """The link end `testbed capture A [B] --at --direction` names (testbed.observe.capture_target.Target),
        checked: an unknown node or link is refused before anything starts."""

    @abstractmethod
    def capture(self, target: Any, write: str, *, a: str, b: str | None, at: str | None, direction: str, count: int,
                duration: str, duration_s: float, snaplen: int | None, bpf: str | None,
                say: Callable[[str, str | None], None]) -> int:
        """Capture `target` into `write` (a file, or - for stdout) until its bounds or a Ctrl-C; a
        valid pcap however it ends; say(line, style) what it does (for stderr). The exit status.
        Spread: on the end's host, the pcap stream written here as it comes."""

    @abstractmethod
    def cp(self, src: str, dst: str) -> int:
        """`testbed cp SRC DST` (NODE:PATH, a path here, or - for a tar stream on stdin or stdout);
        the exit status. Spread: streamed through the controller's SSH connections."""

    @abstractmethod
    def run(self, cmd: list[str], options: RunOptions = RunOptions(), *, say: Callable[[str], None] = lambda _m: None,
            on_output: Callable[[str, str], None] | None = None) -> RunDone:
        """`testbed run`: cmd on the workers the torchrun way (or a job of groups: one host only),
        measured; say() what it does, on_output(host, line) a rank's line from a host (spread)."""
