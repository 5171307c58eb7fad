"""Run directories: runs/<time>-<testbed>/ under the current directory.

Layout:
  summary.json            what ran, where, exit statuses, durations, dilation factor
  topology.json           the topology snapshot (+ worker addresses)
  counters-before.json    per node, per interface byte/packet counters (host view)
  counters-after.json
  logs/<worker>.log       every line of that worker's ranks, prefixed with the rank
  probe/rank-<R>.jsonl    the probe's records (optimizer steps, collectives); during the run
                          probe is a link to <state dir>/runs/<run id>/probe (see testbed.jobs.run)
  report.txt, *.png       written by `testbed report RUN`
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Iterator

from testbed import names, paths, safeio

RUNS = "runs"
READ_MAX = 64 << 20   # a file of a run directory read whole (summary, counters): a job may have grown it
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def create(testbed: str, base: str | os.PathLike | None = None, now: float | None = None) -> Path:
    root = Path(base or os.getcwd()) / RUNS
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now or time.time()))
    # made relative to runs/ opened without following a link: a job may have planted one there
    rfd = safeio.open_dir_beneath(root.parent, RUNS)
    try:
        for i in range(1000):
            leaf = f"{stamp}-{testbed}" if i == 0 else f"{stamp}-{testbed}.{i}"
            try:
                os.mkdir(leaf, 0o755, dir_fd=rfd)
            except FileExistsError:
                continue
            for sub in ("logs", "probe"):
                os.close(safeio.open_dir_beneath(root.parent, f"{RUNS}/{leaf}/{sub}", create=True))
            return root / leaf
    finally:
        os.close(rfd)
    raise RuntimeError(f"cannot make a run directory under {root}")


def write_json(path: Path, data: Any) -> None:
    """Root writes where a job can reach (a writable working directory): no link below the run
    directory's parent is followed (testbed.safeio)."""
    write_bytes(path, json.dumps(data, indent=1, default=str).encode())


def write_bytes(path: Path, data: bytes) -> None:
    base, rel = safeio.path_beneath_runs(path)
    safeio.write_beneath(base, rel, data)


def copy_file(src: Path, dst: Path, limit: int = READ_MAX) -> None:
    """src (a plain file: no link, no FIFO) copied to dst in the run directory as write_bytes does,
    at most `limit` bytes of it."""
    base, rel = safeio.path_beneath_runs(dst)
    safeio.copy_beneath(src, base, rel, limit)


def open_append(path: Path) -> Any:
    """A text file of the run directory opened for append, line-buffered, no link followed; a FIFO,
    a device or a hard link a job planted there is refused (safeio.Unsafe naming the path), never
    waited on or written through."""
    base, rel = safeio.path_beneath_runs(path)
    fd = safeio.open_beneath(base, rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", buffering=1, errors="replace")


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(safeio.read_regular(path, READ_MAX))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, safeio.Unsafe):
        return default


def latest(base: str | os.PathLike | None = None) -> Path | None:
    """The run directory under base/runs with a summary.json that changed last. Nothing a job can
    reach is followed: a link at runs/ is Unsafe (naming it), a link among the run directories (to
    another user's run, to /etc) is passed over, as is a summary.json that is not a plain file."""
    parent = Path(base or os.getcwd())
    if not os.path.lexists(parent / RUNS):
        return None
    rfd = safeio.open_dir_beneath(parent, RUNS)
    best: tuple[float, str] | None = None
    try:
        for name in os.listdir(rfd):
            try:
                dfd = os.open(name, _DIR, dir_fd=rfd)
            except OSError:   # a link (ELOOP) or not a directory
                continue
            try:
                if stat.S_ISREG(os.stat("summary.json", dir_fd=dfd, follow_symlinks=False).st_mode):
                    mtime = os.fstat(dfd).st_mtime
                    if best is None or mtime >= best[0]:
                        best = (mtime, name)
            except OSError:
                pass
            finally:
                os.close(dfd)
    finally:
        os.close(rfd)
    return parent / RUNS / best[1] if best else None


def open_probe(run: Path) -> int:
    """A descriptor of RUN/probe, reached without following a link at or below the run directory
    (safeio.path_beneath_runs): a job that put a link there (to another run's probe, to /etc) gets
    safeio.Unsafe naming the path, never its records read. FileNotFoundError: the run has none."""
    probe = Path(run) / "probe"
    if not os.path.lexists(probe):
        raise FileNotFoundError(errno.ENOENT, "no probe directory", str(probe))
    if probe.is_symlink():
        live = _exchange_probe(Path(run))
        if live is not None:
            return live
    base, rel = safeio.path_beneath_runs(probe)
    return safeio.open_dir_beneath(base, rel)


def _exchange_probe(run: Path) -> int | None:
    """A run still "running" (live, or its `testbed run` was killed) has RUN/probe as testbed's own
    link into the testbed's exchange folder: that folder, found by the run's id and never where the
    link points. FileNotFoundError when it went with its testbed; None for a run that is not running
    (its link is a job's)."""
    summary = read_json(run / "summary.json")
    if not isinstance(summary, dict) or summary.get("status") != "running":
        return None
    rid, tb = summary.get("run_id"), summary.get("testbed")
    if not (isinstance(rid, str) and rid not in ("", ".", "..") and "/" not in rid
            and isinstance(tb, str) and names.valid_testbed_name(tb)):
        return None
    try:
        return safeio.open_dir_beneath(paths.directory(tb), f"runs/{rid}/probe")
    except (OSError, safeio.Unsafe):
        raise FileNotFoundError(errno.ENOENT, f"the run's probe went with its testbed ({tb})",
                                str(run / "probe")) from None


def open_in(dfd: int, name: str, where: str = "") -> int:
    """The plain file `name` of the directory dfd opened for reading: a link is not followed and a
    FIFO not waited on (each is OSError or safeio.Unsafe), as open_regular does for a path."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise safeio.Unsafe(f"{where or name}: not a plain file (a FIFO, a device or a directory): refused")
    os.set_blocking(fd, True)
    return fd


def step_events(chunk: bytes) -> Iterator[tuple[Any, float | None]]:
    """(kind, t) of each record in whole lines of a rank's probe file: t is a step's end time for a
    "step" record, else None. The files are the job's: a line that is not a record is passed over."""
    for line in chunk.splitlines():
        try:
            ev = json.loads(line)
            kind = ev.get("ev")
            t = float(ev.get("t", 0.0)) if kind == "step" else None
        except (ValueError, TypeError, AttributeError):
            continue
        yield kind, t


class StepReader:
    """Incremental reader of the probe's rank-*.jsonl while a run goes: how many optimizer steps
    the ranks recorded (in all, and the most by one rank) and when the last one ended. The files
    are the job's: a line that is not a step record is passed over."""

    def __init__(self, probe_dir: Path):
        self.dir = probe_dir
        self.offsets: dict[Path, int] = {}
        self.per_file: dict[Path, int] = {}
        self.last_step_t: float | None = None
        self.steps = 0

    @property
    def max_rank_steps(self) -> int:
        return max(self.per_file.values(), default=0)

    def poll(self) -> None:
        if not self.dir.is_dir():
            return
        for f in self.dir.glob("rank-*.jsonl"):
            off = self.offsets.get(f, 0)
            try:   # a rank's file: a FIFO or a link there is passed over, never waited on or followed
                data = safeio.read_regular(f, 1 << 22, off)
            except (OSError, safeio.Unsafe):
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[f] = off + end + 1
            for _kind, t in step_events(data[: end + 1]):
                if t is not None:
                    self.steps += 1
                    self.per_file[f] = self.per_file.get(f, 0) + 1
                    self.last_step_t = max(self.last_step_t or 0.0, t)

