"""Per-direction link shaping: egress of one interface inside a namespace.

Everything goes through pyroute2 (netlink); no shell strings.

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
                   TC_ACT_STOLEN with probability `loss`), hand-assembled below.
                   STOLEN, not SHOT: SHOT makes the send fail with ENOBUFS for a
                   local sender (ping/TCP then just resend, nothing is "lost");
                   STOLEN reports success and frees the packet, like a wire
                   (and like netem, which also drops silently).
                   Like netem, a drop drops a whole GSO frame.
    queue          the leaf of 1:1: without netem a bfifo of queue x (mtu+14)
                   bytes (bytes, so GSO frames count by size); with netem
                   netem's limit (packets) = queue + packets in flight over the
                   delay (netem holds both). queue None sizes it from the
                   bandwidth-delay product: max(1000, ceil(1.5 x BDP / mtu)),
                   BDP taken over delay+jitter (at least 1 ms) at the shaped
                   rate (unshaped: 10 Gbit/s assumed).
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins
from pyroute2.netlink.rtnl.tcmsg import sched_pfifo as _sched_pfifo

from testbed.errors import CapabilityError
# the latency floor and the delay threshold are the machine's (defined there, re-exported here)
from testbed.net.capabilities import DEFAULT_FLOOR_S, DELAY_LINE_OVERHEAD_S, delay_threshold, floor_of  # noqa: F401
from testbed.topology.model import LinkProfile

# bfifo's options are pfifo's (struct tc_fifo_qopt { u32 limit }); pyroute2 0.9.7 only names pfifo.
_tc_plugins.setdefault("bfifo", _sched_pfifo)
# pyroute2 0.9.7's netem has no fix_request, so a `rate` kwarg also lands in the top-level TCA_RATE
# attribute and fails to encode; htb/tbf drop it the same way after building their options.
_sched_netem = _tc_plugins["netem"]
if not hasattr(_sched_netem, "fix_request"):
    def _netem_fix_request(request: Any) -> None:
        request.pop("rate", None)
    _sched_netem.fix_request = _netem_fix_request

ROOT = 0x10000          # 1:
CLASS = 0x10001         # 1:1
LEAF = 0x100000         # 10:
TC_H_ROOT = 0xFFFFFFFF
CLSACT = 0xFFFF0000
EGRESS = 0xFFFFFFF3     # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)
ETH_P_ALL = 0x0003
LOSS_PRIO = 1
LOSS_HANDLE = 1
ETH_HLEN = 14
GSO_MAX = 65536
NETEM_MAX_RATE = 0xFFFFFFFF       # bytes/s in netem's u32 rate field (~34.4 Gbit/s)
UNSHAPED_RATE_BPS = 10_000_000_000  # queue sizing when a link has no bandwidth
DEFAULT_QUEUE = 1000


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
        raise CapabilityError("this kernel cannot emulate these links:\n  " + "\n  ".join(problems[:20]) + more)


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


def queue_packets(profile: LinkProfile) -> int:
    """The bottleneck queue in packets: the profile's, or 1.5 x BDP (at least DEFAULT_QUEUE)."""
    if profile.queue:
        return int(profile.queue)
    rate = profile.bandwidth_bps or UNSHAPED_RATE_BPS
    rtt_part = max(profile.delay_s + profile.jitter_s, 0.001)
    bdp_pkts = math.ceil(rate * rtt_part * 1.5 / (profile.mtu * 8) - 1e-6)
    return max(DEFAULT_QUEUE, bdp_pkts)


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
            "limit": queue_packets(profile) + in_flight_packets(profile),
        }
        if netem["jitter"]:
            netem["rate"] = NETEM_MAX_RATE  # keeps FIFO order (see the module docstring)
    fifo = None
    if profile.bandwidth_bps and netem is None:
        fifo = queue_packets(profile) * frame
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
        _install_loss_filter(ipr, idx, plan.bpf_loss, replace=(mode != "add"))


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
    clear and reinstall. Either way a few netlink round trips (~1 ms)."""
    idx = _index(ipr, ifname)
    new_plan = make_plan(new, caps)
    if old is not None and make_plan(old, caps).layout == new_plan.layout:
        try:
            _install(ipr, idx, new_plan, "change")
            return new_plan
        except NetlinkError:
            pass  # fall back to a reinstall
    clear(ipr, idx)
    _install(ipr, idx, new_plan, "add")
    return new_plan


def clear(ipr: Any, ifname: int | str) -> None:
    """Remove our shaping (root qdisc and clsact) from `ifname`; quiet when nothing is there."""
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
            _del_qdisc(ipr, idx, CLSACT, 0xFFFFFFF1)


def _del_qdisc(ipr: Any, idx: int, handle: int, parent: int) -> None:
    try:
        ipr.tc("del", index=idx, handle=handle, parent=parent)
    except NetlinkError:
        pass


def describe(ipr: Any, ifname: int | str) -> dict[str, Any]:
    """What is installed on `ifname` (qdiscs, classes, egress filters) with counters."""
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


# -- loss without netem: a hand-assembled cls_bpf program ------------------------------

_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}
BPF_PROG_LOAD = 5
BPF_PROG_TYPE_SCHED_CLS = 3
TC_ACT_OK, TC_ACT_SHOT, TC_ACT_STOLEN = 0, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def loss_program(p: float) -> bytes:
    """BPF bytecode: drop silently (TC_ACT_STOLEN) with probability p, else TC_ACT_OK.

        r0 = bpf_get_prandom_u32(); r0 >>= 1      # 31 random bits (imm32 is signed)
        if r0 >= T goto pass                       # T = p * 2^31
        r0 = TC_ACT_STOLEN; exit
      pass: r0 = TC_ACT_OK; exit
    """
    if p >= 1.0:
        return _insn(0xB7, imm=TC_ACT_STOLEN) + _insn(0x95)
    t = max(0, min((1 << 31) - 1, int(round(p * (1 << 31)))))
    return b"".join([
        _insn(0x85, imm=7),                 # call bpf_get_prandom_u32
        _insn(0x77, dst=0, imm=1),          # r0 >>= 1 (ALU64 RSH K)
        _insn(0x35, dst=0, off=2, imm=t),   # if r0 >= t goto +2 (JMP JGE K)
        _insn(0xB7, dst=0, imm=TC_ACT_STOLEN),
        _insn(0x95),
        _insn(0xB7, dst=0, imm=TC_ACT_OK),
        _insn(0x95),
    ])


def load_loss_program(p: float) -> int:
    """Load the loss program with bpf(2); returns its fd (the caller closes it)."""
    nr = _BPF_SYSCALL.get(platform.machine())
    if nr is None:
        raise OSError(f"bpf(2) syscall number unknown on {platform.machine()}")
    code = loss_program(p)
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(4096)
    attr = ctypes.create_string_buffer(128)
    # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version, prog_flags, prog_name
    struct.pack_into("<IIQQIIQII16s", attr, 0, BPF_PROG_TYPE_SCHED_CLS, len(code) // 8,
                     ctypes.addressof(insns), ctypes.addressof(lic), 1, len(log), ctypes.addressof(log),
                     0, 0, b"tb_loss")
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(BPF_PROG_LOAD), attr, ctypes.c_uint(128))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf prog load: {os.strerror(err)}: {log.value.decode(errors='replace')}")
    return fd


def _install_loss_filter(ipr: Any, idx: int, p: float, replace: bool = False) -> None:
    fd = load_loss_program(p)
    try:
        try:
            ipr.tc("add", "clsact", idx)
        except NetlinkError as exc:
            if exc.code != 17:  # EEXIST: clsact already there
                raise
        ipr.tc("replace-filter" if replace else "add-filter", "bpf", idx, LOSS_HANDLE, parent=EGRESS,
               prio=LOSS_PRIO, protocol=ETH_P_ALL, fd=fd, name=f"tb_loss_{p:.6f}", direct_action=True)
    finally:
        os.close(fd)


def _remove_loss_filter(ipr: Any, idx: int) -> None:
    _del_qdisc(ipr, idx, CLSACT, 0xFFFFFFF1)
