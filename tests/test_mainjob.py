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
        assert re.search(r"compute per step on one dedicated rank .*\n\s+[\d.]+ ms per step", text), text
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
