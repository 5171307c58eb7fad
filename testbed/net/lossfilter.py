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
import struct
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

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
