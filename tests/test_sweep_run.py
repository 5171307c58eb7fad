"""testbed sweep for real, on a 2-worker star, as a user runs it (a process): three bandwidths of a
short DDP job at a fixed dilation. Ctrl-C during the second run keeps the first run's row, a
whole table and no testbed; the same command continues, brings the testbed up for the second
point and reaches the third by reconfiguring its links in place; the kernel's shaping of that
testbed is then the same, link end by link end, as a fresh `up` of the third point's topology."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
TOPO = "name: {name}\ngenerator: star\nparams: {{n: 2}}\ntiers:\n  host: {{bandwidth: 10gbit, delay: 2us}}\n"
SPEC = """\
topology: {topo}
testbed: {name}
dilation: 2
job:
  command: python examples/train_ddp.py --model mlp --hidden 64 --layers 1 --steps 6 --log-every 3
  timeout: 240s
grid:
  link.bandwidth: [1gbit, 500mbit, 250mbit]
"""


class _Process:
    """The sweep as a process, its output read as it comes (SIGINT at its default: a Ctrl-C)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.t0 = time.monotonic()
        self.out: list[str] = []
        self.times: list[float] = []   # when each line was read, seconds from the start
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.times.append(time.monotonic() - self.t0)
            self.out.append(line)

    @property
    def text(self) -> str:
        return "".join(self.out)

    def timed(self) -> str:
        """The output with when each line came (for a failure's message: what happened when)."""
        return "".join(f"{t:7.2f} {line}" for t, line in zip(self.times, self.out))

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(5)
        return rc


def _rows(directory: Path) -> list[dict[str, str]]:
    with open(directory / "table.csv", newline="") as f:
        return list(csv.DictReader(f))


def _shaping(name: str, state_dir: Path) -> dict[str, object]:
    """Every link end's qdiscs, classes and egress filters as tc prints them in detail (no counters)."""
    st = json.loads((state_dir / name / "state.json").read_text())
    out = {}
    for i, rec in enumerate(st["links"]):
        ends = st["topology"]["links"][i]["endpoints"]
        for node, ifname in zip(ends, rec["ifnames"]):
            ns = f"tb-{name}-{node}"
            got = {}
            for what in (["qdisc", "show", "dev", ifname], ["class", "show", "dev", ifname],
                         ["filter", "show", "dev", ifname, "egress"]):
                res = subprocess.run(["ip", "netns", "exec", ns, "tc", "-j", "-d", *what], capture_output=True,
                                     text=True, timeout=30)
                assert res.returncode == 0, res.stderr
                # (this iproute2 prints classes as text even with -j; without -s there are no counters)
                got[what[0]] = json.loads(res.stdout or "[]") if res.stdout.startswith(("[", "{")) else res.stdout
            out[f"links[{i}] {node}:{ifname}"] = got
    return out


@pytest.mark.slow
def test_a_sweep_interrupted_continues_and_its_in_place_point_matches_a_fresh_up(root, state_dir, tb_name, tmp_path):
    from testbed import lifecycle, store
    from testbed.topology.loader import load_topology

    topo = tmp_path / "star2.yaml"
    topo.write_text(TOPO.format(name=tb_name))
    spec = tmp_path / "bw.yaml"
    spec.write_text(SPEC.format(topo=topo, name=tb_name))
    sweep_dir = tmp_path / "sw"
    env = {**os.environ, "TESTBED_STATE_DIR": str(state_dir), "COLUMNS": "160"}
    argv = [sys.executable, "-m", "testbed", "sweep", str(spec), "--dir", str(sweep_dir)]
    fresh = f"{tb_name}f"
    try:
        first = _Process(argv, env)
        # Ctrl-C once the second run's ranks are running (its run directory is there)
        wait_for(lambda: "[2/3]" in first.text and len(list((sweep_dir / "runs").glob("*"))) >= 2,
                 timeout=300, what="the sweep's second run to start (its run directory)")
        sent = time.monotonic() - first.t0
        first.proc.send_signal(signal.SIGINT)
        rc = first.wait(120)
        text = first.text
        assert rc == 130, f"Ctrl-C sent at {sent:.2f} s; the sweep's output as it came:\n{first.timed()[-3500:]}"
        assert "interrupted: 1 of 3 runs kept" in text, text[-3000:]
        rows = _rows(sweep_dir)
        assert [(r["point"], r["link.bandwidth"], r["build"]) for r in rows] == [("p00", "1gbit", "fresh")]
        assert float(rows[0]["iteration_ms"]) > 0 and rows[0]["verdict"] in (
            "faithful", "not faithful", "inconclusive", "unverified")
        assert json.loads((sweep_dir / "table.json").read_text())["runs_done"] == 1
        assert (sweep_dir / "iteration.png").stat().st_size > 1000
        assert not store.exists(tb_name), "an interrupted sweep leaves no testbed"

        second = _Process(argv + ["--keep-up"], env)
        rc = second.wait(600)
        text = second.text
        assert rc == 0, text[-3000:]
        assert "continuing: 1 of 3 runs done already" in text
        assert "[2/3] p01 link.bandwidth=500mbit" in text and "[3/3] p02 link.bandwidth=250mbit" in text
        assert "reconfigured 2 link(s) in place" in text, text[-3000:]
        rows = _rows(sweep_dir)
        assert [(r["point"], r["build"]) for r in rows] == [("p00", "fresh"), ("p01", "fresh"), ("p02", "in place")]
        assert all(float(r["iteration_ms"]) > 0 for r in rows)
        doc = json.loads((sweep_dir / "table.json").read_text())
        assert doc["runs_done"] == 3 and all(r["collectives"] for r in doc["rows"])
        # the run was judged against the links as they ran (250mbit), not the topology's 10gbit
        run_topo = json.loads((Path(doc["rows"][2]["run_dir"]) / "topology.json").read_text())
        assert {link["ab"]["bandwidth_bps"] for link in run_topo["links"]} == {250_000_000}

        in_place = _shaping(tb_name, state_dir)
        lifecycle.up(load_topology(str(topo), ["tiers.host.bandwidth=250mbit"]), fresh, time_dilation=2)
        assert _shaping(fresh, state_dir) == in_place, "a point reached in place is shaped as a fresh up shapes it"
        again = _Process(argv, env)   # everything done: nothing runs, the table stays
        assert again.wait(120) == 0 and "3 of 3 runs (complete)" in again.text
    finally:
        for name in (tb_name, fresh):
            if store.exists(name):
                lifecycle.down(name)
