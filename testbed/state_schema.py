"""The schema of a testbed's state document: what `testbed.store.load` accepts.

testbed acts as root on what a state lists (namespaces it deletes, processes it signals, cgroups
and directories it removes, containers it drives), so a state is accepted only if it is what
testbed itself writes. This module says what that is, as pydantic v2 models:

- strict types (a PID is an int, never "1", 1.0 or true; a flag is a bool), no field testbed
  does not write (extra="forbid" on every record), and values checked against the testbed:
- namespaces are tb-NAME-NODE for a node of the state's own topology (a switch's where a
  switch's is listed, a worker's where a worker's is); container names likewise;
- files and directories are absolute, without '..', and resolve (realpath: no way out through
  a link) to exactly where testbed puts them in the testbed's directory (workers/NODE,
  logs/NODE, dl-LINK.sock, dl-LINK.pid, mps/pipe, mps/log);
- cgroups are <mount>/testbed/NAME/NODE (a worker's own group) or testbed/NAME.faults/NODE
  (`node slow`'s), with a mount that is one of this machine's cgroup mounts under
  /sys/fs/cgroup, and no '..';
- a PID always comes with the start time (clock ticks since boot) that names the process;
- Docker endpoints are unix:///PATH or tcp://HOST:PORT, container ids 64 hex digits;
- the topology snapshot is re-validated (testbed.topology.model.Topology.validate) and its
  node names are ones testbed makes namespaces of;
- one link record per link of the topology, in order; delay lines name a link and the
  namespaces of its two ends; the schema version is the one `store.save` writes.

What depends on the testbed (its name, its directory, its topology's nodes, this machine's
cgroup mounts) comes through pydantic's validation context: a StateContext, made by
`check()`; the topology snapshot is validated first and fills in the nodes, so the fields
after it are checked against it. Without a context nothing validates.

Loosely typed, as dicts of anything (informational: shown by `status`, read back into the
objects that wrote them, nothing testbed acts on as root): `plan`, `capabilities`, `dilation`,
`timings`, the entries of `no_delay_element`, `gpu.devices`, `gpu.assignment`,
`topology.params`, a docker worker's `hosts`, a part's cut-link ends (`part.tunnels`), and the
other keys of a `time_dilation` record ({"factor": s, ...}). `created`, `state_root` and `owner` are strings, not checked further.

Cost: this module is imported by the first `store.load` of a process (not by importing the
store), and builds the document's validator then, once (defer_build: the records get none of
their own; pydantic's plugins off, see _build). Checking a state is then one pass of
pydantic-core plus one realpath per file path: for a k=8 fat-tree (128 workers) less than the
hand-written checks this replaced took.

`check(data, name, directory)` returns the problems found ([] when the state is valid) as
(dotted field, why, value); the store turns the first into its StateError. `checked` also gives
the Topology the snapshot was checked as.
"""

import os
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from testbed import names
from testbed.errors import TopologyError
from testbed.state_values import (ERROR, UNCHECKED, AbsolutePath, CgroupDir, ContainerId, CutNetns, DelayLineEnd,
                                  DockerHost, EnvName, IfName, Index, NodeKey, NodeName, Number, Pid, Positive,
                                  StateContext, SwitchNetns, Ticks, WorkerKey, WorkerNetns, cgroup_of, context_of,
                                  fail, path_is, with_topology)
from testbed.topology.model import Topology

# The version of the document this schema describes. testbed.store writes the same number (its own
# SCHEMA_VERSION: importing this module to read it would build the validator on every save).
SCHEMA_VERSION = 1

# -- records ------------------------------------------------------------------------------------------------


class _Record(BaseModel):
    """Every record: strict types, no field testbed does not write. Records are validated only as
    parts of the document (defer_build: no validator of their own is built, see _build)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, defer_build=True)


class ProfileRecord(_Record):
    """One direction of a link (LinkProfile.to_json): emulated values, before time dilation."""

    bandwidth_bps: Number | None = None
    delay_s: Number = 0.0
    jitter_s: Number = 0.0
    loss: Annotated[float, Field(ge=0, le=1)] = 0.0
    queue: Number | None = None
    mtu: Positive | None = None


class NodeSnapshot(_Record):
    name: NodeName
    kind: Literal["worker", "switch"]
    gpus: Annotated[StrictInt, Field(ge=0)] = 0
    cpus: Positive | None = None
    memory_bytes: Annotated[StrictInt, Field(gt=0)] | None = None
    image: StrictStr | None = None


class LinkSnapshot(_Record):
    endpoints: Annotated[list[NodeName], Field(min_length=2, max_length=2)]
    tier: StrictStr
    ab: ProfileRecord
    ba: ProfileRecord


class TopologySnapshot(_Record):
    """Topology.to_json of the nominal (undilated) topology; re-validated as a Topology."""

    name: StrictStr
    source: StrictStr | None = None
    generator: StrictStr | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    runtime: Literal["netns", "docker"] | None = None
    time_dilation: Any = None                 # a factor >= 1, "auto", "none" or null (Topology.validate)
    gpu_policy: StrictStr = "round-robin"
    gpu_sharing: StrictStr | None = None
    address_pool: StrictStr | None = None
    fabric_pool: StrictStr | None = None
    host_rate: Any = None                     # bit/s per rank, "network-bound" or "this-machine" (Topology.validate)
    nodes: list[NodeSnapshot]
    links: list[LinkSnapshot]

    @model_validator(mode="wrap")
    @classmethod
    def _graph(cls, data: Any, handler: Any, info: ValidationInfo) -> Self:
        """Typed first; then the graph rules of Topology.validate; then the context learns its nodes."""
        ctx = context_of(info)
        snap = handler(data)
        seen: set[str] = set()
        for i, n in enumerate(snap.nodes):
            if n.name in seen:
                raise fail("a node named twice", n.name, f"nodes[{i}].name")
            seen.add(n.name)
        try:
            topo = Topology.from_json(data).validate()
        except TopologyError as exc:
            value = exc.value if exc.value is not TopologyError._MISSING else None
            raise fail(f"not a valid topology snapshot ({exc.reason})", value, exc.path or "") from None
        except (KeyError, TypeError, ValueError) as exc:   # typed above: not expected, but never let through
            raise fail(f"not a valid topology snapshot ({exc!r})", "...") from None
        ctx.use_topology(topo)
        return snap


class WorkerRecord(_Record):
    """What a runtime records of a worker (netns: runtime..node; docker: id..hosts; bare: netns).
    Which worker it belongs to is checked by RuntimeRecord (the record does not know its key)."""

    netns: StrictStr | None = None
    runtime: Literal["netns", "docker", "bare"] | None = None
    pid: Pid | None = None
    starttime: Ticks | None = None
    cgroups: list[CgroupDir] = Field(default_factory=list)
    dir: AbsolutePath | None = None
    log_dir: AbsolutePath | None = None
    share_ipc: StrictBool | None = None
    net_admin: StrictBool | None = None
    env: dict[EnvName, StrictStr] | None = None
    node: NodeSnapshot | None = None
    id: ContainerId | None = None
    container: StrictStr | None = None
    docker_host: DockerHost | None = None
    hosts: dict[StrictStr, Any] | None = None

    @model_validator(mode="after")
    def _pid_with_start(self) -> Self:
        if self.pid is not None and self.starttime is None:   # no PID without what names the process
            raise fail("a PID without its start time", self.starttime, "starttime")
        return self


class RuntimeRecord(_Record):
    kind: Literal["netns", "docker", "bare"]
    net_admin: StrictBool = False
    workers: dict[WorkerKey, WorkerRecord]

    @model_validator(mode="after")
    def _each_worker_its_own(self, info: ValidationInfo) -> Self:
        """A worker's record names its own namespace, container, directories, cgroups and node."""
        ctx = context_of(info)
        for w, rec in self.workers.items():
            at = f"workers.{w}"
            mine = ctx.netns(w)
            if rec.netns is not None and rec.netns != mine:
                raise fail(f"not this worker's namespace ({mine})", rec.netns, f"{at}.netns")
            if rec.container is not None and rec.container != mine:
                raise fail(f"not this worker's container ({mine})", rec.container, f"{at}.container")
            if rec.node is not None and rec.node.name != w:
                raise fail(f"not worker {w}'s node record", rec.node.name, f"{at}.node.name")
            if rec.node is not None and rec.node.kind != "worker":
                raise fail("not a worker's node record", rec.node.kind, f"{at}.node.kind")
            for key, rel in (("dir", ("workers", w)), ("log_dir", ("logs", w))):
                v = getattr(rec, key)
                why = v is not None and path_is(ctx, v, *rel)
                if why:
                    raise fail(why, v, f"{at}.{key}")
            for i, p in enumerate(rec.cgroups):
                why = cgroup_of(ctx, p, ctx.name, w)
                if why:
                    raise fail(why, p, f"{at}.cgroups[{i}]")
        return self


class DelayLine(_Record):
    """A delay-line helper (testbed.net.delayline.DelayLink.to_json, plus the link's index)."""

    pid: Pid
    start: Ticks
    link_id: StrictStr
    ns_a: DelayLineEnd
    if_a: IfName
    ns_b: DelayLineEnd
    if_b: IfName
    control: AbsolutePath
    pid_file: AbsolutePath
    link: Index

    @model_validator(mode="after")
    def _of_its_link(self, info: ValidationInfo) -> Self:
        ctx = with_topology(info)
        if self.link >= len(ctx.link_ends):
            raise fail(f"not a link of the topology (it has {len(ctx.link_ends)})", self.link, "link")
        if self.link_id != str(self.link):
            raise fail(f"not the id of link {self.link}", self.link_id, "link_id")
        a, b = ctx.link_ends[self.link]
        cut = names.cut_netns(ctx.name, self.link)
        if cut in (self.ns_a, self.ns_b):   # a delayed cut link: both TAPs in the link's own namespace
            for key in ("ns_a", "ns_b"):
                if getattr(self, key) != cut:
                    raise fail(f"not the namespace of link {self.link} ({cut}), as its other TAP's is",
                                getattr(self, key), key)
        else:
            for key, node in (("ns_a", a), ("ns_b", b)):
                if getattr(self, key) != ctx.netns(node):
                    raise fail(f"not the namespace of {node}, an end of link {self.link}", getattr(self, key), key)
        for key, suffix in (("control", "sock"), ("pid_file", "pid")):
            why = path_is(ctx, getattr(self, key), f"dl-{self.link_id}.{suffix}")
            if why:
                raise fail(why, getattr(self, key), key)
        return self


class Resources(_Record):
    """What `up` makes outside the workers' records: namespaces (listed before they are made)
    and the delay-line helpers."""

    switch_netns: list[SwitchNetns] = Field(default_factory=list)
    worker_netns: list[WorkerNetns] = Field(default_factory=list)
    cut_netns: list[CutNetns] = Field(default_factory=list)   # over several hosts, without netem: the delayed cut links' own
    delay_lines: list[DelayLine] = Field(default_factory=list)


class MpsDaemon(_Record):
    """The MPS control daemon testbed started (gpu.start_mps)."""

    pid: Pid
    starttime: Ticks
    pipe_dir: AbsolutePath
    log_dir: AbsolutePath

    @model_validator(mode="after")
    def _in_its_directory(self, info: ValidationInfo) -> Self:
        ctx = context_of(info)
        for key, rel in (("pipe_dir", "pipe"), ("log_dir", "log")):
            why = path_is(ctx, getattr(self, key), "mps", rel)
            if why:
                raise fail(why, getattr(self, key), key)
        return self


class GpuRecord(_Record):
    policy: Literal["round-robin", "packed"] = "round-robin"
    mps: StrictBool = False
    devices: list[dict[str, Any]] = Field(default_factory=list)
    assignment: dict[str, Any] = Field(default_factory=dict)
    mps_daemon: MpsDaemon | None = None


class LinkPair(_Record):
    ab: ProfileRecord
    ba: ProfileRecord


class LinkRecord(_Record):
    """lifecycle's record of link i, and what faults changed (state, down_by, profile)."""

    index: Index
    endpoints: Annotated[list[NodeName], Field(min_length=2, max_length=2)]
    tier: StrictStr
    kind: Literal["access", "fabric", "direct"]
    ifnames: Annotated[list[IfName], Field(min_length=2, max_length=2)]
    state: Literal["up", "down"] = "up"
    down_by: list[StrictStr] = Field(default_factory=list)
    profile: LinkPair | None = None


class NodeFault(_Record):
    state: Literal["down", "crashed", "up"] | None = None
    since: Number | None = None
    cpus: Positive | None = None
    cgroup: list[CgroupDir] | None = None     # `node slow`'s own group (NAME.faults/NODE)


class Partition(_Record):
    groups: list[list[NodeName]]
    netns: list[WorkerNetns]
    since: Number | None = None


class FaultLogEntry(_Record):
    t: Number
    what: StrictStr


class Faults(_Record):
    nodes: dict[NodeKey, NodeFault] = Field(default_factory=dict)
    log: list[FaultLogEntry] = Field(default_factory=list)
    partition: Partition | None = None

    @model_validator(mode="after")
    def _own_groups(self, info: ValidationInfo) -> Self:
        ctx = context_of(info)
        for node, rec in self.nodes.items():
            for i, p in enumerate(rec.cgroup or []):
                why = cgroup_of(ctx, p, f"{ctx.name}.faults", node)
                if why:
                    raise fail(why, p, f"nodes.{node}.cgroup[{i}]")
        return self


def _link_index_key(v: str) -> str:
    if not (v.isascii() and v.isdigit()):
        raise fail("not a link index", v)
    return v


class PartRecord(_Record):
    """One host's part of a testbed over several hosts (testbed.cluster.part.Part.to_json): its
    host's name, the nodes it builds (nodes of the topology), its ends of the cut links and each cut
    link's underlay latency (s). The ends are plain data here: nothing reads them back from the
    state (a tunnel goes with its node's namespace)."""

    host: Annotated[StrictStr, Field(min_length=1)]
    nodes: list[NodeKey]
    tunnels: list[dict[str, Any]] = Field(default_factory=list)
    underlay_s: dict[Annotated[StrictStr, AfterValidator(_link_index_key)], Annotated[float, Field(ge=0, lt=10)]] = Field(default_factory=dict)


class Leftover(_Record):
    what: StrictStr
    time: StrictStr | None = None


class StateDocument(_Record):
    """A testbed's state, as lifecycle, the runtimes, the builder and the fault commands write it.
    Fields are checked in this order: the topology before everything checked against it."""

    schema_version: StrictInt = Field(alias="schema")   # (a Literal would take true and 1.0 for 1)
    name: StrictStr
    status: Literal["building", "up", "removing"]
    pid: Pid
    pid_start: Ticks                     # with pid, names the `up` that wrote it
    topology: TopologySnapshot
    created: StrictStr | None = None
    state_root: StrictStr | None = None
    owner: StrictStr | None = None
    time_dilation: Any = None
    dilation: dict[str, Any] | None = None
    gpu: GpuRecord | None = None
    plan: dict[str, Any] | None = None
    capabilities: dict[str, Any] | None = None
    latency_floor_s: Number | None = None
    no_delay_element: list[dict[str, Any]] = Field(default_factory=list)
    delay_threshold_s: Number | None = None
    runtime: RuntimeRecord
    links: list[LinkRecord]
    resources: Resources
    timings: dict[str, Any] = Field(default_factory=dict)
    faults: Faults | None = None
    leftovers: list[Leftover] = Field(default_factory=list)
    part: PartRecord | None = None       # one host's part of a testbed over several hosts

    @field_validator("schema_version")
    @classmethod
    def _this_version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise fail(f"not schema version {SCHEMA_VERSION}, the one this testbed writes", v)
        return v

    @field_validator("name")
    @classmethod
    def _its_own_name(cls, v: str, info: ValidationInfo) -> str:
        if v != context_of(info).name:
            raise fail("not the name of its directory", v)
        return v

    @field_validator("time_dilation")
    @classmethod
    def _factor(cls, v: Any) -> Any:
        """A factor >= 1 (what `up` writes), or a record with one ({"factor": s, ...})."""
        factor = v.get("factor") if isinstance(v, dict) else v
        if v is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                              or not 1 <= factor < float("inf")):
            raise fail("not a time-dilation factor >= 1", v)
        return v

    @field_validator("links")
    @classmethod
    def _one_per_link(cls, v: list[LinkRecord], info: ValidationInfo) -> list[LinkRecord]:
        ctx = with_topology(info)
        if len(v) != len(ctx.link_ends):
            raise fail(f"not one record per link of the topology ({len(ctx.link_ends)})", len(v))
        for i, (rec, ends) in enumerate(zip(v, ctx.link_ends)):
            if rec.index != i:
                raise fail("not the index of this record", rec.index, f"[{i}].index")
            if tuple(rec.endpoints) != ends:
                raise fail(f"not the endpoints of link {i} ({ends[0]}, {ends[1]})", rec.endpoints,
                            f"[{i}].endpoints")
        return v


def build_without_plugins(model: type[BaseModel]) -> None:
    """Build a model's validator now, once per process, with pydantic's plugins off:
    third-party hooks found through package entry points must take no part in deciding what
    root acts on (and looking for them scans every installed package's metadata)."""
    before = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    try:
        model.model_rebuild(force=True)
    finally:
        if before is None:
            del os.environ["PYDANTIC_DISABLE_PLUGINS"]
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = before


build_without_plugins(StateDocument)


# -- checking ---------------------------------------------------------------------------------------------


class _Nothing:
    def __repr__(self) -> str:
        return "nothing"


NOTHING = _Nothing()


def field_path(loc: tuple[Any, ...], at: str = "") -> str:
    """A pydantic error location as the field path a user reads (`hosts[2].address`; "" for the
    document itself); `at`: a part a validator named below it (".key" or "[i]")."""
    out = ""
    for part in loc:
        if part == "[key]":            # a dict key was refused: the path already ends with it
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    if at:
        out += at if at.startswith("[") or not out else f".{at}"
    return out


def _dotted(loc: tuple[Any, ...], at: str = "") -> str:
    return field_path(loc, at) or "(the document)"


def problems(exc: ValidationError) -> list[tuple[str, str, Any]]:
    """(dotted field, why, value) of each error. What an invalid topology left unchecked is a
    consequence of it, not a problem of its own: listed only when nothing else is found."""
    out, later = [], []
    for e in exc.errors(include_url=False):
        ctx = e.get("ctx") or {}
        kind = e["type"]
        if kind == ERROR:
            item = (_dotted(e["loc"], ctx.get("at", "")), ctx["why"], ctx.get("value", e["input"]))
        elif kind == "extra_forbidden":
            item = (_dotted(e["loc"]), "unknown field", e["input"])
        elif kind == "missing":
            item = (_dotted(e["loc"]), "missing", NOTHING)
        else:
            item = (_dotted(e["loc"]), e["msg"][:1].lower() + e["msg"][1:], e["input"])
        (later if kind == UNCHECKED else out).append(item)
    return out or later


def check(data: Any, name: str, directory: str | os.PathLike[str]) -> list[tuple[str, str, Any]]:
    """The problems of `data` as the state of testbed `name` kept in `directory` ([]: it is valid)."""
    return checked(data, name, directory)[0]


def checked(data: Any, name: str, directory: str | os.PathLike[str]
            ) -> tuple[list[tuple[str, str, Any]], Topology | None]:
    """check(), and the topology the snapshot was checked as (None unless the state is valid): a
    reader that needs it does not parse a k=16 topology a second time."""
    if not names.valid_testbed_name(name):
        return [("name", "not a testbed name", name)], None
    ctx = StateContext.of(name, directory)
    try:
        StateDocument.model_validate(data, context=ctx)
    except ValidationError as exc:
        return problems(exc) or [("(the document)", str(exc), data)], None
    return [], ctx.topology
