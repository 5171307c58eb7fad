"""The data plane on the real kernel: reachability, ECMP, failover. Marked root."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed import lifecycle
from testbed.status import status as status_document
from testbed import node_exec
from testbed.topology.loader import load_topology, load_topology_text
from waiting import WaitTimeout, wait_for

pytestmark = pytest.mark.root


def run_in(st: dict, node: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(node_exec.exec_argv(st, node, list(argv)), capture_output=True, text=True,
                          timeout=timeout)


def worker_ips(st: dict) -> dict[str, str]:
    out = {}
    for lp in st["plan"]["links"]:
        for side in ("a", "b"):
            p = lp[side]
            if p.get("address") and lp["kind"] == "access" and p["node"] not in out:
                out[p["node"]] = p["address"].split("/")[0]
    return out


def all_pairs_reachable(st: dict) -> None:
    """Every worker pings every other worker (ping -c1 through exec); one ping per pair."""
    ips = worker_ips(st)
    failures = []
    for src in ips:
        # one shell per source: a ping for each destination, in parallel
        script = " ".join(f"(ping -c1 -W2 {ip} >/dev/null 2>&1 || echo FAIL {dst}) &"
                          for dst, ip in ips.items() if dst != src) + " wait"
        r = run_in(st, src, "sh", "-c", script, timeout=60)
        failures += [f"{src}->{line.split()[1]}" for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert not failures, f"unreachable pairs: {failures}"


def test_fat_tree_k4_all_pairs(testbed):
    st = testbed(load_topology("fat-tree"))
    assert len(worker_ips(st)) == 16
    all_pairs_reachable(st)
    # switches route, workers do not forward; workers have only lo + their emulated interfaces
    r = run_in(st, "w0", "ip", "-o", "link")
    names_ = sorted(line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines())
    assert names_ == ["eth0", "lo"]
    assert run_in(st, "w0", "cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "0"
    assert run_in(st, "agg0-0", "cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "1"
    assert run_in(st, "agg0-0", "cat", "/proc/sys/net/ipv4/fib_multipath_hash_policy").stdout.strip() == "1"


def test_leaf_spine_all_pairs(testbed):
    st = testbed(load_topology("leaf-spine"))
    all_pairs_reachable(st)


def test_explicit_topology_all_pairs(testbed):
    st = testbed(load_topology("two-racks"))
    all_pairs_reachable(st)


def test_explicit_with_direct_link(testbed):
    text = """
name: mixed
nodes: {a: {kind: worker}, b: {kind: worker}, c: {kind: worker}, s: {kind: switch}}
links:
  - endpoints: [a, s]
  - endpoints: [b, s]
  - endpoints: [c, a]
"""
    st = testbed(load_topology_text(text))
    all_pairs_reachable({**st, "plan": {**st["plan"], "links": [lp for lp in st["plan"]["links"]
                                                                 if lp["kind"] == "access"]}})
    c_addr = next(lp["b"]["address"] for lp in st["plan"]["links"] if lp["kind"] == "direct")
    assert run_in(st, "a", "ping", "-c1", "-W2", c_addr.split("/")[0]).returncode == 0


def _tx_packets(st: dict, node: str) -> dict[str, int]:
    r = run_in(st, node, "cat", "/proc/net/dev")
    out = {}
    for line in r.stdout.splitlines()[2:]:
        name, data = line.split(":", 1)
        out[name.strip()] = int(data.split()[9])  # tx packets
    return out


def test_ecmp_spreads_over_cores(testbed):
    """Several UDP flows (distinct ports) from pod 0 to pod 3 cross more than one core switch."""
    st = testbed(load_topology("fat-tree"))
    ips = worker_ips(st)
    dst = ips["w15"]
    cores = ["core0", "core1", "core2", "core3"]
    before = {c: sum(_tx_packets(st, c).values()) for c in cores}
    # 32 UDP flows (source ports 20001..20032), 20 packets each, from one process
    code = ("import socket\n"
            "for p in range(20001, 20033):\n"
            "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('', p))\n"
            "    [s.sendto(b'x' * 100, (%r, 9999)) for _ in range(20)]\n"
            "    s.close()\n" % dst)
    r = run_in(st, "w0", sys.executable, "-S", "-c", code, timeout=120)
    assert r.returncode == 0, r.stderr
    after = {c: sum(_tx_packets(st, c).values()) for c in cores}
    used = [c for c in cores if after[c] - before[c] >= 20]
    assert len(used) >= 2, f"flows crossed only {used}: {after} vs {before}"


def _set_link(st: dict, node: str, ifname: str, state_: str) -> None:
    r = run_in(st, node, "ip", "link", "set", ifname, state_)
    assert r.returncode == 0, r.stderr


def _rx_packets(st: dict, node: str, ifname: str) -> int:
    r = run_in(st, node, "cat", "/proc/net/dev")
    for line in r.stdout.splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() == ifname:
            return int(data.split()[1])
    raise KeyError(ifname)


def _udp_flows(dst: str, flows: int = 32, packets: int = 20) -> str:
    # paced (0.5 ms between datagrams: the sleep is the pacing, not a wait), so that every datagram
    # can arrive and a loss means a dead path, not a full socket buffer
    return ("import socket, time\n"
            f"for p in range(21001, 21001 + {flows}):\n"
            "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('', p))\n"
            f"    for _ in range({packets}): s.sendto(b'x' * 100, ({dst!r}, 9999)); time.sleep(0.0005)\n"
            "    s.close()\n")


def test_failover_agg_core_link_down(testbed):
    """A downed agg-core link leaves cross-pod traffic flowing: the agg's ECMP route drops the dead next
    hop (ignore_routes_with_linkdown; no control plane) and every flow from the pod still arrives.

    Only the direction whose failure is local is checked: with static routes a core has exactly one
    way down into each pod, so flows from other pods hashed onto that core are lost until routes change.
    """
    st = testbed(load_topology("fat-tree"))
    ips = worker_ips(st)
    victims = [link for link in st["links"] if link["tier"] == "agg-core" and link["endpoints"][0] == "agg0-0"]
    link = victims[0]
    dead = link["ifnames"][0]
    _set_link(st, "agg0-0", dead, "down")
    lifecycle.set_link_state(st["name"], link["index"], "down")

    def route_avoids_the_dead_port() -> str | None:
        r = run_in(st, "agg0-0", "ip", "route", "get", ips["w15"])
        return r.stdout if r.returncode == 0 and f" dev {dead} " not in f" {r.stdout} " else None

    wait_for(route_avoids_the_dead_port, timeout=10, what=f"agg0-0's route to w15 to leave by a port other than {dead}")
    for src, dst in (("w0", "w15"), ("w1", "w8"), ("w2", "w5")):
        before = _rx_packets(st, dst, "eth0")
        r = run_in(st, src, sys.executable, "-S", "-c", _udp_flows(ips[dst]), timeout=120)
        assert r.returncode == 0, r.stderr
        seen = [0]

        def all_arrived() -> bool:   # the sender has returned; the last packets are still on their way
            seen[0] = _rx_packets(st, dst, "eth0") - before
            return seen[0] >= 32 * 20

        try:
            wait_for(all_arrived, timeout=10, what=f"{src}->{dst}: 640 packets at {dst}")
        except WaitTimeout:
            raise AssertionError(f"{src}->{dst}: {seen[0]} of 640 packets arrived with {link['endpoints']} down") \
                from None
    doc = status_document(st["name"])
    assert doc["links"][link["index"]]["state"] == "down"
    _set_link(st, "agg0-0", link["ifnames"][0], "up")


def test_a_dilated_workers_tcp_sizes_its_bursts_on_the_undilated_round_trip(testbed):
    """Under dilation s a worker's tcp_tso_rtt_log is the kernel's 9 + log2(s) (TCP's 64 KiB burst bonus
    then goes by the round trip the topology asks for, not the dilated one); a switch's is left alone,
    and so is every namespace of an undilated testbed."""
    from testbed import names
    from testbed.net import builder, netns

    if not builder.tcp_sysctls(2.0):
        pytest.skip("this kernel has no net.ipv4.tcp_tso_rtt_log (Linux 5.18+): TCP's bursts are not adjusted")

    def rtt_log(st: dict, node: str) -> int:
        with netns.enter(names.netns(st["name"], node)):
            return int(netns.read_sysctl(builder.TSO_RTT_LOG))

    text = "name: d\ngenerator: star\nparams: {n: 2}\ntiers:\n  host: {bandwidth: 10gbit, delay: 2us}\n"
    st = testbed(load_topology_text(text), time_dilation=16)
    assert st["time_dilation"] == 16
    assert [rtt_log(st, n) for n in ("w0", "w1", "s0")] == [13, 13, 9]
    plain = testbed(load_topology_text(text), time_dilation="none")
    assert [rtt_log(plain, n) for n in ("w0", "w1", "s0")] == [9, 9, 9]


@pytest.mark.parametrize("s, log", [(1.0, None), (1.4, 9), (2.0, 10), (40.0, 14), (49.2, 15), (3144.1, 21)])
def test_tcp_sysctls_raise_the_rtt_log_by_log2_of_s(s, log):
    from testbed.net import builder

    got = builder.tcp_sysctls(s)
    if log is not None and not got:
        pytest.skip("this kernel has no net.ipv4.tcp_tso_rtt_log (Linux 5.18+)")
    assert got == ({} if log is None else {builder.TSO_RTT_LOG: str(log)})
