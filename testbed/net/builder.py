"""Build the fabric of a testbed in the kernel, and take it down again.

Input: a validated Topology, its NetworkPlan and the probed Capabilities.
Worker namespaces already exist (the runtime's prepare_netns made them);
switch namespaces are made here. Then, phase by phase (timed, see
`Builder.timings`):

  sysctls    per namespace, through /proc/sys/net after setns (never the root
             namespace): IPv6 off, rp_filter loose, ignore_routes_with_linkdown;
             switches also forward and hash multipath on L4
             (fib_multipath_hash_policy=1); workers of a dilated testbed size
             TCP's bursts on the undilated round trip (tcp_sysctls).
  links      one veth pair per link, both ends created directly in their
             namespaces (IFLA_NET_NS_FD on the device and on the peer), with
             fixed MAC addresses and ifindexes, sent in batches; or a delay
             line (two TAPs and a delay-line engine) when the link needs a delay
             and the kernel has no netem, all of a build's lines handed to the
             engines together once the veths exist.
             Over several hosts a cut link's end is a VXLAN device; with a
             delay and no netem, end A's is a veth to a namespace of the link's
             own, where tc patches it through the link's one delay line to the
             VXLAN device.
  configure  per namespace, with one netlink socket opened inside it and its
             requests sent in three batches (testbed.net.rtnl: many requests a
             send, one ack each): lo up, the bridge with the gateway address
             (switches that serve workers), ports up/enslaved/addressed; then
             shaping (testbed.net.shaping's requests, encoded once per profile);
             then permanent neighbour entries and routes (the plan's summarised
             static ECMP tables on switches, a default route on workers). The
             ifindexes are the builder's own (both veth ends, the bridge): only
             a namespace with a delay line's TAP or a tunnel end is dumped.

Permanent neighbour entries: every address on every L2 segment is known from
the plan and every MAC is chosen here, so ARP is never needed. Permanent
entries are exempt from the kernel's neighbour garbage collection and its
gc_thresh limits, which are global (not per namespace) and would otherwise
overflow on big topologies (k=8 fat-tree: > 1024 entries).

Everything created lives inside the testbed's namespaces, except delay-line
engine processes: testbed.net.teardown stops those (by recorded PID) and deletes the
namespaces, which removes every interface, qdisc and route in them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from testbed import paths
from testbed.net import fanout, names, netns, rtnl
from testbed.net.routes import route_message
from testbed.topology.model import LinkProfile, Topology
from testbed.topology.plan import BRIDGE, LinkPlan, NetworkPlan

COMMON_SYSCTLS = {
    "net/ipv6/conf/all/disable_ipv6": "1",
    "net/ipv6/conf/default/disable_ipv6": "1",
    "net/ipv4/conf/all/rp_filter": "2",
    "net/ipv4/conf/default/rp_filter": "2",
    "net/ipv4/conf/all/ignore_routes_with_linkdown": "1",
    "net/ipv4/conf/default/ignore_routes_with_linkdown": "1",
}
SWITCH_SYSCTLS = {
    **COMMON_SYSCTLS,
    "net/ipv4/ip_forward": "1",
    "net/ipv4/conf/all/forwarding": "1",
    "net/ipv4/conf/default/forwarding": "1",
    "net/ipv4/fib_multipath_hash_policy": "1",
}
WORKER_SYSCTLS = dict(COMMON_SYSCTLS)
# TCP sizes its TSO/GSO bursts by its pacing rate (1 ms of it) plus, since Linux 5.18, a bonus of up
# to 64 KiB for a flow whose min RTT is under 2**tcp_tso_rtt_log us (9: 512 us), halved per multiple
# of that. Dilated by s, every RTT is s times longer: a datacenter flow loses the bonus that the hosts
# it emulates have and sends smaller frames, which every hop (and every delay line: it costs per
# frame) pays for. Raised by log2(s), the log judges the undilated RTT (docs/fidelity.md, "TCP's bursts").
TSO_RTT_LOG, TSO_RTT_LOG_DEFAULT = "net/ipv4/tcp_tso_rtt_log", 9   # (the kernel's for a new namespace)
FIRST_IFINDEX = 16
LOOPBACK_IFINDEX = 1   # the kernel's, in every namespace
# in a delayed cut link's own namespace (no sch_netem: Builder._delayed_tunnel_end): the node's
# port's other end, the delay line's TAP on the port's side and on the tunnel's, the VXLAN device
CUT_PORT, CUT_LINE_PORT, CUT_LINE_TUNNEL, CUT_TUNNEL = "port", "line-port", "line-tunnel", "tunnel"

Recorder = Callable[[str, Any], None]
"""record(kind, item): called right after something outside our namespaces is created
(kind "delay_line": a dict with its pid), so the caller can persist it."""


def _plain(cidr: str) -> str:
    return cidr.split("/")[0]


def tcp_sysctls(s: float) -> dict[str, str]:
    """A worker's TCP sysctls under dilation s: {} at s = 1, or on a kernel without tcp_tso_rtt_log."""
    if s <= 1 or not os.path.exists(f"/proc/sys/{TSO_RTT_LOG}"):
        return {}
    return {TSO_RTT_LOG: str(TSO_RTT_LOG_DEFAULT + max(0, round(math.log2(s))))}


def no_delay_element(topo: Topology, caps: Any) -> list[dict[str, Any]]:
    """Link directions that ask for a delay at or below shaping.delay_threshold (no delay element)."""
    from testbed.net import shaping

    out = []
    for i, link in enumerate(topo.links):
        for src, dst, prof in ((link.a, link.b, link.ab), (link.b, link.a, link.ba)):
            if shaping.below_floor(prof, caps):
                out.append({"link": i, "from": src, "to": dst, "delay_s": prof.delay_s})
    return out


# -- shaping and delay lines: thin adapters over testbed.net.shaping / delayline -------------------------
# (shaping imported where used: it brings pyroute2, ~0.25 s, which `down` never needs)

def needs_delay_line(profile: LinkProfile, caps: Any) -> bool:
    from testbed.net import shaping

    return caps is not None and bool(shaping.needs_delay_line(profile, caps))


def delayed_cut_links(topo: Topology, caps: Any, part: Any) -> list[int]:
    """The cut links of this host's part whose delay needs a delay line (a kernel without
    sch_netem). Each has one line, both directions, on the host of its end A
    (cut_lines_here); on the other host its end is a plain tunnel end, shaped without delay."""
    if part is None:
        return []
    return [i for i, link in enumerate(topo.links) if part.local(link.a) != part.local(link.b)
            and (needs_delay_line(link.ab, caps) or needs_delay_line(link.ba, caps))]


def cut_lines_here(topo: Topology, caps: Any, part: Any) -> list[int]:
    """The delayed cut links whose line this host holds (those whose end A is here): each gets a
    namespace of its own here (names.cut_netns; Builder._delayed_tunnel_end)."""
    return [i for i in delayed_cut_links(topo, caps, part) if part.local(topo.links[i].a)]


def shape(ipr: Any, index: int, profile: LinkProfile, caps: Any) -> None:
    """Shape the egress of one freshly made interface end through pyroute2 (what a batch cannot carry)."""
    from testbed.net import shaping

    shaping.apply(ipr, index, profile, caps, fresh=True)


def fresh_messages(index: int, profile: LinkProfile, caps: Any) -> list[bytes] | None:
    """The same shaping as requests for a batch; None when only shape() can install it."""
    from testbed.net import shaping

    return shaping.fresh_messages(index, profile, caps)


# -- the builder ---------------------------------------------------------------------------------------

@dataclass
class Builder:
    testbed: str
    topo: Topology
    plan: NetworkPlan
    caps: Any = None
    record: Recorder | None = None
    owner_label: str | None = None          # set as lo's alias in every namespace (ownership)
    timings: dict[str, float] = field(default_factory=dict)
    delay_lines: list[dict[str, Any]] = field(default_factory=list)
    progress: Callable[[str, int, int], None] | None = None   # (phase, done, total)
    # one host's part of a testbed over several hosts (testbed.cluster.part.Part): only its nodes
    # are built, and its ends of cut links are tunnels; None: every node, here
    part: Any = None
    # (node, ifname) -> ifindex of the veth ends create_links made (chosen here: configure needs no
    # dump of a namespace whose ports are all veths)
    veth_index: dict[tuple[str, str], int] = field(default_factory=dict)
    dilation: float = 1.0   # the factor `topo` is dilated by (its workers' TCP: tcp_sysctls)

    def ns(self, node: str) -> str:
        return names.netns(self.testbed, node)

    def here(self, node: str) -> bool:
        return self.part is None or self.part.local(node)

    @property
    def nodes(self) -> list[str]:
        return [n for n in self.topo.nodes if self.here(n)]

    @property
    def switch_namespaces(self) -> list[str]:
        return [self.ns(s) for s in self.topo.switches if self.here(s)]

    def _tick(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    def _timed(self, phase: str, t0: float) -> float:
        t = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + (t - t0)
        return t

    # -- phases ------------------------------------------------------------------------------------
    def create_switch_namespaces(self) -> None:
        t0 = time.perf_counter()
        sw = [s for s in self.topo.switches if self.here(s)]
        with netns.Home() as home:
            for i, s in enumerate(sw):
                netns.create(self.ns(s), SWITCH_SYSCTLS, home=home)
                self._tick("switch namespaces", i + 1, len(sw))
        self._timed("switch namespaces", t0)

    def set_worker_sysctls(self) -> None:
        t0 = time.perf_counter()
        sysctls = {**WORKER_SYSCTLS, **tcp_sysctls(self.dilation)}
        with netns.Home() as home:
            for w in (w for w in self.topo.workers if self.here(w)):
                fd = os.open(netns.path(self.ns(w)), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    netns.setns(fd)
                    netns.write_sysctls(sysctls)
                finally:
                    home.back()
                    os.close(fd)
        self._timed("worker sysctls", t0)

    def create_links(self) -> None:
        """Every link of this host: veth pairs sent in batches from here (each end made directly in
        its namespace, by descriptor), delay lines and tunnel ends one by one."""
        t0 = time.perf_counter()
        fds: dict[str, int] = {}
        delayed_cut = set(delayed_cut_links(self.topo, self.caps, self.part))
        ipr = None   # pyroute2, for tunnel ends only
        total = len(self.plan.links)
        lines: list[Any] = []   # delay lines, started together at the end (delayline.start_delay_links)
        try:
            for node in self.nodes:
                fds[node] = os.open(netns.path(self.ns(node)), os.O_RDONLY | os.O_CLOEXEC)
            with rtnl.Batch() as batch:
                for n, lp in enumerate(self.plan.links):
                    link = self.topo.links[lp.index]
                    a_here, b_here = self.here(lp.a.node), self.here(lp.b.node)
                    if not (a_here or b_here):
                        pass   # another host's link
                    elif a_here != b_here:
                        ipr = ipr or self._root_iproute()
                        if lp.index in delayed_cut and a_here:
                            self._delayed_tunnel_end(lp, ipr)
                        else:   # (with a delay and no netem, end B's delay is held by end A's line)
                            self._tunnel_end(lp, lp.a if a_here else lp.b, ipr)
                    elif needs_delay_line(link.ab, self.caps) or needs_delay_line(link.ba, self.caps):
                        lines.append(self._line_spec(lp))
                        continue
                    else:
                        self._queue_veth(batch, lp, fds)
                        if len(batch) < 64:
                            continue
                        batch.commit()
                    self._tick("links", n + 1, total)
                batch.commit()
            if lines:
                self._start_delay_lines(lines, total - len(lines), total)
        finally:
            for fd in fds.values():
                os.close(fd)
            if ipr is not None:
                ipr.close()
        self._tick("links", total, total)
        self._timed("links", t0)

    def _queue_veth(self, batch: rtnl.Batch, lp: LinkPlan, fds: dict[str, int]) -> None:
        link = self.topo.links[lp.index]
        mtu = max(link.ab.mtu, link.ba.mtu)
        # Explicit, distinct ifindexes: the kernel treats carrier changes of a veth whose ifindex
        # equals its peer's as non-urgent and attaches its qdisc up to 1 s late. Known, they also
        # spare configure a dump of each namespace.
        ia, ib = FIRST_IFINDEX + 2 * lp.index, FIRST_IFINDEX + 2 * lp.index + 1
        batch.add(rtnl.RTM_NEWLINK, rtnl.CREATE,
                  rtnl.veth(lp.a.ifname, ia, fds[lp.a.node], self.mac(lp, "a"), mtu,
                            lp.b.ifname, ib, fds[lp.b.node], self.mac(lp, "b")),
                  f"link {link.a}-{link.b} (veth {lp.a.ifname} in {self.ns(lp.a.node)}, "
                  f"{lp.b.ifname} in {self.ns(lp.b.node)})")
        self.veth_index[(lp.a.node, lp.a.ifname)] = ia
        self.veth_index[(lp.b.node, lp.b.ifname)] = ib

    @staticmethod
    def _root_iproute() -> Any:
        from pyroute2 import IPRoute

        return IPRoute()

    def _tunnel(self, lp: LinkPlan) -> Any:
        from testbed.errors import TestbedError

        end = self.part.tunnel(lp.index)
        if end is None:
            link = self.topo.links[lp.index]
            raise TestbedError(f"link {link.a}-{link.b} crosses hosts but this host's part has no tunnel for it")
        return end

    def _tunnel_end(self, lp: LinkPlan, port: Any, ipr: Any) -> None:
        """This host's end of a cut link: a VXLAN device with the port's name, MAC and MTU. Its
        delay, if any, is netem's on the device (shape())."""
        from testbed.net import tunnels

        tunnels.create(self._tunnel(lp), self.ns(port.node), ipr)

    def _delayed_tunnel_end(self, lp: LinkPlan, ipr: Any) -> None:
        """End A of a cut link with a delay, on a kernel without sch_netem: the link's one delay
        line, for both directions, as on one host. The node's port is a veth like any port (the
        port's name, MAC, shaping); its other end, the line's two TAPs and the VXLAN device sit in a
        namespace of the link's own (names.cut_netns), where tc patches them together in the kernel
        (testbed.net.steer): port <-> line-port, line-tunnel <-> tunnel. Each direction is held for
        its delay less the underlay's latency (the tunnel adds it), as netem would; end B, on the
        other host, is a plain tunnel end. A frame passes through one line, as on one host, and a
        reply that comes back at once finds the line awake, as on one host. The underlay stays out
        of the node's reach."""
        from testbed.net import delayline, steer, tunnels

        link = self.topo.links[lp.index]
        end = self._tunnel(lp)
        ns = names.cut_netns(self.testbed, lp.index)   # (recorded by lifecycle before the build)
        netns.create(ns, COMMON_SYSCTLS)   # (IPv6 off: its devices send nothing of their own)
        tunnels.create(dataclasses.replace(end, ifname=CUT_TUNNEL, mac=names.mac_for(self.testbed, f"l{lp.index}/cut")),
                       ns, ipr)
        self._cut_port(lp, ns)
        dl = delayline.start_delay_link(self.testbed, lp.index, ns, CUT_LINE_PORT, ns, CUT_LINE_TUNNEL,
                                        self._egress(lp.index, link.ab), self._egress(lp.index, link.ba),
                                        max(link.ab.mtu, link.ba.mtu), paths.directory(self.testbed))
        rec = dl.to_json()
        rec["link"] = lp.index
        self.delay_lines.append(rec)
        if self.record is not None:
            self.record("delay_line", rec)
        with netns.Home() as home:
            cut = self._iproute_in_netns(home, ns)
            try:
                lo = cut.link_lookup(ifname="lo")[0]
                cut.link("set", index=lo, state="up", **({"ifalias": self.owner_label} if self.owner_label else {}))
                index = {ifname: cut.link_lookup(ifname=ifname)[0]
                         for ifname in (CUT_PORT, CUT_LINE_PORT, CUT_LINE_TUNNEL, CUT_TUNNEL)}
                for i in index.values():
                    cut.link("set", index=i, state="up")
                what = f"link {link.a}-{link.b} (namespace {ns})"
                for x, y in ((CUT_PORT, CUT_LINE_PORT), (CUT_LINE_TUNNEL, CUT_TUNNEL)):
                    steer.steer(cut, index[x], index[y], f"{what}: {x} -> {y}")
                    steer.steer(cut, index[y], index[x], f"{what}: {y} -> {x}")
            finally:
                cut.close()

    def _cut_port(self, lp: LinkPlan, ns: str) -> None:
        """End A's port of a delayed cut link: a veth whose other end is CUT_PORT in the link's
        namespace `ns` (its ifindex the one a local link's end A would have had)."""
        link, port, side = self.topo.links[lp.index], lp.a, "a"
        index = FIRST_IFINDEX + 2 * lp.index
        fds = [os.open(netns.path(n), os.O_RDONLY | os.O_CLOEXEC) for n in (self.ns(port.node), ns)]
        try:
            with rtnl.Batch() as batch:
                batch.add(rtnl.RTM_NEWLINK, rtnl.CREATE,
                          rtnl.veth(port.ifname, index, fds[0], self.mac(lp, side), max(link.ab.mtu, link.ba.mtu),
                                    CUT_PORT, FIRST_IFINDEX, fds[1], names.mac_for(self.testbed, f"l{lp.index}/port")),
                          f"link {link.a}-{link.b} (veth {port.ifname} in {self.ns(port.node)}, {CUT_PORT} in {ns})")
                batch.commit()
        finally:
            for fd in fds:
                os.close(fd)
        self.veth_index[(port.node, port.ifname)] = index

    def _line_spec(self, lp: LinkPlan) -> Any:
        from testbed.net import delayline

        link = self.topo.links[lp.index]
        return delayline.LineSpec(str(lp.index), self.ns(lp.a.node), lp.a.ifname, self.ns(lp.b.node), lp.b.ifname,
                                  link.ab, link.ba, max(link.ab.mtu, link.ba.mtu))

    def _start_delay_lines(self, specs: list[Any], done: int, total: int) -> None:
        """The delay lines of this build, handed to the engines together; each recorded as it starts."""
        from testbed.net import delayline

        def started(dl: Any) -> None:
            nonlocal done
            rec = dl.to_json()
            rec["link"] = int(dl.link_id)
            self.delay_lines.append(rec)
            if self.record is not None:
                self.record("delay_line", rec)
            done += 1
            self._tick("links", done, total)

        delayline.start_delay_links(self.testbed, specs, paths.directory(self.testbed), on_started=started)

    def mac(self, lp: LinkPlan, side: str) -> str:
        return names.mac_for(self.testbed, f"l{lp.index}{side}")

    def bridge_mac(self, switch: str) -> str:
        return names.mac_for(self.testbed, f"br/{switch}")

    def _iproute_in(self, home: Any, node: str) -> Any:
        """An IPRoute socket bound to `node`'s namespace (made there, then back home)."""
        return self._iproute_in_netns(home, self.ns(node))

    @staticmethod
    def _iproute_in_netns(home: Any, ns: str) -> Any:
        from pyroute2 import IPRoute

        fd = os.open(netns.path(ns), os.O_RDONLY | os.O_CLOEXEC)
        try:
            netns.setns(fd)
            return IPRoute()
        finally:
            home.back()
            os.close(fd)

    def configure(self) -> None:
        """Everything inside each namespace: one IPRoute per namespace, opened after setns."""
        t0 = time.perf_counter()
        neigh = self._neighbours()
        # the egress profile and MAC of every port, by (node, ifname)
        ports: dict[str, list[tuple[Any, LinkProfile, str]]] = {n: [] for n in self.topo.nodes}
        for lp in self.plan.links:
            link = self.topo.links[lp.index]
            ports[lp.a.node].append((lp.a, self._egress(lp.index, link.ab), self.mac(lp, "a")))
            ports[lp.b.node].append((lp.b, self._egress(lp.index, link.ba), self.mac(lp, "b")))
        delayed_links = {rec.get("link") for rec in self.delay_lines}
        delayed_ports: dict[str, set[str]] = {n: set() for n in self.topo.nodes}
        for lp in self.plan.links:
            if lp.index in delayed_links:
                delayed_ports[lp.a.node].add(lp.a.ifname)
                delayed_ports[lp.b.node].add(lp.b.ifname)
        nodes = self.nodes
        for node_ports in ports.values():   # compiled here, once, before the work is forked
            for _port, profile, _mac in node_ports:
                fresh_messages(0, profile, self.caps)
        homes: dict[int, netns.Home] = {}   # per process: the namespace to come back to

        def work(node: str) -> dict[str, float]:
            home = homes.get(os.getpid()) or homes.setdefault(os.getpid(), netns.Home())
            batch = self._batch_in(home, node)
            try:
                return self._configure_node(batch, home, node, ports[node], neigh.get(node, []),
                                            delayed_ports[node])
            finally:
                batch.close()

        done = [0]

        def tally(_i: int, spent: dict[str, float]) -> None:
            for k, v in spent.items():
                self.timings[k] = self.timings.get(k, 0.0) + float(v)
            done[0] += 1
            self._tick("configure", done[0], len(nodes))

        try:
            # A namespace is a few batches now (~1-2 ms, most of it the kernel's, under its one rtnl
            # lock): forked processes paid for themselves only past ~64 namespaces each (k=4's 36
            # configured in 0.054-0.074 s inline, 0.072-0.143 s in two processes, load 5).
            fanout.each(nodes, work, name=lambda n: f"configure {n}", on_done=tally, min_per_proc=64)
        finally:
            home = homes.pop(os.getpid(), None)   # only this process's (inline work): a child's went with it
            if home is not None:
                home.close()
        self._timed("configure", t0)

    def _egress(self, index: int, profile: LinkProfile) -> LinkProfile:
        """A link direction's profile as its sending end shapes it: on a cut link, less the
        underlay's own one-way latency (the tunnel adds it), so traffic sees the configured delay."""
        under = self.part.underlay_s.get(index) if self.part is not None else None
        if not under or profile.delay_s <= 0:
            return profile
        from testbed.net.tunnels import netem_delay_for

        # (the queue is the whole link's, sized before the underlay's share of the delay is cut)
        return profile.with_changes(queue=profile.queue_packets(), delay_s=netem_delay_for(profile.delay_s, under))

    def _batch_in(self, home: Any, node: str) -> rtnl.Batch:
        """A request batch bound to `node`'s namespace (its socket made there, then back home)."""
        fd = os.open(netns.path(self.ns(node)), os.O_RDONLY | os.O_CLOEXEC)
        try:
            netns.setns(fd)
            return rtnl.Batch()
        finally:
            home.back()
            os.close(fd)

    def bridge_index(self) -> int:
        """The ifindex given to a switch's bridge: past every veth end's (FIRST_IFINDEX + 2 x link)."""
        return FIRST_IFINDEX + 2 * len(self.topo.links)

    def _configure_node(self, batch: rtnl.Batch, home: Any, node: str, ports: list[tuple[Any, LinkProfile, str]],
                        neigh: list[tuple[str, str, str]], delayed: set[str]) -> dict[str, float]:
        """Everything inside one namespace, in three batches (links and addresses, shaping, neighbours
        and routes); returns the seconds spent shaping and on routes+neigh."""
        t = time.perf_counter
        index = {"lo": LOOPBACK_IFINDEX}
        known = {port.ifname: self.veth_index.get((node, port.ifname)) for port, _p, _m in ports}
        if any(i is None for i in known.values()):   # a delay line's TAP or a tunnel end: the kernel chose
            index.update({name: idx for name, (idx, _state) in batch.links().items()})
        else:
            index.update(known)
        batch.add(rtnl.RTM_NEWLINK, rtnl.CHANGE, rtnl.link_up(index["lo"], alias=self.owner_label or None),
                  f"lo up in {self.ns(node)}")
        br = None
        subnet = self.plan.subnets.get(node)
        if subnet is not None:
            br = index[BRIDGE] = self.bridge_index()
            batch.add(rtnl.RTM_NEWLINK, rtnl.CREATE, rtnl.bridge(BRIDGE, self.bridge_mac(node), br),
                      f"bridge {BRIDGE} in {self.ns(node)}")
            batch.add(rtnl.RTM_NEWLINK, rtnl.CHANGE, rtnl.link_up(br), f"bridge {BRIDGE} up in {self.ns(node)}")
            net = ipaddress.IPv4Interface(subnet.gateway)
            batch.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(br, str(net.ip), net.network.prefixlen),
                      f"address {subnet.gateway} on {BRIDGE} in {self.ns(node)}")
        for port, profile, mac in ports:
            idx = index[port.ifname]
            batch.add(rtnl.RTM_NEWLINK, rtnl.CHANGE,
                      rtnl.link_up(idx, master=br if port.bridged and br is not None else None,
                                   mac=mac if port.ifname in delayed else None),
                      f"{port.ifname} up in {self.ns(node)}")
            if port.address:
                a = ipaddress.IPv4Interface(port.address)
                batch.add(rtnl.RTM_NEWADDR, rtnl.CREATE, rtnl.address(idx, str(a.ip), a.network.prefixlen),
                          f"address {port.address} on {port.ifname} in {self.ns(node)}")
        batch.commit()
        t1 = t()
        by_hand = []   # what a batch cannot carry (a loss filter's program)
        for port, profile, _mac in ports:
            msgs = fresh_messages(index[port.ifname], profile, self.caps)
            if msgs is None:
                by_hand.append((port, profile))
            for m in msgs or ():
                batch.add_message(m, f"shaping of {port.ifname} in {self.ns(node)}")
        batch.commit()
        if by_hand:
            ipr = self._iproute_in(home, node)
            try:
                for port, profile in by_hand:
                    shape(ipr, index[port.ifname], profile, self.caps)
            finally:
                ipr.close()
        t2 = t()
        for ifname, ip, mac in neigh:
            batch.add(rtnl.RTM_NEWNEIGH, rtnl.CREATE, rtnl.neighbour(index[ifname], ip, mac),
                      f"neighbour {ip} on {ifname} in {self.ns(node)}")
        for route in self.plan.routes.get(node, []):
            batch.add(rtnl.RTM_NEWROUTE, rtnl.CREATE, route_message(route, index),
                      f"route to {route.dst} in {self.ns(node)}")
        batch.commit()
        return {"shaping": t2 - t1, "routes+neigh": t() - t2}

    def _neighbours(self) -> dict[str, list[tuple[str, str, str]]]:
        """node -> [(ifname, ip, mac)]: every neighbour each node can have, from the plan."""
        out: dict[str, list[tuple[str, str, str]]] = {n: [] for n in self.topo.nodes}
        segment: dict[str, list[tuple[str, str, str, str]]] = {}   # switch -> [(worker, ifname, ip, mac)]
        for lp in self.plan.links:
            if lp.kind == "access":
                wside, sside = ("a", "b") if lp.a.address else ("b", "a")
                wp, sp = (lp.a, lp.b) if wside == "a" else (lp.b, lp.a)
                segment.setdefault(sp.node, []).append((wp.node, wp.ifname, _plain(wp.address), self.mac(lp, wside)))
            else:
                out[lp.a.node].append((lp.a.ifname, _plain(lp.b.address), self.mac(lp, "b")))
                out[lp.b.node].append((lp.b.ifname, _plain(lp.a.address), self.mac(lp, "a")))
        for sw, members in segment.items():
            sub = self.plan.subnets.get(sw)
            if sub is None:
                continue
            gw, gw_mac = _plain(sub.gateway), self.bridge_mac(sw)
            for w, ifn, ip, mac in members:
                out[sw].append((BRIDGE, ip, mac))
                out[w].append((ifn, gw, gw_mac))
                for w2, _ifn2, ip2, mac2 in members:
                    if w2 != w:
                        out[w].append((ifn, ip2, mac2))
        return out

    def wait_ready(self, timeout: float = 5.0) -> None:
        """Wait until every interface we made is operationally up (the kernel's linkwatch attaches
        qdiscs asynchronously after carrier comes up; until then a device drops what it sends)."""

        from testbed.errors import TestbedError

        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        expected: dict[str, set[str]] = {n: set() for n in self.nodes}
        for lp in self.plan.links:
            for port in (lp.a, lp.b):
                if port.node in expected:
                    expected[port.node].add(port.ifname)
        for sw in self.plan.subnets:
            if sw in expected:
                expected[sw].add(BRIDGE)
        with netns.Home() as home:
            for node, want in expected.items():
                batch = self._batch_in(home, node)
                try:
                    while True:
                        down = [name for name, (_i, state) in batch.links().items()
                                if name in want and state not in ("UP", "UNKNOWN")]
                        if not down:
                            break
                        if time.monotonic() > deadline:
                            raise TestbedError(f"interfaces of {node} did not come up in {timeout:g} s: "
                                               f"{', '.join(sorted(down))}")
                        time.sleep(0.005)
                finally:
                    batch.close()
        self._timed("wait ready", t0)

    def build(self) -> None:
        """Switch namespaces, worker sysctls, links, per-namespace configuration (workers' namespaces exist)."""
        self.create_switch_namespaces()
        self.set_worker_sysctls()
        self.create_links()
        self.configure()
        self.wait_ready()
