"""Groups: different commands on different workers in one run (`testbed run --group/--service/--job`).

A fault-tolerant training stack is not one torch world. torchft runs a lighthouse on one machine and
replica groups on others, each group its own world; elastic stacks restart a group that failed. A
run made of groups says, for each group, which workers run which command:

    group     a torch world of its own: its ranks get MASTER_ADDR (its first worker's address), its
              own MASTER_PORT, RANK and WORLD_SIZE counted inside the group, TESTBED_GROUP (its
              name) and TESTBED_GROUP_INDEX (its place among the groups). A group that fails is
              started again, all its ranks, up to `restarts` times, once its workers are up (a
              crashed node is started again with `testbed node up`, or a scenario's `for:`).
    service   runs beside the groups (a lighthouse, a parameter server): the run ends when every
              group is done, then its services are stopped. A service that fails fails the run.

Every rank also gets TESTBED_ADDR (its worker's address) and TESTBED_ADDR_<NAME> for every group and
service (the address of its first worker, NAME upper-cased). In commands and --env values,
`{addr:NAME}` is replaced by the same address (NAME: a group, a service or a worker), so a group can
name the lighthouse: `-e TORCHFT_LIGHTHOUSE=http://{addr:lighthouse}:29510`.

On the command line each group is one string, its name, its workers and its command:

    --service "lighthouse=w0 torchft_lighthouse --min_replicas 1 --bind [::]:29510"
    --group "g0=w1 python examples/train_torchft.py" --group "g1=w2,w3 torchrun train.py"

or a job file (YAML), given as `--job FILE` or in place of the command (so a scenario's
`job.command` can name one), or the same `groups:` and `services:` written in a scenario's `job:`
(testbed.faults.scenario), whose `env:` is then the job's:

    env: {TORCHFT_LIGHTHOUSE: "http://{addr:lighthouse}:29510"}
    services:
      lighthouse: {workers: [w0], command: 'torchft_lighthouse --min_replicas 1 --bind "[::]:29510"'}
    groups:
      g0: {workers: [w1], command: python examples/train_torchft.py, restarts: 3}
      g1: {workers: [w2], command: python examples/train_torchft.py, restarts: 3}

The probe's files are named by RANK, which repeats across groups: each group's ranks write into a
folder of their own and the launcher copies every line, as it comes, into the run's probe folder as
rank-<group>_<rank>.jsonl (ProbeMirror), where the report, the scenario player and its watchdog
read steps as for any run.

The document's shape is JobFields (pydantic, strict, no unknown field); a mistake is a JobError
naming the file, the field path and the value.
"""

from __future__ import annotations

import os
import re
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Sequence, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from testbed import safeio
from testbed.errors import TopologyError
from testbed.state_schema import build_without_plugins, field_path

NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,23}")   # it ends up in probe file names and env var names
MAX_RESTARTS = 1000
MAX_NPROC_PER_NODE = 64
JOB_FILE_MAX_BYTES = 1 << 20
JOB_SUFFIXES = (".yaml", ".yml")
_ADDR = re.compile(r"\{addr:([^{}]*)\}")


class JobError(TopologyError):
    """A group, service or job file is malformed: exit status 2, naming file, field and value."""


@dataclass(frozen=True)
class Group:
    name: str
    workers: tuple[str, ...]
    cmd: tuple[str, ...]
    service: bool = False
    restarts: int = 0
    nproc_per_node: int = 1

    @property
    def kind(self) -> str:
        return "service" if self.service else "group"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "workers": list(self.workers), "cmd": list(self.cmd),
                "restarts": self.restarts, "nproc_per_node": self.nproc_per_node}


@dataclass(frozen=True)
class Job:
    groups: tuple[Group, ...]
    env: tuple[tuple[str, str], ...] = ()
    source: str | None = None

    @property
    def workers(self) -> list[str]:
        """Every worker a group or service runs on, in order of first mention."""
        out: list[str] = []
        for g in self.groups:
            out += [w for w in g.workers if w not in out]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"groups": [g.to_json() for g in self.groups], "env": dict(self.env), "source": self.source}


# -- reading them ------------------------------------------------------------------------------------------------

def is_job_file(cmd: Sequence[str]) -> bool:
    """A command that is one YAML file: a job file (a YAML file is no program to run)."""
    return len(cmd) == 1 and cmd[0].lower().endswith(JOB_SUFFIXES)


# -- the schema of a job document (a job file, or a scenario's job: groups/services), pydantic ------------------

NAME_WHY = "a name is a letter, then up to 23 letters, digits or _"
_ERROR = "testbed_job"     # our own errors: ctx carries why
_MISSING = TopologyError._MISSING


def _why(text: str) -> PydanticCustomError:
    return PydanticCustomError(_ERROR, "{why}", {"why": text})


def _group_name(value: str) -> str:
    if not NAME.fullmatch(value):
        raise _why(NAME_WHY)
    return value


def _env_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise _why("not an environment variable name")
    return value


def _worker_list(value: Any) -> tuple[str, ...]:
    """Workers as a list or a comma list ("w1,w2")."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(w, str) and w.strip() for w in items):
        raise _why("a list of worker names (or a comma list)")
    items = [w.strip() for w in items]
    if len(set(items)) != len(items):
        raise _why("a worker is named twice")
    return tuple(items)


def _command_words(value: Any) -> tuple[str, ...]:
    """A command line (split as a shell would, nothing expanded) or a list of words."""
    if isinstance(value, str):
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise _why(f"not a command line ({exc})") from None
    elif isinstance(value, list) and all(isinstance(w, str) for w in value):
        words = list(value)
    else:
        raise _why("a string or a list of strings")
    if not words:
        raise _why("empty")
    if is_job_file(words):
        raise _why("a group's command cannot be another job file")
    return tuple(words)


GroupName = Annotated[str, AfterValidator(_group_name)]
EnvName = Annotated[str, AfterValidator(_env_name)]
Workers = Annotated[tuple[str, ...], BeforeValidator(_worker_list)]
Command = Annotated[tuple[str, ...], BeforeValidator(_command_words)]
RANGES = {"restarts": (0, MAX_RESTARTS), "nproc_per_node": (1, MAX_NPROC_PER_NODE)}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class ServiceFields(_Model):
    """A service: runs beside the groups, stopped when they are done (never restarted)."""

    workers: Workers
    command: Command
    nproc_per_node: int = Field(1, ge=1, le=MAX_NPROC_PER_NODE)


class GroupFields(ServiceFields):
    """A group: a torch world of its own, started again when it fails (up to `restarts` times)."""

    restarts: int = Field(0, ge=0, le=MAX_RESTARTS)


class JobFields(_Model):
    """A job document: groups, the services beside them, and the environment of every rank."""

    env: Optional[dict[EnvName, Union[str, int, float]]] = None
    services: Optional[dict[GroupName, ServiceFields]] = None
    groups: Optional[dict[GroupName, GroupFields]] = None


for _model in (ServiceFields, GroupFields, JobFields):
    build_without_plugins(_model)   # a job file is read by root: no third-party hooks in its validation

_WHY = {"missing": "missing (required)", "string_type": "expected a string", "int_type": "expected an integer",
        "float_type": "expected a number", "finite_number": "expected a finite number"}


def _problem(exc: ValidationError) -> tuple[tuple[Any, ...], str, Any]:
    """(location, why, value) of the first problem pydantic found, in a job document's words."""
    errors = exc.errors(include_url=False)
    e = errors[0]
    loc = tuple(e["loc"])
    kind = e["type"]
    # a value that fits none of a union's types gives one error per type, each ending in the type's name
    if kind in ("string_type", "int_type", "float_type") and len(loc) == 3 and loc[0] == "env" and loc[2] != "[key]":
        return loc[:2], "a string or a number", e["input"]
    if kind == _ERROR:
        return loc, e["ctx"]["why"], e["input"]
    if loc[-1:] == ("[key]",):
        return loc, ("not an environment variable name" if loc[0] == "env" else NAME_WHY), e["input"]
    if kind == "extra_forbidden":
        model = JobFields if len(loc) == 1 else GroupFields if loc[0] == "groups" else ServiceFields
        fields = list(model.model_fields)
        return loc, f"unknown field; allowed fields: {', '.join(fields)}", loc[-1]
    if kind == "missing":
        return loc, "missing (required)", _MISSING
    if len(loc) == 3 and loc[-1] in RANGES:
        lo, hi = RANGES[loc[-1]]
        return loc, f"an integer from {lo} to {hi}", e["input"]
    if not loc:
        return loc, "a job file is a mapping with groups:, services: and env:", e["input"]
    if len(loc) == 1:
        what = "NAME: value" if loc[0] == "env" else "NAME: {workers, command}"
        return loc, f"a mapping of {what}", e["input"]
    if len(loc) == 2 and kind in ("model_type", "dict_type"):
        return loc, "a mapping with workers: and command:", e["input"]
    return loc, _WHY.get(kind, e["msg"]), e["input"]


# -- the command line's --group/--service strings -------------------------------------------------------------

def _name(value: Any, source: str | None, path: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise JobError(NAME_WHY, file=source, path=path, value=value)
    return value


def _workers(value: Any, source: str | None, path: str) -> tuple[str, ...]:
    try:
        return _worker_list(value)
    except PydanticCustomError as exc:
        raise JobError(exc.context["why"], file=source, path=path, value=value) from None


def _command(value: Any, source: str | None, path: str) -> tuple[str, ...]:
    try:
        return _command_words(value)
    except PydanticCustomError as exc:
        raise JobError(exc.context["why"], file=source, path=path, value=value) from None


def _count(value: Any, source: str | None, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise JobError(f"an integer from {lo} to {hi}", file=source, path=path, value=value)
    return value


def parse_spec(text: str, *, service: bool, restarts: int = 0, nproc_per_node: int = 1) -> Group:
    """One --group / --service value: "NAME=WORKERS CMD..." (WORKERS a comma list)."""
    opt = "--service" if service else "--group"
    head, _, rest = text.strip().partition(" ")
    name, eq, workers = head.partition("=")
    if not eq or not rest.strip():
        raise JobError(f'{opt} wants "NAME=WORKERS CMD...", e.g. "g0=w1,w2 python train.py"', path=opt, value=text)
    return Group(_name(name, None, opt), _workers(workers, None, opt), _command(rest, None, opt), service,
                 0 if service else restarts, nproc_per_node)


def from_cli(groups: Sequence[str], services: Sequence[str], *, restarts: int = 0,
             nproc_per_node: int = 1) -> Job:
    _count(restarts, None, "--restarts", 0, MAX_RESTARTS)
    job = Job(tuple([parse_spec(s, service=True, nproc_per_node=nproc_per_node) for s in services]
                    + [parse_spec(g, service=False, restarts=restarts, nproc_per_node=nproc_per_node)
                       for g in groups]))
    _check_names(job)
    return job


# -- job documents: a job file, a scenario's job: --------------------------------------------------------------

def from_mapping(data: Any, source: str | None = None, path: str = "") -> Job:
    """A job file's document (or a scenario's `job:` groups and services, `path` "job"), checked
    against JobFields: an error names the file, the field path (below `path`) and the value."""
    try:
        doc = JobFields.model_validate(data)
    except ValidationError as exc:
        loc, why, value = _problem(exc)
        # a refused mapping key (a name that is no string) is named as written: groups.1, not groups[1]
        inner = f"{field_path(loc[:-2])}.{loc[-2]}" if loc[-1:] == ("[key]",) else field_path(loc)
        where = ".".join(x for x in (path, inner) if x) or None
        raise JobError(why, file=source, path=where, value=value) from None
    out = [Group(name, spec.workers, spec.command, True, 0, spec.nproc_per_node)
           for name, spec in (doc.services or {}).items()]
    out += [Group(name, spec.workers, spec.command, False, spec.restarts, spec.nproc_per_node)
            for name, spec in (doc.groups or {}).items()]
    env = tuple((k, str(v)) for k, v in (doc.env or {}).items())
    job = Job(tuple(out), env, source)
    _check_names(job, path)
    return job


def load(path: str | os.PathLike) -> Job:
    """A job file: YAML, at most 1 MiB, a plain file."""
    import yaml

    src = str(path)
    try:
        text = safeio.read_text(Path(path), JOB_FILE_MAX_BYTES)
    except FileNotFoundError:
        raise JobError("job file not found", file=src) from None
    except (OSError, safeio.Unsafe) as exc:
        raise JobError(f"cannot read the job file ({exc})", file=src) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobError(f"not YAML ({str(exc).splitlines()[0]})", file=src) from None
    return from_mapping(data, src)


def _check_names(job: Job, path: str = "") -> None:
    seen: set[str] = set()
    for g in job.groups:
        if g.name in seen:
            where = ".".join(x for x in (path, f"groups.{g.name}") if x) if job.source else None
            raise JobError(f"two groups or services are named {g.name}", file=job.source, path=where, value=g.name)
        seen.add(g.name)
    if not any(not g.service for g in job.groups):
        raise JobError("a run of groups needs at least one group (services alone never end)", file=job.source,
                       path=".".join(x for x in (path, "groups") if x) if job.source else None)


def check_workers(job: Job, known: Sequence[str]) -> None:
    """Every worker a group names is one of the run's (the testbed's, or --workers')."""
    for g in job.groups:
        bad = [w for w in g.workers if w not in known]
        if bad:
            raise JobError(f"unknown worker {bad[0]}; the run's workers: {', '.join(known)}", file=job.source,
                           path=f"{g.kind}s.{g.name}.workers" if job.source else f"--{g.kind} {g.name}",
                           value=bad[0])


def check_addresses(job: Job, address: Mapping[str, str], env: Mapping[str, str]) -> None:
    """Every `{addr:NAME}` in the groups' commands and the env values names something (before
    anything starts)."""
    addrs = addresses(job, address)
    for k, v in [*job.env, *env.items()]:
        expand(v, addrs, where=f"env {k}")
    for g in job.groups:
        for c in g.cmd:
            expand(c, addrs, where=f"{g.kind} {g.name}")


def addresses(job: Job, address: Mapping[str, str]) -> dict[str, str]:
    """NAME -> the address a rank reaches it at: every worker's, then every group's (its first worker)."""
    out = dict(address)
    out.update({g.name: address[g.workers[0]] for g in job.groups})
    return out


def addr_names(text: str) -> list[str]:
    """The NAMEs of the `{addr:NAME}` in `text`, in order."""
    return _ADDR.findall(text)


def expand(text: str, addrs: Mapping[str, str], *, where: str) -> str:
    """`{addr:NAME}` replaced by NAME's address."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in addrs:
            raise JobError(f"{{addr:{m.group(1)}}}: no group, service or worker of that name", path=where,
                           value=text)
        return addrs[m.group(1)]
    return _ADDR.sub(sub, text)


def env_names(job: Job, addrs: Mapping[str, str]) -> dict[str, str]:
    """TESTBED_ADDR_<NAME> of every group and service."""
    return {f"TESTBED_ADDR_{g.name.upper()}": addrs[g.name] for g in job.groups}


# -- the probe's files, one name per rank of the job ---------------------------------------------------------------

def probe_name(group: str, rank: int | str) -> str:
    return f"rank-{group}_{rank}.jsonl"


@dataclass
class ProbeMirror:
    """Copies what each group's ranks append to <probe>/<group>/rank-R.jsonl, as it comes, to
    <probe>/rank-<group>_R.jsonl. The group folders are the ranks' (read as plain files, never
    through a link, a bounded amount per pass); the flat files are ours, made before any rank starts
    (O_EXCL, no link followed) and only appended to through their descriptors."""

    probe: Path
    groups: Sequence[str]
    interval_s: float = 0.2
    max_bytes: int = 512 << 20
    _offsets: dict[str, int] = field(default_factory=dict)
    _out: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def folder(self, group: str) -> Path:
        return self.probe / group

    def start(self) -> "ProbeMirror":
        for g in self.groups:
            d = self.folder(g)
            d.mkdir(mode=0o755, exist_ok=False)
            os.chmod(d, 0o755)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.pass_once()

    def pass_once(self) -> None:
        for g in self.groups:
            try:
                names = sorted(os.listdir(self.folder(g)))
            except OSError:
                continue
            for n in names:
                m = re.fullmatch(r"rank-([0-9]{1,6})\.jsonl", n)
                if m:
                    self._copy(g, m.group(1), self.folder(g) / n)

    def _copy(self, group: str, rank: str, src: Path) -> None:
        key = f"{group}/{rank}"
        off = self._offsets.get(key, 0)
        if off >= self.max_bytes:
            return
        try:
            data = safeio.read_regular(src, min(1 << 22, self.max_bytes - off), off)
        except (OSError, safeio.Unsafe):
            return
        end = data.rfind(b"\n")   # whole lines only: a reader never sees half a record
        if end < 0:
            return
        fd = self._out.get(key)
        if fd is None:
            try:
                fd = os.open(self.probe / probe_name(group, rank),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_APPEND, 0o644)
            except OSError:   # something else took the name: this rank is not mirrored
                self._offsets[key] = self.max_bytes
                return
            self._out[key] = fd
        view = memoryview(data[: end + 1])
        while view:
            view = view[os.write(fd, view):]
        self._offsets[key] = off + end + 1

    def stop(self) -> None:
        """One last pass (what the ranks wrote before they ended), then the files are closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pass_once()
        for fd in self._out.values():
            os.close(fd)
        self._out.clear()
