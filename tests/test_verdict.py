"""The verdict on a run: synthetic run directories (pure), and real runs (root): an overloaded run is
not faithful, a light one is."""

import json
import sys
from pathlib import Path

import pytest

from testbed.report.verdict import instances, judge
from testbed.topology.loader import load_topology_text
from testbed.topology.plan import plan_network
from testbed.topology.reference import MachineConstants, predict

REPO = Path(__file__).resolve().parents[1]
STAR2 = "name: s2\ngenerator: star\nparams: {n: 2}\ntiers:\n  host: {bandwidth: 1gbit, delay: 0s}\n"
MACHINE = MachineConstants(alpha_s=100e-6, beta_s_per_byte=1e-9, source="test")


def _write_run(d: Path, times: list[float], s: float = 1.0, nbytes: int = 16 << 20, monitor=None) -> Path:
    """A run of two ranks that made len(times) all_reduces, each taking times[i] seconds (emulated)."""
    (d / "probe").mkdir(parents=True)
    topo = load_topology_text(STAR2, "<t>")
    (d / "topology.json").write_text(json.dumps(topo.to_json()))
    (d / "summary.json").write_text(json.dumps({"world_size": 2, "time_dilation": {"factor": s, "cap_cpu": s > 1},
                                                "machine": MACHINE.to_json(), "duration_s": 10}))
    for rank in (0, 1):
        recs = [{"ev": "start", "t": 0.0, "rank": rank, "world_size": 2, "worker": f"w{rank}"}]
        t = 100.0
        for i, dt in enumerate(times, 1):
            late = 0.05 * rank    # rank 1 arrives late: the wait is not the collective's time
            recs.append({"ev": "coll", "op": "all_reduce", "bytes": nbytes, "t": t + late, "dur": dt * s + (0.05 - late),
                         "async": False, "src": "api", "g": "0", "gn": 2, "seq": i, "be": "gloo"})
            t += 10
        (d / "probe" / f"rank-{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    if monitor is not None:
        (d / "monitor.json").write_text(json.dumps(monitor))
    return d


def _model(nbytes=16 << 20):
    topo = load_topology_text(STAR2, "<t>")
    return predict(topo, plan_network(topo), "all_reduce", nbytes, ["w0", "w1"], MACHINE).time_s


def test_instances_start_at_the_last_arrival(tmp_path):
    from testbed.report.analyze import load_probe

    _write_run(tmp_path, [0.2, 0.3])
    inst = instances(load_probe(tmp_path), 2)
    (key, xs), = inst.items()
    assert key == ("all_reduce", 16 << 20, ())
    assert [round(i["end"] - i["start"], 6) for i in xs] == [0.2, 0.3]


def test_on_the_model_is_faithful_and_off_is_not(tmp_path):
    m = _model()
    monitor = {"cores": 2, "cpu": [], "qdiscs": {}, "delay_lines": {}}
    v = judge(_write_run(tmp_path / "ok", [m * 1.02] * 5, s=4, monitor=monitor))
    assert v.status == "faithful", v.lines()
    assert v.classes[0].error == pytest.approx(0.02, abs=1e-6)
    off = judge(_write_run(tmp_path / "off", [m * 1.3] * 5, s=4, monitor=monitor))
    assert off.status == "not faithful"
    assert any("1.30x the model" in r for r in off.reasons), off.reasons
    assert off.fixes, "a failing run says what to change"


def test_an_undilated_crowded_machine_is_called_so(tmp_path):
    m = _model()
    v = judge(_write_run(tmp_path, [m] * 3, s=1, monitor={"cores": 1, "cpu": []}))   # 2 ranks, 1 core
    assert v.status == "not faithful"
    assert any("CPU oversubscribed" in r for r in v.reasons)
    assert any("--time-dilation 2" in f for f in v.fixes)


def test_nothing_to_compare_is_unverified_never_faithful(tmp_path):
    d = _write_run(tmp_path, [])
    assert judge(d).status == "unverified"
    summary = json.loads((d / "summary.json").read_text())
    del summary["machine"]
    (d / "summary.json").write_text(json.dumps(summary))
    assert judge(d).status == "unverified"


def test_over_dilation_without_the_cap_is_flagged(tmp_path):
    d = _write_run(tmp_path, [_model()] * 3, s=8, monitor={"cores": 2, "cpu": []})
    summary = json.loads((d / "summary.json").read_text())
    summary["time_dilation"]["cap_cpu"] = False
    (d / "summary.json").write_text(json.dumps(summary))
    cpu = next(c for c in judge(d).checks if c.name == "cpu")
    assert cpu.ok is None and "over-dilated" in cpu.detail and "--ranks 2" in cpu.detail


def test_delay_line_lateness_fails_the_run(tmp_path):
    m = _model()
    late = [0] * 24
    late[12] = 100   # 100 frames 2-4 ms late on a 1 ms link
    first = {"7": {"ab": {"delay_s": 1e-3, "drops": 0, "late_hist_us_log2": [0] * 24},
                   "ba": {"delay_s": 1e-3, "drops": 0, "late_hist_us_log2": [0] * 24}}}
    last = {"7": {"ab": {"delay_s": 1e-3, "drops": 0, "late_hist_us_log2": late},
                  "ba": {"delay_s": 1e-3, "drops": 3, "late_hist_us_log2": [0] * 24}}}
    v = judge(_write_run(tmp_path, [m] * 3, s=2, monitor={"cores": 2, "cpu": [],
                                                          "delay_lines": {"first": first, "last": last}}))
    assert v.status == "not faithful"
    assert any("3072 us late on average, 4096 us p99" in r for r in v.reasons), v.reasons
    assert any("dropped 3 frame" in r for r in v.reasons), v.reasons


# -- real runs --------------------------------------------------------------------------------------------


def _bench(cluster, tmp_path, ops="all_reduce", sizes="16M", workers=None):
    from testbed.jobs import calibration
    from testbed.jobs.run import run
    from testbed.report import report

    machine = calibration.get().constants()
    cmd = [sys.executable, "-m", "testbed.jobs.collectives_bench", "--ops", ops, "--sizes", sizes,
           "--min-iters", "3", "--max-iters", "5", "--budget", "0.05"]
    res = run(cluster, cmd, workers=workers, echo=False, machine=machine, base_dir=str(tmp_path), workdir=str(REPO),
              timeout=300)
    assert res.rc == 0, (res.run_dir / "logs").iterdir()
    text, a, _ = report(res.run_dir, plots=False)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["verdict"]["status"] == a["verdict"].status     # written where users read it
    assert "verdict:" in text
    return a["verdict"], summary


@pytest.mark.slow
def test_sixteen_ranks_without_dilation_are_not_faithful(testbed, tmp_path):
    from testbed.jobs.run import cluster_from_state

    topo = load_topology_text("name: s16\ngenerator: star\nparams: {n: 16}\ntiers:\n"
                              "  host: {bandwidth: 10gbit, delay: 2us}\n", "<t>")
    st = testbed(topo, time_dilation="none")
    v, summary = _bench(cluster_from_state(st["name"]), tmp_path)
    assert v.status == "not faithful", v.lines()
    assert any("CPU oversubscribed" in r for r in v.reasons), v.reasons
    assert summary["emulated_clock"] is False


@pytest.mark.slow
def test_a_light_run_is_faithful(testbed, tmp_path):
    from testbed.jobs.run import cluster_from_state

    # two ranks on two cores, a 1 Gbit/s link: the link, not the machine, sets the pace
    st = testbed(load_topology_text(STAR2, "<t>"), time_dilation="auto")
    v, summary = _bench(cluster_from_state(st["name"]), tmp_path)
    assert v.status == "faithful", v.lines()
    big = next(c for c in v.classes if c.nbytes == 16 << 20)
    assert abs(big.error) <= 0.10
    assert (Path(summary["run_dir"]) / "monitor.json").exists()
