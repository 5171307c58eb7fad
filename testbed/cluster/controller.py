"""One testbed over several hosts: the controller's side (`testbed up TOPOLOGY --hosts HOSTS.yaml`).

`up`: one SSH session per host carries it all (`testbed part up --check`, started
while the nodes are placed by testbed.cluster.placement): the host answers the
checks (reachable, root, the same testbed version, `doctor`) and measures the
underlay toward the other hosts (MTU, one-way latency; a cut link the underlay
cannot carry is refused before anything is built); the controller chooses one
time dilation for all machines, then sends each host its part
(testbed.cluster.part) and every host builds at once. If any host fails, every
host that built its part takes it down again: all or nothing, as on one host. A
Ctrl-C during the build waits for every host's answer first (a host's `part up`
runs on without its SSH session: no terminal hangs it up), then takes down what
was built.

Long commands (`run`, `exec`, streams) get a lifeline: their stdin stays open
to the controller, and its end is a Ctrl-C to the host's testbed (cli.common),
so a Ctrl-C here, or the controller's death, stops what runs there.

The controller keeps one file, <state root>/.clusters/NAME.json: the hosts
file's text (re-validated on every load), the placement and each host's part
summary. Each host keeps its usual local state, so `testbed down NAME` on a
host removes its part even when the controller is gone. Verbs forward: `down`
and link changes to every host (each acts on what is local; every host keeps
the whole topology and routing plan, so each recomputes the same routes),
`exec` to the node's host, `status` gathers every host's.

Hosts are driven through testbed.cluster.remote.HostControl (SSH with
Fabric today): a narrow interface, so another transport could drive them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from testbed import paths
from testbed.errors import StateError, TestbedError

if TYPE_CHECKING:   # (the CLI imports this module for exists() and list_names(): it stays light)
    from testbed.cluster.hosts import Host, Hosts
    from testbed.topology.model import Topology

UP_TIMEOUT_S = 1800.0
DOWN_TIMEOUT_S = 600.0
PROBE_COUNT = 10
CHECK_TIMEOUT_S = 120.0   # how long `up` waits for a host's answers to the checks
HANDSHAKE_HEAD_START_S = 0.5   # placement waits this long at most for the hosts' SSH handshakes
# What of a host's stdout may wait for its newline (remote.lines: a longer line is passed on cut,
# which its JSON reader then refuses), per kind of line; what a host sends is hostile input
PART_LINE_MAX = 4 << 20   # `part up --check`: its answers, then what it built (k=32 fat-tree on one host: 160 kB)
DOC_LINE_MAX = 16 << 20   # streams of documents, one a line (top --json: 313 B per link direction; k=16: ~2 MB)


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


Lifeline = _Pipe   # (public name: callers of stream_on_every_host make their own)

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


# -- up ----------------------------------------------------------------------------------------------------


def _machines(answers: dict[str, Any], reports: dict[str, Any], placement: Any, topo: Topology) -> list[Any]:
    """The machines under the hosts (hosts whose answers give one boot id share one), with the
    workers placed on them, their cores, GPUs and calibration: what time dilation accounts."""
    import re

    from testbed.topology.dilation import Machine
    from testbed.topology.reference import MachineConstants

    from testbed.jobs import calibration

    here = calibration.boot_id()
    cal = calibration.cached()
    mine = cal.constants() if cal is not None else None
    groups: dict[str, list[str]] = {}
    for host, a in answers.items():
        m = a.get("machine") if isinstance(a.get("machine"), dict) else {}
        boot = m.get("boot_id")
        groups.setdefault(boot if isinstance(boot, str) and re.fullmatch(r"[0-9a-f-]{36}", boot) else host,
                          []).append(host)
    out = []
    for boot, hosts in groups.items():
        cores, gpus, constants = 1, 0, None
        for h in hosts:
            m = answers[h].get("machine") if isinstance(answers[h].get("machine"), dict) else {}
            c = m.get("cores")
            if isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= 1 << 16:
                cores = max(cores, c)
            g = (reports[h].doctor or {}).get("gpus")
            gpus = max(gpus, len(g) if isinstance(g, list) else 0)
            if constants is None and isinstance(m.get("constants"), dict):
                try:
                    constants = MachineConstants.from_json(m["constants"])
                except (ValueError, TypeError, KeyError):
                    constants = None   # a host's word is not trusted: uncalibrated, and said so
        if constants is None and boot == here:
            constants = mine   # this very machine (emulated hosts): the controller's calibration is its
        workers = tuple(w for w in topo.workers if placement.assignment[w] in hosts)
        out.append(Machine(tuple(hosts), workers, cores, gpus, constants))
    return out


def _threshold(answers: dict[str, Any]) -> float:
    """A host's delay threshold (shaping.delay_threshold, as the host computed it): a delay at or below
    it gets no delay element there, so a cut link with it is as fast as the underlay."""
    v = answers.get("delay_threshold_s")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 else 0.0


def _probe_asks(placement: Any, hosts: Hosts) -> dict[str, list[str]]:
    """host -> the underlay addresses it measures: one host of each pair a cut link joins."""
    by_name = {h.name: h for h in hosts}
    asks: dict[str, list[str]] = {}
    for pair in sorted({tuple(sorted((c.host_a, c.host_b))) for c in placement.cut_links}):
        asks.setdefault(pair[0], []).append(by_name[pair[1]].underlay)
    return asks


class _PartSession:
    """One host's `testbed part up --check` over one SSH session: the host first prints its answers to
    the checks (one JSON line: uid, version, doctor, the underlay toward its --probe addresses), then
    waits on stdin for the spec (one line: build) or EOF (called off: nothing is built). One session
    and one testbed process per host for the whole `up`: the start-up of each is paid once."""

    def __init__(self, ctl: Any, argv: Sequence[str]):
        self.ctl, self.argv = ctl, list(argv)
        self._pipe = _Pipe()
        self._line: str | None = None        # the answers
        self.built: dict[str, Any] | None = None   # what the host built, as it said once done
        self._told = threading.Event()      # the answers line came, or the session ended without it
        self._finished = threading.Event()  # the build's line came, or the session ended
        self._ended = threading.Event()     # (not Thread.join: see _parallel)
        self.connected = threading.Event()  # the SSH handshake is over (or failed)
        self.result: Any = None             # RemoteResult or the exception run() raised
        self._thread = threading.Thread(target=self._run, name=f"part-{ctl.name}", daemon=True)
        self._thread.start()

    def _heard(self, text: str) -> None:
        if self._line is None:
            self._line = text
            self._told.set()
        elif text.startswith('{"built": true'):
            # built: `up` goes on without waiting for the host's process to exit and its session to close
            try:
                doc = json.loads(text)
            except ValueError:
                return
            self.built = doc if isinstance(doc, dict) else None
            self._finished.set()

    def _run(self) -> None:
        from testbed.cluster.remote import lines

        try:
            try:   # the handshake first (an SshHost), for up() to know when it is over
                if hasattr(self.ctl, "connect"):
                    self.ctl.connect()
            finally:
                self.connected.set()
            self.result = self.ctl.run(self.argv, stdin=self._pipe.reader, timeout=UP_TIMEOUT_S,
                                       on_stdout=lines(self._heard, PART_LINE_MAX))
        except Exception as exc:  # noqa: BLE001 - the host's outcome, judged by up()
            self.result = exc
        finally:
            self.send(None)   # (the session is over: nobody reads the pipe any more)
            self._ended.set()   # (before the others: who wakes on them sees it done)
            self._told.set()
            self._finished.set()

    def answers(self, timeout: float) -> dict[str, Any] | None:
        """The host's answers to the checks, or None: the session ended without them (see result)
        or they took longer than `timeout`."""
        self._told.wait(timeout)
        try:
            doc = json.loads(self._line or "")
        except ValueError:
            return None
        return doc.get("check") if isinstance(doc, dict) and isinstance(doc.get("check"), dict) else None

    def send(self, spec: bytes | None) -> None:
        """The decision: the spec (one line: build it) or None (EOF: build nothing). Once."""
        self._pipe.close(None if spec is None else spec.rstrip(b"\n") + b"\n")

    def wait(self, timeout: float | None = None) -> Any:
        self._ended.wait(timeout)
        return self.result

    @property
    def done(self) -> bool:
        return self._ended.is_set()


def _wait_all(sessions: dict[str, _PartSession]) -> dict[str, Any]:
    """Every host's outcome: what it built (a dict, from its last line) or, when it built nothing,
    the session's result (a failed RemoteResult or an exception). A Ctrl-C waits for every host's
    answer before it is raised (a host's `part up` goes on after the SSH session is gone: only its
    answer says what it built)."""
    interrupted = None
    for s in sessions.values():
        while not s._finished.is_set():
            try:
                s._finished.wait()
            except KeyboardInterrupt as exc:
                interrupted = exc
    if interrupted is not None:
        raise interrupted
    return {n: s.built if s.built is not None else s.result for n, s in sessions.items()}


def _call_off(sessions: dict[str, _PartSession], grace_s: float = 5.0) -> None:
    """Tell every host to build nothing, and wait a while for them to end; a host still busy after
    that (it never answered) has its connection dropped, so its process ends on EOF."""
    for s in sessions.values():
        s.send(None)
    end = time.monotonic() + grace_s
    for s in sessions.values():
        s.wait(max(0.0, end - time.monotonic()))
        if not s.done:
            s.ctl.close()


def _underlay(topo: Topology, placement: Any, hosts: Hosts, asks: dict[str, list[str]], results: dict[str, Any],
              factor: float, thresholds: dict[str, float]) -> dict[frozenset[str], float]:
    """Judge the underlay measurements between the hosts cut links join (results: asking host -> its
    rows, {"peer", "mtu", "rtts_s"} or {"peer", "error"}); refuse what it cannot carry:
    a link MTU the underlay cannot encapsulate, a delay (that gets a delay element) below the
    underlay's own one-way latency. Returns {host pair} -> one-way latency (s)."""
    from testbed.net import tunnels

    pairs: dict[frozenset[str], list[Any]] = {}
    for cut in placement.cut_links:
        pairs.setdefault(frozenset((cut.host_a, cut.host_b)), []).append(cut)
    problems, one_way = [], {}
    for a, res in results.items():
        try:
            rows = {r["peer"]: r for r in res}
        except (TypeError, KeyError):
            problems.append(f"{a}: its underlay measurement was not a list of rows")
            continue
        for b_addr in asks[a]:
            b = next(h.name for h in hosts if h.underlay == b_addr)
            row = rows.get(b_addr) or {}
            if row.get("error") or not row.get("rtts_s"):
                problems.append(f"{a} -> {b} ({b_addr}): {row.get('error', 'no round trips')}")
                continue
            pair = frozenset((a, b))
            one_way[pair] = tunnels.underlay_one_way_s([float(x) for x in row["rtts_s"]])
            try:
                mtu = int(row["mtu"])
            except (KeyError, TypeError, ValueError):
                problems.append(f"{a} -> {b} ({b_addr}): the probe gave no MTU")
                continue
            for cut in pairs[pair]:
                link = topo.links[cut.index]
                why = tunnels.mtu_problem(max(link.ab.mtu, link.ba.mtu), mtu, b_addr)
                if why:
                    problems.append(f"link {cut.a}-{cut.b} ({a} -> {b}): {why}")
                for prof, d in ((link.ab, "A->B"), (link.ba, "B->A")):
                    # the kernel sees the dilated delay; at or below the threshold there is no delay
                    # element on either host (as on a local link: the hop's own latency stands for it)
                    asked = prof.delay_s * factor
                    small = asked <= max(thresholds.get(a, 0.0), thresholds.get(b, 0.0))
                    why = None if small else tunnels.delay_problem(asked, one_way[pair])
                    if why:
                        problems.append(f"link {cut.a}-{cut.b} {d} ({a} <-> {b}): {why}")
    if problems:
        raise ClusterError("the underlay cannot carry the cut links:\n  " + "\n  ".join(problems))
    return one_way


def _judge_hosts(sessions: dict[str, _PartSession], by_name: dict[str, Host]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every host's check report (remote.HostReport) and its answers, from its session. A host whose
    session gave no answers (a testbed without `part up --check`, none installed, ...) is asked the
    separate questions instead, so its report says why as precisely as ever."""
    from testbed.cluster.remote import HostUnreachable, SudoRefused, check_host, report_from_answers

    reports: dict[str, Any] = {}
    answered: dict[str, Any] = {}
    t0 = time.monotonic()
    for n, s in sessions.items():
        answers = s.answers(max(0.0, CHECK_TIMEOUT_S - (time.monotonic() - t0)))
        argv = by_name[n].testbed_argv
        if answers is not None:
            reports[n] = report_from_answers(s.ctl, argv, answers, seconds=time.monotonic() - t0)
            answered[n] = answers
        elif not s.done:
            reports[n] = _problem_report(s.ctl, f"gave no answers to the checks within {CHECK_TIMEOUT_S:g} s")
        elif isinstance(s.result, (HostUnreachable, SudoRefused)):
            reports[n] = _problem_report(s.ctl, str(s.result))
        else:
            reports[n] = check_host(s.ctl, argv, doctor_args=("--for", "", "--cached"))
            if not reports[n].problems:
                reports[n].problems.append(f"`testbed part up --check` failed: {_why(s.result)}")
    return reports, answered


def _filter_problems(answers: dict[str, Any], placement: Any) -> list[str]:
    """Hosts a cut link joins that cannot filter their tunnel ends' underlay (no nft: their
    doctor's underlay_filter), each named with how to install it. A host without answers is
    already named by its check report; one whose doctor predates underlay_filter (the same version
    built earlier) is not judged here: making its tunnel end still refuses without nft."""
    from testbed.net.underlay_filter import INSTALL_HINT

    problems = []
    for h in sorted({h for c in placement.cut_links for h in (c.host_a, c.host_b)}):
        doc = (answers.get(h) or {}).get("doctor")
        if not isinstance(doc, dict) or "underlay_filter" not in doc:
            continue   # (no answers: its report says why; a testbed from before this check: the tunnel end refuses)
        uf = doc.get("underlay_filter")
        if isinstance(uf, dict) and uf.get("ok") is True:
            continue
        said = uf.get("why") if isinstance(uf, dict) and isinstance(uf.get("why"), str) else None
        said = "".join(ch if ch.isprintable() else "?" for ch in said[:300]) if said else \
            "its doctor did not say whether nft works there"   # (a host's words: shown inert)
        problems.append(f"{h}: a cut link joins it, and its tunnel ends take frames from their peer only "
                        f"through nft (the underlay filter): {said}"
                        + ("" if INSTALL_HINT in said else f"; {INSTALL_HINT} on {h}"))
    return problems


def _probe_words(host: Host, hosts: Hosts) -> list[str]:
    """`--probe ADDR` for every other host's underlay: measured by every host before placement
    decides which pairs a cut link joins (a few ms per peer, at once)."""
    return [w for h in hosts if h.name != host.name for w in ("--probe", h.underlay)]


def _problem_report(ctl: Any, why: str) -> Any:
    from testbed.cluster.remote import HostReport

    rep = HostReport(name=ctl.name, address=str(getattr(ctl, "address", ctl.name)))
    rep.problems.append(why)
    return rep


def up(topo: Topology, hosts: Hosts, name: str | None = None, *, pins: dict[str, str] | None = None,
       time_dilation: Any = None, runtime: str | None = None, net_admin: bool = False,
       known_hosts: str | None = None, trust_new: bool = False,
       progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Build testbed `name` over the hosts; all or nothing. Returns the controller's record."""
    from testbed import store
    from testbed.cluster import part as parts_mod
    from testbed import names
    from testbed.cluster.placement import place
    from testbed.topology.plan import plan_network

    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def lap(phase: str, since: float) -> float:
        now = time.monotonic()
        timings[phase] = round(now - since, 3)
        return now

    name = name or topo.name
    if not names.valid_testbed_name(name):
        raise TestbedError(f"invalid testbed name {name!r}: letters, digits, '.', '_', '-' "
                           "(at most 40, starting with a letter or digit)")
    topo.validate()
    if exists(name) or store.exists(name):
        raise StateError(f"a testbed named {name!r} is already up: bring it down first (testbed down {name})")
    from testbed.topology.dilation import choose_over_machines

    setting = time_dilation if time_dilation is not None else (topo.time_dilation or "auto")   # as on one host
    if not (isinstance(setting, str) and setting.strip().lower() in ("auto", "none", "off")):
        try:
            if not float(setting) >= 1:
                raise ValueError
        except (TypeError, ValueError):
            raise TestbedError(f"--time-dilation: a factor >= 1, auto or none (got {setting!r})") from None
    known_hosts = _host_keys_file(name, known_hosts, trust_new)
    ctls = _controls(list(hosts), known_hosts, trust_new)
    by_name = {h.name: h for h in hosts}
    used: list[str] = []
    # every host's session starts now (connect, check, measure the underlay toward every other host)
    # and runs while the nodes are placed; the hosts placement leaves out are then called off
    sessions = {h.name: _PartSession(ctls[h.name], [*h.testbed_argv, "part", "up", "--check", "--count",
                                                    str(PROBE_COUNT), *_probe_words(h, hosts)]) for h in hosts}
    try:
        # placement waits for the SSH handshakes (up to HANDSHAKE_HEAD_START_S): both are this
        # process's CPU, the handshakes are on the critical path (a host starts testbed only after
        # its own) and placement is not (it is done before the hosts have answered)
        end = time.monotonic() + HANDSHAKE_HEAD_START_S
        for session in sessions.values():
            session.connected.wait(max(0.0, end - time.monotonic()))
        placement = place(topo, hosts, pins)
        t = lap("placement", t0)
        used = [h.name for h in hosts if placement.nodes_on(h.name)]
        for n in set(sessions) - set(used):
            sessions.pop(n).send(None)
        plan = plan_network(topo)   # (before the hosts answer: it does not depend on them)
        progress(f"checking {len(used)} host(s): {', '.join(used)}"
                 + ("; measuring the underlay between the hosts cut links join" if placement.cut_links else ""))
        asks = _probe_asks(placement, hosts)
        reports, answers = _judge_hosts(sessions, by_name)
        problems = [f"{r.name}: {p}" for r in reports.values() for p in r.problems]
        problems += _filter_problems(answers, placement)   # (before anything is built or recorded)
        if problems:
            raise ClusterError("hosts not ready:\n  " + "\n  ".join(problems))
        t = lap("check hosts", t)
        try:
            dilation = choose_over_machines(setting, topo, plan, _machines(answers, reports, placement, topo))
        except ValueError as exc:
            raise TestbedError(f"--time-dilation: {exc}") from None
        factor = dilation.factor
        one_way = _underlay(topo, placement, hosts, asks, {n: answers[n].get("probe") for n in asks}, factor,
                            {n: _threshold(a) for n, a in answers.items()})
        parts = parts_mod.make_parts(name, topo, plan, placement.assignment, {h.name: h.underlay for h in hosts},
                                     one_way)
        doc = {"name": name, "status": "building", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "hosts_text": hosts.text,
               "hosts_source": os.path.abspath(hosts.source) if hosts.source else None, "placement": dict(placement.assignment),
               "known_hosts": known_hosts, "time_dilation": factor, "dilation": dilation.to_json(),
               "topology": topo.to_json(), "cut_links": [c.to_json() for c in placement.cut_links],
               "hosts": {n: {"nodes": len(parts[n].nodes), "tunnels": len(parts[n].tunnels)} for n in used},
               "underlay_one_way_s": {"|".join(sorted(p)): v for p, v in one_way.items()}}
        t = lap("underlay", t)
        _save(name, doc)   # before any host builds: `down` and `cleanup` know where to look
        progress(f"building the parts on {len(used)} host(s) at once")
        for n in used:
            spec = {"name": name, "topology": topo.to_json(), "part": parts[n].to_json(),
                    "dilation": dilation.to_json(), "runtime": runtime, "net_admin": net_admin,
                    "workdir": os.getcwd()}   # the directory docker workers mount, as on one host
            sessions[n].send(json.dumps(spec).encode())
        try:
            results = _wait_all(sessions)
        except KeyboardInterrupt:
            progress("interrupted: every host has answered; taking down what was built")
            raise
        t = lap("build parts", t)
        failed = {h: r for h, r in results.items() if not isinstance(r, dict)}
        if failed:
            built = [h for h in used if h not in failed]
            progress(f"rolling back: {', '.join(failed)} failed")
            left = _down_on(ctls, by_name, name, used)
            msg = "\n  ".join(f"{h}: {_why(r)}" for h, r in failed.items())
            tail = "" if not left else "\n  left behind: " + "; ".join(f"{h}: {w}" for h, w in left.items())
            if not left:
                _forget(name)
            else:
                doc["status"] = "failed"   # (taken down already: not again below)
                _save(name, doc)
            raise ClusterError(f"testbed {name} could not be built on every host (the others were taken down"
                               f"{': ' + ', '.join(built) if built else ''}):\n  {msg}{tail}")
        for h, r in results.items():
            doc["hosts"][h].update({k: v for k, v in r.items() if k != "built"})
        doc["status"] = "up"
        doc["seconds"] = round(time.monotonic() - t0, 3)
        doc["timings"] = timings
        _save(name, doc)
        doc["_hosts"] = hosts
        return doc
    except BaseException:
        _call_off(sessions)   # hosts still waiting for the spec build nothing (the others have answered)
        rec = state_path(name)
        status = json.loads(rec.read_text()).get("status") if rec.is_file() else None
        if status == "building":
            # interrupted on the controller (Ctrl-C, after every host answered): take down what was built
            left = _down_on(ctls, by_name, name, used)
            if not left:
                _forget(name)
        elif status is None:
            _forget(name)   # refused before anything was built: only the host keys it learned, if any
        raise
    finally:
        _close(ctls)


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


def run_on_one_host(name: str, argv: Sequence[str], timeout: float | None = 600) -> dict[str, Any]:
    """argv on the first of the testbed's hosts that answers (a read every host answers alike):
    {host: RemoteResult}, or every host's exception if none answers."""
    from testbed.cluster.remote import HostUnreachable

    doc = load(name)
    by_name = {h.name: h for h in doc["_hosts"]}
    tried: dict[str, Any] = {}
    for host in [h for h in doc.get("hosts", {}) if h in by_name]:
        ctls = _controls([by_name[host]], doc.get("known_hosts"), False)
        try:
            return {host: ctls[host].run([*by_name[host].testbed_argv, *argv], timeout=timeout)}
        except HostUnreachable as exc:
            tried[host] = exc
        finally:
            _close(ctls)
    return tried


def run_on_every_host(name: str, argv: Sequence[str], timeout: float | None = 600) -> dict[str, Any]:
    """argv (a testbed command line, without the `testbed`) on every host of the testbed at once:
    host -> RemoteResult or the exception."""
    doc = load(name)
    by_name = {h.name: h for h in doc["_hosts"]}
    names = [h for h in doc.get("hosts", {}) if h in by_name]
    ctls = _controls([by_name[h] for h in names], doc.get("known_hosts"), False)
    try:
        return _parallel(ctls, names, lambda c: c.run([*by_name[c.name].testbed_argv, *argv], timeout=timeout))
    finally:
        _close(ctls)


def stream_on_every_host(name: str, argv: Sequence[str], on_line: Callable[[str, str], None], *,
                         stop: threading.Event | None = None, timeout: float | None = None,
                         progress: Callable[[str], None] = lambda _m: None,
                         on_end: Callable[[str, Any], None] | None = None,
                         lifelines: dict[str, Lifeline] | None = None) -> dict[str, Any]:
    """argv (a testbed command line, without the `testbed`) on every host of the testbed at once, each
    line of its stdout passed on as it comes: on_line(host, line), from the hosts' threads. Until
    every host's command ends, `stop` is set, or a Ctrl-C (then each host's testbed stops as on a
    Ctrl-C there). on_end(host, RemoteResult or exception): as each host's command ends (an
    unreachable host is known at once, not when the others end). Returns host -> the same.
    lifelines: host -> Lifeline, for every host of the testbed: what the caller writes on one
    reaches that host's testbed (cli.common.on_lifeline_input); closing it is a Ctrl-C there."""
    from testbed.cluster.remote import lines

    doc = load(name)
    by_name = {h.name: h for h in doc["_hosts"]}
    names = [h for h in doc.get("hosts", {}) if h in by_name]
    ctls = _controls([by_name[h] for h in names], doc.get("known_hosts"), False)

    def one(c: Any, stdin: Any) -> Any:
        try:
            res = c.run([*LIFELINE_ARGV, *by_name[c.name].testbed_argv, *argv], stdin=stdin, timeout=timeout,
                        on_stdout=lines(lambda line: on_line(c.name, line), DOC_LINE_MAX))
        except Exception as exc:
            if on_end is not None:
                on_end(c.name, exc)
            raise
        if on_end is not None:
            on_end(c.name, res)
        return res

    try:
        return _parallel(ctls, names, one, lifeline=True, progress=progress, stop=stop, pipes=lifelines)
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


def run_on_host(name: str, host: str, argv: Sequence[str], timeout: float | None = 120) -> Any:
    """argv (a plain command line, not a testbed one) on `host` of testbed `name`: RemoteResult."""
    doc = load(name)
    h = next((x for x in doc["_hosts"] if x.name == host), None)
    if h is None:
        raise TestbedError(f"no host {host!r} in testbed {name}")
    ctls = _controls([h], doc.get("known_hosts"), False)
    try:
        return ctls[host].run(list(argv), timeout=timeout)
    finally:
        _close(ctls)


# -- a job across hosts ------------------------------------------------------------------------------------


def run_job(name: str, cmd: Sequence[str], *, workers: Sequence[str] | None = None, nproc_per_node: int = 1,
            port: int | None = None, workdir: str | None = None, env: dict[str, str] | None = None,
            timeout: float | None = None, probe: bool = True, real_clock: bool = False, grace: float = 5.0,
            base_dir: str | Path | None = None, progress: Callable[[str], None] = lambda _m: None,
            on_output: Callable[[str, str], None] | None = None,
            on_started: Callable[[str, str], None] | None = None,
            stop: threading.Event | None = None, real: Sequence[str] | None = None, record_ops: bool = False,
            replay: str | Path | None = None) -> dict[str, Any]:
    """CMD on the selected workers of a testbed over several hosts, as one run.

    Every host that holds some of the workers runs `testbed run --this-host-only` with the whole
    worker list, the same master (the first worker, on its emulated address: the rendezvous crosses
    the emulated network) and the same port, and starts its own workers' ranks with their global
    ranks, the probe and the monitor, as a single-host run does. Their run directories come back
    here and are merged into one (probe files, logs, link counters by node; the summary's ranks
    from every host; monitor.json with every host's queues and delay lines and the CPU samples of the
    most loaded machine; each host's own under parts/HOST/) that
    `testbed report` reads like any run. Returns {"run_dir", "rc", "hosts", "problems"}.

    on_output(host, line): each line the host's ranks print, as it comes (from the hosts' threads).
    on_started(host, remote run directory): once each host's run has started. stop: when set (from
    another thread), every host stops its ranks as on a Ctrl-C; the run directories still come back.

    Phantom ranks: real (the workers that run CMD; every other rank mirrors the lowest real rank):
    every host gets the same list, and the leader's announcements come here from its host's
    stdout and go on to every other host's lifeline (testbed.jobs.relay). record_ops: the host of
    rank 0 records. replay: the trace is checked here and copied to every host, which plays it to
    its own phantoms (each on its own clock, from its start)."""
    import contextlib
    import random
    import re
    import shlex
    import shutil

    from testbed.cluster.remote import lines
    from testbed.jobs import relay, rundir
    from testbed.jobs.relay import PREFIX
    from testbed.topology.model import Topology

    doc = load(name)
    topo = Topology.from_json(doc["topology"])
    chosen = list(workers or topo.workers)
    unknown = [w for w in chosen if w not in topo.workers]
    if unknown:
        raise TestbedError(f"--workers: {unknown[0]!r} is not a worker of testbed {name}")
    port = int(port or random.randint(20000, 29999))
    workdir = workdir or os.getcwd()
    by_name = {h.name: h for h in doc["_hosts"]}
    hosts = [h for h in doc.get("hosts", {}) if any(doc["placement"][w] == h for w in chosen)]
    master_host = doc["placement"][chosen[0]]
    leader_host = None
    if real is not None:
        from testbed.jobs.run import check_real

        real = check_real(real, chosen)
        leader_host = doc["placement"][next(w for w in chosen if w in real)]
    trace = None
    if replay is not None:
        from testbed.jobs.run import load_trace

        trace = load_trace(replay)   # checked here: a bad trace is refused before any host starts
    rd = rundir.create(name, base_dir)
    progress(f"{len(chosen) * nproc_per_node} rank(s) on {len(hosts)} host(s) ({', '.join(hosts)}), master "
             f"{chosen[0]} on {master_host}, port {port}; run directory {rd}")
    ctls = _controls([by_name[h] for h in hosts], doc.get("known_hosts"), False)
    pipes = {h: _Pipe() for h in hosts}
    relays = {h: _Forward(pipes[h]) for h in hosts if real is not None and h != leader_host}
    shipped: dict[str, tuple[str, str]] = {}   # host -> (directory, path) of the trace's copy there

    def start(ctl: Any, stdin: Any) -> Any:
        h = by_name[ctl.name]
        argv = [*h.testbed_argv, "run", "--name", name, "--workers", ",".join(chosen), "--master", chosen[0],
                "--port", str(port), "--nproc-per-node", str(nproc_per_node), "--grace", str(grace),
                "--this-host-only"]
        argv += ["--timeout", str(timeout)] if timeout else []
        argv += ["--no-probe"] if not probe else []
        argv += ["--real-clock"] if real_clock else []
        argv += ["--real", ",".join(real), "--mirror-relay"] if real is not None else []
        if record_ops and real is None:
            argv += ["--record-ops"] if ctl.name == master_host else []
            # the probe's latency burst runs on every rank or none: a recording host skips it, so all do
            argv += ["--env", "TESTBED_LATENCY_BURST=0"]
        if trace is not None:
            shipped[ctl.name] = _ship_trace(ctl, trace)
            argv += ["--replay", shipped[ctl.name][1]]
        for k, v in sorted((env or {}).items()):
            argv += ["--env", f"{k}={v}"]
        argv += ["--", *(cmd if trace is None else [])]
        script = f"cd {shlex.quote(workdir)} && exec {shlex.join([*LIFELINE_ARGV, *argv])}"

        def line(text: str) -> None:
            if text.startswith(PREFIX) and ctl.name == leader_host:   # the leader's announcement
                data = text[len(PREFIX):].encode() + b"\n"
                for fwd in relays.values():
                    fwd.put(data)
                return
            started = _started_line(text)
            if started is not None:
                if on_started is not None:
                    on_started(ctl.name, started)
            elif on_output is not None and not text.startswith('{"run_dir"'):   # (its last line: for us)
                on_output(ctl.name, text)

        try:
            res = ctl.run(["sh", "-c", script], stdin=stdin, timeout=None if timeout is None else timeout + 600,
                          on_stdout=lines(line, len(PREFIX) + relay.LINE_MAX))   # (ranks' lines: cut there)
        except Exception:
            _halt_others(ctl.name, "could not run its ranks")
            raise
        if res.rc not in (0, 130, 143):   # (130, 143: it was stopped, by a Ctrl-C or by halt)
            _halt_others(ctl.name, f"failed (exit status {res.rc})")
        return res

    def _halt_others(host: str, what: str) -> None:
        # as on one host: the other ranks get `grace` seconds after the first failure, then are stopped
        # (not left to notice through the job's broken connections, or to wait forever)
        if not halt.is_set() and len(hosts) > 1:
            progress(f"the run on {host} {what}: stopping the ranks on the other hosts in {grace:g} s")
            timer = threading.Timer(grace, halt.set)
            timer.daemon = True
            timer.start()

    halt = threading.Event()   # set: every host stops its ranks (a failure elsewhere, or the caller's stop)
    if stop is not None:
        threading.Thread(target=lambda: (stop.wait(), halt.set()), name="run-stop", daemon=True).start()


    problems: dict[str, str] = {}
    rcs: dict[str, int] = {}
    try:
        results = _parallel(ctls, hosts, start, lifeline=True, progress=progress, stop=halt, pipes=pipes)
        for h, r in results.items():
            if isinstance(r, Exception):
                problems[h] = f"its ranks could not be run: {r}"
                rcs[h] = 1
                continue
            line = next((ln for ln in reversed(r.stdout.strip().splitlines()) if ln.startswith('{"run_dir"')), "")
            try:
                info = json.loads(line)
                remote_dir = str(info["run_dir"])
                rcs[h] = int(info["rc"])
            except (ValueError, KeyError, TypeError):
                problems[h] = f"its run did not start: {_why(r)}"
                rcs[h] = r.rc or 1
                continue
            part_dir = rd / "parts" / h
            try:
                fetch_run_dir(ctls[h], h, remote_dir, part_dir)
                # (written as every file of the run directory: through no link a local job planted)
                rundir.write_bytes(part_dir / "remote.txt", f"{h}:{remote_dir}\n".encode())
                boot = ctls[h].run(["cat", "/proc/sys/kernel/random/boot_id"], timeout=60)
                bid = boot.stdout.strip()
                rundir.write_bytes(part_dir / "boot_id",
                                   (bid if boot.rc == 0 and re.fullmatch(r"[0-9a-f-]{36}", bid) else h).encode())
            except Exception as exc:  # noqa: BLE001 - reported with the host: the others still merge
                problems[h] = f"its run directory {remote_dir} could not be fetched: {exc}"
                shutil.rmtree(part_dir, ignore_errors=True)
                continue
    finally:
        for fwd in relays.values():
            fwd.close()
        for h, (there, _path) in shipped.items():
            with contextlib.suppress(Exception):   # (a host lost meanwhile keeps the copy in its /tmp)
                ctls[h].run(["rm", "-rf", "--", there], timeout=30)
        _close(ctls)
    _merge_parts(rd, hosts, master_host, doc, problems)
    merged = rundir.read_json(rd / "summary.json")
    if trace is not None and isinstance(merged, dict) and isinstance(merged.get("replay"), dict):
        merged["replay"]["source"] = str(trace.source)   # what was replayed here, not a host's copy
        rundir.write_json(rd / "summary.json", merged)
    # the first failure's status, not that of the hosts stopped because of it (130, 143)
    rc = next((v for v in rcs.values() if v not in (0, 130, 143)), next((v for v in rcs.values() if v), 0))
    rc = rc or (1 if problems else 0)
    return {"run_dir": rd, "rc": rc, "hosts": hosts, "problems": problems}


FETCH_MAX_BYTES = 8 << 30   # a host's run directory: its probe files are at most 512 MiB each
FETCH_FILE_MAX_BYTES = 512 << 20   # one file of it copied into the merged run directory


def fetch_run_dir(ctl: Any, host: str, remote_dir: str, part_dir: Path) -> None:
    """A host's run directory into part_dir (which must not exist), streamed (never whole in memory)
    through the tar gate (testbed.tarstream): files and directories only, no link of the host's
    followed there (no --dereference) or made here, at most FETCH_MAX_BYTES. Unpacked into a hidden
    directory beside part_dir, renamed into place once whole; a refusal leaves nothing. part_dir's
    parent (in the run directory, which a local job can reach) is opened without following a link,
    and everything in it is done relative to that descriptor (testbed.safeio)."""
    import secrets
    import shutil
    import subprocess
    import tempfile

    from testbed import safeio
    from testbed.tarstream import Gate

    what = f"the run directory {remote_dir} of host {host}"
    r, w = os.pipe()
    box: dict[str, Any] = {"broken": False}

    def put(data: bytes) -> None:
        if box["broken"]:
            return   # (the reading side gave up: the rest is dropped, not held)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except OSError:   # (EPIPE: the read end was closed)
            box["broken"] = True

    def send() -> None:
        try:   # `.` named `run`: the one top entry the gate asks for
            box["res"] = ctl.run(["tar", "-C", remote_dir, "-cf", "-", "--transform=s|^\\.|run|S", "."],
                                 on_stdout=put, timeout=600)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the host
            box["err"] = exc
        finally:
            os.close(w)

    try:
        base, rel = safeio.path_beneath_runs(part_dir.parent)
        base.mkdir(parents=True, exist_ok=True)   # (the operator's: trusted; what is below it is not)
        pfd = safeio.open_dir_beneath(base, rel, create=True)
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    tmp, tfd = f".fetch-{secrets.token_hex(6)}", -1
    th = threading.Thread(target=send, name=f"fetch-{host}", daemon=True)
    stream = os.fdopen(r, "rb")
    th.start()
    try:
        gate = Gate(stream, what, max_bytes=FETCH_MAX_BYTES, files_only=True)
        _top, is_dir = gate.first()
        if not is_dir:
            raise TestbedError(f"{what}: not a directory")
        os.mkdir(tmp, 0o700, dir_fd=pfd)
        tfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        with tempfile.TemporaryFile() as err:
            # tar unpacks into the directory made above, named by its descriptor (not a path a job can swap)
            tar = subprocess.Popen(["tar", "-C", f"/proc/self/fd/{tfd}", "-xf", "-", "--no-same-owner"],
                                   stdin=subprocess.PIPE, stderr=err, pass_fds=(tfd,))
            assert tar.stdin is not None
            try:
                fd = tar.stdin.fileno()

                def out(data: bytes) -> None:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                gate.pump(out)
            finally:
                tar.stdin.close()
                rc = tar.wait()
            err.seek(0)
            why = err.read(4096).decode(errors="replace").strip()
        th.join(30)
        res = box.get("res")
        if box.get("err") is not None or res is None or res.rc != 0:
            raise TestbedError(f"{what}: {box.get('err') or (res.stderr.strip()[-300:] if res else 'no answer')}")
        if rc != 0:
            raise TestbedError(f"{what}: unpacking failed: {why or f'tar exit status {rc}'}")
        os.rename("run", part_dir.name, src_dir_fd=tfd, dst_dir_fd=pfd)
    finally:
        box["broken"] = True
        stream.close()   # (a write blocked on the pipe fails now)
        th.join(5)
        if tfd >= 0:
            os.close(tfd)
        shutil.rmtree(tmp, ignore_errors=True, dir_fd=pfd)
        os.close(pfd)


class _Forward:
    """The leader's announcements on their way to one other host's lifeline, in order, from a thread
    of their own: a host that stops reading holds up neither the leader's host nor the others."""

    def __init__(self, pipe: _Pipe):
        import queue

        self._q: Any = queue.SimpleQueue()
        self._pipe = pipe
        threading.Thread(target=self._send, name="relay", daemon=True).start()

    def put(self, data: bytes) -> None:
        self._q.put(data)

    def _send(self) -> None:
        while (data := self._q.get()) is not None:
            if not self._pipe.write(data):
                return

    def close(self) -> None:
        self._q.put(None)


def _ship_trace(ctl: Any, trace: Any) -> tuple[str, str]:
    """A copy of a replayed trace on the host: (the directory made for it, what --replay is given).
    A recorded run travels as a run directory of two files (its operations and its dilation factor,
    which scales the recorded gaps); a Chakra trace as the file itself."""
    import secrets
    import tempfile

    there = f"/tmp/testbed-replay-{secrets.token_hex(6)}"
    if trace.kind == "chakra":
        path = f"{there}/{Path(trace.source).name}"
        ctl.put(Path(trace.source), path)
        return there, path
    ctl.put(Path(trace.source), f"{there}/probe/ops-{trace.rank}.jsonl")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"time_dilation": {"factor": trace.dilation}}, f)
        f.flush()
        ctl.put(Path(f.name), f"{there}/summary.json")
    return there, there


def _merge_monitors(by_host: dict[str, dict[str, Any]], decides: str, cores: Any) -> dict[str, Any]:
    """One monitor.json out of every host's, as the verdict reads it: every host's queues and delay
    lines (each host samples its own nodes and links); the CPU samples and pressure of `decides`,
    a host of the most loaded machine (each host samples its whole machine); `cores` the compute
    devices the run's world had (the merged summary's), the machine's own in cpu_cores."""
    def part(m: dict[str, Any], key: str) -> dict[str, Any]:   # (what a host wrote is not trusted)
        v = m.get(key)
        return v if isinstance(v, dict) else {}

    main = by_host[decides]
    qdiscs: dict[str, Any] = {}
    first: dict[str, Any] = {}
    last: dict[str, Any] = {}
    # a delayed cut link has a line on each of its hosts (without netem): both kept, named by host
    hosts_of: dict[str, int] = {}
    for m in by_host.values():
        for lid in part(part(m, "delay_lines"), "last"):
            hosts_of[lid] = hosts_of.get(lid, 0) + 1
    for h, m in by_host.items():
        qdiscs.update(part(m, "qdiscs"))
        for key, into in (("first", first), ("last", last)):
            for lid, v in part(part(m, "delay_lines"), key).items():
                into[lid if hosts_of.get(lid, 0) < 2 else f"{lid} on {h}"] = v
    times = [m.get(k) for m in by_host.values() for k in ("t0", "t1") if isinstance(m.get(k), (int, float))]
    return {**main, "t0": min(times, default=None), "t1": max(times, default=None),
            "cores": cores if isinstance(cores, int) else main.get("cores"), "cpu_cores": main.get("cores"),
            "qdiscs": qdiscs, "delay_lines": {"first": first, "last": last},
            "cpu_from": decides, "hosts": sorted(by_host)}


def _merge_phantoms(by_host: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One `phantoms` record out of every host's. A rank is phantom if its host says so and real
    otherwise (under torchrun a host knows only its own phantoms). How late the phantoms followed:
    the latest host's median, since every collective waits for its slowest member (over hosts it
    includes the relay through the controller), and each host's under announce_late_by_host."""
    def items(ph: dict[str, Any], key: str) -> list[Any]:   # (what a host wrote is not trusted)
        v = ph.get(key)
        return v if isinstance(v, list) else []

    def number(ph: dict[str, Any], key: str) -> float | None:
        v = ph.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def ints(key: str) -> set[int]:
        return {x for ph in by_host.values() for x in items(ph, key) if isinstance(x, int)}

    phantom = ints("phantom_ranks")
    p50s = {h: number(ph, "announce_late_p50_s") for h, ph in by_host.items()
            if number(ph, "announce_late_p50_s") is not None}
    maxes = [m for ph in by_host.values() if (m := number(ph, "announce_late_max_s")) is not None]
    first = next(iter(by_host.values()))
    return {
        "real_workers": [str(w) for w in items(first, "real_workers")],
        "real_ranks": sorted(ints("real_ranks") - phantom), "phantom_ranks": sorted(phantom),
        "ops_mirrored": [x for ph in by_host.values() for x in items(ph, "ops_mirrored")],
        "errors": [f"{h}: {e}" for h, ph in by_host.items() for e in items(ph, "errors")]
        + [f"{h}: relay: {str(ph['relay_gave_up'])[:300]}" for h, ph in by_host.items() if ph.get("relay_gave_up")],
        "warnings": sorted({str(w) for ph in by_host.values() for w in items(ph, "warnings")})[:20],
        "announce_late_p50_s": max(p50s.values()) if p50s else None,
        "announce_late_max_s": max(maxes) if maxes else None,
        "announce_late_by_host": p50s,
        "relayed_lines": int(sum(number(ph, "relayed_lines") or 0 for ph in by_host.values())),
    }


def _started_line(text: str) -> str | None:
    """The remote run directory from `testbed run --this-host-only`'s first line ({"started": DIR})."""
    if not text.startswith('{"started"'):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return str(doc["started"]) if isinstance(doc, dict) and isinstance(doc.get("started"), str) else None


def _merge_parts(rd: Path, hosts: Sequence[str], master_host: str, doc: dict[str, Any],
                 problems: dict[str, str]) -> None:
    """One run directory out of every host's: what `testbed report` reads."""
    from testbed import safeio
    from testbed.jobs import counters, rundir
    from testbed.topology.model import Topology

    parts = [(h, rd / "parts" / h) for h in hosts if (rd / "parts" / h / "summary.json").is_file()]
    # every write into rd goes through rundir (no link a local job planted there is followed); a
    # name the first host has is its
    for sub in ("probe", "logs"):
        os.close(safeio.open_dir_beneath(*safeio.path_beneath_runs(rd / sub), create=True))
        copied: set[str] = set()
        for _h, p in parts:
            for f in sorted((p / sub).glob("*")):
                if f.name not in copied and f.is_file() and not f.is_symlink():
                    rundir.copy_file(f, rd / sub / f.name, FETCH_FILE_MAX_BYTES)
                    copied.add(f.name)
    summaries = {h: json.loads((p / "summary.json").read_text()) for h, p in parts}
    topo = Topology.from_json(doc["topology"])
    merged_counters = {}
    for which in ("counters-before.json", "counters-after.json"):
        nodes: dict[str, Any] = {}
        t = None
        for _h, p in parts:
            try:
                c = json.loads((p / which).read_text())
            except (OSError, ValueError):
                continue
            nodes.update(c.get("nodes") or {})
            t = c.get("t") if t is None else t
        merged_counters[which] = {"t": t, "nodes": nodes}
        rundir.write_json(rd / which, merged_counters[which])
    for f in ("topology.json",):
        src = rd / "parts" / master_host / f
        if not src.is_file():
            src = next((p / f for _h, p in parts if (p / f).is_file()), None)
        if src is not None and src.is_file():
            rundir.copy_file(src, rd / f)
    events = []
    for _h, p in parts:
        if (p / "testbed-events.jsonl").is_file():
            events += [ln for ln in (p / "testbed-events.jsonl").read_text().splitlines() if ln.strip()]
    if events:
        rundir.write_bytes(rd / "testbed-events.jsonl", ("\n".join(events) + "\n").encode())
    base = dict(summaries.get(master_host) or next(iter(summaries.values()), {}))
    ranks = [dict(r, host=h) for h, sm in summaries.items() for r in sm.get("ranks") or []]
    ranks.sort(key=lambda r: (r.get("rank") is None, r.get("rank") or 0))
    statuses = {h: sm.get("status") for h, sm in summaries.items()}
    # the first failure is what went wrong; hosts stopped because of it come after
    failed = sorted((sm for sm in summaries.values() if sm.get("rc")),
                    key=lambda sm: sm.get("status") in ("interrupted", "stopped"))
    from testbed.jobs import calibration

    machine = calibration.cached()
    base.update({
        "run_dir": str(rd), "ranks": ranks, "hosts": {h: {"status": statuses.get(h), "rc": summaries[h].get("rc"),
                                                          "run_dir": summaries[h].get("run_dir")} for h in statuses},
        "status": "completed" if not failed and not problems else (failed[0].get("status") if failed else "failed"),
        "rc": failed[0].get("rc") if failed else (1 if problems else 0),
        "first_failure": next((sm.get("first_failure") for sm in failed if sm.get("first_failure")), None),
        "started": min((sm.get("started") or 0 for sm in summaries.values()), default=None),
        "ended": max((sm.get("ended") or 0 for sm in summaries.values()), default=None),
        "links": counters.link_bytes(topo, merged_counters["counters-before.json"],
                                     merged_counters["counters-after.json"]),
        "leftover_pids": [p for sm in summaries.values() for p in sm.get("leftover_pids") or []],
        "over_hosts": {"placement": doc["placement"], "monitor_from": master_host, "problems": problems},
        "machine": machine.constants().to_json() if machine is not None else None,
    })
    # ranks per compute device, the verdict's CPU check: hosts with the same boot id are one machine
    # (emulated hosts share this one); the most loaded machine decides
    machines: dict[str, list[str]] = {}
    for h, p in parts:
        bid = (p / "boot_id").read_text().strip() if (p / "boot_id").is_file() else h
        machines.setdefault(bid, []).append(h)
    world = int(base.get("world_size") or len(ranks) or 1)
    load = {}
    for bid, hs in machines.items():
        devices = max(int(summaries[h].get("gpus") or 0) or int(summaries[h].get("cores") or 1) for h in hs)
        load[bid] = sum(len(summaries[h].get("ranks") or []) for h in hs) / max(1, devices)
    if load and max(load.values()) > 0:
        base["cores"] = max(1, round(world / max(load.values())))
        base["gpus"] = 0 if not any(sm.get("gpus") for sm in summaries.values()) else base["cores"]
    base["over_hosts"]["machines"] = list(machines.values())
    monitors = {h: m for h, p in parts if isinstance(m := rundir.read_json(p / "monitor.json"), dict)}
    if monitors:
        busiest = max(load, key=load.get) if load else None
        decides = next((h for h in machines.get(busiest, []) if h in monitors), next(iter(monitors)))
        rundir.write_json(rd / "monitor.json", _merge_monitors(monitors, decides, base.get("cores")))
    phantoms = {h: sm["phantoms"] for h, sm in summaries.items() if isinstance(sm.get("phantoms"), dict)}
    if phantoms:
        base["phantoms"] = _merge_phantoms(phantoms)
        base["real_cpu_cap"] = next((sm["real_cpu_cap"] for sm in summaries.values()
                                     if isinstance(sm.get("real_cpu_cap"), (int, float))), None)
    if base.get("started") and base.get("ended"):
        base["duration_s"] = base["ended"] - base["started"]
    rundir.write_json(rd / "summary.json", base)
