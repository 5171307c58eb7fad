"""A command under torchrun: how `testbed run` recognises one, adds the rendezvous to it, tags its
ranks' lines, and swaps its script for another module (the phantoms)."""

from __future__ import annotations

import os
import re
from typing import Sequence


# torchrun --tee: every line of a local rank starts with this (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)
TORCHRUN_PREFIX_TEMPLATE = "[r${rank}]:"
RANK_PREFIX = re.compile(r"^\[r(\d+)\]:")   # (what that template makes: N is the global rank)


def is_torchrun(cmd: Sequence[str]) -> bool:
    if not cmd:
        return False
    if os.path.basename(cmd[0]) == "torchrun":
        return True
    return len(cmd) >= 3 and os.path.basename(cmd[0]).startswith("python") and cmd[1] == "-m" \
        and cmd[2] == "torch.distributed.run"


def _has_opt(cmd: Sequence[str], *opts: str) -> bool:
    for a in cmd:
        for o in opts:
            if a == o or a.startswith(o + "="):
                return True
    return False


def torchrun_argv(cmd: Sequence[str], nnodes: int, nproc: int, endpoint: str, run_id: str,
                  is_host: bool | None = None, log_dir: str | None = None) -> list[str]:
    """CMD with the rendezvous options added (before the script) unless already there.

    is_host tells torchrun which worker hosts the rendezvous store: its own guess
    compares hostnames and addresses, which fails in namespaces that share the
    host's hostname."""
    cmd = list(cmd)
    head = 3 if cmd[0] != "torchrun" and not cmd[0].endswith("/torchrun") else 1
    extra = []
    if not _has_opt(cmd, "--nnodes"):
        extra.append(f"--nnodes={nnodes}")
    if not _has_opt(cmd, "--nproc-per-node", "--nproc_per_node"):
        extra.append(f"--nproc-per-node={nproc}")
    if not _has_opt(cmd, "--rdzv-backend", "--rdzv_backend"):
        extra.append("--rdzv-backend=c10d")
    if not _has_opt(cmd, "--rdzv-endpoint", "--rdzv_endpoint"):
        extra.append(f"--rdzv-endpoint={endpoint}")
    if not _has_opt(cmd, "--rdzv-id", "--rdzv_id"):
        extra.append(f"--rdzv-id={run_id}")
    if not _has_opt(cmd, "--max-restarts", "--max_restarts"):
        extra.append("--max-restarts=0")
    if is_host is not None and not _has_opt(cmd, "--rdzv-conf", "--rdzv_conf"):
        extra.append(f"--rdzv-conf=is_host={1 if is_host else 0}")
    elif is_host is not None:   # the user's rendezvous settings (e.g. last_call_timeout), and ours
        for i, a in enumerate(cmd[:]):
            name, eq, val = a.partition("=")
            if name in ("--rdzv-conf", "--rdzv_conf") and "is_host=" not in a:
                cmd[i] = f"{a},is_host={1 if is_host else 0}" if eq else a
                if not eq and i + 1 < len(cmd) and "is_host=" not in cmd[i + 1]:
                    cmd[i + 1] = f"{cmd[i + 1]},is_host={1 if is_host else 0}"
                break
    if log_dir is not None and not _has_opt(cmd, "--tee", "--redirects"):
        # per-rank output, prefixed "[rN]:" (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE in the env)
        extra.append("--tee=3")
        if not _has_opt(cmd, "--log-dir", "--log_dir"):
            extra.append(f"--log-dir={log_dir}")
    return cmd[:head] + extra + cmd[head:]


def _opt_value(cmd: Sequence[str], *opts: str) -> str | None:
    """The value of a launcher option (`--opt=V` or `--opt V`) among the words before the script."""
    for i, a in enumerate(cmd):
        for o in opts:
            if a.startswith(o + "="):
                return a.split("=", 1)[1]
            if a == o and i + 1 < len(cmd):
                return cmd[i + 1]
    return None


def is_elastic(cmd: Sequence[str]) -> bool:
    """An elastic torchrun: --nnodes=MIN:MAX with MIN < MAX, or --max-restarts above 0. Its agents
    re-form the job without a lost node and take it back when it returns (testbed run starts the
    agent of a node that crashed again once the node is up)."""
    if not is_torchrun(cmd):
        return False
    nnodes = _opt_value(cmd, "--nnodes") or ""
    lo, sep, hi = nnodes.partition(":")
    if sep and lo.isdigit() and hi.isdigit() and int(lo) < int(hi):
        return True
    restarts = _opt_value(cmd, "--max-restarts", "--max_restarts") or "0"
    return restarts.isdigit() and int(restarts) > 0


# torchrun options that take no value: the first other word not starting with "-" is the script
_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                   "--virtual-local-rank", "--virtual_local_rank"}


def torchrun_module_argv(argv: Sequence[str], module: str) -> list[str]:
    """A torchrun command line with its script (and the script's arguments) replaced by `python -m
    module`: the same launcher, rendezvous and local ranks, another program."""
    argv = list(argv)
    i = 3 if not os.path.basename(argv[0]).startswith("torchrun") else 1
    opts: list[str] = []
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            break
        i += 1
        if a in _TORCHRUN_FLAGS:
            continue   # how to run the script: ours is a module
        opts.append(a)
        if "=" not in a and i < len(argv):
            opts.append(argv[i])
            i += 1
    head = argv[:3] if not os.path.basename(argv[0]).startswith("torchrun") else argv[:1]
    return head + opts + ["-m", module]
