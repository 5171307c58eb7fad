"""testbed.net.rtnl: the builder's batched rtnetlink requests.

Encodings: each is compared byte for byte with what pyroute2 (which the rest of testbed uses,
and which built these same requests before) compiles for the same call (IPBatch: no request is
sent). Kernel: a batch in a namespace of its own makes what it asks for, a failed request is named
and does not hide the ones before it, and the link dump reads names, indexes and states.
"""

from __future__ import annotations

import os
import struct
import subprocess
import uuid

import pytest

from testbed.net import netns, rtnl

pyroute2_linux = pytest.importorskip("pyroute2.iproute.linux")


def _compiled(call) -> list[tuple[int, int, bytes]]:
    """(type, flags, body) of every message pyroute2 compiles for call(ipb)."""
    ipb = pyroute2_linux.IPBatch()
    try:
        call(ipb)
        data = bytes(ipb.asyncore.batch)
    finally:
        ipb.close()
    out, off = [], 0
    while off < len(data):
        length, kind, flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
        out.append((kind, flags, data[off + 16:off + length]))
        off += (length + 3) & ~3
    return out


@pytest.mark.parametrize("ours, theirs", [
    (lambda: rtnl.address(20, "10.0.0.1", 24),
     lambda b: b.addr("add", index=20, address="10.0.0.1", prefixlen=24)),
    (lambda: rtnl.neighbour(20, "10.0.0.2", "02:00:00:00:00:01"),
     lambda b: b.neigh("add", dst="10.0.0.2", lladdr="02:00:00:00:00:01", ifindex=20, state="permanent")),
    (lambda: rtnl.route("10.1.0.0/24", [("10.0.0.2", 20)]),
     lambda b: b.route("add", dst="10.1.0.0/24", gateway="10.0.0.2", oif=20)),
    (lambda: rtnl.route("10.1.0.0/24", [("10.0.0.2", 20), ("10.0.0.3", 21)]),
     lambda b: b.route("add", dst="10.1.0.0/24", multipath=[{"gateway": "10.0.0.2", "oif": 20},
                                                             {"gateway": "10.0.0.3", "oif": 21}])),
    (lambda: rtnl.route("0.0.0.0/0", [("10.0.0.1", 17)]),
     lambda b: b.route("add", dst="0.0.0.0/0", gateway="10.0.0.1", oif=17)),
    (lambda: rtnl.route("10.9.0.0/16", []),
     lambda b: b.route("add", dst="10.9.0.0/16", type="unreachable")),
    (lambda: rtnl.bridge("br", "02:00:00:00:00:0a"),
     lambda b: b.link("add", ifname="br", kind="bridge", address="02:00:00:00:00:0a", br_stp_state=0,
                      br_forward_delay=0, br_mcast_snooping=0)),
])
def test_encodings_are_pyroute2s(ours, theirs):
    [(_kind, _flags, body)] = _compiled(theirs)
    assert ours() == body


def test_a_veth_is_pyroute2s_with_the_peers_index_kept():
    """pyroute2 0.9.7 drops the `index` of a veth's peer (the kernel then picks one); ours is sent,
    so both ends get the ifindex the builder chose. Everything else is the same bytes."""
    ours = rtnl.veth("a", 16, 7, "02:00:00:00:00:01", 9000, "b", 17, 8, "02:00:00:00:00:02")
    [(_kind, _flags, body)] = _compiled(
        lambda b: b.link("add", ifname="a", kind="veth", net_ns_fd=7, index=16, address="02:00:00:00:00:01",
                         mtu=9000, peer={"ifname": "b", "net_ns_fd": 8, "index": 17,
                                         "address": "02:00:00:00:00:02", "mtu": 9000}))
    peer = ours.index(struct.pack("=HH", 0x38, rtnl.VETH_INFO_PEER)) + 4   # the peer's ifinfomsg
    assert struct.unpack_from("=i", ours, peer + 4)[0] == 17
    assert struct.unpack_from("=i", body, peer + 4)[0] == 0
    assert ours[:peer + 4] + b"\0" * 4 + ours[peer + 8:] == body


@pytest.mark.parametrize("kw", [{}, {"master": 5}, {"mac": "02:00:00:00:00:09"}, {"alias": "testbed:x:/run/tb"},
                                {"master": 5, "mac": "02:00:00:00:00:09"}])
def test_link_up_is_pyroute2s(kw):
    theirs = {"master": kw.get("master"), "address": kw.get("mac"), "ifalias": kw.get("alias")}
    [(_kind, flags, body)] = _compiled(lambda b: b.link("set", index=20, state="up",
                                                        **{k: v for k, v in theirs.items() if v is not None}))
    assert flags == rtnl.CHANGE
    assert rtnl.link_up(20, **kw) == body


def test_flags_of_a_creation_are_pyroute2s():
    [(kind, flags, _body)] = _compiled(lambda b: b.addr("add", index=20, address="10.0.0.1", prefixlen=24))
    assert (kind, flags) == (rtnl.RTM_NEWADDR, rtnl.CREATE)


# -- against the kernel ----------------------------------------------------------------------------

@pytest.fixture
def scratch_ns(root):
    name = f"tb-rtnl-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        netns.delete(name)


def _batch_in(ns: str) -> rtnl.Batch:
    with netns.enter(ns):
        return rtnl.Batch()


def test_a_batch_builds_in_its_namespace(scratch_ns):
    fd = os.open(netns.path(scratch_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        with rtnl.Batch() as root_side:   # veths placed by namespace descriptor, from the root namespace
            root_side.add(rtnl.RTM_NEWLINK, rtnl.CREATE,
                          rtnl.veth("va", 40, fd, "02:00:00:00:01:01", 1500, "vb", 41, fd, "02:00:00:00:01:02"),
                          "veth va-vb")
            root_side.commit()
    finally:
        os.close(fd)
    with _batch_in(scratch_ns) as b:
        b.add(rtnl.RTM_NEWLINK, rtnl.CREATE, rtnl.bridge("br", "02:00:00:00:01:03", index=50), "bridge")
        b.add(rtnl.RTM_NEWLINK, rtnl.CHANGE, rtnl.link_up(50), "bridge up")
        b.add(rtnl.RTM_NEWLINK, rtnl.CHANGE, rtnl.link_up(40, master=50), "va up, in br")
        b.add(rtnl.RTM_NEWLINK, rtnl.CHANGE, rtnl.link_up(41), "vb up")
        b.add(rtnl.RTM_NEWLINK, rtnl.CHANGE, rtnl.link_up(1, alias="testbed:t:/x"), "lo up")
        b.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(50, "10.7.0.1", 24), "br address")
        b.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(41, "10.8.0.1", 30), "vb address")
        b.add(rtnl.RTM_NEWNEIGH, rtnl.CREATE, rtnl.neighbour(41, "10.8.0.2", "02:00:00:00:01:09"), "neighbour")
        b.add(rtnl.RTM_NEWROUTE, rtnl.CREATE, rtnl.route("10.9.0.0/16", [("10.8.0.2", 41)]), "route")
        b.add(rtnl.RTM_NEWROUTE, rtnl.CREATE, rtnl.route("10.10.0.0/16", []), "unreachable")
        b.commit()
        links = b.links()
    assert links["va"][0] == 40 and links["vb"][0] == 41 and links["br"][0] == 50 and links["lo"][0] == 1
    ip = lambda *a: subprocess.run(["ip", "-n", scratch_ns, *a], check=True, capture_output=True,  # noqa: E731
                                   text=True).stdout
    assert "master br" in ip("-o", "link", "show", "va")
    assert "testbed:t:/x" in ip("-d", "link", "show", "lo")
    assert "stp_state 0" in ip("-d", "link", "show", "br")
    assert "10.7.0.1/24" in ip("-o", "-4", "addr", "show", "br")
    assert "10.8.0.2 lladdr 02:00:00:00:01:09 PERMANENT" in ip("neigh", "show", "dev", "vb")
    routes = ip("route", "show")
    assert "10.9.0.0/16 via 10.8.0.2 dev vb proto static" in routes
    assert "unreachable 10.10.0.0/16 proto static" in routes


def test_the_first_failure_is_named_and_the_rest_still_ran(scratch_ns):
    with _batch_in(scratch_ns) as b:
        b.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(1, "10.7.0.1", 8), "lo address")
        b.add(rtnl.RTM_NEWROUTE, rtnl.CREATE, rtnl.route("10.9.0.0/16", [("10.8.0.2", 99)]), "route via no device")
        b.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(1, "10.7.0.1", 8), "the same address again")
        b.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(1, "10.6.0.1", 8), "another address")
        with pytest.raises(rtnl.RtnlError) as info:
            b.commit()
    assert info.value.what == "route via no device"
    assert str(info.value).startswith("route via no device: ")
    out = subprocess.run(["ip", "-n", scratch_ns, "-o", "-4", "addr", "show", "lo"], check=True,
                         capture_output=True, text=True).stdout
    assert "10.7.0.1/8" in out and "10.6.0.1/8" in out


def test_many_requests_span_several_sends(scratch_ns):
    with _batch_in(scratch_ns) as b:
        n = 3000   # ~130 KiB of requests: several chunks, acks read as they come
        for i in range(n):
            b.add(rtnl.RTM_NEWROUTE, rtnl.CREATE, rtnl.route(f"10.{i // 250}.{i % 250}.0/24", []), f"route {i}")
        b.commit()
        assert b.sent == n
    out = subprocess.run(["ip", "-n", scratch_ns, "route", "show"], check=True, capture_output=True, text=True).stdout
    assert out.count("unreachable") == n


def _netem() -> bool:
    from testbed.net.capabilities import probe

    return os.geteuid() == 0 and probe().netem


# netem's (a stock kernel: `make test-kernel` runs them in a VM)
NETEM_PROFILES = [pytest.param(p, marks=[pytest.mark.netem,
                                         pytest.mark.skipif(not _netem(), reason="kernel has no sch_netem")])
                  for p in ({"delay_s": 0.010}, {"bandwidth_bps": 10**9, "delay_s": 0.002, "jitter_s": 0.001},
                            {"bandwidth_bps": 10**8, "loss": 0.01})]


@pytest.mark.parametrize("profile", [
    {"bandwidth_bps": 10**9},
    {"bandwidth_bps": 440_528_634, "queue": 64},
    {"bandwidth_bps": 25 * 10**9, "mtu": 9000},
    *NETEM_PROFILES,
])
def test_batched_shaping_installs_what_apply_does(scratch_ns, profile):
    """Shaping sent in a batch (shaping.fresh_messages) leaves the same qdiscs and classes, option
    for option, as shaping.apply on a fresh interface."""
    from pyroute2 import IPRoute

    from testbed.net import shaping
    from testbed.net.capabilities import probe
    from testbed.topology.model import LinkProfile

    caps = probe()
    prof = LinkProfile(**profile)
    with netns.enter(scratch_ns):
        ipr = IPRoute()
    try:
        ipr.link("add", ifname="sa", kind="veth", peer={"ifname": "sb"})
        a, b = ipr.link_lookup(ifname="sa")[0], ipr.link_lookup(ifname="sb")[0]
        shaping.apply(ipr, a, prof, caps, fresh=True)
    finally:
        ipr.close()
    with _batch_in(scratch_ns) as batch:
        for m in shaping.fresh_messages(b, prof, caps):
            batch.add_message(m, "shaping of sb")
        batch.commit()

    def shown(dev: str) -> list[str]:
        out = []
        for what in ("qdisc", "class"):
            text = subprocess.run(["tc", "-n", scratch_ns, "-d", what, "show", "dev", dev], check=True,
                                  capture_output=True, text=True).stdout
            out.append(text)
        return out

    assert shown("sa") == shown("sb")
    kinds = shaping.mechanisms(prof, caps)
    assert all(k in shown("sb")[0] for k in kinds & {"htb", "bfifo", "netem"}) and kinds & {"htb", "netem"}


def test_a_loss_filter_is_left_to_apply():
    from testbed.net import shaping
    from testbed.net.capabilities import Capabilities
    from testbed.topology.model import LinkProfile

    no_netem = Capabilities(is_root=True, kernel="x", htb=True, bpf=True, netem=False)
    assert shaping.fresh_messages(5, LinkProfile(bandwidth_bps=10**9, loss=0.01), no_netem) is None
    assert shaping.fresh_messages(5, LinkProfile(bandwidth_bps=10**9), no_netem)


@pytest.mark.parametrize("bandwidth", [10**6, 10**9, 440_528_634, 3 * 10**9 + 7, 25 * 10**9, 40 * 10**9, 400 * 10**9])
@pytest.mark.parametrize("queue", [None, 64])
def test_htb_requests_are_pyroute2s(bandwidth, queue):
    """HTB and bfifo, encoded by testbed (no pyroute2 import in `up`), are pyroute2's bytes: rate
    tables, 64-bit rates past 4 GB/s, buffers in the kernel's ticks."""
    from testbed.net import shaping
    from testbed.net.capabilities import Capabilities
    from testbed.topology.model import LinkProfile

    plan = shaping.make_plan(LinkProfile(bandwidth_bps=bandwidth, queue=queue), Capabilities(htb=True))
    ours = shaping._htb_messages(plan, shaping._psched_ticks_per_us())
    theirs = shaping._pyroute2_compile(plan)
    assert len(ours) == 3
    assert [m[4:6] for m in ours] == [m[4:6] for m in theirs]   # the types
    assert [m[:4] + m[6:8] + m[16:] for m in ours] == [m[:4] + m[6:8] + m[16:] for m in theirs]


@pytest.mark.parametrize("netem, profile", [
    (netem, profile) for netem in (False, True)
    for profile in (dict(bandwidth_bps=500 * 10**6), dict(bandwidth_bps=10**10, queue=64),
                    dict(bandwidth_bps=10**9, delay_s=0.005))] + [(True, dict(delay_s=0.01, jitter_s=0.001))])
@pytest.mark.parametrize("mode", ["add", "change"])
def test_a_changes_requests_are_pyroute2s(netem, profile, mode):
    """shaping.change's batch: the requests pyroute2's tc calls sent before (_install), flags included
    ('change': no HTB root, REQUEST|ACK|REPLACE), on the interface asked for."""
    from testbed.net import shaping
    from testbed.net.capabilities import Capabilities
    from testbed.topology.model import LinkProfile

    plan = shaping.make_plan(LinkProfile(**profile), Capabilities(htb=True, bpf=True, netem=netem))
    shaping._pyroute2()
    theirs = _compiled(lambda b: shaping._install(b, 7, plan, mode))
    ours = [struct.unpack_from("=IHHII", m) for m in shaping._messages(7, plan, mode)]
    assert [(kind, flags) for _len, kind, flags, _s, _p in ours] == [(kind, flags) for kind, flags, _b in theirs]
    assert [m[16:] for m in shaping._messages(7, plan, mode)] == [body for _k, _f, body in theirs]


@pytest.mark.parametrize("replace", [False, True])
def test_loss_filter_requests_are_pyroute2s(replace):
    from testbed.net import lossfilter as lf

    filt = _compiled(lambda b: b.tc("replace-filter" if replace else "add-filter", "bpf", 9, lf.LOSS_HANDLE,
                                    parent=lf.EGRESS, prio=lf.LOSS_PRIO, protocol=lf.ETH_P_ALL, fd=11,
                                    name="tb_loss_0.250000", direct_action=True))
    msg = lf.filter_message(9, 11, 0.25, replace=replace)
    assert filt == [(struct.unpack_from("=H", msg, 4)[0], struct.unpack_from("=H", msg, 6)[0], msg[16:])]
    for ours, theirs in ((lf.clsact_message(9), lambda b: b.tc("add", "clsact", 9)),
                         (lf.clsact_delete_message(9), lambda b: b.tc("del", index=9, handle=lf.CLSACT,
                                                                     parent=lf.CLSACT_PARENT))):
        assert _compiled(theirs) == [(struct.unpack_from("=H", ours, 4)[0], struct.unpack_from("=H", ours, 6)[0],
                                      ours[16:])]


def test_a_batch_beside_a_socket_is_in_its_namespace_and_may_let_errors_pass(scratch_ns):
    """Batch.beside: a batch in the namespace of a socket made there (as an IPRoute's); a request's
    `ok` errnos do not fail the batch, any other still does."""
    with _batch_in(scratch_ns) as there:
        with rtnl.Batch.beside(there.sock.fileno()) as b:
            b.add(rtnl.RTM_NEWLINK, rtnl.CREATE, rtnl.bridge("brx", "02:00:00:00:02:01", index=60), "bridge")
            b.add(rtnl.RTM_NEWLINK, rtnl.CREATE, rtnl.bridge("brx", "02:00:00:00:02:01", index=60), "again, EEXIST",
                  ok=(17,))
            b.commit()
            assert b.links()["brx"][0] == 60
            b.add(rtnl.RTM_NEWLINK, rtnl.CREATE, rtnl.bridge("brx", "02:00:00:00:02:01", index=60), "again, not ok",
                  ok=(2,))
            with pytest.raises(rtnl.RtnlError) as info:
                b.commit()
            assert info.value.errno == 17 and info.value.what == "again, not ok"
    with rtnl.Batch() as root_side:
        stray = root_side.links().get("brx")
    if stray is not None and stray[0] == 60:   # (made in the wrong namespace: ours by its index; removed)
        subprocess.run(["ip", "link", "del", "brx"], check=False)
    assert stray is None, "the batch beside the namespace's socket made its bridge in this namespace"
