"""The agent's protocol: one JSON request a line in, one JSON reply a line out, in order.

The agent first says who it is: `{"agent": PROTOCOL, "version": "<testbed version>"}`. Then, for
each request `{"op": "link.down", "name": "NAME", "a": "s0", "b": "s1"}` (the fields are the op's:
_OPS), one reply: `{"ok": true, "value": ...}` or `{"ok": false, "error": "why", "exit_code": N}`.
A stream op (STREAMS: `events`, `logs`, `top`, `exec`) first sends its items, one `{"item": ...}` a line, as they come,
then its reply. The controller closes the agent's stdin when it has nothing more to ask; the agent
ends then, and a stream that follows (events -f) ends at once with its reply: closing stdin is how
a controller passes a Ctrl-C on.

Both ends check what they read. A request names only the ops below, with the fields each takes,
and a testbed's name in the form testbed gives names. A reply is a host's word, hostile input to
the controller: its value is checked against the op's type (value_type) before anything uses it, and a
line longer than the caller's bound is refused, not read on.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from testbed import __version__

PROTOCOL = 1

# A testbed's name as testbed.names allows it; a node's as topology files do (pydantic's regex: `$` is the
# end of the text, never before a final newline)
TestbedName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")]
NodeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,254}$")]
LinkField = Literal["bandwidth_bps", "delay_s", "jitter_s", "loss", "queue"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
    name: TestbedName


class Status(_Request):
    op: Literal["status"]


class LinkShow(_Request):
    op: Literal["link.show"]


class LinkSet(_Request):
    op: Literal["link.set"]
    a: NodeName
    b: NodeName
    changes: dict[LinkField, Annotated[float, Field(allow_inf_nan=False, ge=0)]] = Field(min_length=1)
    direction: Literal["both", "A->B", "B->A"] = "both"


class LinkDown(_Request):
    op: Literal["link.down"]
    a: NodeName
    b: NodeName


class LinkUp(_Request):
    op: Literal["link.up"]
    a: NodeName
    b: NodeName


class LinkReset(_Request):
    op: Literal["link.reset"]
    a: NodeName
    b: NodeName


class Partition(_Request):
    op: Literal["partition"]
    groups: list[list[NodeName]] = Field(min_length=1, max_length=4096)


class Heal(_Request):
    op: Literal["heal"]


class Node(_Request):
    op: Literal["node"]
    verb: Literal["down", "up", "crash", "slow", "restore"]
    node: NodeName
    cpus: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class Stacks(_Request):
    op: Literal["stacks"]


EVENT_KINDS = ("up", "down", "link", "node", "partition", "scenario", "run", "verdict", "capture")   # events.KINDS


class Events(_Request):
    op: Literal["events"]
    kinds: list[Literal[EVENT_KINDS]] | None = None   # type: ignore[valid-type]
    follow: bool = False


class Logs(_Request):
    op: Literal["logs"]
    node: NodeName
    follow: bool = False
    tail: Annotated[int, Field(ge=0)] | None = None


class ScenarioStep(_Request):
    """A step of a scenario played over several hosts (testbed.agent.scenario): check, apply or restore,
    with what the controller sends for it (a JSON object: steps, deadlines, what to tell the events)."""
    op: Literal["scenario.check", "scenario.apply", "scenario.restore"]
    data: dict[str, Any] = Field(default_factory=dict)


class Top(_Request):
    op: Literal["top"]
    interval: Annotated[float, Field(ge=0.1, le=3600, allow_inf_nan=False)] = 1.0
    runs: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None


class Exec(_Request):
    op: Literal["exec"]
    node: NodeName
    argv: list[Annotated[str, StringConstraints(max_length=128 << 10)]] = Field(min_length=1, max_length=4096)


class Ps(_Request):
    op: Literal["ps"]
    nodes: list[NodeName] = Field(default_factory=list, max_length=100_000)
    all_nodes: bool = False


# op -> its request's model (each built when first used: a process asks or answers few of them)
_OPS: dict[str, type[_Request]] = {
    "status": Status, "link.show": LinkShow, "link.set": LinkSet, "link.down": LinkDown, "link.up": LinkUp,
    "link.reset": LinkReset, "partition": Partition, "heal": Heal, "node": Node, "ps": Ps, "stacks": Stacks,
    "events": Events, "logs": Logs, "top": Top, "exec": Exec,
    "scenario.check": ScenarioStep, "scenario.apply": ScenarioStep, "scenario.restore": ScenarioStep,
}


def request(fields: dict[str, Any]) -> Any:
    """The request `fields` make ({"op": ..., "name": ..., and the op's own}), checked: pydantic's
    ValidationError names a bad field; an op there is none of raises ProtocolError."""
    model = _OPS.get(fields.get("op")) if isinstance(fields, dict) else None
    if model is None:
        raise ProtocolError(f"op: no op {fields.get('op') if isinstance(fields, dict) else fields!r} "
                            f"({', '.join(_OPS)})")
    return model.model_validate(fields)


# -- what comes back ---------------------------------------------------------------------------------------------

_Reason = Annotated[str, StringConstraints(max_length=200)]
_Word = Annotated[str, StringConstraints(max_length=100)]


class Profile(BaseModel):
    """One direction of a link as `link show` gives it (emulated units)."""
    model_config = ConfigDict(extra="ignore", defer_build=True)
    bandwidth_bps: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    delay_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    jitter_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    loss: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    queue: Annotated[int, Field(ge=0)] | None = None


class LinkRecord(BaseModel):
    """One link of `link show`."""
    model_config = ConfigDict(extra="ignore", defer_build=True)
    index: Annotated[int, Field(ge=0)]
    endpoints: list[NodeName] = Field(min_length=2, max_length=2)
    tier: _Word
    state: _Word
    down_by: list[_Reason] = Field(default_factory=list, max_length=64)
    ab: Profile
    ba: Profile
    changed: bool = False


class LinkProfiles(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)
    ab: Profile
    ba: Profile


class _LinkState(BaseModel):
    model_config = ConfigDict(extra="allow", defer_build=True)
    state: _Word = "up"


class HostStatus(BaseModel):
    """A host's `status` of its part: what the controller reads of it (the rest is passed on as given,
    to be printed as JSON, never as markup)."""
    model_config = ConfigDict(extra="allow", defer_build=True)
    name: TestbedName
    status: _Word
    missing: list[Annotated[str, StringConstraints(max_length=1000)]] = Field(default_factory=list)
    links: list[_LinkState] = Field(default_factory=list)


class ProcessRow(BaseModel):
    """One process of `ps` (its command line is whatever a job wrote: text, never markup)."""
    model_config = ConfigDict(extra="ignore", defer_build=True)
    node: NodeName
    pid: Annotated[int, Field(ge=1)]
    nspid: Annotated[int, Field(ge=1)] | None = None
    user: Annotated[str, StringConstraints(max_length=64)] | None = None
    rss_bytes: Annotated[int, Field(ge=0)] | None = None
    cpu_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    command: Annotated[str, StringConstraints(max_length=8192)]


class Frame(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)
    function: Annotated[str, StringConstraints(max_length=1000)]
    file: Annotated[str, StringConstraints(max_length=4096)]
    line: Annotated[int, Field(ge=0)]


class RankDoc(BaseModel):
    """One rank's stack (testbed.jobs.stacks.to_json)."""
    model_config = ConfigDict(extra="ignore", defer_build=True)
    pid: Annotated[int, Field(ge=1)]
    rank: Annotated[int, Field(ge=0)] | None = None
    worker: NodeName | None = None
    phantom: bool = False
    frames: list[Frame] = Field(default_factory=list, max_length=10_000)
    threads: Annotated[int, Field(ge=0)] = 0
    error: Annotated[str, StringConstraints(max_length=4000)] | None = None


class EventRecord(BaseModel):
    """One event (testbed.events: what a host's stream holds); its other fields are passed on as given."""
    model_config = ConfigDict(extra="allow", defer_build=True)
    t: Annotated[float, Field(allow_inf_nan=False)]
    kind: Literal[EVENT_KINDS]   # type: ignore[valid-type]
    what: Annotated[str, StringConstraints(max_length=16384)]


class LogsEnd(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)
    shown: Annotated[int, Field(ge=0)] = 0   # files shown
    directory: Annotated[str, StringConstraints(max_length=4096)] = ""   # where the node's jobs write


class TopDoc(BaseModel):
    """One host's top document (testbed.observe.top): what testbed.cluster.top merges reads each
    field with care; here only its shape is checked."""
    model_config = ConfigDict(extra="allow", defer_build=True)
    links: list[dict[str, Any]] = Field(max_length=1_000_000)
    workers: list[dict[str, Any]] = Field(max_length=1_000_000)


class Output(BaseModel):
    """A piece of a command's output: fd 1 (stdout) or 2 (stderr), as text."""
    model_config = ConfigDict(extra="ignore", defer_build=True)
    fd: Literal[1, 2]
    data: Annotated[str, StringConstraints(max_length=1 << 20)]


class Exited(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)
    rc: Annotated[int, Field(ge=0, le=255)]


class EventsEnd(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)
    skipped: Annotated[int, Field(ge=0)] = 0   # lines of the host's stream that were not events


# op -> the type of its reply's value, and of its items (a stream op): built when first used
_VALUES: dict[str, Any] = {
    "status": HostStatus,
    "link.show": list[LinkRecord],
    "link.set": LinkProfiles,
    "link.down": bool,
    "link.up": list[_Reason],
    "link.reset": None,
    "partition": list[list[NodeName]],
    "heal": bool,
    "node": Annotated[int, Field(ge=0)] | None,
    "ps": list[ProcessRow],
    "stacks": list[RankDoc],
    "events": EventsEnd,
    "logs": LogsEnd,
    "scenario.check": dict[str, Any],     # (the controller reads each field with care: testbed.cluster.scenario)
    "scenario.apply": dict[str, Any],
    "scenario.restore": dict[str, Any],
    "top": dict[str, Any],
    "exec": Exited,
}
# an event; a top document; a piece of a command's output; a piece of a node's logs (text, as the
# job wrote it, made inert)
_ITEMS: dict[str, Any] = {"events": EventRecord, "top": TopDoc, "exec": Output,
                          "logs": Annotated[str, StringConstraints(max_length=64 << 20)]}
STREAMS = frozenset(_ITEMS)


@functools.cache
def value_type(op: str) -> TypeAdapter[Any]:
    return TypeAdapter(_VALUES[op])


@functools.cache
def item_type(op: str) -> TypeAdapter[Any]:
    return TypeAdapter(_ITEMS[op])


class ProtocolError(ValueError):
    """A line that is not what the protocol says (the message names what was wrong)."""


def hello() -> str:
    return json.dumps({"agent": PROTOCOL, "version": __version__})


def read_hello(line: str) -> str:
    """The agent's version from its first line; refuses another protocol."""
    doc = _object(line, "its first line")
    if doc.get("agent") != PROTOCOL or not isinstance(doc.get("version"), str):
        raise ProtocolError(f"its first line is not an agent of protocol {PROTOCOL}: {line[:200]!r}")
    return doc["version"][:100]


def request_line(req: Any) -> str:
    return req.model_dump_json(exclude_none=True)


def read_request(line: str) -> Any:
    try:
        return request(_object(line, "the request"))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "the request"
        raise ProtocolError(f"{where}: {err.get('msg')}") from None


def reply_ok(value: Any) -> str:
    return json.dumps({"ok": True, "value": value})


def item_line(value: Any) -> str:
    return json.dumps({"item": value}, default=str)


def read_item(op: str, doc: dict[str, Any]) -> Any:
    """An item of stream op `op` (a line already read as an object with an "item"), checked."""
    if op not in STREAMS:
        raise ProtocolError(f"an item in its reply to {op}, which is no stream")
    try:
        return item_type(op).validate_python(doc["item"], strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "item"
        raise ProtocolError(f"an item of {op}: {where}: {err.get('msg')}") from None


def read_line(line: str) -> dict[str, Any]:
    """A line after the first, as an object (an item or a reply)."""
    return _object(line, "a line")


def reply_error(message: str, exit_code: int) -> str:
    return json.dumps({"ok": False, "error": message, "exit_code": exit_code})


class Refused(Exception):
    """The agent carried the request out and it failed there: its words and its exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def read_reply(op: str, line: str | dict[str, Any]) -> Any:
    """The value of a reply to `op`, checked against the op's type; Refused if the host refused."""
    doc = _object(line, "a reply") if isinstance(line, str) else line
    line = line if isinstance(line, str) else json.dumps(doc)[:200]
    if doc.get("ok") is True:
        try:
            return value_type(op).validate_python(doc.get("value"), strict=True)   # (strict: "yes" is no bool)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ())) or "value"
            raise ProtocolError(f"its reply to {op}: {where}: {err.get('msg')}") from None
    if doc.get("ok") is False and isinstance(doc.get("error"), str):
        code = doc.get("exit_code")
        raise Refused(doc["error"][:2000], code if isinstance(code, int) and 0 < code < 256 else 1)
    raise ProtocolError(f"its reply to {op} is neither ok nor an error: {line[:200]!r}")


def _object(line: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError:
        raise ProtocolError(f"{what} is not JSON: {line[:200]!r}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"{what} is not a JSON object: {line[:200]!r}")
    return doc
