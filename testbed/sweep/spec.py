"""A sweep spec: the topology, the job, and what varies over which values (a grid or a list).

    name: bandwidth                # default: the file's name
    topology: fat-tree             # as `testbed up` takes it
    set: [params.k=4]              # overrides every point starts from
    dilation: auto                 # as `testbed up --time-dilation`
    job:                           # default: the main job (what `make testbed` runs)
      steps: 20
    repeats: 2
    grid:                          # every combination ...
      link.bandwidth: [1gbit, 2.5gbit, 5gbit, 10gbit]
    # points:                      # ... or a list of points
    #   - {link.bandwidth: 1gbit, dilation: 8}

What a parameter names (PARAMETER_HELP): a topology override path (as `--set`), `link.FIELD`
(that field on every tier of the topology), `dilation`, `scenario`, `job.steps`,
`job.batch_size`, `job.args`. The file is validated by pydantic (no unknown fields, strict
types); every problem is a TopologyError naming the file, the field path and the value. The
command line's options build the same document (their source is named "the command line").
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from testbed.errors import TopologyError
from testbed.state_schema import field_path

CLI_SOURCE = "the command line"
LINK_FIELDS = ("bandwidth", "delay", "jitter", "loss", "queue")
JOB_PARAMS = ("job.steps", "job.batch_size", "job.args")
SPECIAL = ("dilation", "scenario") + JOB_PARAMS
PARAMETER_HELP = ("a topology override path as `testbed up --set` takes it (params.k, tiers.host.delay, ...), "
                  f"link.FIELD ({', '.join(LINK_FIELDS)}: on every tier), dilation, scenario, "
                  + ", ".join(JOB_PARAMS))
MAX_POINTS = 1000
MAX_REPEATS = 100
_PATH = re.compile(r"[A-Za-z0-9_-]+(\[\d+\])*(\.[A-Za-z0-9_-]+(\[\d+\])*)*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")

Scalar = Union[str, int, float, None]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class JobFields(_Model):
    command: Optional[Union[str, list[str]]] = None      # None: the main job
    steps: int = Field(20, ge=2)
    batch_size: int = Field(32, ge=1)
    args: Union[str, list[str]] = ""
    workers: str = "all"
    timeout: Union[str, int, float] = "900s"


class SweepFile(_Model):
    name: Optional[str] = None
    description: Optional[str] = None
    topology: str
    set: list[str] = []
    testbed: Optional[str] = None
    dilation: Union[str, int, float] = "auto"
    scenario: Optional[str] = None
    job: JobFields = JobFields()
    repeats: int = Field(1, ge=1, le=MAX_REPEATS)
    grid: Optional[dict[str, list[Scalar]]] = None
    points: Optional[list[dict[str, Scalar]]] = None


@dataclass(frozen=True)
class Job:
    """What runs at each point: the main job (command None) or a command, on `workers`."""

    command: tuple[str, ...] | None = None
    steps: int = 20
    batch_size: int = 32
    args: tuple[str, ...] = ()
    workers: str = "all"
    timeout_s: float = 900.0

    @property
    def main(self) -> bool:
        return self.command is None

    def to_json(self) -> dict[str, Any]:
        return {"command": None if self.command is None else list(self.command), "steps": self.steps,
                "batch_size": self.batch_size, "args": list(self.args), "workers": self.workers,
                "timeout_s": self.timeout_s}


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: the base every point starts from, and the points' parameters."""

    name: str
    topology: str
    sets: tuple[str, ...]
    testbed: str
    dilation: str
    scenario: str | None
    job: Job
    repeats: int
    swept: tuple[str, ...]                      # the parameters that vary, in the order written
    points: tuple[tuple[tuple[str, Any], ...], ...]   # each point: (parameter, value) in `swept` order
    grid: bool                                  # a grid (every combination) or a list
    source: str | None = None
    description: str | None = None
    base_dir: str = field(default=".")          # where relative paths of the file are taken from

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "topology": self.topology, "set": list(self.sets), "testbed": self.testbed,
                "dilation": self.dilation, "scenario": self.scenario, "job": self.job.to_json(),
                "repeats": self.repeats, "swept": list(self.swept), "grid": self.grid,
                "points": [[[k, v] for k, v in p] for p in self.points], "source": self.source}


def _err(source: str | None, why: str, path: str | None = None, *value: Any) -> TopologyError:
    return TopologyError(why, file=source, path=path, **({"value": value[0]} if value else {}))


_WHY = {"int_type": "expected an integer", "string_type": "expected a string", "list_type": "expected a list",
        "dict_type": "expected a mapping", "model_type": "expected a mapping", "finite_number": "expected a finite number",
        "float_type": "expected a number", "missing": "missing (required)"}


def _validation_error(exc: ValidationError, source: str | None) -> TopologyError:
    """The first problem pydantic found, as file: field path: why (got value)."""
    errors = exc.errors(include_url=False)
    # a value that fits none of a union's types gives one error per type: the field's path is their common part
    e = errors[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in ("str", "int", "float", "list[str]", "none",
                                                                          "function-after[...]")))
    kind = e["type"]
    if kind == "extra_forbidden":
        allowed = JobFields.model_fields if "job" in loc[:-1] else SweepFile.model_fields
        return _err(source, f"unknown field; allowed fields: {', '.join(allowed)}", field_path(loc), loc[-1])
    if kind == "missing":
        return _err(source, "missing (required)", field_path(loc))
    if kind in ("greater_than_equal", "less_than_equal"):
        bound = (e.get("ctx") or {})
        why = f"must be >= {bound['ge']}" if "ge" in bound else f"must be <= {bound['le']}"
    else:
        types = sorted({_WHY.get(x["type"], x["msg"]) for x in errors if tuple(x["loc"])[:len(loc)] == loc})
        why = " or ".join(types) if types else _WHY.get(kind, e["msg"])
    return _err(source, why, field_path(loc), e["input"])


def _seconds(value: Any, source: str | None, path: str) -> float:
    from testbed.topology.units import parse_time

    try:
        s = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else parse_time(value)
    except (TypeError, ValueError) as exc:
        raise _err(source, str(exc), path, value) from None
    if not s > 0:
        raise _err(source, "must be a positive time", path, value)
    return s


def _words(value: str | list[str]) -> tuple[str, ...]:
    return tuple(shlex.split(value)) if isinstance(value, str) else tuple(value)


def check_parameter(key: str, source: str | None, path: str) -> None:
    """A parameter name is one of SPECIAL, link.FIELD or an override path."""
    if key in SPECIAL:
        return
    if key.startswith("link."):
        if key[5:] not in LINK_FIELDS:
            raise _err(source, f"link.FIELD takes one of {', '.join(LINK_FIELDS)}", path, key)
        return
    if key.startswith("job."):
        raise _err(source, f"a job parameter is one of {', '.join(JOB_PARAMS)}", path, key)
    if not _PATH.fullmatch(key):
        raise _err(source, f"not a parameter; a parameter is {PARAMETER_HELP}", path, key)


def check_value(key: str, value: Any, source: str | None, path: str) -> Any:
    """A parameter's value, checked as far as it can be without the topology (that comes with the plan)."""
    from testbed.topology.units import parse_bandwidth, parse_loss, parse_time

    if isinstance(value, bool):
        raise _err(source, "expected a number or a string, not true/false", path, value)
    if key.startswith("link.") and value is not None:
        fld = key[5:]
        try:
            if fld == "bandwidth":
                parse_bandwidth(value)
            elif fld in ("delay", "jitter"):
                parse_time(value)
            elif fld == "loss":
                parse_loss(value)
            elif not isinstance(value, int) or value < 1:
                raise ValueError("queue is a positive number of packets")
        except (TypeError, ValueError) as exc:
            raise _err(source, str(exc), path, value) from None
    elif key == "dilation":
        _dilation(value, source, path)
    elif key == "scenario" and value is not None and not isinstance(value, str):
        raise _err(source, "expected a scenario file's path", path, value)
    elif key in ("job.steps", "job.batch_size") and (not isinstance(value, int) or value < (2 if key == "job.steps" else 1)):
        raise _err(source, f"expected an integer >= {2 if key == 'job.steps' else 1}", path, value)
    return value


def _dilation(value: Any, source: str | None, path: str) -> str:
    if isinstance(value, str) and value.strip().lower() in ("auto", "none"):
        return value.strip().lower()
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise _err(source, "time dilation is 'auto', 'none' or a number >= 1", path, value) from None
    if not s >= 1 or s != s or s == float("inf"):
        raise _err(source, "time dilation is 'auto', 'none' or a number >= 1", path, value)
    return f"{s:g}"


def _name_of(topology: str, swept: list[str]) -> str:
    """A sweep without a file and a name: its topology's and its parameters' (star-bandwidth)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(topology).stem) or "sweep"
    name = "-".join([stem] + [re.sub(r"[^A-Za-z0-9_-]", "-", k.rsplit(".", 1)[-1]) for k in swept])
    return name[:34].strip("-.") or "sweep"


def sweep_from_data(data: Any, source: str | None = None, base_dir: str | Path = ".") -> Sweep:
    """Validate a parsed sweep document into a Sweep; every problem names `source`, the field and the value."""
    if not isinstance(data, dict):
        raise _err(source, "expected a mapping (topology:, job:, grid: or points:, ...)" if data is not None
                   else "the file is empty; a sweep needs a topology and a grid or points", None,
                   *(() if data is None else (data,)))
    try:
        doc = SweepFile.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, source) from None
    if doc.grid is not None and doc.points is not None:
        raise _err(source, "give either grid: (every combination) or points: (a list), not both", "points")
    swept: list[str] = []
    points: list[dict[str, Any]] = []
    if doc.grid is not None:
        if not doc.grid:
            raise _err(source, "a grid needs at least one parameter", "grid")
        for key, values in doc.grid.items():
            check_parameter(key, source, f"grid.{key}")
            if not values:
                raise _err(source, "a parameter needs at least one value", f"grid.{key}", values)
            for i, v in enumerate(values):
                check_value(key, v, source, f"grid.{key}[{i}]")
            if len(set(map(repr, values))) != len(values):
                raise _err(source, "a value is given twice", f"grid.{key}", values)
            swept.append(key)
        import itertools

        combos = list(itertools.product(*(doc.grid[k] for k in swept)))
        if len(combos) > MAX_POINTS:
            raise _err(source, f"{len(combos)} points: at most {MAX_POINTS}", "grid")
        points = [dict(zip(swept, c)) for c in combos]
    elif doc.points is not None:
        if not doc.points:
            raise _err(source, "points: needs at least one point", "points")
        if len(doc.points) > MAX_POINTS:
            raise _err(source, f"{len(doc.points)} points: at most {MAX_POINTS}", "points")
        for i, p in enumerate(doc.points):
            if not p:
                raise _err(source, "a point needs at least one parameter", f"points[{i}]", p)
            for key, v in p.items():
                check_parameter(key, source, f"points[{i}].{key}")
                check_value(key, v, source, f"points[{i}].{key}")
                if key not in swept:
                    swept.append(key)
        seen: dict[str, int] = {}
        for i, p in enumerate(doc.points):
            k = repr(sorted(p.items(), key=lambda kv: kv[0]))
            if k in seen:
                raise _err(source, f"the same point as points[{seen[k]}]", f"points[{i}]", p)
            seen[k] = i
        points = list(doc.points)
    else:
        points = [{}]   # no parameter varies: the base alone, repeated
    for i, s in enumerate(doc.set):
        if "=" not in s:
            raise _err(source, "expected PATH=VALUE, e.g. params.k=8", f"set[{i}]", s)
    dilation = _dilation(doc.dilation, source, "dilation")
    job = doc.job
    if job.command is not None and not _words(job.command):
        raise _err(source, "the command is empty", "job.command", job.command)
    name = doc.name or (Path(source).stem if source and source != CLI_SOURCE else None) or _name_of(doc.topology, swept)
    if not _NAME.fullmatch(name):
        raise _err(source, "a sweep name is letters, digits, '.', '_', '-' (at most 40)", "name", name)
    testbed = doc.testbed or f"sweep-{name}"[:40]
    if not _NAME.fullmatch(testbed):
        raise _err(source, "a testbed name is letters, digits, '.', '_', '-' (at most 40)", "testbed", testbed)
    return Sweep(
        name=name, topology=doc.topology, sets=tuple(doc.set), testbed=testbed, dilation=dilation,
        scenario=doc.scenario,
        job=Job(command=None if job.command is None else _words(job.command), steps=job.steps,
                batch_size=job.batch_size, args=_words(job.args), workers=job.workers,
                timeout_s=_seconds(job.timeout, source, "job.timeout")),
        repeats=doc.repeats, swept=tuple(swept),
        points=tuple(tuple((k, p.get(k)) for k in swept if k in p) for p in points),
        grid=doc.points is None, source=source, description=doc.description, base_dir=str(base_dir))


def load_sweep(path: str | Path) -> Sweep:
    """The sweep file at `path`, validated. Duplicate keys are refused as the topology loader refuses them."""
    from testbed.topology.loader import parse_yaml

    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _err(source, "sweep file not found") from None
    except UnicodeDecodeError:
        raise _err(source, "the file is not UTF-8 text") from None
    except OSError as exc:
        raise _err(source, f"cannot read the file: {exc.strerror or exc}") from None
    return sweep_from_data(parse_yaml(text, source), source, Path(path).parent)


def parse_option_values(option: str, text: str) -> tuple[str, list[Any]]:
    """`--grid KEY=V1,V2,...` (or `--point`'s KEY=V): the key and its values, each read as YAML
    (so 8 is a number, 1gbit a string)."""
    import yaml

    if "=" not in text:
        raise _err(CLI_SOURCE, f"{option} wants KEY=VALUE[,VALUE...], e.g. link.bandwidth=1gbit,10gbit",
                   option, text)
    key, _, rest = text.partition("=")
    values = []
    for raw in rest.split(","):
        try:
            v = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise _err(CLI_SOURCE, "a value is not valid YAML", f"{option} {key.strip()}", raw) from None
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            v = raw.strip()
        values.append(v)
    return key.strip(), values


def data_from_options(topology: str, grid: list[str], points: list[str], sets: list[str],
                      **fields: Any) -> dict[str, Any]:
    """The sweep document the command line's options describe (validated like a file)."""
    data: dict[str, Any] = {"topology": topology, "set": list(sets)}
    if grid:
        data["grid"] = {}
        for text in grid:
            key, values = parse_option_values("--grid", text)
            data["grid"][key] = values
    if points:
        data["points"] = []
        for text in points:   # one point: KEY=V[;KEY=V...]
            point: dict[str, Any] = {}
            for part in text.split(";"):
                key, values = parse_option_values("--point", part)
                point[key] = values[0] if len(values) == 1 else ",".join(map(str, values))
            data["points"].append(point)
    job = {k: v for k, v in (fields.pop("job", None) or {}).items() if v is not None}
    if job:
        data["job"] = job
    data.update({k: v for k, v in fields.items() if v is not None})
    return data
