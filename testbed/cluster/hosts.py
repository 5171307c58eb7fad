"""The hosts file: the machines one testbed spans, their SSH access, capacity and underlay address.

Pure: parsing and validation only (reading the file is the only I/O); nothing here connects to a
host or looks at the local filesystem beyond the file itself (a key path is checked when a
connection is made, not here). The format (docs/multi-host.md)::

    hosts:
      - name: gpu-a                   # a name pins and tables use (letters, digits, '-', '_')
        ssh: root@gpu-a.lab:22        # [user@]host[:port]; IPv6 as [addr]:port
        key: ~/.ssh/testbed_ed25519   # a private key; omit it to use the SSH agent
        agent: true                   # optional: also (or, with no key, only) the agent
        underlay: 192.168.50.1        # the IP address tunnels between hosts use
        capacity: {cores: 32, memory: 256g, gpus: 8}
        labels: {rack: r1}            # optional, free-form

Validation (pydantic v2, strict types, no unknown fields) raises TopologyError naming the file,
the field path and the value: ``hosts.yaml: hosts[2].capacity.cores: must be >= 1 (got 0)``.
Names, underlay addresses and SSH targets (address and port) are unique across the file.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterator

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from testbed.errors import TopologyError
from testbed.state_schema import build_without_plugins, field_path
from testbed.topology.loader import NAME_RE, parse_yaml
from testbed.topology.units import parse_size

__all__ = ["Capacity", "Host", "Hosts", "SshTarget", "load_hosts", "load_hosts_text", "hosts_from_data",
           "parse_ssh"]

_ERROR = "testbed_hosts"   # our own errors: ctx carries why, the value and where below the validator
DEFAULT_SSH_PORT = 22

# A DNS name (RFC 1123 labels) or an IPv4 address; IPv6 goes in brackets.
_HOSTNAME_RE = re.compile(r"^(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?\Z")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}\Z")


def _fail(why: str, value: Any, at: str = "") -> PydanticCustomError:
    """An error `why` about `value`, at `at` (a dotted path below the validator's own place)."""
    return PydanticCustomError(_ERROR, "{why}", {"why": why, "value": value, "at": at})


# -- values ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SshTarget:
    """Where to SSH: `user` None means SSH's own default (~/.ssh/config, then the login name)."""

    user: str | None
    address: str
    port: int = DEFAULT_SSH_PORT

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port != DEFAULT_SSH_PORT else ""
        return f"{user}{host}{port}"


def parse_ssh(text: str) -> SshTarget:
    """'[user@]host[:port]' (IPv6: '[user@][addr][:port]') -> SshTarget; ValueError says why not."""
    user = None
    rest = text.strip()
    if "@" in rest:
        user, rest = rest.rsplit("@", 1)
        if not _USER_RE.match(user):
            raise ValueError(f"not a user name: {user!r}")
    port_text = None
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise ValueError("an IPv6 address in brackets needs its ']'")
        address, tail = rest[1:end], rest[end + 1:]
        if tail:
            if not tail.startswith(":"):
                raise ValueError("expected ':PORT' after the bracketed address")
            port_text = tail[1:]
        try:
            address = str(ipaddress.IPv6Address(address))
        except ValueError:
            raise ValueError(f"not an IPv6 address: {address!r}") from None
    else:
        if rest.count(":") > 1:
            raise ValueError("write an IPv6 address in brackets: [addr]:port")
        address, _, port_text = rest.partition(":") if ":" in rest else (rest, "", None)
        if not _HOSTNAME_RE.match(address):
            raise ValueError(f"not a host name or IPv4 address: {address!r}")
    port = DEFAULT_SSH_PORT
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"the port must be 1-65535, not {port_text!r}")
        port = int(port_text)
    return SshTarget(user=user, address=address.lower(), port=port)


def _ssh(v: Any) -> Any:
    if isinstance(v, str):
        try:
            parse_ssh(v)
        except ValueError as e:
            raise _fail(f"expected [user@]host[:port]: {e}", v) from None
    return v


def _underlay(v: Any) -> Any:
    if not isinstance(v, str):
        return v  # the strict str check says so
    try:
        ip = ipaddress.ip_address(v.strip())
    except ValueError:
        raise _fail("not an IP address (the underlay is the address tunnels use, e.g. 192.168.50.1)",
                    v) from None
    if ip.is_unspecified or ip.is_multicast or ip.is_loopback:
        raise _fail("the underlay must be a unicast address other hosts reach (not loopback, unspecified "
                    "or multicast)", v)
    return str(ip)


def _memory(v: Any) -> Any:
    if v is None:
        return v
    try:
        size = parse_size(v)
    except ValueError as e:
        raise _fail(str(e), v) from None
    if size <= 0:
        raise _fail("must be > 0", v)
    return size


def _label_value(v: Any) -> Any:
    """Label values are strings; a YAML number or boolean (rack: 1) is taken as its text."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return v


# -- the schema ------------------------------------------------------------------------------------------


class _Record(BaseModel):
    """Strict types (an integer is never "1" or true), no unknown fields, immutable. Built once, with
    pydantic's plugins off (see _build): the hosts file will say where testbed acts as root."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False, defer_build=True)


class Capacity(_Record):
    """What a host gives to workers: cores (a worker takes its `cpus`, or 1), GPUs, memory (bytes;
    None: not limited, workers' memory is not counted)."""

    cores: Annotated[int, Field(ge=1)]
    gpus: Annotated[int, Field(ge=0)] = 0
    memory: Annotated[int | None, BeforeValidator(_memory)] = None


class Host(_Record):
    name: str
    ssh: Annotated[str, BeforeValidator(_ssh)]
    key: str | None = None
    agent: bool | None = None
    underlay: Annotated[str, BeforeValidator(_underlay)]
    capacity: Capacity
    labels: dict[str, Annotated[str, BeforeValidator(_label_value)]] = Field(default_factory=dict)
    testbed: str = "testbed"     # the command that runs testbed on the host (a path, or words for shlex)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise _fail("a host name must be letters, digits, '-' and '_' (starting with a letter or digit)", v)
        return v

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "\0" in v):
            raise _fail("expected the path of a private key", v)
        return v

    @field_validator("testbed")
    @classmethod
    def _testbed(cls, v: str) -> str:
        import shlex

        try:
            words = shlex.split(v)
        except ValueError as exc:
            raise _fail(f"not a command line ({exc})", v) from None
        if not words or "\0" in v or "\n" in v:
            raise _fail("expected the command that runs testbed on the host, e.g. /opt/testbed/.venv/bin/testbed",
                        v)
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _LABEL_RE.match(key):
                raise _fail("a label name must be letters, digits and '-', '_', '.', '/'", key, key)
        return v

    @model_validator(mode="after")
    def _login(self) -> "Host":
        if self.key is None and self.agent is False:
            raise _fail("no way to log in: give a key, or leave agent on", False, "agent")
        return self

    # -- derived views

    @property
    def target(self) -> SshTarget:
        return parse_ssh(self.ssh)

    @property
    def testbed_argv(self) -> list[str]:
        import shlex

        return shlex.split(self.testbed)

    @property
    def uses_agent(self) -> bool:
        """The SSH agent is used when asked for, and by default when no key is given."""
        return self.agent if self.agent is not None else self.key is None

    def to_json(self) -> dict[str, Any]:
        t = self.target
        return {"name": self.name, "ssh": str(t), "user": t.user, "address": t.address, "port": t.port,
                "key": self.key, "agent": self.uses_agent, "underlay": self.underlay,
                "capacity": self.capacity.model_dump(), "labels": dict(self.labels), "testbed": self.testbed}


class _HostsFile(_Record):
    hosts: Annotated[list[Host], Field(min_length=1)]
    description: str | None = None

    @model_validator(mode="after")
    def _unique(self) -> "_HostsFile":
        names: dict[str, int] = {}
        underlays: dict[str, int] = {}
        targets: dict[tuple[str, int], int] = {}
        for i, h in enumerate(self.hosts):
            t = h.target
            for seen, key, field_name, what in ((names, h.name, "name", "name"),
                                                (underlays, h.underlay, "underlay", "underlay address"),
                                                (targets, (t.address, t.port), "ssh", "SSH address and port")):
                if key in seen:
                    raise _fail(f"the same {what} as hosts[{seen[key]}]", getattr(h, field_name),
                                f"hosts[{i}].{field_name}")
                seen[key] = i
        return self


_MODELS: dict[str, type[BaseModel]] = {"": _HostsFile, "hosts": Host, "capacity": Capacity}
_FIELD_NAMES = {cls: tuple(cls.model_fields) for cls in (_HostsFile, Host, Capacity)}


build_without_plugins(_HostsFile)   # as the state's schema is built: no third-party hooks


# -- errors ----------------------------------------------------------------------------------------------


def _allowed(loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The field names allowed where an unknown field `loc` was found."""
    model = _MODELS.get(next((p for p in reversed(loc[:-1]) if isinstance(p, str)), ""), _HostsFile)
    return _FIELD_NAMES[model]


_TYPES = {"int_type": "expected an integer", "int_parsing": "expected an integer",
          "string_type": "expected a string", "bool_type": "expected true or false",
          "list_type": "expected a list", "dict_type": "expected a mapping", "model_type": "expected a mapping",
          "model_attributes_type": "expected a mapping", "finite_number": "expected a finite number"}


def _error(exc: ValidationError, source: str | None) -> TopologyError:
    """The first error of `exc` as a TopologyError: file, dotted field path, why, value."""
    e = exc.errors(include_url=False)[0]
    loc, kind, ctx = tuple(e["loc"]), e["type"], e.get("ctx") or {}
    if kind == _ERROR:
        return TopologyError(ctx["why"], file=source, path=field_path(loc, ctx.get("at", "")) or None,
                             value=ctx.get("value", e["input"]))
    path = field_path(loc) or None
    if kind == "missing":
        return TopologyError("missing (required)", file=source, path=path)
    if kind == "extra_forbidden":
        return TopologyError(f"unknown field; allowed fields: {', '.join(_allowed(loc))}", file=source, path=path,
                             value=loc[-1])
    if kind == "greater_than_equal":
        why = f"must be >= {ctx['ge']}"
    elif kind == "too_short":
        why = "must not be empty"
    else:
        why = _TYPES.get(kind) or (e["msg"][:1].lower() + e["msg"][1:])
    return TopologyError(why, file=source, path=path, value=e["input"])


# -- the loaded file -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hosts:
    """The hosts of a hosts file, in file order (the order placement prefers and tables show)."""

    hosts: tuple[Host, ...]
    source: str | None = None
    description: str | None = None
    text: str | None = None        # the file's text, when loaded from text (a controller keeps it)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def get(self, name: str) -> Host | None:
        return next((h for h in self.hosts if h.name == name), None)

    def __getitem__(self, name: str) -> Host:
        host = self.get(name)
        if host is None:
            raise KeyError(name)
        return host

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "hosts": [h.to_json() for h in self.hosts]}


def hosts_from_data(data: Any, source: str | None = None) -> Hosts:
    """Validate parsed YAML `data` (a mapping with `hosts:`) into Hosts; `source` names it in errors."""
    if data is None:
        raise TopologyError("the file is empty; a hosts file is a mapping with a list under 'hosts'",
                            file=source)
    if not isinstance(data, dict):
        raise TopologyError("expected a mapping with a list under 'hosts'", file=source, value=data)
    try:
        doc = _HostsFile.model_validate(data)
    except ValidationError as exc:
        raise _error(exc, source) from None
    return Hosts(hosts=tuple(doc.hosts), source=source, description=doc.description)


def load_hosts_text(text: str, source: str | None = None, base: str | Path | None = None) -> Hosts:
    """Parse YAML `text` (duplicate keys refused, with their line) and validate it. base: the
    directory a relative `key:` path is taken from (the hosts file's; None: as written)."""
    from dataclasses import replace

    hosts = replace(hosts_from_data(parse_yaml(text, source), source), text=text)
    if base is None:
        return hosts
    # a relative key is the hosts file's neighbour, wherever the command runs (~ stays for SshHost)
    return replace(hosts, hosts=tuple(
        h.model_copy(update={"key": os.path.join(os.path.abspath(base), h.key)})
        if h.key is not None and not os.path.isabs(h.key) and not h.key.startswith("~") else h
        for h in hosts.hosts))


def load_hosts(path: str | Path) -> Hosts:
    """Load and validate the hosts file at `path`. Every problem is a TopologyError naming the file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TopologyError("the file is not UTF-8 text", file=source) from None
    except FileNotFoundError:
        raise TopologyError("hosts file not found", file=source) from None
    except OSError as e:
        raise TopologyError(f"cannot read the file: {e.strerror or e}", file=source) from None
    return load_hosts_text(text, source, base=Path(path).parent)
