"""The capability probe and `testbed doctor`."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from testbed.net import capabilities as capmod

IS_ROOT = os.geteuid() == 0


def _our_probe_namespaces() -> list[str]:
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return [n for n in names if n.startswith(f"tbprobe-{os.getpid()}")]


def test_rows_and_json_shape():
    caps = capmod.Capabilities(netem=False, htb=True, tun=True, latency_floor_s=12e-6, gpus=[])
    rows = caps.rows()
    names = [r[0] for r in rows]
    assert {"netem", "htb", "tun", "bpf", "docker", "gpus", "cgroup", "latency_floor"} <= set(names)
    assert any("12 us" in r[2] for r in rows if r[0] == "latency_floor")
    data = caps.to_json()
    assert data["delay_line"] is True and json.dumps(data)
    assert capmod.Capabilities.from_json(data).latency_floor_s == 12e-6


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root")
def test_probe_real_kernel_and_cleanup():
    caps = capmod.probe(measure_floor=True, refresh=True)
    assert caps.is_root and caps.htb  # every kernel we support has HTB
    assert caps.cgroup in ("v1", "v2", "hybrid", "none")
    assert caps.latency_floor_s is not None and 0 < caps.latency_floor_s < 0.002
    assert not _our_probe_namespaces()
    assert capmod.probe() is caps  # cached
    if not caps.netem:
        assert "netem" in caps.notes


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root")
def test_doctor_cli():
    from testbed.cli.app import app

    runner = CliRunner()
    r = runner.invoke(app, ["doctor", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert "netem" in data and "latency_floor_s" in data
    r = runner.invoke(app, ["doctor"])
    assert r.exit_code == 0 and "latency_floor" in r.output


def test_probe_is_cached_on_disk_for_this_boot(tmp_path, monkeypatch):
    """A second process reuses the kernel's answers instead of probing again (~1 s saved per `up`)."""
    import os

    import pytest

    from testbed.net import capabilities

    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(capabilities, "_CACHE", None)
    first = capabilities.probe()
    assert (tmp_path / ".capabilities.json").is_file()
    monkeypatch.setattr(capabilities, "_CACHE", None)
    monkeypatch.setattr(capabilities, "_probe_all", lambda: pytest.fail("probed again despite the boot cache"))
    again = capabilities.probe()
    assert (again.netem, again.htb, again.latency_floor_s) == (first.netem, first.htb, first.latency_floor_s)


def test_an_unchanged_probe_leaves_the_boot_cache_alone(tmp_path, monkeypatch):
    """A process that found the boot cache and the same answers does not write it again (each
    rewrite was an os.replace: a journal commit where /run is on a disk); a changed answer is written."""
    import json
    import os

    import pytest

    from testbed.net import capabilities

    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(capabilities, "_CACHE", None)
    capabilities.probe()
    cache = tmp_path / ".capabilities.json"
    before = cache.stat().st_ino
    monkeypatch.setattr(capabilities, "_CACHE", None)
    monkeypatch.setattr(capabilities, "_ON_DISK", {})
    capabilities.probe()
    assert cache.stat().st_ino == before
    monkeypatch.setattr(capabilities, "_CACHE", None)
    monkeypatch.setattr(capabilities, "_ON_DISK", {})
    monkeypatch.setattr(capabilities, "_cgroup_mode", lambda: "a mode not seen before")
    capabilities.probe()
    assert cache.stat().st_ino != before
    assert json.loads(cache.read_text())["cgroup"] == "a mode not seen before"


def test_without_turns_features_off_and_says_so():
    """TESTBED_WITHOUT: a kernel that has a feature runs the paths of one that lacks it."""
    caps = capmod.Capabilities(netem=True, htb=True, tun=True, bpf=True, notes={"gact_random": "not built"})
    assert capmod.without(caps, "") is caps and capmod.without(caps, " , ") is caps
    off = capmod.without(caps, "netem, bpf")
    assert (off.netem, off.bpf, off.tun, off.htb) == (False, False, True, True)
    assert off.notes["netem"] == "turned off by TESTBED_WITHOUT=netem, bpf"
    assert off.notes["gact_random"] == "not built"
    assert (caps.netem, caps.bpf) == (True, True) and "netem" not in caps.notes   # the probe's answer stays
    assert off.can_delay and off.delay_line and not off.can_lose
    assert dict((n, w) for n, _, w in off.rows())["netem"].startswith("turned off by TESTBED_WITHOUT")
    lacking = capmod.without(capmod.Capabilities(netem=False), "netem")
    assert lacking.notes["netem"].endswith("(the kernel lacks it too)")
    odd = capmod.Capabilities(notes={"netem": 3, "tun": None})    # notes come from a cache file: any shape
    assert [r[0] for r in odd.rows()] and capmod.Capabilities(notes="x").rows()


@pytest.mark.parametrize("text", ["netm", "netem,htb", "root", "docker", "nftables", "tbf"])
def test_without_refuses_what_it_cannot_turn_off(text):
    from testbed.errors import CapabilityError

    with pytest.raises(CapabilityError) as err:
        capmod.without(capmod.Capabilities(netem=True, htb=True), text)
    assert f"TESTBED_WITHOUT={text!r}" in str(err.value) and "one of: netem" in str(err.value)
