"""Shared fixtures.

- `root`: skip the test unless we are root and can make a network namespace.
- `state_dir`: TESTBED_STATE_DIR in a fresh tmp dir (tests never touch /run/testbed).
- `tb_name`: a unique testbed name per test (short: it ends up in namespace names).
- `testbed`: an `up` helper that brings testbeds up through testbed.lifecycle and,
  whatever happens, brings down everything the test brought up.
- `netns_snapshot`: names of all network namespaces (to assert nothing was left behind).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Iterator

import pytest


def _can_netns() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        from testbed.net import netns

        name = f"tbprobe-test-{uuid.uuid4().hex[:8]}"
        netns.create(name)
        netns.delete(name)
        return True
    except Exception:
        return False


_ROOT_OK: bool | None = None


@pytest.fixture
def root() -> None:
    global _ROOT_OK
    if _ROOT_OK is None:
        _ROOT_OK = _can_netns()
    if not _ROOT_OK:
        pytest.skip("needs root and network namespaces")


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

    try:
        if store.exists(name):
            lifecycle.down(name)
    finally:
        lifecycle.cleanup()


@pytest.fixture
def testbed(root, state_dir) -> Iterator[Callable[..., dict]]:
    """up(topology, name=None, **kw) -> state; everything brought up is brought down afterwards."""
    from testbed import lifecycle
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
    lifecycle.cleanup()


def testbed_namespaces(name: str) -> list[str]:
    from testbed.net import names, netns

    return netns.list_names(names.netns_prefix(name))
