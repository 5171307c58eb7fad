"""The controller's end of the agents: requests to the hosts of a testbed, their checked answers.

Each host runs `testbed agent` over one SSH session (testbed.agent.serve), is sent the requests on
its stdin and answers each in order (testbed.agent.protocol). `ask` sends requests and reads the
answers once the agents end; `stream` sends one stream request and passes its items on as they
come, until the streams end or the caller stops them (each agent's stdin closed: its stream ends).

What a host answers is hostile input: every value and item is checked against its op's type, a
line is bounded, and a host that answers out of protocol is a failed host from there on, with what
it said cut short.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from testbed.errors import TestbedError

ASK_TIMEOUT_S = 600.0
LINE_MAX = 16 << 20   # a reply's or an item's line (k=16 status: ~2 MB); a longer one is cut, then refused


class HostFailed(TestbedError):
    """A host could not carry a request out: unreachable, out of protocol, or refused it (its words)."""

    def __init__(self, host: str, why: str, exit_code: int = 1):
        super().__init__(f"{host}: {why}")
        self.host, self.why, self.exit_code = host, why, exit_code


@dataclass
class Streamed:
    """A stream op's answer read whole (by `ask`): its items, then its reply's value."""
    items: list[Any]
    end: Any


@dataclass
class _Conversation:
    """What one host's agent says, line by line, read against the requests it was sent. on_item:
    each item of a stream as it comes (otherwise kept, and the answer is a Streamed)."""
    host: str
    requests: list[Any]
    on_item: Callable[[str, Any], None] | None = None
    hello: bool = False
    values: list[Any] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)
    broken: HostFailed | None = None

    def feed(self, line: str) -> None:
        from testbed.agent import protocol

        if self.broken is not None or not line.strip():
            return
        try:
            if not self.hello:
                protocol.read_hello(line)
                self.hello = True
                return
            if len(self.values) >= len(self.requests):
                raise protocol.ProtocolError("it said more than it was asked")
            req = self.requests[len(self.values)]
            doc = protocol.read_line(line)
            if "item" in doc:
                item = protocol.read_item(req.op, doc)
                if self.on_item is not None:
                    self.on_item(self.host, item)
                else:
                    self.items.append(item)
                return
            try:
                value = protocol.read_reply(req.op, doc)
            except protocol.Refused as exc:
                value = HostFailed(self.host, str(exc), exc.exit_code)
            if req.op in protocol.STREAMS and self.on_item is None and not isinstance(value, HostFailed):
                value = Streamed(self.items, value)
            self.items = []
            self.values.append(value)
        except protocol.ProtocolError as exc:
            self.broken = HostFailed(self.host, str(exc))

    def outcome(self, res: Any) -> list[Any]:
        """Each request's value, or the HostFailed that stands for it, once the agent's command ended
        (res: its RemoteResult, or the exception that ended it)."""
        from testbed.cluster.controller import _why

        out = list(self.values)
        if isinstance(res, BaseException):
            failure = HostFailed(self.host, str(res) or type(res).__name__)
        elif self.broken is not None:
            failure = self.broken
        elif not self.hello:
            said = _why(res) if res.rc != 0 else "no answer"
            if res.rc == 2 and "agent" in (res.stderr or ""):   # a testbed without the agent: older than this one
                said += " (its testbed has no `agent`: run `testbed install` for this version)"
            failure = HostFailed(self.host, said)
        else:
            failure = None
        for req in self.requests[len(out):]:
            out.append(failure or HostFailed(self.host, f"no answer to {req.op} ({_why(res)})"))
        return out


def _answers(host: str, requests: Sequence[Any], res: Any) -> list[Any]:
    """Each request's value (or HostFailed) from what the host's agent wrote, read after it ended."""
    talk = _Conversation(host, list(requests))
    if not isinstance(res, BaseException):
        for line in res.stdout.splitlines():
            talk.feed(line)
    return talk.outcome(res)


def _record(name: str, record: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the controller's record (loaded unless given, as controller.load gives it), host name -> its
    hosts-file entry, the testbed's hosts in order)."""
    from testbed.cluster.controller import load

    doc = record if record is not None else load(name)
    by_name = {h.name: h for h in doc["_hosts"]}
    return doc, by_name, [h for h in doc.get("hosts", {}) if h in by_name]


def ask(name: str, requests: Sequence[Any] | Mapping[str, Sequence[Any]], *, every: bool = True,
        timeout: float = ASK_TIMEOUT_S, record: dict[str, Any] | None = None) -> dict[str, list[Any]]:
    """`requests` (testbed.agent.protocol requests), in order, to the agent on every host of testbed
    `name` at once, or (every=False: a read every host answers alike) to the first host that answers;
    a mapping host -> requests asks those hosts alone, each its own. Returns host -> each request's
    value (a stream op's: a Streamed), or the HostFailed that stands for it. record: the
    controller's record, when the caller has it loaded."""
    from testbed.agent import protocol
    from testbed.cluster.controller import _close, _controls, _parallel

    doc, by_name, hosts = _record(name, record)
    if isinstance(requests, Mapping):
        unknown = [h for h in requests if h not in by_name]
        if unknown:
            raise TestbedError(f"testbed {name} has no host {unknown[0]!r}")
        per_host = {h: list(reqs) for h, reqs in requests.items()}
    else:
        per_host = {h: list(requests) for h in hosts}
    hosts = list(per_host)

    def one(ctl: Any) -> Any:
        stdin = "".join(protocol.request_line(r) + "\n" for r in per_host[ctl.name]).encode()
        return ctl.run([*by_name[ctl.name].testbed_argv, "agent", name], stdin=stdin, timeout=timeout)

    if every or isinstance(requests, Mapping):
        ctls = _controls([by_name[h] for h in hosts], doc.get("known_hosts"), False)
        try:
            return {h: _answers(h, per_host[h], r) for h, r in _parallel(ctls, hosts, one).items()}
        finally:
            _close(ctls)
    tried: dict[str, list[Any]] = {}
    for host in hosts:
        ctls = _controls([by_name[host]], doc.get("known_hosts"), False)
        try:
            return {host: _answers(host, per_host[host], one(ctls[host]))}
        except TestbedError as exc:   # unreachable, timed out: the next host may answer
            tried[host] = [HostFailed(host, str(exc))] * len(per_host[host])
        finally:
            _close(ctls)
    return tried


def stream(name: str, request: Any, on_item: Callable[[str, Any], None], *, hosts: Sequence[str] | None = None,
           on_end: Callable[[str, Any], None] | None = None, stop: threading.Event | None = None,
           progress: Callable[[str], None] = lambda _m: None, timeout: float | None = None,
           record: dict[str, Any] | None = None) -> dict[str, Any]:
    """`request` (a stream op) to the agent on every host of testbed `name` (or on `hosts`) at once, each item passed
    on as it comes: on_item(host, item), from the hosts' threads. Until every host's stream ends,
    `stop` is set, or a Ctrl-C: then each agent's stdin is closed, which ends its stream, and its
    reply is still read (a second Ctrl-C stops waiting). on_end(host, value or HostFailed): as each
    host's stream ends. Returns host -> the same."""
    from testbed.agent import protocol
    from testbed.cluster.controller import _close, _controls, _parallel, _Pipe
    from testbed.cluster.remote import lines

    doc, by_name, every = _record(name, record)
    if hosts is None:
        hosts = every
    elif any(h not in by_name for h in hosts):
        raise TestbedError(f"testbed {name} has no host {next(h for h in hosts if h not in by_name)!r}")
    talks = {h: _Conversation(h, [request], on_item) for h in hosts}
    pipes = {h: _Pipe() for h in hosts}
    for p in pipes.values():
        p.write((protocol.request_line(request) + "\n").encode())
    ends: dict[str, Any] = {}

    def feed(host: str) -> Callable[[str], None]:
        def one(line: str) -> None:
            talk = talks[host]
            talk.feed(line)
            if talk.broken is not None or len(talk.values) == len(talk.requests):
                pipes[host].close()   # answered (or out of protocol): nothing more to ask, the agent ends
        return one

    def one(ctl: Any, stdin: Any) -> Any:
        res: Any
        try:
            res = ctl.run([*by_name[ctl.name].testbed_argv, "agent", name], stdin=stdin, timeout=timeout,
                          on_stdout=lines(feed(ctl.name), LINE_MAX))
        except Exception as exc:  # noqa: BLE001 - the host's failure, read as its answer
            res = exc
        ends[ctl.name] = talks[ctl.name].outcome(res)[0]
        if on_end is not None:
            on_end(ctl.name, ends[ctl.name])
        return ends[ctl.name]

    ctls = _controls([by_name[h] for h in hosts], doc.get("known_hosts"), False)
    try:
        _parallel(ctls, hosts, one, lifeline=True, progress=progress, stop=stop, pipes=pipes)
    finally:
        _close(ctls)
    return {h: ends.get(h, HostFailed(h, "no answer")) for h in hosts}


class Sessions:
    """One agent per host of a testbed, kept open: requests go one after another on the same SSH
    session, each host's replies come in order (a scenario's steps, sent as they fall due, pay no
    handshake). close() ends every agent (its stdin closed)."""

    def __init__(self, name: str, hosts: Sequence[str] | None = None):
        from testbed.cluster.controller import _controls, _parallel, _Pipe
        from testbed.cluster.remote import lines

        doc, by_name, every = _record(name)
        self.hosts = list(hosts if hosts is not None else every)
        self._talks = {h: _Conversation(h, []) for h in self.hosts}
        self._pipes = {h: _Pipe() for h in self.hosts}
        self.ended: dict[str, Any] = {}   # host -> why its session ended
        self._changed = threading.Condition()
        self._sending = threading.Lock()

        def feed(host: str) -> Callable[[str], None]:
            def one(line: str) -> None:
                with self._changed:
                    self._talks[host].feed(line)
                    self._changed.notify_all()
            return one

        def run(ctl: Any, stdin: Any) -> None:
            res: Any
            try:
                res = ctl.run([*by_name[ctl.name].testbed_argv, "agent", name], stdin=stdin,
                              on_stdout=lines(feed(ctl.name), LINE_MAX))
            except Exception as exc:  # noqa: BLE001 - why the session ended, for the requests still open
                res = exc
            with self._changed:
                self.ended[ctl.name] = res
                self._changed.notify_all()

        self._ctls = _controls([by_name[h] for h in self.hosts], doc.get("known_hosts"), False)
        self._thread = threading.Thread(
            target=lambda: _parallel(self._ctls, self.hosts, run, lifeline=True, pipes=self._pipes),
            name="agent-sessions", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Every host's session still runs."""
        with self._changed:
            return not self.ended

    def ask(self, request: Any, timeout: float) -> dict[str, Any]:
        """`request` to every host's agent at once: host -> its value, or the HostFailed that stands for
        it (its session ended, or it did not answer within `timeout`)."""
        from testbed.agent import protocol

        line = (protocol.request_line(request) + "\n").encode()
        with self._sending:   # (one request at a time: its line goes in the order it is counted)
            with self._changed:
                index = {h: len(self._talks[h].requests) for h in self.hosts}
                for h in self.hosts:
                    self._talks[h].requests.append(request)   # (before the line goes: its answer may come at once)
            for h in self.hosts:   # (outside _changed: a full pipe waits for a feeder that may be reading)
                self._pipes[h].write(line)
        until = time.monotonic() + timeout
        with self._changed:
            while not all(len(self._talks[h].values) > index[h] or h in self.ended or self._talks[h].broken
                          for h in self.hosts):
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            out: dict[str, Any] = {}
            for h in self.hosts:
                talk = self._talks[h]
                if len(talk.values) > index[h]:
                    out[h] = talk.values[index[h]]
                elif talk.broken is not None:
                    out[h] = talk.broken
                elif h in self.ended:
                    out[h] = HostFailed(h, f"its agent's session ended ({self.ended[h]})")
                else:
                    out[h] = HostFailed(h, f"its agent did not answer {request.op} within {timeout:g} s")
            return out

    def close(self) -> None:
        from testbed.cluster.controller import _close

        for p in self._pipes.values():
            p.close()
        self._thread.join(30)
        _close(self._ctls)
