"""`testbed up TOPOLOGY --hosts HOSTS.yaml`: the controller's side of bringing a testbed up over
several hosts (testbed.cluster.controller says what the controller keeps).

One SSH session per host carries it all (`testbed part up --check`, started while the nodes are
placed by testbed.cluster.placement): the host answers the checks (reachable, root, the same
testbed version, `doctor`) and measures the underlay toward the other hosts (MTU, one-way
latency; a cut link the underlay cannot carry is refused before anything is built); the
controller chooses one time dilation for all machines, then sends each host its part
(testbed.cluster.part) and every host builds at once. If any host fails, every host that built
its part takes it down again: all or nothing, as on one host. A Ctrl-C during the build waits for
every host's answer first (a host's `part up` runs on without its SSH session: no terminal hangs
it up), then takes down what was built.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from testbed.errors import StateError, TestbedError

from testbed.cluster.controller import (ClusterError, _close, _controls, _down_on, _forget, _host_keys_file, _Pipe,
                                        _save, _why, exists, state_path)

if TYPE_CHECKING:
    from testbed.cluster.hosts import Host, Hosts
    from testbed.topology.model import Topology

UP_TIMEOUT_S = 1800.0
PROBE_COUNT = 10
CHECK_TIMEOUT_S = 120.0   # how long `up` waits for a host's answers to the checks
HANDSHAKE_HEAD_START_S = 0.5   # placement waits this long at most for the hosts' SSH handshakes
# What of a host's stdout may wait for its newline (remote.lines: a longer line is passed on cut,
# which its JSON reader then refuses); what a host sends is hostile input
PART_LINE_MAX = 4 << 20   # `part up --check`: its answers, then what it built (k=32 fat-tree on one host: 160 kB)

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
    """Every host's check report (host_checks.HostReport) and its answers, from its session. A host whose
    session gave no answers (a testbed without `part up --check`, none installed, ...) is asked the
    separate questions instead, so its report says why as precisely as ever."""
    from testbed.cluster.host_checks import check_host, report_from_answers
    from testbed.cluster.remote import HostUnreachable, SudoRefused

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
    from testbed.cluster.host_checks import HostReport

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
