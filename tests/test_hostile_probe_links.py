"""A run directory's probe, or the run directory itself, replaced by a job with a symbolic link (#23).

A rank with a writable run directory can point RUN/probe (or runs/RUN) at another run's probe, or at
/etc: `testbed report` (rundir.latest, analyze.load_probe) and top's RunWatch must not read the
records there as this run's. Pure file tests: no testbed is brought up.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from testbed import paths, safeio
from testbed.jobs import rundir
from testbed.observe import run_watch
from testbed.report import analyze

MINE = '{"ev": "step", "t": 10.0, "dur": 0.5, "n": 1}\n'
FOREIGN = '{"ev": "step", "t": 99.0, "dur": 9.0, "n": 777}\n'


def _run(cwd, name: str, status: str = "completed", run_id: str = "aaaaaaaaaaaa"):
    d = cwd / "runs" / name
    (d / "probe").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"testbed": "tb", "run_id": run_id, "status": status,
                                                "world_size": 1}))
    (d / "probe" / "rank-0.jsonl").write_text(MINE)
    return d


def _foreign(tmp_path):
    """Another user's run, somewhere the job cannot write but root can read."""
    other = tmp_path / "other"
    (other / "probe").mkdir(parents=True)
    (other / "summary.json").write_text(json.dumps({"testbed": "tb", "run_id": "bbbbbbbbbbbb",
                                                    "status": "running", "world_size": 1}))
    (other / "probe" / "rank-0.jsonl").write_text(FOREIGN)
    return other


def test_latest_passes_over_a_linked_run_directory(tmp_path):
    cwd = tmp_path / "cwd"
    mine = _run(cwd, "20260101-100000-tb")
    other = _foreign(tmp_path)
    os.utime(mine, (1_000_000, 1_000_000))
    (cwd / "runs" / "20991231-235959-tb").symlink_to(other)   # newer than any run, and a link
    assert rundir.latest(cwd) == mine
    # runs/ itself a link: refused, naming it (as rundir.create does)
    shutil.move(cwd / "runs", tmp_path / "runs-elsewhere")
    (cwd / "runs").symlink_to(tmp_path / "runs-elsewhere")
    with pytest.raises(safeio.Unsafe, match="runs"):
        rundir.latest(cwd)
    assert rundir.latest(tmp_path / "nowhere") is None


def test_load_probe_refuses_a_linked_probe_or_run_directory(tmp_path):
    cwd = tmp_path / "cwd"
    rd = _run(cwd, "20260101-100000-tb")
    assert analyze.load_probe(rd) == {"0": [json.loads(MINE)]}
    other = _foreign(tmp_path)
    shutil.rmtree(rd / "probe")
    (rd / "probe").symlink_to(other / "probe")
    with pytest.raises(safeio.Unsafe, match=f"{rd.name}/probe"):
        analyze.load_probe(rd)
    # the run directory a link (what rundir.latest no longer picks, named by hand)
    (cwd / "runs" / "20260101-110000-tb").symlink_to(other)
    with pytest.raises(safeio.Unsafe, match="20260101-110000-tb"):
        analyze.load_probe(cwd / "runs" / "20260101-110000-tb")
    # a run without the probe (--no-probe): nothing, as before
    (rd / "probe").unlink()
    assert analyze.load_probe(rd) == {}


def test_a_killed_runs_report_reads_its_exchange_folder_not_the_link(tmp_path, state_dir):
    """A `testbed run` killed mid-run leaves summary "running" and RUN/probe its own link into the
    exchange folder: `testbed report` reads that folder by the run's id, wherever the link points,
    and nothing once the testbed (and its folder) is gone."""
    cwd = tmp_path / "cwd"
    rd = _run(cwd, "20260101-100000-tb", status="running")
    shutil.rmtree(rd / "probe")
    exchange = paths.directory("tb") / "runs" / "aaaaaaaaaaaa" / "probe"
    exchange.mkdir(parents=True)
    (exchange / "rank-0.jsonl").write_text(MINE)
    (rd / "probe").symlink_to(exchange)
    assert analyze.load_probe(rd) == {"0": [json.loads(MINE)]}
    other = _foreign(tmp_path)   # the job repointed the link: still the run's own records
    (rd / "probe").unlink()
    (rd / "probe").symlink_to(other / "probe")
    assert analyze.load_probe(rd) == {"0": [json.loads(MINE)]}
    shutil.rmtree(exchange.parent)
    assert analyze.load_probe(rd) == {}


def test_top_reads_a_live_run_from_its_exchange_folder_not_through_the_link(tmp_path, state_dir):
    cwd = tmp_path / "cwd"
    rd = _run(cwd, "20260101-100000-tb", status="running")
    shutil.rmtree(rd / "probe")
    # what `testbed run` makes: RUN/probe a link to <state dir>/runs/<run id>/probe
    exchange = paths.directory("tb") / "runs" / "aaaaaaaaaaaa" / "probe"
    exchange.mkdir(parents=True)
    (exchange / "rank-0.jsonl").write_text(MINE)
    (rd / "probe").symlink_to(exchange)
    run = run_watch.RunWatch("tb", cwd / "runs").poll(now=11.0)
    assert run["dir"] == str(rd) and run["step"] == 1 and run["ranks"] == 1
    # the job points the link at another run's probe: top still reads the run's own folder
    other = _foreign(tmp_path)
    (rd / "probe").unlink()
    (rd / "probe").symlink_to(other / "probe")
    run = run_watch.RunWatch("tb", cwd / "runs").poll(now=11.0)
    assert run["dir"] == str(rd) and run["step"] == 1
    # ... and once that folder is gone, the run is not active: nothing foreign is shown
    shutil.rmtree(exchange.parent)
    assert run_watch.RunWatch("tb", cwd / "runs").poll(now=11.0) is None


def test_top_passes_over_a_linked_run_directory(tmp_path, state_dir):
    cwd = tmp_path / "cwd"
    (cwd / "runs").mkdir(parents=True)
    other = _foreign(tmp_path)
    (cwd / "runs" / "20260101-100000-tb").symlink_to(other)   # "running", with a real probe there
    assert run_watch.RunWatch("tb", cwd / "runs").poll(now=100.0) is None
    # a probe in the exchange folder that is a link (to the same foreign run): passed over too
    (paths.directory("tb") / "runs" / "cccccccccccc").mkdir(parents=True)
    (paths.directory("tb") / "runs" / "cccccccccccc" / "probe").symlink_to(other / "probe")
    assert run_watch.RunWatch("tb", cwd / "runs").poll(now=100.0) is None
