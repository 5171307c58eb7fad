"""Many rtnetlink requests per round trip: what `up` sends by the thousand.

pyroute2 sends one request, waits for its answer, and builds every message
in Python on the way (its synchronous API runs an asyncio loop per call):
about 0.2-0.8 ms a request here, and a k=8 fat-tree's build is tens of
thousands of them. The kernel itself needs microseconds for most. So the
builder queues a namespace's requests in a `Batch`, which sends them together
(one sendmsg per ~32 KiB; the kernel runs them in order) and then reads one
acknowledgement per request. A failed request does not stop the ones after
it (netlink goes on through a batch): `commit` raises for the first failure
in the order they were queued, naming what that request was for, and the
builder's caller rolls the whole testbed back anyway.

The messages are the few the builder needs, encoded here with struct:
veth pairs with both ends placed in their namespaces, a bridge, link state,
IPv4 addresses, permanent neighbours, IPv4 routes (one next hop, several, or
unreachable), and messages encoded elsewhere (tc, which testbed.net.shaping
compiles once per profile through pyroute2 and reuses per interface). Each
encoding is the one pyroute2 sends for the same call (tests/test_rtnl.py
compares them byte for byte), so what the kernel gets has not changed.

A `Batch` is bound to the namespace its socket was made in (like IPRoute):
make it after setns into the namespace, or in the root namespace for veths
placed by namespace descriptor.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Iterable

from testbed.errors import TestbedError

NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_EXT_ACK = 11
NETLINK_CAP_ACK = 10
SO_RCVBUFFORCE = 33   # (not in Python's socket module)
SIOCGSKNS = 0x894C    # a socket's network namespace, as an fd (Linux 4.10+)

NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_DUMP, NLM_F_EXCL, NLM_F_CREATE = 0x300, 0x200, 0x400
NLMSGERR_ATTR_MSG = 1
CREATE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE
CHANGE = NLM_F_REQUEST | NLM_F_ACK

RTM_NEWLINK, RTM_GETLINK, RTM_NEWADDR, RTM_NEWROUTE, RTM_NEWNEIGH = 16, 18, 20, 24, 28
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_MASTER, IFLA_OPERSTATE = 1, 3, 4, 10, 16
IFLA_LINKINFO, IFLA_IFALIAS, IFLA_NET_NS_FD = 18, 20, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFLA_BR_FORWARD_DELAY, IFLA_BR_STP_STATE, IFLA_BR_MCAST_SNOOPING = 1, 5, 23
IFA_ADDRESS, IFA_LOCAL = 1, 2
NDA_DST, NDA_LLADDR, NUD_PERMANENT = 1, 2, 0x80
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_MULTIPATH = 1, 4, 5, 9
RT_TABLE_MAIN, RTPROT_STATIC, RTN_UNICAST, RTN_UNREACHABLE = 254, 4, 1, 7
IFF_UP = 0x1
# IF_OPER_*: what IFLA_OPERSTATE says (a device carries traffic when UP; lo and TAPs say UNKNOWN)
OPERSTATES = {0: "UNKNOWN", 1: "NOTPRESENT", 2: "DOWN", 3: "LOWERLAYERDOWN", 4: "TESTING", 5: "DORMANT", 6: "UP"}

_HDR = struct.Struct("=IHHII")           # nlmsghdr: length, type, flags, sequence, port
_IFINFO = struct.Struct("=BxHiII")       # ifinfomsg: family, type, index, flags, change
_CHUNK = 32 * 1024                       # bytes per sendmsg (the socket's send buffer is ~208 KiB)
# requests per sendmsg: each answer is an skb of its own (~1 KiB of the receive buffer's ~208 KiB
# default), all queued before we read the first: more at once overflows it (ENOBUFS)
_PER_SEND = 128
_RCVBUF = 1 << 20


class RtnlError(TestbedError):
    """A request of a batch failed: what it was for, and the kernel's answer."""

    def __init__(self, what: str, code: int, detail: str = ""):
        self.what, self.errno = what, code
        why = os.strerror(code) + (f" ({detail})" if detail else "")
        super().__init__(f"{what}: {why}")


# -- encoding --------------------------------------------------------------------------------------

def attr(kind: int, payload: bytes) -> bytes:
    """One rtattr, padded to 4 bytes."""
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n & 3)


def tc(kind: int, flags: int, index: int, handle: int, parent: int, info: int = 0, attrs: bytes = b"") -> bytes:
    """A whole tc message (header included: for `Batch.add_message`): tcmsg on interface `index`, then
    `attrs` (encoded with `attr`)."""
    body = struct.pack("=BxxxiIII", 0, index, handle, parent, info) + attrs
    return _HDR.pack(_HDR.size + len(body), kind, flags, 0, 0) + body


def _str(s: str) -> bytes:
    return s.encode() + b"\0"


def _u32(v: int) -> bytes:
    return struct.pack("=I", v)


def _mac(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def _ip(ip: str) -> bytes:
    return ipaddress.IPv4Address(ip).packed


def _ifinfo(index: int = 0, up: bool = False) -> bytes:
    return _IFINFO.pack(0, 0, index, IFF_UP if up else 0, IFF_UP if up else 0)


def veth(ifname: str, index: int, ns_fd: int, mac: str, mtu: int,
         peer_ifname: str, peer_index: int, peer_ns_fd: int, peer_mac: str) -> bytes:
    """RTM_NEWLINK body: a veth pair, each end with its own name, ifindex, namespace, MAC and MTU."""
    peer = _ifinfo(peer_index) + attr(IFLA_IFNAME, _str(peer_ifname)) + attr(IFLA_NET_NS_FD, _u32(peer_ns_fd)) \
        + attr(IFLA_ADDRESS, _mac(peer_mac)) + attr(IFLA_MTU, _u32(mtu))
    info = attr(IFLA_INFO_KIND, _str("veth")) + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer))
    return _ifinfo(index) + attr(IFLA_IFNAME, _str(ifname)) + attr(IFLA_NET_NS_FD, _u32(ns_fd)) \
        + attr(IFLA_ADDRESS, _mac(mac)) + attr(IFLA_MTU, _u32(mtu)) + attr(IFLA_LINKINFO, info)


def bridge(ifname: str, mac: str, index: int = 0) -> bytes:
    """RTM_NEWLINK body: a bridge without STP, forward delay or multicast snooping (down)."""
    data = attr(IFLA_BR_STP_STATE, _u32(0)) + attr(IFLA_BR_FORWARD_DELAY, _u32(0)) \
        + attr(IFLA_BR_MCAST_SNOOPING, b"\0")
    info = attr(IFLA_INFO_KIND, _str("bridge")) + attr(IFLA_INFO_DATA, data)
    return _ifinfo(index) + attr(IFLA_IFNAME, _str(ifname)) + attr(IFLA_ADDRESS, _mac(mac)) \
        + attr(IFLA_LINKINFO, info)


def link_up(index: int, *, master: int | None = None, mac: str | None = None, alias: str | None = None) -> bytes:
    """RTM_NEWLINK body (a change): the device up; optionally enslaved, re-addressed, aliased."""
    out = _ifinfo(index, up=True)
    if master is not None:
        out += attr(IFLA_MASTER, _u32(master))
    if mac is not None:
        out += attr(IFLA_ADDRESS, _mac(mac))
    if alias is not None:
        out += attr(IFLA_IFALIAS, _str(alias))
    return out


def address(index: int, ip: str, prefixlen: int) -> bytes:
    """RTM_NEWADDR body: an IPv4 address (local and peer the same, as `ip addr add` and pyroute2 do)."""
    a = _ip(ip)
    return struct.pack("=BBBBI", socket.AF_INET, prefixlen, 0, 0, index) + attr(IFA_ADDRESS, a) + attr(IFA_LOCAL, a)


def neighbour(index: int, ip: str, mac: str) -> bytes:
    """RTM_NEWNEIGH body: a permanent IPv4 neighbour entry."""
    return struct.pack("=BxxxiHBB", socket.AF_INET, index, NUD_PERMANENT, 0, 0) \
        + attr(NDA_DST, _ip(ip)) + attr(NDA_LLADDR, _mac(mac))


def route(dst: str, nexthops: list[tuple[str, int]]) -> bytes:
    """RTM_NEWROUTE body: a static IPv4 route in the main table to `dst` (a network, 0.0.0.0/0 for
    the default) over (gateway, ifindex) next hops: one, several (ECMP), or none (unreachable)."""
    net = ipaddress.IPv4Network(dst)
    kind = RTN_UNICAST if nexthops else RTN_UNREACHABLE
    out = struct.pack("=BBBBBBBBI", socket.AF_INET, net.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, 0, kind, 0)
    if net.prefixlen:
        out += attr(RTA_DST, net.network_address.packed)
    if len(nexthops) == 1:
        via, oif = nexthops[0]
        out += attr(RTA_GATEWAY, _ip(via)) + attr(RTA_OIF, _u32(oif))
    elif nexthops:
        hops = b""
        for via, oif in nexthops:
            gw = attr(RTA_GATEWAY, _ip(via))
            hops += struct.pack("=HBBi", 8 + len(gw), 0, 0, oif) + gw
        out += attr(RTA_MULTIPATH, hops)
    return out


# -- the socket ------------------------------------------------------------------------------------

@dataclass
class _Queued:
    kind: int
    flags: int
    body: bytes
    what: str
    ok: frozenset[int] = frozenset()   # errnos that do not count as a failure


class Batch:
    """Requests queued, then sent together; one socket, in the namespace it was made in."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        try:
            self.sock.bind((0, 0))
            try:   # room for a whole send's answers (root may exceed the rmem_max sysctl)
                self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, _RCVBUF)
            except OSError:
                pass
            # errors say why (extended ack) and do not echo the whole request back (capped acks)
            for opt in (NETLINK_EXT_ACK, NETLINK_CAP_ACK):
                try:
                    self.sock.setsockopt(SOL_NETLINK, opt, 1)
                except OSError:
                    pass
        except BaseException:
            self.sock.close()
            raise
        self.queued: list[_Queued] = []
        self.seq = 0
        self.sent = 0   # requests acknowledged so far (for callers that count)

    @classmethod
    def beside(cls, sock_fd: int) -> "Batch":
        """A batch in the namespace of the socket `sock_fd` (an IPRoute's fileno(), say), found by
        SIOCGSKNS: callers that hold a socket need not know which namespace it was made in."""
        from testbed.net import netns

        ns_fd = fcntl.ioctl(sock_fd, SIOCGSKNS)
        try:
            with netns.enter(ns_fd):
                return cls()
        finally:
            os.close(ns_fd)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.queued)

    def add(self, kind: int, flags: int, body: bytes, what: str, ok: Iterable[int] = ()) -> None:
        """Queue one request (an RTM_* type, NLM_F_* flags, the message after its netlink header);
        `ok`: errnos that this request may get without failing the batch."""
        self.queued.append(_Queued(kind, flags, body, what, frozenset(ok)))

    def add_message(self, message: bytes, what: str, ok: Iterable[int] = ()) -> None:
        """Queue a whole encoded message (header included: its type and flags are kept; the
        sequence number and port are set here)."""
        _len, kind, flags, _seq, _pid = _HDR.unpack_from(message)
        self.add(kind, flags | NLM_F_ACK, message[_HDR.size:], what, ok)

    def commit(self) -> None:
        """Send everything queued and wait for every answer; RtnlError for the first that failed."""
        queued, self.queued = self.queued, []
        failed: tuple[int, int, str] | None = None   # (position, errno, kernel's message)
        i = 0
        while i < len(queued):
            chunk, size, first = [], 0, i
            while i < len(queued) and (not chunk or (len(chunk) < _PER_SEND
                                                     and size + len(queued[i].body) + _HDR.size <= _CHUNK)):
                q = queued[i]
                self.seq += 1
                msg = _HDR.pack(_HDR.size + len(q.body), q.kind, q.flags, self.seq, 0) + q.body
                chunk.append(msg + b"\0" * (-len(msg) & 3))
                size += len(chunk[-1])
                i += 1
            self.sock.sendall(b"".join(chunk))
            base = self.seq - len(chunk)   # sequence numbers base+1 .. self.seq
            for seq, code, detail in self._acks(base + 1, self.seq):
                pos = seq - base - 1 + first
                if code and code not in queued[pos].ok and (failed is None or pos < failed[0]):
                    failed = (pos, code, detail)
            self.sent += len(chunk)
        if failed is not None:
            pos, code, detail = failed
            raise RtnlError(queued[pos].what, code, detail)

    def _acks(self, lo: int, hi: int) -> list[tuple[int, int, str]]:
        """(sequence, errno, extended-ack message) for every request lo..hi, as they come."""
        out = []
        want = set(range(lo, hi + 1))
        while want:
            data = self.sock.recv(1 << 16)
            off = 0
            while off + _HDR.size <= len(data):
                length, kind, _flags, seq, _pid = _HDR.unpack_from(data, off)
                if length < _HDR.size:
                    break
                if kind == NLMSG_ERROR and seq in want:
                    code = -struct.unpack_from("=i", data, off + _HDR.size)[0]
                    detail = _ext_ack_message(data[off:off + length]) if code else ""
                    out.append((seq, code, detail))
                    want.discard(seq)
                off += (length + 3) & ~3
        return out

    def links(self) -> dict[str, tuple[int, str]]:
        """Every device of the namespace: name -> (ifindex, operational state)."""
        self.seq += 1
        seq = self.seq
        self.sock.sendall(_HDR.pack(_HDR.size + _IFINFO.size, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
                          + _ifinfo())
        out: dict[str, tuple[int, str]] = {}
        while True:
            data = self.sock.recv(1 << 20)
            off = 0
            while off + _HDR.size <= len(data):
                length, kind, _flags, mseq, _pid = _HDR.unpack_from(data, off)
                if length < _HDR.size:
                    return out
                if mseq == seq:
                    if kind == NLMSG_DONE:
                        return out
                    if kind == NLMSG_ERROR:
                        code = -struct.unpack_from("=i", data, off + _HDR.size)[0]
                        raise RtnlError("list the devices", code or errno.EIO)
                    if kind == RTM_NEWLINK:
                        index = _IFINFO.unpack_from(data, off + _HDR.size)[2]
                        attrs = _attrs(data, off + _HDR.size + _IFINFO.size, off + length)
                        name = attrs.get(IFLA_IFNAME, b"").split(b"\0", 1)[0].decode(errors="replace")
                        state = attrs.get(IFLA_OPERSTATE, b"\0")[0]
                        out[name] = (index, OPERSTATES.get(state, str(state)))
                off += (length + 3) & ~3


def _attrs(data: bytes, off: int, end: int) -> dict[int, bytes]:
    out = {}
    while off + 4 <= end:
        n, kind = struct.unpack_from("=HH", data, off)
        if n < 4:
            break
        out[kind & 0x3FFF] = data[off + 4:off + n]
        off += (n + 3) & ~3
    return out


def _ext_ack_message(msg: bytes) -> str:
    """The kernel's own words in an error acknowledgement (NLMSGERR_ATTR_MSG), if it sent any."""
    inner_len = _HDR.unpack_from(msg, _HDR.size + 4)[0] if len(msg) >= 2 * _HDR.size + 4 else 0
    flags = _HDR.unpack_from(msg)[2]
    # capped ack: the request's header only; else the whole request is echoed before the attributes
    start = _HDR.size + 4 + (_HDR.size if flags & 0x100 else max(inner_len, _HDR.size))
    attrs = _attrs(msg, (start + 3) & ~3, len(msg))
    return attrs.get(NLMSGERR_ATTR_MSG, b"").split(b"\0", 1)[0].decode(errors="replace")
