"""`testbed scenario plan|run` on a testbed over several hosts, end to end against two emulated hosts
(testbed/cluster/emulate.py), and the pure pieces of testbed.cluster.scenario.

One testbed for the module: topologies/two-sides.yaml pinned so that h1 holds w0, w1 and s0 and h2
holds w2, w3 and s1: s0-s1 is the cut link (a VXLAN tunnel), the only path between the halves. The
scenario takes it down and up again and then caps its bandwidth while a 4-rank DDP job (the cheap
MLP of examples/train_ddp.py) runs across the hosts; every step must be applied by both hosts at
its planned time, and both hosts' parts must be as the topology describes them afterwards.
The CLI runs as a process, as a user runs it, from a working directory under /var/tmp (the ranks
start in it on every host, and the run directories go there).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from cluster_hosts import REPO, host_state, on_host, tb

JOB = f"python {REPO}/examples/train_ddp.py --model mlp --hidden 128 --log-every 100"


def root(test):
    """Against the emulated hosts: root, sshd and ssh."""
    return pytest.mark.root(pytest.mark.requires("sshd")(test))


# -- pure pieces --------------------------------------------------------------------------------------------------


def _plan(events, dilation=1.0):
    from testbed.faults.scenario_loader import scenario_from_data
    from testbed.faults.scenario_planner import plan_scenario
    from testbed.topology.loader import load_topology

    topo = load_topology(str(REPO / "topologies" / "two-sides.yaml"))
    s = scenario_from_data({"name": "t", "seed": 3, "job": {"command": "true"}, "events": events}, "t.yaml")
    return plan_scenario(s, topo, dilation)


def test_steps_survive_their_trip_as_json():
    from testbed.agent.scenario import step_from_json

    plan = _plan([{"at": "1s", "link": ["s0", "s1"], "set": {"bandwidth": "100mbit", "loss": "1%"},
                   "direction": "A->B", "for": "2s"},
                  {"at": "4s", "partition": [["w0", "w1"], ["w2"]], "for": "1s"},
                  {"at": "6s", "node": "w3", "action": "slow", "cpus": 0.5, "for": "1s"},
                  {"at": "8s", "link": ["w0", "s0"], "action": "flap", "every": "1s", "count": 2}])
    assert len(plan.steps) == 10
    for step in plan.steps:
        back = step_from_json(json.loads(json.dumps(step.to_json())))
        assert back == step, (back, step)
        assert back.describe() == step.describe()


def test_steps_close_together_share_a_call():
    from testbed.cluster.scenario import BATCH_MAX, _batches

    plan = _plan([{"at": "1s", "link": ["s0", "s1"], "action": "down", "for": "1s"},
                  {"at": "10s", "link": ["w0", "s0"], "action": "flap", "every": "0.5s", "count": 3},
                  {"at": "20s", "link": ["w2", "s1"], "action": "down"}], dilation=2.0)
    calls = _batches(plan, lead=3.0)   # wall times: 2, 4 | 20, 20.5, 21, 21.5, 22, 22.5 | 40
    assert [[plan.wall(s) for s in c] for c in calls] == [[2.0, 4.0], [20.0, 20.5, 21.0, 21.5, 22.0, 22.5], [40.0]]
    assert [len(c) for c in _batches(plan, lead=1.0)] == [1, 1, 6, 1]
    many = _plan([{"at": "1s", "link": ["s0", "s1"], "action": "flap", "every": "0.1s", "count": 40}])
    assert [len(c) for c in _batches(many, lead=2.0)] == [BATCH_MAX, BATCH_MAX, 80 - 2 * BATCH_MAX]


def test_remote_step_records_are_read_incrementally():
    import base64

    from testbed.cluster.scenario import RemoteSteps

    r = RemoteSteps("tb", "h1", "/x")

    def answer(rows):
        return "1700000000.5\n" + "".join(f"{f} {off} {base64.b64encode(data).decode()}\n" for f, off, data in rows)

    whole = b'{"ev": "start", "t": 99}\n{"ev": "step", "t": 100.5}\n'
    other = b'{"ev": "step", "t": 100.25}\nnot json\n'
    r.feed(answer([("rank-0.jsonl", 0, whole + b'{"ev": "st'), ("rank-1.jsonl", 0, other)]))
    assert (r.steps, r.first_new_t, r.last_step_t) == (2, 100.25, 100.5)
    assert r.offsets == {"rank-0.jsonl": len(whole), "rank-1.jsonl": len(other)}   # up to the last whole line
    r.feed(answer([("rank-0.jsonl", len(whole), b'{"ev": "step", "t": 101}\n'), ("rank-1.jsonl", 0, b"stale\n")]))
    assert (r.steps, r.first_new_t, r.last_step_t) == (3, 101.0, 101.0)   # an offset not asked for: skipped
    assert r.offsets["rank-1.jsonl"] == len(other)
    r.feed("1700000001\n")   # no probe directory yet, or nothing new
    assert r.first_new_t is None and r.steps == 3 and not r.ended
    end = b'{"ev": "end", "t": 102, "steps": 2}\n'
    r.feed(answer([("rank-0.jsonl", len(whole) + 25, end)]))
    assert not r.ended   # rank 1 still runs
    r.feed(answer([("rank-1.jsonl", len(other), end)]))
    assert r.ended and r.steps == 3


def test_an_event_record_says_what_each_host_did_and_when():
    from testbed.cluster.scenario import _event_record, _skews

    plan = _plan([{"at": "2s", "node": "w2", "action": "crash"}], dilation=2.0)
    step = plan.steps[0]
    res = {"h1": {"results": [{"what": "node crash w2 (0 processes killed)", "start": 103.9, "done": 104.01}]},
           "h2": {"results": [{"what": "node crash w2 (3 processes killed)", "start": 103.95, "done": 104.05}]}}
    rec = _event_record(step, plan, 100.0, res, 0, {"w2": "h2"})
    assert rec["what"] == "node crash w2 (3 processes killed)"   # the node's host says it
    assert rec["applied_wall_s"] == pytest.approx(4.05) and rec["applied_s"] == pytest.approx(2.025)
    assert rec["planned_wall_s"] == 4.0 and rec["failed_hosts"] == [] and "error" not in rec
    assert rec["hosts"]["h1"]["applied_wall_s"] == pytest.approx(4.01)
    res["h1"] = RuntimeError("host h1 is unreachable")
    rec = _event_record(step, plan, 100.0, res, 0, {"w2": "h2"})
    assert rec["failed_hosts"] == ["h1"] and rec["error"] == "h1: host h1 is unreachable"
    assert rec["applied_wall_s"] == pytest.approx(4.05)
    assert _skews({"h1": {"now": 10.2}, "h2": {"now": 13.0}, "h3": {"now": 8.5}}, 10.0, 10.5) == \
        {"h1": 0.0, "h2": pytest.approx(2.5), "h3": pytest.approx(-1.5)}


# -- against two emulated hosts ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir():
    """Where the CLI runs: the ranks start in it on every host (the emulated hosts share this
    machine's files) and the run directories go under it. Not /tmp: workers have their own."""
    d = Path(tempfile.mkdtemp(prefix="tb-cluster-scenario-", dir="/var/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_the_topology_says(emu, name: str) -> None:
    """Every link up with its topology profile, no node or partition fault, on both hosts."""
    for host in ("h1", "h2"):
        st = host_state(emu, host, name)
        for rec in st["links"]:
            assert rec.get("state", "up") == "up" and not rec.get("down_by") and not rec.get("profile"), (host, rec)
        faults = st.get("faults") or {}
        assert not faults.get("partition"), host
        assert all(n.get("state") in (None, "up") and "cpus" not in n for n in (faults.get("nodes") or {}).values())


def _scenario(path: Path, events: str, steps: int = 100000, timeout: str = "100s", hang_after: str = "30s") -> Path:
    path.write_text(f"""name: {path.stem}
seed: 1
job:
  workers: all
  command: {JOB} --steps {steps}
  timeout: {timeout}
  hang_after: {hang_after}
  startup: 60s
events:
{events}""")
    return path


CUT_FLAP = """  - at: 2s
    link: [s0, s1]
    action: down
    for: 2s
  - at: 6s
    link: [s1, s0]
    set: {bandwidth: 100mbit}
    for: 2s
"""


@root
@pytest.mark.slow
@pytest.mark.timing   # "at their times": each step applied within 0.5 s of its plan, a wall-time bound
@pytest.mark.timeout(240)
def test_a_cut_link_down_and_reshaped_by_both_hosts_at_their_times(emu, line, workdir):
    scen = _scenario(workdir / "cut-flap.yaml", CUT_FLAP)
    # plan: the controller's record (topology, dilation 1); nothing changes, no host is asked
    r = tb("scenario", "plan", str(scen), "--name", line)
    assert re.search(r"2\.000s\s+2\.000s\s+#0\s+link down s0 s1\n", r.stdout), r.stdout
    assert re.search(r"4\.000s\s+4\.000s\s+#0\s+link up s0 s1 \(revert\)", r.stdout), r.stdout
    assert re.search(r"6\.000s\s+6\.000s\s+#1\s+link set s1 s0 bandwidth=100mbit", r.stdout), r.stdout
    assert re.search(r"8\.000s\s+8\.000s\s+#1\s+link restore s1 s0 bandwidth_bps \(revert\)", r.stdout), r.stdout
    plan = json.loads(tb("scenario", "plan", str(scen), "--name", line, "--json").stdout)
    assert [s["op"] for s in plan["steps"]] == ["link_down", "link_up", "link_set", "link_restore"]

    # run: the job must outlast the timeline (8 s after its first step) and still complete: a step
    # count that takes ~20 s here; the job's own check compares the parameters on every rank
    rate = _steps_per_s(line, workdir)
    steps = max(200, int(rate * 20))
    scen = _scenario(workdir / "cut-flap.yaml", CUT_FLAP, steps=steps)
    r = tb("scenario", "run", str(scen), "--name", line, cwd=workdir, timeout=200)
    out = r.stdout
    assert "completed" in out, out + r.stderr
    rd = Path(re.search(r"run directory: (\S+)", out).group(1))
    assert str(rd).startswith(str(workdir))
    assert "[scenario] training started: the timeline begins" in out
    assert "parameters IDENTICAL on all 4 ranks" in (rd / "logs" / "w0.log").read_text()

    steps_done = [json.loads(x) for x in (rd / "events.jsonl").read_text().splitlines()]
    assert [(e["op"], e["target"]) for e in steps_done] == [
        ("link_down", ["s0", "s1"]), ("link_up", ["s0", "s1"]), ("link_set", ["s1", "s0"]),
        ("link_restore", ["s1", "s0"])]
    timings = []
    for e in steps_done:
        assert "error" not in e and e["failed_hosts"] == [], e
        assert sorted(e["hosts"]) == ["h1", "h2"], e   # every host changed its own end
        for host, v in e["hosts"].items():
            late = v["applied_wall_s"] - e["planned_wall_s"]
            timings.append(f"#{e['event']} {e['op']} on {host}: planned {e['planned_wall_s']:.3f}s, "
                           f"applied {v['applied_wall_s']:.3f}s ({late * 1e3:+.0f} ms; took {v['took_s'] * 1e3:.0f} ms)")
            # sent ahead, each host sleeps to the deadline: on time to within its own apply time
            assert 0 <= late < 0.5, timings
        assert e["what"] == e["hosts"]["h1"]["what"] == e["hosts"]["h2"]["what"]
        assert abs(e["applied_s"] - e["planned_s"]) < 0.5
    print("\n".join(timings))
    doc = json.loads((rd / "scenario.json").read_text())
    assert doc["outcome"] == "completed" and doc["over_hosts"]["hosts"] == ["h1", "h2"], doc
    assert doc["over_hosts"]["master_host"] == "h1" and not doc["over_hosts"]["restore_problems"]
    assert (rd / "scenario.png").stat().st_size > 1000
    assert json.loads((rd / "scenario-plan.json").read_text())["steps"] == plan["steps"]
    # while the cut link was down, no step could end (the halves meet only through it)
    ends = sorted(t for pts in _step_ends(rd).values() for t in pts)
    t0 = doc["over_hosts"]["t0_wall"]   # the first step, as the master host's ranks recorded it
    assert min(ends) <= t0 < min(ends) + 0.5
    down_at, up_at = (t0 + e["applied_wall_s"] for e in steps_done[:2])
    assert not [t for t in ends if down_at + 0.3 < t < up_at], "a step ended while the cut link was down"
    # both hosts' parts are back as the topology describes them; `link show` agrees
    as_the_topology_says(emu, line)
    links = json.loads(tb("link", "show", "--json", "--name", line).stdout)
    assert all(x["state"] == "up" and not x["changed"] for x in links), links
    # each host's event stream tells the scenario: started, the steps it applied, ended
    for host in ("h1", "h2"):
        told = [json.loads(x) for x in on_host(emu, host, "cat", f"/run/testbed/{line}/events.jsonl")
                .stdout.splitlines() if '"scenario"' in x]
        mine = [x["what"] for x in told if x.get("scenario") == "cut-flap"]
        assert mine[0].startswith("cut-flap started: 4 steps") and mine[-1] == "cut-flap ended: completed", mine
        assert [w.split(": ", 1)[1] for w in mine[-5:-1]] == [e["what"] for e in steps_done], mine


def _steps_per_s(name: str, workdir: Path) -> float:
    """Training steps per second of the job across the hosts, from a short run."""
    r = tb("run", "--name", name, "--", *JOB.split(), "--steps", "60", cwd=workdir, timeout=200)
    rd = Path(re.search(r"run directory: (\S+)", r.stdout).group(1))
    ends = _step_ends(rd)["0"]
    return (len(ends) - 1) / (ends[-1] - ends[0])


def _step_ends(rd: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for f in sorted((rd / "probe").glob("rank-*.jsonl")):
        for ln in f.read_text().splitlines():
            try:
                ev = json.loads(ln)
            except ValueError:
                continue
            if ev.get("ev") == "step":
                out.setdefault(f.stem.split("-", 1)[1], []).append(float(ev["t"]))
    return out


@root
@pytest.mark.timeout(120)
def test_a_bad_scenario_is_refused_before_anything_starts(emu, line, workdir):
    from testbed.net import capabilities

    runs = set(workdir.glob("runs/*"))
    bad = _scenario(workdir / "bad.yaml", """  - at: 1s
    link: [s0, s1]
    action: down
  - at: 2s
    link: [w2, core9]
    action: down
""")
    r = tb("scenario", "run", str(bad), "--name", line, cwd=workdir, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "bad.yaml: events[1].link: unknown node" in r.stderr, r.stderr
    r = tb("scenario", "plan", str(bad), "--name", line, check=False)
    assert r.returncode == 2 and "events[1].link: unknown node" in r.stderr, r.stderr
    if not capabilities.probe().netem:
        # a delay on the cut link: no host here has sch_netem, and a tunnel end has no delay line;
        # the hosts say so (each checks the links it holds an end of) before the job starts
        slow = _scenario(workdir / "slow.yaml", """  - at: 1s
    link: [s0, s1]
    set: {delay: 5ms}
""")
        r = tb("scenario", "run", str(slow), "--name", line, cwd=workdir, check=False)
        assert r.returncode == 2, r.stdout + r.stderr
        assert re.search(r"slow\.yaml: events\[0\]\.set\.delay: on host h[12]: this kernel has no sch_netem",
                         r.stderr), r.stderr
    assert set(workdir.glob("runs/*")) == runs, "a job was started"   # (the hosts' run directories go here too)
    as_the_topology_says(emu, line)


@root
@pytest.mark.timeout(150)
def test_a_partition_between_the_hosts_is_a_hung_job_and_is_healed_everywhere(emu, line, workdir):
    """The halves partitioned (each host drops at its own workers): no step can end, the watchdog
    stops the job on both hosts (exit 124, as on one host), the ranks' stacks come from both, and
    both hosts are healed."""
    from testbed.net import names

    scen = _scenario(workdir / "split.yaml", """  - at: 1s
    partition: [[w0, w1], [w2, w3]]
""", hang_after="5s")
    r = tb("scenario", "run", str(scen), "--name", line, "-q", cwd=workdir, timeout=140, check=False)
    assert r.returncode == 124, r.stdout + r.stderr
    assert re.search(r"hung: no step progress for 5s \(after \d+ steps\)", r.stdout), r.stdout
    assert "stopping it on every host" in r.stdout and "testbed restored: heal (h1, h2)" in r.stdout, r.stdout
    rd = Path(re.search(r"run directory: (\S+)", r.stdout).group(1))
    [e] = [json.loads(x) for x in (rd / "events.jsonl").read_text().splitlines()]
    assert e["op"] == "partition" and sorted(e["hosts"]) == ["h1", "h2"] and not e["failed_hosts"], e
    doc = json.loads((rd / "scenario.json").read_text())
    assert doc["outcome"] == "hung" and doc["job_status"] == "interrupted", doc
    stacks = (rd / "stacks.txt").read_text()
    assert "== host h1 ==" in stacks and "== host h2 ==" in stacks and "rank" in stacks, stacks
    as_the_topology_says(emu, line)
    for host, workers in (("h1", ("w0", "w1")), ("h2", ("w2", "w3"))):   # no drop rules left at the workers
        st = host_state(emu, host, line)
        for w in workers:
            ns = (st["runtime"]["workers"].get(w) or {}).get("netns") or names.netns(line, w)
            out = on_host(emu, host, "ip", "netns", "exec", ns, "nft", "list", "tables").stdout
            assert "testbed_partition" not in out, (host, w, out)


@root
@pytest.mark.slow
@pytest.mark.timing   # the steps on time (within 0.5 s) although the first is due 0.2 s after t0
@pytest.mark.timeout(240)
def test_a_scenario_with_phantoms_follows_the_real_rank_on_the_other_host(emu, line, workdir):
    """`real: [w2]`: the job runs on w2 (on h2) and the other three ranks are phantoms, rank 0 (the
    rendezvous, on h1) among them; their announcements cross the controller. t0 and the watchdog
    come from h2's step records (the only ones), and the cut link is reshaped by both hosts, on time
    although the first step is due only 0.2 s after t0."""
    scen = workdir / "phantom-cut.yaml"
    scen.write_text(f"""name: phantom-cut
seed: 1
job:
  workers: all
  command: {JOB} --steps 600 --no-check
  real: [w2]
  timeout: 100s
  hang_after: 30s
  startup: 60s
events:
  - at: 0.2s
    link: [s0, s1]
    set: {{bandwidth: 100mbit}}
    for: 2s
""")
    assert "(w2 real, 3 phantom(s))" in tb("scenario", "plan", str(scen), "--name", line).stdout
    r = tb("scenario", "run", str(scen), "--name", line, cwd=workdir, timeout=200)
    assert "completed" in r.stdout, r.stdout + r.stderr
    rd = Path(re.search(r"run directory: (\S+)", r.stdout).group(1))
    doc = json.loads((rd / "scenario.json").read_text())
    assert doc["outcome"] == "completed" and doc["over_hosts"]["steps_host"] == "h2", doc["over_hosts"]
    steps_done = [json.loads(x) for x in (rd / "events.jsonl").read_text().splitlines()]
    assert [e["op"] for e in steps_done] == ["link_set", "link_restore"]
    assert all("error" not in e and sorted(e["hosts"]) == ["h1", "h2"] for e in steps_done), steps_done
    # due 0.2 s after the first step: sent at once when t0 is seen, to the hosts' sessions started
    # with the job (no testbed process to start), so still on time
    late = [v["applied_wall_s"] - e["planned_wall_s"] for e in steps_done for v in e["hosts"].values()]
    print("lateness (s):", [round(x, 3) for x in late])
    assert all(-0.05 < x < 0.5 for x in late), late
    ph = json.loads((rd / "summary.json").read_text())["phantoms"]
    assert ph["real_ranks"] == [2] and ph["phantom_ranks"] == [0, 1, 3] and not ph["errors"], ph
    as_the_topology_says(emu, line)
