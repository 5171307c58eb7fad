"""`testbed install` (testbed/cluster/install.py, testbed/cli/install.py): this controller's testbed
put on the hosts of a hosts file over SSH, from a wheelhouse built here, then used by `up`.

Two emulated hosts (tests/cluster_hosts.py). They share this machine's files but each has its own
/run (a tmpfs of its mount namespace), so the PREFIX is a fresh directory under /run: each host gets
its own installation there, made in parallel exactly as on two real servers, never visible on this
machine, and gone with the hosts. The wheelhouse is built into a cache of the test's own
(TESTBED_CACHE_DIR), and its digest recorded in a ledger of the test's own
(TESTBED_WHEELHOUSE_LEDGER): the machine's, /var/lib/testbed/wheelhouses, is never written
(recording prunes old entries: a test would drop the operator's); if pip cannot reach a package index here, the tests that need it skip saying
so (they fail under TESTBED_REQUIRE=wheelhouse or =all, as in CI); any other error building it fails.

The hosts file starts with `testbed:` at a path where nothing is: `up` is refused with the hint to
run `testbed install`. A Debian 12 /usr/bin/python3 (3.11.2) is refused naming its version. The
controller's own base interpreter (>= 3.11.4) installs on both hosts; a second install finds it
there; with `testbed:` set to PREFIX/bin/testbed, `up` works and `down` leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

import requires
from cluster_hosts import PINS, REPO, TOPOLOGY, on_host, tb

from testbed import __version__

PREFIX = f"/run/tb-install-{uuid.uuid4().hex[:6]}"   # each emulated host's own /run
MACHINE_LEDGER = Path("/var/lib/testbed/wheelhouses")   # install's default for root: never touched here
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"   # the controller's interpreter, outside its venv
TIMES: dict[str, float] = {}


def _hosts_copy(emu, where: Path, testbed_cmd: str, name: str) -> Path:
    doc = yaml.safe_load(emu.hosts_file.read_text())
    for h in doc["hosts"]:
        h["testbed"] = testbed_cmd
    path = where / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# -- no hosts needed ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix, said", [("opt/testbed", "absolute"), ("/opt/test bed", "only letters"),
                                           ("/opt/$(x)", "only letters"), ("/opt/../etc", ". or .."), ("/", "may not be /")])
def test_a_relative_or_odd_prefix_is_refused_before_anything_connects(prefix, said):
    r = tb("install", "--hosts", str(REPO / "examples" / "hosts.yaml"), "--prefix", prefix, check=False)
    assert r.returncode == 2 and said in r.stderr, r.stderr


def test_the_hosts_file_line_keeps_an_env_in_front():
    from testbed.cluster.install import hosts_file_line

    assert hosts_file_line("/opt/testbed", ["testbed"]) == "/opt/testbed/bin/testbed"
    assert hosts_file_line("/opt/testbed", ["/opt/testbed/bin/testbed"]) is None
    assert hosts_file_line("/p", ["env", "TESTBED_STATE_DIR=/x y", "/v/bin/testbed"]) == \
        "env 'TESTBED_STATE_DIR=/x y' /p/bin/testbed"


# -- on emulated hosts --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger(tmp_path_factory) -> Path:
    """The test's own wheelhouse ledger (made 0700 by install, under pytest's root-only tmp)."""
    return tmp_path_factory.mktemp("ledger") / "wheelhouses"


@pytest.fixture(scope="module")
def emulated_options(tmp_path_factory, ledger):
    """The hosts (`emu`, tests/conftest.py) live with the test's own cache and ledger set."""
    cache = tmp_path_factory.mktemp("cache")
    try:
        yield {"env": {"TESTBED_CACHE_DIR": str(cache),   # not ~/.cache
                       "TESTBED_WHEELHOUSE_LEDGER": str(ledger)}}   # not /var/lib/testbed/wheelhouses
    finally:
        shutil.rmtree(cache, ignore_errors=True)   # 60 MB of wheels: not kept with pytest's last runs


def _listing(path: Path) -> dict[str, float]:
    """name -> mtime of what a ledger directory holds (empty when there is none)."""
    try:
        return {p.name: p.lstat().st_mtime for p in path.iterdir()}
    except FileNotFoundError:
        return {}


@pytest.fixture(scope="module")
def house(emu):
    """The wheelhouse, built once into the test's cache (what `testbed install` then finds there), in
    a process of its own as a user's earlier `install` would: this one's imports and sys.path are
    the whole test session's."""
    from testbed.cluster import install

    machines = _listing(MACHINE_LEDGER)
    t0 = time.monotonic()
    code = ("import json; from testbed.cluster import install as i; h = i.wheelhouse(i.prepare()); "
            "print(json.dumps({'dir': str(h.dir), 'what': h.describe()}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=1800)
    if r.returncode != 0:
        # only pip not reaching a package index is the machine's matter (a skip; a failure where
        # TESTBED_REQUIRE names wheelhouse or all, as in CI); any other error is the product's
        offline = "WheelhouseError" in r.stderr and re.search(
            r"No matching distribution|Could not find a version|Failed to establish a new connection|"
            r"Temporary failure in name resolution|Network is unreachable|ConnectionError|Max retries exceeded",
            r.stderr)
        if offline:
            requires.need("wheelhouse", ok=False, why=r.stderr[-800:])
        raise AssertionError(r.stderr)
    made = json.loads(r.stdout.splitlines()[-1])
    TIMES["wheelhouse"] = time.monotonic() - t0
    # its digest went to the test's ledger (as the process saw it: TESTBED_WHEELHOUSE_LEDGER), and
    # the machine's ledger is as it was
    ledger = Path(os.environ["TESTBED_WHEELHOUSE_LEDGER"])
    recorded = [p.name for p in ledger.iterdir()] if ledger.is_dir() else []
    assert any(n.startswith(f"{Path(made['dir']).name}.") for n in recorded), (made["dir"], recorded)
    assert _listing(MACHINE_LEDGER) == machines, f"{MACHINE_LEDGER} changed while the wheelhouse was built"
    print(f"\nwheelhouse: {made['what']} in {TIMES['wheelhouse']:.1f} s ({made['dir']}; this process's key "
          f"{install.prepare().key[:16]})", file=sys.stderr)
    return made


@pytest.fixture(scope="module")
def missing(emu, tmp_path_factory) -> Path:
    """emu's hosts file with `testbed:` where nothing is installed."""
    return _hosts_copy(emu, tmp_path_factory.mktemp("hosts"), f"{PREFIX}/bin/testbed", "hosts-missing.yaml")


@pytest.mark.root
def test_up_on_hosts_without_testbed_is_refused_with_the_hint_to_install(emu, missing):
    name = f"i{uuid.uuid4().hex[:6]}"
    r = tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(missing), "--known-hosts", str(emu.known_hosts),
           "--time-dilation", "none", *PINS, check=False)
    assert r.returncode != 0, r.stdout
    text = " ".join(r.stderr.split())
    assert "testbed is not installed on h1" in text and "testbed is not installed on h2" in text, r.stderr
    assert "testbed install --hosts" in text, r.stderr


@pytest.mark.root
def test_a_python_older_than_3_11_4_is_refused_naming_its_version(emu, missing):
    old = Path("/usr/bin/python3")
    if not old.exists():
        pytest.skip("no /usr/bin/python3 here")
    version = subprocess.run([str(old), "-c", "import sys; print('.'.join(map(str, sys.version_info[:3])))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if tuple(map(int, version.split("."))) >= (3, 11, 4):
        pytest.skip(f"/usr/bin/python3 is {version} here: nothing older to refuse")
    t0 = time.monotonic()
    r = tb("install", "--hosts", str(missing), "--known-hosts", str(emu.known_hosts), "--prefix", PREFIX,
           "--python", str(old), check=False)
    TIMES["refused"] = time.monotonic() - t0
    text = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1, text
    for host in ("h1", "h2"):
        assert f"`{old}` on {host}" in text and f"is Python {version}" in text, text
    assert ">= 3.11.4" in text and "--python PATH" in text and "not ready: h1, h2" in text, text
    for host in ("h1", "h2"):   # nothing made there
        assert on_host(emu, host, "test", "-e", PREFIX, check=False).rc != 0


@pytest.mark.root
def test_install_then_up_with_it_then_down(emu, house, missing, tmp_path):
    if not BASE_PYTHON.exists():
        pytest.skip(f"no {BASE_PYTHON} (the controller's base interpreter)")
    common = ["--hosts", str(missing), "--known-hosts", str(emu.known_hosts), "--prefix", PREFIX,
              "--python", str(BASE_PYTHON)]
    t0 = time.monotonic()
    r = tb("install", *common, timeout=1200)
    TIMES["install"] = time.monotonic() - t0
    out = " ".join(r.stdout.split())
    assert f"from the cache {house['dir']}" in r.stderr, r.stderr   # the house fixture's
    for host in ("h1", "h2"):
        assert re.search(rf"{host} .*installed .*{PREFIX}/{__version__} in [0-9.]+ s", out), r.stdout
        assert f"{host}: pip install testbed=={__version__}" in r.stderr, r.stderr
        v = on_host(emu, host, f"{PREFIX}/bin/testbed", "version", "--json")
        assert json.loads(v.stdout)["version"] == __version__
        link = on_host(emu, host, "readlink", f"{PREFIX}/bin/testbed").stdout.strip()
        assert link == f"../{__version__}/bin/testbed"
        left = on_host(emu, host, "sh", "-c", f"ls -A {PREFIX}").stdout.split()
        assert sorted(left) == sorted([".install.lock", __version__, "bin"]), left   # no .wheels-* left
    assert not Path(PREFIX).exists()   # on the hosts only
    assert "to use it" not in r.stdout   # the hosts file already says PREFIX/bin/testbed

    t0 = time.monotonic()
    again = tb("install", *common)
    TIMES["again"] = time.monotonic() - t0
    assert again.stdout.count("already installed") == 2, again.stdout
    assert "wheelhouse" not in again.stderr, again.stderr   # not even looked at
    assert TIMES["again"] < 30, TIMES

    # h1: marked installed, but its testbed no longer answers: installed again (the old venv kept aside
    # until the new one works, then removed). h2: no marker, so not provably made by install: refused,
    # and left as it was
    venv = f"{PREFIX}/{__version__}"
    on_host(emu, "h1", "sh", "-c", f"printf '#!/bin/sh\\nexit 1\\n' > {venv}/bin/testbed")
    on_host(emu, "h2", "mv", f"{venv}/.testbed-install.json", f"{PREFIX}/marker.kept")
    fix = tb("install", *common, check=False, timeout=1200)
    out = " ".join(fix.stdout.split())
    assert fix.returncode == 1 and "not ready: h2" in fix.stderr, fix.stdout + fix.stderr
    assert f"h1: {venv} is there but its testbed does not answer as {__version__}: reinstalling" in fix.stderr
    assert re.search(rf"h1 .*installed .*{venv} in [0-9.]+ s", out), fix.stdout
    assert re.search(r"h2 .*refused .*without testbed install's marker", out), fix.stdout
    assert json.loads(on_host(emu, "h1", f"{PREFIX}/bin/testbed", "version", "--json").stdout)["version"] == __version__
    left = on_host(emu, "h1", "sh", "-c", f"ls -A {PREFIX}").stdout.split()
    assert sorted(left) == sorted([".install.lock", __version__, "bin"]), left   # no .old-* left
    assert json.loads(on_host(emu, "h2", f"{PREFIX}/bin/testbed", "version", "--json").stdout)["version"] == __version__
    on_host(emu, "h2", "mv", f"{PREFIX}/marker.kept", f"{venv}/.testbed-install.json")

    # hosts files naming another testbed command are told the line to set
    other = _hosts_copy(emu, tmp_path, "testbed", "hosts-default.yaml")
    hint = tb("install", "--hosts", str(other), "--known-hosts", str(emu.known_hosts), "--prefix", PREFIX,
              "--python", str(BASE_PYTHON), "--host", "h2")
    assert "already installed" in hint.stdout and "h1" not in hint.stdout.split("to use it")[0], hint.stdout
    assert f"host h2:  testbed: {PREFIX}/bin/testbed    (now: testbed)" in hint.stdout, hint.stdout

    name = f"i{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(missing), "--known-hosts", str(emu.known_hosts),
       "--time-dilation", "none", *PINS)
    try:
        TIMES["up"] = time.monotonic() - t0
        ping = tb("exec", "w0", "--name", name, "--", "ping", "-c", "1", "-W", "5", "w2", check=False)
        assert ping.returncode == 0, ping.stdout + ping.stderr   # across the cut link
    finally:
        tb("down", name)
    for host in ("h1", "h2"):
        assert not [ns for ns in on_host(emu, host, "ip", "netns", "list").stdout.split() if name in ns]
        state = on_host(emu, host, "sh", "-c", "ls -A /run/testbed 2>/dev/null || true").stdout.split()
        assert not [d for d in state if name in d], state
    print(f"\ntimes: {json.dumps({k: round(v, 1) for k, v in TIMES.items()})}", file=sys.stderr)


def test_the_probe_names_a_prefix_others_could_change(tmp_path):
    """Root runs PREFIX/bin/testbed on every host: a PREFIX (or a directory above it) that another user
    owns or may write is named by the probe (and install refuses it); a sticky /tmp-like parent is fine."""
    import json
    import os
    import subprocess
    import sys

    from testbed.cluster import install

    def probe(prefix):
        out = subprocess.run([sys.executable, "-I", "-B", "-c", install._PROBE, str(prefix), "0.0.1", install.MARKER],
                             capture_output=True, text=True, timeout=60, check=True)
        return json.loads(out.stdout)["unsafe"]

    base = tmp_path / "base"
    base.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    # pytest's tmp roots are root's and 0700/0755 here; anything above them is the system's
    assert [u for u in probe(base / "prefix") if u[0].startswith(str(tmp_path))] == []
    os.chmod(base, 0o777)
    assert [u[0] for u in probe(base / "prefix")] == [str(base)]
    os.chmod(base, 0o1777)                                   # sticky: others cannot replace our entries
    assert [u for u in probe(base / "prefix") if u[0].startswith(str(tmp_path))] == []
    mine = base / "prefix"
    mine.mkdir()
    os.chown(mine, 65534, 65534)                             # nobody's
    assert [u[0] for u in probe(mine)] == [str(mine)]
