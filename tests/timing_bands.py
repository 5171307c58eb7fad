"""The distributions the bands of the `timing` tests come from: each timed quantity of
tests/test_shaping.py, tests/test_delayline.py and tests/test_faults.py measured N times (N=5 by
default), alone, as root. Prints min/median/max and writes them to ./timing_bands.json.

    sudo .venv/bin/python tests/timing_bands.py

Run it on a quiet machine of the kind CI uses after a change to shaping, the delay line or the
fault controls, and move the bands (stated next to each assertion) if the distribution moved.
(`16 workers up`: `pytest -s tests/test_runtime_netns.py -k sixteen` prints it.)
"""
import json, os, shutil, statistics, sys, tempfile, time, uuid
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE)); sys.path.insert(0, str(HERE.parent))
os.environ["TESTBED_STATE_DIR"] = tempfile.mkdtemp(prefix="meas-state-")
N = int(os.environ.get("N", "5"))
out = {}
def rec(k, v):
    out.setdefault(k, []).append(v); print(k, v, flush=True)

import test_shaping as ts
from testbed.net import netns, rtnl, shaping  # noqa: F401  (loaded as test_shaping loads them)
from testbed.topology.model import LinkProfile
caps = ts.caps()
for rate in (100e6, 1e9, 5e9):
    p = ts.Pair("m%d" % int(rate / 1e6))
    try:
        shaping.apply(p.ipr_a, "eth0", LinkProfile(bandwidth_bps=int(rate)), caps)
        for _ in range(N):
            rec(f"htb_{rate/1e6:g}M_ratio", p.iperf(seconds=2) / (rate * ts.GOODPUT_RATIO))
    finally:
        p.close()
p = ts.Pair("mc")
try:
    # as test_change_in_place_and_clear times them: a change of rate just after a ping, the median
    # of five re-layouts just after an iperf3 second
    old, new = LinkProfile(bandwidth_bps=100 * 10**6), LinkProfile(bandwidth_bps=500 * 10**6)
    lossy = new.with_changes(loss=0.5)
    for i in range(N):
        shaping.apply(p.ipr_a, "eth0", old, caps)
        p.ping(3, 0.01)
        t0 = time.perf_counter(); shaping.change(p.ipr_a, "eth0", old, new, caps); rec("shaping_change_s", time.perf_counter() - t0)
        rec("htb_500M_1s_ratio", p.iperf(seconds=1) / (500e6 * ts.GOODPUT_RATIO))
        took = []
        for a, b in ((new, lossy), (lossy, new), (new, lossy), (lossy, new), (new, lossy)):
            t0 = time.perf_counter(); shaping.change(p.ipr_a, "eth0", a, b, caps); took.append(time.perf_counter() - t0)
        rec("shaping_relayout_first_s", took[0])
        rec("shaping_relayout_median_s", statistics.median(took))
finally:
    p.close()

import test_delayline as td
from testbed.net import delayline
for d in (0.001, 0.010, 0.050):
    p = td.DelayPair("m%d" % int(d * 1000), LinkProfile(delay_s=d), LinkProfile(delay_s=d))
    try:
        for _ in range(N):
            rec(f"dl_rtt_{d*1e3:g}ms_median_over_2d", statistics.median(p.ping(20 if d < 0.05 else 10, 0.01)) / (2 * d))
    finally:
        p.close()
p = td.DelayPair("ma", LinkProfile(delay_s=0.002), LinkProfile(delay_s=0.008))
try:
    for i in range(N):
        rec("dl_asym_10ms_median_s", statistics.median(p.ping(10)))
    for i in range(20):
        a, b = (LinkProfile(delay_s=0.020), LinkProfile(delay_s=0.005)) if i % 2 == 0 else (LinkProfile(delay_s=0.002), LinkProfile(delay_s=0.008))
        t0 = time.perf_counter(); delayline.update(p.link, a, b); rec("dl_update_s", time.perf_counter() - t0)
finally:
    p.close()
p = td.DelayPair("mt", LinkProfile(delay_s=0.001), LinkProfile(delay_s=0.001))
try:
    for _ in range(N):
        rec("dl_iperf_1ms_bps", p.iperf(seconds=2))
    shaping.apply(p.ipr_a, "eth0", LinkProfile(bandwidth_bps=10**9, delay_s=0.001), caps)
    for _ in range(N):
        rec("dl_htb_1G_ratio", p.iperf(seconds=2) / (10**9 * 1448 / 1514))
finally:
    p.close()

from testbed import lifecycle
from testbed.faults import control
from testbed.topology.loader import load_topology
import test_faults as tf
topo = load_topology(*tf.STAR)
name = "m" + uuid.uuid4().hex[:6]
lifecycle.up(topo, name)
try:
    control.link_set(name, "w1", "s0", {"bandwidth_bps": 200_000_000}, "A->B")
    for i in range(20):
        t0 = time.monotonic(); control.link_down(name, "w1", "s0"); rec("fault_link_down_s", time.monotonic() - t0)
        t0 = time.monotonic(); control.link_up(name, "w1", "s0"); rec("fault_link_up_s", time.monotonic() - t0)
        bw = 100_000_000 if i % 2 == 0 else 200_000_000
        t0 = time.monotonic(); control.link_set(name, "w0", "s0", {"bandwidth_bps": bw}, "A->B"); rec("fault_link_set_s", time.monotonic() - t0)
    control.link_reset(name, "w0", "s0")
    for _ in range(N):
        rec("fault_iperf_200M_ratio", tf._iperf(name, topo, "w0", "w1") / 200e6)
finally:
    lifecycle.down(name)
shutil.rmtree(os.environ["TESTBED_STATE_DIR"], ignore_errors=True)
summary = {k: {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in out.items()}
json.dump({"raw": out, "summary": summary}, open("timing_bands.json", "w"), indent=1)
for k, s in summary.items():
    print(f"{k:34s} n={s['n']:2d} min={s['min']:.4g} med={s['median']:.4g} max={s['max']:.4g}")
