"""The run a testbed is running now, as `testbed top` shows it: the newest run directory of the
testbed in ./runs (or --runs) whose summary says "running", else the testbed's exchange folder;
its ranks' probe files read as they grow (bounded reads, no link followed), their steps and ends."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import paths, safeio

PROBE_TAIL_BYTES = 1 << 20     # a probe file already long when top starts: read only its end
PROBE_READ_BYTES = 4 << 20     # new probe data read per refresh and file, at most
PROBE_LINE_MAX_BYTES = 1 << 20
RUN_DIR_RE = re.compile(r"^\d{8}-\d{6}-(?P<rest>.+)$")


@dataclass
class _RankFile:
    offset: int = -1
    buf: bytes = b""
    steps: list[tuple[float, int | None, float | None]] = field(default_factory=list)   # last two (t, n, dur)
    ended: bool = False


class RunWatch:
    """The run active on a testbed and its ranks' last steps, read incrementally from the probe."""

    def __init__(self, name: str, runs_dir: str | os.PathLike[str] | None = None, dilation: float = 1.0):
        self.name = name
        if runs_dir is None:
            try:
                runs_dir = Path.cwd() / "runs"
            except OSError:   # the working directory was removed
                runs_dir = None
        self.runs_dir = Path(runs_dir) if runs_dir is not None else None
        self.dilation = dilation
        self.run: dict[str, Any] | None = None
        self.probe: tuple[Path, str] | None = None
        self.files: dict[str, _RankFile] = {}   # by file name in the probe directory

    def _mine(self, d: Path) -> bool:
        m = RUN_DIR_RE.match(d.name)
        if not m:
            return False
        rest = m["rest"]
        return rest == self.name or (rest.startswith(self.name + ".") and rest[len(self.name) + 1:].isdigit())

    def find(self) -> tuple[dict[str, Any], tuple[Path, str]] | None:
        """(run description, its probe directory as (trusted base, the rest)) of the active run, or
        None. What lies below the base a job can reach: it is opened without following a link
        (safeio.open_dir_beneath), so a run directory or probe a job linked elsewhere is passed over."""
        from testbed.jobs import rundir

        try:
            dirs = sorted((d for d in self.runs_dir.iterdir() if self._mine(d) and not d.is_symlink()),
                          key=lambda d: d.name, reverse=True) if self.runs_dir is not None else []
        except OSError:
            dirs = []
        state = paths.directory(self.name)
        for d in dirs[:20]:
            summary = rundir.read_json(d / "summary.json")
            if not isinstance(summary, dict) or summary.get("status") != "running" \
                    or summary.get("testbed") != self.name:
                continue
            rid = summary.get("run_id")
            if (d / "probe").is_symlink():
                # the live view `testbed run` made points into the exchange folder: read that folder
                # by the run's id, never where a link in the job's reach points
                if not isinstance(rid, str) or "/" in rid or rid in ("", ".", ".."):
                    continue
                probe = (state, f"runs/{rid}/probe")
            else:
                probe = (self.runs_dir, f"{d.name}/probe")
            if _mtime(*probe) is None:   # the launcher was killed and its exchange dir is gone: not active
                continue
            factor = (summary.get("time_dilation") or {}).get("factor") if isinstance(
                summary.get("time_dilation"), dict) else None
            return ({"run_id": rid, "dir": str(d), "status": "running",
                     "world_size": summary.get("world_size"), "factor": float(factor or self.dilation)}, probe)
        try:
            probes = [(m, p.name) for p in (state / "runs").iterdir()
                      if (m := _mtime(state, f"runs/{p.name}/probe")) is not None]
        except OSError:
            probes = []
        if probes:
            rid = max(probes)[1]
            return ({"run_id": rid, "dir": None, "status": "unknown", "world_size": None,
                     "factor": self.dilation}, (state, f"runs/{rid}/probe"))
        return None

    def _read(self, dfd: int, name: str, rf: _RankFile) -> None:
        from testbed.jobs import rundir

        try:   # written by ranks: no link followed, no FIFO waited on (checked on the open file), bounded
            fd = rundir.open_in(dfd, name)
        except (OSError, safeio.Unsafe):
            return
        try:
            if rf.offset < 0:   # first look: only the end of a long file
                rf.offset = max(0, os.fstat(fd).st_size - PROBE_TAIL_BYTES)
                skip_partial = rf.offset > 0
            else:
                skip_partial = False
            data = safeio.read_fd_regular(fd, PROBE_READ_BYTES, rf.offset, where=name)
        except (OSError, safeio.Unsafe):
            return
        finally:
            os.close(fd)
        rf.offset += len(data)
        data = rf.buf + data
        lines = data.split(b"\n")
        rf.buf = lines.pop()   # the last, unfinished line waits for the rest
        if len(rf.buf) > PROBE_LINE_MAX_BYTES:
            rf.buf = b""
        if skip_partial and lines:
            lines.pop(0)
        for line in lines:
            if len(line) > PROBE_LINE_MAX_BYTES:
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(rec, dict):
                continue
            ev = rec.get("ev")
            if ev == "step" and isinstance(rec.get("t"), (int, float)):
                n, dur = rec.get("n"), rec.get("dur")
                rf.steps = (rf.steps + [(float(rec["t"]), n if isinstance(n, int) else None,
                                         float(dur) if isinstance(dur, (int, float)) else None)])[-2:]
            elif ev == "end":
                rf.ended = True

    def poll(self, now: float | None = None) -> dict[str, Any] | None:
        """The run document (see the module text), or None when no run is active."""
        found = self.find()
        if found is None:
            self.run, self.probe, self.files = None, None, {}
            return None
        run, probe = found
        if self.run is None or run["run_id"] != self.run["run_id"] or probe != self.probe:
            self.files = {}
        self.run, self.probe = run, probe
        try:
            dfd = safeio.open_dir_beneath(*probe)
        except (OSError, safeio.Unsafe):   # gone (the run ended) or replaced by a link since find
            return self.document(now)
        try:
            for name in sorted(os.listdir(dfd)):
                if name.startswith("rank-") and name.endswith(".jsonl"):
                    self._read(dfd, name, self.files.setdefault(name, _RankFile()))
        except OSError:
            pass
        finally:
            os.close(dfd)
        return self.document(now)

    def document(self, now: float | None = None) -> dict[str, Any] | None:
        if self.run is None:
            return None
        s = self.run["factor"] or 1.0
        last_n, last_dt, last_t = [], [], []
        for rf in self.files.values():
            if not rf.steps:
                continue
            t, n, dur = rf.steps[-1]
            last_t.append(t)
            if n is not None:
                last_n.append(n)
            if len(rf.steps) == 2:
                last_dt.append((t - rf.steps[0][0]) / s)
            elif dur is not None:
                last_dt.append(dur / s)
        now = time.time() if now is None else now
        return {"run_id": self.run["run_id"], "dir": self.run["dir"], "status": self.run["status"],
                "world_size": self.run["world_size"], "ranks": len(self.files),
                "ranks_ended": sum(rf.ended for rf in self.files.values()),
                "step": max(last_n) if last_n else None, "step_min": min(last_n) if last_n else None,
                "last_step_s": statistics.median(last_dt) if last_dt else None,
                "last_step_max_s": max(last_dt) if last_dt else None,
                "last_step_age_s": max(0.0, now - max(last_t)) if last_t else None}


def _mtime(base: Path, rel: str) -> float | None:
    """When base/rel, a directory reached without following a link below base, last changed; None
    when there is none (or a link is there)."""
    try:
        fd = safeio.open_dir_beneath(base, rel)
    except (OSError, safeio.Unsafe):
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
