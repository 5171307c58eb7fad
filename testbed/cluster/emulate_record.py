"""What DIR/emulated.json records about a set of emulated hosts, and the names and paths it implies.

The record (EmulatedRecord, one EmulatedHost per host) is all that destroy needs; testbed.cluster.emulate's
Emulated adds what is done with it (start and stop a host's sshd, destroy). See that module's
docstring for what an emulated host is.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

__all__ = ["EmulatedHost", "EmulatedRecord"]

PREFIX = "tbh"
STATE_FILE = "emulated.json"
MARKER = "/run/.testbed-emulated-host"
UNDERLAY = ipaddress.ip_network("198.18.0.0/15")   # RFC 2544 benchmarking space: 512 /24s
CONTROLLER_HOST = 254
LOGIN_HOMES = "/run/home"          # in each host: its DIR/hN/home, where the login user's home is
HOST_DOCKER_SOCKET = "/run/docker.sock"   # in each host: the Docker SDK's default, /var/run/docker.sock


@dataclass
class EmulatedHost:
    name: str
    address: str
    netns: str
    dir: str
    holder_pid: int | None = None
    sshd_pid: int | None = None
    sudo: str | None = None          # with a login user: "nopasswd" (it may sudo -n anything) or "none"

    @property
    def path(self) -> Path:
        return Path(self.dir)


@dataclass
class EmulatedRecord:
    """A set of emulated hosts, as recorded in DIR/emulated.json."""

    workdir: str
    id: str
    token: str
    subnet: str
    mtu: int
    cores: int
    testbed: list[str]
    hosts: list[EmulatedHost] = field(default_factory=list)
    made_workdir: bool = False
    login_user: str | None = None    # hosts.yaml logs in as this user (None: root), uid = gid = login_uid
    login_uid: int | None = None
    docker_socket: str | None = None   # this machine's Docker daemon socket, seen by each host at /run/docker.sock

    # -- names and paths

    @property
    def dir(self) -> Path:
        return Path(self.workdir)

    @property
    def alias(self) -> str:
        return f"testbed-emulated {self.token}"

    @property
    def underlay_netns(self) -> str:
        return f"{PREFIX}{self.id}-u"

    @property
    def root_veth(self) -> str:
        return f"{PREFIX}{self.id}c"

    @property
    def controller_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[CONTROLLER_HOST])

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def hosts_file(self) -> Path:
        return self.dir / "hosts.yaml"

    @property
    def authorized_keys(self) -> Path:
        return self.dir / "authorized_keys"

    @property
    def login(self) -> str:
        """Who hosts.yaml logs in as."""
        return self.login_user or "root"

    @property
    def login_home(self) -> str:
        """The login user's home directory, as a host sees it."""
        return f"{LOGIN_HOMES}/{self.login_user}"

    def state_root(self, h: EmulatedHost) -> str | None:
        """Where testbed keeps its state on host `h`: None for its own /run/testbed, else (with a
        shared Docker daemon) a directory under its DIR (see testbed.cluster.emulate's docstring)."""
        return str(h.path / "state") if self.docker_socket else None

    def host(self, name: str) -> EmulatedHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no emulated host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    # -- use

    def load_hosts(self) -> Any:
        """DIR/hosts.yaml, validated (testbed.cluster.hosts.Hosts)."""
        from testbed.cluster.hosts import load_hosts

        return load_hosts(self.hosts_file)

    def controls(self, **kw: Any) -> list[Any]:
        """An SshHost per host, checking host keys against DIR/known_hosts (kw: SshHost's options)."""
        from testbed.cluster.remote import SshHost

        kw.setdefault("known_hosts", self.known_hosts)
        return [SshHost(h, **kw) for h in self.load_hosts()]

    # -- the record

    def save(self) -> None:
        path = self.dir / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        hosts = [EmulatedHost(**h) for h in data.pop("hosts", [])]
        return cls(**data, hosts=hosts)
