"""The probe: injected via PYTHONPATH, lazy, chains to an existing sitecustomize, counts steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.jobs.probe import PROBE_PATH

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, code, extra_path=None, probe_dir=True, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_")}
    env["PYTHONPATH"] = os.pathsep.join([PROBE_PATH] + ([str(extra_path)] if extra_path else []))
    if probe_dir:
        env["TESTBED_PROBE_DIR"] = str(tmp_path / "probe")
    env.update(env_extra or {})
    script = tmp_path / "user_script.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def _records(tmp_path):
    files = sorted((tmp_path / "probe").glob("rank-*.jsonl"))
    return {f.name: [json.loads(l) for l in f.read_text().splitlines()] for f in files}


def test_no_torch_no_file_and_no_import(tmp_path):
    r = _run(tmp_path, "import sys\nprint('torch' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert not list((tmp_path / "probe").glob("*.jsonl")) if (tmp_path / "probe").exists() else True


def test_chains_existing_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = 42\n")
    r = _run(tmp_path, "import builtins\nprint(getattr(builtins, 'CHAINED', None))\n", extra_path=other)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "42"


STEPS_CODE = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
m = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range({steps}):
    opt.zero_grad(); m(torch.randn(5, 8)).sum().backward(); opt.step()
t = torch.ones(1000)
dist.all_reduce(t)
dist.broadcast(t, 0)
dist.destroy_process_group()
print("ok")
"""


def test_records_exact_steps_and_collectives(tmp_path):
    import random

    steps = 7
    code = STEPS_CODE.format(port=random.randint(30000, 40000), steps=steps)
    r = _run(tmp_path, code, env_extra={"RANK": "0", "WORLD_SIZE": "1"})
    assert r.returncode == 0, r.stderr
    recs = _records(tmp_path)
    assert list(recs) == ["rank-0.jsonl"]
    rr = recs["rank-0.jsonl"]
    assert rr[0]["ev"] == "start" and rr[-1]["ev"] == "end"
    s = [x for x in rr if x["ev"] == "step"]
    assert len(s) == steps and [x["n"] for x in s] == list(range(1, steps + 1))
    assert all(x["samples"] == 5 for x in s)
    colls = [x for x in rr if x["ev"] == "coll"]
    ddp = [c for c in colls if c["src"] == "ddp"]
    api = [c for c in colls if c["src"] == "api"]
    assert len(ddp) == steps and all(c["bytes"] == (8 * 4 + 4) * 4 for c in ddp)
    assert [(c["op"], c["bytes"]) for c in api] == [("all_reduce", 4000), ("broadcast", 4000)]
    assert all(c["dur"] >= 0 for c in colls)


def test_no_probe_dir_means_no_patching(tmp_path):
    r = _run(tmp_path, "import torch, torch.distributed as d\nprint(hasattr(d.all_reduce, '__testbed_probe__'))\n",
             probe_dir=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# -- the emulated clock ----------------------------------------------------------------------------------

CLOCK_CODE = """
import json, time
import _testbed_probe as probe
t0, w0, m0, n0 = time.perf_counter(), time.time(), time.monotonic(), time.perf_counter_ns()
r0 = probe._real_perf()
time.sleep({sleep})   # the feature: the span every clock is asked to measure, not a wait
out = {{"perf": time.perf_counter() - t0, "time": time.time() - w0, "mono": time.monotonic() - m0,
       "ns": (time.perf_counter_ns() - n0) / 1e9, "real": probe._real_perf() - r0}}
print(json.dumps(out))
"""


# The bands of the clock tests, measured 2026-12-02: CLOCK_CODE and TIMEOUT_CODE run through _run as
# the tests do, 5 times each, load 3.2-3.5 on 2 cores (`make test-rest` beside it):
#   1 s emulated at s=4: 4.0001-4.009 s real; every clock within 7e-5 of real/4
#   0.3 s at s=1 and with the clock opted out: 0.3001-0.3031 s real; perf within 5e-5 of real
#   torch's 1 s store timeout at s=4: 1.0024-1.006 s real
# A sleep is never shorter than asked, so the lower bounds sit just under it (a clock that runs
# fast fails them). The upper bounds are the sleep's lateness on a loaded machine (a run is
# preempted), far below the other outcome each test rules out (1 s emulated taking 8 s; 0.3 s
# taking 1.2 s at s=4; torch's timeout taking 4 s). The clocks are read one after another: a
# preemption between two reads is up to 2% of the second slept (20 ms), never the 75% of a
# clock left undilated.
@pytest.mark.timing
def test_emulated_clock_runs_s_times_slower(tmp_path):
    # sleep 1 s of emulated time at s=4: ~4 s of wall time, every clock says ~1 s
    r = _run(tmp_path, CLOCK_CODE.format(sleep=1.0), env_extra={"TESTBED_TIME_DILATION": "4"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 3.9 <= out["real"] <= 4.6, out   # measured 4.0001-4.009 (above)
    for k in ("perf", "time", "mono", "ns"):
        assert out[k] == pytest.approx(out["real"] / 4, rel=0.02), (k, out)   # measured within 7e-5


@pytest.mark.timing
def test_no_dilation_or_opt_out_keeps_real_time(tmp_path):
    for extra in ({"TESTBED_TIME_DILATION": "1"}, {"TESTBED_TIME_DILATION": "4", "TESTBED_EMULATED_CLOCK": "0"}):
        r = _run(tmp_path, CLOCK_CODE.format(sleep=0.3), env_extra=extra)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        # measured 0.3001-0.3031 s, perf within 5e-5 of it (above)
        assert 0.29 <= out["real"] <= 0.6 and out["perf"] == pytest.approx(out["real"], rel=0.02), (extra, out)


TIMEOUT_CODE = """
import json, time, datetime, random, sys, types
import torch.distributed as dist
# torch's own timeouts: a store lookup that can never succeed gives up after its real timeout
store = dist.TCPStore("127.0.0.1", random.randint(40000, 50000), 1, True, timeout=datetime.timedelta(seconds=1))
t0 = time.perf_counter()
import _testbed_probe as probe
r0 = probe._real_perf()
try:
    store.get("never-set")
except Exception:
    pass
waited_real = probe._real_perf() - r0
# the Python parts of torch.distributed read real time too
mod = types.ModuleType("torch.distributed.fake_testbed_check")
exec("import time\\ndef now():\\n    return time.monotonic()", mod.__dict__)
a, ra = mod.now(), probe._real_mono()
print(json.dumps({"waited_real": waited_real, "torch_sees_real": abs(a - ra) < 0.05,
                  "user_sees": time.monotonic(), "real": probe._real_mono()}))
"""


def test_torch_timeouts_stay_real(tmp_path):
    r = _run(tmp_path, TIMEOUT_CODE, env_extra={"TESTBED_TIME_DILATION": "4"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0.8 <= out["waited_real"] <= 2.5, out           # 1 s real, not 4 s (measured 1.0024-1.006 s)
    assert out["torch_sees_real"], out
    assert out["user_sees"] < out["real"], out              # the user's clock lags behind


def test_probe_records_real_time_and_the_clock(tmp_path):
    import random

    import time

    code = STEPS_CODE.format(port=random.randint(30000, 40000), steps=3)
    before = time.time()
    r = _run(tmp_path, code, env_extra={"RANK": "0", "WORLD_SIZE": "1", "TESTBED_TIME_DILATION": "8"})
    after = time.time()
    assert r.returncode == 0, r.stderr
    rr = _records(tmp_path)["rank-0.jsonl"]
    assert rr[0]["clock"] == {"emulated": True, "factor": 8.0}
    assert before <= rr[0]["t"] <= after, (before, rr[0]["t"], after)   # this machine's wall time, taken in the run
    colls = [x for x in rr if x["ev"] == "coll"]
    assert all(c["g"] and c["gn"] == 1 and c["be"] == "gloo" for c in colls)
    assert [c["seq"] for c in colls] == list(range(1, len(colls) + 1))


BURST_CODE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29731", rank=int(os.environ["RANK"]), world_size=2)
t = torch.ones(1000)
dist.all_reduce(t)
assert t[0].item() == 2.0
dist.destroy_process_group()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace of its own for the two ranks)")
@pytest.mark.parametrize("burst", [3, 0])
def test_the_latency_burst_runs_on_every_rank_after_init_and_is_not_the_job_s(tmp_path, burst):
    # two gloo ranks in a network namespace of their own (loopback only)
    script = tmp_path / "job.py"
    script.write_text(BURST_CODE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_")}
    env.update({"PYTHONPATH": PROBE_PATH, "TESTBED_PROBE_DIR": str(tmp_path / "probe"),
                "TESTBED_LATENCY_BURST": str(burst)})
    both = (f"ip link set lo up && (RANK=0 {sys.executable} {script} & RANK=1 {sys.executable} {script} & "
            "wait %1 && wait %2)")
    r = subprocess.run(["unshare", "-n", "sh", "-c", both], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _records(tmp_path)
    assert sorted(recs) == ["rank-0.jsonl", "rank-1.jsonl"]
    for name, rr in recs.items():
        colls = [x for x in rr if x["ev"] == "coll"]
        got = [(c["op"], c["seq"]) for c in colls]
        assert got == [("latency_burst", i) for i in range(1, burst + 1)] + [("all_reduce", burst + 1)], (name, got)
        assert all(c["bytes"] == 4096 and c["src"] == "probe" and c["dur"] > 0 for c in colls[:-1])


def test_the_probes_own_operations_are_not_recorded_for_a_replay(tmp_path, monkeypatch):
    """A --real run's leader records its announcements for `testbed run --replay`; the probe's burst is
    announced to the phantoms (they take their part) but is not the job's: it stays out of the trace."""
    import io

    from testbed.jobs.probe import _testbed_mirror as mirror

    trace = io.BytesIO()
    monkeypatch.setattr(mirror, "_trace", trace)
    monkeypatch.setattr(mirror, "_fds", [])
    with mirror.probes_own():
        assert mirror._tls.probe
    assert not mirror._tls.probe
    mirror._announce({"ev": "op", "op": "allreduce", "g": 0, "probe": True})
    assert trace.getvalue() == b""
    mirror._announce({"ev": "op", "op": "allreduce", "g": 0})
    assert b'"op":"allreduce"' in trace.getvalue() and b"probe" not in trace.getvalue()
