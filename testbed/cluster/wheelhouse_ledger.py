"""The ledger of wheelhouse digests: what vouches for a cached wheelhouse (testbed/cluster/wheelhouse.py).

Whatever is in the wheelhouse cache is installed as root on every host. So the sha256 of each
wheels.tar is taken as it is written and recorded here, outside the cache, in a directory whose
path is checked private all the way up: whoever can rewrite the cache (its wheels.tar and its
manifest alike) cannot also rewrite the digest that vouches for them. Where: ledger_root()
(TESTBED_WHEELHOUSE_LEDGER; root's /var/lib/testbed/wheelhouses, else
~/.local/state/testbed/wheelhouses). One small file per digest, NAME.SHA256, NAME a build's name
(VERSION-KEY): pip's wheels are not byte for byte the same twice, so a build may hold several. The
KEEP_LEDGER newest are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from pathlib import Path

from testbed.errors import InstallRefused

__all__ = ["KEEP_LEDGER", "entry_name", "ledger_dir", "ledger_root", "record", "recorded"]

KEEP_LEDGER = 64          # digests kept in the ledger (each a small file; the newest)


def ledger_root() -> Path:
    """Where install records the sha256 of every wheelhouse it builds: outside the cache, so that what
    can rewrite the cache cannot rewrite the digests. TESTBED_WHEELHOUSE_LEDGER, else root's
    /var/lib/testbed/wheelhouses, else $XDG_STATE_HOME/testbed/wheelhouses (~/.local/state/...)."""
    if os.environ.get("TESTBED_WHEELHOUSE_LEDGER"):
        return Path(os.environ["TESTBED_WHEELHOUSE_LEDGER"])
    if os.geteuid() == 0:
        return Path("/var/lib/testbed/wheelhouses")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "testbed" / "wheelhouses"


def ledger_dir() -> Path:
    """The ledger directory, made 0700 if missing; refused unless it and every directory above it
    are root's or ours and nobody else may write in them (a sticky one, like /tmp, aside)."""
    path = Path(os.path.abspath(ledger_root()))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    me = os.geteuid()
    here = path
    while True:
        st = os.lstat(here)
        others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (here != path and st.st_mode & stat.S_ISVTX)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, me) or others_write \
                or (here == path and st.st_uid != me):
            raise InstallRefused(
                f"the wheelhouse ledger {path} is not private: {here} is "
                + ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                   f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}")
                + ". It holds the digests that vouch for what is installed as root on the hosts; fix it or "
                  "point TESTBED_WHEELHOUSE_LEDGER at a directory only you can change")
        if here.parent == here:
            return path
        here = here.parent


def entry_name(build_name: str, digest: str) -> str:
    """The ledger's file for `digest` of the build named `build_name` (Build.name)."""
    return f"{build_name}.{digest}"


def recorded(build_name: str) -> set[str]:
    """The digests of wheels.tar recorded for the build named `build_name` (one per build of it: pip's
    wheels are not byte for byte the same twice)."""
    prefix = f"{build_name}."
    return {name[len(prefix):] for name in os.listdir(ledger_dir()) if name.startswith(prefix)}


def record(build_name: str, key: str, digest: str, size: int) -> None:
    """Record `digest` (and `size`) of the wheels.tar just written for the build `build_name` (its
    `key`); the oldest entries beyond KEEP_LEDGER go."""
    ledger = ledger_dir()
    final = ledger / entry_name(build_name, digest)
    tmp = ledger / f".{final.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps({"key": key, "tar_sha256": digest, "tar_bytes": size,
                             "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    os.replace(tmp, final)
    entries = sorted((p for p in ledger.iterdir() if not p.name.startswith(".")),
                     key=lambda p: p.lstat().st_mtime, reverse=True)
    for old in entries[KEEP_LEDGER:]:
        with contextlib.suppress(OSError):
            old.unlink()
