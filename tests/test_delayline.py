"""The userspace delay line (TAP pair + helper process) on the real kernel.

Two namespaces joined by a delay line (TAP eth0 in each), addressed like a
veth pair. Expected RTT = delay_ab + delay_ba (+ the unshaped baseline and the
helper's per-frame cost, tens of microseconds), asserted within 10%.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import pytest

from testbed.net import capabilities as capmod
from testbed.net import delayline, shaping
from testbed.topology.model import LinkProfile

IS_ROOT = os.geteuid() == 0
pytestmark = [pytest.mark.root, pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, TAP)")]

A_IP, B_IP = "10.78.0.1", "10.78.0.2"
BASELINE = 0.0005  # allowance for the unshaped path + the helper (measured ~60-150 us RTT)


class DelayPair:
    def __init__(self, tag: str, ab: LinkProfile, ba: LinkProfile):
        from pyroute2 import IPRoute, netns

        self.a = f"tb-d{os.getpid()}{tag}-a"
        self.b = f"tb-d{os.getpid()}{tag}-b"
        self.state = tempfile.mkdtemp(prefix="tbdl-")
        self.procs: list[subprocess.Popen] = []
        self.link = None
        netns.create(self.a)
        netns.create(self.b)
        self.link = delayline.start_delay_link("t", "0", self.a, "eth0", self.b, "eth0", ab, ba, 1500, self.state)
        self.ipr_a = IPRoute(netns=self.a)
        self.ipr_b = IPRoute(netns=self.b)
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
        if self.link is not None:
            delayline.stop(self.link)
        for ipr in (getattr(self, "ipr_a", None), getattr(self, "ipr_b", None)):
            if ipr is not None:
                ipr.close()
        for ns in (self.a, self.b):
            try:
                netns.remove(ns)
            except Exception:
                pass
        shutil.rmtree(self.state, ignore_errors=True)

    def ping(self, count: int = 20, interval: float = 0.01) -> list[float]:
        # resolve ARP first: pings sent while ARP crosses the delayed link wait for it
        subprocess.run(["ip", "netns", "exec", self.a, "ping", "-n", "-c", "1", "-W", "2", B_IP],
                       capture_output=True, timeout=10)
        r = subprocess.run(["ip", "netns", "exec", self.a, "ping", "-n", "-c", str(count), "-i", str(interval),
                            "-W", "2", B_IP], capture_output=True, text=True, timeout=60)
        return [float(x) / 1e3 for x in re.findall(r"time=([0-9.]+) ms", r.stdout)]

    def iperf(self, seconds: int = 2, omit: int = 1) -> float:
        srv = subprocess.Popen(["ip", "netns", "exec", self.b, "iperf3", "-s", "-1", "-B", B_IP],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(srv)
        out = None
        for _ in range(50):
            r = subprocess.run(["ip", "netns", "exec", self.a, "iperf3", "-c", B_IP, "-J", "-t", str(seconds),
                                "-O", str(omit)], capture_output=True, text=True, timeout=seconds + omit + 30)
            if r.returncode == 0 and r.stdout.strip():
                res = json.loads(r.stdout)
                if "error" not in res:
                    out = res
                    break
            time.sleep(0.05)
        srv.wait(timeout=10)
        assert out is not None
        return float(out["end"]["sum_received"]["bits_per_second"])


def retry(fn, ok, tries: int = 3):
    """Measure again when a timing check fails: the upper bounds suffer when the 2-core box is busy
    (lower bounds are physics and never get a retry's benefit, since every attempt must be slower)."""
    val = fn()
    for _ in range(tries - 1):
        if ok(val):
            break
        val = fn()
    return val


def _need():
    if not capmod.probe().tun:
        pytest.skip("no /dev/net/tun")
    if not shutil.which("ping"):
        pytest.skip("ping not installed")


@pytest.fixture
def make_pair(request):
    made = []

    def make(ab: LinkProfile, ba: LinkProfile | None = None) -> DelayPair:
        _need()
        p = DelayPair(str(len(made)) + str(abs(hash(request.node.name)) % 1000), ab, ba or ab)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


@pytest.mark.parametrize("delay", [0.001, 0.010, 0.050])
def test_delay_rtt(make_pair, delay):
    p = make_pair(LinkProfile(delay_s=delay))
    want = 2 * delay
    med = retry(lambda: statistics.median(p.ping(20 if delay < 0.05 else 10, 0.01)),
                lambda m: m <= want * 1.10 + BASELINE)
    assert want * 0.98 <= med <= want * 1.10 + BASELINE, f"median RTT {med * 1e3:.3f} ms, want {want * 1e3} ms"


def test_asymmetric_and_update(make_pair):
    p = make_pair(LinkProfile(delay_s=0.002), LinkProfile(delay_s=0.008))
    med = retry(lambda: statistics.median(p.ping(10)), lambda m: m <= 0.010 * 1.1 + BASELINE)
    assert 0.010 * 0.98 <= med <= 0.010 * 1.1 + BASELINE
    t0 = time.perf_counter()
    delayline.update(p.link, LinkProfile(delay_s=0.020), LinkProfile(delay_s=0.005))
    assert time.perf_counter() - t0 < 0.1
    med = retry(lambda: statistics.median(p.ping(10)), lambda m: m <= 0.025 * 1.1 + BASELINE)
    assert 0.025 * 0.98 <= med <= 0.025 * 1.1 + BASELINE
    st = delayline.stats(p.link)
    assert st["ab"]["delay_s"] == 0.020 and st["ab"]["frames"] > 0 and st["ba"]["frames"] > 0
    # how late held frames left (the verdict reads it): every frame counted, p99 well under the delay
    for d in ("ab", "ba"):
        hist = st[d]["late_hist_us_log2"]
        assert sum(hist) == st[d]["frames"]
        assert delayline.lateness_percentile(hist, 99) < 0.002


def test_jitter_keeps_order_and_spreads(make_pair):
    p = make_pair(LinkProfile(delay_s=0.005, jitter_s=0.002), LinkProfile())
    r = subprocess.run(["ip", "netns", "exec", p.a, "ping", "-n", "-c", "1", "-W", "2", B_IP], capture_output=True)
    r = subprocess.run(["ip", "netns", "exec", p.a, "ping", "-n", "-c", "100", "-i", "0.002", "-W", "2", B_IP],
                       capture_output=True, text=True, timeout=60)
    seqs = [int(x) for x in re.findall(r"icmp_seq=(\d+)", r.stdout)]
    rtts = [float(x) / 1e3 for x in re.findall(r"time=([0-9.]+) ms", r.stdout)]
    assert len(rtts) == 100
    assert seqs == sorted(seqs), "the delay line reordered frames"
    assert 0.003 * 0.98 <= min(rtts)
    assert 0.003 <= statistics.median(rtts) <= 0.007 * 1.1 + BASELINE
    assert statistics.pstdev(rtts) > 0.0003


def test_throughput_and_htb_on_tap(make_pair):
    c = capmod.probe()
    p = make_pair(LinkProfile(delay_s=0.001))
    got = retry(lambda: p.iperf(seconds=2), lambda g: g > 2e9, tries=2)
    assert got > 2e9, f"{got / 1e9:.2f} Gbit/s through the delay line"
    # bandwidth on the TAP's egress (before the delay), like on a veth
    shaping.apply(p.ipr_a, "eth0", LinkProfile(bandwidth_bps=10**9, delay_s=0.001), c)
    expect = 10**9 * 1448 / 1514
    got = retry(lambda: p.iperf(seconds=2), lambda g: abs(g - expect) <= 0.05 * expect, tries=2)
    assert abs(got - expect) <= 0.05 * expect, f"{got / 1e6:.0f} Mbit/s at HTB 1 Gbit/s + 1 ms"


def test_stop_removes_taps_and_files(make_pair):
    p = make_pair(LinkProfile(delay_s=0.001))
    link = p.link
    assert os.path.exists(link.pid_file) and os.path.exists(link.control)
    assert delayline.stop(link)
    p.link = None
    assert not os.path.exists(f"/proc/{link.pid}") or open(f"/proc/{link.pid}/stat").read().split()[2] == "Z"
    assert not p.ipr_a.link_lookup(ifname="eth0")
    assert not os.path.exists(link.pid_file) and not os.path.exists(link.control)
    # a PID that now names another process (here: this test's own, with another start time) is
    # never signalled: stopping it is a no-op, and we are still here to check
    from testbed import procs

    me = os.getpid()
    assert delayline.stop(procs.ProcRef(me, procs.start_ticks(me) + 1))
    assert procs.alive(procs.ref(me))
