"""A cut link's VXLAN end takes frames from its peer host only (testbed/net/underlay_filter.py).

Three emulated hosts on one underlay (a bridge in a namespace of its own): hA and hB hold the two
ends of a cut link (nodes nA and nB), hX is an attacker on the same underlay. Each sends the same
crafted VXLAN datagram (the link's VNI, an Ethernet frame for nA's port) to hA's VXLAN port: the
attacker's must not reach nA's port, the peer's must. Without the filter both arrive (the kernel
checks no source for a point-to-point VXLAN device), so this fails on the code before it.

The filter lives and goes with the tunnel end, decides for its own VNIs only (another VXLAN device
on the host keeps its traffic), and a table of our name that we cannot prove ours is never touched.
Every packet goes to an address inside a namespace the test made.
"""

from __future__ import annotations

import json
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import requires
from waiting import wait_for

from testbed.net import netns, tunnels, underlay_filter
from testbed.net.tunnels import TunnelEnd, TunnelError

pytestmark = pytest.mark.root   # (the root marker skips, or fails where root is required: tests/requires.py)

NET = "198.18.251"
HOST_A, HOST_B, HOST_X = f"{NET}.1", f"{NET}.2", f"{NET}.3"
MAC_A, MAC_B = "02:00:00:00:00:0a", "02:00:00:00:00:0b"
FRAMES = 20


@dataclass
class Underlay:
    testbed: str
    u: str                     # the underlay's bridge
    hosts: dict[str, str]      # "A"/"B"/"X" -> the host's namespace
    nodes: dict[str, str]      # "A"/"B" -> the node's namespace
    made: list[str] = field(default_factory=list)

    def end(self, side: str, link: int = 3) -> TunnelEnd:
        local, remote = (HOST_A, HOST_B) if side == "A" else (HOST_B, HOST_A)
        return TunnelEnd(testbed=self.testbed, link=link, node=f"n{side}", ifname=f"eth{link}",
                         mac=MAC_A if side == "A" else MAC_B, mtu=1500, vni=tunnels.vni(self.testbed, link),
                         local=local, remote=remote)


def in_ns(name: str, fn):
    return netns.run_in_netns(name, fn)


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def underlay(root) -> Iterator[Underlay]:
    requires.need("nft")
    base = f"tbhv{uuid.uuid4().hex[:6]}"
    un = Underlay(testbed=base, u=f"{base}u", hosts={s: f"{base}h{s}" for s in "ABX"},
                  nodes={s: f"{base}n{s}" for s in "AB"})
    try:
        for name in [un.u, *un.hosts.values(), *un.nodes.values()]:
            # IPv6 off, as the builder has it: the nodes then send nothing of their own (no router
            # solicitations), so what nA's port receives is what the test sent
            netns.create(name, {"net/ipv6/conf/all/disable_ipv6": "1", "net/ipv6/conf/default/disable_ipv6": "1"})
            un.made.append(name)
        ip(un.u, "link", "add", "br0", "type", "bridge")
        ip(un.u, "link", "set", "br0", "up")
        for i, (side, host) in enumerate(sorted(un.hosts.items())):
            port = f"p{side}"
            ip(un.u, "link", "add", port, "type", "veth", "peer", "name", "u0", "netns", host)
            ip(un.u, "link", "set", port, "master", "br0", "up")
            ip(host, "addr", "add", f"{NET}.{i + 1}/24", "dev", "u0")
            ip(host, "link", "set", "u0", "up")
        yield un
    finally:
        for name in reversed(un.made):
            netns.delete(name)


def make_tunnel(un: Underlay) -> tuple[TunnelEnd, TunnelEnd]:
    a, b = un.end("A"), un.end("B")
    in_ns(un.hosts["A"], lambda: tunnels.create(a, un.nodes["A"]))
    in_ns(un.hosts["B"], lambda: tunnels.create(b, un.nodes["B"]))
    for side in "AB":
        ip(un.nodes[side], "link", "set", "eth3", "up")   # (the builder brings ports up: the socket opens)
    return a, b


def datagram(vni: int, dst_mac: str) -> bytes:
    """A VXLAN datagram's payload: the header (I flag, the VNI) and an Ethernet frame to dst_mac."""
    inner = bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex("020000000099") + b"\x88\xb5" + b"hostile" * 8
    return b"\x08\x00\x00\x00" + vni.to_bytes(3, "big") + b"\x00" + inner


def send_from(ns: str, to: str, payload: bytes, count: int = FRAMES) -> None:
    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(count):
                s.sendto(payload, (to, tunnels.VXLAN_PORT))
    in_ns(ns, send)


def has_link(ns: str, ifname: str) -> bool:
    from pyroute2 import IPRoute

    def look() -> bool:
        with IPRoute() as ipr:
            return bool(ipr.link_lookup(ifname=ifname))
    return in_ns(ns, look)


def rx_packets(ns: str, ifname: str) -> int:
    """The interface's received packets, asked of netlink from inside `ns` (/sys shows the
    namespace of whoever mounted it)."""
    from pyroute2 import IPRoute

    def stats() -> int:
        with IPRoute() as ipr:
            (link,) = ipr.get_links(ipr.link_lookup(ifname=ifname)[0])
            return int(link.get_attr("IFLA_STATS64")["rx_packets"])
    return in_ns(ns, stats)


def dropped(ns: str, testbed: str, end: TunnelEnd) -> int:
    """The packets the end's chain dropped (its counter; 0 when there is no such chain), read from
    nft's JSON listing in `ns`."""
    chain = underlay_filter.End(end.port, end.vni, end.remote).chain
    done = in_ns(ns, lambda: subprocess.run(["nft", "-j", "list", "chain", "inet",
                                             underlay_filter.table_name(testbed), chain],
                                            capture_output=True, text=True, timeout=30, check=False))
    if done.returncode != 0:
        return 0
    for item in json.loads(done.stdout)["nftables"]:
        for expr in (item.get("rule") or {}).get("expr", []):
            if "counter" in expr:
                return int(expr["counter"]["packets"])
    raise AssertionError(f"no counter in chain {chain}: {done.stdout}")


def table_of(ns: str, testbed: str) -> underlay_filter.Table | None:
    return in_ns(ns, lambda: underlay_filter.read(testbed))


def test_frames_from_another_underlay_address_do_not_reach_the_overlay(underlay):
    a, _b = make_tunnel(underlay)
    hA, nA = underlay.hosts["A"], underlay.nodes["A"]
    hostile = datagram(a.vni, MAC_A)
    before = rx_packets(nA, "eth3")
    send_from(underlay.hosts["X"], HOST_A, hostile)   # the attacker ...
    send_from(underlay.hosts["B"], HOST_A, hostile)   # ... and the peer, the same datagram from its address

    def arrived() -> int:
        return rx_packets(nA, "eth3") - before

    # every datagram is accounted for: received on nA's port, or dropped by the end's filter in hA
    wait_for(lambda: arrived() >= FRAMES and arrived() + dropped(hA, underlay.testbed, a) >= 2 * FRAMES,
             timeout=10, what=f"the {2 * FRAMES} datagrams to reach nA's port or the filter")
    assert arrived() == FRAMES, f"{arrived() - FRAMES} frame(s) from the attacker reached nA's port"
    assert dropped(hA, underlay.testbed, a) == FRAMES
    # and the tunnel carries traffic both ways
    ip(nA, "addr", "add", "10.99.0.1/30", "dev", "eth3")
    ip(underlay.nodes["B"], "addr", "add", "10.99.0.2/30", "dev", "eth3")
    done = in_ns(nA, lambda: subprocess.run(["ping", "-n", "-c", "2", "-i", "0.2", "-W", "2", "10.99.0.2"],
                                            capture_output=True, text=True, timeout=30, check=False))
    assert done.returncode == 0, done.stdout + done.stderr


def test_other_vnis_on_the_host_are_left_alone(underlay):
    """A VXLAN device that is not testbed's (its own VNI, its peer the third host) keeps its traffic."""
    a, _b = make_tunnel(underlay)
    hA = underlay.hosts["A"]
    other_vni = a.vni % (2**24 - 1) + 1
    ip(hA, "link", "add", "vxo", "type", "vxlan", "id", str(other_vni), "remote", HOST_X, "local", HOST_A,
       "dstport", str(tunnels.VXLAN_PORT), "nolearning")
    ip(hA, "link", "set", "vxo", "address", "02:00:00:00:00:0c", "up")
    before = rx_packets(hA, "vxo")
    send_from(underlay.hosts["X"], HOST_A, datagram(other_vni, "02:00:00:00:00:0c"))
    wait_for(lambda: rx_packets(hA, "vxo") - before == FRAMES, timeout=10,
             what="the other device's frames from its own peer")


def test_the_filter_goes_with_the_tunnel_end(underlay):
    a, b = make_tunnel(underlay)
    hA, nA = underlay.hosts["A"], underlay.nodes["A"]
    found = table_of(hA, underlay.testbed)
    assert found is not None and [(e.port, e.vni, e.peer) for e in found.ends] == [(a.port, a.vni, HOST_B)]
    # a second end on the same host, to another peer: both kept, each with its own peer
    c = TunnelEnd(**{**a.to_json(), "link": 4, "ifname": "eth4", "vni": tunnels.vni(underlay.testbed, 4),
                     "remote": HOST_X})
    in_ns(hA, lambda: tunnels.create(c, nA))
    assert {(e.vni, e.peer) for e in table_of(hA, underlay.testbed).ends} == {(a.vni, HOST_B), (c.vni, HOST_X)}
    in_ns(hA, lambda: tunnels.delete(nA, "eth4", c))
    assert [(e.vni, e.peer) for e in table_of(hA, underlay.testbed).ends] == [(a.vni, HOST_B)]
    in_ns(hA, lambda: tunnels.delete(nA, "eth3", a))
    assert table_of(hA, underlay.testbed) is None   # the last end took the table with it
    in_ns(underlay.hosts["B"], lambda: tunnels.delete(underlay.nodes["B"], "eth3", b))
    assert table_of(underlay.hosts["B"], underlay.testbed) is None


def test_a_table_of_our_name_that_is_not_provably_ours_is_never_touched(underlay):
    hA, nA = underlay.hosts["A"], underlay.nodes["A"]
    table = underlay_filter.table_name(underlay.testbed)

    def plant() -> None:   # someone else's table under our name (no owner label on its rules)
        subprocess.run(["nft", "add", "table", "inet", table], check=True, capture_output=True, timeout=30)
        subprocess.run(["nft", "add", "chain", "inet", table, "mine"], check=True, capture_output=True, timeout=30)
    in_ns(hA, plant)
    with pytest.raises(TunnelError, match=rf"not provably this testbed's.*{table}|{table}.*not provably"):
        in_ns(hA, lambda: tunnels.create(underlay.end("A"), nA))
    # rolled back: no device left behind in the node, and the planted table as it was
    assert not has_link(nA, "eth3")
    found = table_of(hA, underlay.testbed)
    assert found is not None and found.chains == {"mine"}
    with pytest.raises(underlay_filter.FilterError, match="not touched"):
        in_ns(hA, lambda: underlay_filter.remove_testbed(underlay.testbed))
    assert in_ns(hA, lambda: underlay_filter.sweep(set())) == []   # cleanup leaves it too
    assert table_of(hA, underlay.testbed).chains == {"mine"}


def test_cleanup_removes_only_tables_of_this_state_root(underlay, monkeypatch, tmp_path):
    a, _b = make_tunnel(underlay)
    hA = underlay.hosts["A"]
    # another state root (another user of testbed on this host) does not own it ...
    with monkeypatch.context() as m:
        m.setenv("TESTBED_STATE_DIR", str(tmp_path / "other-root"))
        assert in_ns(hA, lambda: underlay_filter.sweep(set())) == []
    assert table_of(hA, underlay.testbed) is not None
    # ... a live testbed's is kept, a dead one's goes
    assert in_ns(hA, lambda: underlay_filter.sweep({underlay.testbed})) == []
    removed = in_ns(hA, lambda: underlay_filter.sweep(set()))
    assert [t for t, _what in removed] == [underlay.testbed]
    assert table_of(hA, underlay.testbed) is None
    assert has_link(underlay.nodes["A"], a.ifname)   # (the end itself is the node's: it goes with `down`)


def test_the_ruleset_is_json_values_only():
    """No value is ever spliced into nft program text: a hostile peer string stays a string."""
    end = underlay_filter.End(4789, 42, '198.18.251.2"; flush ruleset; "')
    doc = json.dumps({"nftables": [*underlay_filter.end_rules("testbed-x", end),
                                   *underlay_filter.dispatch("x", [end])]})
    parsed = json.loads(doc)["nftables"]
    peers = [r["add"]["rule"]["expr"][0]["match"]["right"] for r in parsed
             if "rule" in r.get("add", {}) and r["add"]["rule"]["chain"] == end.chain
             and "match" in r["add"]["rule"]["expr"][0]]
    assert peers == [end.peer]
    with pytest.raises(underlay_filter.FilterError, match="not a valid testbed name"):
        underlay_filter.table_name("x; flush ruleset")


def test_the_filter_is_made_in_the_hosts_namespace_only(underlay):
    """The filter is made where the end's socket is (the calling thread's namespace: the host's), not
    in the node's and not in this machine's."""
    ours = underlay_filter.table_name(underlay.testbed)
    here = subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True, check=True).stdout
    make_tunnel(underlay)
    assert table_of(underlay.hosts["A"], underlay.testbed) is not None
    assert table_of(underlay.nodes["A"], underlay.testbed) is None
    assert ours not in here
    assert ours not in subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True,
                                      check=True).stdout
