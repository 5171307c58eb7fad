"""What `testbed capture A [B] --at --direction` captures: one interface of one link end, in one
namespace, resolved from the testbed's state (a link named by its ends, or a node's interface),
and what the user should know about it (a link down, a delay line, a dilated clock)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed import store
from testbed.errors import StateError, TestbedError
from testbed.net import names


class CaptureError(TestbedError):
    """A capture names something the testbed does not have, or a bad option: exit status 2."""

    exit_code = 2


@dataclass(frozen=True)
class Target:
    """One interface of one link end, in one namespace."""

    testbed: str
    link: int              # the link's index (as `testbed status` / `link show` number it)
    a: str                 # the link as the user named it: A, B
    b: str
    node: str              # the end captured (--at)
    peer: str              # the other end
    ifname: str            # node's interface on the link
    peer_ifname: str
    netns: str
    direction: str | None  # None: both; "out": node -> peer; "in": peer -> node
    delay_line: bool       # the link is a delay line (two TAPs and an engine), not a veth pair
    link_state: str        # "up" | "down"
    dilation: float        # the testbed's time-dilation factor

    def describe(self) -> str:
        """'w0 eth0 (link w0 <-> s0, w0->s0 only)'."""
        way = {None: "both directions", "out": f"{self.node}->{self.peer} only",
               "in": f"{self.peer}->{self.node} only"}[self.direction]
        return f"{self.node} {self.ifname} (link {self.a} <-> {self.b}, {way})"

    def notes(self) -> list[str]:
        """What this capture sees, where it matters (for stderr when it starts)."""
        out = []
        if self.link_state == "down":
            out.append(f"link {self.a} <-> {self.b} is down: nothing crosses it until `testbed link up {self.a} "
                       f"{self.b}`")
        if self.delay_line:
            out.append(f"this link is a delay line (an engine between {self.node} {self.ifname} and {self.peer} "
                       f"{self.peer_ifname}): packets {self.node} sends are seen here before the link's delay, "
                       f"packets it receives after it")
        if self.dilation != 1.0:
            out.append(f"time dilation {self.dilation:g}: timestamps are the host's clock; divide intervals by "
                       f"{self.dilation:g} for the emulated cluster's")
        return out


def _parse_direction(value: str | None, a: str, b: str, at: str) -> str | None:
    """--direction from the captured end's point of view: None (both), "out" or "in"."""
    text = (value or "both").strip().replace(" ", "")
    if text.lower() in ("", "both"):
        return None
    if text.lower() in ("in", "out"):
        return text.lower()
    src = {f"{a}->{b}": a, f"{b}->{a}": b}.get(text) or {"a->b": a, "b->a": b}.get(text.lower())
    if src is None:
        raise CaptureError(f"--direction must be both, in, out, A->B, B->A, {a}->{b} or {b}->{a} (got {value!r})")
    return "out" if src == at else "in"


def resolve(name: str, first: str, second: str | None = None, *, at: str | None = None,
            direction: str | None = None, st: dict[str, Any] | None = None) -> Target:
    """The interface a capture of LINK (first [second]) at `at` reads, from the testbed's state.

    first second: the link between two nodes (as `testbed link` names it), or node `first`'s
    interface `second` (eth0, eth1, ...); first alone: that node's only link. `at` (default:
    first) is the end captured. `direction`: both, in, out (seen from `at`), A->B, B->A (A: first, B: the
    other end) or with the node names (w0->s0).
    """
    from testbed.topology.model import Topology

    st = st if st is not None else store.load(name)
    if not st.get("topology"):
        raise StateError(f"state of testbed {name!r} has no topology snapshot")
    topo = Topology.from_json(st["topology"])
    recs = st.get("links") or []

    def no_node(what: str, node: str) -> CaptureError:
        some = ", ".join(list(topo.nodes)[:12]) + (" ..." if len(topo.nodes) > 12 else "")
        return CaptureError(f"{what}: testbed {name!r} has no node {node!r} (nodes: {some})")

    def ends(i: int) -> tuple[list[str], list[str]]:
        if i >= len(recs):
            raise StateError(f"state of testbed {name!r} lacks the record of link {i}")
        return list(recs[i]["endpoints"]), list(recs[i]["ifnames"])

    def interfaces(node: str) -> str:
        own = []
        for i in range(len(recs)):
            eps, ifs = ends(i)
            for k in (0, 1):
                if eps[k] == node:
                    own.append(f"{ifs[k]} (to {eps[1 - k]})")
        return ", ".join(own) or "none"

    if first not in topo.nodes:
        raise no_node("LINK", first)
    if second is None:
        mine = [i for i in range(len(recs)) if first in ends(i)[0]]
        if len(mine) != 1:
            raise CaptureError(f"LINK: {first} has {len(mine)} links; name one: `testbed capture {first} PEER` "
                               f"or `testbed capture {first} IFNAME` (its interfaces: {interfaces(first)})")
        i = mine[0]
    elif second in topo.nodes:
        if topo.link_between(first, second) is None:
            nb = ", ".join(topo.neighbors(first)) or "none"
            raise CaptureError(f"LINK: testbed {name!r} has no link between {first} and {second} "
                               f"({first}'s neighbours: {nb})")
        i = topo.link_index(first, second)
    else:
        found = [j for j in range(len(recs)) if (first, second) in zip(*ends(j))]
        if not found:
            raise CaptureError(f"LINK: {second!r} is neither a node of testbed {name!r} nor an interface of "
                               f"{first} (its interfaces: {interfaces(first)})")
        i = found[0]
    eps, ifs = ends(i)
    a = first
    b = eps[1] if eps[0] == first else eps[0]
    node = at or a
    if node not in eps:
        if node not in topo.nodes:
            raise no_node("--at", node)
        raise CaptureError(f"--at: {node} is not an end of link {a} <-> {b} (its ends: {a}, {b})")
    k = eps.index(node)
    dl = any(rec.get("link") == i for rec in (st.get("resources") or {}).get("delay_lines") or [])
    return Target(testbed=name, link=i, a=a, b=b, node=node, peer=eps[1 - k], ifname=ifs[k],
                  peer_ifname=ifs[1 - k], netns=names.netns(name, node),
                  direction=_parse_direction(direction, a, b, node), delay_line=dl,
                  link_state=recs[i].get("state", "up"), dilation=_dilation(st))


def _dilation(st: dict[str, Any]) -> float:
    v = st.get("time_dilation")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1:
        return float(v)
    d = st.get("dilation")
    if isinstance(d, dict) and isinstance(d.get("factor"), (int, float)) and d["factor"] >= 1:
        return float(d["factor"])
    return 1.0
