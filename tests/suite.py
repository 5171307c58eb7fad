"""Run the test suite in phases and say, in one line, what ran, what was skipped and why.

    python tests/suite.py [--jobs N] PHASE... [-- PYTEST_ARGS...]

Phases (markers: pyproject.toml; whole modules are marked in tests/conftest.py):

    fast     everything not marked slow, multihost or timing, N tests at a time (pytest-xdist,
             --dist load: a test that cannot run beside others is marked timing instead)
    timing   the tests that assert a rate, an RTT, a CPU share or an elapsed time, one at a
             time after the parallel part (a measurement beside another test measures the other)
    rest     slow and multihost: minutes each, one at a time

    all      every phase above, in this order (one command for the whole suite)

`make test` = fast timing; `make test-rest` = rest; `make test-all` = all. Every phase runs even
when an earlier one failed. PYTEST_ARGS go to every phase (a path or -k narrows each; -m replaces
the phases' selection with one run). A phase that selects nothing (pytest's exit 5) is not a
failure. The exit status is the first failing phase's; the last two lines are the summary: why
tests were skipped or left out, then "suite: N passed, N failed, N skipped" and, after it, each
phase's own counts and time (a phase that ended without a result, e.g. killed, is named there).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

OUT = "slow or multihost"
# The one phase list, in the order `all` (make test-all) runs it: (in parallel?, marker expression)
PHASES = {
    "fast": (True, f"not ({OUT} or timing)"),
    "timing": (False, f"timing and not ({OUT})"),
    "rest": (False, OUT),
}
MAKE_TEST = ["fast", "timing"]


def _short(reason: str, width: int = 90) -> str:
    """One name per kind of skip: those for another kind of machine grouped, others as they read."""
    reason = " ".join(reason.split())
    if re.search(r"netem", reason, re.IGNORECASE):
        return "no sch_netem in this kernel (make test-kernel runs them)"
    if re.search(r"\bGPU|CUDA|nvidia", reason, re.IGNORECASE):
        return "no GPU here (or one: the test is for a machine without)"
    return reason if len(reason) <= width else reason[: width - 3] + "..."


def summary_line(records: list[dict], phases: list[str] | None = None) -> str:
    """The 'why' line and the closing count line of one or more pytest sessions (phases)."""
    n = {k: sum(r.get(k, 0) for r in records) for k in ("passed", "failed", "error", "skipped", "xfailed",
                                                         "xpassed")}
    why: Counter = Counter()
    for r in records:
        for reason, count in r.get("skipped_why", {}).items():
            why[_short(reason)] += count   # (several reasons can share one short name: they add up)
    ran = sum(n.values())
    total = max((sum(r.get(k, 0) for k in n) + r.get("deselected", 0) for r in records), default=0)
    left = total - ran
    parts = []
    if n["skipped"]:
        top = why.most_common(4)
        rest = n["skipped"] - sum(c for _, c in top)
        parts.append(f"skipped {n['skipped']}: " + "; ".join(f"{c} x {w}" for w, c in top)
                     + (f"; {rest} other" if rest else ""))
    if left > 0:
        if any("no_result" in r for r in records):
            parts.append(f"{left} not run (a phase ended without a result)")
        elif phases == MAKE_TEST:
            parts.append(f"{left} not run (marked {OUT}: make test-all runs them)")
        elif phases == ["rest"]:
            parts.append(f"{left} not run (not marked {OUT}: make test runs them)")
        else:
            parts.append(f"{left} deselected (-m, -k)")
    secs = sum(r.get("seconds", 0) for r in records)
    head = "suite: " + ("; ".join(parts) if parts else "nothing skipped, nothing left out") + f" ({secs:.0f} s)"
    closing = f"suite: {n['passed']} passed, {n['failed'] + n['error']} failed, {n['skipped']} skipped"
    if len(records) > 1 or any("no_result" in r for r in records):
        closing += " (" + "; ".join(_phase_part(r) for r in records) + ")"
    return f"{head}\n{closing}"


def _phase_part(r: dict) -> str:
    """One phase's counts: 'timing 13 passed, 1 failed (85 s)', or why it has none."""
    name = r.get("phase") or "pytest"
    if "no_result" in r:
        return f"{name}: no result, pytest exited {r['no_result']}"
    counts = [f"{r.get('passed', 0)} passed"]
    failed = r.get("failed", 0) + r.get("error", 0)
    if failed:
        counts.append(f"{failed} failed")
    if r.get("skipped"):
        counts.append(f"{r['skipped']} skipped")
    return f"{name} {', '.join(counts)} ({r.get('seconds', 0):.0f} s)"


def _records(path: str) -> list[dict]:
    """The phases' records so far (conftest.py appends one per pytest session)."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def _has_xdist(py: str) -> bool:
    return subprocess.run([py, "-c", "import xdist"], capture_output=True).returncode == 0


def main(argv: list[str]) -> int:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started with `&` from a script: the shell ignores SIGINT there, and that survives exec into
        # every test's testbed process, so the tests that press Ctrl-C wait out their timeouts and fail
        # (2026-12-06: 15 of them). Restored here; pytest and what it starts get the default again.
        print("suite.py: SIGINT was ignored (started in the background by a script?): restored for the tests",
              file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    jobs = int(os.environ.get("TEST_JOBS", "2"))
    phases: list[str] = []
    args = list(argv)
    passthrough: list[str] = []
    if "--" in args:
        i = args.index("--")
        args, passthrough = args[:i], args[i + 1:]
    while args:
        a = args.pop(0)
        if a == "--jobs":
            jobs = int(args.pop(0))
        elif a in PHASES:
            phases.append(a)
        elif a == "all":
            phases += list(PHASES)
        else:
            print(f"suite.py: unknown argument {a!r} (phases: {', '.join(PHASES)}, all; pytest's after --)",
                  file=sys.stderr)
            return 2
    phases = phases or MAKE_TEST
    py = sys.executable
    if jobs > 1 and not _has_xdist(py):
        print("suite.py: pytest-xdist is not installed (pip install -e '.[test]'): running serially",
              file=sys.stderr)
        jobs = 1
    own_m = any(a == "-m" or a.startswith("-m") and not a.startswith("--") for a in passthrough)
    runs = [("custom", phases[0] == "fast", None)] if own_m else \
        [(p, PHASES[p][0], PHASES[p][1]) for p in phases]
    fd, summary = tempfile.mkstemp(prefix="testbed-suite-", suffix=".jsonl")
    os.close(fd)
    rc = 0
    t0 = time.monotonic()
    records: list[dict] = []
    try:
        for name, parallel, expr in runs:
            cmd = [py, "-m", "pytest"]
            if parallel and jobs > 1:
                # --dist load: loadgroup (and loadscope) deadlock once a crashed worker is replaced
                # (pytest-xdist 3.8.0, issues 1323, 1327, 1378)
                cmd += ["-n", str(jobs), "--dist", "load"]
            if expr:
                cmd += ["-m", expr]
            cmd += passthrough
            print(f"=== suite.py: phase {name}: {' '.join(cmd[1:])}", flush=True)
            before = len(_records(summary))
            r = subprocess.run(cmd, env={**os.environ, "TESTBED_TEST_SUMMARY": summary,
                                         "TESTBED_SUITE_PHASE": name})
            if r.returncode not in (0, 5) and rc == 0:
                rc = r.returncode
            got = _records(summary)[before:]
            # a pytest that was killed (or crashed) wrote no record: the summary says so, it does not
            # just count less
            records += got or [{"phase": name, "no_result": r.returncode}]
    finally:
        os.unlink(summary)
    print(f"=== suite.py: {' + '.join(n for n, _, _ in runs)} took {time.monotonic() - t0:.0f} s")
    print(summary_line(records, None if own_m else phases))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
