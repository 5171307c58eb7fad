"""Loss without netem: a cls_bpf program, assembled by hand, on an interface's egress.

The program drops a frame silently (TC_ACT_STOLEN) with probability p, else lets it pass
(testbed.net.shaping says why STOLEN and not SHOT). Its own module because two others use it:
the shaping of a lossy link on a kernel without sch_netem, and the probe of what this machine can
do (testbed.net.capabilities tries to install it).
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import struct
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from testbed.net import rtnl

CLSACT = 0xFFFF0000
CLSACT_PARENT = 0xFFFFFFF1   # TC_H_CLSACT: where a clsact qdisc hangs
EGRESS = 0xFFFFFFF3          # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)
ETH_P_ALL = 0x0003
LOSS_PRIO = 1
LOSS_HANDLE = 1

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


# -- the same requests, encoded (as pyroute2 0.9.7 encodes them: tests/test_rtnl.py compares), for
# testbed.net.shaping's batched changes

RTM_NEWQDISC, RTM_DELQDISC, RTM_NEWTFILTER = 36, 37, 44
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_BPF_FD, TCA_BPF_NAME, TCA_BPF_FLAGS, TCA_BPF_FLAG_ACT_DIRECT = 6, 7, 8, 1
NLM_F_REPLACE = 0x100


def clsact_message(idx: int) -> bytes:
    """Add the clsact qdisc (EEXIST when one is there)."""
    return rtnl.tc(RTM_NEWQDISC, rtnl.CREATE, idx, CLSACT, CLSACT_PARENT, attrs=rtnl.attr(TCA_KIND, b"clsact\0"))


def clsact_delete_message(idx: int) -> bytes:
    """Delete the clsact qdisc, and with it the filter (ENOENT/EINVAL when none is there)."""
    return rtnl.tc(RTM_DELQDISC, rtnl.NLM_F_REQUEST | rtnl.NLM_F_ACK, idx, CLSACT, CLSACT_PARENT)


def filter_message(idx: int, fd: int, p: float, replace: bool = False) -> bytes:
    """Add (or replace) the filter running the loaded program `fd`, as install() does."""
    options = (rtnl.attr(TCA_BPF_FD, struct.pack("=I", fd))
               + rtnl.attr(TCA_BPF_NAME, f"tb_loss_{p:.6f}".encode() + b"\0")
               + rtnl.attr(TCA_BPF_FLAGS, struct.pack("=I", TCA_BPF_FLAG_ACT_DIRECT)))
    flags = rtnl.NLM_F_REQUEST | rtnl.NLM_F_ACK | rtnl.NLM_F_CREATE | (NLM_F_REPLACE if replace else rtnl.NLM_F_EXCL)
    info = (LOSS_PRIO << 16) | socket.htons(ETH_P_ALL)
    return rtnl.tc(RTM_NEWTFILTER, flags, idx, LOSS_HANDLE, EGRESS, info,
                   rtnl.attr(TCA_KIND, b"bpf\0") + rtnl.attr(TCA_OPTIONS, options))


def install(ipr: Any, idx: int, p: float, replace: bool = False) -> None:
    """The filter on interface `idx`'s egress (a clsact qdisc added if there is none); replace: in place
    of the one there."""
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


def remove(ipr: Any, idx: int) -> None:
    """The clsact qdisc of interface `idx`, and with it the filter (none there: nothing to do)."""
    try:
        ipr.tc("del", index=idx, handle=CLSACT, parent=CLSACT_PARENT)
    except NetlinkError:
        pass
