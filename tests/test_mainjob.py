"""The main job (`make testbed`, testbed/mainjob.py) end to end on a small topology, as a user runs it:
the process, its report, its plots, its verdict lines, and the testbed it leaves up."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAR = "name: {name}\ngenerator: star\nparams: {{n: 2}}\ntiers:\n  host: {{bandwidth: 10gbit, delay: 2us}}\n"


@pytest.mark.slow
def test_the_main_job_reports_and_judges(root, state_dir, tb_name, tmp_path):
    topo = tmp_path / "star2.yaml"
    topo.write_text(STAR.format(name=tb_name))
    env = {**os.environ, "TESTBED_STATE_DIR": str(state_dir)}
    out = subprocess.run([sys.executable, "-m", "testbed.mainjob", str(topo), "--steps", "8"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    try:
        assert out.returncode == 0, text[-3000:]
        assert f"bringing up {tb_name} (2 workers, 1 switches, 2 links)" in text
        assert re.search(r"time dilation: [\d.]+ \(auto\)", text), text
        # the compute term: the slowest rank's own work per step, what it was made of, and any wait for a CPU
        assert re.search(r"compute per step [\d.]+ ms: the slowest of 2 ranks' own work .*median of \d+ steps; "
                         r"the median rank [\d.]+ ms; the slowest one's kernel time [\d.]+ ms, \d+ page faults, "
                         r"garbage collection [\d.]+ ms; the last arrival -?[\d.]+ ms later than that work "
                         r"explains\)", re.sub(r"\s+", " ", text)), text
        # the three numbers of every class: the links alone, the model, the measurement
        assert re.search(r"collective\s+size\s+count\s+links ms\s+model ms\s+measured ms", text), text
        row = re.search(r"all_reduce\s+22\.6 MiB\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", text)
        assert row and 0 < float(row[1]) <= float(row[2]) and float(row[3]) > 0, text
        verdict = re.search(r"^verdict: (FAITHFUL|NOT FAITHFUL|INCONCLUSIVE|UNVERIFIED)$", text, re.M)
        assert verdict, text
        assert re.search(r"expected iteration on the emulated cluster: [\d.]+ ms = compute", text)
        plots = re.findall(r"^plot: (\S+)$", text, re.M)
        assert plots and all(Path(p).is_file() and Path(p).stat().st_size > 1000 for p in plots), plots
        run_dir = Path(plots[0]).parent
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["verdict"]["status"].upper() == verdict[1]     # what it printed is what it kept
        assert "network-bound hosts" in summary["verdict"]["constants"]
        assert f"The testbed {tb_name} is still up" in text
        st = subprocess.run([sys.executable, "-m", "testbed", "status", tb_name, "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and json.loads(st.stdout)["name"] == tb_name
    finally:
        subprocess.run([sys.executable, "-m", "testbed", "down", tb_name], env=env, capture_output=True, timeout=120)


def _ddp_records(steps: list[tuple[float, float, list[float]]], s: float) -> list[dict]:
    """A rank's probe records: per step (compute wall seconds, all_reduce seconds, the work it did in
    that compute: [cpu, sys, faults, gc]), in real seconds (s times the emulated ones)."""
    recs, t, w = [], 0.0, [0.0, 0.0, 0, 0.0]
    for compute, comm, work in steps:
        t += compute * s
        w = [a + b for a, b in zip(w, work)]
        recs.append({"ev": "coll", "op": "all_reduce", "src": "ddp", "t": t, "dur": comm * s, "w": list(w),
                     "w_done": list(w)})
        recs.append({"ev": "coll", "op": "barrier", "src": "api", "t": t, "dur": 5.0, "w": list(w)})   # not DDP's
        t += comm * s
        recs.append({"ev": "step", "t": t, "w": list(w)})
    return recs


def test_the_compute_term_is_the_slowest_ranks_own_work_per_step(tmp_path):
    """step_compute: per step, the own work (CPU seconds from one DDP completion to the next launch)
    of the rank that did the most; the median over steps, from step 3 (two warm-up steps). Rank 1
    is the slowest in steps 3 and 5, rank 0 in step 4: the term is the slowest per step, not one
    rank's, and not the median rank's. Rank 2 waited for a CPU in steps 4 and 5 (wall > CPU) and
    came last: the lag is the last arrival's wall less the slowest work, per step (0, 0.3, 0.1)."""
    from testbed.mainjob import measured_split, own_work, step_compute

    probe = tmp_path / "probe"
    probe.mkdir()
    s = 2.0
    warm = [(1.0, 0.1, [1.0, 0.5, 9000, 0.3])] * 2
    ranks = {
        0: warm + [(0.40, 0.2, [0.40, 0.0, 0, 0.0]), (0.50, 0.1, [0.50, 0.1, 1152, 0.0]),
                   (0.40, 0.2, [0.40, 0.0, 0, 0.0])],
        1: warm + [(0.60, 0.05, [0.60, 0.2, 2304, 0.0]), (0.40, 0.2, [0.40, 0.0, 0, 0.0]),
                   (0.70, 0.05, [0.70, 0.3, 2304, 0.1])],
        2: warm + [(0.40, 0.2, [0.40, 0.0, 0, 0.0]), (0.80, 0.05, [0.45, 0.0, 0, 0.0]),
                   (0.80, 0.05, [0.45, 0.0, 0, 0.0])],
    }
    for rank, steps in ranks.items():
        (probe / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _ddp_records(steps, s)))
    w = own_work(_ddp_records(ranks[1], s), s)
    assert sorted(w) == [3, 4, 5]
    assert {k: round(v, 6) for k, v in w[3].items()} == {"wall_s": 0.6, "cpu_s": 0.6, "sys_s": 0.2, "faults": 2304,
                                                          "gc_s": 0.0}
    c = step_compute(tmp_path, s)
    assert c is not None and (c["ranks"], c["steps"]) == (3, 3)
    # the slowest per step: 0.6 (rank 1), 0.5 (rank 0), 0.7 (rank 1): median 0.6; the median rank: 0.4, 0.45, 0.45
    assert round(c["compute_s"], 6) == 0.6 and round(c["typical_s"], 6) == 0.45
    assert (round(c["sys_s"], 6), c["faults"], round(c["lag_s"], 6)) == (0.2, 2304, 0.1)
    # a rank capped at its share of the cores (auto's cap) had 1.5 of this machine's cores in emulated
    # time: its CPU seconds take 1/1.5 emulated second each; a record that is not a sane number is 1
    for cores, expect in ((1.5, 0.4), ("1.5", 0.6), (float("nan"), 0.6), (0.5, 0.6), (1e9, 0.6)):
        (tmp_path / "summary.json").write_text(json.dumps({"time_dilation": {"factor": s, "rank_cores": cores}}))
        c = step_compute(tmp_path, s)
        assert round(c["compute_s"], 6) == expect, (cores, c)
    (tmp_path / "summary.json").unlink()
    split = measured_split(tmp_path, s)
    assert split is not None
    # a probe without work readings (an older run): no term, and the main job then states no expected iteration
    (probe / "rank-0.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k not in ("w", "w_done")}) + "\n" for r in _ddp_records(ranks[0], s)))
    assert step_compute(tmp_path, s)["ranks"] == 2
    assert step_compute(tmp_path / "nothing", s) is None
    # a rank's records are not trusted: bad times and readings drop their steps, they never raise
    bad = _ddp_records(ranks[1], s)
    bad[3]["t"], bad[6]["w"], bad[9]["w_done"], bad[12]["dur"] = "x", [float("nan")] * 4, None, float("inf")
    # step 3: no step-2 launch, a NaN reading; step 5: no completion reading, no finite duration
    assert set(own_work(bad, s)) == {4}
