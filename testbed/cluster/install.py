"""Install this controller's testbed on the hosts of a hosts file, over SSH (`testbed install`).

A testbed over several hosts needs the same testbed version on every host (the controller checks
it at `up`). This module puts it there from the controller alone; the hosts need Python (3.11,
>= 3.11.4, with venv) and SSH, nothing from a package index:

1. **The wheelhouse**, built once on the controller and kept: this testbed's own wheel, built
   from its source tree (the directory holding pyproject.toml above the imported package: a
   clone; a testbed installed from a wheel cannot rebuild itself and is refused), and a wheel of
   every dependency, pinned to the versions installed here (a constraints file of `name==version`
   for every distribution of the running environment but testbed), by ``python -m pip wheel``.
   The sources are copied to a scratch directory first, so the build writes nothing into the
   clone (no build/, no egg-info). Kept under the cache root (TESTBED_CACHE_DIR, else
   $XDG_CACHE_HOME/testbed, else ~/.cache/testbed) as wheelhouse/VERSION-KEY/wheels.tar, KEY
   a digest of the sources, the constraints, the Python tag and the machine: an edited clone or
   a changed environment gets a new wheelhouse; the three newest are kept. pip's own cache goes
   there too (CACHE/pip). Not under the state root (/run/testbed): that is a tmpfs, RAM, emptied
   at each boot, and holds live testbeds only.
   **The sha256 of wheels.tar** is taken as this process writes it and recorded outside the cache,
   in a ledger whose path is checked private all the way up (ledger_root(): root's
   /var/lib/testbed/wheelhouses, else ~/.local/state/testbed/wheelhouses; TESTBED_WHEELHOUSE_LEDGER):
   whoever can rewrite the cache (its wheels.tar and its manifest alike) cannot also rewrite the
   digest that vouches for them. A cached wheels.tar whose digest the ledger does not hold for its
   build is never used: refused when the ledger holds another digest for it (it changed after the
   build), built anew when it holds none. The host is given the digest and the size with the
   install command and checks the stream against them before unpacking anything (so a wheels.tar
   changed between that check and the copy is refused there).
2. **Every selected host at once** (remote.run_parallel), each over its own SSH session, as
   root (sudo -n for a non-root login), touching nothing outside PREFIX:
   a. probe its Python (PYTHON -I -B -c ...: version, machine, venv and ensurepip, what PREFIX
      holds); refused, naming the host: a Python older than 3.11.4 (testbed's requires-python:
      tarfile's extraction filters; Debian 12's /usr/bin/python3 is 3.11.2), another major.minor
      or machine than the controller's (the wheels are cp3XX / x86_64 ...), no venv;
   b. PREFIX/VERSION complete (its marker file, and its `testbed version --json` says VERSION):
      nothing to do unless force ("already installed");
   c. else one remote shell, under a lock on PREFIX/.install.lock (flock: hosts that share a
      filesystem install one after the other, and the later one finds it done), receives the
      wheelhouse, streamed as one tar from the file here, into PREFIX/.wheels-RANDOM, checks its
      size and sha256 against the recorded ones (exit status 4 and nothing unpacked if they
      differ), unpacks it there, makes
      the venv PREFIX/VERSION, ``pip install --no-index --find-links`` testbed==VERSION into it
      (pip's configuration and PIP_* ignored), writes the marker, and points PREFIX/bin/testbed
      at ../VERSION/bin/testbed (a symlink made under a temporary name and renamed over the old
      one). A PREFIX/VERSION without the marker is refused (not provably ours) unless force; one
      being replaced (force, or marked but not answering) is moved aside first and comes back if
      the new one fails. The unpacked wheels are removed in every case, and a venv left half made
      by a failure too;
   d. checks `PREFIX/bin/testbed version --json`.

Older versions in PREFIX are kept (PREFIX/0.0.9/...); PREFIX/bin/testbed is this controller's.
The job's own packages (torch, ...) are not shipped: install them into PREFIX/VERSION.

What runs on a host (the probe, the install script, its receiving and finishing steps) is a file of
testbed/cluster/hostside, sent as the text of the command: the host may have no testbed yet.

In code: prepare() -> Build (cheap: sources, constraints, key), wheelhouse(build, progress)
-> Wheelhouse (built or found in the cache), install(hosts, ...) -> [HostOutcome].
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import posixpath
import re
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import __version__
from testbed.cluster import hostside
from testbed.cluster.hostside import install_receive
from testbed.errors import TestbedError
from testbed.safeio import Unsafe, read_regular

__all__ = ["Build", "HostOutcome", "InstallRefused", "MIN_PYTHON", "Wheelhouse", "WheelhouseError",
           "cache_root", "check_prefix", "check_python", "hosts_file_line", "install", "ledger_root", "prepare",
           "wheelhouse"]

MIN_PYTHON = (3, 11, 4)   # pyproject's requires-python: tarfile's extraction filters
MARKER = ".testbed-install.json"   # in PREFIX/VERSION, written once pip has installed everything
KEEP_WHEELHOUSES = 3
KEEP_LEDGER = 64          # digests kept in the ledger (each a small file; the newest)
MANIFEST_MAX = 1 << 20    # what is read of a cached manifest.json (ours: a few KiB)
RECEIVE_REFUSED = install_receive.REFUSED   # install.sh's exit status when the stream is not the recorded one
PROBE_TIMEOUT_S = 60.0
VERSION_TIMEOUT_S = 120.0
INSTALL_TIMEOUT_S = 1800.0   # the transfer, a wait for another host's install into a shared PREFIX, pip
PIP_WHEEL_TIMEOUT_S = 1800.0
_PREFIX_RE = re.compile(r"/[A-Za-z0-9._+@/-]+")
_SOURCE_TOP = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "README.rst", "README",
               "LICENSE", "LICENSE.txt", "COPYING")

Progress = Callable[[str], None]


class InstallRefused(TestbedError):
    """What was asked cannot be done as asked (a relative PREFIX, no source tree, ...): exit 2."""

    exit_code = 2


class WheelhouseError(TestbedError):
    """The wheelhouse could not be built (pip wheel failed: no network, a dependency without a wheel)."""


# -- checks of the options ------------------------------------------------------------------------


def check_prefix(prefix: str) -> str:
    """PREFIX, normalised; InstallRefused unless absolute, made of plain characters and not /."""
    if not prefix.startswith("/"):
        raise InstallRefused(f"--prefix must be an absolute path (got {prefix!r})")
    if posixpath.normpath(prefix) == "/":
        raise InstallRefused("--prefix may not be / (it would install PREFIX/bin/testbed as /bin/testbed)")
    if not _PREFIX_RE.fullmatch(prefix):
        raise InstallRefused(f"--prefix may hold only letters, digits and . _ + @ - / (got {prefix!r})")
    if any(part in (".", "..") for part in prefix.split("/")):
        raise InstallRefused(f"--prefix may not contain . or .. (got {prefix!r})")
    return posixpath.normpath(prefix)


def check_python(python: str) -> str:
    """The --python command: one word (a name on the host's PATH, or a path)."""
    if not python or python.startswith("-") or any(c.isspace() or not c.isprintable() for c in python):
        raise InstallRefused(f"--python must be one word: a command on the host's PATH or a path (got {python!r})")
    return python


def hosts_file_line(prefix: str, current: Sequence[str]) -> str | None:
    """The `testbed:` value that runs PREFIX's testbed, keeping an `env VAR=...` in front; None
    when `current` (a host's testbed_argv) already does."""
    target = posixpath.join(prefix, "bin", "testbed")
    words = list(current)
    keep: list[str] = []
    if words and words[0] == "env":
        keep = ["env"]
        for w in words[1:]:
            if "=" not in w or w.startswith("-"):
                break
            keep.append(w)
    if words == [*keep, target]:
        return None
    return shlex.join([*keep, target])


# -- the wheelhouse (on the controller) -----------------------------------------------------------


def cache_root() -> Path:
    """Where install keeps wheelhouses (and pip's cache): TESTBED_CACHE_DIR, else
    $XDG_CACHE_HOME/testbed, else ~/.cache/testbed."""
    if os.environ.get("TESTBED_CACHE_DIR"):
        return Path(os.environ["TESTBED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "testbed"


def _private_dir(path: Path) -> Path:
    """`path`, made 0700 if missing; refused if another user owns it or others may write in it (what
    is there is installed as root on the hosts)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InstallRefused(f"{path} is not a directory (the wheelhouse cache)")
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InstallRefused(f"the wheelhouse cache {path} is owned by uid {st.st_uid} or writable by others "
                             f"(mode {stat.S_IMODE(st.st_mode):o}): what it holds is installed as root on the "
                             "hosts; fix it or point TESTBED_CACHE_DIR elsewhere")
    return path


def ledger_root() -> Path:
    """Where install records the sha256 of every wheelhouse it builds: outside the cache, so that what
    can rewrite the cache cannot rewrite the digests. TESTBED_WHEELHOUSE_LEDGER, else root's
    /var/lib/testbed/wheelhouses, else $XDG_STATE_HOME/testbed/wheelhouses (~/.local/state/...)."""
    if os.environ.get("TESTBED_WHEELHOUSE_LEDGER"):
        return Path(os.environ["TESTBED_WHEELHOUSE_LEDGER"])
    if os.geteuid() == 0:
        return Path("/var/lib/testbed/wheelhouses")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "testbed" / "wheelhouses"


def _ledger() -> Path:
    """The ledger directory, made 0700 if missing; refused unless it and every directory above it
    are root's or ours and nobody else may write in them (a sticky one, like /tmp, aside)."""
    path = Path(os.path.abspath(ledger_root()))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    me = os.geteuid()
    here = path
    while True:
        st = os.lstat(here)
        others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (here != path and st.st_mode & stat.S_ISVTX)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, me) or others_write \
                or (here == path and st.st_uid != me):
            raise InstallRefused(
                f"the wheelhouse ledger {path} is not private: {here} is "
                + ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                   f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}")
                + ". It holds the digests that vouch for what is installed as root on the hosts; fix it or "
                  "point TESTBED_WHEELHOUSE_LEDGER at a directory only you can change")
        if here.parent == here:
            return path
        here = here.parent


def _ledger_entry(build: Build, digest: str) -> str:
    return f"{build.name}.{digest}"


def _recorded(build: Build) -> set[str]:
    """The digests of wheels.tar recorded for this build (one per build of it: pip's wheels are not
    byte for byte the same twice)."""
    prefix = f"{build.name}."
    return {name[len(prefix):] for name in os.listdir(_ledger()) if name.startswith(prefix)}


def _record(build: Build, digest: str, size: int) -> None:
    ledger = _ledger()
    final = ledger / _ledger_entry(build, digest)
    tmp = ledger / f".{final.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps({"key": build.key, "tar_sha256": digest, "tar_bytes": size,
                             "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    os.replace(tmp, final)
    entries = sorted((p for p in ledger.iterdir() if not p.name.startswith(".")),
                     key=lambda p: p.lstat().st_mtime, reverse=True)
    for old in entries[KEEP_LEDGER:]:
        with contextlib.suppress(OSError):
            old.unlink()


def _source_tree() -> Path:
    """The clone the imported testbed comes from; InstallRefused if there is none."""
    import tomllib

    import testbed

    pkg = Path(testbed.__file__).resolve().parent
    top = pkg.parent
    pyproject = top / "pyproject.toml"
    if not pyproject.is_file():
        raise InstallRefused(f"testbed install needs testbed's source tree (a clone, e.g. installed with "
                             f"`pip install -e .`): this testbed is imported from {pkg}, which has no "
                             "pyproject.toml above it (installed from a wheel), so it cannot build a wheel "
                             "of itself")
    try:
        project = tomllib.loads(pyproject.read_text()).get("project") or {}
    except (OSError, ValueError) as exc:
        raise InstallRefused(f"cannot read {pyproject}: {exc}") from None
    if project.get("name") != "testbed":
        raise InstallRefused(f"{pyproject} is not testbed's (its project is {project.get('name')!r})")
    if "version" not in (project.get("dynamic") or []) and project.get("version") != __version__:
        raise InstallRefused(f"{pyproject} says version {project.get('version')!r} and the imported testbed "
                             f"{__version__}: reinstall the clone (pip install -e .) so that they agree")
    return top


def _source_files(top: Path) -> list[Path]:
    """What the wheel is built from, relative to `top`: the project files and the package, no bytecode."""
    files = [Path(name) for name in _SOURCE_TOP if (top / name).is_file()]
    for dirpath, dirnames, filenames in os.walk(top / "testbed"):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith((".pyc", ".pyo")):
                files.append((Path(dirpath) / name).relative_to(top))
    return files


def _constraints() -> str:
    """`name==version` of every distribution installed in the running environment but testbed."""
    import importlib.metadata

    pins: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key != "testbed":
            pins.setdefault(key, f"{key}=={dist.version}")
    return "".join(f"{line}\n" for _, line in sorted(pins.items()))


@dataclass(frozen=True)
class Build:
    """What the wheelhouse is built from, and its key (no build yet: prepare() is cheap)."""

    version: str
    source: Path                 # the clone
    files: tuple[Path, ...]      # relative to source
    constraints: str
    python: tuple[int, int]      # the controller's major.minor: the wheels' cpXY
    machine: str                 # platform.machine(): the wheels' architecture
    key: str                     # hex digest of all of the above and the sources' contents

    @property
    def name(self) -> str:
        return f"{self.version}-{self.key[:16]}"


def prepare() -> Build:
    """The source tree, the constraints and the key of this controller's wheelhouse."""
    top = _source_tree()
    files = _source_files(top)
    constraints = _constraints()
    python = sys.version_info[:2]
    machine = platform.machine()
    h = hashlib.sha256()
    h.update(f"testbed {__version__} cp{python[0]}{python[1]} {machine}\n".encode())
    h.update(constraints.encode())
    for rel in files:
        h.update(f"\0{rel.as_posix()}\0".encode())
        h.update((top / rel).read_bytes())
    return Build(__version__, top, tuple(files), constraints, (python[0], python[1]), machine, h.hexdigest())


@dataclass(frozen=True)
class Wheelhouse:
    """The wheels for the hosts, as one tar file (what is streamed to each host)."""

    build: Build
    dir: Path
    tar: Path
    wheels: tuple[str, ...]
    size: int          # bytes of the wheels
    seconds: float     # how long building took (0 when it came from the cache)
    cached: bool
    sha256: str        # of wheels.tar, as recorded in the ledger when it was built
    tar_bytes: int     # its size

    def describe(self) -> str:
        return f"{len(self.wheels)} wheels, {self.size / 1e6:.1f} MB"


def _load_cached(build: Build, entry: Path) -> tuple[Wheelhouse | None, str]:
    """The wheelhouse kept in `entry`, or None and why not. WheelhouseError when its wheels.tar is
    not one this controller built for it (the ledger holds other digests for this build)."""
    tar = entry / "wheels.tar"
    try:
        manifest = json.loads(read_regular(entry / "manifest.json", MANIFEST_MAX))   # (bounded: ours is KiB)
        if manifest.get("key") != build.key:
            return None, "it was built from other sources or versions"
        digest, size = _sha256(tar)
        wheels, wheels_size = tuple(str(w) for w in manifest["wheels"]), int(manifest["size"])
    except FileNotFoundError:
        return None, "none is kept"
    except (OSError, ValueError, KeyError, TypeError, Unsafe) as exc:
        return None, f"its manifest is unreadable ({exc})"
    known = _recorded(build)
    if digest not in known:
        if not known:
            return None, f"no digest of it was recorded when it was built (in {ledger_root()})"
        # the manifest beside it says nothing: whoever rewrote the tar could rewrite it too
        raise WheelhouseError(f"the wheelhouse in {entry} changed after it was built: its wheels.tar ({size} "
                              f"bytes) has sha256 {digest}, and the ledger {ledger_root()} holds "
                              f"{', '.join(sorted(known))} for it. What it holds would be installed as root on "
                              f"the hosts: not used. Find out what wrote there, then remove {entry} to build it "
                              "anew")
    return Wheelhouse(build, entry, tar, wheels, wheels_size, 0.0, True, digest, size), ""


def _sha256(path: Path) -> tuple[str, int]:
    """(sha256, size) of what `path` holds now, read once."""
    h, n = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


class _Hashing:
    """A file object that hashes what is written through it (tarfile writes sequentially)."""

    def __init__(self, fh: Any):
        self.fh, self.h, self.n = fh, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        return self.fh.write(data)

    def tell(self) -> int:
        return self.n


def _tar_of(wheels_dir: Path, tar_path: Path) -> tuple[list[str], str, int]:
    """wheels_dir's wheels in one uncompressed tar (wheels are zip files already), owned by root;
    (names, sha256, size) of what was written, hashed on its way to the file (not read back)."""
    names = sorted(p.name for p in wheels_dir.iterdir() if p.name.endswith(".whl") and p.is_file())

    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o644
        return info

    fd = os.open(tar_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        out = _Hashing(fh)
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:   # type: ignore[call-overload]
            for name in names:
                tf.add(wheels_dir / name, arcname=name, recursive=False, filter=owned)
    return names, out.h.hexdigest(), out.n


def _prune(root: Path, keep: Path) -> None:
    """Keep the newest KEEP_WHEELHOUSES wheelhouses (`keep` among them); drop scratch dirs of builds
    that died over an hour ago."""
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP_WHEELHOUSES - 1:]:
        shutil.rmtree(old, ignore_errors=True)
    for scratch in root.glob(".build-*"):
        try:
            if time.time() - scratch.stat().st_mtime > 3600:
                shutil.rmtree(scratch, ignore_errors=True)
        except OSError:
            pass


def wheelhouse(build: Build, progress: Progress = lambda m: None, *, rebuild: bool = False) -> Wheelhouse:
    """The wheelhouse of `build`: from the cache, or built now (WheelhouseError says why not)."""
    cache = _private_dir(cache_root())
    root = _private_dir(cache / "wheelhouse")
    entry = root / build.name
    found, why = (None, "--rebuild") if rebuild else _load_cached(build, entry)
    if found is not None:
        os.utime(entry)   # the newest used: kept by _prune
        return found
    progress(f"building wheels (this machine's versions) of testbed {build.version} and its dependencies "
             f"with {Path(sys.executable).name} -m pip wheel (not from the cache {entry}: {why}) ...")
    t0 = time.monotonic()
    scratch = Path(os.path.realpath(root / f".build-{secrets.token_hex(4)}"))
    scratch.mkdir(mode=0o700)
    try:
        src = scratch / "src"
        for rel in build.files:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(build.source / rel, src / rel)
        (scratch / "constraints.txt").write_text(build.constraints)
        wheels = scratch / "wheels"
        argv = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-input",
                "--cache-dir", str(_private_dir(cache / "pip")), "--wheel-dir", str(wheels),
                "-c", str(scratch / "constraints.txt"), str(src)]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_WHEEL_TIMEOUT_S, cwd=scratch)
        except subprocess.TimeoutExpired:
            raise WheelhouseError(f"`pip wheel` did not finish within {PIP_WHEEL_TIMEOUT_S:g} s") from None
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr.strip() or r.stdout.strip()).splitlines() if ln.strip()][-8:]
            raise WheelhouseError(f"building the wheelhouse failed (`{shlex.join(argv[1:4])} ...` exited with "
                                  f"status {r.returncode}; it needs the package index this machine's pip "
                                  "uses); last lines:\n" + "\n".join(f"  {ln}" for ln in lines))
        _keep(build, root, scratch, wheels, time.monotonic() - t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _prune(root, entry)
    found, why = _load_cached(build, entry)
    if found is None:
        raise WheelhouseError(f"the wheelhouse in {entry} is unusable right after building it: {why}")
    return Wheelhouse(build, entry, found.tar, found.wheels, found.size, time.monotonic() - t0, False,
                      found.sha256, found.tar_bytes)


def _keep(build: Build, root: Path, scratch: Path, wheels: Path, seconds: float) -> None:
    """The wheels pip made in `wheels` as the cache's entry of `build` (root/NAME): one tar, its
    digest recorded in the ledger as it is written, a manifest (what is in it, for people: it vouches
    for nothing), renamed into place whole."""
    entry = root / build.name
    final = scratch / "entry"
    final.mkdir()
    names, digest, tar_bytes = _tar_of(wheels, final / "wheels.tar")
    if not any(n.startswith(f"testbed-{build.version}-") for n in names):
        raise WheelhouseError(f"pip wheel made no wheel of testbed {build.version} (made: {', '.join(names)})")
    _record(build, digest, tar_bytes)
    size = sum((wheels / n).stat().st_size for n in names)
    (final / "manifest.json").write_text(json.dumps({
        "key": build.key, "version": build.version, "wheels": names, "size": size, "tar_bytes": tar_bytes,
        "built_s": round(seconds, 3), "python": f"{build.python[0]}.{build.python[1]}", "machine": build.machine,
        "constraints": build.constraints.splitlines()}, indent=1))
    if entry.exists():   # a concurrent build, or rebuild: replaced whole
        shutil.rmtree(entry, ignore_errors=True)
    try:
        final.rename(entry)
    except OSError:      # another build put its own there first (its digest recorded too)
        pass


# -- the hosts ------------------------------------------------------------------------------------

# The programs install runs on a host, each a file of testbed/cluster/hostside (see there what it is
# given and answers). They go as the text of the command: the host may have no testbed yet.
_PROBE = hostside.text("install_probe.py")       # PYTHON -I -B -c _PROBE PREFIX VERSION MARKER
_FINISH = hostside.text("install_finish.py")     # VENV_PYTHON -I -c _FINISH PREFIX VERSION [MARKER TEXT]
_RECEIVE = hostside.text("install_receive.py")   # run by _INSTALL: the wheelhouse, checked
_INSTALL = hostside.text("install.sh")           # sh -c _INSTALL sh PREFIX VERSION ... (see _install_on)


@dataclass
class HostOutcome:
    """What install did on one host. state: installed, already installed, refused (its Python),
    failed, unreachable."""

    host: str
    state: str = "pending"
    why: str = ""                       # one sentence: what was found, or what went wrong
    details: list[str] = field(default_factory=list)   # the last lines of pip's (or a command's) stderr
    python: str | None = None           # the host's Python version
    seconds: float = 0.0
    verified: str | None = None         # PREFIX/bin/testbed version --json's version

    @property
    def ready(self) -> bool:
        return self.state in ("installed", "already installed")


def _tail(text: str, n: int = 8) -> list[str]:
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-n:]


def _json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            return doc if isinstance(doc, dict) else None
    return None


def _judge_python(host: str, python: str, probe: dict[str, Any], want: tuple[int, int], machine: str) -> str | None:
    """Why this host's Python cannot take the wheelhouse, or None."""
    raw = probe.get("version_info")
    try:
        vi = tuple(int(x) for x in raw)[:3] if isinstance(raw, list) and len(raw) >= 3 else ()
    except (TypeError, ValueError):
        vi = ()
    if len(vi) != 3:
        return f"`{python}` on {host} answered a version_info we cannot read ({raw!r}): it is not a Python 3 we can use"
    shown = ".".join(map(str, vi))
    where = f"`{python}` on {host}" + (f" ({probe['executable']})" if probe.get("executable") else "")
    need = ".".join(map(str, MIN_PYTHON))
    if vi < MIN_PYTHON:
        return (f"{where} is Python {shown}; testbed needs >= {need} (tarfile's extraction filters): "
                f"give --python PATH of a Python {want[0]}.{want[1]} >= {need} there")
    if vi[:2] != want:
        return (f"{where} is Python {shown} and this controller's {want[0]}.{want[1]}: the wheelhouse has "
                f"cp{want[0]}{want[1]} wheels; give --python PATH of a Python {want[0]}.{want[1]} (>= {need}) there")
    if probe.get("machine") != machine:
        return (f"{host} is {probe.get('machine')} and this controller {machine}: the wheelhouse has {machine} "
                f"wheels; run testbed install from a {probe.get('machine')} machine")
    if not (probe.get("venv") and probe.get("ensurepip")):
        return (f"{where} cannot make a venv (no venv or ensurepip module): install python3-venv there "
                "(Debian: apt-get install python3-venv), or give --python of another Python")
    return None


@dataclass
class _Host:
    ctl: Any
    out: HostOutcome
    probe: dict[str, Any] | None = None
    needs_install: bool = False
    repair: bool = False   # PREFIX/VERSION is marked installed but its testbed does not answer: replaced
    t0: float = field(default_factory=time.monotonic)


def _probe(h: _Host, prefix: str, version: str, python: str, build: Build, force: bool, say: Progress) -> None:
    out = h.out
    r = h.ctl.run([python, "-I", "-B", "-c", _PROBE, prefix, version, MARKER], timeout=PROBE_TIMEOUT_S)
    probe = _json_line(r.stdout) if r.rc == 0 else None
    if probe is None:
        out.state = "refused"
        if r.rc in (126, 127):
            out.why = (f"no Python at `{python}` on {out.host}: give --python PATH of a Python "
                       f"{build.python[0]}.{build.python[1]} >= {'.'.join(map(str, MIN_PYTHON))} there")
        else:
            out.why = f"`{python} -c ...` failed on {out.host} (exit status {r.rc}): it is not a Python 3 we can use"
        out.details = _tail(r.stderr or r.stdout, 3)
        return
    h.probe = probe
    unsafe = probe.get("unsafe")
    if unsafe:
        where = "; ".join(f"{p} (owner uid {u}, mode {m}{', a symbolic link' if ln else ''})"
                          for p, u, m, ln in (x for x in unsafe if isinstance(x, list) and len(x) == 4))
        out.state = "refused"
        out.why = (f"{prefix} on {out.host} is not root's alone: {where}. root runs {prefix}/bin/testbed, so "
                   "whoever can change it or a directory above it could run commands as root: choose a prefix "
                   "owned by root and writable by root only")
        return
    vi = probe.get("version_info")
    out.python = ".".join(map(str, vi[:3])) if isinstance(vi, list) else None
    problem = _judge_python(out.host, python, probe, build.python, build.machine)
    if problem:
        out.state, out.why = "refused", problem
        return
    say(f"{out.host}: Python {out.python} ({probe.get('machine')}) at {probe.get('executable')}")
    marker = probe.get("marker")
    if force or not (isinstance(marker, dict) and marker.get("version") == version and probe.get("testbed")):
        h.needs_install = True
        return
    r = h.ctl.run([posixpath.join(prefix, version, "bin", "testbed"), "version", "--json"], timeout=VERSION_TIMEOUT_S)
    doc = _json_line(r.stdout) if r.rc == 0 else None
    if doc is None or doc.get("version") != version:
        say(f"{out.host}: {prefix}/{version} is there but its testbed does not answer as {version}: reinstalling")
        h.needs_install = h.repair = True
        return
    out.state = "already installed"
    out.why = f"{prefix}/{version}" + (f" (installed {marker['installed_at']})" if marker.get("installed_at") else "")
    if marker.get("wheelhouse") != build.key:
        out.why += ("; built from another source tree or environment of this version (--force replaces it)")
    if probe.get("link") != posixpath.join("..", version, "bin", "testbed"):
        h.ctl.run([posixpath.join(prefix, version, "bin", "python"), "-I", "-c", _FINISH, prefix, version],
                  timeout=VERSION_TIMEOUT_S, check=True)
        out.why += f"; {prefix}/bin/testbed now points to it"


class _Steps:
    """on_stdout of the install script: its "@step" lines, said as they come, per host."""

    SAID = {"waiting": "waiting for another install into {prefix} to end (its lock, {prefix}/.install.lock)",
            "receive": "receiving the wheelhouse ({size})",
            "venv": "making the venv {venv}", "pip": "pip install testbed=={version} from the wheelhouse (no index)",
            "finish": None, "done": None}

    def __init__(self, host: str, say: Progress, fields: dict[str, str]):
        from testbed.cluster.remote import lines

        self.host, self.say, self.fields = host, say, fields
        self.seen: dict[str, float] = {}
        self.already: dict[str, Any] | None = None
        self._lines = lines(self._line)   # what waits for a newline is bounded (a host's stdout is hostile)

    def __call__(self, data: bytes) -> None:
        self._lines(data)

    def _line(self, text: str) -> None:
        if text.startswith("@step "):
            name, _, rest = text[len("@step "):].partition(" ")
            if name not in self.SAID and name not in ("already", "unmarked"):
                return   # (not ours: nothing a host says grows what is kept)
            self.seen[name] = time.monotonic()
            if name == "already":
                try:
                    self.already = json.loads(rest)
                except ValueError:
                    self.already = {}
            elif name == "venv" and "receive" in self.seen:
                self.say(f"{self.host}: received in {self.seen['venv'] - self.seen['receive']:.1f} s; "
                         + self.SAID["venv"].format(**self.fields))
            elif self.SAID.get(name):
                self.say(f"{self.host}: " + self.SAID[name].format(**self.fields))


def _install_on(h: _Host, prefix: str, version: str, python: str, house: Wheelhouse, force: bool, run_id: str,
                say: Progress) -> None:
    out = h.out
    wheels = posixpath.join(prefix, f".wheels-{secrets.token_hex(6)}")
    marker_text = json.dumps({"version": version, "wheelhouse": house.build.key, "run": run_id, "host": out.host,
                              "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "controller": socket.gethostname(), "python": out.python})
    steps = _Steps(out.host, say, {"size": f"{house.size / 1e6:.1f} MB", "venv": f"{prefix}/{version}",
                                   "version": version, "prefix": prefix})
    t0 = time.monotonic()
    with house.tar.open("rb") as fh:
        # the digest recorded when the wheelhouse was built goes with the command: the host checks the
        # stream against it, so a wheels.tar changed here after _load_cached checked it is refused there
        r = h.ctl.run(["sh", "-c", _INSTALL, "sh", prefix, version, python, wheels,
                       "1" if force or h.repair else "0", MARKER,
                       marker_text, run_id, _FINISH, house.sha256, str(house.tar_bytes), _RECEIVE],
                      stdin=fh, timeout=INSTALL_TIMEOUT_S, on_stdout=steps)
    if r.rc != 0:
        last = max(steps.seen, key=steps.seen.get) if steps.seen else None
        if last == "unmarked":   # not ours to replace without --force
            out.state = "refused"
            out.why = (f"{prefix}/{version} on {out.host} exists without testbed install's marker (made by "
                       "something else, or an install killed midway): remove it there, or give --force")
            return
        out.state = "failed"
        if last == "receive" and r.rc == RECEIVE_REFUSED:
            out.why = (f"{out.host} refused the wheelhouse it received: not the {house.tar_bytes} bytes with "
                       f"sha256 {house.sha256} recorded when it was built ({house.tar} changed since?); nothing "
                       "was unpacked")
            out.details = _tail(r.stderr or r.stdout)
            return
        what = {None: f"making {prefix} or locking {prefix}/.install.lock (flock, util-linux)",
                "waiting": f"waiting for the lock on {prefix}/.install.lock",
                "receive": "unpacking the wheelhouse (tar)", "venv": f"making the venv with `{python} -m venv`",
                "pip": "pip install", "finish": "writing the marker and the link",
                "already": f"pointing {prefix}/bin/testbed at it"}.get(last, "installing")
        out.why = f"{what} failed on {out.host} (exit status {r.rc})"
        out.details = _tail(r.stderr or r.stdout)
        return
    if steps.already is not None:
        by = steps.already.get("host")
        out.state = "already installed"
        out.why = (f"{prefix}/{version}: {by} installed it in this run (it shares {prefix} with {out.host})"
                   if steps.already.get("run") == run_id and by and by != out.host
                   else f"{prefix}/{version} (installed meanwhile, by {by or 'another install'})")
    else:
        out.state = "installed"
        out.why = f"{prefix}/{version} in {time.monotonic() - t0:.1f} s"
        if "pip" in steps.seen and "finish" in steps.seen:
            out.why += f" (pip {steps.seen['finish'] - steps.seen['pip']:.1f} s)"


def _verify(h: _Host, prefix: str, version: str) -> None:
    out = h.out
    exe = posixpath.join(prefix, "bin", "testbed")
    r = h.ctl.run([exe, "version", "--json"], timeout=VERSION_TIMEOUT_S)
    doc = _json_line(r.stdout) if r.rc == 0 else None
    out.verified = str(doc.get("version")) if doc else None
    if out.verified != version:
        out.state = "failed"
        out.why = (f"`{exe} version --json` on {out.host} "
                   + (f"says {out.verified}, not {version}" if doc else f"failed (exit status {r.rc})"))
        out.details = _tail(r.stderr or r.stdout)


def install(hosts: Sequence[Any], *, prefix: str, python: str = "python3", known_hosts: str | None = None,
            trust_new: bool = False, force: bool = False, build: Build | None = None,
            progress: Progress = lambda m: None, controls: dict[str, Any] | None = None,
            make_wheelhouse: Callable[[Build], Wheelhouse] | None = None) -> list[HostOutcome]:
    """Install this controller's testbed under PREFIX on every host of `hosts` (hosts-file entries),
    all at once; one outcome per host, in order. Raises only for what concerns every host (a bad
    PREFIX, no source tree, the wheelhouse failing to build); a host's problems are in its outcome.
    controls: name -> HostControl (default: SshHost of each entry, closed at the end);
    make_wheelhouse(build): how the wheelhouse is had when a host needs it (default: wheelhouse())."""
    from testbed.cluster.remote import HostUnreachable, RemoteError, SshHost, run_parallel

    prefix, python = check_prefix(prefix), check_python(python)
    build = build or prepare()
    version = build.version
    own = controls is None
    ctls = controls or {h.name: SshHost(h, known_hosts=known_hosts, trust_new=trust_new) for h in hosts}
    state = [_Host(ctls[h.name], HostOutcome(h.name)) for h in hosts]
    run_id = secrets.token_hex(8)

    def guarded(fn: Callable[[_Host], None]) -> Callable[[_Host], None]:
        def one(h: _Host) -> None:
            try:
                fn(h)
            except HostUnreachable as exc:
                h.out.state, h.out.why = "unreachable", str(exc)
            except RemoteError as exc:   # a timeout, a check=True command, sudo refused
                h.out.state, h.out.why = "failed", str(exc).splitlines()[0]
                h.out.details = _tail(exc.stderr or exc.stdout)
            except Exception as exc:  # noqa: BLE001 - a bug here: still one outcome per host, saying what
                h.out.state, h.out.why = "failed", f"installing on {h.out.host} failed: {type(exc).__name__}: {exc}"
            finally:
                h.out.seconds = round(time.monotonic() - h.t0, 2)
        return one

    try:
        progress(f"checking {len(state)} host(s): {', '.join(h.out.host for h in state)} "
                 f"(python `{python}`, prefix {prefix})")
        run_parallel(state, guarded(lambda h: _probe(h, prefix, version, python, build, force, progress)))
        todo = [h for h in state if h.needs_install and h.out.state == "pending"]
        if todo:
            house = (make_wheelhouse or (lambda b: wheelhouse(b, progress)))(build)
            progress(f"wheelhouse: {house.describe()}, "
                     + (f"from the cache {house.dir}" if house.cached else f"built in {house.seconds:.1f} s, "
                                                                           f"kept in {house.dir}"))
            progress(f"installing testbed {version} on {len(todo)} host(s) at once: "
                     f"{', '.join(h.out.host for h in todo)}")
            run_parallel(todo, guarded(lambda h: _install_on(h, prefix, version, python, house, force, run_id,
                                                             progress)))
        ready = [h for h in state if h.out.ready]
        run_parallel(ready, guarded(lambda h: _verify(h, prefix, version)))
        for h in state:
            if h.out.state == "pending":
                h.out.state, h.out.why = "failed", f"nothing was done on {h.out.host} (an earlier step stopped)"
    finally:
        if own:
            for c in ctls.values():
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing a dead connection: nothing to do
                    pass
    return [h.out for h in state]
