#!/usr/bin/env python3
"""The verbs of a testbed over several hosts, this tree against another (benchmark, issue #24).

    sudo .venv/bin/python bench/agent_verbs.py --baseline DIR [--repeats 5]

DIR is another checkout of testbed (e.g. `git worktree add /tmp/tb-base COMMIT`): its controller
runs with DIR first on sys.path (`python -m testbed`, started in DIR), this tree's from here; the
hosts run this tree's testbed either way (emulated hosts use this checkout's venv), so what differs
is how the controller asks them: the baseline's `testbed VERB ...` over SSH against the agent
(`testbed agent NAME`, testbed.cluster.agents).

Two emulated hosts (testbed.cluster.emulate) carry the 4-worker line of tests/test_cluster.py (s0-s1
crosses the hosts). Each verb runs as a whole `python -m testbed` process, timed from spawn to exit
(what a user waits for), the two trees alternating, one untimed warm-up of each first; medians and
the ratio this/baseline per verb, paired by repeat. Only processes this script starts are signalled;
the testbed and the hosts are removed in a finally.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = Path(sys.executable)
TOPOLOGY = REPO / "topologies" / "two-sides.yaml"
PINS = ["--pin", "w0=h1", "--pin", "w1=h1", "--pin", "s0=h1", "--pin", "w2=h2", "--pin", "w3=h2", "--pin", "s1=h2"]


def verbs(name: str) -> dict[str, list[str]]:
    """What is timed: each a command line after `testbed` (a change, then its undo, each its own)."""
    return {
        "status --json": ["status", name, "--json"],
        "link down": ["link", "down", "s0", "s1", "--name", name],
        "link up": ["link", "up", "s0", "s1", "--name", name],
        "node slow": ["node", "slow", "w2", "--cpus", "0.5", "--name", name],
        "node restore": ["node", "restore", "w2", "--name", name],
        "ps --json": ["ps", "--json", "--name", name],
        "events --json": ["events", "--json", "--name", name],
        "exec w2 true": ["exec", "w2", "--name", name, "--", "true"],
    }


def timed(cwd: Path, argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t0 = time.monotonic()
    r = subprocess.run([str(PYTHON), "-m", "testbed", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    return time.monotonic() - t0, r.returncode, (r.stderr or r.stdout)[-300:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, type=Path, help="another checkout of testbed (the baseline)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (emulated hosts, namespaces)")
    base = a.baseline.resolve()
    if not (base / "testbed" / "__init__.py").is_file():
        sys.exit(f"--baseline {base}: not a checkout of testbed")
    work = Path(tempfile.mkdtemp(prefix="tb-agent-bench-"))   # (not under /run: each emulated host has its own)
    state = Path(tempfile.mkdtemp(prefix="tb-agent-bench-", dir="/run"))   # the controller's state root
    env = {**os.environ, "TESTBED_STATE_DIR": str(state), "PYTHONDONTWRITEBYTECODE": ""}
    emu_dir = work / "hosts"
    name = f"ab{uuid.uuid4().hex[:5]}"
    made = up = False
    try:
        print(f"making 2 emulated hosts in {emu_dir} ...", flush=True)
        made = True
        subprocess.run([str(PYTHON), "-m", "testbed.cluster.emulate", "up", "--hosts", "2", "--dir", str(emu_dir),
                        "--cores", "8"], env=env, check=True, capture_output=True, timeout=180)
        print(f"up {name} over them ...", flush=True)
        up = True
        subprocess.run([str(PYTHON), "-m", "testbed", "up", str(TOPOLOGY), "--name", name, "--hosts",
                        str(emu_dir / "hosts.yaml"), "--known-hosts", str(emu_dir / "known_hosts"), *PINS,
                        "--time-dilation", "none"], cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
        rows: dict[str, dict[str, list[float]]] = {}
        for verb, argv in verbs(name).items():
            got = rows.setdefault(verb, {"this": [], "baseline": []})
            for which, cwd in (("this", REPO), ("baseline", base)):   # warm-up, untimed
                _, rc, said = timed(cwd, argv, env)
                if rc != 0:
                    print(f"  ! {verb} ({which}) exit {rc}: {said}", flush=True)
            for i in range(a.repeats):
                order = (("this", REPO), ("baseline", base)) if i % 2 == 0 else (("baseline", base), ("this", REPO))
                for which, cwd in order:
                    s, rc, said = timed(cwd, argv, env)
                    if rc == 0:
                        got[which].append(s)
                    else:
                        print(f"  ! {verb} ({which}) exit {rc}: {said}", flush=True)
            this, old = got["this"], got["baseline"]
            pairs = [t / b for t, b in zip(this, old)]
            print(f"{verb:16s} this {statistics.median(this):.3f} s  baseline {statistics.median(old):.3f} s  "
                  f"this/baseline {statistics.median(pairs):.2f} (pairs {min(pairs):.2f}-{max(pairs):.2f}, "
                  f"n={len(pairs)})" if this and old and pairs else f"{verb:16s} (no complete pair)", flush=True)
    finally:
        if up:
            subprocess.run([str(PYTHON), "-m", "testbed", "down", name], cwd=REPO, env=env, capture_output=True,
                           timeout=300)
        if made:
            subprocess.run([str(PYTHON), "-m", "testbed.cluster.emulate", "down", "--dir", str(emu_dir)], env=env,
                           capture_output=True, timeout=180)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
