"""What `up` checks once it knows its delay lines (testbed/net/delay_capacity.py): the arithmetic,
and one real refusal."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import requires
from waiting import wait_for

from testbed.net import delay_capacity as cap, limits

REPO = Path(__file__).resolve().parents[1]


def _room(n: int, what: str):
    return (n, what, lambda short: f"raise it by {short}")


def test_capacity_arithmetic_at_k16():
    """A k=16 fat-tree at auto dilation without netem: 1,344 nodes, 1,024 workers, 3,072 lines."""
    assert cap.engines_needed(3072, 20000, 2) == 2                  # one per CPU
    assert cap.engines_needed(3072, 1024, 2) == 10                 # (1024 - 64) // 3 = 320 lines each
    assert cap.engines_needed(1, 20000, 16) == 1 and cap.engines_needed(0, 20000, 2) == 0
    roomy = dict(files=20000, cpus=2, pids_room=_room(30000, "kernel.pid_max"),
                 memory_room=_room(20 << 30, "MemAvailable"), files_room=_room(2_000_000, "fs.file-max"))
    assert cap.refusals(cap.check(3072, 1344, 1024, **roomy)) == []
    got = cap.check(3072, 1344, 1024, **{**roomy, "pids_room": _room(1000, "pids.max 1,100 of cgroup x")})
    (pids,) = cap.refusals(got)
    need = 1024 * cap.PIDS_PER_WORKER + 2 + cap.PIDS_SLACK
    assert pids.startswith("processes (pids.max 1,100 of cgroup x)") and f"{need - 1000:,} short" in pids
    assert f"raise it by {need - 1000}" in pids
    mem = -(-(1344 * limits.MEMORY_PER_NODE + 2 * cap.ENGINE_MEMORY + 3072 * cap.LINE_MEMORY) // 2**20)
    (short,) = cap.refusals(cap.check(3072, 1344, 1024, **{**roomy, "memory_room": _room(2 << 30, "MemAvailable")}))
    assert short.startswith("memory, MiB (MemAvailable): 2,048 here") and f"{mem - 2048:,} short" in short
    (files,) = cap.refusals(cap.check(3072, 1344, 1024, **{**roomy, "files_room": _room(5000, "fs.file-max")}))
    assert files.startswith("open files (fs.file-max)") and f"{3 * 3072 + 1344 + 2 * 64 - 5000:,} short" in files
    # nothing readable: nothing refused
    blind = (None, "", str)
    assert cap.refusals(cap.check(10, 8, 4, files=20000, cpus=2, pids_room=blind, memory_room=blind,
                                  files_room=blind)) == []
    assert cap._raise_to("kernel.pid_max", 32768)(1114) == "sysctl -w kernel.pid_max=34816"   # 33,882 rounded up


def _pids_controller() -> Path | None:
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    try:
        return v2 if "pids" in (v2 / "cgroup.subtree_control").read_text().split() else None
    except OSError:
        return None


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_up_refuses_too_few_processes_before_building(state_dir):
    """A real refusal: `testbed up` in a cgroup whose pids.max is below what the workers need
    names the limit, how short it is and the fix, and builds nothing."""
    controller = _pids_controller()
    requires.need("cgroups", ok=controller is not None, why="a pids cgroup to hold `testbed up` in")
    group = controller / f"tbtest-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "pids.max").write_text("40\n")
        code = (f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
                "from testbed.cli import main; main()")
        r = subprocess.run([sys.executable, "-c", code, "up", "star", "--name", "pids", "--time-dilation", "none"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode != 0
        assert "processes (pids.max 40 of cgroup" in r.stderr and "short" in r.stderr, r.stderr
        assert f"> {group / 'pids.max'}" in r.stderr, r.stderr
        assert not (state_dir / "pids").exists()
        assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                    if n.startswith("tb-pids-")]
    finally:
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), timeout=10, what="the cgroup to empty")
        group.rmdir()
