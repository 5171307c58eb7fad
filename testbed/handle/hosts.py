"""A testbed spread over several hosts: each call goes to the agent on every host at once (or to
one, for a read every host answers alike), and their answers are merged into what a testbed on
one host answers (testbed.cluster.agents carries the requests; testbed.agent.protocol types them).

Every host keeps the whole topology, the links' records and the nodes' faults, and acts on what it
holds (its link ends, its switches' routes, its workers), so a change goes to every host. A call
fails when any host fails it: HostsFailed says each host's word, and which hosts made the change.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import ValidationError

from testbed.errors import TestbedError
from testbed.handle.base import Note, RunDone, RunOptions, Testbed

_DONE = object()


class HostsFailed(TestbedError):
    """Some hosts of a testbed over several hosts failed a call: each one's word, and where it was done."""

    def __init__(self, failed: dict[str, Any], done: list[str]):
        whys: dict[str, list[str]] = {}
        for host, f in failed.items():
            whys.setdefault(f.why, []).append(host)
        text = "; ".join(f"{why} (on {', '.join(hosts)})" for why, hosts in whys.items())
        super().__init__(text + (f"; done on {', '.join(done)}" if done else ""))
        self.failed, self.done = failed, done
        self.exit_code = max((f.exit_code for f in failed.values()), default=1)


class AcrossHosts(TestbedError):
    """What cannot run across hosts from the controller as asked: says what to run instead. Exit 2."""

    exit_code = 2


class HostsTestbed(Testbed):
    def __init__(self, name: str):
        from testbed.cluster import controller

        self.name = name
        self._record = controller.load(name)
        known = {h.name for h in self._record["_hosts"]}
        self.hosts = tuple(h for h in self._record.get("hosts", {}) if h in known)

    def host_of(self, node: str) -> str | None:
        return self._record["placement"].get(node)

    # -- one fan-out, one merge per answer --------------------------------------------------------------------

    def _request(self, op: str, **fields: Any) -> Any:
        """The request, checked here before any host is asked: a bad value names its field."""
        from testbed.agent.protocol import request
        from testbed.running import FaultError

        try:
            return request({"op": op, "name": self.name, **fields})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ())) or op
            raise FaultError(f"{where}: {err.get('msg')} (got {err.get('input')!r})") from None

    def _every(self, op: str, **fields: Any) -> dict[str, Any]:
        """host -> value, from every host; HostsFailed if any failed."""
        from testbed.cluster.agents import HostFailed, ask

        asked = ask(self.name, [self._request(op, **fields)], record=self._record)
        answers = {h: vals[0] for h, vals in asked.items()}
        failed = {h: v for h, v in answers.items() if isinstance(v, HostFailed)}
        if failed:
            raise HostsFailed(failed, [h for h in answers if h not in failed])
        return answers

    def _one(self, op: str, **fields: Any) -> Any:
        """The value from the first host that answers (a read every host answers alike)."""
        from testbed.cluster.agents import HostFailed, ask

        asked = ask(self.name, [self._request(op, **fields)], every=False, record=self._record)
        answers = {h: vals[0] for h, vals in asked.items()}
        for value in answers.values():
            if not isinstance(value, HostFailed):
                return value
        raise HostsFailed(answers, [])

    # -- the calls ------------------------------------------------------------------------------------------------

    def topology(self) -> Any:
        from testbed.topology.model import Topology

        return Topology.from_json(self._record["topology"])

    def dilation(self) -> float:
        return float(self._record.get("time_dilation") or 1.0)

    def play(self, scenario: Any, *, hang_after: float | None = None, timeout: float | None = None,
             echo: Callable[[str], None] | None = None) -> Any:
        """Every step applied by every host to what it holds (testbed.cluster.scenario)."""
        from testbed.cluster import scenario as hosts_scenario

        return hosts_scenario.play(self.name, scenario, hang_after=hang_after, timeout=timeout, echo=echo)

    def status(self) -> dict[str, Any]:
        """{"name", "status", "hosts": {host: its status, or {"lost": why}}, "placement", "cut_links",
        "time_dilation"}."""
        from testbed.cluster.agents import HostFailed, ask

        answers = ask(self.name, [self._request("status")], timeout=120, record=self._record)
        hosts = {h: ({"lost": v.why} if isinstance(v, HostFailed) else v.model_dump())
                 for h, (v,) in answers.items()}
        rec = self._record
        return {"name": self.name, "status": rec.get("status"), "hosts": hosts, "placement": rec["placement"],
                "cut_links": rec.get("cut_links", []), "time_dilation": rec.get("time_dilation")}

    def down(self, progress: Callable[[str], None] = lambda _m: None) -> list[str]:
        from testbed.cluster import controller

        left = controller.down(self.name, progress=progress)
        if left:
            raise TestbedError(f"testbed {self.name} is down except on: "
                               + "; ".join(f"{h}: {why}" for h, why in left.items())
                               + f". Run `testbed down {self.name}` again once they are reachable.")
        return []

    def link_show(self) -> list[dict[str, Any]]:
        return [r.model_dump() for r in self._one("link.show")]

    def link_set(self, a: str, b: str, changes: dict[str, Any], direction: str = "both") -> dict[str, Any]:
        answers = self._every("link.set", a=a, b=b, changes=changes, direction=direction)
        return next(iter(answers.values())).model_dump()

    def link_down(self, a: str, b: str) -> bool:
        return any(self._every("link.down", a=a, b=b).values())

    def link_up(self, a: str, b: str) -> list[str]:
        left: list[str] = []
        for reasons in self._every("link.up", a=a, b=b).values():
            left += [r for r in reasons if r not in left]
        return left

    def link_reset(self, a: str, b: str) -> None:
        self._every("link.reset", a=a, b=b)

    def partition(self, groups: list[list[str]]) -> list[list[str]]:
        return next(iter(self._every("partition", groups=groups).values()))

    def heal(self) -> bool:
        return any(self._every("heal").values())

    def node(self, verb: str, node: str, cpus: float | None = None) -> int | None:
        """Refused here, before any host is asked, where the hosts would refuse it alike (an unknown
        node, crash or slow of a switch, no CPUs); the node's host says how many processes it killed."""
        from testbed.running import FaultError
        from testbed.topology.model import Topology

        topo = Topology.from_json(self._record["topology"])
        n = topo.nodes.get(node)
        if n is None or node not in self._record["placement"]:
            some = ", ".join(list(topo.nodes)[:12]) + (" ..." if len(topo.nodes) > 12 else "")
            raise FaultError(f"node: testbed {self.name!r} has no node {node!r} (nodes: {some})")
        if verb == "crash" and not n.is_worker:
            raise FaultError(f"node: {node} is a switch; crash acts on workers (use `node down` for a switch)")
        if verb == "slow" and not n.is_worker:
            raise FaultError(f"node: {node} is a switch; slow acts on workers")
        if verb == "slow" and not (cpus is not None and cpus > 0):
            raise FaultError(f"--cpus must be positive (got {cpus})")
        answers = self._every("node", verb=verb, node=node, cpus=cpus)
        return answers.get(self._record["placement"][node])

    def ps(self, nodes: list[str], all_nodes: bool = False) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Asks the hosts that hold `nodes` (every host, none named), each for its own."""
        from testbed.cluster.agents import HostFailed, ask
        from testbed.errors import StateError

        placement: dict[str, str] = self._record["placement"]
        bad = [n for n in nodes if n not in placement]
        if bad:
            raise StateError(f"testbed {self.name!r} has no node {bad[0]!r}")
        groups: dict[str, list[str]] = {}
        for n in nodes:
            groups.setdefault(placement[n], []).append(n)
        asks = {h: [self._request("ps", nodes=groups.get(h, []), all_nodes=all_nodes)] for h in (groups or self.hosts)}
        rows, failed = [], {}
        for host, (value,) in sorted(ask(self.name, asks, timeout=120, record=self._record).items()):
            if isinstance(value, HostFailed):
                failed[host] = value.why
            else:
                rows += [{**row.model_dump(), "host": host} for row in value]
        order = {n: i for i, n in enumerate(placement)}
        rows.sort(key=lambda r: (order.get(r["node"], len(order)), r["nspid"] or 0, r["pid"]))
        return rows, failed

    def stacks(self, workers: set[str] | None = None) -> tuple[list[Any], dict[str, str]]:
        """Asks the hosts that hold the testbed's workers (those in `workers`); identical stacks are
        grouped across hosts by the caller (testbed.jobs.stacks)."""
        from testbed.cluster.agents import HostFailed, ask
        from testbed.jobs import stacks

        placement: dict[str, str] = self._record["placement"]
        kinds = {n.get("name"): n.get("kind") for n in (self._record.get("topology") or {}).get("nodes") or []}
        hosts = {placement[n] for n in placement
                 if kinds.get(n, "worker") == "worker" and (workers is None or n in workers)}
        by_host, failed = {}, {}
        for host, (value,) in ask(self.name, {h: [self._request("stacks")] for h in sorted(hosts)},
                                  timeout=120, record=self._record).items():
            if isinstance(value, HostFailed):
                failed[host] = value.why
            else:
                by_host[host] = stacks.from_json([r.model_dump() for r in value], host)
        got = stacks.merge_hosts(by_host, placement)
        return [s for s in got if workers is None or s.worker in workers], failed

    def run(self, cmd: list[str], options: RunOptions = RunOptions(), *, say: Callable[[str], None] = lambda _m: None,
            on_output: Callable[[str, str], None] | None = None) -> RunDone:
        """Every host runs its workers' ranks (`testbed run --this-host-only` there, the same master and
        port); their run directories come back here, merged, one run (testbed.cluster.controller)."""
        from pathlib import Path

        from testbed.cluster import job as hosts_job
        from testbed.errors import RunError
        from testbed.jobs.groups import is_job_file

        o = options
        if o.job is not None or is_job_file(cmd):
            raise RunError(f"testbed {self.name} spans several hosts: groups run on a testbed of one host only")
        if o.replay and cmd:
            raise RunError("--replay runs no command: give either a command or --replay")
        if not cmd and not o.replay:
            raise RunError("nothing to run: give a command after --")
        if o.replay and (o.real is not None or o.record_ops):
            raise RunError("--replay plays a recorded run to phantoms only: no --real, no --record-ops")
        if (o.real is not None or o.record_ops) and not o.probe:
            raise RunError("--real and --record-ops need the probe (it announces and records the collectives): "
                           "drop --no-probe")
        chosen = None if o.workers == "all" else [w.strip() for w in o.workers.split(",") if w.strip()]
        result = hosts_job.run_job(self.name, cmd, workers=chosen, nproc_per_node=o.nproc_per_node, port=o.port,
                                    timeout=o.timeout, env=dict(o.env), probe=o.probe, real_clock=o.real_clock,
                                    grace=o.grace, progress=say, on_output=on_output, real=o.real,
                                    record_ops=o.record_ops, replay=o.replay)
        return RunDone(Path(result["run_dir"]), int(result["rc"]), None, dict(result.get("problems") or {}))

    def top(self, interval: float, runs: str | None, live: bool = False) -> Any:
        """Every host's agent samples its part; the documents merged (testbed.cluster.top). runs: a
        directory on the hosts (made absolute here, where it was typed)."""
        import os

        from testbed.cluster import top as hosts_top

        return hosts_top.HostsTop(self.name, interval, os.path.abspath(runs) if runs else None, record=self._record,
                                  first_wait=hosts_top.LIVE_FIRST_WAIT_S if live else hosts_top.FIRST_WAIT_S)

    def exec(self, node: str, cmd: list[str], out: Callable[[int, str], None],
             progress: Callable[[str], None] = lambda _m: None) -> int:
        """On the node's host, by its agent; a Ctrl-C here closes the agent's stdin, which interrupts
        the command there (testbed.agent.commands), and its status still comes back."""
        from testbed.cluster.agents import HostFailed, stream
        from testbed.errors import StateError

        host = self.host_of(node)
        if host is None:
            nodes = list(self._record["placement"])
            raise StateError(f"testbed {self.name!r} has no node {node!r}; nodes: {', '.join(nodes[:12])}"
                             f"{' ...' if len(nodes) > 12 else ''}")
        req = self._request("exec", node=node, argv=cmd)
        end = stream(self.name, req, lambda _h, piece: out(piece.fd, piece.data), hosts=[host],
                     progress=progress, record=self._record)[host]
        if isinstance(end, HostFailed):
            raise HostsFailed({host: end}, [])
        return end.rc

    def attach(self, node: str, say: Callable[[str], None] = lambda _m: None) -> int:
        """ssh(1) -t to the node's host, with the hosts file's key and port and the testbed's known
        hosts: the controller's own SSH sessions carry no terminal."""
        import os
        import shlex
        import shutil
        import sys

        from testbed.cluster.ssh_command import node_host, ssh_argv

        doc, host = node_host(self.name, node)
        argv = ssh_argv(doc, host, ["attach", node, "--name", self.name], tty=True)
        line = shlex.join(argv)
        if shutil.which("ssh") is None:
            raise AcrossHosts(f"{node} is on host {host.name} of testbed {self.name}; attaching there needs ssh(1) "
                              f"(Debian: apt-get install openssh-client), then run `{line}`")
        say(f"{node} is on host {host.name}: {line}")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp("ssh", argv)   # the shell's status, signals and terminal are the user's
        return 255   # (never: execvp replaces this process or raises)

    def capture_target(self, a: str, b: str | None, at: str | None, direction: str) -> Any:
        from testbed.cluster import capture

        return capture.resolve(self.name, a, b, at, direction)

    def capture(self, target: Any, write: str, *, a: str, b: str | None, at: str | None, direction: str, count: int,
                duration: str, duration_s: float, snaplen: int | None, bpf: str | None,
                say: Callable[[str, str | None], None]) -> int:
        """`testbed capture ... --write -` on the end's host (testbed.cluster.capture)."""
        from testbed.cluster import capture
        from testbed.observe.capture_file import until

        args = [a, *([b] if b is not None else []), *(["--at", at] if at else []), "--direction", direction,
                "--count", str(count), "--duration", duration, *(["--filter", bpf] if bpf is not None else []),
                *(["--snaplen", str(snaplen)] if snaplen is not None else [])]
        return capture.capture_to(self.name, target, write, args, until(count, duration_s), say)

    def cp(self, src: str, dst: str) -> int:
        from testbed.cluster.cp import copy_across

        return copy_across(self.name, src, dst)

    def graph_source(self) -> Any:
        from testbed.cluster.graph import HostsSource

        return HostsSource(self.name)

    def logs(self, node: str, out: Callable[[str], None], follow: bool = False, tail: int | None = None) -> tuple[int, str]:
        """Asked of the node's host alone; with follow, a Ctrl-C here ends the stream there."""
        from testbed.cluster.agents import HostFailed, ask, stream
        from testbed.errors import StateError

        host = self.host_of(node)
        if host is None:
            nodes = list(self._record["placement"])
            raise StateError(f"testbed {self.name!r} has no node {node!r}; nodes: {', '.join(nodes[:12])}"
                             f"{' ...' if len(nodes) > 12 else ''}")
        req = self._request("logs", node=node, follow=follow, tail=tail)
        if follow:
            end = stream(self.name, req, lambda _h, text: out(text), hosts=[host], record=self._record)[host]
        else:
            (end,) = ask(self.name, {host: [req]}, timeout=120, record=self._record)[host]
            if not isinstance(end, HostFailed):
                for text in end.items:
                    out(text)
                end = end.end
        if isinstance(end, HostFailed):
            raise HostsFailed({host: end}, [])
        return end.shown, end.directory

    def events(self, kinds: list[str] | None = None, follow: bool = False) -> Iterator[dict[str, Any] | Note]:
        from testbed.cluster.agents import HostFailed, ask, stream
        from testbed.observe.answers import merge

        req = self._request("events", kinds=kinds, follow=follow)

        def note(host: str, value: Any) -> Note | None:
            if isinstance(value, HostFailed):
                return Note(host, value.why, failed=True)
            skipped = value.skipped
            return Note(host, f"{skipped} line(s) of its events were not events and were skipped") if skipped else None

        if not follow:
            got, notes = {}, []
            for host, (value,) in ask(self.name, [req], timeout=120, record=self._record).items():
                if not isinstance(value, HostFailed):
                    got[host] = [r.model_dump() for r in value.items]
                notes.append(note(host, value if isinstance(value, HostFailed) else value.end))
            yield from merge(got)
            yield from (n for n in notes if n is not None)
            return
        came: queue.Queue = queue.Queue()
        stop = threading.Event()

        def run() -> None:
            try:
                stream(self.name, req, lambda host, rec: came.put({**rec.model_dump(), "host": host}),
                       on_end=lambda host, value: came.put(note(host, value)), stop=stop, record=self._record)
            except Exception as exc:  # noqa: BLE001 - the record could not be read: said as a failure
                came.put(Note(None, str(exc), failed=True))
            finally:
                came.put(_DONE)

        ended = threading.Event()
        threading.Thread(target=lambda: (run(), ended.set()), name="events-hosts", daemon=True).start()
        try:
            while True:
                try:
                    got = came.get(timeout=0.5)
                except queue.Empty:
                    continue
                except KeyboardInterrupt:   # every host's stream ends (its agent's stdin closed)
                    stop.set()
                    continue
                if got is _DONE:
                    return
                if got is not None:
                    yield got
        finally:   # (also when the caller stops reading, as on a Ctrl-C while it printed)
            stop.set()
            try:
                ended.wait(60)   # each host's reply, once its stream ended; a second Ctrl-C: stop waiting
            except KeyboardInterrupt:
                pass
