"""How a host's SSH identity is checked (testbed acts as root on it): keys from a known-hosts file
or the system's, an unknown host refused unless trust_new, which accepts its key (and appends it
to the file given, as ssh's StrictHostKeyChecking=accept-new does)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

SYSTEM_KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")


class UnknownHostKey(Exception):
    def __init__(self, hostname: str, key: Any):
        self.hostname, self.key = hostname, key
        super().__init__(hostname)


def fingerprint(key: Any) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class KeyPolicy:
    """paramiko's missing-host-key policy, our way: refuse, or (trust_new) accept and record."""

    def __init__(self, trust_new: bool, known_hosts: Path | None, lock: threading.Lock):
        self.trust_new, self.known_hosts, self.lock = trust_new, known_hosts, lock

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        if not self.trust_new:
            raise UnknownHostKey(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)
        if self.known_hosts is not None:
            with self.lock:   # hosts connecting in parallel append to the same file
                self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with os.fdopen(fd, "a") as fh:
                    fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


APPEND_LOCK = threading.Lock()
