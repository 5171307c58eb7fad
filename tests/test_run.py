"""`testbed run` on a real (scratch) fabric: DDP, torchrun rendezvous, failures, bandwidth.

Kernel tests (root). Each builds its own uniquely named scratch testbed
(testbed.jobs.scratch) and removes it, even on failure.
"""

import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


def _name():
    return f"tr{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def leaf_spine():
    from testbed.jobs.scratch import scratch_testbed, small_leaf_spine

    name = _name()
    with scratch_testbed(small_leaf_spine(name), name) as cluster:
        yield cluster


def _checksums(run_dir):
    sums = []
    for log in sorted((Path(run_dir) / "logs").glob("*.log")):
        for line in log.read_text().splitlines():
            if "checksum=" in line:
                sums.append((line.split("checksum=")[1].split()[0], "identical=True" in line))
    return sums


def test_ddp_four_workers_identical_params_and_probe(leaf_spine, tmp_path):
    from testbed.jobs.run import run

    steps = 6
    res = run(leaf_spine, [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", str(steps)],
              base_dir=tmp_path, workdir=str(REPO), echo=False, timeout=240)
    assert res.rc == 0, (Path(res.run_dir) / "logs" / "w0.log").read_text()
    sums = _checksums(res.run_dir)
    assert len(sums) == 4 and len({s for s, _ in sums}) == 1 and all(ok for _, ok in sums)
    # the probe recorded exactly `steps` optimizer steps on every rank
    for rank in range(4):
        recs = [json.loads(l) for l in (res.run_dir / "probe" / f"rank-{rank}.jsonl").read_text().splitlines()]
        assert sum(r["ev"] == "step" for r in recs) == steps
        assert sum(r["ev"] == "coll" and r["src"] == "ddp" for r in recs) >= steps
    s = json.loads((res.run_dir / "summary.json").read_text())
    assert s["rc"] == 0 and s["world_size"] == 4 and [r["rc"] for r in s["ranks"]] == [0] * 4
    assert s["time_dilation"]["factor"] == 1.0
    # traffic crossed the emulated links (both tiers: two leaves)
    tiers = {l["tier"]: 0 for l in s["links"]}
    for l in s["links"]:
        tiers[l["tier"]] += l["bytes_ab"] + l["bytes_ba"]
    assert tiers["host"] > 0 and tiers["leaf-spine"] > 0
    for f in ("topology.json", "counters-before.json", "counters-after.json", "logs/w3.log"):
        assert (res.run_dir / f).is_file()
    from testbed.report import report

    text, a, plots = report(res.run_dir)
    assert len(a["ranks"]) == 4 and all(r["steps"] == steps for r in a["ranks"])


def test_torchrun_rendezvous(leaf_spine, tmp_path):
    from testbed.jobs.run import run

    res = run(leaf_spine, ["torchrun", str(REPO / "examples" / "train_ddp.py"), "--steps", "3"],
              workers="w0,w2", nproc_per_node=2, base_dir=tmp_path, workdir=str(REPO), echo=False, timeout=240)
    assert res.rc == 0, (Path(res.run_dir) / "logs" / "w0.log").read_text()[-3000:]
    sums = _checksums(res.run_dir)
    assert len(sums) == 4 and len({s for s, _ in sums}) == 1
    assert sorted(p.name for p in (res.run_dir / "probe").glob("*.jsonl")) == [f"rank-{i}.jsonl" for i in range(4)]


def test_failing_rank_stops_everyone_no_orphans(leaf_spine, tmp_path):
    from testbed.jobs.run import _tagged_pids, run

    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '2':\n    time.sleep(0.5); sys.exit(7)\n"
            "time.sleep(120)\n")
    grace = 2.0
    t0 = time.monotonic()
    res = run(leaf_spine, [sys.executable, "-c", code], nproc_per_node=2, grace=grace, base_dir=tmp_path,
              echo=False)
    elapsed = time.monotonic() - t0
    assert res.rc == 7
    assert res.summary["first_failure"]["rank"] == 2
    assert elapsed < 0.5 + grace + 8, elapsed  # startup + failure + grace + TERM/KILL, far below 120 s
    assert _tagged_pids(res.summary["run_id"]) == []
    for r in res.summary["ranks"]:
        assert r["rc"] is not None
        import psutil

        assert not psutil.pid_exists(r["pid"]) or psutil.Process(r["pid"]).status() == psutil.STATUS_ZOMBIE


def test_unknown_worker_is_an_error(leaf_spine, tmp_path):
    from testbed.jobs.run import RunError, run

    with pytest.raises(RunError):
        run(leaf_spine, ["true"], workers="w0,w99", base_dir=tmp_path, echo=False)


@pytest.mark.slow
def test_busbw_and_ring_model_at_1gbit(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from bench_ring_model import measure

    r = measure(workers=4, bandwidth="1gbit", size="64M", min_size="64M", iters=3, base_dir=str(tmp_path))
    big = r["rows"][-1]
    assert abs(big["busbw_vs_link"] - 1) <= 0.10, big
    assert abs(big["time_error"]) <= 0.10, big
