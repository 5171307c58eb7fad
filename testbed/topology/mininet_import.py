"""Import Mininet topologies: custom-topology files and Mininet's built-in topologies.

Spec syntax (what `testbed topo`/`up` accept besides YAML):

- ``FILE.py`` -- a Mininet custom file (the ``mn --custom FILE.py --topo NAME,...``
  convention): it defines ``topos = {'NAME': TopoClassOrFactory, ...}``. Without a
  name the only topo is taken, or the first when there are several (dict order).
- ``FILE.py:NAME`` or ``FILE.py:NAME,ARG,...,KEY=VALUE`` -- pick NAME and call it with
  these arguments, exactly like ``mn --topo NAME,ARG,KEY=VALUE`` (values that look like
  ints or floats become numbers).
- ``mininet:NAME[,ARG...,KEY=VALUE...]`` -- Mininet's own topologies, same names as
  ``mn --topo``: ``minimal``, ``single,N``, ``reversed,N``, ``linear,K[,N]``,
  ``tree,depth=D,fanout=F``, ``torus,X,Y[,n=N]``.

Mapping: hosts -> workers, switches -> switches, links keep their order and
endpoints (``a`` is Mininet's node1). TCLink options map to the link profile:
``bw`` (Mbit/s), ``delay``/``jitter`` (tc time strings like "5ms"; a bare number
is microseconds, as tc reads it), ``loss`` (percent, 0-100), ``max_queue_size``
(packets). Per-interface ``params1``/``params2`` shape node1->node2 (forward) and
node2->node1 (reverse) respectively, as TCIntf does on each side's egress. A link
touching a host gets tier ``host``, a switch-switch link tier ``fabric``. Other
options (``use_htb``, ``ip``, ``cpu``, ``dpid``, ...) are ignored and reported
in the returned warning list.

The result goes through the YAML loader's data model (``topology_from_data``), so
``--set`` overrides work the same way (``tiers.host.bandwidth=1gbit``,
``links[3].delay=1ms``, ``nodes.h1.gpus=1``): when every link of a tier has the
same profile, that profile is written to ``tiers.TIER`` rather than to each link.

Executing a custom file runs its Python code, as ``mn --custom`` does: only load
files you trust. Nothing is built; Mininet's Topo classes are plain Python.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

from testbed.errors import TopologyError
from testbed.topology.model import Topology
from testbed.topology.units import parse_loss, parse_time

__all__ = ["MININET_PREFIX", "BUILTIN_TOPOS", "is_mininet_spec", "parse_topo_arg", "mininet_data",
           "load_mininet", "load_any", "topology_from_topo"]

MININET_PREFIX = "mininet:"

# mn's TOPOS table: name -> (module, class name)
BUILTIN_TOPOS: dict[str, tuple[str, str]] = {
    "minimal": ("mininet.topo", "MinimalTopo"),
    "single": ("mininet.topo", "SingleSwitchTopo"),
    "reversed": ("mininet.topo", "SingleSwitchReversedTopo"),
    "linear": ("mininet.topo", "LinearTopo"),
    "tree": ("mininet.topolib", "TreeTopo"),
    "torus": ("mininet.topolib", "TorusTopo"),
}

# Link info keys Mininet always adds, or that only pick a class: ignored without a word.
_SILENT_LINK_KEYS = {"node1", "node2", "port1", "port2", "key", "cls"}
_LINK_PARAMS = ("bw", "delay", "jitter", "loss", "max_queue_size")
# Node options that carry nothing for us but are common (dpid, cls...): still reported once.
_SPEC_RE = re.compile(r"^(?P<file>.*\.py)(?::(?P<topo>.*))?$", re.DOTALL)


def is_mininet_spec(spec: str | Path) -> bool:
    """True if `spec` names a Mininet topology (``mininet:...`` or a ``.py`` file, optionally ``:NAME``)."""
    text = str(spec)
    return text.startswith(MININET_PREFIX) or bool(_SPEC_RE.match(text))


def _numeric(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_topo_arg(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``"tree,depth=2,fanout=3"`` -> ("tree", [], {"depth": 2, "fanout": 3}), like mn's splitArgs."""
    parts = [p.strip() for p in text.split(",")] if text else [""]
    name, rest = parts[0], parts[1:]
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for part in rest:
        if not part:
            continue
        if "=" in part:
            key, value = part.split("=", 1)
            kwargs[key.strip()] = _numeric(value.strip())
        else:
            args.append(_numeric(part))
    return name, args, kwargs


def _require_mininet(source: str) -> None:
    try:
        import mininet.topo  # noqa: F401
    except ImportError:
        raise TopologyError("Mininet's Python package is not installed (pip install mininet)",
                            file=source) from None


def _instantiate(factory: Callable[..., Any], args: list, kwargs: dict, source: str, what: str) -> Any:
    from mininet.topo import Topo

    try:
        topo = factory(*args, **kwargs)
    except TopologyError:
        raise
    except Exception as e:  # the user's code: any failure is a bad topology
        raise TopologyError(f"building {what} failed: {type(e).__name__}: {e}", file=source,
                            path="topo", value=what) from None
    if not isinstance(topo, Topo):
        raise TopologyError(f"{what} did not return a mininet.topo.Topo (got {type(topo).__name__})",
                            file=source, path="topo", value=what)
    return topo


def _load_custom(path_text: str, topo_arg: str | None) -> tuple[Any, str, str]:
    """(Topo instance, topology name, source) from a custom file."""
    path = Path(path_text)
    source = path_text
    if not path.is_file():
        raise TopologyError("Mininet custom topology file not found", file=source)
    _require_mininet(source)
    try:
        code = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"cannot read the file: {e}", file=source) from None
    namespace: dict[str, Any] = {"__name__": "mininet_custom", "__file__": str(path)}
    try:
        exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - same as `mn --custom`
    except SyntaxError as e:
        raise TopologyError(f"Python syntax error at line {e.lineno}: {e.msg}", file=source) from None
    except SystemExit:
        raise TopologyError("the file called exit() while being loaded", file=source) from None
    except Exception as e:
        raise TopologyError(f"running the file failed: {type(e).__name__}: {e}", file=source) from None
    topos = namespace.get("topos")
    if not isinstance(topos, dict) or not topos:
        raise TopologyError("a Mininet custom file must define topos = {'name': TopoClass, ...}",
                            file=source, path="topos", value=topos if "topos" in namespace else None)
    name, args, kwargs = parse_topo_arg(topo_arg or "")
    if not name:
        name = next(iter(topos))
    if name not in topos:
        raise TopologyError(f"no such topo in the file; it defines: {', '.join(map(str, topos))}",
                            file=source, path="topos", value=name)
    factory = topos[name]
    if not callable(factory):
        raise TopologyError("topos entries must be Topo classes or functions", file=source,
                            path=f"topos.{name}", value=factory)
    return _instantiate(factory, args, kwargs, source, name), str(name), source


def _load_builtin(spec: str) -> tuple[Any, str, str]:
    import importlib

    source = spec
    _require_mininet(source)
    name, args, kwargs = parse_topo_arg(spec[len(MININET_PREFIX):])
    if name not in BUILTIN_TOPOS:
        raise TopologyError(f"unknown Mininet topology; known: {', '.join(BUILTIN_TOPOS)}", file=source,
                            path="topo", value=name)
    module, cls = BUILTIN_TOPOS[name]
    factory = getattr(importlib.import_module(module), cls)
    return _instantiate(factory, args, kwargs, source, name), f"mininet-{name}", source


# -- converting a Topo to loader data ----------------------------------------------------------------------


def _safe_name(text: str) -> str:
    out = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-_")
    return out or "mininet"


def _time_value(value: Any) -> Any:
    """Mininet/tc time: strings as written ('5ms'); a bare number is microseconds (tc's default unit)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value}us"
    return value


def _profile_fields(params: dict[str, Any], where: str, source: str) -> dict[str, Any]:
    """Loader profile fields (bandwidth, delay, jitter, loss, queue) from TCLink parameters."""
    out: dict[str, Any] = {}

    def bad(key: str, reason: str) -> TopologyError:
        return TopologyError(reason, file=source, path=f"{where}.{key}", value=params[key])

    bw = params.get("bw")
    if bw is not None:
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise bad("bw", "bw must be a positive number of Mbit/s")
        out["bandwidth"] = max(1, round(bw * 10**6))
    for key in ("delay", "jitter"):
        if params.get(key) is not None:
            text = _time_value(params[key])
            try:
                parse_time(text)
            except ValueError as e:
                raise bad(key, f"{key}: {e}") from None
            out[key] = text
    loss = params.get("loss")
    if loss is not None:
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0 <= loss <= 100:
            raise bad("loss", "loss must be a percentage between 0 and 100")
        if loss:
            out["loss"] = f"{loss}%"
            parse_loss(out["loss"])
    q = params.get("max_queue_size")
    if q is not None:
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise bad("max_queue_size", "max_queue_size must be a positive number of packets")
        out["queue"] = q
    return out


def topology_from_topo(topo: Any, name: str, source: str) -> tuple[dict[str, Any], list[str]]:
    """Loader data (the explicit YAML form) and warnings for a mininet.topo.Topo instance."""
    warnings: list[str] = []
    ignored: dict[str, list[str]] = {}  # "host option 'ip'" -> [nodes or links]

    hosts = list(topo.hosts(sort=True))
    switches = list(topo.switches(sort=True))
    clash = set(hosts) & set(switches)
    if clash:
        raise TopologyError("a name is both a host and a switch", file=source, path="nodes",
                            value=sorted(clash)[0])
    nodes: dict[str, Any] = {}
    for kind, names in (("worker", hosts), ("switch", switches)):
        for n in names:
            if not isinstance(n, str):
                raise TopologyError("node names must be strings", file=source, path="nodes", value=n)
            nodes[n] = {"kind": kind}
            info = topo.nodeInfo(n) or {}
            for key in info:
                if key in ("isSwitch",):
                    continue
                what = "host" if kind == "worker" else "switch"
                ignored.setdefault(f"{what} option {key!r}", []).append(n)

    links: list[dict[str, Any]] = []
    seen: dict[frozenset, int] = {}
    for i, (a, b, info) in enumerate(topo.links(sort=False, withKeys=False, withInfo=True)):
        a, b = info.get("node1", a), info.get("node2", b)
        where = f"links[{i}]({a}-{b})"
        pair = frozenset((a, b))
        if pair in seen:
            raise TopologyError(f"parallel links are not supported (same endpoints as links[{seen[pair]}])",
                                file=source, path=where, value=[a, b])
        seen[pair] = i
        common = {k: info[k] for k in _LINK_PARAMS if k in info}
        for key in info:
            if key not in _SILENT_LINK_KEYS and key not in _LINK_PARAMS and key not in ("params1", "params2"):
                ignored.setdefault(f"link option {key!r}", []).append(f"{a}-{b}")
        sides = []
        for side in ("params1", "params2"):
            p = info.get(side) or {}
            if not isinstance(p, dict):
                raise TopologyError(f"{side} must be a dict", file=source, path=f"{where}.{side}", value=p)
            for key in p:
                if key not in _LINK_PARAMS:
                    ignored.setdefault(f"link option {side}.{key!r}", []).append(f"{a}-{b}")
            sides.append(_profile_fields({k: p[k] for k in _LINK_PARAMS if k in p}, f"{where}.{side}", source))
        both = _profile_fields(common, where, source)
        fwd = {**both, **sides[0]}
        rev = {**both, **sides[1]}
        tier = "host" if (a in hosts or b in hosts) else "fabric"
        link: dict[str, Any] = {"endpoints": [a, b], "tier": tier}
        if fwd == rev:
            link.update(fwd)
        else:
            link.update({k: v for k, v in fwd.items() if rev.get(k) == v})
            f_only = {k: v for k, v in fwd.items() if rev.get(k) != v}
            r_only = {k: v for k, v in rev.items() if fwd.get(k) != v}
            if f_only:
                link["forward"] = f_only
            if r_only:
                link["reverse"] = r_only
        links.append(link)

    # A tier whose links all share one profile: write it once under tiers (so --set tiers.X.* works).
    tiers: dict[str, Any] = {}
    by_tier: dict[str, list[dict]] = {}
    for link in links:
        by_tier.setdefault(link["tier"], []).append(link)
    for tier, group in by_tier.items():
        fields = [{k: v for k, v in link.items() if k not in ("endpoints", "tier")} for link in group]
        if all(f == fields[0] for f in fields):
            tiers[tier] = fields[0]
            for link in group:
                for k in fields[0]:
                    del link[k]

    for what, where in ignored.items():
        shown = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
        warnings.append(f"ignored {what} (on {shown})")
    data: dict[str, Any] = {"name": _safe_name(name), "nodes": nodes, "links": links}
    if tiers:
        data["tiers"] = tiers
    return data, warnings


def mininet_data(spec: str | Path) -> tuple[dict[str, Any], list[str], str]:
    """(loader data, warnings, source) for a Mininet spec (see the module docstring)."""
    text = str(spec)
    if text.startswith(MININET_PREFIX):
        topo, name, source = _load_builtin(text)
    else:
        m = _SPEC_RE.match(text)
        if not m:
            raise TopologyError("not a Mininet topology (expected FILE.py[:NAME,ARGS] or mininet:NAME[,ARGS])",
                                file=text)
        topo, name, source = _load_custom(m.group("file"), m.group("topo"))
    return (*topology_from_topo(topo, name, source), source)


def load_mininet(spec: str | Path, overrides: Sequence[str] = ()) -> tuple[Topology, list[str]]:
    """A validated Topology (and the list of ignored options) from a Mininet spec; `overrides` as in YAML."""
    from testbed.topology.loader import apply_overrides, topology_from_data

    data, warnings, source = mininet_data(spec)
    if overrides:
        data = apply_overrides(data, overrides, source)
    return topology_from_data(data, source), warnings


def load_any(spec: str | Path, overrides: Sequence[str] = ()) -> tuple[Topology, list[str]]:
    """Any topology spec: a Mininet spec (see above), else a YAML path or bare name (loader.load_topology)."""
    if is_mininet_spec(spec):
        return load_mininet(spec, overrides)
    from testbed.topology.loader import load_topology

    return load_topology(spec, overrides), []
