"""The environment of a worker: who it is, where its logs go, and what makes
NCCL and gloo use the emulated network.

- NCCL_SOCKET_IFNAME: exactly the worker's emulated interfaces (``=eth0,eth1``:
  the leading ``=`` asks NCCL for exact names, not prefixes).
- GLOO_SOCKET_IFNAME: the worker's first (primary) emulated interface. gloo
  would otherwise bind what the hostname resolves to; with a list it opens one
  device per name and every rank must list the same number, so one it is.
- NCCL_IB_DISABLE=1: InfiniBand/RoCE would bypass the emulated links.
- NCCL_HOSTID: distinct per worker. NCCL treats ranks with the same host hash
  as one machine (SHM/P2P between them, "Duplicate GPU detected" when two
  share a GPU); distinct ids keep every byte on NET/Socket, i.e. on our links.
- OMP_NUM_THREADS: the worker's cpus (rounded down, at least 1) when it has a
  cpu limit, so that a 2-cpu worker does not run one thread per host core.
- GPU variables (CUDA_VISIBLE_DEVICES, MPS) come from testbed/runtime/gpu.py.
- TESTBED_NAME, TESTBED_NODE, TESTBED_LOG_DIR: jobs write their output under
  TESTBED_LOG_DIR (/run/testbed/NAME/logs/NODE/), which `testbed logs` shows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from testbed import paths


def log_dir(testbed: str, node: str) -> Path:
    """Where jobs started in `node` write their output: <state dir>/logs/<node>/."""
    return paths.directory(testbed) / "logs" / node


def worker_env(testbed: str, node: str, interfaces: Sequence[str], *, cpus: float | None = None,
               gpu_env: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables every process started in worker `node` gets (on top of the caller's)."""
    env: dict[str, str] = {
        "TESTBED_NAME": testbed,
        "TESTBED_NODE": node,
        "TESTBED_LOG_DIR": str(log_dir(testbed, node)),
        "NCCL_HOSTID": f"{testbed}.{node}",
        "NCCL_IB_DISABLE": "1",
    }
    ifaces = [i for i in interfaces if i and i != "lo"]
    if ifaces:
        env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(ifaces)
        env["GLOO_SOCKET_IFNAME"] = ifaces[0]
    if cpus is not None:
        env["OMP_NUM_THREADS"] = str(max(1, math.floor(cpus)))
    if gpu_env:
        env.update(gpu_env)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if extra:
        env.update(extra)
    return env
