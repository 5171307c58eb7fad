"""The wheelhouse `testbed install` ships to the hosts, built on the controller (testbed/cluster/install.py).

This testbed's own wheel, built from its source tree (the directory holding pyproject.toml above the
imported package: a clone; a testbed installed from a wheel cannot rebuild itself and is refused),
and a wheel of every dependency, pinned to the versions installed here (a constraints file of
`name==version` for every distribution of the running environment but testbed), by
``python -m pip wheel``. The sources are copied to a scratch directory first, so the build writes
nothing into the clone (no build/, no egg-info). Kept under the cache root (TESTBED_CACHE_DIR, else
$XDG_CACHE_HOME/testbed, else ~/.cache/testbed) as wheelhouse/VERSION-KEY/wheels.tar, KEY a digest
of the sources, the constraints, the Python tag and the machine: an edited clone or a changed
environment gets a new wheelhouse; the three newest are kept. pip's own cache goes there too
(CACHE/pip). Not under the state root (/run/testbed): that is a tmpfs, RAM, emptied at each boot,
and holds live testbeds only.

The sha256 of wheels.tar is taken as this process writes it and recorded outside the cache, in the
ledger (testbed/cluster/wheelhouse_ledger.py). A cached wheels.tar whose digest the ledger does not
hold for its build is never used: refused when the ledger holds another digest for it (it changed
after the build), built anew when it holds none. The Wheelhouse carries that digest and size: the
host checks the stream against them before unpacking anything.

In code: prepare() -> Build (cheap: sources, constraints, key), wheelhouse(build, progress) ->
Wheelhouse (built or found in the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed import __version__
from testbed.errors import InstallRefused, WheelhouseError
from testbed.cluster.wheelhouse_ledger import ledger_root, record, recorded
from testbed.safeio import Unsafe, read_regular

__all__ = ["Build", "Progress", "Wheelhouse", "cache_root", "prepare", "wheelhouse"]

KEEP_WHEELHOUSES = 3
MANIFEST_MAX = 1 << 20    # what is read of a cached manifest.json (ours: a few KiB)
PIP_WHEEL_TIMEOUT_S = 1800.0
_SOURCE_TOP = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "README.rst", "README",
               "LICENSE", "LICENSE.txt", "COPYING")

Progress = Callable[[str], None]   # what is said as the work goes


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
    known = recorded(build.name)
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
    record(build.name, build.key, digest, tar_bytes)
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
