"""`testbed capture` on a testbed over several hosts, end to end, against two emulated hosts
(testbed/cluster/emulate.py): the capture runs on the host that holds the captured end, and its
pcap stream comes back to the controller as it is written, to a file or to stdout; a Ctrl-C on
the controller ends it there and leaves a valid pcap here.

One testbed for the module: topologies/two-sides.yaml pinned so that h1 holds w0, w1 and s0 and h2
holds w2, w3 and s1; s0-s1 is the cut link, and s1's end of it (a VXLAN device in s1's namespace,
on h2) is what every test captures while w0 pings w2 across it. The CLI runs as a process, as a
user runs it; the controller keeps its record in a state directory of its own (TESTBED_STATE_DIR).
The pcap files are read with struct: a reader of our own, so nothing here trusts tcpdump -r.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_hosts import REPO, TOPOLOGY, on_host, tb
from waiting import capturing, wait_for, wait_gone

pytestmark = [pytest.mark.root,
              pytest.mark.requires("sshd", "tcpdump")]


@pytest.fixture(scope="module")
def line(line, emu):
    """(testbed name, w0's address, w2's address, the inode of s1's network namespace on h2): the
    shared pinned line (tests/conftest.py), with what the captures here need to know of it."""
    from testbed.net import names
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network

    plan = plan_network(load_topology(str(TOPOLOGY), []))
    ns = int(on_host(emu, "h2", "stat", "-L", "-c", "%i", f"/run/netns/{names.netns(line, 's1')}").stdout)
    return line, plan.worker_address("w0"), plan.worker_address("w2"), ns


# -- what runs on h2 -------------------------------------------------------------------------------------------


def capture_processes(ns_inode: int) -> list[int]:
    """tcpdump and its timeout(1) in the namespace (the emulated hosts share this machine's PIDs)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() not in ("tcpdump", "timeout") \
                    or os.stat(d / "ns" / "net").st_ino != ns_inode \
                    or (d / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
        except OSError:
            continue
        found.append(int(d.name))
    return found


def remote_clis(name: str) -> list[int]:
    """`testbed capture` processes of this testbed other than the controller's (those on h2)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"capture" in cmd and name.encode() in cmd and b"--write" in cmd:
                found.append(int(d.name))
    return found


def none_left(name: str, ns_inode: int, within: float = 10.0) -> None:
    wait_gone(lambda: {k: v for k, v in (("tcpdump", capture_processes(ns_inode)),
                                         ("testbed capture", remote_clis(name))) if v},
              timeout=within, interval=0.1, what="the capture's processes on h2 to end")


def start(name: str, ns_inode: int, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """`testbed capture ARGS` on the controller, returned once tcpdump captures on h2."""
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "capture", "--name", name, *args], cwd=REPO,
                            stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def capturing_on_h2() -> bool:
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"the capture ended before it started on h2 (status {proc.returncode}): "
                                 f"{err.decode()}")
        return any(capturing(p) for p in capture_processes(ns_inode))

    try:
        wait_for(capturing_on_h2, timeout=60, interval=0.1,
                 what="tcpdump on h2 to capture (its packet socket bound to s1's end)")
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return proc


def ping(name: str, dst: str, count: int, interval: str = "0.2") -> subprocess.CompletedProcess:
    return tb("exec", "w0", "--name", name, "--", "ping", "-n", "-c", str(count), "-i", interval, "-W", "2", dst)


# -- pcap, read here -------------------------------------------------------------------------------------------


def records(data: bytes) -> tuple[int, list[bytes]]:
    """(link type, the packets) of a whole pcap stream; asserts it is one (no record cut short)."""
    assert len(data) >= 24, f"no pcap header ({len(data)} bytes)"
    endian = {b"\xd4\xc3\xb2\xa1": "<", b"\xa1\xb2\xc3\xd4": ">", b"\x4d\x3c\xb2\xa1": "<",
              b"\xa1\xb2\x3c\x4d": ">"}.get(data[:4])
    assert endian is not None, f"not pcap: begins with {data[:4].hex()}"
    major, _minor, _zone, _sigfigs, snaplen, linktype = struct.unpack_from(endian + "HHiIII", data, 4)
    assert major == 2 and snaplen > 0
    out, pos = [], 24
    while pos < len(data):
        assert pos + 16 <= len(data), "a record header cut short"
        _sec, _frac, incl, orig = struct.unpack_from(endian + "IIII", data, pos)
        assert incl <= orig and pos + 16 + incl <= len(data), "a record cut short"
        out.append(data[pos + 16:pos + 16 + incl])
        pos += 16 + incl
    return linktype, out


def icmp(frame: bytes) -> tuple[str, str, int]:
    """(source, destination, ICMP type) of an Ethernet frame carrying IPv4 ICMP."""
    assert struct.unpack_from("!H", frame, 12)[0] == 0x0800, "not IPv4"
    ip = frame[14:]
    assert ip[9] == 1, f"not ICMP (protocol {ip[9]})"
    return str(ipaddress.IPv4Address(ip[12:16])), str(ipaddress.IPv4Address(ip[16:20])), ip[(ip[0] & 0xF) * 4]


def pings_between(data: bytes, a: str, b: str) -> list[tuple[str, str, int]]:
    linktype, packets = records(data)
    assert linktype == 1, f"link type {linktype}, not Ethernet"
    seen = [icmp(p) for p in packets]
    assert all(p in ((a, b, 8), (b, a, 0)) for p in seen), seen   # echo requests a -> b, replies b -> a
    return seen


# -- the tests ---------------------------------------------------------------------------------------------------


def test_capture_of_the_remote_end_of_the_cut_link_comes_back_as_pcap(emu, line, tmp_path):
    """s1's end of s0-s1 (h2's VXLAN end): 6 packets into a file here, then 4 to stdout; each a
    valid pcap of the pings w0 -> w2 across the cut link, written byte for byte as they came."""
    name, w0, w2, ns = line
    out = tmp_path / "s1.pcap"
    proc = start(name, ns, "s1", "s0", "-w", str(out), "--count", "6", "--filter", "icmp")
    ping(name, w2, 3)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 0, err
    assert f"on host h2 (s1's), to {out} here" in err, err   # said here at once
    assert "--count 6 reached" in err, err                    # the host's summary, passed on
    assert "6 packet(s) (" in err and f"from host h2 to {out}" in err, err   # what came here
    seen = pings_between(out.read_bytes(), w0, w2)
    assert sorted(seen) == sorted([(w0, w2, 8)] * 3 + [(w2, w0, 0)] * 3), seen
    none_left(name, ns)

    # to stdout (the default when it is a pipe): the same stream, and nothing else on stdout
    proc = start(name, ns, "s1", "s0", "-c", "4", "-f", "icmp")
    ping(name, w2, 2)
    data, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert data[:24] == out.read_bytes()[:24]   # the same header (format, snap length, link type)
    assert sorted(pings_between(data, w0, w2)) == sorted([(w0, w2, 8)] * 2 + [(w2, w0, 0)] * 2)
    none_left(name, ns)


def test_unknown_nodes_and_links_are_refused_here_naming_them(emu, line, tmp_path):
    name, _, _, _ = line
    for args, message in ((["w9", "s0"], "no node 'w9'"), (["w0", "w2"], "no link between w0 and w2"),
                          (["s0", "s1", "--at", "w2"], "--at: w2 is not an end"),
                          (["s1", "eth9"], "'eth9' is neither a node")):
        r = tb("capture", *args, "--name", name, "-w", str(tmp_path / "never.pcap"), check=False)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert "on host" not in r.stderr, r.stderr   # (refused before any host was asked)
    assert not (tmp_path / "never.pcap").exists()


def test_ctrl_c_ends_the_capture_there_and_leaves_a_valid_pcap_here(emu, line, tmp_path):
    name, w0, w2, ns = line
    out = tmp_path / "ctrl-c.pcap"
    proc = start(name, ns, "s1", "s0", "-w", str(out), "-c", "0", "--duration", "0", "-f", "icmp")
    pinger = subprocess.Popen([sys.executable, "-m", "testbed", "exec", "w0", "--name", name, "--", "ping", "-n",
                               "-c", "25", "-i", "0.2", "-W", "2", w2], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        # four pings have come back here through the stream (a record still being written is "not yet")
        wait_for(lambda: len(pings_between(out.read_bytes(), w0, w2)) >= 4, timeout=30, interval=0.1,
                 what=f"4 pings in {out}", ignore=(OSError, AssertionError))
        assert proc.poll() is None, proc.communicate()[1].decode()
        proc.send_signal(signal.SIGINT)   # what Ctrl-C on the controller's terminal does
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        err = err.decode()
        took = time.monotonic() - t0
        print(f"the Ctrl-C ended the capture across hosts in {took:.2f} s")
        assert took < 15   # a bound on a hang, not a timing claim: 0.52 s here (2026-12-02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pinger.wait(timeout=60)
    assert proc.returncode == 0, err   # as a Ctrl-C on one host: stopped, status 0
    assert "passing the Ctrl-C on to h2" in err and "; stopped" in err, err
    seen = pings_between(out.read_bytes(), w0, w2)   # valid: whole records only
    assert len(seen) >= 4, seen
    none_left(name, ns)
