"""The probe: injected via PYTHONPATH, lazy, chains to an existing sitecustomize, counts steps."""

import contextlib
import json
import os
import signal
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


def _two_ranks(tmp_path, code, timeout, **extra):
    """Runs `code` as ranks 0 and 1 under the probe (records in tmp_path/probe; `extra`: more of the
    ranks' environment) in a network namespace of their own (loopback only). On a timeout both ranks
    are ended with their shell (a session of their own), not left hanging; the test fails with what
    they said."""
    script = tmp_path / "job.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_")}
    env.update({"PYTHONPATH": PROBE_PATH, "TESTBED_PROBE_DIR": str(tmp_path / "probe"), **extra})
    both = (f"ip link set lo up && (RANK=0 {sys.executable} {script} & RANK=1 {sys.executable} {script} & "
            "wait %1 && wait %2)")
    p = subprocess.Popen(["unshare", "-n", "sh", "-c", both], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the two ranks did not end within {timeout} s (hung); they said:\n{err[-3000:]}")
    except BaseException:   # a Ctrl-C, pytest-timeout: the ranks go too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


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
    r = _two_ranks(tmp_path, BURST_CODE, timeout=120, TESTBED_LATENCY_BURST=str(burst))
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


# -- DDP's buckets, timed from the job's wrapped group -------------------------------------------------

OPS_CODE = """
import datetime, io, json, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
r = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29733", rank=r, world_size=2)
t = torch.ones(8) * (r + 1)
dist.all_reduce(t); assert t[0] == 3
dist.broadcast(t, 0)
out = [torch.zeros(8) for _ in range(2)]; dist.all_gather(out, t); assert out[1][0] == 3
flat = torch.zeros(16); dist.all_gather_into_tensor(flat, t)
shard = torch.zeros(4); dist.reduce_scatter_tensor(shard, torch.ones(8)); assert shard[0] == 2
a2a = torch.zeros(4); dist.all_to_all_single(a2a, torch.arange(4.0) + 10 * r); assert a2a.tolist() == [2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r]
if r == 0:
    dist.send(torch.ones(3), 1)
else:
    x = torch.zeros(3); dist.recv(x, 0); assert x.sum() == 3
got = torch.zeros(2)
ops = [dist.P2POp(dist.isend, torch.ones(2) * r, 1 - r), dist.P2POp(dist.irecv, got, 1 - r)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
assert got[0] == 1 - r
objs = [None, None]; dist.all_gather_object(objs, {"r": r}); assert objs == [{"r": 0}, {"r": 1}]
dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
sub = dist.new_group([0, 1]); z = torch.ones(2); dist.all_reduce(z, group=sub); assert z[0] == 2
m = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), find_unused_parameters=True)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); m(torch.randn(4, 8)).sum().backward(); opt.step()
torch.save(m, io.BytesIO())   # DDP pickles only on the default group: the wrapped one is it
from torch.distributed.algorithms.join import Join
uneven = DDP(torch.nn.Linear(8, 2), find_unused_parameters=True)
with Join([uneven]):   # rank 1 has one batch more: rank 0's join hook shadows its all_reduces
    for _ in range(2 + r):
        uneven(torch.randn(4, 8)).sum().backward()
import torch.distributed._functional_collectives as funcol
pg = dist.distributed_c10d._get_default_group()
assert funcol.all_gather_tensor(torch.ones(2) * r, 0, pg).tolist() == [0, 0, 1, 1]
assert funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, pg).tolist() == [2, 2]
assert funcol.all_reduce(torch.ones(2), "sum", pg).tolist() == [2, 2]
one = torch.ones(3); pg.allreduce(one).wait(); assert one[0] == 2
top = torch.ones(1) * r; pg.allreduce([top], op=dist.ReduceOp.MAX).wait(); assert top[0] == 1
# a group destroyed gives its name back (made again under that name, torch 2.13 itself hangs now and
# then: the new group's rendezvous meets the old one's keys in the store, with or without the probe)
local = dist.new_group([0, 1], use_local_synchronization=True); dist.barrier(local); name = local.group_name
dist.destroy_process_group(local)
try:
    dist.distributed_c10d._resolve_process_group(name); freed = False
except RuntimeError as e:
    freed = "Could not resolve" in str(e) or repr(e)
with open(f"{os.environ['SAID']}-{r}.json", "w") as f:   # (not stdout: the two ranks' lines would mix)
    json.dump({"group": type(pg).__name__, "name": pg.name(), "backends": [dist.get_backend(), dist.get_backend(sub)],
               "sub": type(sub).__name__, "comm_hook": m._get_ddp_logging_data().get("comm_hook"),
               "freed": freed}, f)
dist.destroy_process_group()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace of its own for the two ranks)")
def test_every_operation_runs_on_the_wrapped_group_and_ddp_s_buckets_are_timed_without_a_hook(tmp_path):
    """Without phantoms the probe wraps a gloo job's groups (_testbed_groups.TimedGroup): every kind
    of operation a job issues still runs (point-to-point, batched, object, monitored barrier, a
    subgroup, DDP with unused parameters, a DDP model pickled, uneven inputs under Join, functional
    collectives, ProcessGroup.allreduce's other forms, a group destroyed gives its name back), the
    group's name and get_backend still say gloo, and DDP keeps its own path (no comm hook) while
    each bucket is recorded once, before its step's record; DDP's all_reduce of its map of used
    parameters (integers) and Join's shadow all_reduces outside backward are not buckets."""
    r = _two_ranks(tmp_path, OPS_CODE, timeout=180, SAID=str(tmp_path / "said"))
    assert r.returncode == 0, r.stderr[-3000:]
    said = [json.loads((tmp_path / f"said-{rank}.json").read_text()) for rank in (0, 1)]
    assert said == [{"group": "TimedGroup", "name": "gloo", "backends": ["gloo", "gloo"], "sub": "TimedGroup",
                     "comm_hook": None, "freed": True}] * 2
    bucket, uneven = (8 * 8 + 8 + 8 * 2 + 2) * 4, (8 * 2 + 2) * 4
    for rank, (name, rr) in enumerate(sorted(_records(tmp_path).items())):
        colls = [x for x in rr if x["ev"] == "coll"]
        ddp = [c for c in colls if c["src"] == "ddp"]
        assert [(c["op"], c["bytes"], c["async"]) for c in ddp] == \
            [("all_reduce", bucket, True)] * 3 + [("all_reduce", uneven, True)] * (2 + rank), name
        assert all(c["dur"] > 0 and c["w_done"][0] >= c["w"][0] for c in ddp)
        api = [c["op"] for c in colls if c["src"] == "api"]
        p2p = ["send"] if rank == 0 else ["recv"]
        assert api[:11] == ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                            "all_to_all_single", *p2p, "isend", "irecv", "all_gather_object", "all_reduce"], (name, api)
        # each step's buckets are written before its step record: DDP waited for their records
        order = [x["ev"] if x["ev"] == "step" else x["src"] for x in rr if x["ev"] == "step" or x.get("src") == "ddp"]
        assert order[:6] == ["ddp", "step"] * 3, (name, order)


FUNCOL_CODE = """
import json, os, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
r = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29735", rank=r, world_size=2)
pg = dist.distributed_c10d._get_default_group()
for _ in range(100):
    assert funcol.all_gather_tensor(torch.ones(2) * r, 0, pg).tolist() == [0, 0, 1, 1]
    assert funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, pg).tolist() == [2, 2]
    a, b = funcol.all_gather_into_tensor_coalesced([torch.ones(2) * r, torch.ones(3) * (r + 5)], pg)
    assert a.tolist() == [0, 0, 1, 1] and b.tolist() == [5, 5, 5, 6, 6, 6]
    c, d = funcol.reduce_scatter_tensor_coalesced([torch.arange(4.0), torch.ones(6)], "sum", [0, 0], pg)
    assert c.tolist() == [4 * r, 4 * r + 2] and d.tolist() == [2, 2, 2]
with open(f"{os.environ['SAID']}-{r}.json", "w") as f:
    json.dump({"group": type(pg).__name__}, f)
dist.destroy_process_group()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace of its own for the two ranks)")
def test_functional_collectives_on_a_wrapped_group_do_not_deadlock(tmp_path):
    """Functional collectives reach a TimedGroup through torch's Python-group methods for the
    coalesced all_gather and reduce_scatter. Left to torch's C++ fallback they ran with the GIL held
    into gloo while a gloo thread, freeing the last one's tensors under gloo's lock, waited for the
    GIL: before the fix, 100 rounds hung in 4 of 4 runs (2026-12-07, the 2-core VM); gloo's own
    one-tensor methods release the GIL."""
    r = _two_ranks(tmp_path, FUNCOL_CODE, timeout=120, SAID=str(tmp_path / "said"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads((tmp_path / f"said-{rank}.json").read_text()) for rank in (0, 1)] == [{"group": "TimedGroup"}] * 2


HOOKS_CODE = """
import json, os, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
m = DDP(torch.nn.Linear(8, 4))
if {user_hook}:
    m.register_comm_hook(None, default_hooks.allreduce_hook)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(4):
    opt.zero_grad(); m(torch.randn(5, 8)).sum().backward(); opt.step()
print(json.dumps({{"group": type(dist.distributed_c10d._get_default_group()).__name__,
                   "comm_hook": m._get_ddp_logging_data().get("comm_hook")}}))
dist.destroy_process_group()
"""


def test_which_jobs_get_wrapped_groups():
    """Pure: gloo jobs do; a backend-less init only without an accelerator or device_id (c10d would
    add its backend); other backends never; nor any job under TORCH_DISTRIBUTED_DEBUG=DETAIL, whose
    checking wrapper c10d does not put around a Python group (torch 2.13 itself crashes with DETAIL
    and one rank, so this is not run as a job here)."""
    import torch

    from testbed.jobs.probe import _testbed_groups as groups

    assert not torch.cuda.is_available()
    for backend, device_id, env, want in (("gloo", None, {}, True), ("cpu:gloo", None, {}, True),
                                          ("GLOO", None, {"TORCH_DISTRIBUTED_DEBUG": "info"}, True),
                                          (None, None, {}, True), (None, torch.device("cuda", 0), {}, False),
                                          ("nccl", None, {}, False), ("cpu:gloo,cuda:nccl", None, {}, False),
                                          ("gloo", None, {"TORCH_DISTRIBUTED_DEBUG": "detail"}, False)):
        assert groups.wraps(torch, backend, device_id, env) is want, (backend, device_id, env)


@pytest.mark.parametrize("case", ["user hook", "opted out"])
def test_a_job_s_own_hook_is_timed_once_and_the_opt_out_leaves_gloo_plain(tmp_path, case):
    """A comm hook the job registers is timed around it (each bucket once, not again by the
    group); TESTBED_PROBE_DDP=0 leaves the job's group plain gloo and DDP's buckets unrecorded."""
    import random

    code = HOOKS_CODE.format(port=random.randint(30000, 40000), user_hook=case == "user hook")
    extra = {"RANK": "0", "WORLD_SIZE": "1"} | ({"TESTBED_PROBE_DDP": "0"} if case == "opted out" else {})
    r = _run(tmp_path, code, env_extra=extra)
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout.splitlines()[-1])
    ddp = [c for c in _records(tmp_path)["rank-0.jsonl"] if c["ev"] == "coll" and c["src"] == "ddp"]
    if case == "user hook":
        assert said["group"] == "TimedGroup" and "_timed_hook" in said["comm_hook"], said
        assert len(ddp) == 4 and all(c["bytes"] == (8 * 4 + 4) * 4 for c in ddp)
    else:
        assert said == {"group": "ProcessGroup", "comm_hook": None}
        assert ddp == []
