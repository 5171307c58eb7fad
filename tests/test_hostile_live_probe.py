"""A job that swaps its run directory's probe link while it runs (#23).

While a run goes, RUN/probe is testbed's own link into the testbed's folder, where the ranks write.
A job with a writable run directory can replace that link with one to a folder of its own, full of
step records. What reads the run's steps live (the scenario player's `at:` clock, a sweep's
progress, testbed run's own progress) must keep reading the testbed's folder, handed to it by
run(on_start=...), never where the link points now. Root; a real run on a netns star.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_STEPS = 500
# each rank: plant a folder of step records, point RUN/probe at it, then stay a while
SWAP = f"""
import json, os, pathlib, time
run = pathlib.Path(os.environ["TESTBED_RUN_DIR"])
fake = run.parent / ("planted-" + os.environ["TESTBED_WORKER"])
fake.mkdir()
(fake / "rank-9.jsonl").write_text("".join(json.dumps({{"ev": "step", "t": 1.0 + i, "dur": 0.1, "n": i}}) + "\\n"
                                           for i in range({FAKE_STEPS})))
if os.environ["TESTBED_WORKER"] == "w0":
    tmp = run / "probe.new"
    tmp.symlink_to(fake)
    os.replace(tmp, run / "probe")
time.sleep(4)
"""


@pytest.mark.root
def test_live_step_readers_read_the_testbeds_folder_not_a_swapped_link(testbed, shared_tmp):
    from testbed.jobs.run import run
    from testbed.jobs.rundir import StepReader
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text("name: star\ngenerator: star\nparams: {n: 2}\n", "<test>"),
                 time_dilation="none")
    seen: dict = {"given": 0, "link": 0}
    done = threading.Event()

    def on_start(rd: Path, probe_dir: Path) -> None:
        assert not probe_dir.is_relative_to(rd), (probe_dir, rd)   # the testbed's folder, not RUN/probe

        def watch() -> None:
            given = StepReader(probe_dir)
            while not done.wait(0.2):
                given.poll()
                seen["given"] = max(seen["given"], given.steps)
                through = StepReader(rd / "probe")   # what the readers did before: through the link
                through.poll()
                seen["link"] = max(seen["link"], through.steps)

        threading.Thread(target=watch, daemon=True).start()

    try:
        res = run(cluster_from_state(st["name"]), [sys.executable, "-c", SWAP], base_dir=shared_tmp,
                  workdir=str(REPO), echo=False, monitor=False, timeout=120, on_start=on_start)
    finally:
        done.set()
    assert res.rc == 0, (res.run_dir / "logs" / "w0.log").read_text()[-2000:]
    # the job did swap the link (read through it, its records count), and the readers given the
    # testbed's folder saw none of them: the job made no optimizer step
    assert seen["link"] == FAKE_STEPS, seen
    assert seen["given"] == 0, seen


# rank 0 moves its run directory aside and puts a link to a folder of its own in its place
MOVE = """
import os, pathlib
run = pathlib.Path(os.environ["TESTBED_RUN_DIR"])
if os.environ["TESTBED_WORKER"] == "w0":
    elsewhere = run.parent / "elsewhere"
    elsewhere.mkdir()
    os.rename(run, run.parent / "moved")
    os.symlink(elsewhere, run)
"""


@pytest.mark.root
def test_a_run_whose_directory_became_a_link_still_ends_and_writes_nothing_through_it(testbed, shared_tmp):
    from testbed import events, paths
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text("name: star\ngenerator: star\nparams: {n: 2}\n", "<test>"),
                 time_dilation="none")
    said: list[str] = []
    res = run(cluster_from_state(st["name"]), [sys.executable, "-c", MOVE], base_dir=shared_tmp,
              workdir=str(REPO), echo=said.append, monitor=False, timeout=120)
    rid = res.summary["run_id"]
    assert res.rc == 0, said
    # nothing written through the link: the job's folder is as it left it
    assert list((shared_tmp / "runs" / "elsewhere").iterdir()) == []
    # and the run still ended: its event, the exchange folder gone, what was not kept said
    assert any(e.get("run_id") == rid and e.get("status") == "completed" for e in events.read(st["name"]))
    assert not (paths.directory(st["name"]) / "runs" / rid).exists()
    assert {k.split(" (")[0] for k in res.summary["not_kept"]} == {
        "the probe's records", "counters-after.json", "testbed-events.jsonl", "summary.json"}, res.summary["not_kept"]
    assert any("was changed while the job ran" in s for s in said), said
