"""The event stream (testbed/events.py) and `testbed events`.

Pure tests on a temporary state dir; one kernel test follows a real testbed
through up, a link fault, a run and down.
"""

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


def test_emit_then_read_in_order(state_dir):
    from testbed import events

    (state_dir / "tb").mkdir()
    events.emit("tb", "up", "up: 2 workers", workers=2)
    events.emit("tb", "link", "link down w0-s0")
    got = list(events.read("tb"))
    assert [(e["kind"], e["what"]) for e in got] == [("up", "up: 2 workers"), ("link", "link down w0-s0")]
    assert got[0]["workers"] == 2 and got[0]["t"] <= got[1]["t"]


def test_unknown_kind_is_a_bug_not_an_event(state_dir):
    from testbed import events

    with pytest.raises(ValueError, match="not one of"):
        events.emit("tb", "weather", "sunny")


def test_no_directory_no_event_and_no_error(state_dir):
    from testbed import events

    events.emit("gone", "down", "down")       # a testbed already removed: nothing to write to
    assert not (state_dir / "gone").exists()
    assert list(events.read("gone")) == []


def test_lines_that_are_not_events_are_skipped_and_counted(state_dir):
    from testbed import events

    (state_dir / "tb").mkdir()
    events.emit("tb", "up", "up")
    with open(events.path("tb"), "ab") as f:
        f.write(b"not json\n[1, 2]\n" + json.dumps({"t": "x", "kind": "up", "what": "bad t"}).encode() + b"\n"
                + json.dumps({"t": 1.0, "kind": "rm -rf", "what": "bad kind"}).encode() + b"\n"
                + b"{" + b"x" * (events.MAX_LINE + 10) + b"\n")
    events.emit("tb", "down", "down")
    skipped = [0]
    assert [e["kind"] for e in events.read("tb", skipped=skipped)] == ["up", "down"]
    assert skipped[0] == 5


def test_a_symlinked_stream_is_not_followed(state_dir, tmp_path):
    from testbed import events

    (state_dir / "tb").mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, events.path("tb"))
    events.emit("tb", "up", "up")      # O_NOFOLLOW: the write is refused, the caller goes on
    assert target.read_text() == ""


def test_huge_fields_are_dropped_not_the_event(state_dir):
    from testbed import events

    (state_dir / "tb").mkdir()
    events.emit("tb", "run", "run started", cmd="x" * 100_000)
    (rec,) = list(events.read("tb"))
    assert rec["what"] == "run started" and "cmd" not in rec


def test_follow_sees_new_events_and_ends_with_the_testbed(state_dir):
    from testbed import events

    d = state_dir / "tb"
    d.mkdir()
    events.emit("tb", "up", "up")
    seen: list[str] = []

    def reader() -> None:
        for e in events.read("tb", follow=True, poll_s=0.02, stop_after_s=20):
            seen.append(e["kind"])

    t = threading.Thread(target=reader)
    t.start()
    wait_for(lambda: seen == ["up"], timeout=10, what="the follower to read what was there")
    events.emit("tb", "link", "link down")
    events.emit("tb", "down", "down")
    wait_for(lambda: len(seen) == 3, timeout=10, what="the follower to read the two new events")
    events.path("tb").unlink()
    d.rmdir()
    t.join(5)
    assert not t.is_alive(), "follow did not end when the testbed's directory went"
    assert seen == ["up", "link", "down"]


def test_hosts_events_merge_in_time_order_each_with_its_host():
    from testbed.observe.answers import merge

    h1 = [{"t": 10.0, "kind": "up", "what": "up"}, {"t": 12.0, "kind": "link", "what": "link down s0-s1"},
          {"t": 14.0, "kind": "link", "what": "link up s0-s1"}]
    h2 = [{"t": 11.0, "kind": "up", "what": "up"}, {"t": 12.0, "kind": "link", "what": "link down s0-s1"},
          {"t": 12.0, "kind": "node", "what": "node w2 down"}]
    got = merge({"h1": h1, "h2": h2})
    assert [(e["t"], e["host"], e["kind"]) for e in got] == [
        (10.0, "h1", "up"), (11.0, "h2", "up"), (12.0, "h1", "link"), (12.0, "h2", "link"), (12.0, "h2", "node"),
        (14.0, "h1", "link")]   # equal times: the hosts' order, then each host's own
    assert "host" not in h1[0] and got[0] == {**h1[0], "host": "h1"}   # copies: the inputs are left alone
    assert merge({}) == [] and merge({"h1": []}) == []


def test_hosts_answers_failures_and_the_host_column():
    from types import SimpleNamespace

    from testbed import events
    from testbed.observe.answers import parse_answers

    ok = SimpleNamespace(rc=0, stdout=json.dumps({"t": 1.5, "kind": "up", "what": "up"}) + "\nnoise\n", stderr="")
    down = SimpleNamespace(rc=3, stdout="", stderr="error: no testbed named 'x' is up\n")
    got, failed, said = parse_answers({"h1": ok, "h2": down, "h3": OSError("host h3 did not answer"), "h4": None})
    assert got == {"h1": [{"t": 1.5, "kind": "up", "what": "up"}]}
    assert failed == {"h2": "no testbed named 'x' is up", "h3": "host h3 did not answer", "h4": "no answer"}
    assert said == {"h1": "1 line(s) of its output are not events and were skipped"}
    line = events.describe({"t": 1.5, "kind": "link", "what": "link down s0-s1", "host": "h2"}, host_width=4)
    assert line.endswith(".500  h2    link      link down s0-s1"), line
    assert events.describe({"t": 1.5, "kind": "up", "what": "up"}).endswith(".500  up        up")   # as before


@pytest.mark.slow   # a real run judged by its verdict (~70 s beside other tests: it calibrates again)
@pytest.mark.root
def test_a_testbed_tells_its_story(testbed, tmp_path):
    """up, a link going down and up, a run with its steps and verdict, then down: all in the stream,
    in order, as `testbed events --json` prints it."""
    from testbed import events, lifecycle
    from testbed.faults import control
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text("name: ev\ngenerator: star\nparams: {n: 2}\n", "<test_events>"),
                 time_dilation="none")
    name = st["name"]
    control.link_down(name, "w0", "s0")
    control.link_up(name, "w0", "s0")
    env = {**os.environ, "TESTBED_STATE_DIR": os.environ["TESTBED_STATE_DIR"]}
    r = subprocess.run([sys.executable, "-m", "testbed", "run", "--name", name, "--", sys.executable,
                        str(REPO / "examples/train_ddp.py"), "--steps", "12", "--model", "mlp", "--hidden", "64"],
                       cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "testbed", "events", "--name", name, "--json"],
                         env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    recs = [json.loads(line) for line in out.stdout.splitlines()]
    whats = [f"{e['kind']}: {e['what']}" for e in recs]
    assert recs[0]["kind"] == "up", whats
    link = [w for w in whats if w.startswith("link:")]
    assert len(link) == 2 and "down" in link[0] and "up" in link[1], whats
    run = [e for e in recs if e["kind"] == "run"]
    assert "started" in run[0]["what"] and "ended: completed" in run[-1]["what"], whats
    assert [e["step"] for e in run if "step" in e] == [1, 10], whats
    assert recs[-1]["kind"] == "verdict" and recs[-1]["status"] in ("faithful", "not faithful", "inconclusive", "unverified")
    lifecycle.down(name)
    assert not events.path(name).exists()


@pytest.mark.root
def test_a_runs_report_lists_what_happened_during_it(testbed, tmp_path):
    """A link flap and a capture taken while a run goes are in its directory (testbed-events.jsonl)
    and its report, also after the testbed is down."""
    from testbed import lifecycle
    from testbed.faults import control
    from testbed.jobs import stacks
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state
    from testbed.report import report
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text("name: ev\ngenerator: star\nparams: {n: 2}\n", "<test_events>"),
                 time_dilation="none")
    name = st["name"]
    pcap = tmp_path / "w1.pcap"

    def meanwhile(_rd, _probe) -> None:
        def act() -> None:
            # while the ranks run (their job sleeps 6 s: the run's span), not before they are there
            wait_for(lambda: stacks.rank_pids(name), timeout=30, what="the run's ranks")
            control.link_down(name, "w0", "s0")
            control.link_up(name, "w0", "s0")
            subprocess.run([sys.executable, "-m", "testbed", "capture", "--name", name, "w1", "s0", "--duration", "1",
                            "-w", str(pcap)], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                           timeout=60)
        threading.Thread(target=act, daemon=True).start()

    res = run(cluster_from_state(name), [sys.executable, "-c", "import time; time.sleep(6)"], echo=False,
              base_dir=tmp_path, workdir=str(REPO), monitor=False, timeout=120, on_start=meanwhile)
    assert res.rc == 0
    lifecycle.down(name)
    text, _a, _plots = report(res.run_dir, plots=False)
    assert "during the run" in text and "link down w0 s0" in text and "link up w0 s0" in text, text
    assert f"captures taken: {pcap}" in text, text
