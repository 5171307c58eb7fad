"""Phantom ranks in a run (testbed run --real, --replay): which ranks become phantoms and how they are
fed (FIFOs, a recorded trace), the real ranks' CPU cap, what the phantoms report, and the
console's line saying which ranks were real."""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from testbed.errors import RunError, TestbedError
from testbed.jobs import relay, rundir
from testbed.jobs.ranks import Rank
from testbed.jobs.target import Cluster
from testbed.jobs.torchrun import torchrun_module_argv


def check_real(real: Sequence[str], chosen: Sequence[str]) -> list[str]:
    """--real against the run's workers: every one of them among them, and at least one phantom left."""
    real = list(real)
    unknown = [w for w in real if w not in chosen]
    if unknown:
        raise RunError(f"--real {', '.join(unknown)}: not among the run's workers ({', '.join(chosen)})")
    if not real or len(set(real)) == len(chosen):
        raise RunError("--real needs at least one real worker and one phantom among the run's workers")
    return real


def make_phantoms(ranks: list[Rank], real: set[str], chan: Path, runtime: str,
                   leader_rank: int | None = None, leader_here: bool = True,
                   relay_out: bool = False) -> tuple[list[str], list[str]]:
    """Turn the ranks of workers not in `real` into phantoms: same environment, the phantom module
    as the command, and a FIFO each on which the lowest real rank announces its operations (with
    no real rank, a replay: the launcher feeds them; leader_rank is the recorded rank). Returns
    the phantoms' FIFOs and the checking ranks'. Every other real rank gets one too
    (TESTBED_PHANTOM_CHECK): it compares each of its operations with the leader's, so
    rank-dependent control flow stops the run with both operations named instead of hanging the
    phantoms.

    Over several hosts (testbed.jobs.relay): leader_here False: the leader (rank leader_rank) is on
    another host, every real rank here checks and the FIFOs are fed by the relay; relay_out: the
    leader is here and announces on one more FIFO too, relay.FIFO_NAME, for the other hosts.

    Under torchrun a worker's Rank is its agent, and which global ranks it gets is the rendezvous'
    choice: FIFOs are named by worker and local rank, the phantom agent runs the phantom module
    with the job's torchrun options, and the real agent's local rank 0 leads."""
    chan.mkdir(mode=0o755)
    reals = [r for r in ranks if r.worker in real]
    leader = reals[0] if reals and leader_here else None
    leader_rank = leader.rank if leader is not None else int(leader_rank or 0)
    fifos = []
    pkg_root = str(Path(__file__).resolve().parents[2])
    python = sys.executable
    if runtime == "docker":
        from testbed.runtime.docker import PKG_TARGET

        pkg_root, python = PKG_TARGET, "python3"
    for r in ranks:
        if r.worker in real:
            continue
        r.phantom = True
        env = {k: v for k, v in r.env.items() if k not in ("TESTBED_PROBE_DIR", "PYTHONPATH")}
        if r.local_rank is None:   # a torchrun agent: one FIFO per local rank
            nproc = int(r.env.get("LOCAL_WORLD_SIZE", "1"))
            names = [f"{r.worker}-{lr}" for lr in range(nproc)]
            r.label = f"{r.worker}:torchrun-phantoms"
            r.argv = torchrun_module_argv(r.argv, "testbed.jobs.phantom")
            stem = f"{r.worker}-{{LOCAL_RANK}}"
        else:
            names = [f"rank-{r.rank}"]
            r.label = f"{r.worker}:p{r.rank}"
            r.argv = [python, "-m", "testbed.jobs.phantom"]
            stem = names[0]
        for n in names:
            os.mkfifo(chan / f"{n}.fifo", 0o600)
            fifos.append(str(chan / f"{n}.fifo"))
        r.env = {**env, "PYTHONPATH": pkg_root, "TESTBED_PHANTOM_IN": str(chan / f"{stem}.fifo"),
                 "TESTBED_PHANTOM_STATS": str(chan / f"stats-{stem}.json")}
        if leader_rank is not None:
            r.env["TESTBED_PHANTOM_LEADER"] = str(leader_rank)
    checks = []
    for r in reals[1:] if leader is not None else reals:   # the others: each compares its operations with the leader's
        stem = f"check-{r.worker}-{{LOCAL_RANK}}" if r.local_rank is None else f"check-rank-{r.rank}"
        nproc = int(r.env.get("LOCAL_WORLD_SIZE", "1")) if r.local_rank is None else 1
        for lr in range(nproc):
            path = chan / (stem.replace("{LOCAL_RANK}", str(lr)) + ".fifo")
            os.mkfifo(path, 0o600)
            checks.append(str(path))
        r.env["TESTBED_PHANTOM_CHECK"] = str(chan / f"{stem}.fifo")
        r.env["TESTBED_PHANTOM_LEADER"] = str(leader_rank)
    if leader is not None:
        out = fifos + checks
        if relay_out:
            os.mkfifo(chan / relay.FIFO_NAME, 0o600)
            out.append(str(chan / relay.FIFO_NAME))
        leader.env["TESTBED_PHANTOM_OUT"] = os.pathsep.join(out)
        if leader.local_rank is None:
            leader.env["TESTBED_PHANTOM_LEADER_LOCAL_RANK"] = "0"   # its other local ranks do not announce
    return fifos, checks


def real_and_phantom_ranks(ranks: list[Rank], world: int, stats: dict[str, Any] | None) -> dict[str, list[int]]:
    """Which global ranks were real and which phantom. Under torchrun the rendezvous chose: the
    phantoms say theirs in their stats, the rest were real."""
    if all(r.rank is not None for r in ranks):
        return {"real_ranks": [r.rank for r in ranks if not r.phantom],
                "phantom_ranks": [r.rank for r in ranks if r.phantom]}
    phantom = sorted({int(x) for x in (stats or {}).get("ranks") or [] if isinstance(x, int) and 0 <= x < world})
    return {"real_ranks": [x for x in range(world) if x not in phantom], "phantom_ranks": phantom}


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as ranges, sorted, each once: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs: list[list[int]] = []   # [first, last] of each run of consecutive ranks
    for x in sorted(set(ranks)):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def ranks_line(summary: Mapping[str, Any]) -> str | None:
    """What the console says of a run with phantoms (its summary.json, one host's or the
    controller's merge): which ranks were real, on which workers, and which phantoms, e.g.
    "ranks: 1 real (0 on w0), 63 phantoms (1-63)". None for a run without phantoms. Under torchrun
    the ranks do not say their global rank (the rendezvous chose): the real ones are then said to
    be on the real workers, all together."""
    ph = summary.get("phantoms")
    if not isinstance(ph, dict):
        return None

    def ints(v: Any) -> list[int]:
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)] if isinstance(v, list) else []

    real, phantoms = ints(ph.get("real_ranks")), ints(ph.get("phantom_ranks"))
    if not phantoms:
        return None
    where: dict[str, list[int]] = {}   # worker -> its real ranks, in rank order
    for r in summary.get("ranks") or []:
        if isinstance(r, dict) and r.get("rank") in real and not r.get("phantom"):
            where.setdefault(str(r.get("worker")), []).append(r["rank"])
    said = ""
    if real and sorted(x for v in where.values() for x in v) == sorted(set(real)):
        said = ", ".join(f"{rank_ranges(v)} on {w}" for w, v in sorted(where.items(), key=lambda kv: min(kv[1])))
    elif real:
        rw = ph.get("real_workers")
        workers = [str(w) for w in rw] if isinstance(rw, list) else []
        said = rank_ranges(real) + (f" on {','.join(workers)}" if workers else "")
    head = f"{len(set(real))} real ({said})" if real else "none real (a replay)"
    n = len(set(phantoms))
    return f"ranks: {head}, {n} phantom{'' if n == 1 else 's'} ({rank_ranges(phantoms)})"


@dataclass
class Trace:
    """A recorded sequence of operations (what the mirror announced), for --replay."""
    source: Path
    lines: list[bytes]
    times: list[float]     # each line's recorded wall time
    world: int
    rank: int
    dilation: float        # of the recorded run (1 when unknown)
    kind: str = "testbed"  # or "chakra": an MLCommons Chakra execution trace (testbed.jobs.chakra)
    skipped: dict[str, int] = field(default_factory=dict)   # what the trace holds that cannot be replayed


TRACE_MAX_BYTES = 256 << 20


def load_trace(path: str | os.PathLike) -> Trace:
    """A trace from a run directory (its probe/ops-N.jsonl) or the file itself, checked line by
    line: JSON objects with the fields the phantoms read, an init first, at most 256 MiB."""
    p = Path(path)
    run_dir = None
    from testbed.jobs import chakra

    if p.exists() and chakra.is_chakra(p):
        try:
            c = chakra.convert(p)
        except chakra.ChakraError as exc:
            raise RunError(str(exc)) from None
        return Trace(c.source, c.lines, c.times, c.world, 0, 1.0, "chakra", c.skipped)
    if p.is_dir():
        run_dir = p
        found = sorted((p / "probe").glob("ops-*.jsonl")) if (p / "probe").is_dir() else []
        if not found:
            raise RunError(f"{p}: no recorded operations (probe/ops-N.jsonl): record a run with "
                           "`testbed run --record-ops -- ...` (or --real) first")
        p = found[0]
    if not p.is_file() or p.is_symlink() or p.stat().st_size > TRACE_MAX_BYTES:
        raise RunError(f"{p}: not a plain trace file of at most {TRACE_MAX_BYTES >> 20} MiB")
    lines, times = [], []
    world = rank = None
    for i, raw in enumerate(p.read_bytes().splitlines(), 1):
        try:
            obj = json.loads(raw)
        except ValueError:
            raise RunError(f"{p}:{i}: not JSON") from None
        if not isinstance(obj, dict) or obj.get("ev") not in ("init", "op", "new_group", "end"):
            raise RunError(f"{p}:{i}: not an operation record (ev init, op, new_group or end)")
        t = obj.get("t")
        if obj["ev"] != "new_group" and not isinstance(t, (int, float)):
            raise RunError(f"{p}:{i}: field t: not a time ({t!r})")
        if obj["ev"] == "init":
            world, rank = obj.get("world"), obj.get("rank", 0)
        elif world is None:
            raise RunError(f"{p}:{i}: an operation before the init record")
        if obj["ev"] == "end":
            break
        lines.append(raw)
        times.append(float(t) if isinstance(t, (int, float)) else (times[-1] if times else 0.0))
    if not isinstance(world, int) or world < 2 or not isinstance(rank, int) or not 0 <= rank < world:
        raise RunError(f"{p}: the init record names no world size and rank (world {world!r}, rank {rank!r})")
    s = 1.0
    if run_dir is not None:
        summary = rundir.read_json(run_dir / "summary.json") or {}
        f = (summary.get("time_dilation") or {}).get("factor") if isinstance(summary, dict) else None
        s = float(f) if isinstance(f, (int, float)) and f >= 1 else 1.0
    return Trace(p, lines, times, world, rank, s)


def feed_trace(trace: Trace, fifos: Sequence[str], s_now: float, stop: threading.Event) -> None:
    """Play the trace to every phantom: each line at its recorded offset, in emulated time (the
    recorded gap / its run's factor x this run's factor), with its time field set to when it is
    sent (the phantoms' lateness is measured against it); then the end."""
    fds = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in fifos]
    try:
        scale = s_now / trace.dilation
        t0, first = time.monotonic(), trace.times[0] if trace.times else 0.0
        for raw, t in zip(trace.lines + [b'{"ev":"end"}'], trace.times + [trace.times[-1] if trace.times else 0.0]):
            wait = t0 + (t - first) * scale - time.monotonic()
            if wait > 0 and stop.wait(wait):
                return
            obj = json.loads(raw)
            obj["t"] = time.time()
            line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
            for fd in fds:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
            if stop.is_set():
                return
        # Held open until the run ends: a FIFO's buffered lines are freed with its last open end, so
        # a short trace played before a phantom opened its FIFO (Python and torch take seconds to
        # start) would otherwise never reach it.
        stop.wait()
    except OSError:
        return   # the run is ending: the phantoms' FIFOs went with it
    finally:
        for fd in fds:
            os.close(fd)


def cap_real_workers(cluster: Cluster, real: Sequence[str], nproc: int, capped: list[str],
                      echo: Callable[[str], None] | None) -> float | None:
    """Slow the real ranks' compute by the dilation factor, as sharing the cores with the other ranks
    would have: with phantoms (which compute nothing) a real rank would otherwise get a whole core
    and compute s times faster than its emulated server. The same cgroup quota as `testbed node
    slow`, for the run only; workers already slowed keep their limit. Appends what it capped."""
    from testbed import node_cpus
    from testbed.lifecycle import cores

    cpus = nproc / float(cluster.time_dilation or 1.0)
    if cpus >= cores() or cluster.dilation.get("cap_cpu"):   # capped at `up` already (1/s, or auto's share)
        return None
    mine = [w for w in real if w not in _user_slowed(cluster)]
    try:
        node_cpus.nodes_slow(cluster.name, mine, cpus)
    except TestbedError as exc:
        if echo is not None:
            echo(f"[testbed] could not limit {', '.join(mine)} to {cpus:g} CPUs ({exc}): their ranks compute "
                 "faster than under dilation")
        return None
    capped.extend(mine)
    return cpus


def _user_slowed(cluster: Cluster) -> set[str]:
    """Workers under the user's own `node slow`: theirs to undo, the run leaves them alone."""
    from testbed import store

    nodes = (store.load(cluster.name).get("faults") or {}).get("nodes") or {}
    return {w for w, f in nodes.items() if "cpus" in (f or {})}


def uncap(cluster: Cluster, capped: list[str], echo: Callable[[str], None] | None) -> None:
    from testbed import node_cpus

    if not capped:
        return
    try:
        node_cpus.nodes_restore(cluster.name, capped)
    except TestbedError as exc:
        if echo is not None:
            echo(f"[testbed] {', '.join(capped)} keep the run's CPU limit ({exc}): testbed node restore NODE")


def read_phantom_stats(chan: Path) -> dict[str, Any]:
    """What the phantoms wrote at their end: operations mirrored, how late they read announcements."""
    rows = []
    for f in sorted(chan.glob("stats-*.json")) if chan.is_dir() else []:
        try:
            if f.is_file() and not f.is_symlink() and f.stat().st_size < 65536:
                rows.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    rows = [r for r in rows if isinstance(r, dict)]
    late = [r["announce_late_s"] for r in rows if isinstance(r.get("announce_late_s"), dict)
            and isinstance(r["announce_late_s"].get("p50"), (int, float))]
    warnings = sorted({str(w) for r in rows if isinstance(r.get("warnings"), list) for w in r["warnings"]})
    return {"ranks": [r.get("rank") for r in rows],
            "ops_mirrored": [r.get("ops") for r in rows], "errors": [r["error"] for r in rows if r.get("error")],
            "warnings": warnings[:20],
            # the median: the first announcements wait for the phantoms' own start (torch's import)
            "announce_late_p50_s": statistics.median(x["p50"] for x in late) if late else None,
            "announce_late_max_s": max((x["max"] for x in late), default=None)}
