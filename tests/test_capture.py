"""`testbed capture` (testbed.observe.capture): pcap of one link end, bounded, owned, cleaned.

Root-free: the pcap stream counter, durations, directions, link resolution from a state built
in memory, the command line, a missing tcpdump. With root (each test its own 2-worker star,
w0 and w1 on s0, brought up through the `testbed` fixture and down afterwards): the CLI as a
user runs it, in a subprocess, against pings between the testbed's own workers; after each,
no tcpdump (nor its `timeout` parent) is left in the testbed's namespaces.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import requires
from waiting import wait_for, wait_gone

from testbed.observe import capture as cap
from testbed.observe import capture_target

IS_ROOT = os.geteuid() == 0
STAR = ["params.n=2", "tiers.host.delay=0"]     # plain veths; w0 10.0.0.2, w1 10.0.0.3 on s0


# -- root-free --------------------------------------------------------------------------------------------------

def _pcap(n: int, sizes=(60, 1514, 0, 65226)) -> bytes:
    head = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1)
    body = b""
    for i in range(n):
        size = sizes[i % len(sizes)]
        body += struct.pack("<IIII", i, 0, size, size) + bytes(size)
    return head + body


@pytest.mark.parametrize("chunk", [1, 7, 16, 100, 1 << 20])
def test_counter_counts_records_across_any_chunking(chunk):
    data = _pcap(9)
    c = cap.PcapCounter()
    for i in range(0, len(data), chunk):
        c.feed(data[i:i + chunk])
        assert c.packets <= 9
    assert (c.packets, c.bytes, c.whole) == (9, len(data), True)
    c = cap.PcapCounter()
    c.feed(data[:-3])
    assert c.packets == 9 and not c.whole     # the last record is cut short


def test_counter_refuses_what_is_not_pcap():
    with pytest.raises(Exception, match="no pcap stream"):
        cap.PcapCounter().feed(b"listening on eth0, link-type EN10MB\n")


@pytest.mark.parametrize("text,seconds", [("60", 60), ("60s", 60), ("500ms", 0.5), ("2m", 120), ("2min", 120),
                                          ("1h", 3600), ("0", 0), ("1.5s", 1.5)])
def test_duration(text, seconds):
    assert cap.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5x", "-1s", "soon", "-2m"])
def test_bad_duration_names_the_value(text):
    with pytest.raises(capture_target.CaptureError, match=re.escape(repr(text))) as ei:
        cap.parse_duration(text)
    assert ei.value.exit_code == 2


def _star_state(name="tx"):
    """A running star's state as `resolve` reads it (topology snapshot, link records), made in memory."""
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network

    topo = load_topology("star", ["params.n=2"])
    plan = plan_network(topo)
    links = [{"index": lp.index, "endpoints": [lp.a.node, lp.b.node], "ifnames": [lp.a.ifname, lp.b.ifname],
              "tier": topo.links[lp.index].tier, "kind": lp.kind, "state": "up"} for lp in plan.links]
    return {"name": name, "topology": topo.to_json(), "links": links, "resources": {"delay_lines": []}}


def test_resolve_names_a_link_as_the_link_verbs_do():
    st = _star_state()
    t = capture_target.resolve("tx", "w0", "s0", st=st)
    assert (t.node, t.peer, t.ifname, t.netns, t.direction, t.link) == ("w0", "s0", "eth0", "tb-tx-w0", None, 0)
    t = capture_target.resolve("tx", "s0", "w1", st=st)           # either order; the first is captured
    assert (t.node, t.ifname, t.peer_ifname) == ("s0", "eth1", "eth0")
    t = capture_target.resolve("tx", "w1", "s0", at="s0", st=st)
    assert (t.node, t.ifname) == ("s0", "eth1")
    t = capture_target.resolve("tx", "s0", "eth1", st=st)         # a node's interface
    assert (t.node, t.peer, t.link) == ("s0", "w1", 1)
    t = capture_target.resolve("tx", "w1", st=st)                 # a worker's only link
    assert (t.node, t.peer, t.ifname) == ("w1", "s0", "eth0")


@pytest.mark.parametrize("direction,at,want", [
    ("both", None, None), ("out", None, "out"), ("in", None, "in"), ("A->B", None, "out"), ("B->A", None, "in"),
    ("w0->s0", None, "out"), ("s0->w0", None, "in"), ("w0 -> s0", None, "out"),
    ("w0->s0", "s0", "in"), ("A->B", "s0", "in"), ("out", "s0", "out")])
def test_direction_is_seen_from_the_captured_end(direction, at, want):
    assert capture_target.resolve("tx", "w0", "s0", at=at, direction=direction, st=_star_state()).direction == want


@pytest.mark.parametrize("args,kw,message", [
    (("w9", "s0"), {}, "no node 'w9'"),
    (("w0", "w1"), {}, "no link between w0 and w1"),
    (("w0", "eth7"), {}, "'eth7' is neither a node"),
    (("s0",), {}, "s0 has 2 links"),
    (("w0", "s0"), {"at": "w1"}, "--at: w1 is not an end of link w0 <-> s0"),
    (("w0", "s0"), {"at": "w7"}, "--at: testbed 'tx' has no node 'w7'"),
    (("w0", "s0"), {"direction": "w1->s0"}, "got 'w1->s0'"),
])
def test_resolve_errors_name_the_value(args, kw, message):
    with pytest.raises(capture_target.CaptureError) as ei:
        capture_target.resolve("tx", *args, st=_star_state(), **kw)
    assert message in str(ei.value) and ei.value.exit_code == 2


def test_argv_runs_tcpdump_in_the_namespace_bounded_and_owned():
    t = capture_target.resolve("tx", "w0", "s0", direction="out", st=_star_state())
    argv = cap.Capture(t, count=5, duration_s=2.5, snaplen=128, bpf="icmp or arp").argv()
    assert argv[:3] == ["setpriv", "--pdeathsig", "INT"]
    assert argv[3:5] == ["nsenter", "--net=/run/netns/tb-tx-w0"]
    assert argv[5:11] == ["timeout", "-s", "INT", "-k", str(cap.KILL_AFTER_S), "2.500s"]
    td = argv[11:]
    assert td[:8] == ["tcpdump", "-i", "eth0", "-w", "-", "-U", "--immediate-mode", "-n"]
    assert td[td.index("-c") + 1] == "5" and td[td.index("-s") + 1] == "128" and td[td.index("-Q") + 1] == "out"
    assert td[-2:] == ["--", "icmp or arp"]
    unbounded = cap.Capture(t, count=0, duration_s=0).argv()
    assert "-c" not in unbounded and unbounded[10] == "0"


def test_missing_tcpdump_says_how_to_install_it(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nsenter", "setpriv", "timeout"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    c = cap.Capture(capture_target.resolve("tx", "w0", "s0", st=_star_state()))
    with pytest.raises(cap.CapabilityError, match=re.escape("apt-get install -y tcpdump")) as ei:
        c.start()
    assert ei.value.exit_code == 3 and c.proc is None


def test_summary_names_why_it_stopped_and_what_was_lost():
    t = capture_target.resolve("tx", "w0", "s0", st=_star_state())
    res = cap.Result(packets=7, bytes=2048, elapsed_s=1.25, reason="count", returncode=0, captured=7, received=9,
                     dropped=2, messages=["something odd"])
    first, *rest = cap.describe_result(res, t, "x.pcap", 7, 60)
    assert first == "7 packet(s) (2 KiB) from w0 eth0 in 1.2 s to x.pcap; --count 7 reached"
    assert "dropped 2 packet(s)" in rest[0] and "--snaplen 128" in rest[0] and rest[1] == "tcpdump: something odd"
    killed = cap.Result(packets=0, bytes=24, elapsed_s=0.1, reason="error", returncode=128 + 9)
    assert cap.describe_result(killed, t, "-", 0, 0)[0].endswith("tcpdump failed (tcpdump killed by SIGKILL)")
    assert cap.describe_result(dataclasses.replace(killed, returncode=-15), t, "-", 0, 0)[0].endswith(
        "(killed by SIGTERM)")


def test_help_says_what_the_capture_sees():
    r = subprocess.run([sys.executable, "-m", "testbed", "capture", "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for words in ("10000 packets or 60 s", "--count 0 --duration 0", "delay line", "larger than the MTU",
                  "after its shaping", "time dilation", "| tcpdump -n -r -", "wireshark -k -i -"):
        assert words in text, words


# -- with root: a real testbed ------------------------------------------------------------------------------------

def _namespaces(name):
    from testbed.net import names, netns

    return netns.list_names(names.netns_prefix(name))


def _capture_processes(name) -> dict[int, str]:
    """tcpdump and timeout processes in the testbed's namespaces: pid -> command name."""
    from testbed.net import netns

    out = {}
    for pid in netns.pids_in(_namespaces(name)):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm in ("tcpdump", "timeout") and state not in ("Z", "X"):
            out[pid] = comm
    return out


def _none_left(name, within=3.0):
    """No capture process is left in the testbed's namespaces (those that were there end within
    `within` s; 0: none may be there now, e.g. after a command that was refused)."""
    if not within:
        assert _capture_processes(name) == {}, f"capture processes left behind: {_capture_processes(name)}"
        return
    wait_gone(lambda: _capture_processes(name), timeout=within, what=f"the capture processes of {name} to end")


class Cli:
    """`testbed capture -n NAME ARGS...` in a subprocess; started() returns once it says it captures."""

    def __init__(self, name, *args, stdout=subprocess.DEVNULL):
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed", "capture", "-n", name, *args],
                                     stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.err = b""

    def started(self, timeout=15.0) -> "Cli":
        deadline = time.monotonic() + timeout
        fd = self.proc.stderr.fileno()
        while b"capturing " not in self.err:
            left = deadline - time.monotonic()
            assert left > 0, f"capture did not start: {self.err.decode()}"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                assert chunk, f"capture exited before it started (status {self.proc.wait()}): {self.err.decode()}"
                self.err += chunk
        return self

    def finish(self, timeout=30.0) -> tuple[int, str]:
        rest = self.proc.stderr.read()
        self.proc.wait(timeout=timeout)
        return self.proc.returncode, (self.err + rest).decode()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def star(testbed):
    """(name, addresses) of a fresh 2-worker star; no capture process may outlive the test."""
    requires.need("tcpdump")
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network

    topo = load_topology("star", STAR)
    st = testbed(topo)
    name = st["name"]
    plan = plan_network(topo)
    clis: list[Cli] = []
    yield name, {w: plan.worker_address(w) for w in topo.workers}, clis
    for c in clis:
        c.kill()
    _none_left(name)


def _start(star, *args, stdout=subprocess.DEVNULL) -> Cli:
    name, _, clis = star
    c = Cli(name, *args, stdout=stdout)
    clis.append(c)
    return c.started()


def ping(name, src, dst_ip, count=2, interval="0.1"):
    r = subprocess.run(["ip", "netns", "exec", f"tb-{name}-{src}", "ping", "-n", "-c", str(count), "-i", interval,
                        "-W", "2", dst_ip], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def read_pcap(path_or_bytes) -> list[str]:
    """tcpdump -n -r's lines (the file must be valid pcap: tcpdump -r fails otherwise)."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        r = subprocess.run(["tcpdump", "-n", "-r", "-"], input=path_or_bytes, capture_output=True, timeout=30)
    else:
        r = subprocess.run(["tcpdump", "-n", "-r", str(path_or_bytes)], capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode().splitlines()


def _icmp(lines, kind):
    return [ln for ln in lines if f"ICMP echo {kind}" in ln]


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_ping_through_a_captured_link_lands_in_the_file(star, tmp_path):
    name, ip, _ = star
    out = tmp_path / "w0.pcap"
    c = _start(star, "w0", "s0", "-w", str(out), "-c", "4", "-f", "icmp")
    assert set(_capture_processes(name).values()) == {"tcpdump", "timeout"}   # the check sees them
    ping(name, "w0", ip["w1"], count=2)
    rc, err = c.finish()
    assert rc == 0, err
    assert "4 packet(s)" in err and "--count 4 reached" in err
    lines = read_pcap(out)
    assert len(_icmp(lines, "request")) == 2 and len(_icmp(lines, "reply")) == 2
    assert all(f"IP {ip['w0']} > {ip['w1']}: ICMP echo request" in ln for ln in _icmp(lines, "request"))
    assert all(f"IP {ip['w1']} > {ip['w0']}: ICMP echo reply" in ln for ln in _icmp(lines, "reply"))
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_stdout_streams_valid_pcap_and_nothing_else(star):
    name, ip, _ = star
    c = _start(star, "w1", "-w", "-", "-c", "2", "-f", "icmp", stdout=subprocess.PIPE)   # w1's only link
    ping(name, "w0", ip["w1"], count=1)
    data = c.proc.stdout.read()
    rc, err = c.finish()
    assert rc == 0, err
    assert data[:4] in cap.PCAP_MAGICS, data[:4]
    counter = cap.PcapCounter()
    counter.feed(data)                 # stdout is exactly a pcap stream: a header and 2 whole records
    assert counter.whole and counter.packets == 2
    lines = read_pcap(data)
    assert len(_icmp(lines, "request")) == 1 and len(_icmp(lines, "reply")) == 1
    assert "to stdout" in err
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_count_bound_holds(star, tmp_path):
    name, ip, _ = star
    out = tmp_path / "c.pcap"
    c = _start(star, "w0", "s0", "-w", str(out), "-c", "3", "-f", "icmp", "--duration", "0")
    ping(name, "w0", ip["w1"], count=6, interval="0.05")
    rc, err = c.finish()
    assert rc == 0 and "--count 3 reached" in err, err
    assert len(read_pcap(out)) == 3
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_duration_bound_holds_and_the_file_is_valid(star, tmp_path):
    name, ip, _ = star
    out = tmp_path / "d.pcap"
    t0 = time.monotonic()
    c = _start(star, "w0", "s0", "-w", str(out), "--duration", "1.5", "-c", "0")
    ping(name, "w0", ip["w1"], count=2)
    rc, err = c.finish()
    took = time.monotonic() - t0
    print(f"capture --duration 1.5, from the command's start to its end: {took:.2f} s")
    assert rc == 0 and "--duration 1.5 s reached" in err, err
    assert 1.5 <= took < 8, took   # at least the duration; 8: a hang bound (1.90 s here, 2026-12-02)
    assert len(_icmp(read_pcap(out), "request")) == 2
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
@pytest.mark.parametrize("args,kind", [
    (["w0", "s0", "--direction", "w0->s0"], "request"),   # at w0: out
    (["w0", "s0", "--direction", "in"], "reply"),         # at w0: in
    (["w0", "s0", "--at", "s0", "--direction", "w0->s0"], "request"),   # at s0: in
    (["s0", "eth0", "--direction", "out"], "reply"),      # s0's port toward w0: out
])
def test_direction_keeps_one_way(star, tmp_path, args, kind):
    name, ip, _ = star
    out = tmp_path / "q.pcap"
    c = _start(star, *args, "-w", str(out), "-c", "3", "-f", "icmp")
    ping(name, "w0", ip["w1"], count=3)
    rc, err = c.finish()
    assert rc == 0, err
    lines = read_pcap(out)
    assert len(lines) == 3 and len(_icmp(lines, kind)) == 3, lines
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_ends_it_cleanly_with_every_packet(star, tmp_path, sig):
    name, ip, _ = star
    out = tmp_path / "i.pcap"
    c = _start(star, "w0", "s0", "-w", str(out), "-c", "0", "--duration", "0", "-f", "icmp")
    assert len(_capture_processes(name)) == 2
    ping(name, "w0", ip["w1"], count=3, interval="0.05")
    c.proc.send_signal(sig)
    rc, err = c.finish()
    assert rc == 0 and "; stopped" in err, err
    lines = read_pcap(out)          # valid, and nothing lost at the stop (--immediate-mode)
    assert len(_icmp(lines, "request")) == 3 and len(_icmp(lines, "reply")) == 3, lines
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_killed_cli_leaves_no_capture_behind(star, tmp_path):
    name, _, _ = star
    c = _start(star, "w0", "s0", "-w", str(tmp_path / "k.pcap"), "-c", "0", "--duration", "0")
    assert len(_capture_processes(name)) == 2
    c.proc.kill()                   # no code of ours runs: the parent-death signal ends the chain
    c.proc.wait()
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_reader_going_away_ends_the_capture(star):
    name, ip, _ = star
    c = _start(star, "w0", "s0", "-w", "-", "-c", "0", "--duration", "0", stdout=subprocess.PIPE)
    assert c.proc.stdout.read(24)[:4] in cap.PCAP_MAGICS
    c.proc.stdout.close()           # like `| head -c 24`
    ping(name, "w0", ip["w1"], count=2)
    rc, err = c.finish(timeout=15)
    assert rc == 0 and "reader of the output went away" in err, err
    assert "Exception" not in err and "Traceback" not in err, err
    _none_left(name)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
@pytest.mark.parametrize("args,code,message", [
    (["w0", "s7"], 2, "'s7' is neither a node of testbed"),
    (["w9", "s0"], 2, "no node 'w9'"),
    (["w0", "w1"], 2, "no link between w0 and w1"),
    (["w0", "s0", "--at", "w1"], 2, "--at: w1 is not an end"),
    (["w0", "s0", "-d", "sideways"], 2, "got 'sideways'"),
    (["w0", "s0", "-f", "tcp portt 80"], 2, "--filter 'tcp portt 80'"),
    (["w0", "s0", "--duration", "5x"], 2, "got '5x'"),
    (["w0", "s0", "-c", "-3"], 2, "got -3"),
])
def test_bad_names_exit_2_and_leave_nothing(star, tmp_path, args, code, message):
    name, _, _ = star
    out = tmp_path / "never.pcap"
    r = subprocess.run([sys.executable, "-m", "testbed", "capture", "-n", name, *args, "-w", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()
    _none_left(name, within=0)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_unknown_testbed_and_a_terminal_are_refused(star):
    name, _, _ = star
    r = subprocess.run([sys.executable, "-m", "testbed", "capture", "-n", f"{name}x", "w0", "s0", "-w", "-"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4 and f"no testbed named '{name}x'" in r.stderr, r.stderr   # as every verb says it
    import pty

    parent, child = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "testbed", "capture", "-n", name, "w0", "s0"], stdout=child,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(child)
        os.close(parent)
    assert r.returncode == 2 and "stdout is a terminal" in r.stderr, r.stderr
    _none_left(name, within=0)


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_testbed_brought_down_ends_the_capture(star, tmp_path):
    from testbed import lifecycle

    name, ip, _ = star
    out = tmp_path / "down.pcap"
    c = _start(star, "w0", "s0", "-w", str(out), "-c", "0", "--duration", "0", "-f", "icmp")
    ping(name, "w0", ip["w1"], count=1)
    # the request has come through the stream into the file (a record still being written: not yet)
    wait_for(lambda: _icmp(read_pcap(out), "request"), timeout=10, what=f"the echo request in {out}",
             ignore=AssertionError)
    assert lifecycle.down(name) == []
    rc, err = c.finish(timeout=30)
    assert rc == 1 and "went away" in err and "holds what came before" in err, err
    assert len(_icmp(read_pcap(out), "request")) == 1        # what came before is there, readable
    assert _namespaces(name) == []


# -- a delay line, Docker workers, netem ---------------------------------------------------------------------------

def _timestamps(path) -> dict[tuple[str, str], float]:
    """(kind, seq) -> time of each ICMP echo in a capture (tcpdump -tt)."""
    r = subprocess.run(["tcpdump", "-n", "-tt", "-r", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^(\d+\.\d+) .*ICMP echo (request|reply), id \d+, seq (\d+)", line)
        if m:
            out[(m.group(2), m.group(3))] = float(m.group(1))
    return out


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_delay_line_sits_between_the_two_ends(testbed, tmp_path):
    """Without netem (forced), a 10 ms link is a delay line: w0's end sees a request 10 ms before s0's
    end does, s0's end a reply 10 ms before w0's."""
    requires.need("tcpdump")
    from testbed.net import capabilities
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network

    caps = capabilities.probe()
    requires.need("tun", ok=caps.tun)
    topo = load_topology("star", ["params.n=2", "tiers.host.delay=10ms"])
    st = testbed(topo, caps=dataclasses.replace(caps, netem=False))
    name = st["name"]
    assert st["resources"]["delay_lines"], "no delay line was built"
    w1 = plan_network(topo).worker_address("w1")
    clis = [Cli(name, "w0", "s0", "-w", str(tmp_path / "w0.pcap"), "-c", "4", "-f", "icmp"),
            Cli(name, "w0", "s0", "--at", "s0", "-w", str(tmp_path / "s0.pcap"), "-c", "4", "-f", "icmp")]
    try:
        for c in clis:
            c.started()
        ping(name, "w0", w1, count=2, interval="0.2")
        for c in clis:
            rc, err = c.finish()
            assert rc == 0 and "this link is a delay line" in err, err
    finally:
        for c in clis:
            c.kill()
    at_w0, at_s0 = _timestamps(tmp_path / "w0.pcap"), _timestamps(tmp_path / "s0.pcap")
    for seq in ("1", "2"):
        there = at_s0[("request", seq)] - at_w0[("request", seq)]
        back = at_w0[("reply", seq)] - at_s0[("reply", seq)]
        for d in (there, back):
            assert 0.0095 <= d < 0.030, (seq, there, back)
    _none_left(name)


@pytest.mark.netem
@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_with_netem_the_sending_end_sees_packets_after_its_delay(testbed, tmp_path):
    """netem delays in the egress qdisc, before the capture point: on a star with delay d on every
    link direction, w0 sees its request leave at t+d and the reply come at t+4d (3d apart, not the
    RTT's 4d)."""
    requires.need("tcpdump")
    from testbed.net import capabilities
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network

    requires.need("netem", ok=capabilities.probe().netem)
    d = 0.020
    topo = load_topology("star", ["params.n=2", "tiers.host.delay=20ms"])
    st = testbed(topo)
    name = st["name"]
    assert not st["resources"].get("delay_lines")
    w1 = plan_network(topo).worker_address("w1")
    c = Cli(name, "w0", "s0", "-w", str(tmp_path / "w0.pcap"), "-c", "10", "-f", "icmp")
    try:
        c.started(timeout=60)
        ping(name, "w0", w1, count=5, interval="0.3")
        rc, err = c.finish(timeout=60)
        assert rc == 0, err
    finally:
        c.kill()
    ts = _timestamps(tmp_path / "w0.pcap")
    gaps = [ts[("reply", str(s))] - ts[("request", str(s))] for s in range(1, 6)]
    # 3d if the capture point is after netem, 4d if before; a slow (emulated) machine only adds time
    assert all(g >= 2.5 * d for g in gaps) and min(gaps) < 3.5 * d, gaps
    _none_left(name)


@pytest.mark.docker
@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tcpdump)")
def test_docker_worker_link(testbed, tmp_path, monkeypatch):
    from testbed.runtime import docker as dk
    from testbed.topology.loader import load_topology
    from testbed.topology.plan import plan_network

    requires.need("tcpdump")
    requires.need("docker", ok=dk.daemon_available(), why=f"no Docker daemon at {dk.docker_host()}")
    requires.need("docker", ok=dk.image_available(os.environ.get("TESTBED_WORKER_IMAGE", dk.DEFAULT_IMAGE)),
                  why="the worker image is missing (make image)")
    monkeypatch.chdir(tmp_path)
    topo = load_topology("star", STAR)
    st = testbed(topo, runtime="docker")
    name = st["name"]
    ip = {w: plan_network(topo).worker_address(w) for w in topo.workers}
    out = tmp_path / "dk.pcap"
    c = Cli(name, "w0", "s0", "-w", str(out), "-c", "2", "-f", "icmp")
    try:
        c.started(timeout=60)
        ping(name, "w0", ip["w1"], count=1)
        rc, err = c.finish()
        assert rc == 0, err
    finally:
        c.kill()
    lines = read_pcap(out)
    assert _icmp(lines, "request") and f"IP {ip['w0']} > {ip['w1']}" in _icmp(lines, "request")[0]
    _none_left(name)
