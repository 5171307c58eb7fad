"""What a host sends back is bounded (testbed/cluster/remote.py).

A host answers over a real SSH session (an emulated host: a namespace with its own sshd). It sends
200 MiB with no newline: on stdout without a reader, on stderr, and on stdout to a line reader.
Each run is made by a fresh Python process that measures itself (psutil's RSS before the command,
the kernel's peak RSS after it), so what one case costs is not hidden in the test session's own
memory. Without a reader the host is given up on, named, and this process grows by no more than
what it keeps of a command's stdout (STDOUT_MAX); the other two cost about what they keep
(STDERR_KEEP, STREAM_KEEP and a line of LINE_MAX).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cluster import remote

pytestmark = [pytest.mark.root, pytest.mark.requires("sshd")]

REPO = Path(__file__).resolve().parents[1]
FLOOD = 200 << 20
MiB = 1 << 20
# What else a command costs this process besides the buffers remote.py keeps: paramiko's channel
# window (2 MiB by default, received before we read it), 64 KiB reads, the threads' stacks and the
# decoded text. Measured here in three runs of this module (2026-12-02, 2 cores): beyond the kept
# buffers, stdout grew 1.6-2.4 MiB, stderr 5.4-6.9 MiB, the line reader 6.1-6.7 MiB; 16 MiB is
# about twice the largest, and a fifth of what one unbounded 200 MiB flood would add.
SLACK = 16 * MiB

CHILD = r"""
import json, sys
import psutil
from testbed.cluster import emulate, remote

emu = emulate.load(sys.argv[1])
(ctl,) = emu.controls()
ctl.run(["true"], check=True)   # connected, sudo decided: what the command adds is measured alone
me = psutil.Process()
before = me.memory_info().rss
mode, flood = sys.argv[2], int(sys.argv[3])
said = {}
try:
    if mode == "stdout":
        r = ctl.run(["sh", "-c", f"head -c {flood} /dev/zero"], timeout=300)
        said["rc"], said["stdout"] = r.rc, len(r.stdout)
    elif mode == "stderr":
        r = ctl.run(["sh", "-c", f"head -c {flood} /dev/zero >&2; echo done"], timeout=300)
        said["rc"], said["stdout"], said["stderr"] = r.rc, r.stdout, len(r.stderr)
    else:
        got = []
        feed = remote.lines(lambda line: got.append([len(line), line[:8]]))
        r = ctl.run(["sh", "-c", f"head -c {flood} /dev/zero; printf '\\nlast'"], timeout=300, on_stdout=feed)
        feed.close()
        said["rc"], said["lines"], said["kept"] = r.rc, got, len(r.stdout)
except remote.RemoteError as exc:
    said["error"] = f"{type(exc).__name__}: {exc}"
said["before"] = before
# VmHWM: this process image's peak. (Not ru_maxrss: exec keeps the parent's peak in it, and a
# long test session forks us at hundreds of MiB.)
said["peak"] = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def emulated_options() -> dict:
    """One host (`emu`, tests/conftest.py)."""
    return {"n": 1}


def _flood(emu, mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(emu.dir), mode, str(FLOOD)], capture_output=True,
                          text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    said["grew"] = said["peak"] - said["before"]
    print(f"\n{mode}: grew {said['grew'] / MiB:.1f} MiB "
          f"(before {said['before'] / MiB:.1f} MiB, peak {said['peak'] / MiB:.1f} MiB)", file=sys.stderr)
    return said


def test_200_mib_on_stdout_without_a_reader_is_refused_naming_the_host(emu):
    said = _flood(emu, "stdout")
    assert "error" in said, said
    assert said["error"].startswith("OutputTooLarge: on host h1: ") and "more than 64 MiB on stdout" in said["error"]
    assert said["grew"] < remote.STDOUT_MAX + SLACK, said


def test_200_mib_on_stderr_keeps_its_end_only(emu):
    said = _flood(emu, "stderr")
    assert said.get("rc") == 0 and said["stdout"] == "done\n", said
    assert said["stderr"] == remote.STDERR_KEEP
    assert said["grew"] < remote.STDERR_KEEP + SLACK, said


def test_200_mib_without_a_newline_to_a_line_reader_waits_for_no_newline(emu):
    said = _flood(emu, "lines")
    assert said.get("rc") == 0, said
    # the endless line is passed on cut at LINE_MAX, its rest dropped; the next line comes whole
    assert said["lines"] == [[remote.LINE_MAX, "\0" * 8], [4, "last"]], said["lines"][:3]
    assert said["kept"] <= remote.STREAM_KEEP
    assert said["grew"] < remote.STREAM_KEEP + remote.LINE_MAX + SLACK, said
