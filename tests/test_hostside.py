"""The programs that run inside a host, each a file of its own (testbed/cluster/hostside/), run
here as a host runs them: the same text, the same arguments.

- every one ships with the package (pyproject's package data) and is valid sh or Python;
- install's programs, driven by install.install() through a HostControl that runs the commands
  on this machine (what a host's sshd would run), with a stand-in wheelhouse (one wheel of a
  "testbed" 9.9.9 whose `testbed version --json` answers; no package index): a whole install,
  then "already installed", a --force whose pip fails (the old venv comes back), an install that
  waits for another one's lock on PREFIX, a PREFIX/VERSION nobody marked;
- the scenario watchdog's poller, through RemoteSteps.poll against a run directory here;
- the emulated host's holder, in namespaces of its own.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import tomllib
import zipfile
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest

from testbed.cluster import hostside, install
from testbed.cluster.hostside import install_finish, install_probe
from testbed.cluster.remote import RemoteResult
from testbed.cluster.scenario import _POLL_SH, RemoteSteps

ROOT = Path(__file__).resolve().parent.parent
PROGRAM_DIRS = {"testbed.cluster.hostside": ROOT / "testbed/cluster/hostside", "testbed.nodeside": ROOT / "testbed/nodeside"}
VERSION = "9.9.9"


# -- the files ---------------------------------------------------------------------------------------------


def test_every_program_file_ships_with_the_package():
    """A file that is not a module reaches the wheel only through package data: every .sh the
    controller sends must be matched there, or an installed controller cannot read it."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, folder in PROGRAM_DIRS.items():
        for path in folder.glob("*.sh"):
            assert any(fnmatch(path.name, pat) for pat in data.get(package, [])), (package, path.name, data)
    shipped = {p.name for p in PROGRAM_DIRS["testbed.cluster.hostside"].iterdir() if p.suffix in (".sh", ".py")}
    assert {"install.sh", "install_probe.py", "install_receive.py", "install_finish.py",
            "emulated_holder.sh", "poll_steps.sh"} <= shipped


def test_the_programs_sent_are_the_files():
    assert install._PROBE == (PROGRAM_DIRS["testbed.cluster.hostside"] / "install_probe.py").read_text()
    assert install._INSTALL == hostside.text("install.sh")
    assert _POLL_SH == (PROGRAM_DIRS["testbed.cluster.hostside"] / "poll_steps.sh").read_text()


@pytest.mark.parametrize("path", sorted(p for d in PROGRAM_DIRS.values() for p in d.glob("*.sh")), ids=lambda p: p.name)
def test_every_shell_program_parses(path):
    r = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.requires("shellcheck")
@pytest.mark.parametrize("path", sorted(p for d in PROGRAM_DIRS.values() for p in d.glob("*.sh")), ids=lambda p: p.name)
def test_every_shell_program_passes_shellcheck(path):
    """POSIX sh as hosts run it (dash on Debian): shellcheck finds what `sh -n` cannot (unquoted
    expansions, bashisms that dash runs differently)."""
    r = subprocess.run(["shellcheck", "--shell=sh", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_probe_parses_as_python_3_5():
    """The probe runs under whatever --python names, to say what it is: it must not fail to parse
    on an old Python (install then says the version instead of "not a Python 3 we can use")."""
    import ast

    text = hostside.text("install_probe.py")
    tree = ast.parse(text, feature_version=(3, 5))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)], "an f-string (3.6)"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.arg) and n.annotation is not None]


# -- install's programs, one at a time --------------------------------------------------------------------


def test_the_probe_says_what_prefix_holds(tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / VERSION / "bin").mkdir(parents=True)
    (prefix / VERSION / install.MARKER).write_text(json.dumps({"version": VERSION}))
    exe = prefix / VERSION / "bin" / "testbed"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (prefix / "bin").mkdir()
    (prefix / "bin" / "testbed").symlink_to(f"../{VERSION}/bin/testbed")
    r = subprocess.run([sys.executable, "-I", "-B", "-c", install._PROBE, str(prefix), VERSION, install.MARKER],
                       capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(r.stdout)
    assert doc["version_info"] == list(sys.version_info[:3]) and doc["executable"] == sys.executable
    assert doc["venv"] is True and doc["ensurepip"] is True
    assert doc["marker"] == {"version": VERSION} and doc["testbed"] is True
    assert doc["link"] == f"../{VERSION}/bin/testbed"
    # nothing there: no marker, no link; a marker that is not JSON is no marker
    assert install_probe.probe(str(tmp_path / "none"), VERSION, install.MARKER)["marker"] is None
    (prefix / VERSION / install.MARKER).write_text("{half")
    assert install_probe.probe(str(prefix), VERSION, install.MARKER)["marker"] is None


def test_finish_writes_the_marker_then_swaps_the_link(tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / "1.0").mkdir(parents=True)
    (prefix / "2.0").mkdir()
    assert install_finish.main([str(prefix), "1.0", "m.json", '{"v": 1}']) == 0
    assert (prefix / "1.0" / "m.json").read_text() == '{"v": 1}'
    assert os.readlink(prefix / "bin" / "testbed") == "../1.0/bin/testbed"
    # the link alone, replacing the old one (run as the host runs it)
    subprocess.run([sys.executable, "-I", "-c", install._FINISH, str(prefix), "2.0"], check=True, timeout=60)
    assert os.readlink(prefix / "bin" / "testbed") == "../2.0/bin/testbed"
    assert not (prefix / "2.0" / "m.json").exists()
    assert sorted(p.name for p in (prefix / "bin").iterdir()) == ["testbed"]   # no temporary link left
    assert sorted(p.name for p in (prefix / "1.0").iterdir()) == ["m.json"]


# -- install's programs, as install runs them on a host -------------------------------------------------


class _HereHost:
    """A HostControl running each command on this machine, its stdout passed on as it comes."""

    def __init__(self, name: str = "h-here"):
        self.name = name

    def run(self, argv, *, stdin=None, timeout=None, check=False, on_stdout=None):
        proc = subprocess.Popen(list(argv), stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        err: list[bytes] = []
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
        reader.start()
        out = bytearray()
        for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
            out += chunk
            if on_stdout is not None:
                on_stdout(chunk)
        proc.wait(timeout)
        reader.join()
        result = RemoteResult(proc.returncode, out.decode(errors="replace"), err[0].decode(errors="replace"),
                              self.name, tuple(argv))
        return result.check() if check else result

    def close(self):
        pass


def _record(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _standin_wheel(folder: Path) -> Path:
    """A wheel of a "testbed" VERSION whose console script answers `version --json` as testbed does."""
    dist = f"testbed-{VERSION}.dist-info"
    files = {
        "tbstandin.py": (f'import json\n\ndef main():\n    print(json.dumps({{"version": "{VERSION}"}}))\n').encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: testbed\nVersion: {VERSION}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test_hostside\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": b"[console_scripts]\ntestbed = tbstandin:main\n",
    }
    record = "\n".join([*(_record(p, d) for p, d in files.items()), f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"testbed-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path


def _house(tmp_path: Path, wheels: list[Path], name: str = "house") -> install.Wheelhouse:
    build = install.Build(version=VERSION, source=tmp_path, files=(), constraints="", python=sys.version_info[:2],
                          machine=os.uname().machine, key=hashlib.sha256(name.encode()).hexdigest())
    folder = tmp_path / name
    folder.mkdir()
    tar = folder / "wheels.tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for w in wheels:
            tf.add(w, arcname=w.name)
    tar.write_bytes(buf.getvalue())
    return install.Wheelhouse(build, folder, tar, tuple(w.name for w in wheels), sum(w.stat().st_size for w in wheels),
                              0.0, True, hashlib.sha256(buf.getvalue()).hexdigest(), len(buf.getvalue()))


def _install(prefix: Path, house: install.Wheelhouse, said: list[str], **kw) -> install.HostOutcome:
    [out] = install.install([SimpleNamespace(name="h-here")], prefix=str(prefix), python=sys.executable,
                            build=house.build, progress=said.append, controls={"h-here": _HereHost()},
                            make_wheelhouse=lambda b: house, **kw)
    return out


@pytest.fixture
def prefix(tmp_path):
    """PREFIX under the test's own directory, root's alone (the probe refuses anything else)."""
    os.chmod(tmp_path, 0o755)
    return tmp_path / "opt" / "testbed"


@pytest.mark.root
def test_install_the_whole_way_then_again_then_a_failed_force_puts_the_old_one_back(tmp_path, prefix):
    wheel = _standin_wheel(tmp_path)
    house = _house(tmp_path, [wheel])
    said: list[str] = []
    out = _install(prefix, house, said)
    assert (out.state, out.verified) == ("installed", VERSION), (out.why, out.details, said)
    for step in ("receiving the wheelhouse", "making the venv", f"pip install testbed=={VERSION}"):
        assert any(step in s for s in said), (step, said)
    venv = prefix / VERSION
    marker = json.loads((venv / install.MARKER).read_text())
    assert (marker["version"], marker["wheelhouse"], marker["host"]) == (VERSION, house.build.key, "h-here")
    assert os.readlink(prefix / "bin" / "testbed") == f"../{VERSION}/bin/testbed"
    assert sorted(p.name for p in prefix.iterdir()) == [".install.lock", VERSION, "bin"]   # the wheels removed

    again = _install(prefix, house, said)
    assert again.state == "already installed" and again.verified == VERSION, (again.why, again.details)

    # --force with a wheelhouse pip cannot install from (no testbed in it): the venv made for it goes,
    # the one that was there comes back, whole
    (venv / "kept").write_text("the old venv")
    other = tmp_path / "other-1.0-py3-none-any.whl"
    other.write_bytes(b"not a testbed wheel")
    failed = _install(prefix, _house(tmp_path, [other], "broken"), said, force=True)
    assert failed.state == "failed" and "pip install failed" in failed.why, (failed.why, failed.details)
    assert (venv / "kept").read_text() == "the old venv" and json.loads((venv / install.MARKER).read_text()) == marker
    assert sorted(p.name for p in prefix.iterdir()) == [".install.lock", VERSION, "bin"]
    r = subprocess.run([str(prefix / "bin" / "testbed"), "version", "--json"], capture_output=True, text=True,
                       timeout=60)
    assert json.loads(r.stdout) == {"version": VERSION}


def _stand_in_venv(prefix: Path, marker: dict) -> Path:
    """PREFIX/VERSION as a finished install leaves it, as far as install.sh looks: the marker, an
    executable bin/testbed, and a bin/python to run the finish with."""
    bindir = prefix / VERSION / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").symlink_to(sys.executable)
    exe = bindir / "testbed"
    exe.write_text(f'#!/bin/sh\necho \'{{"version": "{VERSION}"}}\'\n')
    exe.chmod(0o755)
    (prefix / VERSION / install.MARKER).write_text(json.dumps(marker))
    return prefix / VERSION


def _run_script(prefix: Path, house: install.Wheelhouse, force: str = "0", run_id: str = "run1") -> subprocess.Popen:
    """install.sh as install._install_on starts it, on this machine."""
    argv = ["sh", "-c", install._INSTALL, "sh", str(prefix), VERSION, sys.executable, str(prefix / ".wheels-test"),
            force, install.MARKER, json.dumps({"version": VERSION, "run": run_id}), run_id, install._FINISH,
            house.sha256, str(house.tar_bytes), install._RECEIVE]
    with house.tar.open("rb") as tar:
        return subprocess.Popen(argv, stdin=tar, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.root
def test_an_install_waits_for_the_lock_of_another_then_finds_it_done(tmp_path, prefix):
    """Hosts that share PREFIX install one after the other: the second waits on PREFIX's lock,
    then finds the first one's install and only points the link at it."""
    house = _house(tmp_path, [_standin_wheel(tmp_path)])
    prefix.mkdir(parents=True)
    lock = open(prefix / ".install.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = _run_script(prefix, house)
        first = proc.stdout.readline()   # (blocks until install.sh says its first step, or ends)
        assert first == "@step waiting\n", (first, proc.stderr.read() if proc.poll() is not None else "")
        _stand_in_venv(prefix, {"version": VERSION, "run": "other", "host": "h-other"})   # what the other one made
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.splitlines() == [f"@step already {json.dumps({'version': VERSION, 'run': 'other', 'host': 'h-other'})}"]
    assert os.readlink(prefix / "bin" / "testbed") == f"../{VERSION}/bin/testbed"
    assert not (prefix / ".wheels-test").exists()


@pytest.mark.root
def test_a_version_directory_nobody_marked_is_left_alone(tmp_path, prefix):
    house = _house(tmp_path, [_standin_wheel(tmp_path)])
    (prefix / VERSION).mkdir(parents=True)
    (prefix / VERSION / "theirs").write_text("x")
    proc = _run_script(prefix, house)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out.splitlines() == ["@step unmarked"], (out, err)
    assert "give --force" in err
    assert sorted(p.name for p in (prefix / VERSION).iterdir()) == ["theirs"]
    assert not (prefix / "bin").exists() and not (prefix / ".wheels-test").exists()
    # and install says so, naming the way out
    said: list[str] = []
    out = _install(prefix, house, said)
    assert out.state == "refused" and "without testbed install's marker" in out.why and "--force" in out.why, out.why


# -- the scenario watchdog's poller -----------------------------------------------------------------------


class _PollHere:
    """What controller.open_host gives RemoteSteps: here, a shell on this machine."""

    def __init__(self):
        self.calls = 0

    def run(self, argv, *, timeout=None, **kw):
        self.calls += 1
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
        return RemoteResult(r.returncode, r.stdout, r.stderr, "h-here", tuple(argv))

    def close(self):
        pass


def test_the_poller_reads_each_rank_file_from_where_it_left_off(tmp_path):
    run_dir = tmp_path / "run"
    reader = RemoteSteps("tb", "h-here", str(run_dir))
    reader._ctl = _PollHere()
    reader.poll()   # no run directory yet: only the host's clock
    assert reader.error is None and reader.steps == 0 and reader.offsets == {}
    probe = run_dir / "probe"
    probe.mkdir(parents=True)
    r0, r1 = probe / "rank-0.jsonl", probe / "rank-1.jsonl"
    r0.write_text('{"ev": "start", "t": 99}\n{"ev": "step", "t": 100.5}\n{"ev": "st')   # a line being written
    r1.write_text('{"ev": "step", "t": 100.25}\n')
    (probe / "rank-2.jsonl").symlink_to(r1)         # a link a job planted: not read
    (probe / "notes.jsonl").write_text('{"ev": "step", "t": 1}\n')   # not a rank file
    reader.poll()
    assert reader.error is None, reader.error
    assert (reader.steps, reader.first_new_t, reader.last_step_t) == (2, 100.25, 100.5)
    assert reader.offsets == {"rank-0.jsonl": len(r0.read_bytes()) - len('{"ev": "st'), "rank-1.jsonl": len(r1.read_bytes())}
    with r0.open("a") as fh:
        fh.write('ep", "t": 101}\n{"ev": "end", "t": 102}\n')
    reader.poll()
    assert (reader.steps, reader.first_new_t, reader.last_step_t) == (3, 101.0, 101.0)
    assert not reader.ended
    with r1.open("a") as fh:
        fh.write('{"ev": "end", "t": 102}\n')
    reader.poll()
    assert reader.ended and reader.steps == 3 and reader.first_new_t is None
    assert reader._ctl.calls == 4


def test_the_poller_sends_at_most_4_mib_a_time(tmp_path):
    probe = tmp_path / "run" / "probe"
    probe.mkdir(parents=True)
    line = b'{"ev": "step", "t": 1.0, "pad": "' + b"x" * 990 + b'"}\n'
    count = (5 << 20) // len(line) + 1                  # a little over 5 MiB
    (probe / "rank-0.jsonl").write_bytes(line * count)
    reader = RemoteSteps("tb", "h-here", str(tmp_path / "run"))
    reader._ctl = _PollHere()
    reader.poll()
    first = reader.steps
    assert first == (4 << 20) // len(line), first   # whole lines of the first 4 MiB
    reader.poll()
    assert reader.steps == count and reader.offsets == {"rank-0.jsonl": len(line) * count}


# -- the emulated host's holder ---------------------------------------------------------------------------


def _holder(env: dict[str, str]) -> subprocess.Popen:
    """The holder's program as emulate starts it, with a network namespace of its own in place of
    the host's; returns once it said "ready"."""
    proc = subprocess.Popen(["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--",
                             "/bin/sh", "-c", hostside.text("emulated_holder.sh")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env})
    line = proc.stdout.readline()   # (blocks until the holder is set up, or ends)
    if line != b"ready\n":
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"the holder said {line!r}: {proc.stderr.read().decode(errors='replace')}")
    return proc


@pytest.mark.root
@pytest.mark.requires("unshare")
def test_the_holder_gives_the_host_its_own_run_and_hostname():
    """A private /run holding the marker, the machine's /run mounts not showing through, the host's
    hostname; it stays until killed."""
    proc = _holder({"TB_HOST": "h-test", "TB_MARK": "token123 h-test"})
    try:
        root = Path(f"/proc/{proc.pid}/root")
        assert (root / "run/.testbed-emulated-host").read_text() == "token123 h-test\n"
        assert sorted(p.name for p in (root / "run").iterdir()) == [".testbed-emulated-host", "lock", "netns",
                                                                   "sshd", "testbed"]
        assert list((root / "run/netns").iterdir()) == []   # not the machine's namespaces
        assert (root / "run/lock").stat().st_mode & 0o7777 == 0o1777
        hostname = subprocess.run(["nsenter", f"--target={proc.pid}", "--uts", "hostname"], capture_output=True,
                                  text=True, timeout=30, check=True).stdout.strip()
        assert hostname == "h-test" and hostname != os.uname().nodename
        assert proc.poll() is None
    finally:
        proc.kill()   # (ours: unshare exec'd the shell, which exec'd sleep, all under this PID)
        proc.wait(30)


@pytest.mark.root
@pytest.mark.requires("unshare")
def test_the_holder_binds_the_login_users_files_and_the_docker_socket(tmp_path):
    """With a login user, the host sees its own /etc/passwd, group, shadow, hosts and sudoers.d, and
    the user's homes at /run/home; with a shared Docker daemon, its socket at /run/docker.sock
    (a plain file stands in for both: a bind is a bind). This machine sees none of it."""
    etc = tmp_path / "etc"
    (etc / "sudoers.d").mkdir(parents=True)
    for name in ("passwd", "group", "shadow", "hosts"):
        (etc / name).write_text(f"the host's {name}\n")
    (etc / "sudoers.d" / "user").write_text("user ALL=(ALL) NOPASSWD: ALL\n")
    (tmp_path / "home" / "user").mkdir(parents=True)
    socket = tmp_path / "daemon.sock"
    socket.write_text("the daemon")
    stage = tmp_path / "docker.sock"
    stage.touch(mode=0o600)
    before = {name: Path("/etc", name).read_bytes() for name in ("passwd", "hosts")}
    proc = _holder({"TB_HOST": "h-test", "TB_MARK": "token123 h-test", "TB_ETC": str(etc),
                    "TB_HOME": str(tmp_path / "home"), "TB_HOMES": "/run/home", "TB_DOCKER": str(socket),
                    "TB_DOCKER_STAGE": str(stage), "TB_DOCKER_AT": "/run/docker.sock"})
    try:
        root = Path(f"/proc/{proc.pid}/root")
        for name in ("passwd", "group", "shadow", "hosts"):
            assert (root / "etc" / name).read_text() == f"the host's {name}\n"
        assert sorted(p.name for p in (root / "etc/sudoers.d").iterdir()) == ["user"]
        assert [p.name for p in (root / "run/home").iterdir()] == ["user"]
        assert (root / "run/docker.sock").read_text() == "the daemon"
        assert stage.read_text() == ""   # bound in the host's mount namespace only, never out here
        assert {name: Path("/etc", name).read_bytes() for name in ("passwd", "hosts")} == before
    finally:
        proc.kill()
        proc.wait(30)
