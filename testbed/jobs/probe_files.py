"""The probe's files of a run: the folder the ranks write into (in the testbed's state dir, seen by
every worker) and their copy into the run directory at the end, checked as hostile input."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from testbed import safeio
from testbed.jobs.target import Cluster


PROBE_FILE = re.compile(r"(rank-[A-Za-z0-9_]{1,32}|ops-[0-9]{1,6})\.jsonl")   # ranks' records, ops (fullmatch)


PROBE_FILE_MAX_BYTES = 512 << 20


def shared_dir(cluster: Cluster, run_id: str) -> Path:
    """<state dir>/runs/<run id>: where ranks write (the state dir is visible in every worker)."""
    base = cluster.state_dir
    if base is None:
        from testbed import paths

        base = paths.directory(cluster.name)
    return Path(base) / "runs" / run_id


def collect_probe(rd: Path, shared: Path) -> None:
    """Replace the run dir's probe link with a directory holding the ranks' files; remove `shared`.
    Each file is opened once (no link followed, never waited on), checked on that descriptor and
    copied from it: what is checked is what is copied."""
    try:
        _copy_probe(rd, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)   # <state dir>/runs stays: Docker workers mount it


def _copy_probe(rd: Path, shared: Path) -> None:
    base, rel = safeio.path_beneath_runs(rd / "probe")
    run_fd = safeio.open_dir_beneath(base, rel.parent)   # (refuses a run directory, or runs/, become a link)
    try:   # testbed's live link goes; a directory there stays
        if stat.S_ISLNK(os.lstat("probe", dir_fd=run_fd).st_mode):
            os.unlink("probe", dir_fd=run_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(run_fd)
    dst = safeio.open_dir_beneath(base, rel, create=True)
    try:
        src = safeio.open_dir_beneath(shared, "probe")
    except (OSError, safeio.Unsafe):
        src = -1
    try:
        for name in sorted(os.listdir(src)) if src >= 0 else []:
            # only the ranks' own files, plain and of a sane size: a rank is not trusted to name them
            if not PROBE_FILE.fullmatch(name):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > PROBE_FILE_MAX_BYTES:
                    continue
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                              dir_fd=dst)
                try:   # (the state dir is on a tmpfs, the run dir on disk: copied, not renamed)
                    left = PROBE_FILE_MAX_BYTES
                    while left > 0 and (chunk := os.read(fd, min(1 << 20, left))):
                        os.write(out, chunk)
                        left -= len(chunk)
                finally:
                    os.close(out)
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        os.close(dst)
        if src >= 0:
            os.close(src)
