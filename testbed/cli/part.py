"""testbed part up|probe: one host's side of a testbed over several hosts.

The controller (`testbed up TOPOLOGY --hosts HOSTS.yaml`) runs these on each
host over SSH; a user does not need them. `part up` reads its spec (JSON) on
stdin and builds this host's nodes; `part probe` measures the underlay to the
other hosts (MTU, round trips) so the controller can refuse a cut link the
underlay cannot carry. Everything else on a host is the usual verbs on its
local state: `testbed down NAME` there removes its part, even with the
controller gone.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from testbed.cli.common import fail, require_root

part_app = typer.Typer(help="One host's side of a testbed over several hosts (run by the controller over SSH).",
                       no_args_is_help=True, add_completion=False)

_SPEC_FIELDS = {"name", "topology", "part", "time_dilation", "runtime", "net_admin"}


def _spec(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except ValueError as exc:
        fail(f"part up: the spec on stdin is not JSON ({exc})", 2)
    if not isinstance(spec, dict):
        fail("part up: the spec on stdin is not a JSON object", 2)
    unknown = set(spec) - _SPEC_FIELDS
    if unknown:
        fail(f"part up: unknown spec field {sorted(unknown)[0]!r}", 2)
    for key in ("name", "topology", "part"):
        if key not in spec:
            fail(f"part up: the spec has no {key!r}", 2)
    return spec


@part_app.command("up")
def part_up() -> None:
    """Build this host's part from the spec on stdin; print what was built (JSON)."""
    from testbed import lifecycle
    from testbed.cluster.part import Part
    from testbed.errors import TestbedError
    from testbed.topology.model import Topology

    require_root("testbed part up")
    spec = _spec(sys.stdin.read())
    try:
        topo = Topology.from_json(spec["topology"])
        part = Part.from_json(spec["part"])
    except (ValueError, TypeError, KeyError) as exc:
        fail(f"part up: {exc}", 2)
    runtime = spec.get("runtime")
    if runtime not in (None, "netns", "docker"):
        fail(f"part up: runtime must be netns or docker (got {runtime!r})", 2)
    try:
        st = lifecycle.up(topo, spec["name"], time_dilation=spec.get("time_dilation") or "none", runtime=runtime,
                          net_admin=bool(spec.get("net_admin")), part=part)
    except TestbedError as exc:
        fail(str(exc), 1)
    print(json.dumps({"name": st["name"], "host": part.host, "nodes": sorted(part.nodes),
                      "workers": sorted(st["runtime"]["workers"]), "tunnels": len(part.tunnels),
                      "seconds": (st.get("timings") or {}).get("total")}))


@part_app.command("probe")
def part_probe(peers: list[str] = typer.Argument(..., help="Underlay addresses of the other hosts."),
               count: int = typer.Option(5, "--count", min=1, max=50, help="Round trips per peer.")) -> None:
    """The underlay toward each peer: the MTU its route leaves by and round-trip times (JSON)."""
    import ipaddress

    from testbed.net import tunnels

    out = []
    for peer in peers:
        try:
            ipaddress.ip_address(peer)
        except ValueError:
            fail(f"part probe: not an IP address: {peer!r}", 2)
        row: dict[str, Any] = {"peer": peer}
        try:
            row["mtu"] = tunnels.underlay_mtu(peer)
            row["rtts_s"] = tunnels.measure_rtts(peer, count)
        except tunnels.TunnelError as exc:
            row["error"] = str(exc)
        out.append(row)
    print(json.dumps(out))


def register(app: typer.Typer) -> None:
    app.add_typer(part_app, name="part")
