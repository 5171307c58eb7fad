"""The values a testbed's state may hold, each checked against the testbed it belongs to: node names,
interface names, absolute paths that resolve to where testbed puts its files, cgroup directories
under this machine's mounts, namespace names of the state's own nodes, Docker endpoints and
container ids (what testbed.state_schema's records are made of; the rules are listed there).

What depends on the testbed comes through pydantic's validation context, a StateContext; our own
errors carry why, where below the field, and the value (ERROR), and a rule that needs a topology
that is not valid says so (UNCHECKED)."""

import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Self

from pydantic import AfterValidator, Field, StrictInt, StrictStr, ValidationInfo
from pydantic_core import PydanticCustomError

from testbed import cgroupfs, names
from testbed.topology.model import Topology

NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
DOCKER_HOST_RE = re.compile(r"^(unix:///[^\0]+|tcp://[\w.-]+:\d+)\Z")
CONTAINER_ID_RE = re.compile(r"^[0-9a-f]{64}\Z")
ERROR = "testbed_state"                 # our own errors: ctx carries why, where (below loc), value
UNCHECKED = "testbed_state_unchecked"   # a rule that needs the topology, which is not valid


# -- the context ------------------------------------------------------------------------------------------


@dataclass
class StateContext:
    """What a state is checked against: the testbed's name and directory (given), this machine's
    cgroup mounts, and (filled in by the topology snapshot's validator) the topology's nodes."""

    name: str
    directory: str                       # <state root>/NAME, as paths.directory gives it
    real_directory: str = ""             # its realpath
    cgroup_mounts: frozenset[str] = frozenset()   # realpaths of this machine's cgroup mounts
    topology: Topology | None = None
    workers: frozenset[str] = frozenset()
    switches: frozenset[str] = frozenset()
    link_ends: tuple[tuple[str, str], ...] = ()
    _real_mounts: dict[str, str] = field(default_factory=dict)
    _real_dirs: dict[str, str] = field(default_factory=dict)
    _links_in: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, directory: str | os.PathLike[str]) -> Self:
        hier = cgroupfs.hierarchy()
        mounts = frozenset(os.path.realpath(m) for m in hier.mounts.values()) if hier else frozenset()
        d = os.fspath(directory)
        return cls(name=name, directory=d, real_directory=os.path.realpath(d), cgroup_mounts=mounts)

    def use_topology(self, topo: Topology) -> None:
        self.topology = topo
        self.workers = frozenset(topo.workers)
        self.switches = frozenset(topo.switches)
        self.link_ends = tuple((link.a, link.b) for link in topo.links)

    def netns(self, node: str) -> str:
        return names.netns(self.name, node)

    def real_mount(self, mount: str) -> str:
        real = self._real_mounts.get(mount)
        if real is None:
            real = self._real_mounts[mount] = os.path.realpath(mount)
        return real

    def realpath(self, path: str) -> str:
        """os.path.realpath(path), each directory resolved and listed once: a state names thousands
        of files in a few directories (k=16: 8,192), and realpath walks every part of every one.
        Its last part is resolved only when the listing shows a link there (a missing file is kept
        as it is, after its resolved directory, as realpath does)."""
        head, _, tail = path.rpartition("/")
        if tail in ("", ".", "..") or not head or head.endswith("/"):   # (what os.path.split would strip)
            return os.path.realpath(path)
        links = self._links_in.get(head)
        if links is None:
            try:
                with os.scandir(head) as it:
                    links = {e.name for e in it if e.is_symlink()}
            except OSError:   # (no listing: realpath says where it leads)
                return os.path.realpath(path)
            self._links_in[head] = links
        if tail in links:
            return os.path.realpath(path)
        real = self._real_dirs.get(head)
        if real is None:
            real = self._real_dirs[head] = os.path.realpath(head)
        return f"{real}/{tail}" if real != "/" else f"/{tail}"


def context_of(info: ValidationInfo) -> StateContext:
    ctx = info.context
    if not isinstance(ctx, StateContext):
        raise PydanticCustomError(ERROR, "{why}", {"why": "validated without its testbed (no StateContext)"})
    return ctx


def with_topology(info: ValidationInfo) -> StateContext:
    """The context, with the topology the rule needs (an error of its own when that is not valid:
    the topology's own error says why)."""
    ctx = context_of(info)
    if ctx.topology is None:
        raise PydanticCustomError(UNCHECKED, "not checked: the topology snapshot is not valid")
    return ctx


def fail(why: str, value: Any, at: str = "") -> PydanticCustomError:
    """An error `why` about `value`, at `at` (a dotted path below the validator's own place)."""
    return PydanticCustomError(ERROR, "{why}", {"why": why, "value": value, "at": at})


# -- values -------------------------------------------------------------------------------------------------


def _node_name(v: str) -> str:
    if not NODE_RE.match(v):
        raise fail("a node name testbed would not make a namespace of", v)
    return v


_IFNAME_BAD = re.compile(r"[/: \t\n\0]")


def _ifname(v: str) -> str:
    if not (0 < len(v) <= names.IFNAMSIZ) or v in (".", "..") or _IFNAME_BAD.search(v):
        raise fail(f"not an interface name (1 to {names.IFNAMSIZ} characters, no '/', ':' or blanks)", v)
    return v


def _absolute(v: str) -> str:
    """An absolute path without '..' or NUL (where it leads is checked with the context)."""
    if not v.startswith("/") or "\0" in v or "/../" in v + "/":   # (a '..' part; no split: 13,312 at k=16)
        raise fail("not an absolute path without '..'", v)
    return v


def _cgroup_dir(v: str, info: ValidationInfo) -> str:
    """<mount>/testbed/NAME[.faults]/NODE, the mount one of this machine's, under /sys/fs/cgroup.
    (Which NODE and which of NAME, NAME.faults: the record holding it checks.)"""
    ctx = context_of(info)
    # (string operations, not Path or normpath: a k=16 state holds 5,120 of these; testbed writes
    # them normalised, so a '//', '.' part or trailing '/' is refused rather than normalised)
    if "//" in _absolute(v) or "/./" in v or v.endswith(("/", "/.")):
        raise fail("not a path as testbed writes it (a '//', '.' part or trailing '/')", v)
    parts = v.rsplit("/", 3)
    if len(parts) < 4 or not parts[0]:
        raise fail(f"not a cgroup of this testbed: no cgroup mount before {cgroupfs.TOP}/{ctx.name}/NODE", v)
    mount_dir, top, group, node = parts
    if not (group in (ctx.name, f"{ctx.name}.faults") and top == cgroupfs.TOP and NODE_RE.match(node)):
        raise fail(f"not a cgroup of this testbed ({cgroupfs.TOP}/{ctx.name}/NODE)", v)
    mount = ctx.real_mount(mount_dir)
    root = str(cgroupfs.CGROUP_ROOT)
    if not (mount == root or mount.startswith(root + "/")):
        raise fail(f"not under {cgroupfs.CGROUP_ROOT}", v)
    if mount not in ctx.cgroup_mounts:
        raise fail("not under one of this machine's cgroup mounts", v)
    return v


def _netns_of(v: str, info: ValidationInfo, which: str) -> str:
    """v is tb-NAME-NODE for a NODE among the topology's `which` (nodes, switches or workers)."""
    ctx = with_topology(info)
    prefix = names.netns_prefix(ctx.name)
    among = ctx.topology.nodes if which == "nodes" else ctx.switches if which == "switches" else ctx.workers
    if not (v.startswith(prefix) and v[len(prefix):] in among):
        what = {"nodes": "one of this testbed's namespaces ({p}NODE)",
                "switches": "the namespace of one of this testbed's switches ({p}SWITCH)",
                "workers": "the namespace of one of this testbed's workers ({p}WORKER)"}[which]
        raise fail("not " + what.format(p=prefix), v)
    return v


def _testbed_netns(v: str, info: ValidationInfo) -> str:
    return _netns_of(v, info, "nodes")


def _switch_netns(v: str, info: ValidationInfo) -> str:
    return _netns_of(v, info, "switches")


def _worker_netns(v: str, info: ValidationInfo) -> str:
    return _netns_of(v, info, "workers")


def _delay_line_end(v: str, info: ValidationInfo) -> str:
    """A node's namespace, or a delayed cut link's own (where its delay line's TAPs are)."""
    prefix = names.netns_prefix(with_topology(info).name)
    return _cut_netns(v, info) if v.startswith(prefix + names.CUT_MARK) else _testbed_netns(v, info)


def _cut_netns(v: str, info: ValidationInfo) -> str:
    """v is tb-NAME-~lINDEX for a link of the topology (a delayed cut link's own namespace)."""
    ctx = with_topology(info)
    prefix = names.cut_netns(ctx.name, 0)[:-1]
    index = v[len(prefix):] if v.startswith(prefix) else ""
    if not (index.isdigit() and str(int(index)) == index and int(index) < len(ctx.link_ends)):
        raise fail(f"not the namespace of one of this testbed's links ({prefix}INDEX)", v)
    return v


def _a_worker(v: str, info: ValidationInfo) -> str:
    if v not in with_topology(info).workers:
        raise fail("not a worker of the topology", v)
    return v


def _a_node(v: str, info: ValidationInfo) -> str:
    if v not in with_topology(info).topology.nodes:
        raise fail("not a node of the topology", v)
    return v


def _matching(regex: "re.Pattern[str]", what: str):
    """A validator: the value must match `regex`, else it is not `what`."""
    def check(v: str) -> str:
        if not regex.match(v):
            raise fail(f"not {what}", v)
        return v

    return check


_env_name = _matching(ENV_NAME_RE, "an environment variable name")
_docker_host = _matching(DOCKER_HOST_RE, "a Docker endpoint (unix:///PATH or tcp://HOST:PORT)")
_container_id = _matching(CONTAINER_ID_RE, "a container id (64 hex digits)")


Pid = Annotated[StrictInt, Field(ge=1)]
Ticks = Annotated[StrictInt, Field(ge=0)]            # clock ticks since boot: with the PID, names a process
Index = Annotated[StrictInt, Field(ge=0)]
Number = Annotated[float, Field(ge=0)]               # strict: an int or a float, never a bool or a string
Positive = Annotated[float, Field(gt=0)]
NodeName = Annotated[StrictStr, AfterValidator(_node_name)]
IfName = Annotated[StrictStr, AfterValidator(_ifname)]
AbsolutePath = Annotated[StrictStr, AfterValidator(_absolute)]
CgroupDir = Annotated[StrictStr, AfterValidator(_cgroup_dir)]
TestbedNetns = Annotated[StrictStr, AfterValidator(_testbed_netns)]
SwitchNetns = Annotated[StrictStr, AfterValidator(_switch_netns)]
WorkerNetns = Annotated[StrictStr, AfterValidator(_worker_netns)]
CutNetns = Annotated[StrictStr, AfterValidator(_cut_netns)]
DelayLineEnd = Annotated[StrictStr, AfterValidator(_delay_line_end)]
WorkerKey = Annotated[StrictStr, AfterValidator(_a_worker)]
NodeKey = Annotated[StrictStr, AfterValidator(_a_node)]
EnvName = Annotated[StrictStr, AfterValidator(_env_name)]
DockerHost = Annotated[StrictStr, AfterValidator(_docker_host)]
ContainerId = Annotated[StrictStr, AfterValidator(_container_id)]


def path_is(ctx: StateContext, v: str, *rel: str) -> str | None:
    """Why path `v` is not <the testbed's directory>/REL (resolved: no link leads elsewhere), or None."""
    want = "/".join((ctx.real_directory, *rel))   # (real_directory is absolute and not "/": the state root's own)
    if ctx.realpath(v) != want:
        return f"not {os.path.join(ctx.directory, *rel)}"
    return None


def cgroup_of(ctx: StateContext, v: str, group: str, node: str) -> str | None:
    """Why cgroup directory `v` (its form already checked) is not testbed/GROUP/NODE, or None."""
    parent, _, name = v.rpartition("/")   # (string operations: k=16 has 5,120 of these; v has no '//')
    if name != node or parent.rpartition("/")[2] != group:
        return f"not {cgroupfs.TOP}/{group}/{node} (a cgroup of another node or group)"
    return None
