"""The Python stack of every rank of a running job, read from outside with py-spy.

A distributed job that stalls is debugged by asking where each rank is: "15
ranks wait in all_reduce, rank 7 is in the data loader". py-spy reads a
process's interpreter state from outside (root, by host PID), so ranks in
namespaces or containers need nothing installed and are not stopped for long.
Ranks are the Python processes that carry the testbed's name and a RANK in
their environment (a torchrun agent has none; the nsenter and shell wrappers
are not Python). Identical main-thread stacks are grouped; the collective a
rank waits in is named from its stack (the outermost torch.distributed call).

Used by `testbed stacks` and, when a run or a scenario declares a job hung or
timed out, saved to the run directory (stacks.txt, stacks.json). Over several
hosts each host takes its own ranks' stacks and the controller merges them
(merge_hosts): identical stacks are grouped across hosts, with a count per host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from testbed import procs

DUMP_TIMEOUT_S = 20


@dataclass
class RankStack:
    pid: int
    rank: int | None
    worker: str | None
    phantom: bool
    frames: list[tuple[str, str, int]] = field(default_factory=list)   # (function, file, line), innermost first
    threads: int = 0
    error: str | None = None
    host: str | None = None   # the host it runs on (a testbed over several hosts; its pid is that host's)

    @property
    def collective(self) -> str | None:
        """The torch.distributed call this rank is in (outermost), or None."""
        found = None
        for name, filename, _line in self.frames:
            if "torch/distributed/" in filename.replace(os.sep, "/") and not name.startswith("_") \
                    and name not in ("wrapper", "inner"):
                found = name
        return found


def py_spy() -> str | None:
    """py-spy beside our interpreter (the venv's), or on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def _env(pid: int) -> dict[str, str]:
    out = {}
    for item in procs.environ(pid) or []:
        k, _, v = item.partition(b"=")
        out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def rank_pids(name: str, run_id: str | None = None) -> list[tuple[int, dict[str, str]]]:
    """(pid, environment) of every rank process of testbed `name` (of one run, with run_id)."""
    found = []
    for pid in procs.pids_with_env("TESTBED_NAME", name, include_self=False):
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if not exe.startswith("python"):
            continue   # nsenter, sh, env: the wrappers a rank is started through
        env = _env(pid)
        if "RANK" not in env or (run_id is not None and env.get("TESTBED_RUN_ID") != run_id):
            continue
        found.append((pid, env))
    return found


def _dump(tool: str, pid: int, env: dict[str, str]) -> RankStack:
    rank = int(env["RANK"]) if env.get("RANK", "").isdigit() else None
    rs = RankStack(pid, rank, env.get("TESTBED_WORKER"), bool(env.get("TESTBED_PHANTOM_IN")))
    try:
        out = subprocess.run([tool, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True,
                             timeout=DUMP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        rs.error = f"py-spy did not answer within {DUMP_TIMEOUT_S}s"
        return rs
    if out.returncode != 0:
        rs.error = (out.stderr.strip().splitlines() or [f"py-spy exited with {out.returncode}"])[-1]
        return rs
    try:
        threads = json.loads(out.stdout)
    except ValueError:
        rs.error = "py-spy printed no JSON"
        return rs
    if not isinstance(threads, list):
        rs.error = "py-spy printed no thread list"
        return rs
    threads = [t for t in threads if isinstance(t, dict)]
    rs.threads = len(threads)
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), threads[0] if threads else None)
    for f in (main or {}).get("frames") or []:
        if isinstance(f, dict):
            rs.frames.append((str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0)))
    return rs


def take(name: str, run_id: str | None = None) -> list[RankStack]:
    """Every rank's main-thread stack, in rank order (all dumped at once: a stall does not wait)."""
    tool = py_spy()
    if tool is None:
        from testbed.errors import CapabilityError

        raise CapabilityError("py-spy is not installed: pip install py-spy (it is in testbed's dependencies)")
    targets = rank_pids(name, run_id)
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        stacks = list(pool.map(lambda t: _dump(tool, *t), targets))
    return sorted(stacks, key=lambda s: (s.rank is None, s.rank if s.rank is not None else 0, s.pid))


def _ranges(ranks: list[int]) -> str:
    out, i = [], 0
    ranks = sorted(ranks)
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def groups(stacks: list[RankStack]) -> list[list[RankStack]]:
    """Ranks with identical main-thread stacks together, the biggest group first."""
    by: dict[Any, list[RankStack]] = {}
    for s in stacks:
        by.setdefault((tuple(s.frames), s.error), []).append(s)
    return sorted(by.values(), key=lambda g: (-len(g), g[0].rank if g[0].rank is not None else 1 << 30))


def render(stacks: list[RankStack], depth: int = 12) -> str:
    """Groups as text: who, where (the collective), the innermost frames."""
    if not stacks:
        return "no rank process is running"
    lines = []
    for g in groups(stacks):
        ranks = [s.rank for s in g if s.rank is not None]
        who = f"{len(g)} rank{'s' if len(g) > 1 else ''}" + (f" ({_ranges(ranks)})" if ranks else "")
        kinds = {s.phantom for s in g}
        if kinds == {True}:
            who += ", phantom"
        elif kinds == {True, False}:
            who += ", real and phantom"
        hosts: dict[str, int] = {}
        for s in g:
            if s.host is not None:
                hosts[s.host] = hosts.get(s.host, 0) + 1
        if hosts:
            who += " [" + ", ".join(f"{h}: {n}" for h, n in sorted(hosts.items())) + "]"
        head = g[0]
        if head.error:
            lines.append(f"{who}: no stack ({head.error})")
            continue
        where = f" in {head.collective}" if head.collective else ""
        lines.append(f"{who}{where}:")
        for fn, filename, line in head.frames[:depth]:
            lines.append(f"    {fn} ({_short(filename)}:{line})")
        if len(head.frames) > depth:
            lines.append(f"    ... {len(head.frames) - depth} outer frame(s)")
    return "\n".join(lines)


def _short(filename: str) -> str:
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return "/".join(parts[-2:]) if len(parts) > 2 else filename


def to_json(stacks: list[RankStack]) -> list[dict[str, Any]]:
    return [{"pid": s.pid, "rank": s.rank, "worker": s.worker, "phantom": s.phantom, "collective": s.collective,
             "threads": s.threads, "error": s.error,
             "frames": [{"function": f, "file": p, "line": n} for f, p, n in s.frames],
             **({"host": s.host} if s.host is not None else {})} for s in stacks]


def from_json(doc: Any, host: str | None = None) -> list[RankStack]:
    """to_json's list read back (a host's `testbed stacks --json`), each rank on `host`. ValueError
    when it is not such a list."""
    if not isinstance(doc, list):
        raise ValueError("not a list of ranks")
    out = []
    for d in doc:
        if not isinstance(d, dict) or not isinstance(d.get("pid"), int):
            raise ValueError("not a list of ranks")
        rank = d.get("rank")
        out.append(RankStack(d["pid"], rank if isinstance(rank, int) else None, d.get("worker"),
                             bool(d.get("phantom")),
                             [(str(f.get("function")), str(f.get("file")), int(f.get("line") or 0))
                              for f in d.get("frames") or [] if isinstance(f, dict)],
                             int(d.get("threads") or 0), d.get("error"), host))
    return out


def merge_hosts(by_host: dict[str, list[RankStack]], placement: dict[str, str]) -> list[RankStack]:
    """Every host's ranks as one list in rank order, each with its host. A rank whose worker the
    placement puts on another host is that host's to report, not this one's (hosts that share a PID
    namespace, as emulated ones do, see each other's ranks)."""
    out = []
    for host, stacks in by_host.items():
        for s in stacks:
            if s.worker is not None and placement.get(s.worker, host) != host:
                continue
            out.append(replace(s, host=host))
    return sorted(out, key=lambda s: (s.rank is None, s.rank if s.rank is not None else 0, s.host or "", s.pid))


def save(run_dir: Path, name: str, run_id: str) -> Path | None:
    """Take the run's stacks and write stacks.txt and stacks.json into its directory; None when
    there was nothing to take (or py-spy is missing: then stacks.txt says so). Through no link a job
    planted there (rundir.write_bytes)."""
    from testbed.jobs import rundir

    try:
        stacks = take(name, run_id)
    except Exception as exc:   # the run is being stopped: a missing dump must not stop that
        rundir.write_bytes(run_dir / "stacks.txt", f"stacks not taken: {exc}\n".encode())
        return None
    if not stacks:
        return None
    rundir.write_bytes(run_dir / "stacks.txt", (render(stacks, depth=40) + "\n").encode())
    rundir.write_json(run_dir / "stacks.json", to_json(stacks))
    return run_dir / "stacks.txt"
