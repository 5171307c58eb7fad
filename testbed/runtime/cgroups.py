"""Per-worker resource limits through cgroups (v1 and v2).

Every worker gets one group, ``testbed/<testbed>/<worker>``, at the top of
each hierarchy we use, so that cleanup is exact: removing a worker removes
its group and nothing else (and the parents once they are empty).

- cgroup v2 (unified, most current distributions): one directory under the
  cgroup2 mount; ``cpu.max`` and ``memory.max`` (+ ``memory.swap.max`` = 0).
  The ``cpu`` and ``memory`` controllers are enabled in the
  ``cgroup.subtree_control`` of /testbed and /testbed/<testbed>.
- cgroup v1 (this development machine: cpu, cpuacct, memory ... mounted
  separately): one directory per hierarchy; ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``, ``memory.limit_in_bytes`` (+ memsw when swap
  accounting is on). cpuset is never used (its groups need cpus/mems set
  before a task may join).

The paths a worker's group has are returned as a plain list of directories:
that list goes into the state file, and every later command (exec, down,
cleanup) works from it alone.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import time
from pathlib import Path
from typing import Iterable, Sequence

# where the hierarchies are and where our groups go: a leaf below the state's schema (read here as cgroups.X too)
from testbed.cgroupfs import CGROUP_ROOT, TOP, V1_CONTROLLERS, Hierarchy, detect, hierarchy  # noqa: F401
from testbed.errors import CapabilityError, StateError

CFS_PERIOD_US = 10_000     # short: a throttled worker waits at most this long (dilated workers get ~1/s)
CFS_MIN_QUOTA_US = 1_000   # the kernel's smallest quota
CFS_MAX_PERIOD_US = 1_000_000   # the kernel's longest period (a longer one is EINVAL)


def _write(p: Path, value: str) -> None:
    with open(p, "w") as f:
        f.write(value)


def _read(p: Path) -> str:
    return p.read_text().strip()


def group_paths(testbed: str, worker: str, hier: Hierarchy | None = None) -> list[Path]:
    """The directories of a worker's group (one per v1 hierarchy, one on v2)."""
    hier = hier or hierarchy()
    if hier is None:
        return []
    rel = Path(TOP) / testbed / worker
    return [m / rel for m in hier.mounts.values()]


def groups_of(testbed: str, hier: Hierarchy | None = None) -> list[list[Path]]:
    """Every worker group testbed `testbed` has (its own and its `node slow` ones), one list of
    directories per worker: what `cleanup` removes when no state can be trusted."""
    hier = hier or hierarchy()
    if hier is None:
        return []
    by_worker: dict[tuple[str, str], list[Path]] = {}
    for mount in hier.mounts.values():
        for group in (testbed, f"{testbed}.faults"):
            base = mount / TOP / group
            if base.is_dir() and not base.is_symlink():
                for d in sorted(base.iterdir()):
                    if d.is_dir() and not d.is_symlink():
                        by_worker.setdefault((group, d.name), []).append(d)
    return list(by_worker.values())


def _enable_v2_controllers(mount: Path, testbed: str) -> None:
    avail = set(_read(mount / "cgroup.controllers").split()) if (mount / "cgroup.controllers").exists() else set()
    want = [c for c in ("cpu", "memory", "pids") if c in avail]
    missing = {"cpu", "memory"} - avail
    if missing:
        raise CapabilityError(f"cgroup v2 at {mount} lacks the {', '.join(sorted(missing))} controller(s)")
    for d in (mount, mount / TOP, mount / TOP / testbed):
        d.mkdir(exist_ok=True)
        have = set(_read(d / "cgroup.subtree_control").split())
        todo = [c for c in want if c not in have]
        if not todo:
            continue
        try:
            _write(d / "cgroup.subtree_control", " ".join("+" + c for c in todo))
        except OSError as exc:
            raise CapabilityError(
                f"cannot enable cgroup controllers {todo} in {d} ({exc.strerror}); on cgroup v2 the "
                "testbed needs a delegated subtree (run as root outside a container, or give the "
                "container its own cgroup namespace)") from None


def create(testbed: str, worker: str, *, cpus: float | None = None, memory_bytes: int | None = None,
           hier: Hierarchy | None = None) -> list[str]:
    """Make the worker's group, set its limits; return its directories (for the state file).

    Raises CapabilityError when limits are asked for and cannot be enforced;
    without limits a missing cgroup filesystem just yields [] (no group).
    """
    hier = hier or hierarchy()
    want_limits = cpus is not None or memory_bytes is not None
    if hier is None:
        if want_limits:
            raise CapabilityError("cpu/memory limits need cgroups, and no cgroup filesystem is mounted")
        return []
    if hier.version == 1:
        if cpus is not None and "cpu" not in hier.mounts:
            raise CapabilityError("cpu limits need the cgroup v1 cpu controller, which is not mounted")
        if memory_bytes is not None and "memory" not in hier.mounts:
            raise CapabilityError("memory limits need the cgroup v1 memory controller, which is not mounted")
    paths = group_paths(testbed, worker, hier)
    try:
        if hier.version == 2:
            _enable_v2_controllers(hier.mounts[""], testbed)
        for p in paths:
            p.mkdir(parents=True, exist_ok=True)
        set_limits(paths, cpus=cpus, memory_bytes=memory_bytes, hier=hier)
    except CapabilityError:
        remove(paths)
        raise
    except OSError as exc:
        remove(paths)
        if want_limits:
            raise CapabilityError(f"cannot create the cgroup of {worker} ({exc}): limits cannot be enforced") from None
        return []
    return [str(p) for p in paths]


def _ctrl_of(p: Path, hier: Hierarchy) -> str:
    if hier.version == 2:
        return ""
    for ctrl, mnt in hier.mounts.items():
        if p.is_relative_to(mnt):
            return ctrl
    return "?"


def set_limits(paths: Sequence[str | Path], *, cpus: float | None = None, memory_bytes: int | None = None,
               hier: Hierarchy | None = None, clear: bool = False) -> None:
    """Set (or with clear=True, lift where None) the cpu and memory limits of a group."""
    hier = hier or hierarchy()
    if hier is None:
        return
    for p in map(Path, paths):
        ctrl = _ctrl_of(p, hier)
        if hier.version == 2:
            if cpus is not None or clear:
                _write(p / "cpu.max", "{} {}".format(*cfs(cpus)) if cpus is not None else "max")
                if (p / "cpu.max.burst").exists():
                    _write(p / "cpu.max.burst", str(cfs_burst(cpus) if cpus is not None else 0))
            if memory_bytes is not None or clear:
                _write(p / "memory.max", str(memory_bytes) if memory_bytes is not None else "max")
                if (p / "memory.swap.max").exists():
                    _write(p / "memory.swap.max", "0" if memory_bytes is not None else "max")
        elif ctrl == "cpu":
            if cpus is not None or clear:
                quota, period = cfs(cpus) if cpus is not None else (-1, CFS_PERIOD_US)
                _write(p / "cpu.cfs_period_us", str(period))
                _write(p / "cpu.cfs_quota_us", str(quota))
                if (p / "cpu.cfs_burst_us").exists():
                    _write(p / "cpu.cfs_burst_us", str(cfs_burst(cpus) if cpus is not None else 0))
        elif ctrl == "memory":
            if memory_bytes is not None or clear:
                limit = str(memory_bytes) if memory_bytes is not None else "-1"
                memsw = p / "memory.memsw.limit_in_bytes"
                # memsw must stay >= limit: order the writes so every step is valid
                cur = _read(p / "memory.limit_in_bytes")
                raising = memory_bytes is None or int(cur) < memory_bytes
                if raising and memsw.exists():
                    _write(memsw, limit)
                _write(p / "memory.limit_in_bytes", limit)
                if not raising and memsw.exists():
                    _write(memsw, limit)
                if (p / "memory.swappiness").exists():
                    try:
                        _write(p / "memory.swappiness", "0")
                    except OSError:
                        pass


def cfs(cpus: float) -> tuple[int, int]:
    """(quota, period) in microseconds for a limit of `cpus` cores: a 10 ms period, longer only
    where the quota would fall under the kernel's 1 ms minimum (below 0.1 core), and 1 s at most:
    below 0.001 core the group gets 0.001 (a k=16 fat-tree at auto asks for 1/1447; the kernel
    refused its 1.45 s period, and `up` failed; testbed.topology.dilation says what it means)."""
    period = min(CFS_MAX_PERIOD_US, max(CFS_PERIOD_US, math.ceil(CFS_MIN_QUOTA_US / cpus))) if cpus > 0 \
        else CFS_PERIOD_US
    return max(CFS_MIN_QUOTA_US, int(round(cpus * period))), period


def cfs_burst(cpus: float) -> int:
    """The burst (microseconds of unused quota a group may carry into the next period) for a limit
    of `cpus` cores: one quota where the period is stretched past CFS_PERIOD_US, else none.

    Below 0.1 core the period grows to s ms (the quota cannot go under 1 ms), and a worker that
    waited on the network through a period boundary loses what it did not use, then waits up to s
    ms once throttled: 63 phantoms in a ring wait on whichever is throttled at every step
    (all_reduce 1.17x the model at s=31.4, docs/fidelity.md). Carrying one period's quota
    smooths that quantisation; over any n periods a worker still gets at most n + 1 quotas."""
    quota, period = cfs(cpus)
    return quota if period > CFS_PERIOD_US else 0


def cgroup_procs_files(paths: Iterable[str | Path]) -> list[str]:
    return [str(Path(p) / "cgroup.procs") for p in paths]


def add(paths: Iterable[str | Path], pid: int) -> None:
    for p in paths:
        _write(Path(p) / "cgroup.procs", str(pid))


def pids(paths: Iterable[str | Path]) -> set[int]:
    out: set[int] = set()
    for p in paths:
        try:
            out.update(int(x) for x in _read(Path(p) / "cgroup.procs").split())
        except (OSError, ValueError):
            pass
    return out


def cpu_usage_s(paths: Iterable[str | Path]) -> float | None:
    """CPU time (seconds) used by the group so far."""
    for p in map(Path, paths):
        if (p / "cpuacct.usage").exists():
            return int(_read(p / "cpuacct.usage")) / 1e9
        if (p / "cpu.stat").exists() and (p / "cgroup.controllers").exists():
            for line in _read(p / "cpu.stat").splitlines():
                k, _, v = line.partition(" ")
                if k == "usage_usec":
                    return int(v) / 1e6
    return None


def cpu_throttling(paths: Iterable[str | Path]) -> tuple[int, int, float] | None:
    """(periods, periods throttled, seconds throttled) of the group's CPU cap so far, from the cpu
    controller's cpu.stat (v1: throttled_time in ns; v2: throttled_usec); None where the group has
    no cap's counters. Values come from the kernel, read as numbers or not at all."""
    for p in map(Path, paths):
        f = p / "cpu.stat"
        if not f.exists():
            continue
        fields = {}
        for line in _read(f).splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isascii() and v.strip().isdigit():
                fields[k] = int(v)
        if "nr_periods" in fields and "nr_throttled" in fields:
            secs = fields["throttled_usec"] / 1e6 if "throttled_usec" in fields else \
                fields.get("throttled_time", 0) / 1e9
            return fields["nr_periods"], fields["nr_throttled"], secs
    return None


def memory_usage_bytes(paths: Iterable[str | Path]) -> int | None:
    for p in map(Path, paths):
        for f in ("memory.usage_in_bytes", "memory.current"):
            if (p / f).exists():
                return int(_read(p / f))
    return None


def oom_kills(paths: Iterable[str | Path]) -> int | None:
    """How many processes of the group the OOM killer killed (None if unknown)."""
    for p in map(Path, paths):
        for f in ("memory.events", "memory.oom_control"):
            if (p / f).exists():
                for line in _read(p / f).splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        return int(v)
    return None


def freeze(paths: Iterable[str | Path], frozen: bool = True) -> bool:
    """Freeze/thaw every process of the group; False when no freezer is available."""
    for p in map(Path, paths):
        if (p / "cgroup.freeze").exists():
            _write(p / "cgroup.freeze", "1" if frozen else "0")
            return True
        if (p / "freezer.state").exists():
            _write(p / "freezer.state", "FROZEN" if frozen else "THAWED")
            return True
    return False


def remove(paths: Iterable[str | Path], *, kill: bool = True, timeout: float = 2.0) -> None:
    """Remove a worker's group: kill what is still in it, rmdir it, then its empty parents.

    Idempotent. Parents (testbed/<testbed>, testbed) are removed only when
    empty; EBUSY/ENOTEMPTY there means another worker or testbed uses them.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        return
    for p in paths:   # a group testbed made, whoever handed us the path
        real = Path(os.path.realpath(p)) if p.exists() else p
        if ".." in p.parts or real.parent.parent.name != TOP or not real.is_relative_to(CGROUP_ROOT):
            raise StateError(f"refusing to remove {p}: not a testbed cgroup ({CGROUP_ROOT}/.../{TOP}/NAME/NODE)")
    if kill:
        for pid in pids(paths):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if any(_frozen(p) for p in paths):
            freeze(paths, False)      # a frozen task keeps a pending SIGKILL until thawed
    deadline = time.monotonic() + timeout
    for p in paths:
        while True:
            try:
                p.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                if kill:
                    for pid in pids([p]):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                time.sleep(0.01)
        if p.parent.parent.name != TOP:
            continue
        for parent in (p.parent, p.parent.parent):   # testbed/<testbed>, then testbed/
            try:
                parent.rmdir()
            except OSError:
                break


def frozen(paths: Iterable[str | Path]) -> bool:
    """The group is frozen (stop() of a worker): any of its freezer controls says so."""
    return any(_frozen(Path(p)) for p in paths)


def _frozen(p: Path) -> bool:
    try:
        if (p / "freezer.state").exists():
            return _read(p / "freezer.state") != "THAWED"
        if (p / "cgroup.freeze").exists():
            return _read(p / "cgroup.freeze") == "1"
    except OSError:
        pass
    return False
