"""The controller's end of the agents: a request to the hosts of a testbed, their checked answers.

Each host runs `testbed agent` over one SSH session (testbed.agent.serve), is sent the requests on
its stdin and answers one line each (testbed.agent.protocol). What a host answers is hostile input:
every value is checked against its op's type, and a host that answers out of protocol is a failed
host, with what it said cut short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from testbed.errors import TestbedError

ASK_TIMEOUT_S = 600.0


class HostFailed(TestbedError):
    """A host could not carry a request out: unreachable, out of protocol, or refused it (its words)."""

    def __init__(self, host: str, why: str, exit_code: int = 1):
        super().__init__(f"{host}: {why}")
        self.host, self.why, self.exit_code = host, why, exit_code


def _answers(host: str, requests: Sequence[Any], res: Any) -> list[Any]:
    """Each request's value (or HostFailed) from what the host's agent wrote."""
    from testbed.agent import protocol
    from testbed.cluster.controller import _why

    if isinstance(res, Exception):
        return [HostFailed(host, str(res))] * len(requests)
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    try:
        if not lines:
            raise protocol.ProtocolError("no answer")
        protocol.read_hello(lines[0])
    except protocol.ProtocolError as exc:
        said = _why(res) if res.rc != 0 else str(exc)
        if res.rc == 2 and "agent" in (res.stderr or ""):   # a testbed without the agent: older than this one
            said += " (its testbed has no `agent`: run `testbed install` for this version)"
        return [HostFailed(host, said)] * len(requests)
    out: list[Any] = []
    for i, req in enumerate(requests):
        if i + 1 >= len(lines):
            out.append(HostFailed(host, f"no answer to {req.op} ({_why(res)})"))
            continue
        try:
            out.append(protocol.read_reply(req.op, lines[i + 1]))
        except protocol.Refused as exc:
            out.append(HostFailed(host, str(exc), exc.exit_code))
        except protocol.ProtocolError as exc:
            out.append(HostFailed(host, str(exc)))
    return out


def ask(name: str, requests: Sequence[Any] | Mapping[str, Sequence[Any]], *, every: bool = True,
        timeout: float = ASK_TIMEOUT_S) -> dict[str, list[Any]]:
    """`requests` (testbed.agent.protocol requests), in order, to the agent on every host of testbed
    `name` at once, or (every=False: a read every host answers alike) to the first host that answers;
    a mapping host -> requests asks those hosts alone, each its own. Returns host -> each request's
    value, or the HostFailed that stands for it."""
    from testbed.agent import protocol
    from testbed.cluster.controller import _close, _controls, _parallel, load

    doc = load(name)
    by_name = {h.name: h for h in doc["_hosts"]}
    if isinstance(requests, Mapping):
        unknown = [h for h in requests if h not in by_name]
        if unknown:
            raise TestbedError(f"testbed {name} has no host {unknown[0]!r}")
        per_host = {h: list(reqs) for h, reqs in requests.items()}
    else:
        per_host = {h: list(requests) for h in doc.get("hosts", {}) if h in by_name}
    hosts = list(per_host)

    def one(ctl: Any) -> Any:
        stdin = "".join(protocol.request_line(r) + "\n" for r in per_host[ctl.name]).encode()
        return ctl.run([*by_name[ctl.name].testbed_argv, "agent"], stdin=stdin, timeout=timeout)

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
