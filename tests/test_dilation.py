"""Time dilation: pure functions of testbed.jobs.dilation."""

import pytest

from testbed.topology.dilation import auto_factor, dilate, undilate
from testbed.topology.model import LinkProfile


def test_dilate_scales_bandwidth_and_delay():
    p = LinkProfile(bandwidth_bps=10_000_000_000, delay_s=2e-6, jitter_s=1e-6, loss=0.01, queue=100, mtu=9000)
    d = dilate(p, 4)
    assert d.bandwidth_bps == 2_500_000_000
    assert d.delay_s == pytest.approx(8e-6) and d.jitter_s == pytest.approx(4e-6)
    assert (d.loss, d.queue, d.mtu) == (0.01, 100, 9000)


@pytest.mark.parametrize("s", [1, 2, 4.8, 8, 34])
def test_a_default_queue_is_the_declared_links_whatever_s_is(s):
    """Sized on the link as declared: after dilating, the round trip's 1 ms floor and the 2.5 ms cap
    would shrink the queue by s, and auto's s would decide the queue."""
    from testbed.net.shaping import make_plan
    from types import SimpleNamespace

    caps = SimpleNamespace(netem=False, htb=True, bpf=True, tun=True, latency_floor_s=20e-6)
    for declared, packets in ((LinkProfile(bandwidth_bps=10**9, delay_s=2e-6), 209),       # 2.5 ms of its rate
                              (LinkProfile(bandwidth_bps=5 * 10**9, delay_s=2e-6), 1000),  # Linux's
                              (LinkProfile(bandwidth_bps=10**10, delay_s=2e-6), 1250),     # 1.5 x BDP over 1 ms
                              (LinkProfile(bandwidth_bps=10**9, delay_s=0.005), 1250),     # over the 10 ms round trip
                              (LinkProfile(bandwidth_bps=10**8), 100)):                    # QUEUE_FLOOR
        assert declared.queue_packets() == packets
        assert dilate(declared, s).queue_packets() == packets
        assert make_plan(dilate(declared, s), caps).fifo_bytes == packets * 1514


def test_dilate_identity_and_unshaped():
    p = LinkProfile(bandwidth_bps=None, delay_s=0.001)
    assert dilate(p, 1) == p
    assert dilate(p, 2).bandwidth_bps is None and dilate(p, 2).delay_s == pytest.approx(0.002)


@pytest.mark.parametrize("s", [0, 0.5, -1, float("nan"), float("inf")])
def test_dilate_rejects_bad_factor(s):
    with pytest.raises(ValueError):
        dilate(LinkProfile(), s)


@pytest.mark.parametrize("ranks,gpus,cpus,s", [
    (16, 0, 2, 8.0), (16, 2, 2, 8.0), (16, 8, 2, 2.0), (4, 8, 2, 1.0), (1, 0, 2, 1.0), (0, 0, 2, 1.0),
    (3, 0, 2, 1.5), (16, 0, 0, 16.0),
])
def test_auto_factor(ranks, gpus, cpus, s):
    assert auto_factor(ranks, gpus, cpus) == pytest.approx(s)


def test_undilate():
    assert undilate(8.0, 4) == 2.0


# -- choosing the factor ------------------------------------------------------------------------------------

from dataclasses import replace  # noqa: E402

from testbed.topology.dilation import HOST_MARGIN, Choice, choose, dilate_topology, rank_cores  # noqa: E402
from testbed.topology.loader import load_topology, load_topology_text  # noqa: E402
from testbed.topology.plan import plan_network  # noqa: E402
from testbed.topology.reference import MachineConstants, goodput  # noqa: E402

HOST_BOUND = MachineConstants(alpha_s=300e-6, beta_s_per_byte=1.2e-9)    # 6.7 Gbit/s per rank


def _ft():
    t = load_topology("fat-tree")
    return t, plan_network(t)


def test_auto_counts_ranks_per_core_and_the_traffic():
    """On hosts like this machine (host_rate: this-machine) the model charges its host cost, so the
    machine only has to supply it: 16 host-bound ranks keep 16 cores busy moving bytes, 8 per core,
    as compute needs. On network-bound hosts (the default) that host work must stay HOST_MARGIN
    times below the links' time: 16 ranks at the links' full rate, at this machine's cost per byte."""
    t, plan = _ft()
    mine = replace(t, host_rate="this-machine")
    c = choose("auto", mine, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND)
    assert c.factor == pytest.approx(8.0) and c.compute == 8.0 and c.network == pytest.approx(8.0, rel=0.02)
    assert c.setting == "auto" and not c.cap_cpu
    assert any("share 2 CPU core" in r for r in c.reasons) and any("network needs" in r for r in c.reasons)
    c = choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND)
    link_rate = 10e9 / 8 * goodput(1500)               # bytes/s a rank's link carries
    need = HOST_MARGIN * 16 * link_rate * HOST_BOUND.beta_s_per_byte / 2
    assert c.network == pytest.approx(need, rel=0.01) and c.factor == pytest.approx(need, abs=0.1) and c.cap_cpu
    assert any("network-bound hosts" in r for r in c.reasons)
    faster = replace(t, host_rate=50e9)                 # declared hosts at 50 Gbit/s: still link-bound
    assert choose("auto", faster, plan, 0, 2, constants=HOST_BOUND).network == pytest.approx(need, rel=0.01)


def test_auto_plans_the_hosts_work_at_the_slowest_cost_measured():
    """One calibration sees one of this VM's two modes of moving bytes: auto's margin is over the
    slowest per-byte cost this boot measured (MachineConstants.planning_beta), and says so."""
    t, plan = _ft()
    fast = replace(HOST_BOUND, beta_s_per_byte=0.8e-9)
    both = replace(fast, beta_slow_s_per_byte=1.2e-9)
    a, b = (choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=c) for c in (fast, both))
    assert b.network == pytest.approx(a.network * 1.5, rel=1e-6)
    assert any("at the slowest measured this boot, planned for" in r for r in b.reasons), b.reasons
    assert not any("slowest" in r for r in a.reasons)


def test_auto_caps_a_rank_at_its_share_of_the_cores_not_at_one_over_s():
    """auto raises s above what compute needs (8 ranks per core) so that the ranks have the CPU to move
    their bytes at the links' rate; a cap of 1/s would leave each rank one core's rate here whatever s
    (measured: docs/fidelity.md). So each worker is capped at its share, 2 cores / 16 ranks, and its rank
    has s/8 of this machine's cores in emulated time. A fixed factor keeps DieCast's 1/s."""
    t, plan = _ft()
    c = choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND)
    assert c.cap_cpu and c.factor > 8.5
    assert c.cap_cores == pytest.approx(1 / 8) and c.rank_cores == pytest.approx(c.factor / 8)
    assert any("its share of this machine" in r for r in c.reasons), c.reasons
    again = Choice.from_json(c.to_json())
    assert again == c and rank_cores(c.to_json()) == pytest.approx(c.factor / 8)
    capped = dilate_topology(t, c.factor, cap_cpu=True, cap_cores=c.cap_cores)
    assert all(capped.nodes[w].cpus == pytest.approx(1 / 8) for w in t.workers)
    fixed = choose(16, t, plan, 0, 2)
    assert fixed.cap_cores == pytest.approx(1 / 16) and fixed.rank_cores == 1.0
    gpus = choose("auto", t, plan, n_gpus=1, n_cpus=2, constants=HOST_BOUND)   # GPUs: DieCast's 1/s as before
    assert gpus.cap_divisor is None and (not gpus.cap_cpu or gpus.cap_cores == pytest.approx(1 / gpus.factor))
    # phantoms (up --real-ranks): the traffic is all 16 ranks', so each keeps its share of the cores too
    # (their runs measure their own per-message cost: the probe's burst is mirrored)
    phantoms = choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND, real_ranks=1)
    assert phantoms.cap_cpu and phantoms.cap_cores == pytest.approx(1 / 8)
    assert phantoms.rank_cores == pytest.approx(phantoms.factor / 8)
    uncapped = choose("auto", replace(t, host_rate="this-machine"), plan, 0, 2, constants=HOST_BOUND)
    assert not uncapped.cap_cpu and uncapped.rank_cores == 1.0
    # what is read back from disk is not trusted: anything but a sane record is one core
    for bad in (None, {}, {"factor": "x"}, {"factor": 12, "cap_divisor": -3, "compute": 8}, "12"):
        assert rank_cores(bad) == 1.0, bad
    assert rank_cores({"factor": 12.0, "compute": 8.0, "cap_divisor": 0.5}) == 1.0   # a divisor < 1 is dropped


def test_phantoms_compute_nothing_but_still_send():
    """up --real-ranks 1: compute counts one rank (2 cores: no sharing), the traffic all 16, so
    the factor is the network's and every worker's CPU is capped (compute slows by s too)."""
    t, plan = _ft()
    t = replace(t, host_rate="this-machine")
    c = choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND, real_ranks=1)
    assert c.compute == 1.0 and c.network == pytest.approx(8.0, rel=0.02) and c.factor == pytest.approx(8.0, rel=0.02)
    assert c.cap_cpu and any("phantoms" in r for r in c.reasons)
    with pytest.raises(ValueError, match="real ranks"):
        choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND, real_ranks=17)


def test_auto_without_calibration_says_so():
    t, plan = _ft()
    c = choose("auto", t, plan, n_gpus=0, n_cpus=2)
    assert c.factor == 8.0 and c.network is None
    assert any("not calibrated" in r for r in c.reasons)


def test_slow_links_need_no_network_dilation():
    t = load_topology_text("name: s\ngenerator: star\nparams: {n: 4}\ntiers:\n  host: {bandwidth: 100mbit}\n", "<t>")
    c = choose("auto", t, plan_network(t), n_gpus=0, n_cpus=2, constants=HOST_BOUND)
    assert c.network == 1.0 and c.factor == 2.0


def test_more_cores_need_more_traffic():
    """The traffic's host work spreads over the cores: 32 times the cores, a 32nd of the need; once
    the cores move the bytes HOST_MARGIN times faster than the links, no dilation at all."""
    t, plan = _ft()
    on_two = choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND).network
    assert choose("auto", t, plan, n_gpus=0, n_cpus=64, constants=HOST_BOUND).network == \
        pytest.approx(max(1.0, on_two / 32), rel=0.01)
    assert choose("auto", t, plan, n_gpus=0, n_cpus=256, constants=HOST_BOUND).factor == 1.0


def test_fixed_none_and_bad_settings():
    t, plan = _ft()
    assert choose(None, t, plan, 0, 2).factor == 1.0
    none = choose("none", t, plan, 0, 2)
    assert none.factor == 1.0 and none.setting == "none" and any("compute needs" in r for r in none.reasons)
    fixed = choose("16", t, plan, 0, 2)
    assert fixed.factor == 16.0 and fixed.cap_cpu and any("capped" in r for r in fixed.reasons)
    assert not choose(8, t, plan, 0, 2).cap_cpu
    for bad in ("fast", 0.5, float("nan")):
        with pytest.raises(ValueError):
            choose(bad, t, plan, 0, 2)
    assert Choice.from_json(fixed.to_json()) == fixed


def test_dilate_topology_caps_cpus_only_when_asked():
    t, _ = _ft()
    assert all(t.nodes[w].cpus == 1 for w in t.workers)
    d = dilate_topology(t, 4)
    assert all(d.nodes[w].cpus == 1 for w in t.workers)
    assert d.links[0].ab.bandwidth_bps == t.links[0].ab.bandwidth_bps // 4
    capped = dilate_topology(t, 4, cap_cpu=True)
    assert all(capped.nodes[w].cpus == 0.25 for w in t.workers)
    assert all(capped.nodes[s].cpus is None for s in t.switches)


def test_cfs_period_keeps_the_quota_legal_and_short():
    from testbed.runtime.cgroups import cfs

    assert cfs(1.0) == (10_000, 10_000)
    assert cfs(2.5) == (25_000, 10_000)
    assert cfs(0.125) == (1_250, 10_000)            # a dilated worker: waits at most 10 ms
    quota, period = cfs(0.05)
    assert quota >= 1_000 and quota / period == pytest.approx(0.05, rel=0.01)


def test_cfs_period_stops_at_the_kernels_one_second():
    """Below 0.001 core the quota cannot shrink and the period cannot grow (the kernel's limits):
    the group gets 0.001 core, and dilation's reasons say so (a k=16 fat-tree at auto: s = 1447)."""
    from testbed.runtime.cgroups import cfs
    from testbed.topology import dilation

    assert cfs(1 / 1446.7) == (1_000, 1_000_000)
    assert cfs(0.001) == (1_000, 1_000_000)
    assert cfs(0.002) == (1_000, 500_000)
    choice = dilation._with_cap_reason(dilation.Choice(1446.7, "auto", 512.0, None, ("auto",)))
    assert "slows by 1000, not 1446.7" in choice.reasons[-1] and "1.45x faster" in choice.reasons[-1]
    assert "at the least" not in dilation._with_cap_reason(dilation.Choice(900.0, "auto", 512.0, None, ())).reasons[-1]


def test_cfs_burst_only_where_the_period_is_stretched():
    """A quota under the kernel's 1 ms stretches the period to s ms; only there a group may carry one
    period's unused quota (cgroups.cfs_burst's docstring says why)."""
    from testbed.runtime.cgroups import cfs, cfs_burst

    assert cfs_burst(1.0) == 0 and cfs_burst(0.125) == 0 and cfs_burst(0.1) == 0
    assert cfs_burst(1 / 31.4) == cfs(1 / 31.4)[0] == 1_000


# -- several hosts: one factor for all, the most loaded machine decides ---------------------------------------

from testbed.topology.dilation import Machine, choose_over_machines  # noqa: E402


def _machines(t, split: int, cores: tuple[int, int], constants=(HOST_BOUND, HOST_BOUND), shared: bool = False):
    w = list(t.workers)
    if shared:   # emulated hosts: one boot id, one machine
        return [Machine(("h1", "h2"), tuple(w), cores[0], 0, constants[0])]
    return [Machine(("h1",), tuple(w[:split]), cores[0], 0, constants[0]),
            Machine(("h2",), tuple(w[split:]), cores[1], 0, constants[1])]


def test_two_hosts_sharing_one_machine_count_as_one_machine():
    t, plan = _ft()
    t = replace(t, host_rate="this-machine")
    one = choose("auto", t, plan, n_gpus=0, n_cpus=2, constants=HOST_BOUND)
    both = choose_over_machines("auto", t, plan, _machines(t, 8, (2, 2), shared=True))
    assert both.factor == one.factor == pytest.approx(8.0) and both.compute == 8.0
    assert any(r.startswith("h1+h2: 16 ranks share 2 CPU core") for r in both.reasons)


def test_two_machines_the_most_loaded_decides():
    t, plan = _ft()
    t = replace(t, host_rate="this-machine")   # the old accounting: each machine's share of its host cost
    even = choose_over_machines("auto", t, plan, _machines(t, 8, (2, 2)))
    assert even.compute == 4.0 and even.factor == pytest.approx(4.0, rel=0.05)   # 8 ranks on 2 cores each
    uneven = choose_over_machines("auto", t, plan, _machines(t, 12, (2, 2)))
    assert uneven.compute == 6.0 and uneven.factor == pytest.approx(6.0, rel=0.05)
    big = choose_over_machines("auto", t, plan, _machines(t, 8, (64, 64)))
    assert big.factor == 1.0
    # network-bound hosts (the default): each machine's ranks at the links' full rate, with the margin
    nb = choose_over_machines("auto", replace(t, host_rate=None), plan, _machines(t, 12, (2, 2)))
    link_rate = 10e9 / 8 * goodput(1500)
    assert nb.network == pytest.approx(HOST_MARGIN * 12 * link_rate * HOST_BOUND.beta_s_per_byte / 2, rel=0.01)


def test_an_uncalibrated_machine_is_named_and_only_its_compute_counts():
    t, plan = _ft()
    c = choose_over_machines("auto", t, plan, _machines(t, 8, (4, 8), constants=(HOST_BOUND, None)))
    assert c.compute == 2.0 and any(r.startswith("h2: traffic not accounted for") for r in c.reasons)
    assert any(r.startswith("h1: its ranks' data-parallel traffic") for r in c.reasons)


def test_fixed_factor_caps_cpu_against_the_machines_compute():
    t, plan = _ft()
    assert not choose_over_machines(4, t, plan, _machines(t, 8, (2, 2))).cap_cpu      # 8 ranks / 2 cores
    capped = choose_over_machines("16", t, plan, _machines(t, 8, (2, 2)))
    assert capped.cap_cpu and capped.factor == 16.0 and capped.reasons[0] == "fixed at 16"
    assert choose_over_machines("none", t, plan, _machines(t, 8, (2, 2))).factor == 1.0
    with pytest.raises(ValueError):
        choose_over_machines("0.5", t, plan, _machines(t, 8, (2, 2)))
