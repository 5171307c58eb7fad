"""Runtime control of a running testbed (testbed.faults.control): links, nodes, partitions. Needs root.

Every test gets a testbed of its own (the `star`, `leaves` and `fat` fixtures are function-scoped): a
test that fails half-way, or leaves a link down or a worker slowed, cannot change what the next test
sees. A star (4 namespaces) or a 2-leaf leaf-spine (8) comes up in 0.1-0.2 s; the k=4 fat-tree (36)
takes about a second, so only the two tests about failover across its three tiers use it. The fixture
checks that the fresh testbed is at its baseline before the test, and that it is gone, namespaces
included, after it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from waiting import tcp_sockets, wait_for

IS_ROOT = os.geteuid() == 0
pytestmark = [pytest.mark.root, pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")]

# 200mbit host links: iperf3 measures what HTB lets through, well below what the CPU can move
STAR = ("star", ["tiers.host.bandwidth=200mbit", "tiers.host.delay=0", "tiers.host.queue=1000", "params.n=3"])
# delay 0: plain veths (what is tested here is the control, not the delay element). 1000-packet
# queues: the iperf3 checks measure the shaper's rate, and the default queue (100 packets at 50-200
# Mbit/s) drops where a flow steps down from 200 to 50 Mbit/s: make test once saw 2096
# retransmissions in 2 s there and 0.976 of the rate
LEAF_SPINE = ("leaf-spine", ["params.leaves=2", "params.spines=2", "params.hosts_per_leaf=2", "tiers.host.delay=0",
                             "tiers.leaf-spine.delay=0"])   # w0 w1 on leaf0, w2 w3 on leaf1
FAT = ("fat-tree", ["tiers.host.delay=0", "tiers.edge-agg.delay=0", "tiers.agg-core.delay=0"])


def _namespaces_of(name):
    from testbed.net import names, netns

    return netns.list_names(names.netns_prefix(name))


def baseline_problems(name):
    """How testbed `name` differs from its topology (empty: all links up at the topology's profiles,
    no partition, no node down, crashed or slowed, no time dilation)."""
    from testbed import store
    from testbed import running
    from testbed.faults import control

    st = store.load(name)
    out = [f"link {'-'.join(l['endpoints'])}: {l['state']} (down_by {l['down_by']}), changed={l['changed']}"
           for l in control.link_show(name) if l["state"] != "up" or l["down_by"] or l["changed"]]
    faults = st.get("faults") or {}
    if faults.get("partition"):
        out.append(f"partition {faults['partition'].get('groups')}")
    for node, ns in sorted((faults.get("nodes") or {}).items()):
        if ns.get("state") not in (None, "up") or "cpus" in ns or ns.get("cgroup"):
            out.append(f"node {node}: {ns}")
    if running.dilation_of(st) != 1.0:
        out.append(f"time dilation {running.dilation_of(st)}")
    return out


@pytest.fixture
def make_testbed(root, state_dir):
    """up(topology, overrides) -> (name, topo): a testbed of this test's own, at its baseline.

    Afterwards, whatever the test did (links down, nodes slowed, a failure half-way), the testbed is
    brought down; a testbed that could not be removed, or left a namespace, is this test's error."""
    from testbed import lifecycle, store
    from testbed.cleanup import cleanup
    from testbed.topology.loader import load_topology

    made: list[str] = []

    def up(topology, overrides=()):
        topo = load_topology(topology, overrides)
        name = f"f{uuid.uuid4().hex[:6]}"
        made.append(name)
        lifecycle.up(topo, name)
        problems = baseline_problems(name)
        assert not problems, f"fresh testbed {name} ({topology}) is not at its baseline: {problems}"
        return name, topo

    yield up
    errors = []
    for name in made:
        try:
            if store.exists(name):
                lifecycle.down(name)
        except Exception as exc:  # noqa: BLE001 - reported below, the other testbeds still go
            errors.append(f"down {name}: {exc!r}")
    if errors or any(_namespaces_of(n) for n in made):
        try:
            cleanup()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"cleanup: {exc!r}")
    left = [ns for n in made for ns in _namespaces_of(n)]
    assert not errors and not left, f"testbed not removed cleanly: {errors}; namespaces left: {left}"


@pytest.fixture
def star(make_testbed):
    return make_testbed(*STAR)


@pytest.fixture
def leaves(make_testbed):
    return make_testbed(*LEAF_SPINE)


@pytest.fixture
def fat(make_testbed):
    return make_testbed(*FAT)


def addr(topo, w):
    from testbed.topology.plan import plan_network

    return plan_network(topo).worker_address(w)


def ping(name, topo, a, b, count=1, wait="0.3"):
    r = subprocess.run(["ip", "netns", "exec", f"tb-{name}-{a}", "ping", "-n", "-q", "-c", str(count), "-W", wait,
                        "-i", "0.05", addr(topo, b)], capture_output=True, text=True, timeout=30)
    return r.returncode == 0


def reachable_within(name, topo, a, b, limit=3.0):
    """Seconds until a ping a->b succeeds (None: not within limit)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if ping(name, topo, a, b, wait="0.1"):
            return time.monotonic() - t0
    return None


def links_state(name):
    from testbed.faults import control

    return {tuple(l["endpoints"]): l for l in control.link_show(name)}


def _cpu_group(pid) -> Path:
    """The directory of the cpu cgroup that process `pid` is in."""
    from testbed.runtime import cgroups

    hier = cgroups.hierarchy()
    assert hier is not None, "no cgroup filesystem"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, rel = line.split(":", 2)
        if hier.version == 2 and ctrls == "":
            return hier.mounts[""] / rel.lstrip("/")
        if hier.version == 1 and "cpu" in ctrls.split(","):
            return hier.mounts["cpu"] / rel.lstrip("/")
    raise AssertionError(f"process {pid} is in no cpu cgroup")


def cpu_limit(pid):
    """CPUs the CFS quota of the cpu cgroup that process `pid` is in allows (None: no quota)."""
    group = _cpu_group(pid)
    if (group / "cpu.max").exists():
        text = (group / "cpu.max").read_text().split()
        return None if text[0] == "max" else int(text[0]) / int(text[1])
    quota = int((group / "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int((group / "cpu.cfs_period_us").read_text())


def nr_throttled(pid) -> int:
    """CFS periods in which the cpu cgroup of process `pid` ran out of its quota, so far."""
    for line in (_cpu_group(pid) / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "nr_throttled":
            return int(value)
    raise AssertionError(f"no nr_throttled in the cpu.stat of process {pid}'s group")


# -- links --------------------------------------------------------------------------------------------------


# Bands of the timed checks here, from 20 runs each on a 3-worker star (2026-12-02, the 2-core
# machine with other engineers' jobs beside; `python tests/timing_bands.py`): link down 5.2-14.9 ms,
# link up 9.6-58 ms, link set 5.8-14.7 ms (warm); iperf3 at the 200 Mbit/s profile: 0.953-0.958
# of 200 Mbit/s (the goodput ratio 1448/1514 is 0.956). One measurement each, no second try.
CONTROL_WITHIN_S = {"down": 0.050, "up": 0.100, "set": 0.050}   # >= 1.7x the slowest seen
GOODPUT_RATIO = 1448 / 1514


@pytest.mark.timing
def test_link_down_stops_ping_and_up_restores(star):
    from testbed.faults import control

    name, topo = star
    assert ping(name, topo, "w0", "w1")
    t0 = time.monotonic()
    assert control.link_down(name, "w1", "s0")
    took = time.monotonic() - t0
    assert took < CONTROL_WITHIN_S["down"], f"link down took {took * 1e3:.0f} ms"
    assert not ping(name, topo, "w0", "w1", count=3)
    assert ping(name, topo, "w0", "w2")
    assert links_state(name)[("w1", "s0")]["state"] == "down"
    t0 = time.monotonic()
    assert control.link_up(name, "w1", "s0") == []
    took = time.monotonic() - t0
    assert took < CONTROL_WITHIN_S["up"], f"link up took {took * 1e3:.0f} ms"
    assert reachable_within(name, topo, "w0", "w1") is not None
    assert links_state(name)[("w1", "s0")]["state"] == "up"


def test_fat_tree_agg_core_down_keeps_cross_pod(fat):
    from testbed.faults import control

    name, topo = fat
    cross = ["w4", "w8", "w12", "w5", "w9", "w13"]
    assert all(ping(name, topo, "w0", w) for w in cross)
    downed = [("agg0-0", "core0"), ("agg0-1", "core2")]
    for a, b in downed:
        assert control.link_down(name, a, b), f"{a}-{b} was already down"
    links = links_state(name)
    assert sorted(k for k, l in links.items() if l["state"] == "down") == sorted(downed)
    # many flows (different ICMP ids hash differently); every one must get through
    for w in cross:
        assert ping(name, topo, "w0", w, count=5), f"w0 -> {w} broken by one agg-core link down"
    for a, b in downed:
        assert control.link_up(name, a, b) == []
    assert all(l["state"] == "up" for l in links_state(name).values())
    assert all(reachable_within(name, topo, "w0", w) is not None for w in cross)


def test_host_link_down_stops_it_not_its_rack(leaves):
    """A host link down cuts that worker off, across the fabric; its rack mate stays reachable."""
    from testbed.faults import control

    name, topo = leaves
    assert control.link_down(name, "w3", "leaf1")
    assert not ping(name, topo, "w0", "w3", count=3)
    assert ping(name, topo, "w0", "w2")
    assert control.link_up(name, "w3", "leaf1") == []
    assert reachable_within(name, topo, "w0", "w3") is not None


def test_switch_down_fails_over_and_up_restores(fat):
    from testbed.faults import control

    name, topo = fat
    control.node_down(name, "core1")
    downs = [k for k, l in links_state(name).items() if l["state"] == "down"]
    assert sorted(downs) == sorted((l.a, l.b) for l in topo.links_of("core1"))
    assert all(ping(name, topo, "w0", w, count=3) for w in ("w4", "w8", "w15"))
    # `link up` only undoes `link down`: a link the downed switch holds stays down, and says why
    assert control.link_up(name, "agg0-0", "core1") == ["node:core1"]
    assert links_state(name)[("agg0-0", "core1")]["state"] == "down"
    control.node_up(name, "core1")
    assert all(l["state"] == "up" for l in links_state(name).values())
    assert all(reachable_within(name, topo, "w0", w) is not None for w in ("w4", "w8", "w15"))


def test_unknown_names_refused(star):
    from testbed.faults import control

    name, _ = star
    with pytest.raises(control.FaultError, match="no node 'nope'"):
        control.link_down(name, "w0", "nope")
    with pytest.raises(control.FaultError, match="no link between w0 and w1"):
        control.link_down(name, "w0", "w1")
    with pytest.raises(control.FaultError, match="switch"):
        control.node_crash(name, "s0")
    assert all(l["state"] == "up" and not l["changed"] for l in links_state(name).values())


class Goodput(float):
    """A flow's goodput in bit/s: the median of its 0.25 s intervals as the receiver counted them,
    with the whole-run mean, the intervals and the sender's retransmissions kept for the message.

    The median is the shaper's rate: a rate set wrong moves every interval, while a stall of the
    machine moves one or two of the eight. CI's VM once delivered 0.93 of the rate as a whole-run
    mean (stop 39); 24 runs here, idle or beside busy loops, never came near (188.5 of 191.3 Mbit/s
    at worst). The message shows each interval and the retransmissions, so a next one tells a stall
    from a slow rate, and from drops (STAR's queues, above)."""

    def __new__(cls, intervals, mean, retransmits):
        out = super().__new__(cls, statistics.median(intervals))
        out.intervals, out.mean, out.retransmits = intervals, mean, retransmits
        return out

    def __repr__(self):
        return (f"{float(self) / 1e6:.2f} Mbit/s (median of 0.25 s intervals "
                f"{[round(i / 1e6, 1) for i in self.intervals]}; mean {self.mean / 1e6:.2f}; "
                f"{self.retransmits} retransmissions)")


def _iperf(name, topo, client, server, reverse=False, secs=2):
    """Goodput client -> server (server -> client with reverse), counted where it arrives: the
    iperf3 server runs at the sender and the client receives (-R), since a sender's intervals count
    what entered its socket buffer, not what crossed the link."""
    sender, receiver = (server, client) if reverse else (client, server)
    port = str(5201 + (uuid.uuid4().int % 500))
    srv = subprocess.Popen(["ip", "netns", "exec", f"tb-{name}-{sender}", "iperf3", "-s", "-1", "-p", port],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: srv.poll() is not None or tcp_sockets(srv.pid, int(port), "LISTEN",
                                                               netns=f"tb-{name}-{sender}"), timeout=30,
                 what=f"iperf3's server on {sender} to listen")
        argv = ["ip", "netns", "exec", f"tb-{name}-{receiver}", "iperf3", "-c", addr(topo, sender), "-p", port,
                "-t", str(secs), "-O", "0.5", "-i", "0.25", "-R", "-J"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=secs + 20)
        assert r.returncode == 0, f"iperf3 {sender} -> {receiver} failed: {r.stderr.strip()} {r.stdout[-400:]}"
        data = json.loads(r.stdout)
        intervals = [i["sum"]["bits_per_second"] for i in data["intervals"]
                     if not i["sum"].get("omitted") and i["sum"]["seconds"] > 0.2]
        assert len(intervals) >= 6, f"iperf3 {sender} -> {receiver}: {len(intervals)} whole intervals in {secs} s"
        return Goodput(intervals, data["end"]["sum_received"]["bits_per_second"],
                       data["end"]["sum_sent"].get("retransmits"))
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(5)


@pytest.mark.timing
def test_link_set_bandwidth_iperf(star):
    """200mbit -> 100mbit on w0's link in one direction, then 50mbit both, then reset.

    iperf3's goodput is a fixed fraction of the HTB rate (headers: ~94-96%), so each measurement is
    compared, within 2%, with the baseline measured at the topology's rate scaled by the new rate.
    """
    from testbed.faults import control

    name, topo = star
    up0, down0 = _iperf(name, topo, "w0", "w1"), _iperf(name, topo, "w0", "w1", reverse=True)
    assert up0 == pytest.approx(200e6 * GOODPUT_RATIO, rel=0.03)
    assert down0 == pytest.approx(200e6 * GOODPUT_RATIO, rel=0.03)
    # one direction only: traffic from w0 to s0 (A->B with A = w0). The bound is on the change itself:
    # a first call in a process also pays one-time costs (a netlink socket per namespace, lazy
    # imports; 0.12-0.18 s on this machine on a slow day), so the code path is warmed first on
    # another link, with a no-op change to its own rate
    control.link_set(name, "w1", "s0", {"bandwidth_bps": 200_000_000}, "A->B")
    t0 = time.monotonic()
    link = control.link_set(name, "w0", "s0", {"bandwidth_bps": 100_000_000}, "A->B")
    took = time.monotonic() - t0
    assert took < CONTROL_WITHIN_S["set"], f"link set took {took * 1e3:.0f} ms"
    assert link["ab"]["bandwidth_bps"] == 100_000_000 and link["ba"]["bandwidth_bps"] == 200_000_000

    def against(expected: float, reverse: bool = False) -> None:
        """Goodput now within 2% of what the baseline scaled to the new rate predicts (printed: pytest -s)."""
        got = _iperf(name, topo, "w0", "w1", reverse=reverse)
        print(f"goodput {got / 1e6:.2f} Mbit/s, expected {expected / 1e6:.2f}: ratio {got / expected:.4f}")
        assert got / expected == pytest.approx(1, rel=0.02), f"{got!r}, expected {expected / 1e6:.2f} Mbit/s"

    # Within 2%: the six ratios below came out 0.9943-1.0053 in 5 runs (30 measurements, medians of
    # intervals, 2026-12-07, the 2-core machine idle; 0.9950-1.0084 with whole-run means on 2026-12-02
    # with other sessions' tests beside; `pytest -s -k link_set_bandwidth_iperf` prints them), so 2% is
    # 2.4x the widest seen; a rate left unchanged, or halved instead of quartered, is off by 50-100%.
    against(up0 / 2)
    against(down0, reverse=True)
    # both directions, named from the other end
    control.link_set(name, "s0", "w0", {"bandwidth_bps": 50_000_000})
    against(up0 / 4)
    against(down0 / 4, reverse=True)
    assert links_state(name)[("w0", "s0")]["changed"]
    control.link_reset(name, "w0", "s0")
    assert not links_state(name)[("w0", "s0")]["changed"]
    against(up0)
    against(down0, reverse=True)


@pytest.mark.timing
def test_link_set_honours_dilation(star):
    from testbed import store
    from testbed.faults import control

    name, topo = star
    st = store.load(name)
    st["time_dilation"] = {"factor": 2.0, "source": "test"}
    store.save(name, st)
    control.link_set(name, "w0", "s0", {"bandwidth_bps": 100_000_000})
    # the emulated link says 100mbit; the kernel runs it at 100mbit / 2
    assert links_state(name)[("w0", "s0")]["ab"]["bandwidth_bps"] == 100_000_000
    # HTB at 50 Mbit/s: not measured on its own; at 100 Mbit/s-1 Gbit/s goodput is within 0.5% of the ratio
    assert _iperf(name, topo, "w0", "w1") == pytest.approx(50e6 * GOODPUT_RATIO, rel=0.03)
    control.link_reset(name, "w0", "s0")
    assert not links_state(name)[("w0", "s0")]["changed"]


def test_partition_and_heal(star):
    from testbed.faults import control

    name, topo = star
    groups = control.partition(name, [["w0"], ["w1", "w2"]])
    assert groups == [["w0"], ["w1", "w2"]]
    assert not ping(name, topo, "w0", "w1", count=3)
    assert not ping(name, topo, "w2", "w0", count=3)
    assert ping(name, topo, "w1", "w2")
    assert control.heal(name)
    assert ping(name, topo, "w0", "w1") and ping(name, topo, "w2", "w0")
    assert not control.heal(name)


@pytest.mark.timing
def test_node_crash_and_slow(star):
    """crash kills what runs in the worker; slow caps its CPU (a busy loop gets ~cpus of a core);
    restore puts the topology's limit back."""
    from testbed import store
    from testbed.faults import control

    name, topo = star
    busy = subprocess.Popen(["nsenter", f"--net=/run/netns/tb-{name}-w2", "--", "python3", "-c",
                             "while True: pass"], stdout=subprocess.DEVNULL)
    try:
        import psutil

        p = psutil.Process(busy.pid)   # (nsenter execs python3: the same process)
        # the loop runs (a tenth of a second of CPU) before the first window opens
        wait_for(lambda: sum(p.cpu_times()[:2]) > 0.1, timeout=30, what="the busy loop to run")
        c0 = p.cpu_times()
        time.sleep(1.0)   # the measured window: CPU seconds over 1 s of wall time
        fast = sum(p.cpu_times()[:2]) - sum(c0[:2])
        control.node_slow(name, "w2", 0.2)
        assert cpu_limit(busy.pid) == pytest.approx(0.2), "the busy loop is not under the slowed quota"
        # the quota bites: a period in which the loop used it up has passed (so the window below is
        # all under the quota, not partly before it)
        throttled = nr_throttled(busy.pid)
        wait_for(lambda: nr_throttled(busy.pid) > throttled, timeout=10, what="the loop's group to be throttled")
        c1 = p.cpu_times()
        time.sleep(1.5)   # the measured window: CPU seconds over 1.5 s of wall time
        slow = (sum(p.cpu_times()[:2]) - sum(c1[:2])) / 1.5
        print(f"busy loop: {fast:.3f} cores unslowed, {slow:.3f} under the 0.2 quota")
        # 5 runs (2026-12-02, 2-core machine, other sessions' tests beside): unslowed 0.83-1.00 of a
        # core, slowed 0.200-0.207. The quota is an upper bound whatever else runs: 0.26 leaves 0.05
        # over the highest seen (a period's edge in the window); and the quota is what slowed the
        # loop: the unslowed share was 4.1x the slowed at the least, asked here to be over 2x
        assert slow < 0.26, (fast, slow)
        assert fast > 2 * slow, (fast, slow)
        control.node_restore(name, "w2")
        # back to the topology's limit (star: cpus 1 per worker), and the state forgets the slow
        assert cpu_limit(busy.pid) == topo.nodes["w2"].cpus
        assert "cpus" not in store.load(name)["faults"]["nodes"]["w2"]
        n = control.node_crash(name, "w2")
        assert n >= 1
        busy.wait(5)
        assert busy.returncode == -9
        assert store.load(name)["faults"]["nodes"]["w2"]["state"] == "crashed"
    finally:
        if busy.poll() is None:
            busy.kill()
        busy.wait(5)
    control.node_up(name, "w2")
    assert store.load(name)["faults"]["nodes"]["w2"]["state"] == "up"


def test_restore_all(star):
    from testbed import store
    from testbed.faults import control

    name, topo = star
    control.link_down(name, "w0", "s0")
    control.link_set(name, "w1", "s0", {"loss": 0.5})
    control.node_down(name, "s0")
    control.partition(name, [["w2"]])
    changed = control.restore_all(name)
    assert changed
    assert {"heal", "node up s0", "link reset w0 s0", "link reset w1 s0"} <= set(changed), changed
    links = links_state(name)
    assert all(l["state"] == "up" and not l["changed"] and not l["down_by"] for l in links.values())
    assert baseline_problems(name) == []
    assert not store.load(name)["faults"].get("partition")
    assert reachable_within(name, topo, "w0", "w1") is not None
    assert reachable_within(name, topo, "w2", "w0") is not None
    assert control.restore_all(name) == []


def test_cli_link_commands(star):
    import sys

    name, topo = star
    env = dict(os.environ, PYTHONPATH=os.getcwd())

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True, env=env,
                              timeout=60)

    r = cli("link", "down", "w0", "s0", "--name", name)
    assert r.returncode == 0, r.stderr
    r = cli("link", "show", "--name", name, "--json")
    assert r.returncode == 0, r.stderr
    assert [l for l in json.loads(r.stdout) if l["endpoints"] == ["w0", "s0"]][0]["state"] == "down"
    assert cli("link", "up", "w0", "s0", "--name", name).returncode == 0
    assert links_state(name)[("w0", "s0")]["state"] == "up"
    r = cli("link", "set", "w0", "s0", "--bandwidth", "10 parsecs", "--name", name)
    assert r.returncode == 2 and "--bandwidth" in r.stderr
    r = cli("link", "set", "w0", "w1", "--loss", "1%", "--name", name)
    assert r.returncode == 2 and "no link between" in r.stderr
    r = cli("node", "down", "zz", "--name", name)
    assert r.returncode == 2 and "no node 'zz'" in r.stderr
    assert all(l["state"] == "up" and not l["changed"] for l in links_state(name).values())


def test_a_run_after_link_set_is_judged_at_the_rate_set(star):
    """`testbed run` takes the testbed's topology as its links run now: the rate `link set`
    recorded, not the file's (the verdict's model and the run's topology.json use it)."""
    from testbed.faults import control
    from testbed.jobs.target import cluster_from_state

    name, _ = star

    def rates() -> tuple[float, float]:
        (lk,) = [lk for lk in cluster_from_state(name).topology.links if {lk.a, lk.b} == {"w0", "s0"}]
        ab, ba = (lk.ab, lk.ba) if lk.a == "w0" else (lk.ba, lk.ab)
        return ab.bandwidth_bps, ba.bandwidth_bps

    before = rates()
    control.link_set(name, "w0", "s0", {"bandwidth_bps": 100_000_000}, "A->B")
    assert rates() == (100_000_000, before[1])
    control.link_reset(name, "w0", "s0")
    assert rates() == before
