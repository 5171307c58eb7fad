"""The Docker runtime: every worker is a Docker container, driven through the Docker SDK.

A worker `NODE` of testbed `NAME` is the container `tb-NAME-NODE` (the same
name as its network namespace), started from the worker image
(`node.image`, else $TESTBED_WORKER_IMAGE, else testbed/worker:latest; build
it with `make image`) with:

- `--network none` and hostname NODE. Its network namespace is then bound on
  /run/netns/tb-NAME-NODE (what `ip netns attach` does), so the data plane
  builds links, addresses, routes and shaping into it exactly as for the
  namespace runtimes: the container sees only lo and the emulated interfaces.
- `--init` (Docker's tini) running `sleep infinity`: the long-lived init;
  jobs run beside it with `docker exec`.
- Docker's default capabilities plus SYS_PTRACE (py-spy), never --privileged;
  NET_ADMIN only with `up --net-admin` (a job could then remove its own
  links' shaping: the data plane shapes a worker's egress in its namespace). Memory limit = node.memory_bytes with no swap (a hog is
  OOM-killed inside its own cgroup), CPU quota = node.cpus, /dev/shm =
  half the memory limit (1 GiB without one; $TESTBED_DOCKER_SHM overrides),
  GPUs through device requests (`--gpus`) when node.gpus > 0.
- Mounts, so that `testbed run` finds the user's script and the probe finds
  the testbed package:
    * the directory `up` ran in (the user's project), at the same path,
      read-only, and the container's working directory (exec starts there).
      Like a shared home directory on a real cluster; not mounted when it is
      "/", under /proc, /sys, /dev or the state root (when the state root lies
      inside it, an empty tmpfs covers the state root); $TESTBED_DOCKER_MOUNT_CWD
      =rw mounts it read-write (a job may then change your files as root),
      =0 not at all.
    * the testbed package, read-only, at /opt/testbed/src/testbed, with
      PYTHONPATH=/opt/testbed/src (the image holds its dependencies).
    * the runs' exchange folder of the testbed (/run/testbed/NAME/runs),
      same path, read-write: where ranks write their probe files. Nothing
      else of the state directory: the state file, which testbed acts on as
      root, stays out of the workers' reach.
    * extra mounts from $TESTBED_DOCKER_MOUNTS ("SRC:DST[:ro],...").
- /etc/hosts naming every worker, and an /etc/resolv.conf without name
  servers (Docker would copy the host's, unreachable from the emulated
  network: every lookup of an unknown name would hang until it timed out).
- labels testbed.owner=testbed, testbed.name, testbed.node, testbed.netns,
  testbed.state_root: `cleanup_by_label` finds containers of a CLI that died.

The Docker endpoint is $DOCKER_HOST (default unix:///var/run/docker.sock); it
is recorded with each worker so other shells reach the same daemon. Start a
private daemon with `scripts/dockerd.sh start`.

Faults never restart a container: its init holds the network namespace our
links live in, and a restarted container would get a new, empty one. So
stop = freeze (docker pause), kill = SIGKILL of everything but the init (a
crashed server), restart = thaw + a fresh workload; links stay throughout.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shlex
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from testbed.errors import CapabilityError, StateError, TestbedError
from testbed import paths, procs
from testbed.net import names, netns
from testbed.runtime import cgroups
from testbed.runtime.base import Runtime
from testbed.topology.model import Node

DEFAULT_IMAGE = "testbed/worker:latest"
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
OWNER = "testbed"
PKG_TARGET = "/opt/testbed/src"
STOP_TIMEOUT = 5
_GiB = 1 << 30
RUNS_DIR = "runs"   # <state dir>/runs: what `testbed run` shares with the ranks
RESOLV_CONF = "# testbed worker: no DNS; names come from /etc/hosts\noptions timeout:1 attempts:1\n"


class DockerUnavailable(CapabilityError):
    """No Docker daemon answers, or the docker SDK is missing."""


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


def docker_cli() -> str:
    """Debian's client matches Debian's daemon; fall back to whatever `docker` is on PATH."""
    if os.access("/usr/bin/docker", os.X_OK):
        return "/usr/bin/docker"
    return shutil.which("docker") or "docker"


def _hint() -> str:
    return ("start one with `eval \"$(scripts/dockerd.sh start)\"` (as root; it prints the DOCKER_HOST to "
            "export), or point DOCKER_HOST at a running daemon")


def connect(host: str | None = None, *, timeout: int = 120):
    """A DockerClient for `host` (default $DOCKER_HOST) that has answered a ping; DockerUnavailable if none."""
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise DockerUnavailable(f"the docker Python SDK is not installed ({exc}): pip install docker") from None
    host = host or docker_host()
    try:
        client = docker.DockerClient(base_url=host, timeout=timeout, max_pool_size=64)
        client.ping()
    except Exception as exc:
        raise DockerUnavailable(f"no Docker daemon answers at {host} ({type(exc).__name__}: {exc}); "
                                f"{_hint()}") from None
    return client


# -- binding a process's network namespace on /run/netns ---------------------------------------------------

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_MS_BIND = 4096


def attach_netns(name: str, pid: int) -> None:
    """Bind the network namespace of `pid` on /run/netns/NAME (`ip netns attach NAME PID`)."""
    netns._ensure_run_dir()
    target = netns.path(name)
    fd = os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    os.close(fd)
    src = f"/proc/{pid}/ns/net".encode()
    if _libc.mount(src, str(target).encode(), b"none", _MS_BIND, None) != 0:
        e = ctypes.get_errno()
        target.unlink(missing_ok=True)
        raise TestbedError(f"cannot bind the network namespace of pid {pid} on {target}: {os.strerror(e)}")


# -- the runtime -----------------------------------------------------------------------------------------------

def _hosts_file(hosts: Mapping[str, str], node: str) -> str:
    """/etc/hosts text; `hosts` maps name -> address (address -> name is accepted too).
    Each IPv4 address comes again IPv4-mapped (::ffff:a.b.c.d) under the absolute name (`w0.`),
    for reverse lookups from dual-stack sockets (torch's c10d), as in the netns runtime's
    hosts_text: glibc does not match those against IPv4 lines, and there is no DNS to ask."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    mapped = ["::ffff:127.0.0.1\tlocalhost."]
    for k, v in hosts.items():
        try:
            ipaddress.ip_address(str(k).split("/")[0])
            addr, name = str(k), str(v)
        except ValueError:
            addr, name = str(v), str(k)
        lines.append(f"{addr.split('/')[0]}\t{name}")
        if ipaddress.ip_address(addr.split("/")[0]).version == 4:
            mapped.append(f"::ffff:{addr.split('/')[0]}\t{name}.")
    lines += ["# the same, IPv4-mapped: reverse lookups from dual-stack sockets", *mapped]
    return "\n".join(lines) + "\n"


def _env_file(env: Mapping[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())


def _parse_mounts(spec: str) -> list[tuple[str, str, bool]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise TestbedError(f"TESTBED_DOCKER_MOUNTS: bad entry {item!r} (want SRC:DST[:ro|rw])")
        out.append((os.path.abspath(parts[0]), parts[1], len(parts) == 3 and parts[2] == "ro"))
    return out


class DockerRuntime(Runtime):
    kind = "docker"

    def __init__(self, testbed: str, *, host: str | None = None, image: str | None = None,
                 workdir: str | None = None, gpu_ids: Mapping[str, Sequence[str]] | None = None,
                 net_admin: bool = False):
        super().__init__(testbed)
        self.net_admin = net_admin
        self.host = host or docker_host()
        self.image = image or os.environ.get("TESTBED_WORKER_IMAGE") or DEFAULT_IMAGE
        self.workdir = workdir if workdir is not None else os.getcwd()
        # node -> GPU ids (indices or UUIDs) chosen by the GPU policy; without it `count` GPUs are asked for.
        self.gpu_ids = dict(gpu_ids or {})
        self._client = None

    # -- plumbing --------------------------------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            self._client = connect(self.host)
        return self._client

    def container_name(self, node: str) -> str:
        return names.netns(self.testbed, node)

    def _get(self, node: str, record: Mapping[str, Any] | None = None):
        import docker

        ref = (record or {}).get("id") or self.container_name(node)
        try:
            c = self.client.containers.get(ref)
        except docker.errors.NotFound:
            raise StateError(f"worker {node}: container {self.container_name(node)} does not exist") from None
        labels = c.labels or {}   # paused, killed or changed only if it says it is this worker
        if labels.get("testbed.owner") != OWNER or labels.get("testbed.name") != self.testbed \
                or labels.get("testbed.node") != node:
            raise StateError(f"worker {node}: container {ref} is not this worker's (labels {labels}); "
                             "not acted on")
        return c

    def labels(self, node: str, netns_name: str) -> dict[str, str]:
        return {"testbed.owner": OWNER, "testbed.name": self.testbed, "testbed.node": node,
                "testbed.netns": netns_name, "testbed.state_root": str(paths.root())}

    def _mounts(self) -> tuple[list[Any], str | None]:
        from docker.types import Mount

        import testbed

        mounts = [Mount(f"{PKG_TARGET}/testbed", str(Path(testbed.__file__).resolve().parent),
                        type="bind", read_only=True)]
        # Of the testbed's directory a worker sees only the runs' exchange folder (where ranks write
        # their probe files), never the state file or the helpers' sockets it lists.
        sdir = paths.directory(self.testbed)
        exchange = sdir / RUNS_DIR
        exchange.mkdir(mode=0o755, parents=True, exist_ok=True)
        mounts.append(Mount(str(exchange), str(exchange), type="bind"))
        workdir = None
        cwd = os.path.realpath(self.workdir) if self.workdir else None
        how = os.environ.get("TESTBED_DOCKER_MOUNT_CWD", "ro")
        if (cwd and how != "0" and cwd != "/" and not cwd.startswith(("/proc", "/sys", "/dev"))
                and not Path(cwd).is_relative_to(paths.root())):
            mounts.append(Mount(cwd, cwd, type="bind", read_only=how != "rw"))
            workdir = cwd
            state_root = os.path.realpath(paths.root())
            if Path(state_root).is_relative_to(cwd):
                # the state root lies inside the user's directory: an empty tmpfs over it, so the
                # state files stay out of sight (Docker mounts parents first: the exchange
                # folder still shows through)
                mounts.append(Mount(state_root, None, type="tmpfs"))
        for src, dst, ro in _parse_mounts(os.environ.get("TESTBED_DOCKER_MOUNTS", "")):
            mounts.append(Mount(dst, src, type="bind", read_only=ro))
        return mounts, workdir

    def _shm_size(self, node: Node) -> int:
        if os.environ.get("TESTBED_DOCKER_SHM"):
            from testbed.topology.units import parse_size

            return int(parse_size(os.environ["TESTBED_DOCKER_SHM"]))
        if node.memory_bytes:
            return max(64 << 20, node.memory_bytes // 2)
        return _GiB

    def _image(self, node: Node) -> str:
        import docker

        image = node.image or self.image
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            if image == DEFAULT_IMAGE or image.startswith("testbed/"):
                raise CapabilityError(f"image {image} is not built on the daemon at {self.host}: run `make image` "
                                      "(images/worker/build.sh)") from None
            try:
                self.client.images.pull(image)
            except docker.errors.APIError as exc:
                raise CapabilityError(f"image {image} is neither local nor pullable: {exc}") from None
        return image

    # -- lifecycle -------------------------------------------------------------------------------------
    def prepare_netns(self, node: Node, netns_name: str) -> None:
        import docker
        from docker.types import DeviceRequest

        cname = self.container_name(node.name)
        if netns.exists(netns_name):
            raise StateError(f"namespace {netns_name} already exists (a leftover? try `testbed cleanup`)")
        image = self._image(node)
        mounts, workdir = self._mounts()
        kw: dict[str, Any] = {}
        if node.memory_bytes:
            kw.update(mem_limit=int(node.memory_bytes), memswap_limit=int(node.memory_bytes))
        if node.cpus:
            quota, period = cgroups.cfs(node.cpus)
            kw.update(cpu_period=period, cpu_quota=quota)
        if node.gpus:
            ids = self.gpu_ids.get(node.name)
            req = (DeviceRequest(device_ids=[str(i) for i in ids], capabilities=[["gpu"]]) if ids
                   else DeviceRequest(count=int(node.gpus), capabilities=[["gpu"]]))
            kw["device_requests"] = [req]
        env = {"PYTHONPATH": PKG_TARGET, "TESTBED_NAME": self.testbed, "TESTBED_NODE": node.name,
               "TESTBED_RUNTIME": "docker"}
        try:
            c = self.client.containers.run(
                image, ["sleep", "infinity"], name=cname, hostname=node.name, detach=True, init=True,
                network_mode="none", labels=self.labels(node.name, netns_name),
                cap_add=(["NET_ADMIN"] if self.net_admin else []) + ["SYS_PTRACE"], shm_size=self._shm_size(node), mounts=mounts,
                working_dir=workdir, environment=env, stop_signal="SIGTERM", **kw)
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                raise StateError(f"container {cname} already exists (a leftover? try `testbed cleanup`); "
                                 "refusing to adopt it") from None
            raise TestbedError(f"worker {node.name}: docker could not start {cname}: {exc.explanation or exc}") \
                from None
        try:
            c.reload()
            pid = int(c.attrs["State"]["Pid"])
            if not pid:
                raise TestbedError(f"worker {node.name}: container {cname} is not running "
                                   f"({c.attrs['State'].get('Status')}: {c.attrs['State'].get('Error')})")
            attach_netns(netns_name, pid)
        except BaseException:
            with _suppress():
                c.remove(force=True)
            raise

    def prepare_many(self, items: Iterable[tuple[Node, str]], *, parallel: int = 16) -> None:
        """prepare_netns for many workers at once (container starts overlap; ~N times faster)."""
        items = list(items)
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(items) or 1))) as ex:
            futures = [ex.submit(self.prepare_netns, n, ns) for n, ns in items]
            errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def _write_files(self, c: Any, node: str, hosts: Mapping[str, str], env: Mapping[str, str]) -> None:
        # /etc/resolv.conf: Docker copies the host's, whose name server the emulated network cannot
        # reach (every lookup of an unknown name would hang for seconds): none, as in the netns runtime.
        script = ('printf "%s" "$1" > /etc/hosts && printf "%s" "$3" > /etc/resolv.conf && mkdir -p /etc/testbed '
                  '&& printf "%s" "$2" > /etc/testbed/env && ln -sf /etc/testbed/env /etc/profile.d/testbed.sh')
        res = c.exec_run(["/bin/sh", "-c", script, "sh", _hosts_file(hosts, node), _env_file(env), RESOLV_CONF],
                         user="0")
        if res.exit_code != 0:
            raise TestbedError(f"worker {node}: writing /etc/hosts failed: {res.output.decode(errors='replace')}")

    def start(self, node: Node, netns_name: str, env: Mapping[str, str], hosts: Mapping[str, str]) -> dict[str, Any]:
        c = self._get(node.name)
        self._write_files(c, node.name, hosts, env)
        c.reload()
        pid = int(c.attrs["State"]["Pid"])
        return {"id": c.id, "pid": pid, "starttime": procs.start_ticks(pid), "container": c.name,
                "netns": netns_name, "docker_host": self.host, "env": dict(env), "hosts": dict(hosts),
                "net_admin": self.net_admin}

    def remove(self, node: str, record: Mapping[str, Any]) -> None:
        """Remove the worker's container, found by its name and only if its labels say it is this
        testbed's (the record names it, but a record is not proof), then its namespace bind."""
        import docker

        try:
            c = self.client.containers.get(self.container_name(node))
        except docker.errors.NotFound:
            c = None
        if c is not None:
            labels = c.labels or {}
            if labels.get("testbed.owner") != OWNER or labels.get("testbed.name") != self.testbed \
                    or labels.get("testbed.node") != node:
                raise StateError(f"container {c.name} is not labelled as worker {node} of testbed {self.testbed}: "
                                 "not removed")
            c.remove(force=True, v=True)
        netns.delete(names.netns(self.testbed, node))

    # -- reaching a worker -----------------------------------------------------------------------------
    def exec_argv(self, node: str, record: Mapping[str, Any], argv: Sequence[str], *,
                  env: Mapping[str, str] | None = None, tty: bool = False, workdir: str | None = None) -> list[str]:
        host = record.get("docker_host") or self.host
        cmd = [docker_cli(), "-H", host, "exec", "-i"]
        if tty:
            cmd.append("-t")
        if workdir:
            cmd += ["-w", workdir]
        for k, v in {**(record.get("env") or {}), **(env or {})}.items():
            cmd += ["-e", f"{k}={v}"]
        return cmd + [record.get("container") or self.container_name(node), *argv]

    def pid(self, node: str, record: Mapping[str, Any]) -> int | None:
        try:
            c = self._get(node, record)
        except (StateError, DockerUnavailable):
            return None
        st = c.attrs.get("State", {})
        return int(st["Pid"]) if st.get("Running") and st.get("Pid") else None

    def alive(self, node: str, record: Mapping[str, Any]) -> bool:
        return self.pid(node, record) is not None

    # -- control ---------------------------------------------------------------------------------------
    # The container's init (tini + sleep) is the "machine" and holds the network namespace our links
    # live in: faults act on what runs inside it and never restart the container, whose new
    # namespace would be empty.
    def stop(self, node: str, record: Mapping[str, Any]) -> None:
        """Freeze every process of the worker (cgroup freezer), as the netns runtime does: a hung node."""
        c = self._get(node, record)
        c.reload()
        if c.status != "paused":
            c.pause()

    def cont(self, node: str, record: Mapping[str, Any]) -> None:
        self._resume(node, record)

    def resume(self, node: str, record: Mapping[str, Any]) -> None:
        self._resume(node, record)

    def _resume(self, node: str, record: Mapping[str, Any]) -> None:
        c = self._get(node, record)
        c.reload()
        if c.status == "paused":
            c.unpause()

    def processes(self, node: str, record: Mapping[str, Any]) -> list[int]:
        """Host PIDs of everything in the worker's PID namespace, its init (tini) first.
        (`docker exec` processes are not the init's children: match on the namespace.)"""
        init = self.pid(node, record)
        return [] if init is None else procs.pids_in_pidns(init)

    def _machine(self, init: int) -> set[int]:
        """The init and the `sleep infinity` it keeps: what must survive a crash."""
        import psutil

        keep = {init}
        try:
            keep |= {c.pid for c in psutil.Process(init).children() if c.cmdline() == ["sleep", "infinity"]}
        except psutil.Error:
            pass
        return keep

    def kill(self, node: str, record: Mapping[str, Any]) -> None:
        """SIGKILL every process the worker runs (a crashed server); its init and links stay."""
        self._resume(node, record)
        procs = self.processes(node, record)
        if not procs:
            return
        keep = self._machine(procs[0])
        for pid in procs:
            if pid not in keep:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    def pause(self, node: str, record: Mapping[str, Any]) -> None:
        self.stop(node, record)

    def restart(self, node: str, record: Mapping[str, Any]) -> dict[str, Any]:
        """The worker comes back: thawed, with nothing of its old workload running. Same
        container, same network namespace, so its links are intact."""
        self.kill(node, record)
        return dict(record)

    def set_limits(self, node: str, record: Mapping[str, Any], *, cpus: float | None = None,
                   memory_bytes: int | None = None) -> None:
        kw: dict[str, Any] = {}
        if cpus is not None:
            quota, period = cgroups.cfs(cpus) if cpus > 0 else (-1, cgroups.CFS_PERIOD_US)
            kw.update(cpu_period=period, cpu_quota=quota)
        if memory_bytes is not None:
            kw.update(mem_limit=int(memory_bytes), memswap_limit=int(memory_bytes))
        if kw:
            self._get(node, record).update(**kw)

    # -- cleanup ---------------------------------------------------------------------------------------
    def cleanup_by_label(self, testbed: str | None = None, *, any_state_root: bool = False) -> list[str]:
        """Remove containers (and their /run/netns binds) labelled ours: this testbed's, or with
        testbed=None every testbed's of this state root. Returns the container names removed."""
        return cleanup_by_label(testbed if testbed is not None else self.testbed, host=self.host,
                                any_state_root=any_state_root)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def list_containers(testbed: str | None = None, *, host: str | None = None, any_state_root: bool = False,
                    client: Any = None) -> list[Any]:
    """Our containers (label testbed.owner=testbed), of one testbed or all, of this state root by default."""
    client = client or connect(host)
    filters = [f"testbed.owner={OWNER}"]
    if testbed:
        filters.append(f"testbed.name={testbed}")
    if not any_state_root:
        filters.append(f"testbed.state_root={paths.root()}")
    return client.containers.list(all=True, filters={"label": filters})


def cleanup_by_label(testbed: str | None = None, *, host: str | None = None,
                     any_state_root: bool = False) -> list[str]:
    """Force-remove our containers (see list_containers) and unbind their namespaces. For `testbed cleanup`."""
    import docker

    client = connect(host)
    removed = []
    for c in list_containers(testbed, client=client, any_state_root=any_state_root):
        ns = c.labels.get("testbed.netns")
        try:
            c.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        if ns and ns.startswith(names.PREFIX):
            netns.delete(ns)
        removed.append(c.name)
    return removed


def daemon_available(host: str | None = None) -> bool:
    try:
        connect(host, timeout=5)
        return True
    except DockerUnavailable:
        return False


def image_available(image: str = DEFAULT_IMAGE, host: str | None = None) -> bool:
    try:
        connect(host, timeout=5).images.get(image)
        return True
    except Exception:
        return False


__all__ = ["DockerRuntime", "DockerUnavailable", "attach_netns", "cleanup_by_label", "connect",
           "daemon_available", "docker_cli", "docker_host", "image_available", "list_containers"]
