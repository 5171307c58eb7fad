"""The state of running testbeds: one JSON document per testbed, validated, locked, root's only.

`up` claims a name (creates NAME/ with mode 0700 and an empty state file,
exclusively) and writes the state as it builds; every other command reads it;
`down` removes it. Writes are atomic (a reader never sees half a document),
files are 0600, and `save` never recreates a testbed whose directory is gone:
a command that raced `down` fails instead of bringing the state back.

Trust: testbed acts as root on what the state lists (namespaces it deletes,
processes it signals, cgroups it removes), so `load` accepts only what testbed
itself would have written (`validate`, through the typed schema of
testbed.state_schema): known fields of the right types, namespace names of
this testbed (tb-NAME-NODE for a node of its topology), cgroup directories
testbed/NAME[.faults]/NODE of a cgroup mount, files where testbed puts them
in the testbed's own directory, PIDs with the start time that names the
process. Anything else is a StateError naming the file, the field (dotted:
runtime.workers.w0.pid) and the value; `cleanup` then falls back to what it
can prove is ours (ownership labels).

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
import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from testbed import paths
from testbed.errors import StateError
from testbed import names

if TYPE_CHECKING:
    from testbed.topology.model import Topology

# what `save` writes: testbed.state_schema.SCHEMA_VERSION, the only one it accepts (the same number, not
# imported: importing the schema builds its validator, which only `load` needs)
SCHEMA_VERSION = 1
LOCK_TIMEOUT_S = 30.0


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
    return load_with_topology(name)[0]


def load_with_topology(name: str) -> tuple[dict[str, Any], "Topology"]:
    """load(), and the state's topology as its check parsed it (at k=16 a second parse is 26 ms)."""
    data = load_unchecked(name)
    return data, _checked(name, data)


def load_unchecked(name: str) -> dict[str, Any]:
    """The state as JSON, not validated: for messages and for cleanup's fallback only."""
    p = paths.state_file(name)
    paths.check_root()
    if paths.directory(name).is_symlink() or p.is_symlink():
        raise StateError(f"state of testbed {name!r} is reached through a symbolic link ({p}): not trusted; "
                         "run `testbed cleanup`")
    try:
        data = _parse(p.read_bytes())
    except FileNotFoundError:
        raise StateError(f"no testbed named {name!r} is up") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise StateError(f"state of testbed {name!r} is corrupt ({p}: {exc}); run `testbed cleanup`") from None
    if not isinstance(data, dict):
        raise StateError(f"state of testbed {name!r} is corrupt ({p}: not a JSON object); run `testbed cleanup`")
    return data


def _parse(raw: bytes) -> Any:
    """The state's JSON: pydantic-core's parser (the schema's own dependency) reads a k=16 state (3.7 MB)
    in two thirds of json's time; what it refuses that `save` can write (a lone surrogate from a
    non-UTF-8 file name, nesting deeper than 200) is read by json, whose RecursionError the caller
    catches."""
    from pydantic_core import from_json

    try:
        return from_json(raw)
    except ValueError:
        return json.loads(raw)


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
        f.write(json.dumps(data, separators=(",", ":")))   # the C encoder: indent would take the slow Python one
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


def _err(name: str, field: str, why: str, value: Any, more: list[str] | None = None) -> StateError:
    shown = repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    also = ""
    if more:
        also = f"; {len(more)} more: {', '.join(more[:3])}{' ...' if len(more) > 3 else ''}"
    return StateError(f"state of testbed {name!r} ({paths.state_file(name)}): {field}: {why} (got {shown}){also}; "
                      "testbed does not act on it (testbed cleanup removes what it can prove is ours)")


def validate(name: str, data: dict[str, Any]) -> None:
    """Raise StateError unless `data` is what testbed itself writes for testbed `name`: the typed
    schema of testbed.state_schema (imported here, so that importing the store stays cheap)."""
    _checked(name, data)


def _checked(name: str, data: dict[str, Any]) -> "Topology":
    from testbed import state_schema

    found, topo = state_schema.checked(data, name, paths.directory(name))
    if found or topo is None:
        field, why, value = found[0] if found else ("topology", "not checked", None)
        raise _err(name, field, why, value, more=[f for f, _, _ in found[1:]])
    return topo
