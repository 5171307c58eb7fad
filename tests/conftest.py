"""Shared fixtures, and how the suite is split, required and summarised.

- `root`: skip the test unless we are root and can make a network namespace (a failure under
  TESTBED_REQUIRE=root or =all: tests/requires.py).
- `state_dir`: TESTBED_STATE_DIR in a fresh tmp dir (tests never touch /run/testbed).
- `tb_name`: a unique testbed name per test (short: it ends up in namespace names).
- `testbed`: an `up` helper that brings testbeds up through testbed.lifecycle and,
  whatever happens, brings down everything the test brought up.
- `netns_snapshot`: names of all network namespaces (to assert nothing was left behind).
- `emu`, `line`: a module's emulated hosts and the pinned two-sides testbed over them
  (tests/cluster_hosts.py), made once for the module; `emulated_options` says which hosts.

The split (docs/HACKING.md, tests/suite.py): `make test` runs every test not marked `slow`,
`multihost` or `timing` in parallel (pytest-xdist), then the `timing` ones alone; `make
test-all` adds the `slow` and `multihost` ones. Whole modules are marked here, in MODULE_MARKS;
single tests carry their own `@pytest.mark.slow` / `@pytest.mark.timing`. A new file is in the
fast default until it is marked.

`@pytest.mark.requires("tool", ...)` skips a test without the tool, or fails it where the tool
is required (tests/requires.py). TESTBED_REQUIRE=all (CI) turns every other skip into a failure
too, except one whose reason names another kind of machine (netem, a GPU).

The calibration cache: a session keeps it in a file of its own (TESTBED_CALIBRATION_FILE),
seeded with this boot's machine cache when there is one, so that a calibration measured beside
other tests never lands in /run/testbed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import requires

# Modules marked as a whole. `slow`: minutes of wall time each (a file over ~60 s, measured
# 2026-12-02 on the 2-core machine, `--durations`); `multihost`: emulated hosts over real SSH (an
# sshd per host, every verb as a process); `timing`: what they assert is a rate, an RTT, a CPU
# share or an elapsed time, so they run alone after the parallel part.
MODULE_MARKS: dict[str, tuple[str, ...]] = {
    # (a test that uses emulated hosts through @pytest.mark.requires("sshd") is multihost on its own)
    "test_cluster_install.py": ("multihost", "slow"),   # a wheelhouse build, pip installs on two hosts
    "test_chaos.py": ("slow",),         # 30 seeded rounds of up, flaps and kill -9
    "test_concurrency.py": ("slow",),   # 20 seeded rounds of down racing faults
    "test_scenarios_run.py": ("slow",),  # every example scenario run to its end (up to 420 s each)
}
_STARTED = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TESTBED_CALIBRATION_FILE") or hasattr(config, "workerinput"):
        return   # set by the user, or by the controller of these xdist workers
    d = Path(tempfile.mkdtemp(prefix="testbed-cal-"))
    config.add_cleanup(lambda: shutil.rmtree(d, ignore_errors=True))
    mine = d / "calibration.json"
    try:
        from testbed.jobs import calibration

        machine = Path(calibration.DEFAULT_FILE)
        if calibration.cached() is None and _can_calibrate():
            # Measured here, before any test runs beside it (the parallel phase would disturb it, and
            # every `testbed run` and auto `up` would otherwise measure one): it waits for a quiet
            # machine and is kept for the boot only if clean (testbed.jobs.calibration).
            print("conftest: this boot has no calibration: measuring it before the tests (~25 s)", flush=True)
            try:
                calibration.get(progress=lambda m: print(f"conftest: {m.strip()}", flush=True))
            except calibration.CalibrationError as exc:
                print(f"conftest: no calibration: {exc}", flush=True)
        if calibration.cached() is not None:   # this boot's, every field checked
            shutil.copyfile(machine, mine)
    except Exception:
        pass
    os.environ["TESTBED_CALIBRATION_FILE"] = str(mine)


def _can_calibrate() -> bool:
    import importlib.util

    # not in the stock-kernel VM (make test-kernel): torch does not even import within 90 s under
    # TCG, and none of the netem tests it runs needs the calibration
    if os.environ.get("TESTBED_IN_KERNEL_VM") == "1":
        return False
    return importlib.util.find_spec("torch") is not None and requires._root()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark in MODULE_MARKS.get(item.path.name, ()):
            item.add_marker(getattr(pytest.mark, mark))
        # emulated hosts (an sshd each, every verb over SSH) are multihost wherever they are used
        if any("sshd" in m.args for m in item.iter_markers("requires")) and not item.get_closest_marker("multihost"):
            item.add_marker(pytest.mark.multihost)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        requires.need("root")
    for mark in item.iter_markers("requires"):
        for tool in mark.args:
            requires.need(tool)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and requires.strict():
        why = _skip_reason(rep)
        if not requires.MACHINE_BOUND_REASON.search(why):
            rep.outcome = "failed"
            rep.longrepr = f"skipped under TESTBED_REQUIRE=all (CI must not pass by skipping): {why}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and requires.strict():   # a module skipped as a whole
        why = _skip_reason(rep)
        if not requires.MACHINE_BOUND_REASON.search(why):
            rep.outcome = "failed"
            rep.longrepr = f"skipped under TESTBED_REQUIRE=all (CI must not pass by skipping): {why}"


def _skip_reason(rep: Any) -> str:
    r = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    return r.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line: what ran, what was skipped and why, what the marker selection left out."""
    if hasattr(config, "workerinput"):
        return
    stats = terminalreporter.stats
    reasons = Counter(_skip_reason(r) for r in stats.get("skipped", []))
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "error", "xfailed", "xpassed")}
    counts["skipped"] = sum(reasons.values())
    record = {"phase": os.environ.get("TESTBED_SUITE_PHASE"), "markexpr": config.option.markexpr or "",
              "deselected": len(stats.get("deselected", [])),
              "skipped_why": dict(reasons), **counts,
              "seconds": round(time.monotonic() - config.stash.get(_STARTED, time.monotonic()), 1)}
    out = os.environ.get("TESTBED_TEST_SUMMARY")
    if out:   # tests/suite.py merges the phases into one line
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        return
    if record["skipped"] or record["deselected"]:
        import suite

        terminalreporter.write_line(suite.summary_line([record]).splitlines()[0])


@pytest.fixture
def root() -> None:
    requires.need("root")


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Any:
    d = tmp_path / "state"
    d.mkdir()
    monkeypatch.setenv("TESTBED_STATE_DIR", str(d))
    return d


@pytest.fixture
def tb_name(request) -> Iterator[str]:
    """A fresh testbed name; whatever a test that failed half-way left under it goes afterwards
    (the test's state dir is deleted by pytest later: left alone, it would strand live workers)."""
    name = f"t{uuid.uuid4().hex[:6]}"
    if "state_dir" not in request.fixturenames:
        yield name
        return
    request.getfixturevalue("state_dir")   # set up first, so torn down after this
    yield name
    from testbed import lifecycle, store
    from testbed.cleanup import cleanup

    try:
        if store.exists(name):
            lifecycle.down(name)
    finally:
        cleanup()


@pytest.fixture
def testbed(root, state_dir) -> Iterator[Callable[..., dict]]:
    """up(topology, name=None, **kw) -> state; everything brought up is brought down afterwards."""
    from testbed import lifecycle
    from testbed.cleanup import cleanup
    from testbed import store

    names: list[str] = []

    def up(topo, name: str | None = None, **kw) -> dict:
        name = name or f"t{uuid.uuid4().hex[:6]}"
        names.append(name)
        return lifecycle.up(topo, name, **kw)

    yield up
    for name in names:
        if store.exists(name):
            try:
                lifecycle.down(name)
            except Exception:
                pass
    cleanup()


def testbed_namespaces(name: str) -> list[str]:
    from testbed.net import names, netns

    return netns.list_names(names.netns_prefix(name))


@pytest.fixture
def shared_tmp():
    """A folder workers see too (their /tmp is private): under /var/tmp, removed afterwards."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tb-test-", dir="/var/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- emulated hosts (tests/cluster_hosts.py): the one copy of these fixtures for every module -----------


@pytest.fixture(scope="module")
def emulated_options() -> dict[str, Any]:
    """How the module's emulated hosts are made: cluster_hosts.emulated_hosts' keywords. Two hosts
    of 8 cores here; a module that needs others overrides this fixture (`n`, `login_user`,
    `docker_socket`, an `env` to live with)."""
    return {}


@pytest.fixture(scope="module")
def emu(tmp_path_factory, emulated_options) -> Iterator[Any]:
    """The module's emulated hosts (an sshd each), destroyed after its last test."""
    from cluster_hosts import emulated_hosts

    yield from emulated_hosts(tmp_path_factory, **emulated_options)


@pytest.fixture(scope="module")
def line_topology() -> Path:
    """The topology `line` brings up: topologies/two-sides.yaml; a module that needs a variant of it
    (the same nodes and pins) overrides this fixture."""
    from cluster_hosts import TOPOLOGY

    return TOPOLOGY


@pytest.fixture(scope="module")
def line(request, emu, line_topology) -> Iterator[str]:
    """The name of `line_topology` up over the module's two hosts, pinned so that s0-s1 crosses them
    (cluster_hosts.up_line), named after the module; down after its last test."""
    from cluster_hosts import up_line

    yield from up_line(emu, request.module.__name__.removeprefix("test_").removeprefix("cluster_")[:4], line_topology)
