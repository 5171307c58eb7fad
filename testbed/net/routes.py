"""A planned route (testbed.topology.plan.Route) in the kernel: installed or replaced, as a batch
message, removed. No next hop is an `unreachable` route."""

from __future__ import annotations

from typing import Any

from testbed.net import rtnl
from testbed.topology.plan import Route


def install_route(ipr: Any, route: Route, index: dict[str, int], command: str = "add") -> None:
    """One planned route into the kernel (`command`: add or replace). No next hop: an `unreachable`
    route, so a sender gets an error at once instead of the default route taking its packets."""
    dst = _kernel_dst(route.dst)
    if not route.nexthops:
        ipr.route(command, dst=dst, type="unreachable")
    elif len(route.nexthops) == 1:
        h = route.nexthops[0]
        ipr.route(command, dst=dst, gateway=h.via, oif=index[h.ifname])
    else:
        ipr.route(command, dst=dst, multipath=[{"gateway": h.via, "oif": index[h.ifname]} for h in route.nexthops])


def route_message(route: Route, index: dict[str, int]) -> bytes:
    """install_route's "add", encoded for a batch (testbed.net.rtnl)."""
    return rtnl.route(_kernel_dst(route.dst), [(h.via, index[h.ifname]) for h in route.nexthops])


def remove_route(ipr: Any, dst: str) -> None:
    """Delete the route to `dst` (a network or "default"), whatever its type."""
    ipr.route("del", dst=_kernel_dst(dst))


def _kernel_dst(dst: str) -> str:
    return "0.0.0.0/0" if dst == "default" else dst
