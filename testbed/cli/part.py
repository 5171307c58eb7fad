"""testbed part up|probe: one host's side of a testbed over several hosts.

The controller (`testbed up TOPOLOGY --hosts HOSTS.yaml`) runs these on each
host over SSH; a user does not need them. `part up` reads its spec (JSON) on
stdin and builds this host's nodes; `part probe` measures the underlay to the
other hosts (MTU, round trips) so the controller can refuse a cut link the
underlay cannot carry. `part up --check --probe ADDR...` is the controller's
whole `up` in one session: it first prints the answers to the host checks and
the underlay measurement (one JSON line), then waits for the spec (one line;
EOF: the controller called it off, nothing is built). Everything else on a host is the usual verbs on its
local state: `testbed down NAME` there removes its part, even with the
controller gone.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import typer

from testbed.cli.common import fail, require_root

part_app = typer.Typer(help="One host's side of a testbed over several hosts (run by the controller over SSH).",
                       no_args_is_help=True, add_completion=False)

_SPEC_FIELDS = {"name", "topology", "part", "time_dilation", "dilation", "runtime", "net_admin", "workdir"}


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


def _answers(probe: list[str], count: int) -> dict[str, Any]:
    """What a controller asks before it builds, answered in one go: uid, `version --json`,
    `doctor --json --cached` (no --for: each part's limits are checked when it is built), the delay
    threshold, the machine (for time dilation) and the underlay toward `probe` (measured beside
    the kernel probe)."""
    import os
    import threading

    from testbed.cli import doctor, version

    rows: list[dict[str, Any]] = []
    pinger = threading.Thread(target=lambda: rows.extend(_probe_rows(probe, count)), daemon=True)
    pinger.start()
    answers: dict[str, Any] = {"uid": os.geteuid(), "version": version.info(), "machine": _machine()}
    try:
        answers["doctor"] = doctor.report("", cached=True)
        from testbed.net import capabilities

        answers["delay_threshold_s"] = capabilities.delay_threshold(
            capabilities.probe(measure_floor=True, refresh=False))   # (cached: read again, not measured)
    except Exception as exc:  # noqa: BLE001 - an answer too: the controller names it as this host's problem
        answers["doctor_error"] = f"{type(exc).__name__}: {exc}"
    pinger.join()
    answers["probe"] = rows
    return answers


def _machine() -> dict[str, Any]:
    """What the controller's time dilation accounts this host's machine with: its boot (hosts with
    one boot id share a machine), the cores testbed may use and this boot's calibration, if any."""
    from testbed.jobs import calibration
    from testbed.lifecycle import cores

    cal = calibration.cached()
    return {"boot_id": calibration.boot_id(), "cores": cores(),
            "constants": cal.constants().to_json() if cal is not None else None}


@part_app.command("up")
def part_up(check: bool = typer.Option(False, "--check", help="First print the answers to the controller's "
                                                            "checks (one JSON line), then read the spec as one "
                                                            "line; EOF instead: build nothing."),
            probe: list[str] = typer.Option([], "--probe", help="With --check: an underlay address to measure "
                                                                "(repeatable)."),
            count: int = typer.Option(5, "--count", min=1, max=50, help="Round trips per --probe address.")) -> None:
    """Build this host's part from the spec on stdin; print what was built (JSON)."""
    from testbed.errors import TestbedError

    if check:
        # one SSH session per host for the whole `up`: the checks' answers, the controller's
        # decision (the spec, or EOF), the build. The process's start-up is paid once.
        _check_addresses(probe)
        sys.stdout.write(json.dumps({"check": _answers(probe, count)}) + "\n")
        sys.stdout.flush()
        from testbed import lifecycle  # noqa: F401 - imported while the controller decides
        text = sys.stdin.readline()
        if not text.strip():
            print(json.dumps({"built": False}))
            return
    else:
        text = sys.stdin.read()
    require_root("testbed part up")
    spec = _spec(text)
    try:
        st = _build(spec)
    except TestbedError as exc:
        fail(str(exc), 1)
    print(json.dumps(st))


def _build(spec: dict[str, Any]) -> dict[str, Any]:
    from testbed import lifecycle
    from testbed.cluster.part import Part
    from testbed.topology.model import Topology

    try:
        topo = Topology.from_json(spec["topology"])
        part = Part.from_json(spec["part"])
    except (ValueError, TypeError, KeyError) as exc:
        fail(f"part up: {exc}", 2)
    runtime = spec.get("runtime")
    if runtime not in (None, "netns", "docker"):
        fail(f"part up: runtime must be netns or docker (got {runtime!r})", 2)
    dilation: Any = spec.get("time_dilation") or "none"
    if spec.get("dilation") is not None:   # the controller's choice for every host (per machine)
        from testbed.topology.dilation import Choice

        try:
            dilation = Choice.from_json(spec["dilation"])
        except (ValueError, TypeError, KeyError) as exc:
            fail(f"part up: dilation: {exc}", 2)
        if not (math.isfinite(dilation.factor) and dilation.factor >= 1):
            fail(f"part up: dilation.factor: a factor >= 1 (got {dilation.factor!r})", 2)
    workdir = spec.get("workdir")
    if isinstance(workdir, str) and os.path.isdir(workdir):
        # the controller's working directory, where `up` ran (when this host has it; else the SSH
        # login's): docker workers mount it, as `up` on one host does its own
        os.chdir(workdir)
    st = lifecycle.up(topo, spec["name"], time_dilation=dilation, runtime=runtime,
                      net_admin=bool(spec.get("net_admin")), part=part)
    return {"built": True, "name": st["name"], "host": part.host, "nodes": sorted(part.nodes),
            "workers": sorted(st["runtime"]["workers"]), "tunnels": len(part.tunnels),
            "seconds": (st.get("timings") or {}).get("total")}


def _check_addresses(peers: list[str]) -> None:
    import ipaddress

    for peer in peers:
        try:
            ipaddress.ip_address(peer)
        except ValueError:
            fail(f"part: not an IP address: {peer!r}", 2)


def _probe_rows(peers: list[str], count: int) -> list[dict[str, Any]]:
    """The underlay toward each peer: {"peer", "mtu", "rtts_s"} or {"peer", "error"}."""
    from testbed.net import tunnels

    from concurrent.futures import ThreadPoolExecutor

    def one(peer: str) -> dict[str, Any]:
        row: dict[str, Any] = {"peer": peer}
        try:
            row["mtu"] = tunnels.underlay_mtu(peer)
            row["rtts_s"] = tunnels.measure_rtts(peer, count)
        except tunnels.TunnelError as exc:
            row["error"] = str(exc)
        return row

    if not peers:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:   # the peers at once
        return list(pool.map(one, peers))


@part_app.command("probe")
def part_probe(peers: list[str] = typer.Argument(..., help="Underlay addresses of the other hosts."),
               count: int = typer.Option(5, "--count", min=1, max=50, help="Round trips per peer.")) -> None:
    """The underlay toward each peer: the MTU its route leaves by and round-trip times (JSON)."""
    _check_addresses(peers)
    print(json.dumps(_probe_rows(peers, count)))


def register(app: typer.Typer) -> None:
    app.add_typer(part_app, name="part")
