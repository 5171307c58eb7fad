"""Install this controller's testbed on the hosts of a hosts file, over SSH (`testbed install`).

A testbed over several hosts needs the same testbed version on every host (the controller checks
it at `up`). This module puts it there from the controller alone; the hosts need Python (3.11,
>= 3.11.4, with venv) and SSH, nothing from a package index:

1. **The wheelhouse**, built once on the controller and kept (testbed/cluster/wheelhouse.py): this
   testbed's wheel from its clone and a wheel of every dependency at the version installed here,
   one wheels.tar in the cache, its sha256 recorded as it is written in a ledger outside the cache
   (testbed/cluster/wheelhouse_ledger.py) that whoever can rewrite the cache cannot rewrite. The
   host is given the digest and the size with the install command and checks the stream against
   them before unpacking anything (so a wheels.tar changed after the controller checked it is
   refused there).
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
-> Wheelhouse (built or found in the cache), both of testbed/cluster/wheelhouse.py and named here
too, install(hosts, ...) -> [HostOutcome].
"""

from __future__ import annotations

import json
import posixpath
import re
import secrets
import shlex
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from testbed.cluster import hostside
from testbed.cluster.hostside import install_receive
# (the errors, the wheelhouse and the ledger's root are named here too: callers say install.X)
from testbed.errors import InstallRefused, WheelhouseError
from testbed.cluster.wheelhouse import Build, Progress, Wheelhouse, cache_root, prepare, wheelhouse
from testbed.cluster.wheelhouse_ledger import ledger_root

__all__ = ["Build", "HostOutcome", "InstallRefused", "MIN_PYTHON", "Wheelhouse", "WheelhouseError",
           "cache_root", "check_prefix", "check_python", "hosts_file_line", "install", "ledger_root", "prepare",
           "wheelhouse"]

MIN_PYTHON = (3, 11, 4)   # pyproject's requires-python: tarfile's extraction filters
MARKER = ".testbed-install.json"   # in PREFIX/VERSION, written once pip has installed everything
RECEIVE_REFUSED = install_receive.REFUSED   # install.sh's exit status when the stream is not the recorded one
PROBE_TIMEOUT_S = 60.0
VERSION_TIMEOUT_S = 120.0
INSTALL_TIMEOUT_S = 1800.0   # the transfer, a wait for another host's install into a shared PREFIX, pip
_PREFIX_RE = re.compile(r"/[A-Za-z0-9._+@/-]+")


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
        # stream against it, so a wheels.tar changed here after wheelhouse() checked it is refused there
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
