"""The emulated hosts' network: their namespaces, the underlay bridge joining them, this machine's veth.

Namespaces are made and removed by testbed.net.netns (as `ip netns add|del` does), devices and
addresses through pyroute2, each namespace's from a thread of its own that entered it (this
process's main thread never sits in a host's namespace, where destroy would take it for one of
the host's processes). Every namespace's lo and the root-side veth carry the record's alias: what
proves them ours to destroy.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from testbed.cluster.emulate_record import PREFIX, UNDERLAY, EmulatedHost, EmulatedRecord
from testbed.errors import StateError, TestbedError
from testbed.net import netns

T = TypeVar("T")


def _netlink(ns: str | None, what: str, fn: Callable[[Any], T]) -> T:
    """fn(ipr) with a pyroute2 IPRoute of namespace `ns` (None: this process's); TestbedError
    saying `what` failed when it does."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    def call() -> T:
        with IPRoute() as ipr:
            return fn(ipr)

    try:
        return netns.run_in_netns(ns, call)
    except (NetlinkError, OSError) as exc:
        raise TestbedError(f"{what}{f' in namespace {ns}' if ns else ''}: {exc}") from None


def _index(ipr: Any, dev: str) -> int:
    found = ipr.link_lookup(ifname=dev)
    if not found:
        raise TestbedError(f"no device {dev}")
    return found[0]


def netns_names() -> set[str]:
    return set(netns.list_names())


def link_alias(dev: str, ns: str | None = None) -> str | None:
    """The alias of `dev` ("" when it has none), None when there is no such device (or namespace)."""
    def read(ipr: Any) -> str | None:
        found = ipr.link_lookup(ifname=dev)
        if not found:
            return None
        return ipr.get_links(found[0])[0].get_attr("IFLA_IFALIAS") or ""

    try:
        return _netlink(ns, f"alias of {dev}", read)
    except TestbedError:
        return None


def pick_subnet(tries: int = 64) -> tuple[str, ipaddress.IPv4Network]:
    """A fresh id and its /24 of the underlay space, overlapping no route or address here."""
    def routed(ipr: Any) -> list[Any]:
        used = []
        for r in ipr.get_routes(family=socket.AF_INET):   # every table, as `ip route show table all`
            if r["dst_len"]:   # (0: a default route)
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(f"{r.get_attr('RTA_DST')}/{r['dst_len']}", strict=False))
        for a in ipr.get_addr(family=socket.AF_INET):
            local = a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
            used.append(ipaddress.ip_network(f"{local}/{a['prefixlen']}", strict=False))
        return used

    used: list[Any] = []
    with contextlib.suppress(TestbedError):   # unreadable: nothing known to avoid
        used = _netlink(None, "routes and addresses", routed)
    names = netns_names()
    subnets = list(UNDERLAY.subnets(new_prefix=24))
    for _ in range(tries):
        ident = secrets.token_hex(3)
        net = subnets[int(ident, 16) % len(subnets)]
        if any(n.overlaps(net) for n in used) or any(x.startswith(PREFIX + ident) for x in names):
            continue
        return ident, net
    raise StateError(f"no free /24 in {UNDERLAY} for the underlay (every one tried is routed here)")


def new_netns(name: str, alias: str) -> None:
    """Namespace `name`, its lo up and carrying `alias`."""
    try:
        netns.create(name)
    except OSError as exc:
        raise TestbedError(f"namespace {name}: {exc}") from None

    def lo(ipr: Any) -> None:
        index = _index(ipr, "lo")
        ipr.link("set", index=index, ifalias=alias)
        ipr.link("set", index=index, state="up")

    _netlink(name, "lo", lo)


def _veth(ipr: Any, name: str, peer: str, peer_ns: str, mtu: int) -> None:
    """A veth `name` here, its other end `peer` in namespace `peer_ns`, both with `mtu`."""
    fd = os.open(netns.path(peer_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        ipr.link("add", ifname=name, kind="veth", mtu=mtu, peer={"ifname": peer, "mtu": mtu, "net_ns_fd": fd})
    finally:
        os.close(fd)


def make_underlay(emu: EmulatedRecord) -> None:
    """The underlay's namespace with its bridge br0, and this machine's end (the controller reaches
    the hosts through it): the veth root_veth here, its peer ctl on the bridge."""
    plen = ipaddress.ip_network(emu.subnet).prefixlen
    u = emu.underlay_netns
    new_netns(u, emu.alias)

    def bridge(ipr: Any) -> None:
        ipr.link("add", ifname="br0", kind="bridge", mtu=emu.mtu)
        ipr.link("set", index=_index(ipr, "br0"), state="up")

    _netlink(u, "bridge br0", bridge)
    c = emu.root_veth

    def controller_end(ipr: Any) -> None:
        _veth(ipr, c, "ctl", u, emu.mtu)
        ipr.link("set", index=_index(ipr, c), ifalias=emu.alias)
        with contextlib.suppress(OSError):   # no IPv6 chatter from this machine onto the underlay
            with open(f"/proc/sys/net/ipv6/conf/{c}/disable_ipv6", "w") as fh:
                fh.write("1")
        ipr.addr("add", index=_index(ipr, c), address=emu.controller_address, prefixlen=plen)
        ipr.link("set", index=_index(ipr, c), state="up")

    _netlink(None, f"veth {c}", controller_end)
    _netlink(u, "ctl", lambda ipr: ipr.link("set", index=_index(ipr, "ctl"), master=_index(ipr, "br0"),
                                            state="up"))


def plug_host(emu: EmulatedRecord, h: EmulatedHost, port: str) -> None:
    """Host `h`'s namespace, its eth0 (with its underlay address) the peer of `port` on the bridge."""
    plen = ipaddress.ip_network(emu.subnet).prefixlen
    u = emu.underlay_netns
    new_netns(h.netns, emu.alias)

    def bridge_port(ipr: Any) -> None:
        _veth(ipr, port, "eth0", h.netns, emu.mtu)
        ipr.link("set", index=_index(ipr, port), master=_index(ipr, "br0"), state="up")

    _netlink(u, f"port {port}", bridge_port)

    def eth0(ipr: Any) -> None:
        ipr.addr("add", index=_index(ipr, "eth0"), address=h.address, prefixlen=plen)
        ipr.link("set", index=_index(ipr, "eth0"), state="up")

    _netlink(h.netns, "eth0", eth0)


def delete_link(dev: str) -> None:
    """Remove device `dev` of this machine's namespace (a veth: its peer goes with it)."""
    _netlink(None, f"delete {dev}", lambda ipr: ipr.link("del", index=_index(ipr, dev)))


def delete_netns(name: str) -> None:
    try:
        netns.delete(name)
    except OSError as exc:
        raise TestbedError(f"delete namespace {name}: {exc}") from None
