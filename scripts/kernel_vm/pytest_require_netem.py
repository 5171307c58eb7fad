"""pytest plugin for the stock-kernel stage: the run must not pass by skipping.

Loaded inside the VM by scripts/kernel_vm/guest.sh (`-p pytest_require_netem`,
with this directory on PYTHONPATH). Active only when TESTBED_REQUIRE_NETEM=1.

- A test that skips (plain skip, not xfail) is reported as a failure: inside
  the VM sch_netem is there, so a skip means a test or fixture decided the
  environment is wrong, and the stage would otherwise go green on nothing.
- The session fails unless at least one test was collected and passed.

The root tests/conftest.py should also turn its `netem` skip into a failure
under TESTBED_REQUIRE_NETEM=1; this plugin is the backstop.
"""

from __future__ import annotations

import os

import pytest

ACTIVE = os.environ.get("TESTBED_REQUIRE_NETEM") == "1"
_counts = {"passed": 0, "skipped_to_failed": 0}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not ACTIVE:
        return
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped under TESTBED_REQUIRE_NETEM=1 (the stage must not pass by skipping): {reason}"
        _counts["skipped_to_failed"] += 1
    elif rep.passed and rep.when == "call":
        _counts["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    if not ACTIVE:
        return
    collected = session.testscollected
    line = (
        f"testbed-kernel-vm: collected={collected} passed={_counts['passed']} "
        f"skips-turned-failures={_counts['skipped_to_failed']}"
    )
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(line)
    else:  # pragma: no cover
        print(line)
    if collected == 0 or _counts["passed"] == 0:
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED if collected == 0 else pytest.ExitCode.TESTS_FAILED
