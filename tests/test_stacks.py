"""Stacks of a stalled job (testbed/jobs/stacks.py, `testbed stacks`): kernel test with real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

# Rank 1 is stuck "loading data"; the others wait for it in all_reduce. (The sleep is the stall the
# test reads the stacks of, not a wait: the run's 50 s timeout ends it.)
STALL = ("import time, torch, torch.distributed as dist\n"
         "dist.init_process_group('gloo')\n"
         "def load_batch():\n"
         "    time.sleep(600)\n"
         "if dist.get_rank() == 1:\n"
         "    load_batch()\n"
         "dist.all_reduce(torch.ones(4))\n")


def test_ranks_and_groups_pure():
    from testbed.jobs.stacks import RankStack, _ranges, groups, render

    assert _ranges([0, 2, 3, 4, 7]) == "0, 2-4, 7"
    c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
    waiting = [("all_reduce", c10d, 10), ("wrapper", "/x/site-packages/torch/distributed/c10d_logger.py", 5),
               ("<module>", "job.py", 7)]
    stacks = [RankStack(p, r, "w", False, list(waiting)) for p, r in ((10, 0), (12, 2), (13, 3))]
    stacks.append(RankStack(11, 1, "w1", False, [("load_batch", "job.py", 4), ("<module>", "job.py", 6)]))
    g = groups(stacks)
    assert [len(x) for x in g] == [3, 1]
    text = render(stacks)
    assert "3 ranks (0, 2-3) in all_reduce:" in text and "1 rank (1):" in text and "load_batch (job.py:4)" in text


def test_hosts_stacks_merge_grouped_across_hosts_with_counts_per_host():
    from testbed.jobs.stacks import RankStack, from_json, merge_hosts, render, to_json

    c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
    waiting = [("all_reduce", c10d, 10), ("<module>", "job.py", 7)]
    h1 = [RankStack(10, 0, "w0", False, list(waiting)), RankStack(11, 1, "w1", False, [("load", "job.py", 4)])]
    h2 = [RankStack(20, 2, "w2", False, list(waiting)), RankStack(21, 3, "w3", False, list(waiting))]
    # what a host says (`stacks --json`) reads back as it was
    back = from_json(json.loads(json.dumps(to_json(h2))), "h2")
    assert [(s.pid, s.rank, s.worker, s.frames, s.host) for s in back] == [(s.pid, s.rank, s.worker, s.frames, "h2")
                                                                           for s in h2]
    # hosts that share a PID namespace (emulated ones) see each other's ranks: each is its worker's host's
    got = merge_hosts({"h1": h1 + h2, "h2": back}, {"w0": "h1", "w1": "h1", "w2": "h2", "w3": "h2"})
    assert [(s.rank, s.host) for s in got] == [(0, "h1"), (1, "h1"), (2, "h2"), (3, "h2")]
    assert h1[0].host is None   # copies: the hosts' lists are left alone
    text = render(got)
    assert "3 ranks (0, 2-3) [h1: 1, h2: 2] in all_reduce:" in text, text
    assert "1 rank (1) [h1: 1]:" in text and "load (job.py:4)" in text, text
    assert [d["host"] for d in to_json(got)] == ["h1", "h1", "h2", "h2"]
    assert "host" not in to_json(h1)[0]   # one host: as before
    with pytest.raises(ValueError):
        from_json({"pid": 1})


def test_a_stalled_job_shows_who_waits_where(testbed, tmp_path):
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text("name: st\ngenerator: star\nparams: {n: 4}\n", "<test_stacks>"),
                 time_dilation="none")
    cl = cluster_from_state(st["name"])
    live: dict[str, str] = {}

    def stacks() -> dict[str, str]:
        r = subprocess.run([sys.executable, "-m", "testbed", "stacks", "--name", cl.name], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        return {"out": r.stdout, "err": r.stderr, "rc": str(r.returncode)}

    def look(_rd, _probe) -> None:
        def later() -> None:
            # until the three ranks wait in all_reduce and rank 1 in its stall: their start (torch, the
            # rendezvous) took 5-15 s here, longer beside other tests, and the three wait in the probe's
            # first all_reduce while rank 1 is still in init_process_group (make test saw that once);
            # `testbed stacks` is what is tested, each look included
            def both(d: dict[str, str]) -> dict[str, str] | None:
                return d if "3 ranks (0, 2-3) in all_reduce:" in d["out"] and "load_batch" in d["out"] else None
            try:
                live.update(wait_for(lambda: both(stacks()), timeout=40, interval=1.0,
                                     what="three ranks in all_reduce and rank 1 in load_batch in `testbed stacks`"))
            except AssertionError as exc:
                live["err"] = str(exc)
        threading.Thread(target=later, daemon=True).start()

    res = run(cl, [sys.executable, "-c", STALL], echo=False, base_dir=tmp_path, workdir=str(REPO), monitor=False,
              timeout=50, on_start=look)
    assert res.summary["status"] == "timeout"
    assert live.get("rc") == "0", live
    assert "3 ranks (0, 2-3) in all_reduce:" in live["out"], live["out"]
    assert "1 rank (1):" in live["out"] and "load_batch" in live["out"], live["out"]
    # the timeout saved the same into the run directory
    saved = (res.run_dir / "stacks.txt").read_text()
    assert res.summary["stacks"] == str(res.run_dir / "stacks.txt")
    assert "3 ranks (0, 2-3) in all_reduce:" in saved and "load_batch" in saved, saved
    doc = json.loads((res.run_dir / "stacks.json").read_text())
    assert sorted(d["rank"] for d in doc) == [0, 1, 2, 3]
