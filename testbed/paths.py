"""Where testbed keeps its files: /run/testbed (TESTBED_STATE_DIR overrides it, as tests do).

    <root>/NAME/state.json       a testbed's state (testbed.store reads and writes it)
    <root>/NAME/...              its workers' dirs, logs, delay-line sockets, run exchange dirs
    <root>/.locks/NAME.lock      its lock (outside NAME/, so removing a testbed keeps it)
    <root>/.capabilities.json    the kernel probe of this boot

Only root may write here: `check_root` refuses a root directory that is a
symbolic link, not owned by root, or writable by group or others (a hostile
user could otherwise plant the files that root later acts on), naming the
path and what is wrong. Paths only; no I/O beyond creating and checking the
root, so every layer may use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_ROOT = "/run/testbed"


class UnsafeStateRoot(PermissionError):
    """The state root is not a directory only root controls."""


def root() -> Path:
    return Path(os.environ.get("TESTBED_STATE_DIR") or DEFAULT_ROOT)


def directory(name: str) -> Path:
    return root() / name


def state_file(name: str) -> Path:
    return directory(name) / "state.json"


def lock_file(name: str) -> Path:
    return root() / ".locks" / f"{name}.lock"


def check_root(create: bool = False) -> Path:
    """The state root, checked (and with create=True made, mode 0700) before anything trusts it."""
    r = root()
    if create and not os.path.lexists(r):
        r.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(r)
    except FileNotFoundError:
        return r
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != 0 and os.geteuid() == 0:
        problem = f"is owned by uid {st.st_uid}, not root"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if problem:
        raise UnsafeStateRoot(f"state directory {r} {problem}: testbed keeps what it acts on as root there; "
                              f"fix it (chown root:root {r}; chmod 700 {r}) or point TESTBED_STATE_DIR elsewhere")
    return r
