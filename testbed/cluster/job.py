"""A job across the hosts of a testbed (`testbed run` there): every host runs its workers' ranks
(`testbed run --this-host-only`, the same master and port), their lines come back as they come,
and their run directories come back here, merged into one run that is reported and judged as one.

A Ctrl-C here is passed on through each host's lifeline (its stdin: its end is a Ctrl-C to the
host's testbed, testbed.cli.common), so the ranks stop everywhere and the run directories still
come back.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from testbed.errors import TestbedError

from testbed.cluster.controller import LIFELINE_ARGV, _close, _controls, _parallel, _Pipe, _why, load

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
        from testbed.jobs.phantom_ranks import check_real

        real = check_real(real, chosen)
        leader_host = doc["placement"][next(w for w in chosen if w in real)]
    trace = None
    if replay is not None:
        from testbed.jobs.phantom_ranks import load_trace

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
