"""Where this machine's cgroup hierarchies are mounted, and where testbed's groups go in them.

A leaf (no testbed import): the state's schema checks a recorded group against these mounts, and
testbed.runtime.cgroups makes and limits the groups. Every worker's group is TOP/<testbed>/<worker>
at the top of each hierarchy used (`node slow`'s own groups: TOP/<testbed>.faults/<worker>).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
TOP = "testbed"
# the v1 hierarchies a worker joins (those mounted; cpuset deliberately not)
V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")


@dataclass(frozen=True)
class Hierarchy:
    version: int                    # 1 or 2
    mounts: dict[str, Path]         # v1: controller -> mount point; v2: {"": mount}


def _parse_mountinfo(text: str) -> list[tuple[str, str, list[str]]]:
    """(mount point, fstype, super options) of each cgroup mount in a mountinfo text."""
    out = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        fstype = rfields[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mnt = fields[4].replace("\\040", " ")
        out.append((mnt, fstype, rfields[2].split(",")))
    return out


def detect(mountinfo: str | None = None) -> Hierarchy | None:
    """Which cgroup layout this machine has (None: no usable cgroup filesystem)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    mounts = _parse_mountinfo(mountinfo)
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for mnt, fstype, opts in mounts:
        if fstype == "cgroup2":
            # a pure v2 system mounts it at /sys/fs/cgroup; hybrid systems at .../unified
            if v2 is None or mnt == str(CGROUP_ROOT):
                v2 = Path(mnt)
        else:
            for ctrl in V1_CONTROLLERS:
                if ctrl in opts and ctrl not in v1:
                    v1[ctrl] = Path(mnt)
    if "cpu" in v1 or "memory" in v1:
        return Hierarchy(1, v1)
    if v2 is not None:
        return Hierarchy(2, {"": v2})
    return None


_hier_cache: list[Hierarchy | None] = []


def hierarchy() -> Hierarchy | None:
    if not _hier_cache:
        _hier_cache.append(detect())
    return _hier_cache[0]
