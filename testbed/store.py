"""The state of running testbeds: one JSON document per testbed, validated, locked, root's only.

`up` claims a name (creates NAME/ with mode 0700 and an empty state file,
exclusively) and writes the state as it builds; every other command reads it;
`down` removes it. Writes are atomic (a reader never sees half a document),
files are 0600, and `save` never recreates a testbed whose directory is gone:
a command that raced `down` fails instead of bringing the state back.

Trust: testbed acts as root on what the state lists (namespaces it deletes,
processes it signals, cgroups it removes), so `load` accepts only what testbed
itself would have written, checked field by field (`validate`): known
top-level fields of the right types, namespace names of this testbed
(tb-NAME-NODE for a node of its topology), cgroup directories under
testbed/NAME/ (or NAME.faults/) of a cgroup mount, files under the
testbed's own directory, PIDs with the start time that names the process.
Anything else is a StateError naming the file, the field and the value;
`cleanup` then falls back to what it can prove is ours (ownership labels).

Locking: `lock(name)` is an exclusive flock on <root>/.locks/NAME.lock, held
by every mutation (up for its whole build, down, cleanup, link, node and
partition changes, scenario events); waiting ends after a timeout with the
holder's PID in the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from testbed import paths
from testbed.errors import StateError
from testbed.net import names

SCHEMA_VERSION = 1
LOCK_TIMEOUT_S = 30.0
STATUSES = ("building", "up", "removing")
TOP_FIELDS = {
    "schema", "name", "status", "pid", "pid_start", "created", "state_root", "owner", "topology",
    "time_dilation", "dilation", "gpu", "plan", "capabilities", "latency_floor_s", "no_delay_element",
    "delay_threshold_s", "runtime", "links", "resources", "timings", "faults", "leftovers",
}
RUNTIMES = ("netns", "docker", "bare")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


# -- where and what -------------------------------------------------------------------------------------


def exists(name: str) -> bool:
    return paths.state_file(name).is_file()


def list_names() -> list[str]:
    base = paths.root()
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if not p.name.startswith(".") and (p / "state.json").is_file())


def load(name: str) -> dict[str, Any]:
    """The validated state of testbed `name` (StateError if there is none, or it is not ours)."""
    data = load_unchecked(name)
    validate(name, data)
    return data


def load_unchecked(name: str) -> dict[str, Any]:
    """The state as JSON, not validated: for messages and for cleanup's fallback only."""
    p = paths.state_file(name)
    paths.check_root()
    if paths.directory(name).is_symlink() or p.is_symlink():
        raise StateError(f"state of testbed {name!r} is reached through a symbolic link ({p}): not trusted; "
                         "run `testbed cleanup`")
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise StateError(f"no testbed named {name!r} is up") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateError(f"state of testbed {name!r} is corrupt ({p}: {exc}); run `testbed cleanup`") from None
    if not isinstance(data, dict):
        raise StateError(f"state of testbed {name!r} is corrupt ({p}: not a JSON object); run `testbed cleanup`")
    return data


def claim(name: str) -> None:
    """Make NAME/ and an empty state file, exclusively: a second `up` of the same name fails here."""
    if not names.valid_testbed_name(name):
        raise StateError(f"invalid testbed name {name!r}")
    paths.check_root(create=True)
    d = paths.directory(name)
    d.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(paths.state_file(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
    except FileExistsError:
        raise StateError(f"a testbed named {name!r} is already up (or being brought up)") from None


def save(name: str, data: dict[str, Any]) -> None:
    """Write atomically. Never recreates a removed testbed: its directory must still be there."""
    d = paths.directory(name)
    if not d.is_dir() or d.is_symlink():
        raise StateError(f"testbed {name!r} is gone (brought down meanwhile?): its state is not written again")
    data = {"schema": SCHEMA_VERSION, **data}
    tmp = d / f".state.json.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1))
    os.replace(tmp, paths.state_file(name))


def remove(name: str) -> None:
    d = paths.directory(name)
    if d.is_symlink():        # never follow one out of the state root
        d.unlink()
        return
    shutil.rmtree(d, ignore_errors=True)


# -- the lock -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def lock(name: str, timeout: float = LOCK_TIMEOUT_S, what: str = "") -> Iterator[None]:
    """Hold testbed `name`'s lock for the block (see the module text). Re-entrant within a process
    only through the caller: take it once per operation."""
    if not names.valid_testbed_name(name):
        raise StateError(f"invalid testbed name {name!r}")
    paths.check_root(create=True)
    lf = paths.lock_file(name)
    lf.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(lf, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                    raise StateError(f"testbed {name!r} is busy: {holder} holds its lock ({lf}); "
                                     f"waited {timeout:g} s") from None
                time.sleep(0.02)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}{' (' + what + ')' if what else ''}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- validation -------------------------------------------------------------------------------------------


def _err(name: str, field: str, why: str, value: Any) -> StateError:
    shown = repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return StateError(f"state of testbed {name!r} ({paths.state_file(name)}): {field}: {why} (got {shown}); "
                      "testbed does not act on it (testbed cleanup removes what it can prove is ours)")


def _int(name: str, field: str, v: Any, minimum: int = 0, optional: bool = False) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(name, field, f"not an integer >= {minimum}", v)


def _under(name: str, field: str, v: Any, base: Path) -> None:
    """v is an absolute path inside base (no '..', no way out through a link in the part we made)."""
    if not isinstance(v, str) or not v.startswith("/") or ".." in Path(v).parts or "\0" in v:
        raise _err(name, field, "not an absolute path without '..'", v)
    real_base = Path(os.path.realpath(base))
    real = Path(os.path.realpath(v))
    if real != real_base and real_base not in real.parents:
        raise _err(name, field, f"not inside {base}", v)


def _cgroup_dir(name: str, field: str, v: Any) -> None:
    """A cgroup directory testbed makes: <mount>/testbed/NAME[.faults]/NODE under /sys/fs/cgroup."""
    from testbed.runtime import cgroups

    if not isinstance(v, str) or ".." in Path(v).parts or not v.startswith("/"):
        raise _err(name, field, "not an absolute path without '..'", v)
    p = Path(v)
    if not (p.parent.name in (name, f"{name}.faults") and p.parent.parent.name == cgroups.TOP
            and _NODE_RE.match(p.name)):
        raise _err(name, field, f"not a cgroup of this testbed ({cgroups.TOP}/{name}/NODE)", v)
    mount = p.parent.parent.parent
    if not Path(os.path.realpath(mount)).is_relative_to(cgroups.CGROUP_ROOT):
        raise _err(name, field, f"not under {cgroups.CGROUP_ROOT}", v)


def _netns(name: str, field: str, v: Any, allowed: set[str]) -> None:
    if not isinstance(v, str) or v not in allowed:
        raise _err(name, field, f"not one of this testbed's namespaces ({names.netns_prefix(name)}NODE)", v)


def validate(name: str, data: dict[str, Any]) -> None:
    """Raise StateError unless `data` is what testbed itself writes for testbed `name`."""
    from testbed.errors import TopologyError
    from testbed.topology.model import Topology

    unknown = sorted(set(data) - TOP_FIELDS)
    if unknown:
        raise _err(name, unknown[0], "unknown field", data[unknown[0]])
    if data.get("name") != name:
        raise _err(name, "name", "not the name of its directory", data.get("name"))
    if data.get("status") not in STATUSES:
        raise _err(name, "status", f"not one of {', '.join(STATUSES)}", data.get("status"))
    _int(name, "pid", data.get("pid"), 1)
    _int(name, "pid_start", data.get("pid_start"), 0, optional=True)
    try:
        topo = Topology.from_json(data["topology"]).validate()
    except (KeyError, TypeError, ValueError, AttributeError, TopologyError) as exc:
        raise _err(name, "topology", f"not a valid topology snapshot ({exc})", "...") from None
    for n in topo.nodes:
        if not _NODE_RE.match(n):
            raise _err(name, "topology.nodes", "a node name testbed would not make a namespace of", n)
    ns_of = {names.netns(name, n): n for n in topo.nodes}
    allowed = set(ns_of)
    sdir = paths.directory(name)

    res = data.get("resources")
    if not isinstance(res, dict) or set(res) - {"switch_netns", "worker_netns", "delay_lines"}:
        raise _err(name, "resources", "not the resources testbed records", res)
    for key in ("switch_netns", "worker_netns"):
        lst = res.get(key, [])
        if not isinstance(lst, list):
            raise _err(name, f"resources.{key}", "not a list", lst)
        for i, ns in enumerate(lst):
            _netns(name, f"resources.{key}[{i}]", ns, allowed)
    dls = res.get("delay_lines", [])
    if not isinstance(dls, list):
        raise _err(name, "resources.delay_lines", "not a list", dls)
    for i, dl in enumerate(dls):
        f = f"resources.delay_lines[{i}]"
        if not isinstance(dl, dict):
            raise _err(name, f, "not a record", dl)
        _int(name, f + ".pid", dl.get("pid"), 1)
        _int(name, f + ".start", dl.get("start"), 0)
        for k in ("ns_a", "ns_b"):
            _netns(name, f"{f}.{k}", dl.get(k), allowed)
        for k in ("control", "pid_file"):
            _under(name, f"{f}.{k}", dl.get(k), sdir)

    rt = data.get("runtime")
    if not isinstance(rt, dict) or rt.get("kind") not in RUNTIMES or not isinstance(rt.get("workers"), dict):
        raise _err(name, "runtime", f"not a runtime record (kind one of {', '.join(RUNTIMES)})", rt)
    for w, rec in rt["workers"].items():
        f = f"runtime.workers.{w}"
        if w not in topo.workers or not isinstance(rec, dict):
            raise _err(name, f, "not a worker of the topology", w)
        if rec.get("netns") is not None:
            _netns(name, f + ".netns", rec["netns"], {names.netns(name, w)})
        if rec.get("pid") is not None:
            _int(name, f + ".pid", rec["pid"], 1)
            _int(name, f + ".starttime", rec.get("starttime"), 0)   # no PID without what names the process
        cg = rec.get("cgroups") or []
        if not isinstance(cg, list):
            raise _err(name, f + ".cgroups", "not a list", cg)
        for i, p in enumerate(cg):
            _cgroup_dir(name, f"{f}.cgroups[{i}]", p)
        for k in ("dir", "log_dir"):
            if rec.get(k) is not None:
                _under(name, f"{f}.{k}", rec[k], sdir)
        if rec.get("net_admin") is not None and not isinstance(rec["net_admin"], bool):
            raise _err(name, f + ".net_admin", "not true or false", rec["net_admin"])
        if rec.get("container") is not None and rec["container"] != names.netns(name, w):
            raise _err(name, f + ".container", f"not this worker's container ({names.netns(name, w)})",
                       rec["container"])
        host = rec.get("docker_host")
        if host is not None and not (isinstance(host, str) and re.match(r"^(unix:///[^\0]+|tcp://[\w.-]+:\d+)$", host)):
            raise _err(name, f + ".docker_host", "not a Docker endpoint (unix:///PATH or tcp://HOST:PORT)", host)

    mps = (data.get("gpu") or {}).get("mps_daemon") if isinstance(data.get("gpu"), dict) else None
    if mps is not None:
        if not isinstance(mps, dict):
            raise _err(name, "gpu.mps_daemon", "not a record", mps)
        _int(name, "gpu.mps_daemon.pid", mps.get("pid"), 1)
        _int(name, "gpu.mps_daemon.starttime", mps.get("starttime"), 0)
        for k in ("pipe_dir", "log_dir"):
            if mps.get(k) is not None:
                _under(name, f"gpu.mps_daemon.{k}", mps[k], sdir)

    faults = data.get("faults") or {}
    if not isinstance(faults, dict):
        raise _err(name, "faults", "not a record", faults)
    for node, rec in (faults.get("nodes") or {}).items():
        f = f"faults.nodes.{node}"
        if node not in topo.nodes or not isinstance(rec, dict):
            raise _err(name, f, "not a node of the topology", node)
        for i, p in enumerate(rec.get("cgroup") or []):
            _cgroup_dir(name, f"{f}.cgroup[{i}]", p)
    part = faults.get("partition")
    if part:
        for i, ns in enumerate((part or {}).get("netns") or []):
            _netns(name, f"faults.partition.netns[{i}]", ns, allowed)

    links = data.get("links")
    if not isinstance(links, list) or len(links) != len(topo.links):
        raise _err(name, "links", "not one record per link of the topology", links)
    for i, rec in enumerate(links):
        ifs = rec.get("ifnames") if isinstance(rec, dict) else None
        if not isinstance(ifs, list) or not all(isinstance(x, str) and 0 < len(x) <= names.IFNAMSIZ
                                                 and "/" not in x for x in ifs):
            raise _err(name, f"links[{i}].ifnames", "not interface names", ifs)

    left = data.get("leftovers") or []
    if not isinstance(left, list) or not all(isinstance(x, dict) and isinstance(x.get("what"), str)
                                             for x in left):
        raise _err(name, "leftovers", "not a list of what could not be removed", left)
