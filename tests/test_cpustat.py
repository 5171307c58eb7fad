"""testbed.cpustat: the one reader of /proc/stat (pure parsing, and one real read)."""

from __future__ import annotations

import pytest

from testbed import cpustat

LINUX_6 = """cpu  3685503 1111 1167736 7109822 148568 0 134303 58416 900 100
cpu0 1842751 555 583868 3554911 74284 0 67151 29208 450 50
intr 1 2 3
procs_running 3
procs_blocked 0
"""


def test_every_kind_of_time_once():
    t = cpustat.parse(LINUX_6)
    assert (t.user, t.nice, t.system, t.idle, t.iowait, t.irq, t.softirq, t.steal) == \
        (3685503, 1111, 1167736, 7109822, 148568, 0, 134303, 58416)
    # guest (900) and guest_nice (100) are inside user and nice already: not counted twice
    assert t.total == 3685503 + 1111 + 1167736 + 7109822 + 148568 + 0 + 134303 + 58416
    assert t.busy == 3685503 + 1111 + 1167736          # interrupt work left out
    assert t.idle_all == 7109822 + 148568
    assert t.running == 3


def test_an_older_kernel_has_fewer_columns():
    t = cpustat.parse("cpu  10 0 5 100\nprocs_running 1\n")
    assert (t.iowait, t.irq, t.softirq, t.steal) == (0, 0, 0, 0) and t.total == 115


@pytest.mark.parametrize("text", ["", "cpu0 1 2 3 4\n", "intr 5\nprocs_running 2\n"])
def test_no_cpu_line_is_an_error(text):
    with pytest.raises(ValueError, match="no 'cpu' line"):
        cpustat.parse(text)


def test_this_machine():
    a = cpustat.read()
    b = cpustat.read()
    assert 0 < a.busy <= a.total <= b.total and b.running >= 1   # (this process runs)
    assert cpustat.ticks_per_s() > 0
