"""The machine's CPU counters, from /proc/stat, read in one place.

What the run monitor and the calibration's machine check sample: the CPUs' time by kind and the
tasks runnable now. psutil.cpu_times() has the first but not the second (procs_running), and a
sample must take both from one read, so this parses the file itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

STAT = "/proc/stat"
_BOUND = 1 << 20   # a bounded read: a 2-core machine's file is ~1.5 KiB, a 1,024-core one's ~150 KiB


@dataclass(frozen=True)
class CpuTicks:
    """All CPUs' time since boot in clock ticks (ticks_per_s()), and the tasks runnable now."""

    user: int
    nice: int
    system: int
    idle: int
    iowait: int
    irq: int
    softirq: int
    steal: int
    running: int

    @property
    def total(self) -> int:
        """Every kind of time (guest time is inside user and nice already: not added again)."""
        return (self.user + self.nice + self.system + self.idle + self.iowait + self.irq + self.softirq
                + self.steal)

    @property
    def busy(self) -> int:
        """user + nice + system: interrupt work is left out, much of it is the testbed's own traffic."""
        return self.user + self.nice + self.system

    @property
    def idle_all(self) -> int:
        """idle + iowait: a CPU waiting on I/O runs nothing."""
        return self.idle + self.iowait


def parse(text: str) -> CpuTicks:
    """The `cpu` line (older kernels have fewer columns: the missing ones are 0) and procs_running."""
    fields: list[int] | None = None
    running = 0
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:9]]
        elif line.startswith("procs_running "):
            running = int(line.split()[1])
    if fields is None:
        raise ValueError(f"{STAT} has no 'cpu' line")
    fields += [0] * (8 - len(fields))
    return CpuTicks(*fields, running=running)


def read() -> CpuTicks:
    """The counters now (OSError, ValueError when /proc/stat cannot be read or parsed)."""
    with open(STAT, "rb") as f:
        return parse(f.read(_BOUND).decode("ascii", errors="replace"))


def ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")
