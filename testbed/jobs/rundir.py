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
