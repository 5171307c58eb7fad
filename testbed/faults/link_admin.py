"""A link's admin state and the routes around it: both ends set down or up in their namespaces,
the reasons a link is held down (a `link down`, a node down), and the switches' routes converged
to the plan's tables for the links down now (only the routes that differ are replaced or deleted)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from testbed.errors import StateError
from testbed.net import netns
from testbed.running import Handle
from testbed.topology.plan import Route


@contextlib.contextmanager
def ipr_in(ns: str) -> Iterator[Any]:
    from pyroute2 import IPRoute

    if not netns.exists(ns):
        raise StateError(f"namespace {ns} is gone (testbed half-removed? try `testbed cleanup`)")
    with netns.enter(ns):
        ipr = IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def ifindex(ipr: Any, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


def set_admin(h: Handle, i: int, up: bool) -> None:
    rec = h.st["links"][i]
    link = h.topo.links[i]
    for node, ifname in zip((link.a, link.b), rec["ifnames"]):
        if not h.here(node):
            continue
        with ipr_in(h.netns(node)) as ipr:
            idx = ifindex(ipr, ifname)
            if idx is not None:
                ipr.link("set", index=idx, state="up" if up else "down")


def down_set(h: Handle) -> set[int]:
    return {i for i, rec in enumerate(h.st.get("links", [])) if rec.get("state") == "down"}


def down_ifnames(h: Handle) -> set[tuple[str, str]]:
    """(node, ifname) of every link end that is down now."""
    out = set()
    for i in down_set(h):
        rec = h.st["links"][i]
        link = h.topo.links[i]
        out.add((link.a, rec["ifnames"][0]))
        out.add((link.b, rec["ifnames"][1]))
    return out


def route_changes(old: Sequence[Route], new: Sequence[Route]) -> tuple[list[Route], list[str]]:
    """What turns routing table `old` into `new`: (routes to put in with `replace`, destinations to delete)."""
    before = {r.dst: r for r in old}
    after = {r.dst for r in new}
    return [r for r in new if before.get(r.dst) != r], [dst for dst in before if dst not in after]


def sync_routes(h: Handle, old_down: set[int], touched: Sequence[str] = ()) -> None:
    """After links went down or up: converge the switches' routes to the plan's tables for the links
    down now (only what changed), and re-install routes and permanent neighbours on `touched` nodes
    (endpoints of links that came up: admin-down flushed what used their interfaces). The nodes
    are independent: spread over the cores (a link of a k=16 fat-tree changes 144 switches' tables)."""
    from testbed.net import fanout
    from testbed.net.builder import Builder

    new_down = down_set(h)
    old_r = h.plan.switch_routes(old_down)
    new_r = h.plan.switch_routes(new_down)
    touched = set(touched)
    down_if = down_ifnames(h)
    neigh = Builder(h.name, h.topo, h.plan)._neighbours() if touched else {}
    nodes = [n for n in h.topo.nodes if h.here(n) and (n in touched or (n in new_r and old_r[n] != new_r[n]))]

    def work(node: str) -> dict[str, Any]:
        return {"problems": _sync_node(h, node, old_r.get(node), new_r.get(node), node in touched, down_if,
                                       neigh.get(node, []))}

    fanout.each(nodes, work, name=lambda n: f"routes of {n}",
                on_done=lambda _i, r: [h.log(p) for p in r.get("problems") or []])


def _sync_node(h: Handle, node: str, old: list[Route] | None, new: list[Route] | None, full: bool,
               down_if: set[tuple[str, str]], neigh: list[tuple[str, str, str]]) -> list[str]:
    """One node's part of sync_routes; returns what could not be installed, to log."""
    from testbed.net.routes import install_route, remove_route

    problems = []
    with ipr_in(h.netns(node)) as ipr:
        index = {l.get_attr("IFLA_IFNAME"): l["index"] for l in ipr.get_links()}
        if full:
            for ifname, ip, mac in neigh:
                if (node, ifname) in down_if or ifname not in index:
                    continue
                with contextlib.suppress(Exception):
                    ipr.neigh("replace", dst=ip, lladdr=mac, ifindex=index[ifname], state="permanent")
        if new is not None:   # a switch
            put, gone = route_changes(old or [], new)
            for route in new if full else put:
                try:
                    install_route(ipr, route, index, "replace")
                except Exception as exc:  # reported, the rest still goes in
                    problems.append(f"route {route.dst} on {node} not installed: {exc}")
            for dst in gone:
                with contextlib.suppress(Exception):   # admin-down may have flushed it already
                    remove_route(ipr, dst)
        else:
            for route in h.plan.routes.get(node, []):
                hops = tuple(hp for hp in route.nexthops if (node, hp.ifname) not in down_if and hp.ifname in index)
                if hops:
                    with contextlib.suppress(Exception):
                        install_route(ipr, Route(route.dst, hops), index, "replace")
    return problems


def down_reasons(rec: dict[str, Any]) -> list[str]:
    reasons = rec.get("down_by")
    if reasons is None:
        reasons = ["link"] if rec.get("state") == "down" else []
    return list(reasons)


def hold_down(h: Handle, i: int, reason: str) -> bool:
    """Add a reason for link i to be down; returns True if it went down now."""
    rec = h.st["links"][i]
    reasons = down_reasons(rec)
    was_up = not reasons
    if reason not in reasons:
        reasons.append(reason)
    rec["down_by"] = reasons
    rec["state"] = "down"
    if was_up:
        set_admin(h, i, False)
    return was_up


def release(h: Handle, i: int, reason: str | None) -> bool:
    """Drop a reason (None: all) for link i to be down; bring it up when none is left. True if it came up."""
    rec = h.st["links"][i]
    reasons = down_reasons(rec)
    if not reasons:
        rec["down_by"] = []
        rec["state"] = "up"
        return False
    reasons = [] if reason is None else [r for r in reasons if r != reason]
    rec["down_by"] = reasons
    if reasons:
        return False
    rec["state"] = "up"
    set_admin(h, i, True)
    return True
