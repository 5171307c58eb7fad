"""Smoke test for the stock-kernel stage (`make test-kernel`, scripts/kernel-vm.sh).

Two network namespaces joined by a veth pair; a netem qdisc (added with
pyroute2) delays one side; ping must see the delay. It proves, inside the
virtme-ng guest, that sch_netem loads, that pyroute2 can configure it and that
packets really wait in it.

Outside the VM (a kernel without sch_netem, or not root) the test skips, like
every `netem` test. With TESTBED_REQUIRE_NETEM=1 (set by the stage inside the
VM) a missing sch_netem or missing root is a failure instead: the stage must
never pass by skipping.

Tolerances (see docs/testing-kernel.md): the VM runs under TCG (no KVM), which
adds several ms of RTT jitter, so the RTT is bounded tightly below (netem
never releases a packet early) and loosely above.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import uuid

import pytest

pytestmark = [pytest.mark.netem, pytest.mark.root]

REQUIRE = os.environ.get("TESTBED_REQUIRE_NETEM") == "1"

DELAY_MS = 20.0  # one-way netem delay on one side = added RTT
# Lower bound: netem holds each packet at least DELAY_MS (timer slack only
# adds), so min RTT >= DELAY_MS minus clock-granularity slack.
LOW_SLACK_MS = 0.5
# Upper bound: TCG jitter (measured 6-12 ms extra on single pings). Bound the
# median, which is robust against a few slow pings.
HIGH_SLACK_MS = 15.0
PINGS = 20


def _skip_or_fail(msg: str) -> None:
    if REQUIRE:
        pytest.fail(f"TESTBED_REQUIRE_NETEM=1 but {msg}", pytrace=False)
    pytest.skip(msg)


def _pyroute2():
    try:
        import pyroute2  # noqa: F401
        from pyroute2 import IPRoute, netns
        from pyroute2.netlink.exceptions import NetlinkError
    except ImportError as exc:  # pragma: no cover - venv always has it
        _skip_or_fail(f"pyroute2 is not importable: {exc}")
    return IPRoute, netns, NetlinkError


def _ping(ns: str, addr: str, count: int) -> list[float]:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ping", "-n", "-c", str(count), "-i", "0.2", "-W", "2", addr],
        capture_output=True,
        text=True,
        timeout=count * 3 + 10,
    )
    rtts = [float(m) for m in re.findall(r"time=([0-9.]+) ms", out.stdout)]
    assert out.returncode == 0 and rtts, f"ping failed (rc={out.returncode}):\n{out.stdout}\n{out.stderr}"
    return rtts


@pytest.fixture
def veth_pair():
    """Namespaces tb-<name>-a and tb-<name>-b joined by a veth, 10.203.0.1/.2.

    Yields (IPRoute, netns_a, netns_b, ifindex of the veth in a). Removes
    everything it made, even on failure.
    """
    if os.geteuid() != 0:
        _skip_or_fail("not root (network namespaces need CAP_SYS_ADMIN/NET_ADMIN)")
    IPRoute, netns, _ = _pyroute2()
    name = f"ksmk{uuid.uuid4().hex[:6]}"
    ns_a, ns_b = f"tb-{name}-a", f"tb-{name}-b"
    made: list[str] = []
    ipr_a = ipr_b = None
    try:
        for ns in (ns_a, ns_b):
            netns.create(ns)
            made.append(ns)
        ipr_a = IPRoute(netns=ns_a)
        ipr_b = IPRoute(netns=ns_b)
        ipr_a.link("add", ifname="veth-a", kind="veth", peer={"ifname": "veth-b", "net_ns_fd": ns_b})
        idx_a = ipr_a.link_lookup(ifname="veth-a")[0]
        idx_b = ipr_b.link_lookup(ifname="veth-b")[0]
        ipr_a.addr("add", index=idx_a, address="10.203.0.1", prefixlen=24)
        ipr_b.addr("add", index=idx_b, address="10.203.0.2", prefixlen=24)
        for ipr, idx in ((ipr_a, idx_a), (ipr_b, idx_b)):
            ipr.link("set", index=idx, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield ipr_a, ns_a, ns_b, idx_a
    finally:
        for ipr in (ipr_a, ipr_b):
            if ipr is not None:
                ipr.close()
        for ns in made:
            try:
                netns.remove(ns)  # removing a namespace destroys its veth end too
            except Exception:  # noqa: BLE001 - best-effort cleanup, keep going
                pass


def _add_netem(ipr, idx: int, **kw) -> None:
    _, _, NetlinkError = _pyroute2()
    try:
        ipr.tc("add", "netem", index=idx, handle="1:", **kw)
    except NetlinkError as exc:
        # ENOENT "Specified qdisc kind is unknown": sch_netem missing/unloadable
        _skip_or_fail(f"cannot add a netem qdisc ({exc}); the kernel has no sch_netem")


def test_netem_available_in_kernel():
    """sch_netem is loaded (the stage modprobes it) or built in."""
    loaded = os.path.isdir("/sys/module/sch_netem")
    if not loaded:
        _skip_or_fail("sch_netem is not loaded (/sys/module/sch_netem missing)")


def test_netem_delay_shows_in_ping_rtt(veth_pair):
    ipr, ns_a, _, idx = veth_pair
    base = _ping(ns_a, "10.203.0.2", 5)
    assert statistics.median(base) < DELAY_MS / 2, f"unshaped RTT already high: {base}"

    _add_netem(ipr, idx, delay=int(DELAY_MS * 1000))  # pyroute2 takes microseconds
    kinds = [q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index=idx)]
    assert "netem" in kinds, f"netem not installed on veth-a: {kinds}"

    rtts = _ping(ns_a, "10.203.0.2", PINGS)
    lo, med = min(rtts), statistics.median(rtts)
    print(f"netem {DELAY_MS} ms: unshaped median {statistics.median(base):.3f} ms, "
          f"shaped min {lo:.3f} median {med:.3f} max {max(rtts):.3f} ms")
    assert lo >= DELAY_MS - LOW_SLACK_MS, f"a packet came back before the netem delay: {rtts}"
    assert med <= DELAY_MS + HIGH_SLACK_MS, f"median RTT far above the netem delay: {rtts}"

    # Removing the qdisc removes the delay (proves it was netem, not the VM).
    ipr.tc("del", index=idx, handle="1:", root=True)
    after = _ping(ns_a, "10.203.0.2", 5)
    assert statistics.median(after) < DELAY_MS / 2, f"delay stayed after removing netem: {after}"
