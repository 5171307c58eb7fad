"""What a testbed asks of the machine once its links are built: checked before `up` builds anything.

testbed.net.limits checks what the namespaces need (namespace counts, the build's open files) as
soon as the topology is read. This module adds what is known only once the dilation and the
kernel's capabilities are: how many links need a userspace delay line (a kernel without
sch_netem), hence how many delay-line engines run and how many files they hold, and, with the
workers, how many processes and how much memory the testbed takes. `up` refuses a shortfall of
any of them, naming the limit, how short it is, and the fix.

Costs, measured on the 2-core development machine (docs/delay-engine.md): an engine's RSS is 19.4
MiB with one line and 23.2 MiB with 1,000 (PSS 9.9 and 13.6 MiB: ~4 KiB a line); the kernel's share
of a line (two TAPs, their queues) is about a veth pair's, which limits.MEMORY_PER_NODE already
counts. A netns worker is one process (its init; a star's 4 workers: 4 processes, 4 threads);
two each leave room for what enters it.
"""

from __future__ import annotations

import math
import resource
from pathlib import Path
from typing import Any, Callable

from testbed.net import delayline, limits
from testbed.net.delay_engine import BASE_FILES, FILES_PER_LINE, capacity

ENGINE_MEMORY = 20 * 2**20      # an engine's RSS with one line (measured 19.4 MiB)
LINE_MEMORY = 4 * 2**10         # per line in its engine (measured 3.8 MiB for 999 more)
PIDS_PER_WORKER = 2
PIDS_SLACK = 64                 # the build's own short-lived processes (ip, tc, the capability probe)


def lines_needed(topo: Any, caps: Any, part: Any = None) -> int:
    """How many delay lines this host builds for `topo` (already dilated) on a kernel with `caps`."""
    from testbed.net.builder import cut_lines_here, needs_delay_line

    here = (lambda n: True) if part is None else part.local
    local = sum(1 for link in topo.links if here(link.a) and here(link.b)
                and (needs_delay_line(link.ab, caps) or needs_delay_line(link.ba, caps)))
    return local + len(cut_lines_here(topo, caps, part))


def engines_needed(lines: int, files: int, cpus: int) -> int:
    """How many engines serve `lines` lines (testbed.net.delayline: one per CPU up to its cap, `cpus`
    here, more when an engine's open-files limit `files` cannot hold its share). 0 when no engine
    can hold a line."""
    if lines <= 0:
        return 0
    per = capacity(files)
    return max(min(cpus, lines), math.ceil(lines / per)) if per > 0 else 0


def _read_int(path: str | Path, field: int = 0) -> int | None:
    try:
        text = Path(path).read_text().split()[field]
        return None if text == "max" else int(text)
    except (OSError, ValueError, IndexError):
        return None


def _tasks_in_use() -> int | None:
    """Threads on the machine now (/proc/loadavg: running/total)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None


def _own_cgroup(controller: str) -> Path | None:
    """This process's cgroup directory for `controller` (v1), or its unified one (v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        num, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if controller in ctrls.split(","):
            return Path("/sys/fs/cgroup", controller, path.lstrip("/"))
        if num == "0" and ctrls == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup", path.lstrip("/"))
    return None


Room = tuple[int | None, str, Callable[[int], str]]   # how much more fits, which limit says so, its fix for a shortfall


def _raise_to(setting: str, current: int) -> Callable[[int], str]:
    return lambda short: f"sysctl -w {setting}={-(-(current + short) // 1024) * 1024}"


def _pids_room() -> Room:
    """How many more processes (threads, to the kernel) may start here, and which limit says so."""
    rooms: list[Room] = []
    used = _tasks_in_use()
    for setting in ("kernel.pid_max", "kernel.threads-max"):
        mx = _read_int("/proc/sys/" + setting.replace(".", "/"))
        if used is not None and mx is not None:
            rooms.append((mx - used, f"{setting} {mx:,}, {used:,} in use", _raise_to(setting, mx)))
    group = _own_cgroup("pids")
    if group is not None:
        mx, cur = _read_int(group / "pids.max"), _read_int(group / "pids.current")
        if mx is not None and cur is not None:
            rooms.append((mx - cur, f"pids.max {mx:,} of cgroup {group}, {cur:,} in use",
                          lambda short: f"echo {mx + short} > {group / 'pids.max'} (or the container's --pids-limit)"))
    return min(rooms, key=lambda r: r[0]) if rooms else (None, "", lambda short: "")


def _memory_room() -> Room:
    """How much more memory the testbed may take, and which limit says so."""
    fix = ("fewer nodes, a --time-dilation that needs fewer delay lines (or a kernel with sch_netem), "
           "or a machine with more memory")
    rooms: list[Room] = []
    avail = limits.mem_available()
    if avail is not None:
        rooms.append((avail, "MemAvailable", lambda short: fix))
    group = _own_cgroup("memory")
    if group is not None:
        for limit_file, usage_file in (("memory.limit_in_bytes", "memory.usage_in_bytes"),
                                       ("memory.max", "memory.current")):
            mx, cur = _read_int(group / limit_file), _read_int(group / usage_file)
            if mx is not None and cur is not None and mx < 1 << 60:   # (v1 says "no limit" with ~2^63)
                rooms.append((mx - cur, f"{limit_file} of cgroup {group}",
                              lambda short, f=group / limit_file, mx=mx: f"raise {f} to {mx + (short << 20)}, or {fix}"))
    return min(rooms, key=lambda r: r[0]) if rooms else (None, "", lambda short: fix)


def _files_room() -> Room:
    """Open files the machine may still allocate (fs.file-nr: allocated, free, max)."""
    try:
        allocated, _free, mx = (int(x) for x in Path("/proc/sys/fs/file-nr").read_text().split())
    except (OSError, ValueError):
        return None, "", lambda short: ""
    return mx - allocated, f"fs.file-max {mx:,}, {allocated:,} open", _raise_to("fs.file-max", mx)


def check(lines: int, nodes: int, workers: int, *, files: int | None = None, cpus: int | None = None,
          pids_room: Room | None = None, memory_room: Room | None = None,
          files_room: Room | None = None) -> list[limits.Limit]:
    """Each limit a testbed of `nodes` namespaces, `workers` workers and `lines` delay lines meets.
    The machine's figures are read here unless given (tests give them; memory in bytes). An
    engine's own open-files limit is not among them: limits.check asks more of it than a line
    takes, and delayline starts more engines when each holds fewer lines (engines_needed)."""
    if files is None:
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if files == resource.RLIM_INFINITY:
            files = _read_int("/proc/sys/fs/nr_open") or 1 << 20
    engines = engines_needed(lines, files, cpus or delayline.engines_max())
    wants = [(pids_room or _pids_room(), "processes", workers * PIDS_PER_WORKER + engines + PIDS_SLACK, 1),
             (memory_room or _memory_room(), "memory, MiB",
              nodes * limits.MEMORY_PER_NODE + engines * ENGINE_MEMORY + lines * LINE_MEMORY, 2**20)]
    if lines:
        wants.insert(0, (files_room or _files_room(), "open files",
                         FILES_PER_LINE * lines + nodes + BASE_FILES * engines, 1))
    out = []
    for (room, what, fix), name, need, unit in wants:
        room, need = None if room is None else room // unit, -(-need // unit)
        short = 0 if room is None else max(0, need - room)
        out.append(limits.Limit(f"{name} ({what})" if what else name, room, need, fix(short)))
    return out


def refusals(checked: list[limits.Limit]) -> list[str]:
    """Each limit that is short: its name, what it has, what is needed, by how much, and the fix."""
    return [f"{l.name}: {l.have:,} here, {l.need:,} needed, {l.need - l.have:,} short (fix: {l.fix})"
            for l in checked if not l.ok]
