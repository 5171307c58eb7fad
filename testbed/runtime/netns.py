"""The embedded default runtime: a worker is a set of namespaces, no daemon.

Each worker has its own network namespace (tb-NAME-NODE, made by
prepare_netns, filled by the data plane), and a long-lived init process in
new mount, UTS, PID and IPC namespaces (testbed/runtime/worker_init.py: one
spawner process forks the inits of a whole batch; ps shows each init as
"testbed-init NODE", comm "tb-init"):

- hostname = the node's name; /etc/hosts lists every worker by name (and
  /etc/hostname says its name): both bind-mounted from files under
  /run/testbed/NAME/workers/NODE/;
- a private /tmp and /dev/shm (tmpfs), its own /proc (its own PID space: it
  sees only its processes) and its own /sys (it sees only its interfaces),
  read-only, as are /proc/sys (but /proc/sys/net, its own) and
  /proc/sysrq-trigger;
- everything else is the host's filesystem, shared as in Mininet, so the
  project's venv and the user's code are there at the same paths. Host mounts
  propagate into workers (rslave), never the other way round;
- but not the testbed's state (the state root, /run/testbed): an empty
  read-only tmpfs covers it, and only what workers need comes back at the
  same paths: NAME/runs (read-write: what ranks of `testbed run` write),
  NAME/logs/NODE (read-write: TESTBED_LOG_DIR), NAME/workers/NODE
  (read-only: its hosts files, attach's rcfile) and the MPS pipe and log
  dirs when the worker uses MPS;
- capabilities: Docker's default set (worker_init.WORKER_CAPS; no sys_ptrace, see there),
  and net_admin only for a testbed brought up with net_admin=True (a job
  could otherwise remove its links' shaping); never sys_admin, so the mounts
  above stay. The init drops the rest from its bounding set and its own sets;
  every process entering the worker gets the same bounding set from setpriv
  (util-linux). The choice is in each worker's record (net_admin);
- cpu and memory limits from the topology through a cgroup
  testbed/NAME/NODE (testbed/runtime/cgroups.py), which the init and every
  process started with exec/attach join;
- the init is PID 1 of the worker: it reaps orphans, and on SIGTERM ends the
  worker's processes and exits. It runs in its own session, so it survives
  the CLI that started it; `down` (remove) stops it.

Reaching a worker is `nsenter -t <init pid> -a` (exec_argv), preceded by
joining the worker's cgroup and followed by `setpriv` (the worker's
capabilities) and `env` with the worker's variables (env.py, GPU
variables): processes get the caller's environment plus the worker's.

With MPS (CUDA_MPS_PIPE_DIRECTORY in the worker env) a worker keeps the
host's IPC namespace and /dev/shm: MPS clients talk to the server through them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from testbed import paths, procs
from testbed.errors import CapabilityError, StateError, TestbedError
from testbed.net import names
from testbed.net import netns as netns_mod
from testbed.runtime import cgroups, worker_init
from testbed.runtime.base import PendingStart, Runtime
from testbed.runtime.env import log_dir
from testbed.topology.model import Node

START_TIMEOUT_S = 15.0
STOP_GRACE_S = 3.0
INIT_SCRIPT = str(Path(worker_init.__file__).resolve())   # run by its path, without site (its docstring)
MPS_DIR_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
SETPRIV_DIRS = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")   # where setpriv is looked for besides $PATH

def _project_dirs() -> list[Path]:
    """The project (its code) and the venv it runs from: what every worker must see."""
    import testbed

    return [Path(testbed.__file__).resolve().parents[1], Path(sys.prefix).resolve()]


def _visible_under_tmp() -> list[str]:
    """Host dirs a worker must still see though its /tmp is private: the project and its venv,
    and the caller's working dir (a checkout under /tmp, a test's tmp). (What it needs of the
    state dir, maybe under /tmp too, comes back through _state_binds.)"""
    wanted = [*_project_dirs(), Path.cwd()]
    tmp = [p for p in wanted if str(p).startswith("/tmp/")]
    # a dir inside another kept one comes along with it
    return sorted({str(p) for p in tmp if not any(q != p and q in p.parents for q in tmp)})


def _state_binds(testbed: str, node: str, env: Mapping[str, str]) -> list[list[Any]]:
    """What a worker sees of the state root (worker_init.hide_state_root), as [path, writable]:
    the runs' exchange folder, its log dir, its own dir (read-only), the MPS dirs its env names,
    and the project or venv should they lie under the state root. Real paths; made here first."""
    root = os.path.realpath(paths.root())
    sdir = paths.directory(testbed)
    runs = sdir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    os.chmod(runs, 0o755)
    binds: list[list[Any]] = [[str(runs), True], [str(log_dir(testbed, node)), True],
                              [str(sdir / "workers" / node), False]]
    binds += [[env[k], True] for k in MPS_DIR_VARS if env.get(k)]
    binds += [[str(d), True] for d in _project_dirs()]
    out: dict[str, bool] = {}
    for path, rw in binds:
        real = os.path.realpath(path)
        if worker_init.is_within(real, root) and real != root and os.path.isdir(real):
            out[real] = out.get(real, False) or rw
    return [[p, rw] for p, rw in sorted(out.items())]


def setpriv_path() -> str:
    """setpriv (util-linux): what gives a process entering a worker the worker's capabilities."""
    found = shutil.which("setpriv", path=os.pathsep.join([os.environ.get("PATH", ""), *SETPRIV_DIRS]))
    if found is None:
        raise CapabilityError("setpriv (util-linux) is not installed: it bounds the capabilities of every process "
                              "entering a netns worker; install util-linux (Debian/Ubuntu: apt-get install util-linux)")
    return found


def setpriv_argv(net_admin: bool) -> list[str]:
    """setpriv ... --: the worker's bounding set (worker_init.worker_caps), an empty inheritable set
    (and so ambient set); what it runs as root then has exactly those capabilities."""
    keep = ",".join(f"+{c}" for c in worker_init.worker_caps(net_admin))
    return [setpriv_path(), "--inh-caps=-all", f"--bounding-set=-all,{keep}", "--"]


def hosts_text(testbed: str, node: str, hosts: Mapping[str, Any]) -> str:
    """The /etc/hosts of a worker: localhost, then every worker by name (its own name included),
    then each IPv4 address again in its IPv4-mapped IPv6 form (::ffff:a.b.c.d) under the name's
    absolute form (`w0.`). A dual-stack socket sees its peers as mapped addresses, and glibc
    never matches those against IPv4 lines: without them a reverse lookup (torch's c10d names
    every socket it connects) falls through to DNS, which a worker has none of, and fails with
    EAI_AGAIN. The absolute name keeps forward lookups of `w0` to its IPv4 address alone."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"# testbed {testbed}: its workers"]
    mapped = ["::ffff:127.0.0.1\tlocalhost."]
    for name, addrs in hosts.items():
        if isinstance(addrs, str):
            addrs = [addrs]
        for a in addrs:
            lines.append(f"{a}\t{name}")
            if ":" not in a:
                mapped.append(f"::ffff:{a.split('/')[0]}\t{name}.")
    if node not in hosts:
        lines.append(f"127.0.1.1\t{node}")
    lines += ["# the same, IPv4-mapped: reverse lookups from dual-stack sockets", *mapped]
    return "\n".join(lines) + "\n"


class NetnsRuntime(Runtime):
    kind = "netns"

    def __init__(self, testbed: str, net_admin: bool = False):
        """net_admin: workers started here get CAP_NET_ADMIN (a job can then change or remove its
        own links' shaping); it is recorded per worker, and exec/attach follow the record."""
        super().__init__(testbed)
        self.net_admin = bool(net_admin)

    # -- paths -----------------------------------------------------------------
    def worker_dir(self, node: str) -> Path:
        return paths.directory(self.testbed) / "workers" / node

    def log_dir(self, node: str) -> Path:
        return log_dir(self.testbed, node)

    # -- lifecycle -------------------------------------------------------------
    def prepare_netns(self, node: Node, netns: str) -> None:
        if not netns_mod.exists(netns):
            netns_mod.create(netns)

    def start(self, node: Node, netns: str, env: Mapping[str, str], hosts: Mapping[str, str]) -> dict[str, Any]:
        return self.start_many([(node, netns, env, hosts)])[0]

    def start_many(self, workers: Sequence[tuple[Node, str, Mapping[str, str], Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """start() for many workers at once (their inits start concurrently); records in order.

        If one fails, the ones started here are removed again and the error raised.
        """
        return self.begin_start_many(workers).finish()

    def begin_start_many(self, workers: Sequence[tuple[Node, str, Mapping[str, str], Mapping[str, Any]]]
                         ) -> PendingStart:
        """Launch the inits now (they come up while the caller builds links); finish() collects them."""
        prepared: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        proc: subprocess.Popen | None = None

        def abort() -> None:
            if proc is not None:  # let the inits report their pids, so remove finds them
                with contextlib.suppress(Exception):
                    self._collect(proc, {n: rec for n, rec, _ in prepared})
            self.remove_many([(n, rec) for n, rec, _ in prepared])

        def finish() -> list[dict[str, Any]]:
            try:
                self._collect(proc, {n: rec for n, rec, _ in prepared}, check=True)
            except BaseException:
                self.remove_many([(n, rec) for n, rec, _ in prepared])
                raise
            return [rec for _, rec, _ in prepared]

        try:
            setpriv_path()     # exec/attach need it: refuse now rather than leave unreachable workers
            for node, netns, env, hosts in workers:
                rec, cfg = self._prepare(node, netns, env, hosts_text(self.testbed, node.name, hosts))
                prepared.append((node.name, rec, cfg))
            proc = self._spawn(prepared)
        except BaseException:
            abort()
            raise
        return PendingStart(finish=finish, abort=abort, records=[rec for _, rec, _ in prepared])

    def _prepare(self, node: Node, netns: str, env: Mapping[str, str], hosts: str,
                 net_admin: bool | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Files, cgroup and init configuration of one worker; returns (record, init config).
        net_admin: None for this runtime's setting."""
        net_admin = self.net_admin if net_admin is None else bool(net_admin)
        nspath = netns_mod.path(netns)
        if not nspath.exists():
            raise StateError(f"network namespace {netns} of worker {node.name} does not exist")
        wdir = self.worker_dir(node.name)
        (wdir / "etc").mkdir(parents=True, exist_ok=True)
        ldir = self.log_dir(node.name)
        ldir.mkdir(parents=True, exist_ok=True)
        (wdir / "etc" / "hosts").write_text(hosts)
        (wdir / "etc" / "hostname").write_text(node.name + "\n")
        # No name server: the host's would be unreachable from the emulated network (every
        # lookup would hang for seconds); peers resolve through /etc/hosts.
        (wdir / "etc" / "resolv.conf").write_text("# testbed worker: no DNS; names come from /etc/hosts\n"
                                                  "options timeout:1 attempts:1\n")
        share_ipc = "CUDA_MPS_PIPE_DIRECTORY" in env
        cg = cgroups.create(self.testbed, node.name, cpus=node.cpus, memory_bytes=node.memory_bytes)
        rec: dict[str, Any] = {
            "runtime": self.kind, "pid": None, "starttime": None, "netns": netns, "cgroups": cg,
            "dir": str(wdir), "log_dir": str(ldir), "share_ipc": share_ipc, "net_admin": net_admin,
            # who and where the worker is, whatever else the caller's env says
            "env": {"TESTBED_NAME": self.testbed, "TESTBED_NODE": node.name, "TESTBED_LOG_DIR": str(ldir), **env},
            "node": node.to_json(),
        }
        cfg = {
            "netns": str(nspath), "cgroup_procs": cgroups.cgroup_procs_files(cg), "hostname": node.name,
            "share_ipc": share_ipc, "log": str(ldir / "init.log"), "grace": STOP_GRACE_S,
            "keep": _visible_under_tmp(), "caps": worker_init.worker_caps(net_admin),
            "state_root": os.path.realpath(paths.root()), "state_binds": _state_binds(self.testbed, node.name, env),
            "binds": [[str(wdir / "etc" / "hosts"), "/etc/hosts"], [str(wdir / "etc" / "hostname"), "/etc/hostname"]]
            + ([[str(wdir / "etc" / "resolv.conf"), "/etc/resolv.conf"]] if os.path.exists("/etc/resolv.conf") else []),
        }
        return rec, cfg

    def _spawn(self, prepared: Sequence[tuple[str, dict[str, Any], dict[str, Any]]]) -> subprocess.Popen:
        """One spawner process forks every worker's bootstrap (worker_init.main)."""
        items = [{"node": n, "cfg": cfg, "log": cfg["log"]} for n, _rec, cfg in prepared]
        logs = paths.directory(self.testbed) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "init-spawn.log", "ab") as err:
            try:
                # argv[0] "testbed-init" (what ps shows): the interpreter then cannot find its home
                # through argv[0]; PYTHONHOME names it. -P: nothing of testbed/runtime on sys.path.
                ienv = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
                        "PYTHONHOME": f"{sys.base_prefix}:{sys.base_exec_prefix}"}
                proc = subprocess.Popen([worker_init.TITLE, "-S", "-P", INIT_SCRIPT, "spawn"], executable=sys.executable,
                                        env=ienv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                        start_new_session=True, close_fds=True)
            except OSError as exc:
                raise CapabilityError(f"cannot start the workers' inits: {exc}") from None
        proc.stdin.write(json.dumps(items).encode())
        proc.stdin.close()
        proc.stdin = None  # communicate() must not touch it again
        return proc

    def _collect(self, proc: subprocess.Popen, recs: Mapping[str, dict[str, Any]], check: bool = False) -> None:
        """Read what the inits reported: fill each record's pid; with check, raise on the first failure."""
        try:
            out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise TestbedError(f"the workers' inits did not start within {START_TIMEOUT_S:.0f} s") from None
        ok: set[str] = set()
        errors: dict[str, str] = {}
        for line in out.decode(errors="replace").splitlines():
            node, _, msg = line.partition(" ")
            rec = recs.get(node)
            if rec is None:
                continue
            if msg.startswith("pid "):
                rec["pid"] = int(msg.split()[1])
                rec["starttime"] = procs.start_ticks(rec["pid"])
            elif msg.startswith("error "):
                errors.setdefault(node, msg[6:])
            elif msg == "ok":
                ok.add(node)
        if not check:
            return
        for node, rec in recs.items():
            if node in errors or node not in ok or rec.get("pid") is None:
                why = errors.get(node) or f"its init exited; see {rec['log_dir']}/init.log"
                raise CapabilityError(f"cannot start worker {node}: {why}")

    def remove(self, node: str, record: Mapping[str, Any]) -> None:
        self.remove_many([(node, record)])

    def remove_many(self, workers: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        """remove() for many workers at once: all inits are asked to stop, then awaited."""
        workers = list(workers)
        # an init is signalled only if the record names it (PID, start time) and it sits in its
        # worker's namespace: a record alone is not proof
        inits = []
        for node, rec in workers:
            if rec.get("pid") and rec.get("starttime") is not None:
                r = procs.ProcRef(int(rec["pid"]), int(rec["starttime"]))
                if procs.in_netns(r, netns_mod.path(names.netns(self.testbed, node))):
                    inits.append(r)
        procs.stop(inits, term_wait=STOP_GRACE_S + 1.0)
        first_error: Exception | None = None
        for node, rec in workers:
            try:
                cgroups.remove(rec.get("cgroups") or [])
            except OSError as exc:
                first_error = first_error or exc
            if rec.get("dir"):
                shutil.rmtree(rec["dir"], ignore_errors=True)
        wroot = paths.directory(self.testbed) / "workers"
        try:
            wroot.rmdir()
        except OSError:
            pass
        if first_error:
            raise TestbedError(f"could not remove a worker's cgroup: {first_error}")

    # -- reaching a worker -----------------------------------------------------
    def pid(self, node: str, record: Mapping[str, Any]) -> int | None:
        """The worker's init, if the process the record names (PID and start time) still runs."""
        pid, start = record.get("pid"), record.get("starttime")
        if not pid or start is None:
            return None
        return int(pid) if procs.alive(procs.ProcRef(int(pid), int(start))) else None

    def _require_pid(self, node: str, record: Mapping[str, Any]) -> int:
        pid = self.pid(node, record)
        if pid is None:
            raise StateError(f"worker {node} of testbed {self.testbed} is not running")
        return pid

    def exec_argv(self, node: str, record: Mapping[str, Any], argv: Sequence[str], *,
                  env: Mapping[str, str] | None = None, tty: bool = False, workdir: str | None = None) -> list[str]:
        pid = self._require_pid(node, record)
        if not argv:
            raise TestbedError("nothing to run")
        variables = {"HOSTNAME": node, **(record.get("env") or {}), **(env or {})}
        inner = ["env", *(f"{k}={v}" for k, v in variables.items())]
        if workdir:
            inner += ["/bin/sh", "-c", 'cd "$0" && exec "$@"', workdir]
        try:
            here = os.getcwd()
        except OSError:
            here = "/"
        cmd = ["nsenter", "-t", str(pid), "-a", f"--wd={here}", "--",
               *setpriv_argv(bool(record.get("net_admin"))), *inner, *argv]
        procs = cgroups.cgroup_procs_files(record.get("cgroups") or [])
        if procs:
            join = "; ".join(f"echo $$ > {shlex.quote(p)}" for p in procs)
            cmd = ["/bin/sh", "-c", f'{join} || exit 125; exec "$@"', "testbed-exec", *cmd]
        return cmd

    def attach(self, node: str, record: Mapping[str, Any]) -> int:
        rc = self.worker_dir(node) / "attachrc"
        rc.parent.mkdir(parents=True, exist_ok=True)
        rc.write_text(
            "[ -f /etc/bash.bashrc ] && . /etc/bash.bashrc\n"
            "[ -f ~/.bashrc ] && . ~/.bashrc\n"
            f"PS1='[{self.testbed}] \\u@\\h:\\w\\$ '\n"
        )
        if Path("/bin/bash").exists():
            argv = ["/bin/bash", "--rcfile", str(rc), "-i"]
        else:
            argv = ["/bin/sh", "-i"]
        return self.exec(node, record, argv, tty=True)

    # -- control -----------------------------------------------------------------
    def processes(self, node: str, record: Mapping[str, Any]) -> list[int]:
        """Host PIDs of every process in the worker (its PID namespace), the init first."""
        pid = self.pid(node, record)
        if pid is None:
            return []
        return pids_in_pidns(pid)

    def stop(self, node: str, record: Mapping[str, Any]) -> None:
        """Freeze every process of the worker (a hung node); cont() thaws it."""
        self._require_pid(node, record)
        if not cgroups.freeze(record.get("cgroups") or [], True):
            for p in self.processes(node, record)[1:]:
                _signal(p, signal.SIGSTOP)

    def cont(self, node: str, record: Mapping[str, Any]) -> None:
        if not cgroups.freeze(record.get("cgroups") or [], False):
            for p in self.processes(node, record)[1:]:
                _signal(p, signal.SIGCONT)

    def kill(self, node: str, record: Mapping[str, Any]) -> None:
        """The node crashes: its init and every process in it die at once (its network stays)."""
        pid = self.pid(node, record)
        if pid is None:
            return
        cgroups.freeze(record.get("cgroups") or [], False)
        _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while procs.start_ticks(pid) == record.get("starttime") and time.monotonic() < deadline:
            time.sleep(0.005)

    def restart(self, node: str, record: Mapping[str, Any]) -> dict[str, Any]:
        """Kill the worker if it runs and start it again (same namespace, env, hosts, limits)."""
        self.kill(node, record)
        cgroups.remove(record.get("cgroups") or [])
        n = Node.from_json(record["node"])
        hosts = (Path(record["dir"]) / "etc" / "hosts").read_text()
        return self._start_prepared(n, record["netns"], record.get("env") or {}, hosts,
                                    net_admin=bool(record.get("net_admin")))

    def _start_prepared(self, node: Node, netns: str, env: Mapping[str, str], hosts: str,
                        net_admin: bool | None = None) -> dict[str, Any]:
        setpriv_path()
        rec, cfg = self._prepare(node, netns, env, hosts, net_admin=net_admin)
        try:
            proc = self._spawn([(node.name, rec, cfg)])
            self._collect(proc, {node.name: rec}, check=True)
        except BaseException:
            self.remove(node.name, rec)
            raise
        return rec

    def set_limits(self, node: str, record: Mapping[str, Any], *, cpus: float | None = None,
                   memory_bytes: int | None = None) -> None:
        paths = record.get("cgroups") or []
        if not paths:
            raise CapabilityError(f"worker {node} has no cgroup: limits cannot be changed")
        cgroups.set_limits(paths, cpus=cpus, memory_bytes=memory_bytes)

    def cpu_usage_s(self, node: str, record: Mapping[str, Any]) -> float | None:
        return cgroups.cpu_usage_s(record.get("cgroups") or [])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def pids_in_pidns(init_pid: int) -> list[int]:
    """Host PIDs of the processes in the PID namespace whose init is init_pid (init first)."""
    return procs.pids_in_pidns(init_pid)
