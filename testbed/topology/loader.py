"""Load a topology from YAML (explicit nodes/links or a generator) into a validated Topology.

Layers, each raising TopologyError(file=, path=, value=) and never anything else:

1. find and read the file (`resolve_spec`, `load_topology`);
2. parse YAML, refusing duplicate keys, which PyYAML would silently drop (`parse_yaml`);
3. apply ``path=value`` command-line overrides to the raw data (`apply_overrides`);
4. check the shape field by field and build the model (`topology_from_data`);
5. the model's own graph checks (`Topology.validate`).

Link profiles are layered, later layers overriding earlier ones field by field:
generator tier default -> ``defaults.link`` -> ``tiers.NAME`` -> the link's own
fields. Each layer may hold ``forward:`` (endpoints[0] -> endpoints[1]; for a
generator, from the lower end upward) and ``reverse:`` mappings that override
one direction only.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

import testbed
from testbed.errors import TopologyError
from testbed.topology.generators import GENERATORS
from testbed.topology.model import HOST_RATE_KINDS, NODE_KINDS, Link, LinkProfile, Node, Topology
from testbed.topology.units import parse_bandwidth, parse_loss, parse_size, parse_time

__all__ = ["load_topology", "load_topology_text", "topology_from_data", "apply_overrides", "parse_yaml",
           "resolve_spec", "topology_dirs"]

TOP_FIELDS = ("name", "description", "generator", "params", "tiers", "defaults", "nodes", "links",
              "runtime", "time_dilation", "host_rate", "gpu_policy", "gpu_sharing", "addressing")
DEFAULTS_FIELDS = ("link", "worker")
PROFILE_FIELDS = ("bandwidth", "delay", "jitter", "loss", "queue", "mtu")
DIRECTIONS = ("forward", "reverse")
LINK_FIELDS = ("endpoints", "tier") + PROFILE_FIELDS + DIRECTIONS
NODE_FIELDS = ("kind", "gpus", "cpus", "memory", "image")
WORKER_DEFAULT_FIELDS = ("gpus", "cpus", "memory", "image")
ADDRESSING_FIELDS = ("pool", "fabric_pool")

# Names end up in namespace, container and interface names and in dotted override paths.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*\Z")


def _repo_topologies() -> Path:
    return Path(testbed.__file__).resolve().parent.parent / "topologies"


def topology_dirs() -> list[Path]:
    """Where bare names are looked up: ./topologies, then the repository's topologies/."""
    return [Path("topologies"), _repo_topologies()]


# -- paths and small checks ----------------------------------------------------------------------------


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


class _Ctx:
    """The source file, so every error can name it."""

    def __init__(self, source: str | None):
        self.source = source

    def error(self, message: str, path: str | None = None, *value: Any) -> TopologyError:
        if value:
            return TopologyError(message, file=self.source, path=path, value=value[0])
        return TopologyError(message, file=self.source, path=path)

    def mapping(self, value: Any, path: str, allowed: Sequence[str] | None = None) -> dict:
        """`value` as a dict (None counts as empty); with `allowed`, unknown keys are refused."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(f"expected a mapping, not a {_type(value)}", path or "(top level)", value)
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    raise self.error(f"unknown field; allowed fields: {', '.join(allowed)}", _join(path, str(key)),
                                     key)
        return value

    def parse(self, fn: Callable[[Any], Any], value: Any, path: str) -> Any:
        try:
            return fn(value)
        except ValueError as e:
            raise self.error(str(e), path, value) from None

    def name(self, value: Any, path: str, what: str) -> str:
        if not isinstance(value, str) or not NAME_RE.match(value):
            raise self.error(f"{what} must be a string of letters, digits, '-' and '_' "
                             f"(starting with a letter or digit)", path, value)
        return value


def _type(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


def _int(ctx: _Ctx, value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.error("expected an integer", path, value)
    if value < minimum:
        raise ctx.error(f"must be >= {minimum}", path, value)
    return value


def _number(ctx: _Ctx, value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ctx.error("expected a number", path, value)
    return value


def _string(ctx: _Ctx, value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ctx.error("expected a string", path, value)
    return value


# -- reading and YAML --------------------------------------------------------------------------------------


def resolve_spec(spec: str | Path) -> Path:
    """The file `spec` names: a path, or a bare name (".yaml" optional) in topology_dirs()."""
    path = Path(spec)
    if path.is_file():
        return path
    candidates: list[Path] = []
    if len(path.parts) == 1:  # a bare name: look in the topology directories
        for d in topology_dirs():
            for name in (path.name, path.name + ".yaml", path.name + ".yml"):
                candidates.append(d / name)
    for c in candidates:
        if c.is_file():
            return c
    looked = f" (looked in {', '.join(str(d) for d in topology_dirs())})" if candidates else ""
    raise TopologyError(f"topology file not found{looked}", file=str(spec))


def parse_yaml(text: str, source: str | None = None) -> Any:
    """YAML text to data; syntax errors and duplicate keys become TopologyError with the line."""
    ctx = _Ctx(source)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            return None
        _check_duplicates(ctx, root, "")
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = e.problem or e.context or "syntax error"
        raise ctx.error(f"invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as e:
        raise ctx.error(f"invalid YAML: {e}") from None


def _check_duplicates(ctx: _Ctx, node: yaml.Node, path: str) -> None:
    """PyYAML keeps the last of duplicate keys without a word; a duplicate node name must be an error."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None:
                line = key_node.start_mark.line + 1
                if key in seen:
                    what = "duplicate node name" if path == "nodes" else "duplicate key"
                    raise ctx.error(f"{what} at line {line} (first at line {seen[key]})", _join(path, key), key)
                seen[key] = line
            _check_duplicates(ctx, value_node, _join(path, key if key is not None else "?"))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(ctx, item, _join(path, i))


# -- overrides ---------------------------------------------------------------------------------------------

_OVERRIDE_TOKEN = re.compile(r"([A-Za-z0-9_-]+)|\[(\d+)\]|(\.)")


def _override_path(text: str) -> list[str | int]:
    """'links[2].delay' -> ['links', 2, 'delay']; ValueError if malformed."""
    parts: list[str | int] = []
    pos = 0
    expect_key = True
    while pos < len(text):
        m = _OVERRIDE_TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"unexpected {text[pos]!r} in the path")
        if m.group(1) is not None:
            if not expect_key:
                raise ValueError("a field name must follow a '.'")
            parts.append(m.group(1))
            expect_key = False
        elif m.group(2) is not None:
            if expect_key:
                raise ValueError("an index must follow a field name")
            parts.append(int(m.group(2)))
        else:
            if expect_key:
                raise ValueError("empty field name")
            expect_key = True
        pos = m.end()
    if expect_key:
        raise ValueError("the path is empty or ends with '.'")
    return parts


def apply_overrides(data: Any, overrides: Sequence[str], source: str | None = None) -> dict:
    """A copy of `data` with each "dotted.path[i]=value" applied (value parsed as YAML).

    Missing mapping keys are created, so `tiers.host.delay=1ms` works on a file without tiers.
    """
    result = copy.deepcopy(data) if data is not None else {}
    if not isinstance(result, dict):
        raise TopologyError(f"expected a mapping at the top level, not a {_type(result)}", file=source,
                            value=result)
    for override in overrides:
        def bad(reason: str) -> TopologyError:
            return TopologyError(f"bad override: {reason}", file=source, value=override)

        if not isinstance(override, str) or "=" not in override:
            raise bad("expected PATH=VALUE, e.g. params.k=8")
        key_text, value_text = override.split("=", 1)
        try:
            parts = _override_path(key_text.strip())
        except ValueError as e:
            raise bad(str(e)) from None
        try:
            value = yaml.safe_load(value_text) if value_text.strip() else None
        except yaml.YAMLError:
            raise bad("the value is not valid YAML") from None
        target: Any = result
        walked = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(part, int):
                if not isinstance(target, list):
                    raise bad(f"{walked} is not a list")
                if part >= len(target):
                    raise bad(f"{walked} has {len(target)} entries, no index {part}")
            elif not isinstance(target, dict):
                raise bad(f"{walked or 'the top level'} is not a mapping")
            if last:
                target[part] = value
            else:
                if isinstance(part, str) and target.get(part) is None:
                    target[part] = [] if isinstance(parts[i + 1], int) else {}
                target = target[part]
            walked = _join(walked, part)
    return result


# -- building the model ------------------------------------------------------------------------------------

_PROFILE_PARSERS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "bandwidth": ("bandwidth_bps", parse_bandwidth),
    "delay": ("delay_s", parse_time),
    "jitter": ("jitter_s", parse_time),
    "loss": ("loss", parse_loss),
}


def _profile_layer(ctx: _Ctx, raw: Any, path: str, directions: bool = True
                   ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(both, forward, reverse): LinkProfile keyword arguments parsed from one layer's fields."""
    allowed = PROFILE_FIELDS + (DIRECTIONS if directions else ())
    data = ctx.mapping(raw, path, allowed)
    both: dict[str, Any] = {}
    for key, value in data.items():
        if key in DIRECTIONS:
            continue
        field_path = _join(path, key)
        if key in _PROFILE_PARSERS:
            attr, fn = _PROFILE_PARSERS[key]
            if key == "bandwidth" and value is None:  # explicit null: unshaped
                both[attr] = None
            else:
                both[attr] = ctx.parse(fn, value, field_path)
        elif key == "queue":
            both["queue"] = _int(ctx, value, field_path, 1)
        elif key == "mtu":
            both["mtu"] = _int(ctx, value, field_path, 68)
    forward = _profile_layer(ctx, data["forward"], _join(path, "forward"), False)[0] if "forward" in data else {}
    reverse = _profile_layer(ctx, data["reverse"], _join(path, "reverse"), False)[0] if "reverse" in data else {}
    return both, forward, reverse


def _layered(base: tuple[LinkProfile, LinkProfile], layers: Sequence[tuple[dict, dict, dict]]
             ) -> tuple[LinkProfile, LinkProfile]:
    ab, ba = base
    for both, forward, reverse in layers:
        ab = ab.with_changes(**{**both, **forward})
        ba = ba.with_changes(**{**both, **reverse})
    return ab, ba


def _node_attrs(ctx: _Ctx, data: dict, path: str) -> dict[str, Any]:
    """Node keyword arguments (gpus, cpus, memory_bytes, image) from checked fields."""
    attrs: dict[str, Any] = {}
    if "gpus" in data:
        attrs["gpus"] = _int(ctx, data["gpus"], _join(path, "gpus"), 0)
    if "cpus" in data:
        cpus = _number(ctx, data["cpus"], _join(path, "cpus"))
        if not cpus > 0:
            raise ctx.error("cpus must be > 0", _join(path, "cpus"), cpus)
        attrs["cpus"] = cpus
    if "memory" in data:
        attrs["memory_bytes"] = ctx.parse(parse_size, data["memory"], _join(path, "memory"))
    if "image" in data:
        attrs["image"] = _string(ctx, data["image"], _join(path, "image"))
    return attrs


def _choice(ctx: _Ctx, data: dict, key: str, choices: Sequence[str]) -> str | None:
    value = data.get(key)
    if value is not None and value not in choices:
        raise ctx.error(f"{key} must be one of {', '.join(choices)}", key, value)
    return value


def _network(ctx: _Ctx, value: Any, path: str) -> str:
    try:
        return str(ipaddress.IPv4Network(_string(ctx, value, path), strict=True))
    except ValueError as e:
        raise ctx.error(f"not an IPv4 network (CIDR like 10.0.0.0/16): {e}", path, value) from None


def _explicit(ctx: _Ctx, data: dict, worker: dict, link_default: tuple[dict, dict, dict],
              tiers: dict[str, tuple[dict, dict, dict]]) -> tuple[dict[str, Node], list[Link]]:
    nodes_raw = ctx.mapping(data.get("nodes"), "nodes")
    if not nodes_raw:
        raise ctx.error("the topology needs nodes (or a generator)", "nodes")
    nodes: dict[str, Node] = {}
    for name, raw in nodes_raw.items():
        path = _join("nodes", str(name))
        ctx.name(name, path, "a node name")
        fields = ctx.mapping(raw, path, NODE_FIELDS)
        if "kind" not in fields:
            raise ctx.error(f"a node needs a kind ({' or '.join(NODE_KINDS)})", _join(path, "kind"))
        kind = fields["kind"]
        if kind not in NODE_KINDS:
            raise ctx.error(f"kind must be {' or '.join(NODE_KINDS)}", _join(path, "kind"), kind)
        attrs = _node_attrs(ctx, fields, path)
        if kind == "worker":
            attrs = {**worker, **attrs}
        nodes[name] = Node(name=name, kind=kind, **attrs)

    links_raw = data.get("links")
    if links_raw is None:
        links_raw = []
    if not isinstance(links_raw, list):
        raise ctx.error(f"expected a list of links, not a {_type(links_raw)}", "links", links_raw)
    links: list[Link] = []
    for i, raw in enumerate(links_raw):
        path = _join("links", i)
        fields = ctx.mapping(raw, path, LINK_FIELDS)
        if not isinstance(fields, dict) or not fields:
            raise ctx.error("a link needs endpoints", path, raw)
        ends = fields.get("endpoints")
        ends_path = _join(path, "endpoints")
        if not isinstance(ends, list) or len(ends) != 2 or not all(isinstance(e, str) for e in ends):
            raise ctx.error("endpoints must be a list of two node names", ends_path, ends)
        for end in ends:
            if end not in nodes:
                raise ctx.error("link names an unknown node", ends_path, end)
        if ends[0] == ends[1]:
            raise ctx.error("a link cannot join a node to itself", ends_path, ends)
        if "tier" in fields:
            tier = ctx.name(fields["tier"], _join(path, "tier"), "a tier name")
        else:  # derived: a worker's access link or a switch-to-switch fabric link
            tier = "host" if any(nodes[e].is_worker for e in ends) else "fabric"
        own = {k: v for k, v in fields.items() if k not in ("endpoints", "tier")}
        layers = [link_default, tiers.get(tier, ({}, {}, {})), _profile_layer(ctx, own, path)]
        ab, ba = _layered((LinkProfile(), LinkProfile()), layers)
        links.append(Link(a=ends[0], b=ends[1], tier=tier, ab=ab, ba=ba))
    return nodes, links


def _generated(ctx: _Ctx, data: dict, worker: dict, link_default: tuple[dict, dict, dict],
               tiers: dict[str, tuple[dict, dict, dict]]) -> tuple[dict[str, Node], list[Link], dict]:
    gen_name = data["generator"]
    if not isinstance(gen_name, str) or gen_name not in GENERATORS:
        raise ctx.error(f"unknown generator; known: {', '.join(GENERATORS)}", "generator", gen_name)
    spec = GENERATORS[gen_name]
    for key in ("nodes", "links"):
        if key in data:
            raise ctx.error(f"'{key}' cannot be combined with a generator (use params, tiers and defaults)", key)
    for tier in tiers:
        if tier not in spec.tiers:
            raise ctx.error(f"unknown tier for {gen_name}; its tiers are: {', '.join(spec.tiers)}",
                            _join("tiers", tier), tier)
    profiles: dict[str, tuple[LinkProfile, LinkProfile]] = {}
    for tier in spec.tiers:
        base = spec.tier_defaults.get(tier, LinkProfile())
        profiles[tier] = _layered((base, base), [link_default, tiers.get(tier, ({}, {}, {}))])
    params = ctx.mapping(data.get("params"), "params")
    try:
        nodes, links = spec.function(params, profiles, worker)
    except TopologyError as e:
        raise e.with_file(ctx.source) if ctx.source else e from None
    resolved = {k: v for k, v in {**spec.defaults, **params}.items() if v is not None}
    return nodes, links, resolved


def topology_from_data(data: Any, source: str | None = None) -> Topology:
    """Build and validate a Topology from parsed YAML data (a dict). `source` names it in errors."""
    ctx = _Ctx(source)
    if not isinstance(data, dict):
        if data is None:
            raise ctx.error("the file is empty; a topology needs a name and nodes/links or a generator")
        raise ctx.error(f"expected a mapping at the top level, not a {_type(data)}", None, data)
    ctx.mapping(data, "", TOP_FIELDS)

    name = data.get("name")
    if name is None and source and source.endswith((".yaml", ".yml")):
        name = Path(source).stem  # a file without a name is named after the file
    name = ctx.name(name, "name", "the topology name")
    if "description" in data and data["description"] is not None:
        _string(ctx, data["description"], "description")

    defaults = ctx.mapping(data.get("defaults"), "defaults", DEFAULTS_FIELDS)
    link_default = _profile_layer(ctx, defaults.get("link"), "defaults.link")
    worker = _node_attrs(ctx, ctx.mapping(defaults.get("worker"), "defaults.worker", WORKER_DEFAULT_FIELDS),
                         "defaults.worker")
    tiers_raw = ctx.mapping(data.get("tiers"), "tiers")
    tiers: dict[str, tuple[dict, dict, dict]] = {}
    for tier, raw in tiers_raw.items():
        path = _join("tiers", str(tier))
        ctx.name(tier, path, "a tier name")
        tiers[tier] = _profile_layer(ctx, raw, path)

    generator = None
    params: dict[str, Any] = {}
    if data.get("generator") is not None:
        generator = data["generator"]
        nodes, links, params = _generated(ctx, data, worker, link_default, tiers)
    else:
        nodes, links = _explicit(ctx, data, worker, link_default, tiers)

    addressing = ctx.mapping(data.get("addressing"), "addressing", ADDRESSING_FIELDS)
    pool = _network(ctx, addressing["pool"], "addressing.pool") if addressing.get("pool") is not None else None
    fabric = (_network(ctx, addressing["fabric_pool"], "addressing.fabric_pool")
              if addressing.get("fabric_pool") is not None else None)

    td = data.get("time_dilation")
    if td is not None and td not in ("auto", "none"):
        if isinstance(td, bool) or not isinstance(td, (int, float)) or not td >= 1:
            raise ctx.error("time_dilation must be a number >= 1, 'auto' or 'none'", "time_dilation", td)

    host_rate = data.get("host_rate")
    if host_rate is not None and host_rate not in HOST_RATE_KINDS:
        if isinstance(host_rate, bool) or not isinstance(host_rate, (str, int, float)):
            raise ctx.error(f"host_rate must be a rate per rank (e.g. 25gbit), {' or '.join(HOST_RATE_KINDS)}",
                            "host_rate", host_rate)
        try:
            host_rate = float(parse_bandwidth(host_rate))
        except ValueError as exc:
            raise ctx.error(f"{exc}; or {' or '.join(HOST_RATE_KINDS)}", "host_rate", host_rate) from None

    topo = Topology(
        name=name, nodes=nodes, links=links, source=source, generator=generator, params=params,
        host_rate=host_rate,
        runtime=_choice(ctx, data, "runtime", ("netns", "docker")),
        time_dilation=td,
        gpu_policy=_choice(ctx, data, "gpu_policy", ("round-robin", "packed")) or "round-robin",
        gpu_sharing=_choice(ctx, data, "gpu_sharing", ("mps",)),
        address_pool=pool, fabric_pool=fabric,
    )
    return topo.validate()


def load_topology_text(text: str, source: str | None = None, overrides: Sequence[str] = ()) -> Topology:
    """Parse YAML `text`, apply `overrides`, build and validate. `source` names it in errors."""
    data = parse_yaml(text, source)
    if overrides:
        data = apply_overrides(data, overrides, source)
    return topology_from_data(data, source)


def load_topology(spec: str | Path, overrides: Sequence[str] = ()) -> Topology:
    """Load the topology file `spec` (a path, or a bare name in topologies/), validated.

    `overrides` are "path=value" strings (see apply_overrides). Every problem is a TopologyError.
    """
    path = resolve_spec(spec)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TopologyError("the file is not UTF-8 text", file=source) from None
    except OSError as e:
        raise TopologyError(f"cannot read the file: {e.strerror or e}", file=source) from None
    return load_topology_text(text, source, overrides)
