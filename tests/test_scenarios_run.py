"""Every example scenario, played for real against its small topology (root; a few tens of seconds each):
its outcome, the testbed restored, and every expectation of its own `expect:` block met."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IS_ROOT = os.geteuid() == 0
pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")]

EXPECTED = {"core-flap": "completed", "lossy-tor": "completed", "switch-failure": "completed",
            "straggler": "completed", "partition": "hung", "rank-crash": "failed", "phantom-uplink": "completed",
            # (torchft-partition and torchft-crash need the [ft] extra: tests/test_torchft.py plays the first)
            "elastic-crash": "completed"}


@pytest.fixture()
def env(tmp_path):
    old = os.environ.get("TESTBED_STATE_DIR")
    os.environ["TESTBED_STATE_DIR"] = str(tmp_path / "state")
    # the run directory must be visible inside workers, whose /tmp is private: not under /tmp
    runs = Path(tempfile.mkdtemp(prefix="tb-scenario-runs-", dir="/var/tmp"))
    try:
        yield runs
    finally:
        shutil.rmtree(runs, ignore_errors=True)
        if old is None:
            os.environ.pop("TESTBED_STATE_DIR", None)
        else:
            os.environ["TESTBED_STATE_DIR"] = old


def _links_pristine(name):
    from testbed.faults import control

    return all(l["state"] == "up" and not l["changed"] for l in control.link_show(name))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_example_scenario_runs(env, stem, monkeypatch):
    from testbed import lifecycle
    from testbed.faults.player import play
    from testbed.faults.scenario_loader import load_scenario
    from testbed import store

    monkeypatch.chdir(REPO)
    s = load_scenario(REPO / "scenarios" / f"{stem}.yaml")
    name = f"s{uuid.uuid4().hex[:6]}"
    lifecycle.up(s.load_topology(), name)
    try:
        res = play(name, s, base_dir=env, echo=False)
        assert res.outcome == EXPECTED[stem], (res.outcome, res.error)
        doc = json.loads((res.run_dir / "scenario.json").read_text())
        assert doc["outcome"] == res.outcome
        # what the file says should happen did (each line names the measured value when not)
        from testbed.faults.expect import verdict_line

        lines = [verdict_line(v) for v in res.expectations]
        assert res.judged and len(res.expectations) == len(s.expect), lines
        assert all(v.ok is True for v in res.expectations), "\n".join(lines)
        assert res.exit_code == 0
        assert doc["expectations"] == [v.to_json() for v in res.expectations]
        applied = [e for e in doc["events"] if "error" not in e]
        assert applied, doc["events"]
        assert all(abs(e["applied_s"] - e["planned_s"]) < 1.0 for e in applied), doc["events"]
        assert (res.run_dir / "events.jsonl").read_text().count("\n") == len(doc["events"])
        # the testbed's event stream tells the same steps, in the same order, between start and outcome
        from testbed import events

        told = [e for e in events.read(name) if e["kind"] == "scenario" and e.get("scenario") == s.name]
        assert "started" in told[0]["what"] and f"ended: {res.outcome}" in told[-1]["what"], told
        n = len(s.expect)
        assert told[-1]["what"].endswith(f"; expectations: {n} of {n} met"), told[-1]
        steps = [json.loads(line) for line in (res.run_dir / "events.jsonl").read_text().splitlines()]
        assert [(e["event"], round(e["applied_s"], 6)) for e in told[1:-1]] == \
            [(e["event"], round(e["applied_s"], 6)) for e in steps]
        assert all(e["what"] in t["what"] for e, t in zip(steps, told[1:-1]))
        if res.outcome == "hung":   # every rank's stack, taken before the job was stopped
            stacks = (res.run_dir / "stacks.txt").read_text()
            assert "rank" in stacks and "no stack" not in stacks, stacks
        assert (res.run_dir / "scenario.png").stat().st_size > 1000
        if stem == "rank-crash":
            assert "node crash of w1" in res.error
        if stem == "phantom-uplink":   # w0 ran the job, the others mirrored it
            ph = json.loads((res.run_dir / "summary.json").read_text())["phantoms"]
            assert ph["real_ranks"] == [0] and ph["phantom_ranks"] == [1, 2, 3] and not ph["errors"], ph
        # the testbed is left as the topology describes it
        assert _links_pristine(name)
        f = store.load(name).get("faults", {})
        assert not f.get("partition")
        assert all(n.get("state") in (None, "up") and "cpus" not in n for n in f.get("nodes", {}).values())
    finally:
        lifecycle.down(name)


@pytest.mark.timeout(120)
def test_bad_scenario_changes_nothing(env, tmp_path):
    from testbed import lifecycle
    from testbed.faults.player import play
    from testbed.faults.scenario import ScenarioError
    from testbed.faults.scenario_loader import scenario_from_data
    from testbed.topology.loader import load_topology

    name = f"s{uuid.uuid4().hex[:6]}"
    lifecycle.up(load_topology("star", ["params.n=2"]), name)
    try:
        bad = scenario_from_data({"name": "bad", "job": {"command": "true"}, "events": [
            {"at": "1s", "link": ["w0", "s0"], "action": "down"},
            {"at": "2s", "link": ["w1", "core9"], "action": "down"}]}, "bad.yaml")
        with pytest.raises(ScenarioError) as ei:
            play(name, bad, base_dir=env, echo=False)
        assert ei.value.path == "events[1].link"
        assert _links_pristine(name)
        assert not list(Path(env).glob("runs/*")), "no job was started"
    finally:
        lifecycle.down(name)


@pytest.mark.timeout(300)
def test_cli_gates_on_the_expectations_and_writes_junit(env):
    """`testbed scenario run --junit` as a CI runs it: partition.yaml expects `hung` (met: exit 0);
    the same file expecting `completed` exits 1, naming what it measured, in the console and the XML."""
    from xml.etree import ElementTree as ET

    from testbed import lifecycle
    from testbed.faults.scenario_loader import load_scenario

    s = load_scenario(REPO / "scenarios" / "partition.yaml")
    text = (REPO / "scenarios" / "partition.yaml").read_text()
    text = text.replace("python examples/train_ddp.py", f"python {REPO}/examples/train_ddp.py")
    good, bad = env / "partition.yaml", env / "partition-completes.yaml"
    good.write_text(text)
    bad.write_text(text.replace("  - outcome: hung\n", "  - outcome: completed\n"))
    name = f"s{uuid.uuid4().hex[:6]}"
    lifecycle.up(s.load_topology(), name)
    try:
        for f, rc in ((good, 0), (bad, 1)):
            xml = env / f"{f.stem}.xml"
            r = subprocess.run([sys.executable, "-m", "testbed", "scenario", "run", str(f), "-n", name, "-q",
                                "--junit", str(xml)], cwd=env, capture_output=True, text=True, timeout=240,
                               env={**os.environ, "COLUMNS": "250"})
            out = r.stdout
            assert r.returncode == rc, (r.returncode, out, r.stderr)
            assert "hung" in out and "met         hang_detected: {within: 10s}  ->  the watchdog said so" in out, out
            suite = ET.parse(xml).getroot().find("testsuite")
            cases = {c.get("name"): c for c in suite.findall("testcase")}
            assert list(cases) == ["outcome: completed" if rc else "outcome: hung", "hang_detected: {within: 10s}"]
            if rc:
                assert "NOT MET     outcome: completed  ->  outcome hung (no step progress for 6s" in out, out
                assert "expectations: 1 of 2 met" in out
                assert suite.get("failures") == "1" and cases["outcome: completed"].find("failure") is not None
            else:
                assert "expectations: 2 of 2 met" in out and suite.get("failures") == "0"
    finally:
        lifecycle.down(name)
