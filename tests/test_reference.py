"""The reference model against closed forms (testbed.topology.reference). Pure, no root."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.topology.fairness import max_min_rates
from testbed.topology.loader import load_topology_text
from testbed.topology.plan import plan_network
from testbed.topology.reference import (
    COLLECTIVES, GLOO_TURNS_BYTES, NETWORK_ONLY, MachineConstants, ModelError, bus_factor, cost_terms, goodput,
    phases, predict, ring_time,
)

G = goodput(1500)   # 1448 / 1514


def topo(text: str):
    t = load_topology_text(text, "<test>")
    return t, plan_network(t)


def star(n: int, bw: str = "10gbit", delay: str = "0s"):
    return topo(f"name: s\ngenerator: star\nparams: {{n: {n}}}\ntiers:\n  host: {{bandwidth: {bw}, delay: {delay}}}\n")


def test_goodput_is_the_tcp_payload_share():
    assert G == pytest.approx(1448 / 1514)
    assert goodput(9000) == pytest.approx(8948 / 9014)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 12), size=st.integers(1024, 1 << 28), gbit=st.sampled_from([1, 5, 10, 40]))
def test_ring_all_reduce_on_a_star_is_the_closed_form(n, size, gbit):
    t, plan = star(n, f"{gbit}gbit")
    p = predict(t, plan, "all_reduce", size, t.workers, NETWORK_ONLY)
    assert p.time_s == pytest.approx(ring_time(n, size, gbit * 1e9 * G), rel=1e-9)
    assert p.lo_s == p.hi_s == p.time_s and p.placements == "single path"


def test_alpha_and_delay_make_the_latency_term():
    t, plan = star(4, "10gbit", "5us")
    c = MachineConstants(alpha_s=100e-6, beta_s_per_byte=0.0)
    p = predict(t, plan, "all_reduce", 24, t.workers, c)   # 6 float32s: a message every step
    # 2(n-1) steps, each alpha + a round trip over two hops of 5 us (gloo: ready notice, then data)
    assert p.time_s == pytest.approx(6 * (100e-6 + 2 * 10e-6), rel=1e-3)
    assert p.latency_s == pytest.approx(6 * (100e-6 + 2 * 10e-6), abs=1e-7) and p.bandwidth_s < 1e-7
    assert p.delay_s == pytest.approx(6 * 2 * 10e-6) and p.software_s == pytest.approx(6 * 100e-6, abs=1e-7)
    nccl = predict(t, plan, "all_reduce", 0, t.workers, c, backend="nccl")
    assert nccl.time_s == pytest.approx(6 * (100e-6 + 10e-6))   # NCCL's receivers post ahead: one way
    assert predict(t, plan, "all_reduce", 0, t.workers, c).time_s == 0   # gloo returns at once


@pytest.mark.parametrize("n,nbytes,messages", [
    (16, 8, 2), (16, 4, 1), (16, 120, 30), (16, 4096, 30), (16, 1 << 20, 30), (4, 8, 2), (4, 24, 6), (2, 8, 2),
])
def test_gloo_sends_no_message_for_an_empty_segment(n, nbytes, messages):
    """gloo cuts an all_reduce into 2n segments and skips the empty ones: e < 2(n-1) float32s
    cost e messages per phase on the busiest rank (the model counts one per step, 2(n-1) steps;
    16 ranks, 8 bytes: measured 1.2-2.2 ms against 23 ms when every step paid a message).
    Unshaped links: no transfer for the segments' costs to overlap with."""
    t, plan = star(n, "null", "5us")
    c = MachineConstants(alpha_s=100e-6, beta_s_per_byte=0.0)
    p = predict(t, plan, "all_reduce", nbytes, t.workers, c)
    delays = 2 * (n - 1) * 2 * 10e-6          # the data still crosses every hop in turn
    assert p.latency_s == pytest.approx(messages * 100e-6 + delays)
    assert p.delay_s == pytest.approx(delays) and p.software_s == pytest.approx(messages * 100e-6)
    assert cost_terms("all_reduce", nbytes, n)[0] == pytest.approx(messages)


@pytest.mark.parametrize("n,nbytes,k", [(16, 4 << 20, 2), (16, 32 << 20, 2), (16, 64 << 20, 4), (4, 1 << 20, 2),
                                         (4, 64 << 20, 16), (2, 64 << 10, 2)])
def test_gloo_overlaps_a_segments_cost_with_the_other_segments_transfer(n, nbytes, k):
    """gloo's ring all_reduce sends a step's bytes in k segments of at most 1 MiB (at least 2n in
    all), two in flight: one segment's software cost (alpha / 2: alpha is a step of two segments)
    is paid while the other is on the wire. A step takes max(transfer + alpha/2, k alpha/2 +
    transfer/k), not alpha + transfer; the path delays stay one after the other."""
    from testbed.topology.reference import gloo_segments

    assert gloo_segments(nbytes, n) == k
    t, plan = star(n, "10gbit", "5us")
    alpha = 700e-6
    p = predict(t, plan, "all_reduce", nbytes, t.workers, MachineConstants(alpha_s=alpha, beta_s_per_byte=0.0))
    wire = nbytes / n / (10e9 / 8 * G)
    step = max(wire + alpha / 2, k * alpha / 2 + wire / k)
    assert p.time_s == pytest.approx(2 * (n - 1) * (step + 2 * 10e-6), rel=1e-9)
    assert p.bandwidth_s == pytest.approx(2 * (n - 1) * wire, rel=1e-9)
    serial = predict(t, plan, "all_reduce", nbytes, t.workers, MachineConstants(alpha_s=alpha, beta_s_per_byte=0.0),
                     backend="nccl")   # NCCL's ring has no such segments: alpha under each step's transfer
    assert serial.bandwidth_s == pytest.approx(p.bandwidth_s, rel=1e-9)
    assert p.time_s < 2 * (n - 1) * (alpha + wire + 2 * 10e-6)


@pytest.mark.parametrize("op", ["send_recv", "all_gather", "broadcast"])
@pytest.mark.parametrize("nbytes", [1 << 10, 64 << 10, 1 << 20, 16 << 20])
def test_a_messages_cost_runs_while_its_bytes_move(op, nbytes):
    """One message a step (everything but gloo's segmented ring): a step takes its path delays and
    the longer of alpha and its transfer, not their sum. Measured: 1 MiB steps took the links'
    time with a burst alpha of 140 us beside a 450 us transfer (docs/fidelity.md)."""
    t, plan = star(2, "10gbit", "5us")
    alpha = 300e-6
    p = predict(t, plan, op, nbytes, t.workers, MachineConstants(alpha_s=alpha, beta_s_per_byte=0.0))
    links = predict(t, plan, op, nbytes, t.workers, NETWORK_ONLY)
    wire = links.bandwidth_s
    assert wire == pytest.approx((nbytes / 2 if op == "all_gather" else nbytes) / (10e9 / 8 * G), rel=1e-9)
    assert p.time_s == pytest.approx(links.delay_s + max(alpha, wire), rel=1e-9)
    assert p.software_s == pytest.approx(max(0.0, alpha - wire), abs=1e-12)   # what alpha adds beyond the wire
    if wire > alpha:   # the transfer hides alpha whole: the links' time
        assert p.time_s == pytest.approx(links.time_s, rel=1e-9)
    else:              # alpha binds: the path delays and alpha, the bytes under it
        assert p.time_s == pytest.approx(links.delay_s + alpha, rel=1e-9)


def test_host_cost_limits_a_fast_link_smoothly():
    t, plan = star(2, "100gbit")
    beta = 1.28e-9
    c = MachineConstants(alpha_s=0.0, beta_s_per_byte=beta)
    p = predict(t, plan, "all_reduce", 64 << 20, t.workers, c)
    per_net = 1 / (100e9 / 8 * G)
    assert p.time_s == pytest.approx((64 << 20) * (per_net ** 6 + beta ** 6) ** (1 / 6))
    assert "host" in p.bottleneck
    # an unshaped link: the host alone
    t, plan = topo("name: u\ngenerator: star\nparams: {n: 2}\ntiers:\n  host: {bandwidth: null, delay: 0s}\n")
    assert predict(t, plan, "all_reduce", 1 << 20, t.workers, c).time_s == pytest.approx((1 << 20) * beta)


def test_leaf_spine_four_to_one_oversubscribed():
    # 4 leaves x 4 hosts, 2 spines; uplinks sized for 4:1: 4 x 10G / (2 x 4) = 5G each.
    t, plan = topo("name: ls\ngenerator: leaf-spine\nparams: {leaves: 4, spines: 2, hosts_per_leaf: 4, "
                   "oversubscription: 4}\ntiers:\n  host: {bandwidth: 10gbit, delay: 0s}\n"
                   "  leaf-spine: {delay: 0s}\n")
    S = 64 << 20
    ring = predict(t, plan, "all_reduce", S, t.workers, NETWORK_ONLY)
    # the ring crosses each leaf's uplinks once per direction: one flow on a 5G uplink
    assert ring.time_s == pytest.approx(ring_time(16, S, 5e9 * G), rel=1e-9)
    assert "leaf" in ring.bottleneck and "spine" in ring.bottleneck
    a2a = predict(t, plan, "all_to_all", S, t.workers, NETWORK_ONLY, backend="nccl")   # every send at once
    # each leaf sends 4 hosts x 12 remote peers = 48 flows of S/16 over two 5G uplinks
    balanced = (S / 16) / (2 * 5e9 / 8 * G / 48)
    assert a2a.lo_s >= balanced * (1 - 1e-9)
    assert a2a.lo_s == pytest.approx(balanced, rel=0.35)
    assert a2a.hi_s > a2a.lo_s            # ECMP hashing matters here: both bounds are given
    assert a2a.hi_s <= 2 * balanced * (1 + 1e-9)   # at worst everything on one uplink
    assert "sampled" in a2a.placements


def test_gloo_all_to_all_takes_a_pairs_two_directions_in_turn():
    """gloo's all_to_all: a pair's "ready to receive" notice queues behind the data already on its
    connection, so its two directions take turns (measured on a 2-worker star: they alternate at the
    link's full rate). Two ranks: each half of the buffer in turn, twice NCCL's time. Four on a star:
    each phase puts two flows of S/4 on the busiest host link, where NCCL's one phase puts three."""
    S = 64 << 20
    for n, ratio in ((2, 2.0), (4, 4 / 3)):
        t, plan = topo(f"name: s\ngenerator: star\nparams: {{n: {n}}}\ntiers:\n  host: {{bandwidth: 10gbit, delay: 0s}}\n")
        gloo = predict(t, plan, "all_to_all", S, t.workers, NETWORK_ONLY)
        nccl = predict(t, plan, "all_to_all", S, t.workers, NETWORK_ONLY, backend="nccl")
        assert nccl.time_s == pytest.approx((n - 1) * S / n / (10e9 / 8 * G), rel=1e-9)
        assert gloo.time_s == pytest.approx(ratio * nccl.time_s, rel=1e-9), n
    ph = phases("all_to_all", S, 5, "gloo")
    flows = [(f.src, f.dst) for p in ph for f in p.flows]
    assert len(ph) == 2 and sorted(flows) == sorted((a, b) for a in range(5) for b in range(5) if a != b)
    assert all((f.dst, f.src) not in {(g.src, g.dst) for g in p.flows} for p in ph for f in p.flows)
    assert cost_terms("all_to_all", S, 5, "gloo")[0] == 4   # n-1 messages, half in each phase
    # 512 KiB each way went together on such a star (measured): the turns start from GLOO_TURNS_BYTES
    t, plan = topo("name: s\ngenerator: star\nparams: {n: 2}\ntiers:\n  host: {bandwidth: 10gbit, delay: 2us}\n")
    for size, turns in ((1 << 20, 1), (2 * GLOO_TURNS_BYTES, 2)):
        gloo = predict(t, plan, "all_to_all", size, t.workers, NETWORK_ONLY)
        alone = predict(t, plan, "send_recv", size // 2, t.workers, NETWORK_ONLY)   # one direction's bytes
        assert gloo.time_s == pytest.approx(turns * alone.time_s, rel=1e-9), size
    # below GLOO_TURNS_BYTES each way, one phase with every send, whatever the path
    assert len(phases("all_to_all", 2 * GLOO_TURNS_BYTES - 2, 2, "gloo")) == 1
    assert len(phases("all_to_all", 5 * GLOO_TURNS_BYTES, 5, "gloo")) == 2


def test_dumbbell_bottleneck():
    t, plan = topo("name: d\ngenerator: dumbbell\nparams: {left: 2, right: 2}\ntiers:\n"
                   "  host: {bandwidth: 10gbit, delay: 0s}\n  core: {bandwidth: 1gbit, delay: 1ms}\n")
    S = 16 << 20
    p = predict(t, plan, "all_reduce", S, t.workers, NETWORK_ONLY)
    # one ring flow crosses the core in each direction: it runs at 1G
    assert p.bandwidth_s == pytest.approx(6 * (S / 4) / (1e9 / 8 * G))
    assert p.latency_s == pytest.approx(6 * 2 * 1e-3)   # a round trip across the core, each step
    assert p.delay_s == pytest.approx(p.latency_s) and p.software_s == pytest.approx(0, abs=1e-12)   # (no alpha)
    assert "s0->s1" in p.bottleneck or "s1->s0" in p.bottleneck
    # two flows across the core in the same direction share it
    x = predict(t, plan, "send_recv", S, ["w0", "w2"], NETWORK_ONLY)
    assert x.bandwidth_s == pytest.approx(S / (1e9 / 8 * G))


def test_fat_tree_ring_does_not_depend_on_hashing():
    t, plan = topo("name: ft\ngenerator: fat-tree\nparams: {k: 4}\ntiers:\n  host: {bandwidth: 10gbit, delay: 0s}\n"
                   "  edge-agg: {bandwidth: 10gbit, delay: 0s}\n  agg-core: {bandwidth: 10gbit, delay: 0s}\n")
    p = predict(t, plan, "all_reduce", 16 << 20, t.workers, NETWORK_ONLY)
    assert p.lo_s == pytest.approx(p.hi_s)
    assert p.time_s == pytest.approx(ring_time(16, 16 << 20, 10e9 * G))


def test_every_collective_has_phases_and_a_positive_time():
    t, plan = star(8)
    c = MachineConstants(alpha_s=50e-6, beta_s_per_byte=1e-9)
    for op in COLLECTIVES:
        p = predict(t, plan, op, 1 << 20, t.workers, c)
        assert p.time_s > 0 and p.lo_s <= p.time_s <= p.hi_s, op
    assert len(phases("broadcast", 1, 8)) == 3 and len(phases("barrier", 1, 5)) == 3
    assert phases("all_reduce", 1, 1) == []
    with pytest.raises(ModelError):
        phases("all_shuffle", 1, 4)


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(14 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1


def test_max_min_fairness():
    # two flows share A (cap 10); the second also crosses B (cap 2): it gets 2, the first the rest
    assert max_min_rates([["A"], ["A", "B"]], {"A": 10.0, "B": 2.0}) == [8.0, 2.0]
    assert max_min_rates([[], ["A"]], {"A": 4.0}) == [math.inf, 4.0]
    assert max_min_rates([["A"], ["A"], ["A"]], {"A": 3.0}) == [1.0, 1.0, 1.0]


def test_error_is_zero_inside_the_bounds():
    t, plan = star(2)
    p = predict(t, plan, "all_reduce", 1 << 20, t.workers, NETWORK_ONLY)
    assert p.error(p.time_s) == 0
    assert p.error(p.time_s * 1.2) == pytest.approx(0.2)
    assert p.error(p.time_s * 0.5) == pytest.approx(-0.5)


def test_with_alpha_replaces_all_reduce_s_and_keeps_the_others_ratio():
    from testbed.topology.reference import MachineConstants, with_alpha

    c = MachineConstants(200e-6, 1e-9, "cal", (("all_reduce", 200e-6, 1e-9), ("broadcast", 100e-6, 2e-9)), 0.03)
    w = with_alpha(c, 600e-6, 0.1, "measured")
    assert w.alpha_s == 600e-6 and w.beta_s_per_byte == 1e-9 and w.spread == 0.1
    assert w.for_op("broadcast") == (pytest.approx(300e-6), 2e-9) and w.for_op("all_reduce")[0] == pytest.approx(600e-6)
    assert w.source.startswith("alpha measured; cal")
