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

import json
import os
import time
from pathlib import Path
from typing import Any

RUNS = "runs"


def create(testbed: str, base: str | os.PathLike | None = None, now: float | None = None) -> Path:
    root = Path(base or os.getcwd()) / RUNS
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now or time.time()))
    for i in range(1000):
        d = root / (f"{stamp}-{testbed}" if i == 0 else f"{stamp}-{testbed}.{i}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        (d / "logs").mkdir()
        (d / "probe").mkdir()
        return d
    raise RuntimeError(f"cannot make a run directory under {root}")


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def latest(base: str | os.PathLike | None = None) -> Path | None:
    root = Path(base or os.getcwd()) / RUNS
    if not root.is_dir():
        return None
    dirs = sorted((d for d in root.iterdir() if (d / "summary.json").is_file()), key=lambda d: d.stat().st_mtime)
    return dirs[-1] if dirs else None


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
            try:
                with open(f, "rb") as fh:
                    fh.seek(off)
                    data = fh.read(1 << 22)
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[f] = off + end + 1
            for line in data[: end + 1].splitlines():
                try:
                    ev = json.loads(line)
                    t = float(ev.get("t", 0.0)) if ev.get("ev") == "step" else None
                except (ValueError, TypeError, AttributeError):
                    continue
                if t is not None:
                    self.steps += 1
                    self.per_file[f] = self.per_file.get(f, 0) + 1
                    self.last_step_t = max(self.last_step_t or 0.0, t)

