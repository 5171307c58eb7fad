"""What ranks leave in places root writes and reads: run directories and the probe's exchange folder.

A rank (here a netns worker, which shares this machine's files) plants symbolic links where the
launcher will write, and a FIFO where it will read. Root must neither write through the links nor
wait on the FIFO.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from testbed import safeio
from testbed.jobs import rundir

TOPO = """
name: hr
nodes:
  w0: {kind: worker}
  s0: {kind: switch}
links:
  - {endpoints: [w0, s0], bandwidth: 1gbit}
"""


def test_write_json_does_not_follow_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    rd = rundir.create("x", tmp_path / "cwd")
    (rd / ".summary.json.tmp").symlink_to(victim)   # the old temporary name
    (rd / "summary.json").symlink_to(victim)
    rundir.write_json(rd / "summary.json", {"ok": 1})
    assert victim.read_text() == "precious"
    assert not (rd / "summary.json").is_symlink() and rundir.read_json(rd / "summary.json") == {"ok": 1}


def test_logs_opened_for_append_refuse_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    rd = rundir.create("x", tmp_path / "cwd")
    (rd / "logs" / "w0.log").symlink_to(victim)
    with pytest.raises(safeio.Unsafe, match="w0.log"):
        rundir.open_append(rd / "logs" / "w0.log")
    # a directory of the run replaced by a link to elsewhere: refused too
    os.rmdir(rd / "probe")
    (rd / "probe").symlink_to(tmp_path)
    with pytest.raises(safeio.Unsafe, match="probe"):
        rundir.write_json(rd / "probe" / "victim", {})
    assert victim.read_text() == "precious"


def test_a_planted_runs_link_is_not_followed(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (cwd / "runs").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(safeio.Unsafe, match="runs"):
        rundir.create("x", cwd)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_step_reader_passes_over_a_fifo_and_a_link(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    os.mkfifo(probe / "rank-x.jsonl")
    (tmp_path / "secret").write_text('{"ev": "step", "t": 1}\n')
    (probe / "rank-y.jsonl").symlink_to(tmp_path / "secret")
    (probe / "rank-0.jsonl").write_text('{"ev": "step", "t": 2}\n')
    r = rundir.StepReader(probe)
    done = threading.Event()
    t = threading.Thread(target=lambda: (r.poll(), done.set()), daemon=True)
    t.start()
    if not done.wait(5):
        with open(probe / "rank-x.jsonl", "w"):   # (releases the blocked reader)
            pass
        pytest.fail("StepReader.poll waited on a FIFO a rank made")
    assert r.steps == 1


def test_collect_probe_copies_only_plain_files(tmp_path):
    from testbed.jobs.probe_files import collect_probe

    rd = rundir.create("x", tmp_path / "cwd")
    shared = tmp_path / "shared"
    (shared / "probe").mkdir(parents=True)
    (shared / "probe" / "rank-0.jsonl").write_text("{}\n")
    (tmp_path / "secret").write_text("root's")
    (shared / "probe" / "rank-1.jsonl").symlink_to(tmp_path / "secret")
    os.mkfifo(shared / "probe" / "rank-2.jsonl")
    (shared / "probe" / "rank-3.jsonl\n").write_text("{}\n")
    os.rmdir(rd / "probe")
    (rd / "probe").symlink_to(shared / "probe")
    collect_probe(rd, shared)
    assert sorted(p.name for p in (rd / "probe").iterdir()) == ["rank-0.jsonl"]
    assert not shared.exists()


@pytest.fixture
def var_tmp():
    import shutil
    import uuid

    d = Path("/var/tmp") / f"tbhostile-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.root
@pytest.mark.root
def test_a_rank_fifo_and_links_neither_stall_nor_redirect_the_launcher(testbed, var_tmp):
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.topology.loader import load_topology_text

    tmp_path = var_tmp   # (a netns worker has a /tmp of its own)
    st = testbed(load_topology_text(TOPO, "<test>"))
    cluster = cluster_from_state(st["name"])
    victim = tmp_path / "victim"
    victim.write_text("precious")
    base = tmp_path / "cwd"
    base.mkdir()
    # the rank: a FIFO where the launcher reads step records, links where it writes its files
    script = (f'mkfifo "$TESTBED_PROBE_DIR/rank-x.jsonl"; '
              f'for d in {base}/runs/*/; do for f in summary counters-after monitor; do '
              f'ln -s {victim} "$d.$f.json.tmp"; done; ln -s {victim} "$d/testbed-events.jsonl"; done; sleep 60')
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(res=run(cluster, ["sh", "-c", script], base_dir=base,
                                                           workdir=str(base), echo=False, timeout=6, grace=1)),
                         daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(60)
    if t.is_alive():
        for f in Path(st.get("state_dir") or "/run/testbed").glob("**/rank-x.jsonl"):
            with open(f, "w"):
                pass
        t.join(30)
        pytest.fail("testbed run --timeout 6 hung on a rank's FIFO")
    assert time.monotonic() - t0 < 45
    assert victim.read_text() == "precious"
    res = out["res"]
    logs = (res.run_dir / "logs" / "w0.log").read_text()
    assert res.summary["status"] == "timeout", (res.summary["status"], logs)
    assert (base / "runs").is_dir() and any((base / "runs").glob("*/.summary.json.tmp"))


# -- round two (issue #23): the writes and reads a review found following links or waiting on FIFOs


def _done_within(fn, fifos, what: str, limit_s: float = 20.0):
    """fn() run in a thread; fails saying `what` if it has not returned within limit_s (a read or a
    write waiting on one of `fifos`, which are then opened from here to let it go). Returns fn's
    result or raises what it raised."""
    box: dict = {}
    done = threading.Event()

    def go():
        try:
            box["res"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["exc"] = exc
        finally:
            done.set()
    threading.Thread(target=go, daemon=True).start()
    if not done.wait(limit_s):
        for f in fifos:   # (releases the blocked side: a reader gets EOF, a writer a reader)
            fd = os.open(f, os.O_RDWR | os.O_NONBLOCK)
            os.close(fd)
        pytest.fail(f"{what} waited on a FIFO a job planted")
    if "exc" in box:
        raise box["exc"]
    return box["res"]


def _rank_wins_the_race(monkeypatch, target: Path) -> None:
    """The rank acts between a reader's check of `target` and its open: the name checked (is_file)
    is a plain file, the name opened a FIFO. Stands in for the scheduler only; the FIFO is real."""
    real = Path.is_file

    def is_file(self):
        ok = real(self)
        if self == target and ok:
            target.unlink()
            os.mkfifo(target)
        return ok
    monkeypatch.setattr(Path, "is_file", is_file)


def test_scenario_plot_does_not_write_through_a_planted_link(tmp_path):
    from testbed.faults import player

    victim = tmp_path / "victim"
    victim.write_text("precious")
    rd = rundir.create("x", tmp_path / "cwd")
    (rd / "probe" / "rank-0.jsonl").write_text("".join(f'{{"ev": "step", "t": {t}}}\n' for t in (1, 2, 3)))
    (rd / "scenario.png").symlink_to(victim)
    out = player.plot(rd, {"scenario": "s", "outcome": "completed", "events": []}, None)
    assert victim.read_text() == "precious"
    assert out == rd / "scenario.png" and not out.is_symlink() and out.read_bytes().startswith(b"\x89PNG")


def test_files_opened_for_append_refuse_a_fifo_and_a_hard_link(tmp_path):
    rd = rundir.create("x", tmp_path / "cwd")
    fifo = rd / "logs" / "w0.log"
    os.mkfifo(fifo)
    with pytest.raises(safeio.Unsafe, match=r"w0\.log: a FIFO"):
        _done_within(lambda: rundir.open_append(fifo), [fifo], "rundir.open_append")
    # a FIFO with a reader (the job keeps one open): opened at once, refused on what it is
    keep = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(safeio.Unsafe, match=r"w0\.log: not a plain file"):
            _done_within(lambda: rundir.open_append(fifo), [fifo], "rundir.open_append")
    finally:
        os.close(keep)
    # every other caller of open_beneath (the sweep's lock, opened read-write) has the same check
    with pytest.raises(safeio.Unsafe, match=r"w0\.log: not a plain file"):
        _done_within(lambda: safeio.open_beneath(rd.parent.parent, f"runs/{rd.name}/logs/w0.log",
                                                 os.O_RDWR | os.O_CREAT), [fifo], "safeio.open_beneath")
    # a hard link to a file elsewhere (same file system): appended to, it would grow that file
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.link(victim, rd / "logs" / "w1.log")
    with pytest.raises(safeio.Unsafe, match=r"w1\.log: a plain file with 2 names"):
        rundir.open_append(rd / "logs" / "w1.log")
    assert victim.read_text() == "precious"
    # what is ours still opens: a new log, then the same one again, and it blocks no more
    with rundir.open_append(rd / "logs" / "w2.log") as f:
        f.write("line\n")
    with rundir.open_append(rd / "logs" / "w2.log") as f:
        assert os.get_blocking(f.fileno())
        f.write("more\n")
    assert (rd / "logs" / "w2.log").read_text() == "line\nmore\n"


def test_the_merged_run_of_several_hosts_is_written_through_no_planted_link(tmp_path):
    """controller._merge_parts writes into the controller's run directory, which a local job (the
    controller's machine is often a host too) can reach."""
    import json
    import shutil

    from testbed.cluster import job as hosts_job
    from testbed.topology.loader import load_topology_text

    victim = tmp_path / "victim"
    victim.write_text("precious")
    rd = rundir.create("x", tmp_path / "cwd")
    part = rd / "parts" / "h1"
    for sub in ("probe", "logs"):
        (part / sub).mkdir(parents=True)
    (part / "summary.json").write_text(json.dumps({"status": "completed", "rc": 0, "ranks": [{"rank": 0}],
                                                    "started": 1.0, "ended": 2.0, "cores": 2}))
    (part / "probe" / "rank-0.jsonl").write_text('{"ev": "step", "t": 1}\n')
    (part / "logs" / "w0.log").write_text("[w0:r0] hello\n")
    (part / "topology.json").write_text("{}")
    (part / "testbed-events.jsonl").write_text('{"t": 1, "kind": "link"}\n')
    # the job's links where the merge writes
    for name in ("probe/rank-0.jsonl", "logs/w0.log", "topology.json", "testbed-events.jsonl"):
        (rd / name).symlink_to(victim)
    topo = load_topology_text(TOPO, "<test>")
    hosts_job._merge_parts(rd, ["h1"], "h1", {"topology": topo.to_json(), "placement": {"w0": "h1"}}, {})
    assert victim.read_text() == "precious"
    for name in ("probe/rank-0.jsonl", "logs/w0.log", "topology.json", "testbed-events.jsonl"):
        assert not (rd / name).is_symlink() and (rd / name).read_bytes() == (part / name).read_bytes(), name
    # a folder of the merged run replaced by a link to elsewhere: refused, nothing lands there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(rd / "logs")
    (rd / "logs").symlink_to(elsewhere)
    with pytest.raises(safeio.Unsafe, match="logs"):
        hosts_job._merge_parts(rd, ["h1"], "h1", {"topology": topo.to_json(), "placement": {"w0": "h1"}}, {})
    assert list(elsewhere.iterdir()) == []


def test_run_events_never_waits_on_a_fifo(tmp_path):
    from testbed.report import analyze

    rd = rundir.create("x", tmp_path / "cwd")
    os.mkfifo(rd / "testbed-events.jsonl")
    assert _done_within(lambda: analyze.run_events(rd), [rd / "testbed-events.jsonl"], "analyze.run_events") == []


def _racing_probe(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A running run's probe folder whose rank 1 swaps its file for a FIFO between a reader's check
    and its open: (run directory, rank 1's file)."""
    import json

    rd = rundir.create("tb", tmp_path / "cwd")
    (rd / "summary.json").write_text(json.dumps({"testbed": "tb", "run_id": "r", "status": "running",
                                                 "world_size": 2}))
    for f in ("rank-0.jsonl", "rank-1.jsonl"):
        (rd / "probe" / f).write_text('{"ev": "step", "t": 10.0, "dur": 0.5, "n": 1}\n')
    _rank_wins_the_race(monkeypatch, rd / "probe" / "rank-1.jsonl")
    return rd, rd / "probe" / "rank-1.jsonl"


def test_report_reads_the_probe_file_it_opened_not_a_name_it_checked(tmp_path, monkeypatch):
    from testbed.report import analyze

    rd, raced = _racing_probe(tmp_path, monkeypatch)
    probe = _done_within(lambda: analyze.load_probe(rd), [raced], "analyze.load_probe")
    assert probe["0"] == [{"ev": "step", "t": 10.0, "dur": 0.5, "n": 1}]


def test_top_reads_the_probe_file_it_opened_not_a_name_it_checked(tmp_path, monkeypatch, state_dir):
    from testbed.observe import run_watch

    rd, raced = _racing_probe(tmp_path, monkeypatch)
    run = _done_within(lambda: run_watch.RunWatch("tb", rd.parent).poll(now=11.0), [raced], "top's RunWatch")
    assert run is not None and run["step"] >= 1 and run["ranks"] >= 1


def test_a_fetched_run_directory_lands_in_no_folder_a_job_linked(tmp_path):
    """controller.fetch_run_dir unpacks a host's run directory into runs/RUN/parts/HOST: a link a
    local job planted at runs/RUN/parts is refused, nothing lands where it points."""
    from test_hostile_fetch import Host

    from testbed.cluster import job as hosts_job

    remote = tmp_path / "remote-run"
    (remote / "logs").mkdir(parents=True)
    (remote / "summary.json").write_text("{}")
    (remote / "logs" / "w0.log").write_text("hello\n")
    rd = rundir.create("x", tmp_path / "cwd")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (rd / "parts").symlink_to(elsewhere)
    with pytest.raises(safeio.Unsafe, match="parts"):
        hosts_job.fetch_run_dir(Host(), "h1", str(remote), rd / "parts" / "h1")
    assert list(elsewhere.iterdir()) == []
    # the same fetch into the run directory as made: lands, and nothing else beside it
    (rd / "parts").unlink()
    hosts_job.fetch_run_dir(Host(), "h1", str(remote), rd / "parts" / "h1")
    assert (rd / "parts" / "h1" / "logs" / "w0.log").read_text() == "hello\n"
    assert [p.name for p in (rd / "parts").iterdir()] == ["h1"]
