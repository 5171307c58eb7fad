"""The machine's limits against a topology's needs (testbed/net/limits.py), and `up` refusing early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.net import limits

REPO = Path(__file__).resolve().parents[1]


def test_what_a_k16_fat_tree_needs(monkeypatch):
    have = {"user/max_net_namespaces": 1000, "user/max_mnt_namespaces": 100000, "kernel/pid_max": 32768,
            "kernel/threads-max": 200000}
    monkeypatch.setattr(limits, "_sysctl", lambda p: have.get(p))
    monkeypatch.setattr(limits, "mem_available", lambda: 20 << 30)
    got = {c.name.split(" (")[0]: c for c in limits.check(nodes=1344, workers=1024)}
    assert not got["network namespaces"].ok and got["network namespaces"].need == 1344
    assert got["mount namespaces"].ok
    assert not got["PIDs for the job's threads"].ok            # 1,024 ranks x 40 threads
    assert got["memory"].need == 1344 * limits.MEMORY_PER_NODE >> 20
    (refusal,) = limits.refusals(list(got.values()))
    assert "max_net_namespaces" in refusal and "sysctl -w user.max_net_namespaces=2688" in refusal
    assert any("kernel.pid_max" in w for w in limits.warnings(list(got.values())))


def test_unreadable_limits_do_not_refuse(monkeypatch):
    monkeypatch.setattr(limits, "_sysctl", lambda p: None)
    monkeypatch.setattr(limits, "mem_available", lambda: None)
    assert limits.refusals(limits.check(10, 4)) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_up_refuses_too_few_open_files_before_building(state_dir):
    """A hard open-files limit below what linking the namespaces holds: refused up front, naming the
    limit and the fix, with nothing built."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64));"
            "from testbed.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code, "up", "fat-tree", "--name", "lim", "--time-dilation", "none"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0
    assert "open files" in r.stderr and "ulimit -Hn" in r.stderr, r.stderr
    assert not (state_dir / "lim").exists()
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith("tb-lim-")]
