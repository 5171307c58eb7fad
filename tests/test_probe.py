"""The probe: injected via PYTHONPATH, lazy, chains to an existing sitecustomize, counts steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.jobs.probe import PROBE_PATH

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, code, extra_path=None, probe_dir=True, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_")}
    env["PYTHONPATH"] = os.pathsep.join([PROBE_PATH] + ([str(extra_path)] if extra_path else []))
    if probe_dir:
        env["TESTBED_PROBE_DIR"] = str(tmp_path / "probe")
    env.update(env_extra or {})
    script = tmp_path / "user_script.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def _records(tmp_path):
    files = sorted((tmp_path / "probe").glob("rank-*.jsonl"))
    return {f.name: [json.loads(l) for l in f.read_text().splitlines()] for f in files}


def test_no_torch_no_file_and_no_import(tmp_path):
    r = _run(tmp_path, "import sys\nprint('torch' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert not list((tmp_path / "probe").glob("*.jsonl")) if (tmp_path / "probe").exists() else True


def test_chains_existing_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = 42\n")
    r = _run(tmp_path, "import builtins\nprint(getattr(builtins, 'CHAINED', None))\n", extra_path=other)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "42"


STEPS_CODE = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
m = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range({steps}):
    opt.zero_grad(); m(torch.randn(5, 8)).sum().backward(); opt.step()
t = torch.ones(1000)
dist.all_reduce(t)
dist.broadcast(t, 0)
dist.destroy_process_group()
print("ok")
"""


def test_records_exact_steps_and_collectives(tmp_path):
    import random

    steps = 7
    code = STEPS_CODE.format(port=random.randint(30000, 40000), steps=steps)
    r = _run(tmp_path, code, env_extra={"RANK": "0", "WORLD_SIZE": "1"})
    assert r.returncode == 0, r.stderr
    recs = _records(tmp_path)
    assert list(recs) == ["rank-0.jsonl"]
    rr = recs["rank-0.jsonl"]
    assert rr[0]["ev"] == "start" and rr[-1]["ev"] == "end"
    s = [x for x in rr if x["ev"] == "step"]
    assert len(s) == steps and [x["n"] for x in s] == list(range(1, steps + 1))
    assert all(x["samples"] == 5 for x in s)
    colls = [x for x in rr if x["ev"] == "coll"]
    ddp = [c for c in colls if c["src"] == "ddp"]
    api = [c for c in colls if c["src"] == "api"]
    assert len(ddp) == steps and all(c["bytes"] == (8 * 4 + 4) * 4 for c in ddp)
    assert [(c["op"], c["bytes"]) for c in api] == [("all_reduce", 4000), ("broadcast", 4000)]
    assert all(c["dur"] >= 0 for c in colls)


def test_no_probe_dir_means_no_patching(tmp_path):
    r = _run(tmp_path, "import torch, torch.distributed as d\nprint(hasattr(d.all_reduce, '__testbed_probe__'))\n",
             probe_dir=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
