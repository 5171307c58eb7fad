"""Runs of groups (testbed.jobs.groups) and torchft on them: a lighthouse and replica groups on
different workers, each group its own torch world, through partitions and crashes.

- job files and --group/--service strings: every mistake named (pure logic);
- groups on a real testbed: each its own world and port, a failed group started again, a service
  stopped when the groups are done, the probe's files one per rank of the job (root);
- torchft 0.2.0 (`pip install -e '.[ft]'`; a named skip without it, a failure under
  TESTBED_REQUIRE=all): a replica group cut off by a partition rejoins with the others' weights
  (the scenario scenarios/torchft-partition.yaml, judged by its own `expect:`), and a crashed
  group's node started again: the group restarts, heals from a peer and ends with the same weights.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from waiting import wait_for

REPO = Path(__file__).resolve().parents[1]



# torchft is an optional extra (pip install -e '.[ft]'; .ci/run installs it): its tests skip,
# naming it, where it is not installed, and fail in CI (TESTBED_REQUIRE=all)


# -- job files and command-line groups (pure) --------------------------------------------------------------------

def test_a_group_string_names_its_workers_and_command():
    from testbed.jobs import groups

    job = groups.from_cli(["g0=w1,w2 torchrun train.py --lr 0.1"], ["lh=w0 torchft_lighthouse --min_replicas 1"],
                          restarts=2)
    lh, g0 = job.groups
    assert (lh.name, lh.workers, lh.service, lh.restarts) == ("lh", ("w0",), True, 0)
    assert (g0.name, g0.workers, g0.cmd, g0.restarts) == ("g0", ("w1", "w2"),
                                                          ("torchrun", "train.py", "--lr", "0.1"), 2)
    assert job.workers == ["w0", "w1", "w2"]


@pytest.mark.parametrize("groups_, services, why", [
    (["g0=w1"], [], "NAME=WORKERS CMD"),
    (["g-0=w1 python x.py"], [], "a name is a letter"),
    (["g0=w1,w1 python x.py"], [], "named twice"),
    (["g0=w1 python x.py", "g0=w2 python x.py"], [], "two groups or services are named g0"),
    ([], ["lh=w0 torchft_lighthouse"], "needs at least one group"),
    (["g0=w1 other.yaml"], [], "another job file"),
])
def test_a_bad_group_string_is_refused_naming_it(groups_, services, why):
    from testbed.jobs import groups

    with pytest.raises(groups.JobError, match=why) as e:
        groups.from_cli(groups_, services)
    assert e.value.exit_code == 2


@pytest.mark.parametrize("text, where", [
    ("groups: {g0: {workers: [w1]}}", "groups.g0.command: missing"),
    ("groups: {g0: {workers: [w1], command: x, restart: 1}}", "groups.g0.restart: unknown field"),
    ("groups: {g0: {workers: [w1], command: x, restarts: -1}}", "groups.g0.restarts: an integer from 0"),
    ("services: {lh: {workers: [w0], command: x, restarts: 1}}\ngroups: {g0: {workers: [w1], command: x}}",
     "services.lh.restarts: unknown field"),
    ("groups: {g0: {workers: w1, command: [1]}}", "groups.g0.command: a string or a list"),
    ("env: {1X: y}\ngroups: {g0: {workers: [w1], command: x}}", "env.1X: not an environment variable"),
    ("jobs: {}", "jobs: unknown field"),
    ("- a list", "a mapping with groups"),
    ("groups: {g0: [", "not YAML"),
])
def test_a_bad_job_file_is_refused_naming_file_and_field(tmp_path, text, where):
    from testbed.jobs import groups

    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(groups.JobError) as e:
        groups.load(f)
    assert str(e.value).startswith(str(f)) and where in str(e.value), str(e.value)


def test_the_example_job_file_reads_and_expands_addresses():
    from testbed.jobs import groups

    job = groups.load(REPO / "examples" / "torchft.job.yaml")
    assert [g.name for g in job.groups] == ["lighthouse", "g0", "g1"] and job.groups[0].service
    addrs = groups.addresses(job, {"w0": "10.0.0.1", "w1": "10.0.0.2", "w2": "10.0.0.3"})
    assert groups.expand(dict(job.env)["TORCHFT_LIGHTHOUSE"], addrs, where="env") == "http://10.0.0.1:29510"
    with pytest.raises(groups.JobError, match=r"\{addr:nope\}"):
        groups.expand("{addr:nope}", addrs, where="env X")
    with pytest.raises(groups.JobError, match="unknown worker w9"):
        groups.check_workers(groups.from_cli(["g0=w9 x"], []), ["w0", "w1"])


def test_the_probe_mirror_copies_whole_lines_and_refuses_a_planted_link(tmp_path):
    from testbed.jobs import groups

    probe = tmp_path / "probe"
    probe.mkdir()
    m = groups.ProbeMirror(probe, ["g0", "g1"], interval_s=3600).start()
    try:
        (probe / "g0" / "rank-0.jsonl").write_text('{"ev":"start"}\n{"ev":"step","t":1}\n{"ev":"st')
        (probe / "g1" / "rank-0.jsonl").symlink_to("/etc/passwd")      # a rank's link: never read
        (probe / "rank-g1_1.jsonl").symlink_to(tmp_path / "elsewhere")  # a planted flat name: never written through
        (probe / "g1" / "rank-1.jsonl").write_text('{"ev":"step","t":2}\n')
        m.pass_once()
        assert (probe / "rank-g0_0.jsonl").read_text() == '{"ev":"start"}\n{"ev":"step","t":1}\n'
        with open(probe / "g0" / "rank-0.jsonl", "a") as f:
            f.write('ep","t":3}\n')
    finally:
        m.stop()
    assert (probe / "rank-g0_0.jsonl").read_text().splitlines()[-1] == '{"ev":"step","t":3}'
    assert not (probe / "rank-g1_0.jsonl").exists() and not (tmp_path / "elsewhere").exists()


# -- groups on a real testbed ------------------------------------------------------------------------------------

def _star(n: int):
    from testbed.topology.loader import load_topology_text

    return load_topology_text(f"""
name: star
generator: star
params: {{n: {n}}}
tiers:
  host: {{bandwidth: 10gbit, delay: 0}}
""", "<test_torchft>")


# A group's rank: fails the first time it starts when FAIL_ONCE names its group, then takes 3
# optimizer steps (the probe records them) and says what world it was given.
RANK_SCRIPT = """
import os, sys, torch
g = os.environ["TESTBED_GROUP"]
print("world", g, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
      os.environ["TESTBED_ADDR_SVC"], os.environ["TESTBED_GROUP_RESTART"] if "TESTBED_GROUP_RESTART" in os.environ else "-",
      os.environ["PEER"], flush=True)
if os.environ.get("FAIL_ONCE") == g and "TESTBED_GROUP_RESTART" not in os.environ:
    sys.exit(3)
p = torch.nn.Parameter(torch.zeros(1))
o = torch.optim.SGD([p], lr=0.1)
for _ in range(3):
    p.grad = torch.ones(1)
    o.step()
"""


@pytest.mark.root
def test_groups_each_get_their_world_a_failed_group_restarts_and_services_stop(testbed, tmp_path, shared_tmp):
    from testbed.jobs import groups
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state

    st = testbed(_star(3))
    cl = cluster_from_state(st["name"])
    script = shared_tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    job = groups.from_mapping({
        "env": {"PEER": "{addr:w2}", "FAIL_ONCE": "g0"},
        "services": {"svc": {"workers": ["w0"], "command": "sleep 600"}},
        "groups": {"g0": {"workers": ["w1"], "command": [sys.executable, str(script)], "restarts": 1},
                   "g1": {"workers": ["w1", "w2"], "command": [sys.executable, str(script)]}},
    })
    res = run(cl, [], job=job, base_dir=tmp_path, workdir=str(REPO), echo=False, timeout=180, port=21000)
    logs = {w: (res.run_dir / "logs" / f"{w}.log").read_text() for w in ("w0", "w1", "w2")}
    assert res.rc == 0, logs
    a = cl.address
    worlds = sorted(l.split(" ", 1)[1] for w in logs for l in logs[w].splitlines() if " world " in l)
    # g0 (port 21001) started twice, failing the first time; g1 (port 21002) is a world of two on w1 and w2
    assert worlds == sorted([f"world g0 0 1 {a['w1']} 21001 {a['w0']} - {a['w2']}",
                             f"world g0 0 1 {a['w1']} 21001 {a['w0']} 1 {a['w2']}",
                             f"world g1 0 2 {a['w1']} 21002 {a['w0']} - {a['w2']}",
                             f"world g1 1 2 {a['w1']} 21002 {a['w0']} - {a['w2']}"]), logs
    s = res.summary
    by = {g["name"]: g for g in s["groups"]}
    assert by["g0"]["restarts_used"] == 1 and by["g0"]["failures"][0]["rc"] == 3
    assert by["g1"]["restarts_used"] == 0 and by["svc"]["kind"] == "service"
    svc = next(r for r in s["ranks"] if r["group"] == "svc")
    assert svc["rc"] in (143, 137)   # stopped by the launcher once the groups were done
    assert s["status"] == "completed" and s["launcher"] == "groups"
    # one probe file per rank of the job, each with its 3 steps
    for f in ("rank-g0_0", "rank-g1_0", "rank-g1_1"):
        recs = [json.loads(l) for l in (res.run_dir / "probe" / f"{f}.jsonl").read_text().splitlines()]
        assert sum(r["ev"] == "step" for r in recs) == 3, (f, recs)
    assert not list((res.run_dir / "probe").glob("rank-[0-9]*.jsonl"))
    from testbed.report import quorum

    assert "g0" in quorum.section(res.run_dir) and quorum.plot(res.run_dir).stat().st_size > 1000


@pytest.mark.root
def test_a_group_that_fails_with_no_restart_left_fails_the_run(testbed, tmp_path):
    from testbed.jobs import groups
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state

    st = testbed(_star(2))
    cl = cluster_from_state(st["name"])
    job = groups.from_cli(["g0=w0 sh -c 'exit 5'", "g1=w1 sleep 600"], [], restarts=0)
    res = run(cl, [], job=job, base_dir=tmp_path, workdir=str(REPO), echo=False, timeout=120, grace=0.5)
    assert res.rc == 5 and res.summary["status"] == "rank failed"
    assert res.summary["first_failure"]["label"] == "w0:g0.r0"


def test_groups_are_refused_on_a_testbed_over_several_hosts():
    from testbed.errors import RunError
    from testbed.jobs import groups
    from testbed.jobs.run import run
    from testbed.jobs.target import Cluster, Executor

    cl = Cluster("x", ["w0", "w1"], {"w0": "10.0.0.1", "w1": "10.0.0.2"}, {}, Executor(), part=frozenset({"w0"}))
    with pytest.raises(RunError, match="spans several hosts"):
        run(cl, [], job=groups.from_cli(["g0=w0 true"], []))


# -- torchft ------------------------------------------------------------------------------------------------------

def _ft_lines(run_dir: Path) -> list[dict]:
    from testbed.report import quorum

    return quorum.ft_records(run_dir)


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.requires("torchft")
def test_torchft_partition_scenario_meets_its_expectations(state_dir, tb_name, monkeypatch):
    """The issue's target: the job survives a partition of one replica group, and the group rejoins
    after the partition heals with the same weights as the others; asserted by the scenario's own
    expect: block."""
    import tempfile
    import shutil

    from testbed import lifecycle
    from testbed.faults.player import play
    from testbed.faults.scenario_loader import load_scenario

    monkeypatch.chdir(REPO)
    s = load_scenario(REPO / "scenarios" / "torchft-partition.yaml")
    runs = Path(tempfile.mkdtemp(prefix="tb-ft-runs-", dir="/var/tmp"))
    try:
        lifecycle.up(s.load_topology(), tb_name)
        res = play(tb_name, s, base_dir=runs, echo=False)
        doc = json.loads((res.run_dir / "scenario.json").read_text())
        logs = "\n".join((res.run_dir / "logs" / f"{w}.log").read_text()[-3000:] for w in ("w1", "w2"))
        assert res.outcome == "completed", (res.error, logs)
        assert doc["expectations"] and all(e["ok"] for e in doc["expectations"]), (doc["expectations"], logs)
        finals = {r["group"]: r for r in _ft_lines(res.run_dir) if r.get("final")}
        assert set(finals) == {"g0", "g1"} and finals["g0"]["digest"] == finals["g1"]["digest"], finals
        assert finals["g0"]["same_weights"] is True and finals["g1"]["same_weights"] is True
        # g0 went on alone while g1 was cut off: a quorum of one, then of two again
        g0 = [r["participants"] for r in _ft_lines(res.run_dir) if r["group"] == "g0" and not r.get("final")]
        assert 1 in g0 and g0[-1] == 2, g0
    finally:
        shutil.rmtree(runs, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.requires("torchft")
def test_torchft_group_on_a_crashed_node_restarts_and_heals(testbed, tmp_path):
    from testbed.faults import control
    from testbed.jobs import groups
    from testbed.jobs.run import run
    from testbed.jobs.rundir import StepReader
    from testbed.jobs.target import cluster_from_state

    st = testbed(_star(3))
    name = st["name"]
    cl = cluster_from_state(name)
    job = groups.load(REPO / "examples" / "torchft.job.yaml")
    started: dict = {}
    out: dict = {}

    def go():
        out["res"] = run(cl, [], job=job, base_dir=tmp_path, workdir=str(REPO), echo=False, timeout=300,
                         on_start=lambda rd, _probe: started.setdefault("rd", rd))

    t = threading.Thread(target=go)
    t.start()
    try:
        rd = wait_for(lambda: started.get("rd"), timeout=30, what="the run directory")

        def steps(group):
            r = StepReader(rd / "probe")
            r.poll()
            return sum(n for f, n in r.per_file.items() if f.name == f"rank-{group}_0.jsonl")

        wait_for(lambda: steps("g1") >= 20, timeout=180, what="20 committed steps of g1 before the crash")
        control.node_crash(name, "w2")
        g0_at_crash = steps("g0")
        wait_for(lambda: steps("g0") >= g0_at_crash + 20, timeout=120,
                 what="g0 going on alone: 20 more steps after w2 crashed")
        control.node_up(name, "w2")
    finally:
        t.join(300)
    res = out["res"]
    assert res.rc == 0, (res.run_dir / "logs" / "w2.log").read_text()[-3000:]
    g1 = next(g for g in res.summary["groups"] if g["name"] == "g1")
    assert g1["restarts_used"] == 1 and g1["failures"][0]["rc"] == 137, g1
    finals = {r["group"]: r for r in _ft_lines(res.run_dir) if r.get("final")}
    assert set(finals) == {"g0", "g1"} and finals["g0"]["digest"] == finals["g1"]["digest"], finals
    assert finals["g0"]["step"] == finals["g1"]["step"] == 600
