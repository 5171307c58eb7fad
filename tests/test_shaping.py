"""Link shaping on the real kernel: HTB rates, loss, change(), and (under a stock kernel) netem.

Two namespaces joined by a veth (eth0 <-> eth0, 10.77.0.1 <-> 10.77.0.2);
shaping is applied to the egress of A's eth0 (traffic A -> B), measured with
iperf3 (TCP goodput, A sends) and ping (requests A -> B).

Expected goodput of a shaped TCP stream: HTB counts L2 bytes (14-byte Ethernet
header, per segment even for GSO frames); with MTU 1500 and TCP timestamps a
segment carries 1448 payload bytes in a 1514-byte frame, so goodput/rate =
1448/1514 = 0.956. Asserted within 5% of that.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import time

import pytest

import requires

from testbed.errors import CapabilityError
from testbed.net import capabilities as capmod
from testbed.net import shaping
import testbed.net.netns  # noqa: F401  shaping.change's modules, loaded here: their import is not a change's time
import testbed.net.rtnl  # noqa: F401
from testbed.topology.model import LinkProfile
from waiting import tcp_sockets, udp_sockets, wait_for

IS_ROOT = os.geteuid() == 0
root = pytest.mark.root
pytestmark = [pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")]

A_IP, B_IP = "10.77.0.1", "10.77.0.2"
GOODPUT_RATIO = 1448 / 1514


def caps():
    return capmod.probe(measure_floor=True)


def netem_only():
    return pytest.mark.skipif(not (IS_ROOT and caps().netem), reason="kernel has no sch_netem")


# -- a veth pair between two namespaces -----------------------------------------------

class Pair:
    def __init__(self, tag: str):
        from pyroute2 import IPRoute, netns

        self.a = f"tb-t{os.getpid()}{tag}-a"
        self.b = f"tb-t{os.getpid()}{tag}-b"
        self.procs: list[subprocess.Popen] = []
        netns.create(self.a)
        netns.create(self.b)
        self.ipr_a = IPRoute(netns=self.a)
        self.ipr_b = IPRoute(netns=self.b)
        self.ipr_a.link("add", ifname="eth0", kind="veth", peer={"ifname": "eth0", "net_ns_fd": self.b})
        for ipr, ip in ((self.ipr_a, A_IP), (self.ipr_b, B_IP)):
            idx = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=idx, address=ip, prefixlen=24)
            ipr.link("set", index=idx, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")

    def close(self) -> None:
        from pyroute2 import netns

        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for ipr in (self.ipr_a, self.ipr_b):
            ipr.close()
        for ns in (self.a, self.b):
            try:
                netns.remove(ns)
            except Exception:
                pass

    def ping(self, count: int, interval: float, size: int = 56, timeout: float = 60) -> tuple[list[float], int]:
        """RTTs (s) of the replies and the number sent."""
        r = subprocess.run(["ip", "netns", "exec", self.a, "ping", "-n", "-c", str(count), "-i", str(interval),
                            "-s", str(size), "-W", "1", B_IP], capture_output=True, text=True, timeout=timeout)
        rtts = [float(x) / 1e3 for x in re.findall(r"time=([0-9.]+) ms", r.stdout)]
        return rtts, count

    def iperf(self, seconds: float = 2, streams: int = 1, omit: int = 1) -> float:
        """TCP goodput A -> B in bit/s (receiver side)."""
        port = 5201
        srv = subprocess.Popen(["ip", "netns", "exec", self.b, "iperf3", "-s", "-1", "-B", B_IP, "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(srv)
        wait_for(lambda: srv.poll() is not None or tcp_sockets(srv.pid, port, "LISTEN", netns=self.b), timeout=30,
                 what="iperf3's server in B to listen")
        # one measurement: a client that fails (or a server that did not start) fails the test
        r = subprocess.run(["ip", "netns", "exec", self.a, "iperf3", "-c", B_IP, "-p", str(port), "-J",
                            "-t", str(seconds), "-O", str(omit), "-P", str(streams)],
                           capture_output=True, text=True, timeout=seconds + omit + 30)
        out = json.loads(r.stdout) if r.stdout.strip() else {}
        # (iperf3 -J exits 0 even when it could not connect: its JSON then says "error")
        assert r.returncode == 0 and "error" not in out and "end" in out, \
            f"iperf3 client failed (status {r.returncode}): {out.get('error')} {r.stderr.strip()[-500:]}"
        srv.wait(timeout=10)
        return float(out["end"]["sum_received"]["bits_per_second"])


@pytest.fixture
def pair(request):
    requires.need("iperf3")
    requires.need("ping")
    p = Pair(str(abs(hash(request.node.name)) % 10000))
    try:
        yield p
    finally:
        p.close()


def binomial_ok(k: int, n: int, p: float, z: float = 3.9) -> bool:
    """k successes in n trials is within z sigma (z=3.9: ~1e-4 false alarm) of probability p."""
    sd = math.sqrt(n * p * (1 - p))
    return abs(k - n * p) <= z * sd + 1


# -- pure checks (no kernel) -----------------------------------------------------------

class FakeCaps:
    def __init__(self, **kw):
        self.netem = kw.get("netem", False)
        self.htb = kw.get("htb", True)
        self.bpf = kw.get("bpf", True)
        self.tun = kw.get("tun", True)
        self.latency_floor_s = kw.get("floor", 20e-6)


@pytest.mark.parametrize("netem", [False, True])
def test_mechanisms_and_floor(netem):
    c = FakeCaps(netem=netem)
    p = LinkProfile(bandwidth_bps=10**9, delay_s=0.001, loss=0.01)
    m = shaping.mechanisms(p, c)
    assert "htb" in m
    assert ("netem" in m) == netem and ("delay-line" in m) == (not netem) and ("bpf-loss" in m) == (not netem)
    tiny = LinkProfile(delay_s=10e-6)
    assert shaping.below_floor(tiny, c) and not shaping.has_delay(tiny, c)
    assert not shaping.needs_delay_line(tiny, c)
    assert shaping.needs_delay_line(p, c) == (not netem)
    assert not shaping.needs_delay_line(LinkProfile(bandwidth_bps=10**9), c)
    # 50 us: netem holds it; the delay line would add ~100 us of its own, so it gets no element there
    mid = LinkProfile(delay_s=50e-6)
    assert shaping.has_delay(mid, c) == netem and shaping.below_floor(mid, c) == (not netem)
    assert shaping.delay_threshold(c) == pytest.approx(20e-6 if netem else 120e-6)


def test_check_supported_lists_every_problem_before_creating_anything():
    c = FakeCaps(netem=False, tun=False, bpf=False)
    profs = [("links[3] (edge0-0->agg0-0)", LinkProfile(jitter_s=0.001)),
             ("links[4] (agg0-0->core0)", LinkProfile(loss=0.01)),
             ("links[5] (a->b)", LinkProfile(bandwidth_bps=10**9))]
    with pytest.raises(CapabilityError) as ei:
        shaping.check_supported(profs, c)
    msg = str(ei.value)
    assert "links[3] (edge0-0->agg0-0): jitter 1ms needs sch_netem or the userspace delay line" in msg
    assert "(needs /dev/net/tun)" in msg
    assert "links[4] (agg0-0->core0): loss 1%" in msg
    assert "links[5]" not in msg
    shaping.check_supported(profs, FakeCaps(netem=True))
    shaping.check_supported(profs, FakeCaps(netem=False))


def test_plan_queue_and_burst():
    c = FakeCaps(netem=False)
    p = shaping.make_plan(LinkProfile(bandwidth_bps=10 * 10**9), c)
    assert p.burst == int(10 * 10**9 / 8 * 0.002) and p.fifo_bytes == 1250 * 1514 and p.netem is None
    q = shaping.make_plan(LinkProfile(bandwidth_bps=10**9, queue=50), c)
    assert q.fifo_bytes == 50 * 1514
    # 2.5 ms at 1 Gbit/s: 209 packets, not Linux's 1000 (docs/fidelity.md)
    assert shaping.make_plan(LinkProfile(bandwidth_bps=10**9), c).fifo_bytes == 209 * 1514
    # a fifo smaller than one 64 KiB GSO frame would refuse every such frame: it holds one at least
    assert shaping.make_plan(LinkProfile(bandwidth_bps=10**9, queue=20), c).fifo_bytes == shaping.GSO_MAX + 1514
    n = shaping.make_plan(LinkProfile(bandwidth_bps=10**9, delay_s=0.05, jitter_s=0.01), FakeCaps(netem=True))
    # 1.5 x BDP over the 120 ms round trip at 1 Gbit/s = 15000 packets queue, + 5000 in flight
    assert n.netem["limit"] == 15000 + 5000 and n.netem["rate"] == shaping.NETEM_MAX_RATE
    assert n.netem["delay"] == 50000 and n.netem["jitter"] == 10000 and n.fifo_bytes is None


def test_loss_program_shape():
    from testbed.net.lossfilter import loss_program

    code = loss_program(0.25)
    assert len(code) == 7 * 8
    assert loss_program(1.0) != code


# -- the kernel ------------------------------------------------------------------------

# Bands of the kernel checks below, from 5 runs each on the 2-core machine (2026-12-02, other
# engineers' jobs running beside; `python tests/timing_bands.py`), one measurement per test (no
# second try): iperf3 goodput over rate x GOODPUT_RATIO 0.9968-0.9994 at 100 Mbit/s, 0.9956-0.9997
# at 1 Gbit/s, 0.9721-0.9968 at 5 Gbit/s (the CPU starts to show), 0.9947-0.9996 at 500 Mbit/s over
# 1 s. shaping.change, one batch of requests since 2026-12-08 (20 runs, 10 of them with both CPUs
# busy, as test_change_in_place_and_clear times it): of a rate 0.8-2.8 ms; the median of five
# re-layouts (loss added and taken off) 0.7-2.7 ms, the first of them 10-25 ms (just after iperf3).
HTB_TOLERANCE = {100 * 10**6: 0.02, 10**9: 0.02, 5 * 10**9: 0.05}   # each at least 1.8x the widest miss
CHANGE_WITHIN_S = 0.012                                             # 4x the slowest change measured
RELAYOUT_WITHIN_S = 0.011                                           # 4x the slowest median measured


@pytest.mark.timing
@root
@pytest.mark.parametrize("rate", [100 * 10**6, 10**9, 5 * 10**9])
def test_htb_rate(pair, rate):
    assert caps().htb, "no sch_htb: every kernel this runs on has it (DESIGN.md)"
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(bandwidth_bps=rate), caps())
    d = shaping.describe(pair.ipr_a, "eth0")
    assert [q["kind"] for q in d["qdiscs"] if q["parent"] == "root"] == ["htb"]
    expect = rate * GOODPUT_RATIO
    got = pair.iperf(seconds=2)
    tol = HTB_TOLERANCE[rate]
    assert abs(got - expect) <= tol * expect, f"{got / 1e6:.1f} Mbit/s at HTB {rate / 1e6:g} (expected {expect / 1e6:.1f})"


@pytest.mark.timing
@root
@pytest.mark.parametrize("loss", [0.01, 0.10])
def test_loss(pair, loss):
    c = caps()
    assert c.can_lose, "neither netem nor cls_bpf: loss cannot be emulated on this kernel"
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(loss=loss), c)
    pair.ping(3, 0.01)  # ARP
    n = 3000
    rtts, sent = pair.ping(n, 0.0002, timeout=60)
    lost = sent - len(rtts)
    assert binomial_ok(lost, sent, loss), f"lost {lost}/{sent} at loss {loss}"


def _our_qdiscs(pair) -> dict[str, dict]:
    """The HTB and netem qdiscs on A's eth0 by kind: handle, parent and counters."""
    return {q["kind"]: q for q in shaping.describe(pair.ipr_a, "eth0")["qdiscs"] if q["kind"] in ("htb", "netem")}


def _assert_changed_in_place(before: dict[str, dict], after: dict[str, dict]) -> None:
    """The same qdiscs, their counters kept: changed, not deleted and added again (a reinstall starts
    from zero and drops the packets the link holds)."""
    assert after.keys() == before.keys(), f"{sorted(before)} became {sorted(after)}"
    for kind, q in before.items():
        assert (after[kind]["handle"], after[kind]["parent"]) == (q["handle"], q["parent"]), (kind, q, after[kind])
        assert after[kind]["packets"] >= q["packets"] > 0, f"{kind}'s counters reset: {q} -> {after[kind]}"


@pytest.mark.timing
@root
def test_change_in_place_and_clear(pair):
    c = caps()
    old = LinkProfile(bandwidth_bps=100 * 10**6)
    new = LinkProfile(bandwidth_bps=500 * 10**6)
    shaping.apply(pair.ipr_a, "eth0", old, c)
    pair.ping(3, 0.01)   # packets through the old rate: counters that a reinstall would reset
    before = _our_qdiscs(pair)
    t0 = time.perf_counter()
    shaping.change(pair.ipr_a, "eth0", old, new, c)
    took = time.perf_counter() - t0
    assert took < CHANGE_WITHIN_S, f"change took {took * 1e3:.1f} ms"
    _assert_changed_in_place(before, _our_qdiscs(pair))
    rates = [cl.get("rate_bps") for cl in shaping.describe(pair.ipr_a, "eth0")["classes"]]
    assert 500 * 10**6 in rates
    got = pair.iperf(seconds=1)
    assert abs(got - 500e6 * GOODPUT_RATIO) <= 0.02 * 500e6 * GOODPUT_RATIO, f"{got / 1e6:.1f} Mbit/s"
    # a change of layout (adding loss, and taking it off) reinstalls, still fast: the median of five
    # (the first Python work after this process sat blocked for iperf3's second runs 10-20x slower
    # for some milliseconds on this VM, whatever the code: docs/HACKING.md, `timing`)
    lossy = new.with_changes(loss=0.5)
    took = []
    for a, b in ((new, lossy), (lossy, new), (new, lossy), (lossy, new), (new, lossy)):
        t0 = time.perf_counter()
        shaping.change(pair.ipr_a, "eth0", a, b, c)
        took.append(time.perf_counter() - t0)
    assert statistics.median(took) < RELAYOUT_WITHIN_S, f"re-layouts took {[round(t * 1e3, 1) for t in took]} ms"
    pair.ping(3, 0.01)
    rtts, sent = pair.ping(400, 0.001)
    assert binomial_ok(sent - len(rtts), sent, 0.5)
    shaping.clear(pair.ipr_a, "eth0")
    d = shaping.describe(pair.ipr_a, "eth0")
    assert not [q for q in d["qdiscs"] if q["kind"] in ("htb", "clsact", "netem", "bfifo")]
    rtts, sent = pair.ping(200, 0.001)
    assert len(rtts) == sent


@root
def test_queue_limit_without_netem(pair):
    c = caps()
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(bandwidth_bps=10**9, queue=64), c)
    leaf = [q for q in shaping.describe(pair.ipr_a, "eth0")["qdiscs"] if q["handle"] == "10:0"]
    assert leaf and leaf[0]["kind"] == ("netem" if c.netem else "bfifo")


# -- netem (a stock kernel; `make test-kernel` runs these in a VM) ------------------------

@pytest.mark.timing
@root
@pytest.mark.netem
@netem_only()
@pytest.mark.parametrize("delay", [0.001, 0.010, 0.050])
def test_netem_delay(pair, delay):
    base = statistics.median(pair.ping(10, 0.01)[0])
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(delay_s=delay), caps())
    rtts, _ = pair.ping(20, 0.01)
    med = statistics.median(rtts)
    # one direction delayed: RTT = delay + baseline. Below, netem never releases early (0.98: clock
    # slack). Above: under TCG (make test-kernel, the only place CI has netem) timers fire 6-12 ms
    # late on an idle host (docs/testing-kernel.md), so the median may be 12 ms over there and this
    # band cannot tell 1 ms from 10 ms in the VM; on a kernel run natively, 5% + 1 ms. (Not yet
    # measured natively with netem on this kind of machine: its kernel has no sch_netem.)
    slack = 0.012 if os.environ.get("TESTBED_IN_KERNEL_VM") == "1" else 0.001
    assert delay * 0.98 <= med <= delay * 1.05 + base + slack, f"median RTT {med * 1e3:.2f} ms at {delay * 1e3} ms"


@pytest.mark.timing
@root
@pytest.mark.netem
@netem_only()
def test_netem_jitter_keeps_order(pair):
    """Jitter 5 ms on 10 ms, 2000 UDP datagrams at 10 kpps: netem keeps them in order.

    netem itself keeps FIFO order here (its `rate`); plain jitter would swap roughly half
    of the neighbours at this spacing (5 ms jitter, 0.1 ms apart). A handful of swaps can
    still come from the receive side: the veth peer queues each packet on the backlog of
    the CPU that dequeued it, and with 2 CPUs two neighbours can be delivered crosswise
    (seen under TCG: 8 of 2000). So: at most 1%, against ~50% without the fix."""
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(delay_s=0.010, jitter_s=0.005), caps())
    d = shaping.describe(pair.ipr_a, "eth0")
    assert any(q["kind"] == "netem" for q in d["qdiscs"])
    script = r"""
import socket, struct, sys, time
role = sys.argv[1]
if role == "rx":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("10.77.0.2", 9999))
    seq = []
    s.settimeout(60)   # the sender is yet to start: its Python takes seconds under TCG
    try:
        while True:
            seq.append(struct.unpack("!I", s.recv(64)[:4])[0])
            s.settimeout(2)   # then: 2 s without a datagram ends the stream
    except socket.timeout:
        pass
    inv = sum(1 for a, b in zip(seq, seq[1:]) if b < a)
    print(len(seq), inv)
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(2000):
        s.sendto(struct.pack("!I", i), ("10.77.0.2", 9999)); time.sleep(0.0001)   # pacing, not a wait
"""
    import sys
    rx = subprocess.Popen(["ip", "netns", "exec", pair.b, sys.executable, "-c", script, "rx"],
                          stdout=subprocess.PIPE, text=True)
    pair.procs.append(rx)
    wait_for(lambda: rx.poll() is not None or udp_sockets(rx.pid, 9999, netns=pair.b), timeout=30,
             what="the receiver's socket in B")
    subprocess.run(["ip", "netns", "exec", pair.a, sys.executable, "-c", script, "tx"], check=True, timeout=60)
    out, _ = rx.communicate(timeout=90)   # its 60 s wait for a first datagram, then 2 s
    got, inversions = map(int, out.split())
    assert got >= 1900 and inversions <= got // 100, f"received {got}, {inversions} reordered"
    rtts, _ = pair.ping(50, 0.01)
    assert max(rtts) - min(rtts) > 0.003  # the jitter is there


@root
@pytest.mark.netem
@netem_only()
@pytest.mark.parametrize("loss", [0.01, 0.10])
def test_netem_loss(pair, loss):
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(loss=loss), caps())
    assert "netem" in shaping.mechanisms(LinkProfile(loss=loss), caps())
    pair.ping(3, 0.01)
    rtts, sent = pair.ping(2000, 0.0005)
    assert binomial_ok(sent - len(rtts), sent, loss)


@root
@pytest.mark.netem
@netem_only()
def test_netem_bdp_queue_limit(pair):
    prof = LinkProfile(bandwidth_bps=10**9, delay_s=0.02)
    shaping.apply(pair.ipr_a, "eth0", prof, caps())
    leaf = [q for q in shaping.describe(pair.ipr_a, "eth0")["qdiscs"] if q["kind"] == "netem"]
    assert leaf and leaf[0]["limit"] == prof.queue_packets() + shaping.in_flight_packets(prof)
    assert leaf[0]["limit"] >= 1.5 * 10**9 * 0.02 / (1500 * 8)
    shaping.apply(pair.ipr_a, "eth0", prof.with_changes(queue=100), caps())
    leaf = [q for q in shaping.describe(pair.ipr_a, "eth0")["qdiscs"] if q["kind"] == "netem"]
    assert leaf[0]["limit"] == 100 + shaping.in_flight_packets(prof)


@pytest.mark.timing
@root
@pytest.mark.netem
@netem_only()
def test_netem_htb_together(pair):
    prof = LinkProfile(bandwidth_bps=20 * 10**6, delay_s=0.005)   # low: the VM runs under TCG
    shaping.apply(pair.ipr_a, "eth0", prof, caps())
    kinds = {q["kind"]: q for q in shaping.describe(pair.ipr_a, "eth0")["qdiscs"]}
    assert kinds["htb"]["parent"] == "root" and kinds["netem"]["parent"] == "1:1"
    rtts, _ = pair.ping(10, 0.01)
    assert statistics.median(rtts) >= 0.005 * 0.98
    got = pair.iperf(seconds=3)
    expect = 20e6 * GOODPUT_RATIO
    assert abs(got - expect) <= 0.08 * expect, f"{got / 1e6:.1f} Mbit/s"


@pytest.mark.timing
@root
@pytest.mark.netem
@netem_only()
def test_netem_runtime_change(pair):
    """A running link's delay changed by shaping.change: in place (the same qdiscs, counters kept)
    and in effect when the call returns (every ping sent afterwards is held the new delay).

    Not bounded here: how long the call takes. It was (< 0.1 s), and that measured the Python work
    of three netlink requests, not the kernel's change: 37-200 ms, median 69 ms, in 15 changes in
    the stock-kernel VM (2026-12-02, `make test-kernel`, host load 4-5), of which the link dump that
    finds eth0's index took 8-64 ms, the HTB class change (pyroute2 computes its two 256-entry rate
    tables in Python) 20-103 ms, the netem change 8-48 ms, and the guest's user CPU time was the
    wall time (system time 0-30 ms, at 10 ms ticks): an interpreter emulated by TCG, on a host
    shared with other work. The same in-place path (the HTB class changed, nothing removed; without
    the netem leaf this machine's kernel lacks) is timed where the time is the code's, on this
    machine's own kernel, by test_change_in_place_and_clear (CHANGE_WITHIN_S)."""
    c = caps()
    old = LinkProfile(bandwidth_bps=10**9, delay_s=0.005)
    new = LinkProfile(bandwidth_bps=10**9, delay_s=0.030, loss=0.0)
    shaping.apply(pair.ipr_a, "eth0", old, c)
    pair.ping(3, 0.01)   # packets through the old shaping: counters that a reinstall would reset
    before = _our_qdiscs(pair)
    shaping.change(pair.ipr_a, "eth0", old, new, c)
    _assert_changed_in_place(before, _our_qdiscs(pair))
    # netem holds each packet at least its delay (0.98: clock slack), so the smallest RTT, not the
    # median, says that the first packet sent after the call already had the new delay
    rtts, _ = pair.ping(10, 0.01)
    assert rtts and min(rtts) >= 0.030 * 0.98, f"RTTs {[round(r * 1e3, 2) for r in rtts]} ms after 5 -> 30 ms"
    # no bandwidth, root netem: change in place as well (jitter 2 ms: no packet held under 18 ms)
    a, b = LinkProfile(delay_s=0.002), LinkProfile(delay_s=0.020, jitter_s=0.002)
    shaping.apply(pair.ipr_a, "eth0", a, c)
    pair.ping(3, 0.01)
    before = _our_qdiscs(pair)
    shaping.change(pair.ipr_a, "eth0", a, b, c)
    _assert_changed_in_place(before, _our_qdiscs(pair))
    rtts, _ = pair.ping(10, 0.01)
    assert rtts and min(rtts) >= 0.018 * 0.98, f"RTTs {[round(r * 1e3, 2) for r in rtts]} ms after 2 -> 20±2 ms"


@root
def test_a_reinstall_removes_what_is_there_not_what_the_state_says(pair):
    """shaping.change's reinstall deletes the root qdisc and the loss filter whatever `old` claims: a
    state that drifted from the kernel (a change that failed half-way, a job with net_admin) still
    ends with the new shaping alone."""
    c = caps()
    if not c.can_lose:
        pytest.skip("neither netem nor cls_bpf: no loss to leave behind")
    shaping.apply(pair.ipr_a, "eth0", LinkProfile(bandwidth_bps=100 * 10**6, loss=0.5), c)
    pair.ping(3, 0.01)
    # the state claims nothing was installed; the new layout differs, so this reinstalls
    shaping.change(pair.ipr_a, "eth0", LinkProfile(), LinkProfile(bandwidth_bps=200 * 10**6), c)
    d = shaping.describe(pair.ipr_a, "eth0")
    assert not [q for q in d["qdiscs"] if q["kind"] in ("clsact", "netem")], d["qdiscs"]
    assert 200 * 10**6 in [cl.get("rate_bps") for cl in d["classes"]]
    rtts, sent = pair.ping(200, 0.001)
    assert len(rtts) == sent
