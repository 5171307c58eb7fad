"""One testbed over several hosts: what its controller keeps, and how it reaches the hosts.

The controller keeps one file, <state root>/.clusters/NAME.json: the hosts file's text
(re-validated on every load), the placement and each host's part summary. Each host keeps its
usual local state, so `testbed down NAME` on a host removes its part even when the controller is
gone. `up` is testbed.cluster.up, a job across hosts testbed.cluster.job, the agents' requests
testbed.cluster.agents; here: the record, the SSH connections to the hosts and their fan-out
(`_parallel`), `down`, and running a command on the hosts.

Long commands get a lifeline: their stdin stays open to the controller, and its end is a Ctrl-C to
the host's testbed (cli.common), so a Ctrl-C here, or the controller's death, stops what runs there.

Hosts are driven through testbed.cluster.remote.HostControl (SSH with Fabric today): a narrow
interface, so another transport could drive them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed import paths
from testbed.errors import StateError, TestbedError

if TYPE_CHECKING:   # (the CLI imports this module for exists() and list_names(): it stays light)
    from testbed.cluster.hosts import Host, Hosts

DOWN_TIMEOUT_S = 600.0


class ClusterError(TestbedError):
    """A testbed over several hosts could not be built, reached or removed; says which host and why."""


# -- the controller's state ------------------------------------------------------------------------------


def state_path(name: str) -> Path:
    return paths.root() / ".clusters" / f"{name}.json"


def exists(name: str | None) -> bool:
    return bool(name) and state_path(name).is_file()


def _save(name: str, doc: dict[str, Any]) -> None:
    paths.check_root(create=True)
    d = state_path(name).parent
    d.mkdir(mode=0o700, exist_ok=True)
    tmp = d / f".{name}.json.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, state_path(name))


def load(name: str) -> dict[str, Any]:
    """The controller's record of testbed `name`, checked: its hosts file is parsed again, the
    placement names only those hosts."""
    from testbed.cluster.hosts import load_hosts_text

    paths.check_root()   # refuses a state root that is not root's alone, before anything is trusted
    p = state_path(name)
    if p.is_symlink():
        raise StateError(f"{p} is a symbolic link: not a record testbed wrote")
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise StateError(f"no testbed {name!r} over several hosts here ({p} is missing)") from None
    except ValueError as exc:
        raise StateError(f"{p}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("name") != name or not isinstance(doc.get("hosts_text"), str) \
            or not isinstance(doc.get("placement"), dict):
        raise StateError(f"{p}: not a cluster record of testbed {name!r}")
    src = doc.get("hosts_source")
    hosts = load_hosts_text(doc["hosts_text"], f"{p}:hosts_text",
                            base=os.path.dirname(src) if isinstance(src, str) and os.path.isabs(src) else None)
    known = {h.name for h in hosts}
    bad = [h for h in doc["placement"].values() if not isinstance(h, str) or h not in known]
    if bad:
        raise StateError(f"{p}: placement names host {bad[0]!r}, which its hosts file lacks")
    doc["_hosts"] = hosts
    return doc


def _forget(name: str) -> None:
    """Remove the controller's record of `name` (and the host keys its `up` learned)."""
    state_path(name).unlink(missing_ok=True)
    (state_path(name).parent / f"{name}.known_hosts").unlink(missing_ok=True)


def list_names() -> list[str]:
    d = paths.root() / ".clusters"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


# -- hosts -------------------------------------------------------------------------------------------------


def _host_keys_file(name: str, given: str | None, trust_new: bool) -> str | None:
    """The known-hosts file every command on this testbed checks host keys against, as an absolute
    path. With trust_new (only `up` takes it), the testbed's own copy under .clusters/, seeded from
    the given file (or ~/.ssh/known_hosts): the keys `up` accepts are added there, and every later
    verb accepts only those."""
    if given is not None:
        given = os.path.abspath(os.path.expanduser(given))
        if not os.path.isfile(given) and not trust_new:
            raise ClusterError(f"--known-hosts {given}: no such file (give the hosts' keys, or "
                               "--trust-new-host-keys to accept and remember them)")
    if not trust_new:
        return given
    d = state_path(name).parent
    paths.check_root(create=True)
    d.mkdir(mode=0o700, exist_ok=True)
    mine = d / f"{name}.known_hosts"
    seed = given or os.path.expanduser("~/.ssh/known_hosts")
    text = Path(seed).read_text() if os.path.isfile(seed) else ""
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return str(mine)


def _controls(hosts: Sequence[Host], known_hosts: str | None, trust_new: bool) -> dict[str, Any]:
    from testbed.cluster.remote import SshHost

    return {h.name: SshHost(h, known_hosts=known_hosts, trust_new=trust_new) for h in hosts}


def _close(ctls: dict[str, Any]) -> None:
    for c in ctls.values():
        try:
            c.close()
        except Exception:  # noqa: BLE001 - closing a dead connection: nothing to do
            pass


class _Pipe:
    """The write end of a remote command's stdin (its read end is what SshHost.run feeds from): a
    spec sent in a dialogue, or a lifeline cut to pass a Ctrl-C on."""

    def __init__(self) -> None:
        r, self._w = os.pipe()
        self.reader = os.fdopen(r, "rb", buffering=0)   # unbuffered: the feeder passes on each write at once
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._w is not None

    def write(self, data: bytes) -> bool:
        """Send `data` on (phantoms' announcements relayed from another host); False once closed."""
        with self._lock:
            w = self._w
        if w is None:
            return False
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(w, view):]
        except OSError:
            return False
        return True

    def close(self, last: bytes | None = None) -> None:
        """Write `last` (if any), then EOF. Once; later calls do nothing."""
        with self._lock:
            w, self._w = self._w, None
        if w is None:
            return
        try:
            if last:
                os.write(w, last)   # (a pipe holds 64 KiB; the feeder empties it)
        except OSError:
            pass   # the command is over already: its result says why
        finally:
            os.close(w)



# A remote testbed started under this env takes the end of its stdin as a Ctrl-C (cli.common: the
# SSH session's end sends no signal to a command without a tty, so nothing else would stop it).
LIFELINE_ARGV = ("env", "TESTBED_LIFELINE=stdin")


def _parallel(ctls: dict[str, Any], names: Sequence[str], fn: Callable[..., Any], *, lifeline: bool = False,
              progress: Callable[[str], None] = lambda _m: None, stop: threading.Event | None = None,
              pipes: dict[str, _Pipe] | None = None) -> dict[str, Any]:
    """fn(ctl) on the named hosts at once: host -> result or the exception it raised.

    lifeline: fn(ctl, stdin) runs a testbed command under LIFELINE_ARGV with `stdin` as its stdin. A
    Ctrl-C here cuts every host's lifeline (each host's testbed stops as on a Ctrl-C there: a run
    stops its ranks and keeps its run directory) and waits for their answers; a second Ctrl-C
    stops waiting (the caller's connections close, which ends the lifelines too). `stop` set (from
    another thread) cuts them too, quietly. pipes: the lifelines to use (the caller writes on them too)."""
    results: dict[str, Any] = {}
    pipes = (pipes if pipes is not None else {n: _Pipe() for n in names}) if lifeline else {}
    done = {n: threading.Event() for n in names}

    def one(n: str) -> None:
        try:
            results[n] = fn(ctls[n], pipes[n].reader) if lifeline else fn(ctls[n])
        except Exception as exc:  # noqa: BLE001 - in the host's place, for the caller
            results[n] = exc
        finally:
            done[n].set()

    for n in names:
        threading.Thread(target=one, args=(n,), name=f"host-{n}", daemon=True).start()
    try:
        for n in names:
            # an Event, not Thread.join: on this Python a join that a Ctrl-C interrupts marks the
            # thread as ended although it still runs
            while not done[n].is_set():
                try:
                    done[n].wait(None if stop is None else 0.2)
                    if stop is not None and stop.is_set():
                        for p in pipes.values():
                            p.close()
                except KeyboardInterrupt:
                    if not lifeline or not any(p.is_open for p in pipes.values()):
                        raise
                    progress(f"interrupted: passing the Ctrl-C on to {', '.join(names)} and waiting for them to "
                             "stop (Ctrl-C again not to wait)")
                    for p in pipes.values():
                        p.close()
    finally:
        for p in pipes.values():
            p.close()
    return {n: results.get(n) for n in names}


def _why(res: Any) -> str:
    """One line of why a host's command failed."""
    from testbed.cluster.remote import RemoteResult

    if isinstance(res, RemoteResult):
        lines = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if ln.strip()]
        return lines[-1].removeprefix("error: ") if lines else f"exit status {res.rc}"
    return str(res)


# -- down, status, forwarding --------------------------------------------------------------------------------


def _down_on(ctls: dict[str, Any], by_name: dict[str, Host], name: str, hosts: Sequence[str]) -> dict[str, str]:
    """`testbed down NAME` on the hosts at once; host -> why it is not down (absent: done)."""
    def down(ctl: Any) -> Any:
        return ctl.run([*by_name[ctl.name].testbed_argv, "down", name], timeout=DOWN_TIMEOUT_S)

    left = {}
    for h, r in _parallel(ctls, list(hosts), down).items():
        if isinstance(r, Exception):
            left[h] = f"unreachable ({r}); its part stays until `testbed down {name}` runs there"
        elif r.rc != 0 and "no testbed" not in (r.stderr + r.stdout).lower():
            left[h] = _why(r)
    return left


def down(name: str, progress: Callable[[str], None] = lambda _m: None) -> dict[str, str]:
    """Take testbed `name` down on every host; host -> what is left there (empty: all gone, and the
    controller's record is removed; else the record keeps only the hosts still to do)."""
    doc = load(name)
    hosts: Hosts = doc["_hosts"]
    by_name = {h.name: h for h in hosts}
    todo = [h for h in doc.get("hosts", {}) if h in by_name] or sorted(set(doc["placement"].values()))
    ctls = _controls([by_name[h] for h in todo], doc.get("known_hosts"), False)
    try:
        progress(f"taking {name} down on {len(todo)} host(s): {', '.join(todo)}")
        left = _down_on(ctls, by_name, name, todo)
    finally:
        _close(ctls)
    if left:
        doc = {k: v for k, v in doc.items() if k != "_hosts"}
        doc["status"] = "partly down"
        doc["hosts"] = {h: v for h, v in doc.get("hosts", {}).items() if h in left}
        _save(name, doc)
    else:
        _forget(name)
    return left


def run_on_node_host(name: str, node: str, argv: Sequence[str], timeout: float | None = None, *,
                     lifeline: bool = False, progress: Callable[[str], None] = lambda _m: None,
                     on_stdout: Callable[[bytes], None] | None = None) -> Any:
    """argv (a testbed command line, without the `testbed`) on the host that holds `node`. lifeline:
    a Ctrl-C here is passed on to it (see _parallel), and the result still comes back. on_stdout:
    its output as it comes (with lifeline)."""
    doc = load(name)
    host = doc["placement"].get(node)
    if host is None:
        raise TestbedError(f"no node {node!r} in testbed {name} (nodes: {', '.join(list(doc['placement'])[:12])} ...)")
    h = next(x for x in doc["_hosts"] if x.name == host)
    ctls = _controls([h], doc.get("known_hosts"), False)
    try:
        if not lifeline:
            return ctls[host].run([*h.testbed_argv, *argv], timeout=timeout)
        res = _parallel(ctls, [host], lambda c, stdin: c.run([*LIFELINE_ARGV, *h.testbed_argv, *argv], stdin=stdin,
                                                             timeout=timeout, on_stdout=on_stdout),
                        lifeline=True, progress=progress)[host]
        if isinstance(res, Exception):
            raise res
        return res
    finally:
        _close(ctls)


def host_of(name: str, node: str) -> str:
    """The host that holds `node` of testbed `name`."""
    doc = load(name)
    host = doc["placement"].get(node)
    if host is None:
        raise TestbedError(f"no node {node!r} in testbed {name}")
    return host


def open_host(name: str, host: str) -> Any:
    """A HostControl of `host` of testbed `name` that keeps its connection between commands (for
    polling: each run_on_host pays an SSH handshake). The caller closes it."""
    doc = load(name)
    h = next((x for x in doc["_hosts"] if x.name == host), None)
    if h is None:
        raise TestbedError(f"no host {host!r} in testbed {name}")
    return _controls([h], doc.get("known_hosts"), False)[host]
