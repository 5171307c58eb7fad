"""Cut links as VXLAN tunnels (testbed.net.tunnels).

The pure part runs anywhere. The real part builds two emulated hosts hA and hB
(network namespaces joined by a veth underlay in 198.18.250.0/24, MTU 9000) and
two node namespaces nA and nB; each host makes the tunnel end of its node, and
traffic crosses nA -> hA -> underlay -> hB -> nB. Every packet goes to an
address inside a namespace the test made.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import requires
from waiting import wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.net import netns, tunnels
from testbed.net.tunnels import TunnelEnd, TunnelError

HOST_A, HOST_B = "198.18.250.1", "198.18.250.2"
HOST_A6, HOST_B6 = "fd00:99:250::1", "fd00:99:250::2"
VXLAN_PORT_HEX = f":{tunnels.VXLAN_PORT:04X} "   # as /proc/net/udp writes a local port


def end_for(testbed: str = "tb1", link: int = 3, **kw: Any) -> TunnelEnd:
    values: dict[str, Any] = {"testbed": testbed, "link": link, "node": "w0", "ifname": f"eth{link}",
                              "mac": "02:00:00:00:00:01", "mtu": 1500, "vni": tunnels.vni(testbed, link),
                              "local": HOST_A, "remote": HOST_B}
    values.update(kw)
    return TunnelEnd(**values)


# -- VNIs ------------------------------------------------------------------------------------------------

def test_vni_is_the_same_in_another_process():
    names = ["fat-tree", "t1a2b3", "x"]
    here = [tunnels.vni(n, i) for n in names for i in (0, 1, 47, 65535)]
    code = (f"from testbed.net import tunnels; print([tunnels.vni(n, i) for n in {names!r} "
            "for i in (0, 1, 47, 65535)])")
    # a fresh interpreter has another hash() salt: the VNI must not depend on it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert json.loads(out) == here


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.integers(min_value=0, max_value=2**16 - 1))
def test_vni_is_24_bit_and_nonzero(testbed, index):
    v = tunnels.vni(testbed, index)
    assert 1 <= v < 2**24
    assert tunnels.vni(testbed, index) == v


@pytest.mark.parametrize("testbed", ["fat-tree", "a", "t" + "f" * 39])
def test_vni_distinct_for_all_links_of_a_testbed(testbed):
    assert len({tunnels.vni(testbed, i) for i in range(2**16)}) == 2**16


def test_vni_runs_of_two_testbeds_rarely_overlap():
    # 200 testbeds of 48 links: 19,900 pairs, each overlapping with p ~ 96 / 2**24 (~0.11 expected)
    runs = [{tunnels.vni(f"tb{k}", i) for i in range(48)} for k in range(200)]
    overlapping = sum(1 for a in range(200) for b in range(a + 1, 200) if runs[a] & runs[b])
    assert overlapping <= 2


@pytest.mark.parametrize(("testbed", "index", "named"), [
    ("", 0, "testbed"), (None, 0, "testbed"), ("tb", -1, "link_index"), ("tb", 2**24 - 1, "link_index"),
    ("tb", True, "link_index"), ("tb", 1.0, "link_index")])
def test_vni_rejects_bad_input(testbed, index, named):
    with pytest.raises(ValueError, match=named):
        tunnels.vni(testbed, index)


# -- overhead, MTU, delay --------------------------------------------------------------------------------

def test_overhead():
    assert tunnels.overhead(HOST_A) == 50
    assert tunnels.overhead(HOST_A6) == 70
    with pytest.raises(ValueError):
        tunnels.overhead("not-an-address")


def test_mtu_problem_says_both_fixes():
    text = tunnels.mtu_problem(1500, 1500, HOST_B)
    assert text is not None
    assert "at least 1550" in text and "mtu <= 1450" in text
    assert tunnels.mtu_problem(1500, 9000, HOST_B) is None
    assert tunnels.mtu_problem(1450, 1500, HOST_B) is None      # exactly fits
    assert tunnels.mtu_problem(1451, 1500, HOST_B) is not None
    assert tunnels.mtu_problem(1500, 1570, HOST_B6) is None
    six = tunnels.mtu_problem(1501, 1570, HOST_B6)
    assert six is not None and "IPv6" in six and "at least 1571" in six and "mtu <= 1500" in six


def test_underlay_one_way_is_half_the_smallest_round_trip():
    assert tunnels.underlay_one_way_s([0.004, 0.002, 0.010]) == pytest.approx(0.001)
    for bad in ([], [0.001, -0.001], [float("nan")]):
        with pytest.raises(ValueError, match="rtts_s"):
            tunnels.underlay_one_way_s(bad)


def test_delay_problem_and_the_delay_to_add():
    text = tunnels.delay_problem(100e-6, 200e-6)
    assert text is not None and "100 us" in text and "200 us" in text
    assert tunnels.delay_problem(300e-6, 200e-6) is None
    assert tunnels.delay_problem(200e-6, 200e-6) is None
    assert tunnels.delay_problem(0.0, 200e-6) is None            # no delay asked: as fast as the underlay
    assert tunnels.netem_delay_for(1e-3, 2e-4) == pytest.approx(8e-4)
    assert tunnels.netem_delay_for(1e-4, 2e-4) == 0.0


def test_parse_ping():
    per_packet = ("PING 10.99.0.2 (10.99.0.2) 56(84) bytes of data.\n"
                  "64 bytes from 10.99.0.2: icmp_seq=1 ttl=64 time=0.057 ms\n"
                  "64 bytes from 10.99.0.2: icmp_seq=1 ttl=64 time=0.300 ms (DUP!)\n"
                  "64 bytes from 10.99.0.2: icmp_seq=2 ttl=64 time=1.25 ms\n\n"
                  "--- 10.99.0.2 ping statistics ---\n"
                  "2 packets transmitted, 2 received, +1 duplicates, 0% packet loss, time 201ms\n"
                  "rtt min/avg/max/mdev = 0.057/0.202/0.300/0.100 ms\n")
    assert tunnels.parse_ping(per_packet) == pytest.approx([57e-6, 1.25e-3])
    quiet = "2 packets transmitted, 2 received, 0% packet loss\nrtt min/avg/max/mdev = 0.05/0.07/0.09/0.02 ms\n"
    assert tunnels.parse_ping(quiet) == pytest.approx([50e-6, 70e-6, 90e-6])
    busybox = "round-trip min/avg/max = 0.100/0.200/0.300 ms\n"
    assert tunnels.parse_ping(busybox) == pytest.approx([1e-4, 2e-4, 3e-4])
    assert tunnels.parse_ping("3 packets transmitted, 0 received, 100% packet loss, time 2040ms\n") == []


# -- the tunnel end's record -----------------------------------------------------------------------------

def test_tunnel_end_round_trips_through_json():
    end = end_for()
    assert TunnelEnd.from_json(json.loads(json.dumps(end.to_json()))) == end
    six = end_for(local=HOST_A6, remote=HOST_B6, port=8472)
    assert TunnelEnd.from_json(six.to_json()) == six
    no_port = end.to_json()
    del no_port["port"]
    assert TunnelEnd.from_json(no_port).port == tunnels.VXLAN_PORT


@pytest.mark.parametrize(("name", "value"), [
    ("testbed", ""), ("testbed", 5), ("node", None), ("link", -1), ("link", "3"), ("link", True),
    ("ifname", ""), ("ifname", "x" * 16), ("ifname", "eth 0"), ("ifname", "a/b"), ("ifname", "a:b"),
    ("ifname", ".."), ("mac", "02:00:00:00:00"), ("mac", "01:00:5e:00:00:01"), ("mac", "00:00:00:00:00:00"),
    ("mac", 2), ("mtu", 67), ("mtu", 65536), ("mtu", 1500.0), ("vni", 0), ("vni", 2**24), ("port", 0),
    ("port", 70000), ("local", "198.18.250.300"), ("local", "239.1.1.1"), ("local", "0.0.0.0"),
    ("remote", HOST_B6), ("remote", HOST_A), ("remote", "host-b.example"), ("remote", None)])
def test_from_json_names_the_bad_field(name, value):
    record = end_for().to_json()
    record[name] = value
    with pytest.raises(ValueError) as caught:
        TunnelEnd.from_json(record)
    assert repr(name) in str(caught.value) and repr(value) in str(caught.value)


def test_from_json_rejects_a_malformed_record():
    with pytest.raises(ValueError, match="JSON object"):
        TunnelEnd.from_json(["tb1", 3])
    extra = {**end_for().to_json(), "netns": "/proc/1/ns/net"}
    with pytest.raises(ValueError, match="'netns'"):
        TunnelEnd.from_json(extra)
    missing = end_for().to_json()
    del missing["remote"]
    with pytest.raises(ValueError, match="'remote'"):
        TunnelEnd.from_json(missing)


# -- real: two emulated hosts with a veth underlay ---------------------------------------------------------

@dataclass
class Hosts:
    hA: str
    hB: str
    nA: str
    nB: str
    testbed: str
    extra: list[str] = field(default_factory=list)

    def end(self, side: str, link: int = 3, **kw: Any) -> TunnelEnd:
        local, remote = (HOST_A, HOST_B) if side == "A" else (HOST_B, HOST_A)
        mac = "02:00:00:00:00:0a" if side == "A" else "02:00:00:00:00:0b"
        values = {"testbed": self.testbed, "link": link, "node": f"n{side}", "ifname": f"eth{link}", "mac": mac,
                  "mtu": 1500, "vni": tunnels.vni(self.testbed, link), "local": local, "remote": remote}
        values.update(kw)
        return TunnelEnd(**values)

    def namespace(self, tag: str) -> str:
        """One more node namespace, removed with the others."""
        name = f"{self.hA[:-2]}{tag}"
        netns.create(name)
        self.extra.append(name)
        return name


def in_ns(name: str, fn: Callable[[], Any]) -> Any:
    return netns.run_in_netns(name, fn)


def links_of(name: str) -> dict[str, Any]:
    from pyroute2 import IPRoute

    def dump() -> dict[str, Any]:
        with IPRoute() as ipr:
            return {link.get_attr("IFLA_IFNAME"): link for link in ipr.get_links()}
    return in_ns(name, dump)


def run_in(name: str, *cmd: str) -> subprocess.CompletedProcess:
    """A command in namespace `name` (a child forked from a thread inherits that thread's namespace)."""
    return in_ns(name, lambda: subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False))


def bring_up(name: str, ifname: str, address: str, prefixlen: int) -> None:
    from pyroute2 import IPRoute

    def up() -> None:
        with IPRoute() as ipr:
            (index,) = ipr.link_lookup(ifname=ifname)
            ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
            ipr.link("set", index=index, state="up")
    in_ns(name, up)


def udp_ports(name: str) -> str:
    """/proc/net/udp of namespace `name`: /proc/thread-self, since namespaces here are per thread."""
    def read() -> str:
        with open("/proc/thread-self/net/udp") as f:
            return f.read()
    return in_ns(name, read)


@pytest.fixture
def hosts(root) -> Iterator[Hosts]:
    """hA, hB joined by a veth underlay; nA, nB empty; all four deleted afterwards (`root` skips
    the test without root and namespaces; each end's underlay filter needs nft)."""
    from pyroute2 import IPRoute

    requires.need("nft")

    base = f"tbtun{uuid.uuid4().hex[:6]}"
    h = Hosts(hA=f"{base}hA", hB=f"{base}hB", nA=f"{base}nA", nB=f"{base}nB", testbed=base)
    made: list[str] = []
    try:
        for name in (h.hA, h.hB, h.nA, h.nB):
            netns.create(name)
            made.append(name)
        fds = [os.open(netns.path(n), os.O_RDONLY | os.O_CLOEXEC) for n in (h.hA, h.hB)]
        try:
            with IPRoute() as ipr:   # both ends made straight in the hosts: nothing in ours
                ipr.link("add", ifname="u0", kind="veth", net_ns_fd=fds[0], mtu=9000,
                         peer={"ifname": "u0", "net_ns_fd": fds[1], "mtu": 9000})
        finally:
            for fd in fds:
                os.close(fd)
        bring_up(h.hA, "u0", HOST_A, 24)
        bring_up(h.hB, "u0", HOST_B, 24)
        yield h
    finally:
        for name in [*h.extra, *made]:   # nodes before hosts does not matter: either takes the ends
            netns.delete(name)


def make_pair(h: Hosts, **kw: Any) -> tuple[TunnelEnd, TunnelEnd]:
    a, b = h.end("A", **kw), h.end("B", **kw)
    in_ns(h.hA, lambda: tunnels.create(a, h.nA))
    in_ns(h.hB, lambda: tunnels.create(b, h.nB))
    return a, b



@pytest.mark.root
def test_tunnel_carries_traffic_over_the_hosts_underlay(hosts):
    a, _b = make_pair(hosts)
    link = links_of(hosts.nA)["eth3"]
    info = link.get_attr("IFLA_LINKINFO")
    data = info.get_attr("IFLA_INFO_DATA")
    assert info.get_attr("IFLA_INFO_KIND") == "vxlan"
    assert data.get_attr("IFLA_VXLAN_ID") == a.vni
    assert data.get_attr("IFLA_VXLAN_GROUP") == HOST_B and data.get_attr("IFLA_VXLAN_LOCAL") == HOST_A
    assert data.get_attr("IFLA_VXLAN_PORT") == tunnels.VXLAN_PORT
    assert data.get_attr("IFLA_VXLAN_LEARNING") == 0
    assert link.get_attr("IFLA_MTU") == 1500 and link.get_attr("IFLA_ADDRESS") == a.mac
    assert not link["flags"] & 1, "left down: the builder brings ports up"
    # its underlay is another namespace (hA), and nothing of it stayed in hA under any name
    assert link.get_attr("IFLA_LINK_NETNSID") is not None
    assert set(links_of(hosts.nA)) == {"lo", "eth3"}
    assert set(links_of(hosts.hA)) == {"lo", "u0"}

    bring_up(hosts.nA, "eth3", "10.99.0.1", 30)
    bring_up(hosts.nB, "eth3", "10.99.0.2", 30)
    done = run_in(hosts.nA, "ping", "-n", "-c", "3", "-i", "0.2", "-W", "1", "10.99.0.2")
    assert done.returncode == 0, done.stdout + done.stderr
    # the UDP socket of the VXLAN device lives in the host's namespace, not the node's
    assert VXLAN_PORT_HEX in udp_ports(hosts.hA)
    assert VXLAN_PORT_HEX not in udp_ports(hosts.nA)
    # a full 1500-byte frame, not fragmented, crosses the tunnel on the 9000-byte underlay
    big = run_in(hosts.nA, "ping", "-n", "-c", "2", "-i", "0.2", "-W", "1", "-M", "do", "-s", "1472", "10.99.0.2")
    assert big.returncode == 0, big.stdout + big.stderr

    # deleting the node's namespace takes the end with it: the host's VNI is free again
    netns.delete(hosts.nA)   # (the kernel frees a deleted namespace, and its devices, asynchronously)
    wait_for(lambda: VXLAN_PORT_HEX not in udp_ports(hosts.hA), timeout=30,
             what=f"the VXLAN socket (port {tunnels.VXLAN_PORT}) gone from {hosts.hA} with the node's namespace")
    again = hosts.namespace("n2")
    in_ns(hosts.hA, lambda: tunnels.create(a, again))
    assert "eth3" in links_of(again)


@pytest.mark.root
def test_deleting_the_host_namespace_takes_its_ends(hosts):
    make_pair(hosts)
    netns.delete(hosts.hA)   # (freed asynchronously, as above)
    wait_for(lambda: "eth3" not in links_of(hosts.nA), timeout=30,
             what=f"{hosts.nA}'s tunnel end eth3 gone with the host's namespace")
    assert "eth3" in links_of(hosts.nB)


@pytest.mark.root
def test_create_failures_roll_back_and_say_why(hosts):
    a = hosts.end("A")
    in_ns(hosts.hA, lambda: tunnels.create(a, hosts.nA))

    same_vni = replace(a, ifname="eth4", link=4)
    with pytest.raises(TunnelError) as caught:
        in_ns(hosts.hA, lambda: tunnels.create(same_vni, hosts.nA))
    text = str(caught.value)
    assert "EEXIST" in text and "link 4" in text and "node nA" in text and f"VNI {a.vni}" in text

    same_name = replace(a, vni=a.vni % (2**24 - 1) + 1)
    with pytest.raises(TunnelError, match=r"create the VXLAN device: EEXIST.*already has an interface eth3"):
        in_ns(hosts.hA, lambda: tunnels.create(same_name, hosts.nA))

    with pytest.raises(TunnelError, match=r"node nA .*no-such-ns.*open the node's namespace"):
        in_ns(hosts.hA, lambda: tunnels.create(same_name, f"{hosts.nA}-no-such-ns"))

    # nothing half-made anywhere: the first end alone
    assert set(links_of(hosts.nA)) == {"lo", "eth3"}
    assert set(links_of(hosts.hA)) == {"lo", "u0"}
    # and the rolled-back VNI is free (it was deleted, not just moved away)
    in_ns(hosts.hA, lambda: tunnels.create(replace(same_name, ifname="eth5"), hosts.nA))


@pytest.mark.root
def test_delete_is_idempotent_and_only_deletes_tunnels(hosts):
    make_pair(hosts)
    tunnels.delete(hosts.nA, "eth3")
    assert "eth3" not in links_of(hosts.nA)
    tunnels.delete(hosts.nA, "eth3")
    tunnels.delete(f"{hosts.nA}-no-such-ns", "eth3")
    with pytest.raises(TunnelError, match="not a tunnel end"):
        tunnels.delete(hosts.hA, "u0")
    assert "u0" in links_of(hosts.hA)


@pytest.mark.root
def test_underlay_mtu_and_round_trips(hosts):
    from pyroute2 import IPRoute

    assert in_ns(hosts.hA, lambda: tunnels.underlay_mtu(HOST_B)) == 9000
    assert tunnels.mtu_problem(1500, 9000, HOST_B) is None

    def shrink(mtu: int) -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="u0")[0], mtu=mtu)
    in_ns(hosts.hA, lambda: shrink(1500))
    small = in_ns(hosts.hA, lambda: tunnels.underlay_mtu(HOST_B))
    assert small == 1500
    assert "at least 1550" in tunnels.mtu_problem(1500, small, HOST_B)

    def route_mtu() -> None:   # a route's own mtu is lower than the device's: it wins
        with IPRoute() as ipr:
            ipr.route("add", dst=f"{HOST_B}/32", oif=ipr.link_lookup(ifname="u0")[0], metrics={"mtu": 1400})
    in_ns(hosts.hA, route_mtu)
    assert in_ns(hosts.hA, lambda: tunnels.underlay_mtu(HOST_B)) == 1400

    rtts = in_ns(hosts.hA, lambda: tunnels.measure_rtts(HOST_B, count=3))
    assert len(rtts) == 3 and all(0 < r < 0.1 for r in rtts)
    assert tunnels.underlay_one_way_s(rtts) == min(rtts) / 2
    # the node's namespace has no route to the underlay at all: ping fails at once
    with pytest.raises(TunnelError, match=f"{HOST_B} is unreachable"):
        in_ns(hosts.nA, lambda: tunnels.measure_rtts(HOST_B, count=1))
    with pytest.raises(TunnelError, match="no route"):
        in_ns(hosts.nA, lambda: tunnels.underlay_mtu(HOST_B))


IFA_F_TENTATIVE = 0x40   # linux/if_addr.h


@pytest.mark.root
def test_tunnel_over_an_ipv6_underlay(hosts):
    from pyroute2 import IPRoute

    def address(ip: str) -> None:
        netns.write_sysctls({"net/ipv6/conf/u0/accept_dad": "0"})   # usable at once, no DAD wait
        with IPRoute() as ipr:
            ipr.addr("add", index=ipr.link_lookup(ifname="u0")[0], address=ip, prefixlen=64)
    def usable(ip: str) -> bool:
        """The address is there and no longer tentative: with DAD off, an address stays tentative
        until the kernel has seen the veth's carrier come up, which it notes asynchronously (under a
        parallel suite's load, connect() then failed with EADDRNOTAVAIL, 2026-12-06)."""
        with IPRoute() as ipr:
            flags = [a.get_attr("IFA_FLAGS") or a["flags"] for a in ipr.get_addr(family=socket.AF_INET6)
                     if a.get_attr("IFA_ADDRESS") == ip]
        return bool(flags) and not flags[0] & IFA_F_TENTATIVE

    in_ns(hosts.hA, lambda: address(HOST_A6))
    in_ns(hosts.hB, lambda: address(HOST_B6))
    wait_for(lambda: in_ns(hosts.hA, lambda: usable(HOST_A6)) and in_ns(hosts.hB, lambda: usable(HOST_B6)),
             timeout=10, what="both IPv6 underlay addresses to leave the tentative state")
    assert in_ns(hosts.hA, lambda: tunnels.underlay_mtu(HOST_B6)) == 9000

    a, b = hosts.end("A", local=HOST_A6, remote=HOST_B6), hosts.end("B", local=HOST_B6, remote=HOST_A6)
    in_ns(hosts.hA, lambda: tunnels.create(a, hosts.nA))
    in_ns(hosts.hB, lambda: tunnels.create(b, hosts.nB))
    data = links_of(hosts.nA)["eth3"].get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_DATA")
    assert data.get_attr("IFLA_VXLAN_GROUP6") == HOST_B6
    bring_up(hosts.nA, "eth3", "10.99.0.1", 30)
    bring_up(hosts.nB, "eth3", "10.99.0.2", 30)
    done = run_in(hosts.nA, "ping", "-n", "-c", "2", "-i", "0.2", "-W", "1", "-M", "do", "-s", "1472", "10.99.0.2")
    assert done.returncode == 0, done.stdout + done.stderr
