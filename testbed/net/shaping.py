"""Per-direction link shaping: egress of one interface inside a namespace.

Everything goes through netlink (pyroute2, or testbed.net.rtnl's batches); no shell strings.

What gets installed on the egress of an interface for one LinkProfile:

    bandwidth      HTB root 1: with one class 1:1 (default class), rate=ceil=
                   bandwidth, explicit burst/cburst (rate x 2 ms, at least 4
                   frames and one 64 KiB GSO frame) and an explicit quantum.
                   TSO/GSO stay on (turning them off made shaping worse).
    delay/jitter   with sch_netem: netem, as the leaf of 1:1 (or the root
                   when there is no bandwidth). Jitter never reorders: netem
                   is given a `rate` of 34 Gbit/s (the largest its u32 field
                   holds, above what a veth moves), and with a rate netem
                   schedules each packet after the previous one (time_to_send =
                   max(now + delay, last) + len/rate), i.e. FIFO. Without a
                   rate netem sorts packets by their own random send time and
                   reorders them.
                   without netem: nothing here; the link is a userspace delay
                   line (testbed.net.delayline) and this module shapes its TAPs.
                   Delay+jitter at or below the measured latency floor (without
                   netem: the floor plus the delay line's own ~100 us) gets no
                   delay element at all (see `delay_threshold`).
    loss           with netem: netem's loss. Without: clsact + a cls_bpf
                   direct-action filter on egress (bpf_get_prandom_u32 ->
                   TC_ACT_STOLEN with probability `loss`), hand-assembled in
                   testbed.net.lossfilter.
                   STOLEN, not SHOT: SHOT makes the send fail with ENOBUFS for a
                   local sender (ping/TCP then just resend, nothing is "lost");
                   STOLEN reports success and frees the packet, like a wire
                   (and like netem, which also drops silently).
                   Like netem, a drop drops a whole GSO frame.
    queue          the leaf of 1:1: without netem a bfifo of queue x (mtu+14)
                   bytes (bytes, so GSO frames count by size; at least one
                   64 KiB GSO frame, which a smaller fifo would refuse
                   every time, stalling its flow); with netem
                   netem's limit (packets) = queue + packets in flight over the
                   delay (netem holds both). queue None sizes it from the
                   link (LinkProfile.queue_packets: Linux's 1000 packets,
                   at most 2.5 ms of the rate, at least 1.5 x the BDP over
                   the round trip (>= 1 ms) and 100 packets; unshaped: 10
                   Gbit/s assumed). A dilated link's profile comes with its
                   declared link's queue.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from testbed.errors import CapabilityError
# the latency floor and the delay threshold are the machine's (defined there, re-exported here)
from testbed.net.capabilities import DEFAULT_FLOOR_S, DELAY_LINE_OVERHEAD_S, delay_threshold, floor_of  # noqa: F401
from testbed.net.capabilities import turned_off
from testbed.topology.model import UNSHAPED_RATE_BPS, LinkProfile

# pyroute2 (and testbed.net.lossfilter, which needs it) are imported where a function is given an
# IPRoute: importing pyroute2's package is ~0.15 s, a quarter of a k=4 `up`, which sends its
# shaping through testbed.net.rtnl (fresh_messages) and needs none of it.
_PATCHED: list[bool] = []


def _pyroute2() -> Any:
    """pyroute2's NetlinkError, with its tc plugins made to encode what we install."""
    from pyroute2.netlink.exceptions import NetlinkError

    if not _PATCHED:
        from pyroute2.netlink.rtnl.tcmsg import plugins, sched_pfifo

        # bfifo's options are pfifo's (struct tc_fifo_qopt { u32 limit }); pyroute2 0.9.7 only names pfifo.
        plugins.setdefault("bfifo", sched_pfifo)
        # pyroute2 0.9.7's netem has no fix_request, so a `rate` kwarg also lands in the top-level
        # TCA_RATE attribute and fails to encode; htb/tbf drop it the same way after building their options.
        netem = plugins["netem"]
        if not hasattr(netem, "fix_request"):
            def _netem_fix_request(request: Any) -> None:
                request.pop("rate", None)
            netem.fix_request = _netem_fix_request
        _PATCHED.append(True)
    return NetlinkError

ROOT = 0x10000          # 1:
CLASS = 0x10001         # 1:1
LEAF = 0x100000         # 10:
TC_H_ROOT = 0xFFFFFFFF
ETH_HLEN = 14
GSO_MAX = 65536
NETEM_MAX_RATE = 0xFFFFFFFF       # bytes/s in netem's u32 rate field (~34.4 Gbit/s)


# -- what a profile needs ---------------------------------------------------------


def has_delay(profile: LinkProfile, caps: Any) -> bool:
    """The profile asks for delay/jitter above the threshold (it gets a delay element)."""
    return profile.delay_s + profile.jitter_s > delay_threshold(caps)


def below_floor(profile: LinkProfile, caps: Any) -> bool:
    """Delay/jitter asked for, but at or below the threshold: no delay element (tell the user)."""
    total = profile.delay_s + profile.jitter_s
    return 0 < total <= delay_threshold(caps)


def needs_delay_line(profile: LinkProfile, caps: Any) -> bool:
    """True when this direction needs the userspace delay line (delay above the floor, no netem)."""
    return has_delay(profile, caps) and not caps.netem


def link_needs_delay_line(ab: LinkProfile, ba: LinkProfile, caps: Any) -> bool:
    """A link is a delay line (two TAPs) when either direction needs one."""
    return needs_delay_line(ab, caps) or needs_delay_line(ba, caps)


def mechanisms(profile: LinkProfile, caps: Any) -> set[str]:
    """The mechanisms a profile uses on this machine: htb, netem, delay-line, bpf-loss, bfifo."""
    out: set[str] = set()
    if profile.bandwidth_bps:
        out.add("htb")
    if has_delay(profile, caps):
        out.add("netem" if caps.netem else "delay-line")
    if profile.loss > 0:
        out.add("netem" if caps.netem else "bpf-loss")
    if profile.bandwidth_bps and "netem" not in out:
        out.add("bfifo")
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:g}ms"


def check_supported(profiles: Iterable[tuple[str, LinkProfile]], caps: Any) -> None:
    """Raise CapabilityError naming every profile this machine cannot emulate. Creates nothing."""
    problems: list[str] = []
    for where, p in profiles:
        if p.bandwidth_bps and not caps.htb:
            problems.append(f"{where}: bandwidth {p.bandwidth_bps / 1e6:g}Mbit/s needs sch_htb "
                            "(CONFIG_NET_SCH_HTB)")
        if has_delay(p, caps) and not caps.netem and not caps.tun:
            what = f"jitter {_ms(p.jitter_s)}" if p.jitter_s and not p.delay_s else f"delay {_ms(p.delay_s)}"
            if p.jitter_s and p.delay_s:
                what += f" jitter {_ms(p.jitter_s)}"
            problems.append(f"{where}: {what} needs sch_netem or the userspace delay line "
                            "(needs /dev/net/tun)")
        if p.loss > 0 and not caps.netem and not caps.bpf:
            problems.append(f"{where}: loss {p.loss * 100:g}% needs sch_netem or clsact + cls_bpf "
                            "(CONFIG_NET_CLS_BPF, CONFIG_BPF_SYSCALL)")
    if problems:
        more = "" if len(problems) <= 20 else f"\n  ... and {len(problems) - 20} more"
        why = "".join(f"\n  ({k}: {v})" for k, v in sorted(turned_off(caps).items()))
        raise CapabilityError("this kernel cannot emulate these links:\n  " + "\n  ".join(problems[:20]) + more + why)


# -- the plan: what apply() installs ----------------------------------------------

@dataclass(frozen=True)
class Plan:
    rate_Bps: int | None = None       # HTB rate, bytes/s
    burst: int = 0                    # bytes
    quantum: int = 0
    netem: dict[str, Any] | None = None   # kwargs for pyroute2's netem
    fifo_bytes: int | None = None     # bfifo limit
    bpf_loss: float = 0.0
    mtu: int = 1500

    @property
    def layout(self) -> tuple[bool, bool, bool, bool]:
        return (self.rate_Bps is not None, self.netem is not None, self.fifo_bytes is not None, self.bpf_loss > 0)


def in_flight_packets(profile: LinkProfile) -> int:
    """Packets netem holds while they wait out delay+jitter at the link's rate."""
    rate = profile.bandwidth_bps or UNSHAPED_RATE_BPS
    return math.ceil(rate * (profile.delay_s + profile.jitter_s) / (profile.mtu * 8) - 1e-6)


def make_plan(profile: LinkProfile, caps: Any) -> Plan:
    frame = profile.mtu + ETH_HLEN
    rate_Bps = burst = quantum = 0
    if profile.bandwidth_bps:
        rate_Bps = int(profile.bandwidth_bps // 8)
        burst = max(int(rate_Bps * 0.002), 4 * frame, GSO_MAX + frame)
        quantum = max(frame, min(200_000, rate_Bps // 10))
    netem = None
    want_delay = has_delay(profile, caps)
    if caps.netem and (want_delay or profile.loss > 0):
        netem = {
            "delay": int(round(profile.delay_s * 1e6)) if want_delay else 0,   # microseconds
            "jitter": int(round(profile.jitter_s * 1e6)) if want_delay else 0,
            "loss": profile.loss * 100.0,                                      # percent
            "limit": profile.queue_packets() + in_flight_packets(profile),
        }
        if netem["jitter"]:
            netem["rate"] = NETEM_MAX_RATE  # keeps FIFO order (see the module docstring)
    fifo = None
    if profile.bandwidth_bps and netem is None:
        # never below one largest GSO frame: a frame the fifo cannot hold is refused every time it
        # is sent, and the flow stalls (measured: queue 32 (48 KB) on a 10 Gbit/s link's sender)
        fifo = max(profile.queue_packets() * frame, GSO_MAX + frame)
    bpf_loss = profile.loss if (profile.loss > 0 and not caps.netem) else 0.0
    return Plan(rate_Bps=rate_Bps or None, burst=burst, quantum=quantum, netem=netem,
                fifo_bytes=fifo, bpf_loss=bpf_loss, mtu=profile.mtu)


# -- installing -------------------------------------------------------------------

def _index(ipr: Any, ifname: int | str) -> int:
    if isinstance(ifname, int):
        return ifname
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise LookupError(f"no interface {ifname!r} in this namespace")
    return found[0]


def _htb_class_kw(plan: Plan) -> dict[str, Any]:
    return dict(parent=ROOT, rate=f"{plan.rate_Bps * 8}bit",
                ceil=f"{plan.rate_Bps * 8}bit", burst=plan.burst, cburst=plan.burst,
                quantum=plan.quantum, mtu=max(1600, plan.mtu + ETH_HLEN), prio=0)


def _install(ipr: Any, idx: int, plan: Plan, mode: str) -> None:
    """mode 'add' on a clean interface, 'change' to change a same-layout install in place."""
    _pyroute2()
    qcmd = "add" if mode == "add" else "change"
    ccmd = "add-class" if mode == "add" else "change-class"
    if plan.rate_Bps:
        if mode == "add":
            ipr.tc("add", "htb", idx, ROOT, default=0x1, r2q=10)
        ipr.tc(ccmd, "htb", idx, CLASS, **_htb_class_kw(plan))
        if plan.netem is not None:
            ipr.tc(qcmd, "netem", idx, LEAF, parent=CLASS, **plan.netem)
        elif plan.fifo_bytes is not None:
            ipr.tc(qcmd, "bfifo", idx, LEAF, parent=CLASS, limit=plan.fifo_bytes)
    elif plan.netem is not None:
        ipr.tc(qcmd, "netem", idx, ROOT, parent=TC_H_ROOT, **plan.netem)
    if plan.bpf_loss > 0:
        from testbed.net import lossfilter

        lossfilter.install(ipr, idx, plan.bpf_loss, replace=(mode != "add"))


# Encoded requests per plan, compiled once per process (the builder compiles before it forks):
# every interface of a tier gets the same messages, only its ifindex differs.
_COMPILED: dict[str, list[bytes]] = {}
_TEMPLATE_INDEX = 0x7FFF_FFF0
_TCM_IFINDEX = 16 + 4   # in a tc request: the netlink header, then tcmsg's family and padding


def fresh_messages(index: int, profile: LinkProfile, caps: Any) -> list[bytes] | None:
    """The tc requests `apply(..., fresh=True)` sends for `profile` on the interface `index`, encoded
    (for testbed.net.rtnl's batches); None when the install is more than requests (cls_bpf loss
    loads a program first: apply() does that one)."""
    plan = make_plan(profile, caps)
    if plan.bpf_loss > 0:
        return None
    return _messages(index, plan, "add")


_NLM_F_CHANGE = 0x1 | 0x4 | 0x100   # REQUEST | ACK | REPLACE: pyroute2's 'change' (no CREATE: it must be there)


def _messages(index: int, plan: Plan, mode: str) -> list[bytes]:
    """_install(plan, mode)'s tc requests on the interface `index`, the loss filter left out: 'add'
    as compiled; 'change' the same requests with pyroute2's change flags, less the HTB root (a
    change leaves it as it is)."""
    plan = dataclasses.replace(plan, bpf_loss=0.0)   # (the filter's requests are _send's: a program each)
    key = repr(plan)
    template = _COMPILED.get(key)
    if template is None:
        template = _COMPILED[key] = _compile(plan)
    if mode == "change":
        template = [m[:6] + struct.pack("=H", _NLM_F_CHANGE) + m[8:] for m in template[1 if plan.rate_Bps else 0:]]
    where = struct.pack("=i", index)
    return [m[:_TCM_IFINDEX] + where + m[_TCM_IFINDEX + 4:] for m in template]


def _delete_message(index: int, handle: int, parent: int) -> bytes:
    """A kind-less delete of the qdisc `handle` under `parent` (handle 0 at the root: whatever qdisc is
    there, as `tc qdisc del dev X root`; the kernel's default one answers ENOENT)."""
    from testbed.net import rtnl

    return rtnl.tc(RTM_DELQDISC, rtnl.NLM_F_REQUEST | rtnl.NLM_F_ACK, index, handle, parent)


def _compile(plan: Plan) -> list[bytes]:
    """The requests of _install(plan, "add") on a placeholder interface: HTB and bfifo encoded here
    (what `up` installs without netem: no pyroute2 to import), netem by pyroute2."""
    if plan.netem is None:
        ticks = _psched_ticks_per_us()
        if ticks is not None:
            return _htb_messages(plan, ticks)
    return _pyroute2_compile(plan)


# -- HTB and bfifo requests, encoded as pyroute2 0.9.7 encodes them (tests/test_rtnl.py compares) --

RTM_NEWQDISC, RTM_DELQDISC, RTM_NEWTCLASS = 36, 37, 40
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_HTB_PARMS, TCA_HTB_INIT, TCA_HTB_CTAB, TCA_HTB_RTAB, TCA_HTB_RATE64, TCA_HTB_CEIL64 = 1, 2, 3, 4, 6, 7
_CREATE = 0x1 | 0x4 | 0x200 | 0x400    # NLM_F_REQUEST | ACK | EXCL | CREATE
_RTAB_CELL_LOG = 3                      # tc's for an MTU of 1600 (pyroute2 always sizes cells so)


def _psched_ticks_per_us() -> float | None:
    """The kernel's packet-scheduler clock in ticks per microsecond (/proc/net/psched, as tc and
    pyroute2 read it); None when it cannot be read (pyroute2 then encodes, with its own fallback)."""
    try:
        with open("/proc/net/psched") as f:
            t2us, us2t, clock_res, _wee = (int(x, 16) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return t2us / us2t * (clock_res / 1_000_000)


def _xmit_ticks(rate_Bps: float, size: float, ticks_per_us: float) -> int:
    """Time to send `size` bytes at `rate_Bps`, in scheduler ticks (tc's tc_calc_xmittime)."""
    return int(int(1_000_000 * (size / rate_Bps)) * ticks_per_us)


def _rtattr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n & 3)


def _tc_request(kind: int, handle: int, parent: int, qdisc: str, options: bytes) -> bytes:
    body = struct.pack("=BxxxiIII", 0, _TEMPLATE_INDEX, handle, parent, 0) \
        + _rtattr(TCA_KIND, qdisc.encode() + b"\0") + _rtattr(TCA_OPTIONS, options)
    return struct.pack("=IHHII", 16 + len(body), kind, _CREATE, 0, 0) + body


def _htb_messages(plan: Plan, ticks_per_us: float) -> list[bytes]:
    """HTB root, its one class at the plan's rate (rate = ceil, rate tables included), bfifo leaf."""
    if not plan.rate_Bps:
        return []
    rate = float(plan.rate_Bps)   # bytes/s (pyroute2 parses "<bits>bit" into a float)
    buffer = _xmit_ticks(rate, plan.burst, ticks_per_us)
    table_rate = rate if rate < 1 << 32 else (1 << 32) - 1   # past 32 bits: the field saturates, RATE64 says
    spec = struct.pack("=BBHhHI", _RTAB_CELL_LOG, 0, 0, -1, 0, int(table_rate))   # cell_log, linklayer, overhead,
    parms = spec + spec + struct.pack("=IIIII", buffer, buffer, plan.quantum, 0, 0)   # align, mpu; ceil = rate
    table = struct.pack("=256I", *(_xmit_ticks(table_rate, (i + 1) << _RTAB_CELL_LOG, ticks_per_us)
                                   for i in range(256)))
    options = _rtattr(TCA_HTB_PARMS, parms) + _rtattr(TCA_HTB_RTAB, table) + _rtattr(TCA_HTB_CTAB, table)
    if rate >= 1 << 32:
        options += _rtattr(TCA_HTB_RATE64, struct.pack("=Q", int(rate))) \
            + _rtattr(TCA_HTB_CEIL64, struct.pack("=Q", int(rate)))
    out = [
        # version 3, rate2quantum 10, default class 1:1, debug 0, direct packets 0
        _tc_request(RTM_NEWQDISC, ROOT, TC_H_ROOT, "htb", _rtattr(TCA_HTB_INIT, struct.pack("=5I", 3, 10, 1, 0, 0))),
        _tc_request(RTM_NEWTCLASS, CLASS, ROOT, "htb", options),
    ]
    if plan.fifo_bytes is not None:
        out.append(_tc_request(RTM_NEWQDISC, LEAF, CLASS, "bfifo", struct.pack("=i", plan.fifo_bytes)))
    return out


def _pyroute2_compile(plan: Plan) -> list[bytes]:
    """pyroute2's own encoding of _install(plan) on a placeholder interface (IPBatch sends nothing)."""
    from pyroute2.iproute.linux import IPBatch

    ipb = IPBatch()
    try:
        _install(ipb, _TEMPLATE_INDEX, plan, "add")
        data = bytes(ipb.asyncore.batch)
    finally:
        ipb.close()
    out, off = [], 0
    while off < len(data):
        length = struct.unpack_from("=I", data, off)[0]
        msg = data[off:off + length]
        if length < _TCM_IFINDEX + 4 or struct.unpack_from("=i", msg, _TCM_IFINDEX)[0] != _TEMPLATE_INDEX:
            raise RuntimeError(f"pyroute2 encoded a tc request of {length} bytes without the interface "
                               "where testbed.net.shaping patches it: update _TCM_IFINDEX")
        out.append(msg)
        off += (length + 3) & ~3
    return out


def apply(ipr: Any, ifname: int | str, profile: LinkProfile, caps: Any, *, fresh: bool = False) -> Plan:
    """Shape the egress of `ifname` (index or name) in the namespace `ipr` is bound to.

    Removes whatever root qdisc/clsact was there first, unless `fresh` says the interface
    was just created (the builder: it saves a dump and deletes per interface).
    Returns the plan installed. Delay without netem is not done here (the link must be a
    delay line).
    """
    idx = _index(ipr, ifname)
    if not fresh:
        clear(ipr, idx)
    plan = make_plan(profile, caps)
    _install(ipr, idx, plan, "add")
    return plan


def change(ipr: Any, ifname: int | str, old: LinkProfile | None, new: LinkProfile, caps: Any) -> Plan:
    """Change a running link's shaping: in place (netlink change) when the layout is the same, else
    delete and reinstall (also when the change in place fails). Each is one batch of requests
    (testbed.net.rtnl), sent in the namespace of `ipr`'s socket; a name costs a link dump first. A pyroute2 call per request took 9-21 ms for a reinstall that adds
    loss on this 2-core machine, idle; the batch 1-3 ms (docs/HACKING.md, `timing`)."""
    from testbed.net import rtnl

    new_plan = make_plan(new, caps)
    old_plan = make_plan(old, caps) if old is not None else None
    with rtnl.Batch.beside(ipr.fileno()) as batch:
        if isinstance(ifname, int):
            idx = ifname
        else:
            found = batch.links().get(ifname)
            if found is None:
                raise LookupError(f"no interface {ifname!r} in this namespace")
            idx = found[0]
        if old_plan is not None and old_plan.layout == new_plan.layout:
            try:
                _send(batch, idx, new_plan, "change")
                return new_plan
            except rtnl.RtnlError:
                pass  # fall back to a reinstall
        # both deletes, whatever `old` says: the kernel may not hold what the state does (a change
        # that failed half-way, a job with net_admin), and nothing there to delete is no failure
        from testbed.net import lossfilter

        gone = (errno.ENOENT, errno.EINVAL)
        batch.add_message(_delete_message(idx, 0, TC_H_ROOT), f"delete the root qdisc of interface {idx}", gone)
        batch.add_message(lossfilter.clsact_delete_message(idx), f"delete the loss filter of interface {idx}", gone)
        _send(batch, idx, new_plan, "add")
    return new_plan


def _send(batch: Any, idx: int, plan: Plan, mode: str) -> None:
    """Queue _install(plan, mode)'s requests after what `batch` holds, and send them all."""
    what = f"{mode} the shaping of interface {idx}"
    for message in _messages(idx, plan, mode):
        batch.add_message(message, what)
    fd = None
    try:
        if plan.bpf_loss > 0:
            from testbed.net import lossfilter

            fd = lossfilter.load_loss_program(plan.bpf_loss)
            if mode == "add":
                batch.add_message(lossfilter.clsact_message(idx), f"{what}: clsact", (errno.EEXIST,))
            batch.add_message(lossfilter.filter_message(idx, fd, plan.bpf_loss, replace=mode != "add"),
                              f"{what}: loss filter")
        batch.commit()
    finally:
        if fd is not None:
            os.close(fd)


def clear(ipr: Any, ifname: int | str) -> None:
    """Remove our shaping (root qdisc and clsact) from `ifname`; quiet when nothing is there."""
    from testbed.net import lossfilter

    NetlinkError = _pyroute2()
    idx = _index(ipr, ifname)
    # kind-less deletes: pyroute2 would otherwise run the kind's option builder on a delete
    try:
        qdiscs = ipr.get_qdiscs(idx)
    except NetlinkError:
        qdiscs = []
    for q in qdiscs:
        kind = q.get_attr("TCA_KIND")
        if q["parent"] == TC_H_ROOT and kind not in ("noqueue", "pfifo_fast", "mq"):
            _del_qdisc(ipr, idx, q["handle"], TC_H_ROOT)
        elif kind == "clsact":
            lossfilter.remove(ipr, idx)


def _del_qdisc(ipr: Any, idx: int, handle: int, parent: int) -> None:
    NetlinkError = _pyroute2()
    try:
        ipr.tc("del", index=idx, handle=handle, parent=parent)
    except NetlinkError:
        pass


def describe(ipr: Any, ifname: int | str) -> dict[str, Any]:
    """What is installed on `ifname` (qdiscs, classes, egress filters) with counters."""
    from testbed.net.lossfilter import EGRESS

    NetlinkError = _pyroute2()
    idx = _index(ipr, ifname)

    def h(x: int) -> str:
        if x == TC_H_ROOT:
            return "root"
        return f"{x >> 16:x}:{x & 0xFFFF:x}"

    out: dict[str, Any] = {"index": idx, "qdiscs": [], "classes": [], "filters": []}
    for q in ipr.get_qdiscs(idx):
        kind = q.get_attr("TCA_KIND")
        entry: dict[str, Any] = {"kind": kind, "handle": h(q["handle"]), "parent": h(q["parent"])}
        opts = q.get_attr("TCA_OPTIONS")
        if opts is not None and kind in ("netem", "pfifo", "bfifo"):
            for key in ("delay", "jitter", "limit", "loss"):
                try:
                    entry[key] = opts[key] if not hasattr(opts, "get") else opts.get(key)
                except (KeyError, TypeError):
                    pass
        st = q.get_attr("TCA_STATS2")
        if st is not None:
            basic = st.get_attr("TCA_STATS_BASIC")
            queue = st.get_attr("TCA_STATS_QUEUE")
            if basic is not None:
                entry["bytes"], entry["packets"] = basic["bytes"], basic["packets"]
            if queue is not None:
                entry["drops"], entry["backlog"] = queue["drops"], queue["backlog"]
        out["qdiscs"].append(entry)
    try:
        for c in ipr.get_classes(idx):
            entry = {"kind": c.get_attr("TCA_KIND"), "handle": h(c["handle"]), "parent": h(c["parent"])}
            opts = c.get_attr("TCA_OPTIONS")
            parms = opts.get_attr("TCA_HTB_PARMS") if opts is not None else None
            if parms is not None:
                rate64 = opts.get_attr("TCA_HTB_RATE64")
                entry["rate_bps"] = (rate64 or parms["rate"]["rate"] if isinstance(parms["rate"], dict)
                                     else rate64 or parms["rate"]) * 8
            out["classes"].append(entry)
    except NetlinkError:
        pass
    try:
        for f in ipr.get_filters(idx, parent=EGRESS):
            opts = f.get_attr("TCA_OPTIONS")
            if opts is None:
                continue
            name = opts.get_attr("TCA_BPF_NAME")
            if name:
                out["filters"].append({"kind": f.get_attr("TCA_KIND"), "name": name})
    except NetlinkError:
        pass
    return out
