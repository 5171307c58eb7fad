"""The userspace delay line (TAP pairs served by delay-line engines) on the real kernel.

Two namespaces joined by a delay line (TAP eth0 in each), addressed like a
veth pair. Expected RTT = delay_ab + delay_ba (+ the unshaped baseline and the
engine's per-frame cost, tens of microseconds), asserted within 10%. Then the
engine itself: many lines in one process, descriptors above 1,023, teardown.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import requires
from waiting import tcp_sockets, wait_for

from testbed import procs
from testbed.net import capabilities as capmod
from testbed.net import delayline, shaping
from testbed.report import verdict
from testbed.topology.model import LinkProfile

IS_ROOT = os.geteuid() == 0
pytestmark = [pytest.mark.root, pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, TAP)")]

A_IP, B_IP = "10.78.0.1", "10.78.0.2"
BASELINE = 0.0005  # allowance for the unshaped path + the engine (measured ~60-150 us RTT)


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
        # the client starts once the server listens (was: up to 50 tries, 0.05 s apart); `ip netns
        # exec` execs iperf3, so the server's PID is the one read
        wait_for(lambda: srv.poll() is not None or tcp_sockets(srv.pid, 5201, "LISTEN", netns=self.b), timeout=30,
                 what="iperf3's server in B to listen on 5201")
        assert srv.poll() is None, f"iperf3's server in B ended ({srv.returncode}) before it listened"
        r = subprocess.run(["ip", "netns", "exec", self.a, "iperf3", "-c", B_IP, "-J", "-t", str(seconds),
                            "-O", str(omit)], capture_output=True, text=True, timeout=seconds + omit + 30)
        out = json.loads(r.stdout or "{}")
        assert r.returncode == 0 and "error" not in out and out.get("end"), \
            f"iperf3 failed ({r.returncode}): {r.stdout[-500:]} {r.stderr[-500:]}"
        srv.wait(timeout=10)
        return float(out["end"]["sum_received"]["bits_per_second"])


def _need():
    requires.need("tun", ok=capmod.probe().tun)
    requires.need("ping")


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


# Measured once each (no second try: a user sees the first), in the serial `timing` phase. The bands
# come from 5 runs of each measurement on the 2-core machine (2026-12-02, while other engineers'
# jobs ran on it; `python tests/timing_bands.py`): median RTT over 2 x delay
# 1.17-1.24 at 1 ms (2.34-2.48 ms: the helper's ~0.2 ms per pass shows at small delays), 1.025-1.045
# at 10 ms, 1.00-1.01 at 50 ms; asymmetric 2+8 ms: 10.30-10.45 ms; update(): 0.19-1.24 ms;
# iperf3 through a 1 ms line: 2.7-5.2 Gbit/s; HTB 1 Gbit/s on the TAP: 0.9925-1.0001 of the rate.
# Measured again with the engine (delay_engine.py), 10 runs of the same quantities at a load average
# of 5 to 16 from other jobs (2026-12-02 10:30): 1.115-1.21 at 1 ms, 1.02-1.03 at 10 ms, 1.00-1.035
# at 50 ms (the 1.035 at load 16); asymmetric 10.2-10.6 ms; update(): 0.13-0.91 ms; iperf3 4.3-8.2
# Gbit/s; HTB 0.989-1.000. Upper bound want x 1.05 + 0.5 ms: 2.6 / 21.5 / 105.5 ms, above every
# run; the lower bound is physics (the line never releases early).
RTT_OVER = 1.05


@pytest.mark.timing
@pytest.mark.parametrize("delay", [0.001, 0.010, 0.050])
def test_delay_rtt(make_pair, delay):
    p = make_pair(LinkProfile(delay_s=delay))
    want = 2 * delay
    med = statistics.median(p.ping(20 if delay < 0.05 else 10, 0.01))
    assert want * 0.98 <= med <= want * RTT_OVER + BASELINE, f"median RTT {med * 1e3:.3f} ms, want {want * 1e3} ms"


@pytest.mark.timing
def test_asymmetric_and_update(make_pair):
    p = make_pair(LinkProfile(delay_s=0.002), LinkProfile(delay_s=0.008))
    med = statistics.median(p.ping(10))
    assert 0.010 * 0.98 <= med <= 0.010 * RTT_OVER + BASELINE, med
    t0 = time.perf_counter()
    delayline.update(p.link, LinkProfile(delay_s=0.020), LinkProfile(delay_s=0.005))
    took = time.perf_counter() - t0
    assert took < 0.010, f"update took {took * 1e3:.1f} ms"   # measured 0.19-1.24 ms (engine: 0.13-0.91)
    med = statistics.median(p.ping(10))
    assert 0.025 * 0.98 <= med <= 0.025 * RTT_OVER + BASELINE, med
    st = delayline.stats(p.link)
    assert st["ab"]["delay_s"] == 0.020 and st["ab"]["frames"] > 0 and st["ba"]["frames"] > 0
    # How late held frames left. The verdict judges the mean (checks.delay_line_checks: off beyond
    # TOLERANCE of the delay); the tail is reported, not judged. ~25 frames per direction make a "p99"
    # the single worst frame, which a 2-core VM's scheduler can hold back 1-2 ms now and then (CI saw
    # one in the 1.0-2.0 ms bucket), so the worst frame is held to the smallest delay it crossed.
    # Measured on this machine, 8 runs: mean 56-99 us, worst bucket 128-1024 us. With the engine, 10
    # runs at a load average of 5-16 from other jobs: mean 35-166 us up to load 8, up to 454 us at 16,
    # worst frame 0.5-3.7 ms. This test's sequence run 6 times with each design, alternating (10:43,
    # load average ~1, other jobs starting and stopping): "ab" mean 131-301 us with the old helpers,
    # 45-344 us with the engine; worst frame 0.5-1.6 and 0.2-3.9 ms. Both pass the bound about half
    # the time then: this VM wakes a sleeping process late (bench/delay_engine.py --timers), and the
    # bound is the verdict's, not widened to pass.
    for d, smallest in (("ab", 0.002), ("ba", 0.005)):
        hist = st[d]["late_hist_us_log2"]
        assert sum(hist) == st[d]["frames"]
        mean = delayline.lateness_mean(hist)
        assert mean < verdict.TOLERANCE * smallest, f"{d}: frames left {mean * 1e6:.0f} us late on average"
        assert st[d]["late_max_s"] < smallest, f"{d}: worst frame {st[d]['late_max_s'] * 1e3:.2f} ms late"


@pytest.mark.timing
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


@pytest.mark.timing
def test_throughput_and_htb_on_tap(make_pair):
    c = capmod.probe()
    p = make_pair(LinkProfile(delay_s=0.001))
    got = p.iperf(seconds=2)
    assert got > 2e9, f"{got / 1e9:.2f} Gbit/s through the delay line"   # measured 2.7-5.2 (engine: 4.3-8.2)
    # bandwidth on the TAP's egress (before the delay), like on a veth
    shaping.apply(p.ipr_a, "eth0", LinkProfile(bandwidth_bps=10**9, delay_s=0.001), c)
    expect = 10**9 * 1448 / 1514
    got = p.iperf(seconds=2)
    # measured 0.9925-1.0001 of expect (engine: 0.989-1.000): 3% is over 2.5x the widest miss
    assert abs(got - expect) <= 0.03 * expect, f"{got / 1e6:.0f} Mbit/s at HTB 1 Gbit/s + 1 ms"


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
    me = os.getpid()
    assert delayline.stop(procs.ProcRef(me, procs.start_ticks(me) + 1))
    assert procs.alive(procs.ref(me))


# -- the engine: many lines per process ------------------------------------------------------------

class Lines:
    """Two namespaces joined by `n` delay lines (TAPs d0..d<n-1> on each side), all in one state
    directory, so they share this testbed's engines."""

    def __init__(self, n: int, delay: float = 0.001, together: bool = False, **kw):
        """together: all n through start_delay_links (a build's way), kw its options; else one by one."""
        from pyroute2 import netns

        tag = uuid.uuid4().hex[:5]
        self.a, self.b = f"tb-e{tag}-a", f"tb-e{tag}-b"
        self.state = tempfile.mkdtemp(prefix="tbdl-")
        self.links: list[delayline.DelayLink] = []
        self.iprs: list = []
        netns.create(self.a)
        netns.create(self.b)
        prof = LinkProfile(delay_s=delay)
        if together:
            specs = [delayline.LineSpec(str(i), self.a, f"d{i}", self.b, f"d{i}", prof, prof, 1500) for i in range(n)]
            self.links = delayline.start_delay_links("t", specs, self.state, **kw)
            return
        for i in range(n):
            self.links.append(delayline.start_delay_link("t", str(i), self.a, f"d{i}", self.b, f"d{i}", prof, prof,
                                                         1500, self.state))

    @staticmethod
    def ip(i: int, side: int) -> str:
        return f"10.{80 + i // 256}.{i % 256}.{side}"

    def address(self, i: int) -> None:
        """Address and raise line i's TAPs (10.8x.y.1 in a, .2 in b)."""
        from pyroute2 import IPRoute

        for ns, side in ((self.a, 1), (self.b, 2)):
            with IPRoute(netns=ns) as ipr:
                idx = ipr.link_lookup(ifname=f"d{i}")[0]
                ipr.addr("add", index=idx, address=self.ip(i, side), prefixlen=24)
                ipr.link("set", index=idx, state="up")

    def ping(self, i: int, count: int = 3) -> list[float]:
        r = subprocess.run(["ip", "netns", "exec", self.a, "ping", "-n", "-c", str(count), "-i", "0.01", "-W", "2",
                            self.ip(i, 2)], capture_output=True, text=True, timeout=60)
        return [float(x) / 1e3 for x in re.findall(r"time=([0-9.]+) ms", r.stdout)]

    def taps(self) -> list[str]:
        from pyroute2 import IPRoute

        out = []
        for ns in (self.a, self.b):
            with IPRoute(netns=ns) as ipr:
                out += [f"{ns}/{l.get_attr('IFLA_IFNAME')}" for l in ipr.get_links()
                        if l.get_attr("IFLA_IFNAME", "").startswith("d")]
        return out

    def engines(self) -> set[int]:
        return {link.pid for link in self.links}

    def close(self) -> None:
        from pyroute2 import netns

        delayline.stop_all(self.state)
        for ns in (self.a, self.b):
            try:
                netns.remove(ns)
            except Exception:
                pass
        shutil.rmtree(self.state, ignore_errors=True)


@pytest.fixture
def make_lines():
    made = []

    def make(n: int, delay: float = 0.001, **kw) -> Lines:
        _need()
        lines = Lines(n, delay, **kw)
        made.append(lines)
        return lines

    try:
        yield make
    finally:
        for lines in made:
            lines.close()


def _alive(pids) -> list[int]:
    return [p for p in pids if procs.start_ticks(p) is not None]


def test_many_lines_share_an_engine_per_cpu(make_lines, monkeypatch):
    """Twelve lines, two engines: each line is served (its own control socket and pid file naming
    its engine), traffic crosses the first and the last line, and the engines are the only processes."""
    monkeypatch.setattr(delayline, "ENGINES_MAX", 2)
    ls = make_lines(12)
    assert len(ls.engines()) == 2, ls.engines()
    for link in ls.links:
        assert delayline.read_pid_file(Path(link.pid_file)) == procs.ProcRef(link.pid, link.start)
        st = delayline.stats(link)
        assert st["ab"]["delay_s"] == 0.001 and st["ba"]["frames"] == 0
    for i in (0, 11):
        ls.address(i)
        assert len(ls.ping(i)) == 3, f"no answer across line {i}"
    assert delayline.stats(ls.links[11])["ab"]["frames"] >= 3 and delayline.stats(ls.links[5])["ab"]["frames"] == 0
    delayline.update(ls.links[0], LinkProfile(delay_s=0.004), None)   # one line's profile, not its neighbours'
    assert delayline.stats(ls.links[0])["ab"]["delay_s"] == 0.004
    assert delayline.stats(ls.links[2])["ab"]["delay_s"] == 0.001   # (same engine as line 0)


def test_lines_started_together_are_each_served(make_lines, monkeypatch):
    """A build's lines (start_delay_links): the engines start together, each is handed several lines
    before it answers (a window of 3 here, so answers are read both mid-way and at the end), every
    line is confirmed once, in the caller's callback, and carries traffic through the engine named."""
    monkeypatch.setattr(delayline, "ENGINES_MAX", 2)
    seen: list[str] = []
    ls = make_lines(10, together=True, window=3, on_started=lambda link: seen.append(link.link_id))
    assert sorted(seen, key=int) == [str(i) for i in range(10)] and len(ls.links) == 10
    assert len(ls.engines()) == 2, ls.engines()
    for link in ls.links:
        assert delayline.read_pid_file(Path(link.pid_file)) == procs.ProcRef(link.pid, link.start)
    for i in (0, 9):
        ls.address(i)
        assert len(ls.ping(i)) == 3, f"no answer across line {i}"


def test_a_line_refused_among_many_is_named(make_lines, monkeypatch):
    """A line an engine refuses (here: its id is taken, its control socket exists) fails the batch
    with its id, after the answers of the lines before and after it were read (they are recorded)."""
    monkeypatch.setattr(delayline, "ENGINES_MAX", 1)
    ls = make_lines(2, together=True)
    prof = LinkProfile(delay_s=0.001)
    specs = [delayline.LineSpec(lid, ls.a, f"x{k}", ls.b, f"x{k}", prof, prof, 1500)
             for k, lid in enumerate(("5", "1", "6"))]
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="delay line 1: the engine refused it"):
        delayline.start_delay_links("t", specs, ls.state, on_started=lambda link: seen.append(link.link_id))
    assert seen == ["5", "6"]


def test_descriptors_above_1023(make_lines, monkeypatch):
    """The crash of issue 25 (select() on a descriptor above 1,023): here both the process that
    starts lines and the engine hold more than 1,024 files, and the last line still carries traffic."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}: this test needs 4,096")
    monkeypatch.setattr(delayline, "ENGINES_MAX", 1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    dummies = []
    try:
        while not dummies or dummies[-1] < 1100:   # our own next descriptors are above 1,023
            dummies.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        n = 345   # 3 files a line: the engine's descriptors pass 1,024
        ls = make_lines(n)
        (engine,) = ls.engines()
        fds = [int(fd) for fd in os.listdir(f"/proc/{engine}/fd")]
        assert max(fds) > 1023 and len(fds) >= 3 * n, (max(fds), len(fds))
        ls.address(n - 1)
        assert len(ls.ping(n - 1)) == 3, "no answer across the line with the highest descriptors"
    finally:
        for fd in dummies:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_teardown_leaves_nothing(make_lines, monkeypatch):
    """A line removed alone leaves its engine serving the others; an engine ends with its last line;
    stop_all (teardown after a crash) ends the rest: no engine, TAP, pid file or socket is left."""
    monkeypatch.setattr(delayline, "ENGINES_MAX", 2)
    ls = make_lines(4)
    first, second = ls.links[0], ls.links[1]
    assert first.pid != second.pid and ls.links[2].pid == first.pid
    assert delayline.stop(first)
    assert _alive([first.pid]) == [first.pid] and not os.path.exists(first.control)
    assert f"{ls.a}/d0" not in ls.taps() and f"{ls.a}/d2" in ls.taps()
    delayline.stats(ls.links[2])   # its engine still answers for the line it kept
    assert delayline.stop(ls.links[2])   # that engine's last line: it ends
    wait_for(lambda: not _alive([first.pid]), timeout=5, what=f"engine {first.pid} to end with its last line")
    engines = ls.engines()
    assert delayline.stop_all(ls.state) == 1   # the second engine (lines 1 and 3)
    assert not _alive(engines)
    assert ls.taps() == []
    assert sorted(p.name for p in Path(ls.state).iterdir()) == [delayline.ENGINE_LOG]


def test_an_engine_killed_before_its_first_line_is_found_by_its_pid_file(tmp_path):
    """An engine names itself (dle-PID.pid) before anything else: cleanup finds one whose parent
    died before giving it a line, and an engine whose parent closes the channel with no line ends."""
    _need()
    d = str(tmp_path)
    engine = delayline._spawn("t", d, 10.0)
    try:
        (pf,) = tmp_path.glob("dle-*.pid")
        assert delayline.read_pid_file(pf) == engine.ref
        engine.channel.close()   # no line will come
        assert not procs.wait_gone([engine.ref], 5.0), "an engine without lines outlived its channel"
        assert not list(tmp_path.glob("dle-*.pid"))
        engine = delayline._spawn("t", d, 10.0)
        assert delayline.stop_all(d) == 1 and not procs.alive(engine.ref)
    finally:
        engine.channel.close()
        procs.stop([engine.ref])
