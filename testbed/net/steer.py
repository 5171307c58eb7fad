"""Steering between devices of one namespace: every frame that arrives on one device leaves by
another, in the kernel, with no bridge between them (tc: an ingress qdisc, a u32 filter that
matches everything, mirred's egress redirect).

A delayed cut link's own namespace uses it (Builder._delayed_tunnel_end) so that only what its
host sends passes through the delay line: what comes in from the tunnel goes straight to the
node's port, with no second pass through userspace (each pass costs a process wake-up, which on
a VM with idle CPUs is 0.1-0.3 ms).
"""

from __future__ import annotations

from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

INGRESS = 0xFFFF0000   # the ingress qdisc's handle (ffff:)
ETH_P_ALL = 0x0003
MATCH_ALL = ["0x0/0x0+0"]   # a u32 key that every frame matches


class SteerError(RuntimeError):
    pass


def steer(ipr: Any, src: int, dst: int, what: str) -> None:
    """Send everything arriving on ifindex `src` out of ifindex `dst` (both in ipr's namespace).
    `what` names the pair in errors. SteerError when this kernel lacks the parts."""
    try:
        ipr.tc("add", "ingress", src, INGRESS)
        ipr.tc("add-filter", "u32", src, parent=INGRESS, prio=1, protocol=ETH_P_ALL, keys=MATCH_ALL,
               target=INGRESS | 1,   # (a class id u32 must carry; the redirect takes the frame first)
               action=dict(kind="mirred", direction="egress", action="redirect", ifindex=dst))
    except NetlinkError as exc:
        raise SteerError(f"{what}: cannot steer frames with tc ({exc.args[-1] if exc.args else exc}): this "
                         "needs the kernel's ingress qdisc, u32 classifier and mirred action "
                         "(CONFIG_NET_SCH_INGRESS, CONFIG_NET_CLS_U32, CONFIG_NET_ACT_MIRRED)") from exc
