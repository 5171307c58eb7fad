"""Cut links as VXLAN tunnels: a link whose two ends sit on different hosts.

A testbed spread over several hosts keeps every link it can on one host (a
veth or a delay line); a link whose ends were placed on two hosts becomes a
point-to-point VXLAN device at each end, carried over the hosts' underlay.
VXLAN because the end must look like the veth end it replaces: an Ethernet
device with the plan's name, MAC and MTU, shaped and bridged like any port.

Each end is created by one netlink request from the host's namespace (where
the underlay is) that names the node's namespace as the device's home and the
plan's interface name. A VXLAN device binds its UDP socket and routes its
underlay in the namespace the request came from (the kernel's "link netns"),
not in the one it lives in, so the node's namespace holds
only the Ethernet end: workers still see only emulated interfaces, and the
underlay stays out of their reach. The end is gone when either namespace
goes (the node's deletes it; the host's deletes every end it carries).

Each end takes frames from its peer host's underlay address only: an nftables filter in the
host's namespace (testbed.net.underlay_filter), installed by create() before the device is ever
up (a VXLAN device opens its UDP socket when brought up), removed with the end by delete().

The pure part (VNIs, overhead, MTU and delay checks, the end's JSON record)
has no I/O so the controller can decide and explain before touching a host.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from testbed.errors import TestbedError
from testbed.net import netns, underlay_filter

VXLAN_PORT = 4789           # IANA's VXLAN port
VNI_SPACE = (1 << 24) - 1   # VNIs 1 .. 2**24-1 (0 is left out: some stacks treat it as "none")
IFNAMSIZ = 15
# outer IP + UDP 8 + VXLAN 8 + the inner Ethernet header 14 (the inner frame's own MTU excludes it)
_UDP_VXLAN_ETH = 8 + 8 + 14
_IP_HEADER = {4: 20, 6: 40}
_KINDS = {"vxlan"}


class TunnelError(TestbedError):
    """A tunnel end could not be made, measured or removed; the message names the link and node."""


# -- the pure part ----------------------------------------------------------------------------------------

def overhead(underlay_ip: str) -> int:
    """Bytes VXLAN adds to each frame on an underlay of `underlay_ip`'s family: 50 on IPv4, 70 on IPv6."""
    return _IP_HEADER[ipaddress.ip_address(underlay_ip).version] + _UDP_VXLAN_ETH


def vni(testbed: str, link_index: int) -> int:
    """The VXLAN network identifier of link `link_index` of testbed `testbed`.

    Scheme: the testbed's name picks an offset in the VNI space (blake2b of the
    name, so the same on every process and host; Python's hash() is salted per
    process), and its links take consecutive VNIs from there, wrapping within
    1 .. 2**24-1. So the links of one testbed never share a VNI (up to 2**24-1
    links), and two testbeds collide only when their runs of VNIs overlap:
    about (links of one + links of the other) / 2**24, e.g. 6e-6 for two
    48-link fat-trees. Consecutive rather than hashed per link: hashing each
    link alone would make a testbed collide with itself (birthday bound).
    The kernel refuses a second device with the same VNI and port in one host
    namespace (EEXIST), so a collision is loud, never a silent cross-talk.
    """
    if not isinstance(testbed, str) or not testbed:
        raise ValueError(f"testbed: a non-empty name is needed, got {testbed!r}")
    if isinstance(link_index, bool) or not isinstance(link_index, int) or not 0 <= link_index < VNI_SPACE:
        raise ValueError(f"link_index: an integer in 0..{VNI_SPACE - 1} is needed, got {link_index!r}")
    digest = hashlib.blake2b(f"testbed-vxlan/{testbed}".encode(), digest_size=8).digest()
    offset = int.from_bytes(digest, "big") % VNI_SPACE
    return 1 + (offset + link_index) % VNI_SPACE


def mtu_problem(link_mtu: int, underlay_mtu: int, underlay_ip: str) -> str | None:
    """Why a link of `link_mtu` cannot be carried whole over this underlay, or None when it can."""
    extra = overhead(underlay_ip)
    if link_mtu + extra <= underlay_mtu:
        return None
    family = f"IPv{ipaddress.ip_address(underlay_ip).version}"
    return (f"a link MTU of {link_mtu} needs {link_mtu + extra} bytes on the {family} underlay "
            f"(VXLAN adds {extra}), whose MTU toward {underlay_ip} is {underlay_mtu}: raise the underlay "
            f"MTU to at least {link_mtu + extra}, or give the link mtu <= {underlay_mtu - extra} in the topology")


def underlay_one_way_s(rtts_s: Sequence[float]) -> float:
    """The underlay's own one-way latency from round-trip samples: the minimum RTT, halved.

    The minimum, not the mean: queueing and scheduling only ever add to an RTT,
    so the smallest sample is the closest to what the path adds to every packet;
    anything above it is noise that a configured delay should not be cut by.
    """
    samples = [float(r) for r in rtts_s]
    if not samples:
        raise ValueError("rtts_s: no round-trip samples (the underlay was not measured)")
    if any(not r >= 0 for r in samples):   # `not >=` also catches NaN
        raise ValueError(f"rtts_s: round trips must be >= 0 s, got {samples!r}")
    return min(samples) / 2


def delay_problem(configured_delay_s: float, underlay_one_way_s: float) -> str | None:
    """Why a cut link's configured one-way delay cannot be honoured over this underlay, or None.

    A delay of 0 means none was asked for: like a local link (as fast as a veth
    is), the cut link is then as fast as the underlay is, and that is not refused.
    """
    if configured_delay_s <= 0 or configured_delay_s >= underlay_one_way_s:
        return None
    return (f"the link's configured delay of {_us(configured_delay_s)} is below the underlay's own one-way "
            f"latency of {_us(underlay_one_way_s)} (half the smallest measured round trip): traffic would see "
            f"at least {_us(underlay_one_way_s)}; configure a delay of at least that, or place both ends "
            "on one host")


def netem_delay_for(configured_delay_s: float, underlay_one_way_s: float) -> float:
    """The delay to add at the ends so traffic sees the configured one (the underlay supplies the rest)."""
    return max(0.0, configured_delay_s - underlay_one_way_s)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


_MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")


@dataclass(frozen=True)
class TunnelEnd:
    """One end of a cut link, as the host that holds it builds it."""

    testbed: str
    link: int           # index in topo.links
    node: str           # the node whose namespace holds this end
    ifname: str         # the port's name there (plan LinkPlan.a/.b .ifname)
    mac: str
    mtu: int            # the link's MTU (the inner frame, as on a veth)
    vni: int
    local: str          # this host's underlay address
    remote: str         # the other host's underlay address
    port: int = VXLAN_PORT

    def __post_init__(self) -> None:
        _validate(self)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> TunnelEnd:
        """Build from a record of unknown origin: every field is checked (ValueError names it)."""
        if not isinstance(data, dict):
            # ValueError like every other bad record, so a caller catches one kind
            raise ValueError(f"tunnel end: a JSON object is needed, got {type(data).__name__}")  # noqa: TRY004
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(map(str, data)) - set(known))
        if unknown:
            raise ValueError(f"tunnel end: unknown field {unknown[0]!r}")
        missing = [k for k in known if k not in data and k != "port"]
        if missing:
            raise ValueError(f"tunnel end: field {missing[0]!r} is missing")
        return cls(**data)


def _bad(field_name: str, value: Any, need: str) -> ValueError:
    return ValueError(f"tunnel end: field {field_name!r} must be {need}, got {value!r}")


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, value, f"an integer in {lo}..{hi}")


def _validate(end: TunnelEnd) -> None:
    for name in ("testbed", "node"):
        value = getattr(end, name)
        if not isinstance(value, str) or not value:
            raise _bad(name, value, "a non-empty string")
    ifname = end.ifname
    # the kernel's dev_valid_name: 1..15 bytes, not . or .., no '/', ':' or whitespace
    if (not isinstance(ifname, str) or not 0 < len(ifname.encode()) <= IFNAMSIZ or ifname in (".", "..")
            or any(c in "/:" or c.isspace() for c in ifname)):
        raise _bad("ifname", ifname, f"an interface name of 1..{IFNAMSIZ} bytes without '/', ':' or spaces")
    if not isinstance(end.mac, str) or not _MAC_RE.match(end.mac.lower()):
        raise _bad("mac", end.mac, "a MAC address like 02:00:00:00:00:01")
    first = int(end.mac[:2], 16)
    if first & 1 or end.mac.lower() == "00:00:00:00:00:00":
        raise _bad("mac", end.mac, "a unicast, non-zero MAC address")
    _int_in("link", end.link, 0, VNI_SPACE - 1)
    _int_in("mtu", end.mtu, 68, 65535)   # IPv4's minimum .. the largest Ethernet MTU a device takes
    _int_in("vni", end.vni, 1, VNI_SPACE)
    _int_in("port", end.port, 1, 65535)
    family = None
    for name in ("local", "remote"):
        value = getattr(end, name)
        try:
            addr = ipaddress.ip_address(value) if isinstance(value, str) else None
        except ValueError:
            addr = None
        if addr is None or addr.is_multicast or addr.is_unspecified:
            raise _bad(name, value, "a unicast IPv4 or IPv6 address")
        if family is not None and addr.version != family:
            raise _bad(name, value, f"an IPv{family} address like 'local'")
        family = addr.version
    if ipaddress.ip_address(end.local) == ipaddress.ip_address(end.remote):
        raise _bad("remote", end.remote, "another host's address (it equals 'local')")


# -- ping output ------------------------------------------------------------------------------------------

_PER_PACKET = re.compile(r"^\d+ bytes from .*\btime[=<]\s*([0-9.]+)\s*ms(?!.*DUP)", re.MULTILINE)
_SUMMARY = re.compile(r"(?:rtt|round-trip) min/avg/max(?:/mdev)? = ([0-9.]+)/([0-9.]+)/([0-9.]+)")


def parse_ping(output: str) -> list[float]:
    """Round trips in seconds from ping's output: one per reply (duplicates skipped); when ping
    printed only its summary (-q, busybox), [min, avg, max]; [] when nothing came back."""
    per_packet = [float(ms) / 1e3 for ms in _PER_PACKET.findall(output)]
    if per_packet:
        return per_packet
    m = _SUMMARY.search(output)
    return [float(ms) / 1e3 for ms in m.groups()] if m else []


# -- the netlink part: acts in the calling thread's network namespace (the host's) --------------------------

def _ns_path(node_netns: str) -> Path:
    """A namespace given by name (under /run/netns) or as a path (/proc/PID/ns/net)."""
    return Path(node_netns) if os.sep in node_netns else netns.path(node_netns)


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None) if not isinstance(exc, OSError) else exc.errno
    name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
    text = str(exc.args[1]) if len(getattr(exc, "args", ())) > 1 else str(exc)
    return f"{name} ({text})" if name else text


def create(end: TunnelEnd, node_netns: str, ipr: Any = None) -> None:
    """Make `end` in `node_netns` (a name under /run/netns, or a path) as `end.ifname`, with its UDP
    socket in the calling thread's namespace (the host's, which holds the underlay), and leave it down.

    One netlink request: a device created with a target namespace belongs to that namespace, while
    VXLAN binds its socket in the namespace the request came from, so the node sees only an Ethernet
    port and never the underlay. Then the host's filter lets the end's VNI in from `end.remote` only
    (underlay_filter), before anything brings the device up. Either it is made whole (device and
    filter) or not at all; TunnelError says why not.
    ipr: an IPRoute of the host's namespace to send it on (the builder's), else one of our own.
    """
    underlay = ("vxlan_local6", "vxlan_group6") if ":" in end.local else ("vxlan_local", "vxlan_group")
    step = "open the node's namespace"
    node_fd = -1
    own = None
    try:
        node_fd = os.open(_ns_path(node_netns), os.O_RDONLY | os.O_CLOEXEC)
        if ipr is None:
            from pyroute2 import IPRoute

            step = "open a netlink socket"
            ipr = own = IPRoute()
        step = "create the VXLAN device"
        # vxlan_group with a unicast address is the one remote of a point-to-point tunnel;
        # learning off: every frame goes to that remote, nothing is learned from the underlay
        ipr.link("add", ifname=end.ifname, kind="vxlan", net_ns_fd=node_fd, address=end.mac, mtu=end.mtu,
                 vxlan_id=end.vni, vxlan_port=end.port, vxlan_learning=0,
                 **{underlay[0]: end.local, underlay[1]: end.remote})
    except Exception as exc:
        name_taken = False
        if getattr(exc, "code", None) == errno.EEXIST:   # which clashed: the name there, or the VNI here?
            with contextlib.suppress(Exception), _iproute_in(node_fd) as node:
                name_taken = bool(node.link_lookup(ifname=end.ifname))
        raise _create_error(end, node_netns, step, exc, name_taken) from exc
    finally:
        if own is not None:
            own.close()
        if node_fd >= 0:
            os.close(node_fd)
    try:
        underlay_filter.install(end.testbed, underlay_filter.End(end.port, end.vni, end.remote))
    except Exception as exc:
        with contextlib.suppress(Exception):   # (its socket never opened: the device is still down)
            delete(node_netns, end.ifname)
        raise _create_error(end, node_netns, "let its frames in from its peer only", exc) from exc


def _create_error(end: TunnelEnd, node_netns: str, step: str, exc: BaseException,
                  name_taken: bool = False) -> TunnelError:
    reason = _reason(exc)
    hint = ""
    if name_taken:
        hint = f"; {node_netns} already has an interface {end.ifname}"
    elif getattr(exc, "code", None) == errno.EEXIST and step.startswith("create"):
        hint = (f"; VNI {end.vni} is already in use on UDP port {end.port} in this host's namespace "
                "(another testbed's tunnel, or one left behind)")
    return TunnelError(f"tunnel for link {end.link} of testbed {end.testbed}: node {end.node} "
                       f"({node_netns}): cannot {step}: {reason}{hint}")


def _iproute_in(ns_fd: int) -> Any:
    """An IPRoute socket bound to the namespace `ns_fd` (opened there; the thread comes back)."""
    from pyroute2 import IPRoute

    with netns.enter(ns_fd):
        return IPRoute()


def delete(node_netns: str, ifname: str, end: TunnelEnd | None = None) -> None:
    """Remove the tunnel end `ifname` from `node_netns`; a missing end or namespace is fine.
    Refuses (TunnelError) to delete an interface there that is not a VXLAN device. With `end` (the
    record it was created from), its underlay filter goes too, from the calling thread's namespace
    (the host's, as for create)."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ns_fd = os.open(_ns_path(node_netns), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        ns_fd = -1   # the namespace is gone, and its devices with it
    try:
        with contextlib.nullcontext() if ns_fd < 0 else _iproute_in(ns_fd) as ipr:
            found = ipr.link_lookup(ifname=ifname) if ipr is not None else []
            for link in ipr.get_links(*found) if found else []:   # get_links() alone lists them all
                kind = _kind(link)
                if kind not in _KINDS:
                    raise TunnelError(f"{node_netns}: {ifname} is a {kind or 'plain'} device, not a tunnel "
                                      "end: not deleted")
                try:
                    ipr.link("del", index=link["index"])
                except NetlinkError as exc:
                    if exc.code != errno.ENODEV:   # gone in between
                        raise TunnelError(f"{node_netns}: cannot delete tunnel end {ifname}: "
                                          f"{_reason(exc)}") from exc
    finally:
        if ns_fd >= 0:
            os.close(ns_fd)
    if end is not None:
        try:
            underlay_filter.remove(end.testbed, end.port, end.vni)
        except underlay_filter.FilterError as exc:
            raise TunnelError(f"tunnel end {ifname} of link {end.link} ({node_netns}) is deleted, but its "
                              f"underlay filter is not: {exc}") from exc


def _kind(link: Any) -> str | None:
    info = link.get_attr("IFLA_LINKINFO")
    return info.get_attr("IFLA_INFO_KIND") if info is not None else None


def underlay_mtu(remote_ip: str) -> int:
    """The MTU toward `remote_ip` from the calling thread's namespace: the kernel's path MTU for it
    (the device the route leaves by, lowered by the route's own `mtu` or a path MTU it learned), read
    from a connected UDP socket (IP_MTU / IPV6_MTU): no netlink, and nothing is sent."""
    import socket

    v6 = ipaddress.ip_address(remote_ip).version == 6
    family, level, option = ((socket.AF_INET6, socket.IPPROTO_IPV6, _IPV6_MTU) if v6
                             else (socket.AF_INET, socket.IPPROTO_IP, _IP_MTU))
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((remote_ip, 9))   # a UDP connect only looks the route up
        except OSError as exc:
            raise TunnelError(f"no route to the underlay address {remote_ip}: {_reason(exc)}") from exc
        return int(sock.getsockopt(level, option))


_IP_MTU, _IPV6_MTU = 14, 24   # linux/in.h, linux/in6.h (Python's socket module names neither)


def measure_rtts(remote_ip: str, count: int = 5) -> list[float]:
    """Round trips (seconds) to `remote_ip` from the calling thread's namespace, with iputils ping.

    Per-packet lines are kept (no -q) so each reply is one sample; TunnelError when none came back."""
    ipaddress.ip_address(remote_ip)   # a ValueError here, not a ping of a host name
    if count < 1:
        raise ValueError(f"count: at least 1 ping is needed, got {count}")
    # 2 ms apart (root may go down to 2 ms): the minimum is what counts, and `up` waits for it
    cmd = ["ping", "-n", "-c", str(count), "-i", "0.002", "-W", "1", remote_ip]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=count * 0.2 + 5,
                              env={"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except FileNotFoundError as exc:
        raise TunnelError("ping is not installed (Debian: apt-get install iputils-ping)") from exc
    except subprocess.TimeoutExpired as exc:
        raise TunnelError(f"ping {remote_ip} did not finish in {exc.timeout:.0f} s") from exc
    rtts = parse_ping(done.stdout)
    if not rtts:
        said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise TunnelError(f"underlay address {remote_ip} is unreachable: {count} ping(s), no reply "
                          f"(ping exit {done.returncode}: {said})")
    return rtts
