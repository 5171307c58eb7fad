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
        # the compute term is the ranks' own (each one's median step less its all_reduce)
        assert re.search(r"^compute per step [\d.]+ ms \(the median of 2 ranks' own, [\d.]+-[\d.]+ ms", text, re.M), text
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


def test_the_compute_term_is_each_ranks_step_less_its_all_reduce(tmp_path):
    """ranks_compute: per rank, the median over steps (the first is warm-up) of the step less its
    own DDP all_reduces, in emulated time; the median over ranks, with the lowest and highest.
    A rank that waited longer for the last one (rank 1 here) has more all_reduce, the same compute."""
    from testbed.mainjob import measured_split, ranks_compute

    probe = tmp_path / "probe"
    probe.mkdir()
    s = 2.0
    for rank, (compute, wait) in enumerate(((0.4, 0.0), (0.3, 0.1), (0.5, 0.0))):
        recs, t = [], 0.0
        for _ in range(5):
            t += compute
            recs.append({"ev": "coll", "op": "all_reduce", "src": "ddp", "t": t, "dur": 0.2 + wait})
            recs.append({"ev": "coll", "op": "barrier", "src": "probe", "t": t, "dur": 5.0})   # not DDP's: not counted
            t += 0.2 + wait
            recs.append({"ev": "step", "t": t})
        (probe / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = ranks_compute(tmp_path, s)
    assert c is not None and c["ranks"] == 3
    assert (round(c["compute_s"], 6), round(c["low_s"], 6), round(c["high_s"], 6)) == (0.2, 0.15, 0.25)
    split = measured_split(tmp_path, s)
    assert split is not None and (round(split["comm_s"], 6), round(split["rest_s"], 6)) == (0.1, 0.2)
    assert ranks_compute(tmp_path / "nothing", s) is None
