"""The bare runtime: a node is just its network namespace.

No init process, no private hostname or PID space: `exec` runs a command in
the node's network namespace with `nsenter --net=/run/netns/NS` and nothing
else. Switches always use it (exec/attach on a switch); workers run in a
container runtime (testbed/runtime/netns.py or docker.py) and use it only in
states whose runtime kind is "bare".
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Mapping, Sequence

from testbed.net import netns
from testbed.runtime.base import Runtime
from testbed.topology.model import Node


def _nsenter() -> str:
    return shutil.which("nsenter") or "/usr/bin/nsenter"


class BareRuntime(Runtime):
    kind = "bare"

    def __init__(self, testbed: str):
        super().__init__(testbed)
        self._home: netns.Home | None = None

    def prepare_netns(self, node: Node, netns_name: str) -> None:
        netns.create(netns_name)

    def start(self, node: Node, netns_name: str, env: Mapping[str, str], hosts: Mapping[str, str]) -> dict[str, Any]:
        return {"netns": netns_name}

    def remove(self, node: str, record: Mapping[str, Any]) -> None:
        from testbed.net.teardown import kill_processes_in

        name = record.get("netns")
        if not name:
            from testbed.net import names
            name = names.netns(self.testbed, node)
        kill_processes_in([name])
        netns.delete(name)

    def exec_argv(self, node: str, record: Mapping[str, Any], argv: Sequence[str], *,
                  env: Mapping[str, str] | None = None, tty: bool = False, workdir: str | None = None) -> list[str]:
        name = record.get("netns")
        if not name:
            from testbed.net import names
            name = names.netns(self.testbed, node)
        cmd = [_nsenter(), f"--net={netns.path(name)}"]
        if workdir:
            cmd.append(f"--wd={workdir}")
        cmd.append("--")
        if env:
            cmd += ["env", *[f"{k}={v}" for k, v in env.items()]]
        return cmd + list(argv)

    def pid(self, node: str, record: Mapping[str, Any]) -> int | None:
        return None

    def alive(self, node: str, record: Mapping[str, Any]) -> bool:
        name = record.get("netns")
        return bool(name) and os.path.exists(netns.path(name))
