"""The embedded default runtime: a worker is a set of namespaces, no daemon.

Each worker has its own network namespace (tb-NAME-NODE, made by
prepare_netns, filled by the data plane), and a long-lived init process in
new mount, UTS, PID and IPC namespaces:

- hostname = the node's name; /etc/hosts lists every worker by name (and
  /etc/hostname says its name): both bind-mounted from files under
  /run/testbed/NAME/workers/NODE/;
- a private /tmp and /dev/shm (tmpfs), its own /proc (its own PID space: it
  sees only its processes) and its own /sys (it sees only its interfaces);
- everything else is the host's filesystem, shared as in Mininet, so the
  project's venv and the user's code are there at the same paths. Host mounts
  propagate into workers (rslave), never the other way round;
- cpu and memory limits from the topology through a cgroup
  testbed/NAME/NODE (testbed/runtime/cgroups.py), which the init and every
  process started with exec/attach join;
- the init is PID 1 of the worker: it reaps orphans, and on SIGTERM ends the
  worker's processes and exits. It runs in its own session, so it survives
  the CLI that started it; `down` (remove) stops it.

Reaching a worker is `nsenter -t <init pid> -a` (exec_argv), preceded by
joining the worker's cgroup and followed by `env` with the worker's
variables (env.py, GPU variables): processes get the caller's environment
plus the worker's.

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
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from testbed.errors import CapabilityError, StateError, TestbedError
from testbed.net import names
from testbed.net import netns as netns_mod
from testbed import paths, procs
from testbed.runtime import cgroups
from testbed.runtime.base import PendingStart, Runtime
from testbed.runtime.env import log_dir
from testbed.topology.model import Node

START_TIMEOUT_S = 15.0
STOP_GRACE_S = 3.0

# The worker's init, forked by the spawner below (`python -S -c <_SPAWN> testbed-init`, which
# is what ps shows for every init; its config comes through the environment). It is a script and
# not a module so that it needs nothing but the standard library (no site, no
# venv): stage A joins the cgroup and the network namespace, unshares the
# others and forks stage B, PID 1 of the new PID namespace; A reports B's host
# PID on stdout and exits. B builds the mount namespace, reports "ok" (or
# "error ...") and becomes the init loop.
_INIT = r'''
import ctypes, json, os, signal, sys, time
cfg = json.loads(os.environ.pop("TESTBED_INIT_CONFIG"))
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
NEWNS, NEWUTS, NEWIPC, NEWPID, NEWNET = 0x20000, 0x04000000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 19
def say(msg):
    os.write(1, (msg + "\n").encode())
def chk(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    chk(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount %s on %s" % (fstype or src, dst))
try:
    for f in cfg["cgroup_procs"]:
        with open(f, "w") as fh:
            fh.write(str(os.getpid()))
    fd = os.open(cfg["netns"], os.O_RDONLY)
    chk(libc.setns(fd, NEWNET), "setns " + cfg["netns"])
    os.close(fd)
    chk(libc.unshare(NEWNS | NEWUTS | NEWPID | (0 if cfg["share_ipc"] else NEWIPC)), "unshare")
    pid = os.fork()
except Exception as exc:
    say("error %s" % exc)
    os._exit(1)
if pid:
    say("pid %d" % pid)
    os._exit(0)
try:
    os.setsid()
    mount(None, "/", None, MS_REC | MS_SLAVE)
    # the state dir may be under /tmp (tests): use its files before /tmp is replaced
    logfd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for src, dst in cfg["binds"]:
        if os.path.isfile(dst):
            mount(src, dst, None, MS_BIND)
    cg = None
    if os.path.isdir("/sys/fs/cgroup"):
        cg = os.open("/sys/fs/cgroup", os.O_RDONLY | os.O_DIRECTORY)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if cg is not None:
        try:
            mount("/proc/self/fd/%d" % cg, "/sys/fs/cgroup", None, MS_BIND | MS_REC)
        except OSError:
            pass
        os.close(cg)
        # read-only inside the worker: a job must not lift its own limits (or anyone's); joining
        # the worker's group happens from the host, before a process enters (exec_argv)
        keep_flags = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
        with open("/proc/self/mountinfo") as fh:
            points = [(l.split()[4], l.split()[5]) for l in fh]
        for mp, opts in points:
            if mp == "/sys/fs/cgroup" or mp.startswith("/sys/fs/cgroup/"):
                flags = MS_BIND | MS_REMOUNT | MS_RDONLY
                for o in opts.split(","):
                    flags |= keep_flags.get(o, 0)
                mount(None, mp, None, flags)
    # host dirs the worker must keep seeing though they are under /tmp (a state dir there, in tests)
    keep = [(k, os.open(k, os.O_RDONLY | os.O_DIRECTORY)) for k in cfg["keep"]
            if k.startswith("/tmp/") and os.path.isdir(k)]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for k, kfd in keep:
        os.makedirs(k, exist_ok=True)
        mount("/proc/self/fd/%d" % kfd, k, None, MS_BIND | MS_REC)
        os.close(kfd)
    if not cfg["share_ipc"]:
        if os.path.isdir("/dev/shm"):
            mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        if os.path.isdir("/dev/mqueue"):
            try:
                mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass
    host = cfg["hostname"].encode()
    chk(libc.sethostname(host, len(host)), "sethostname")
    try:    # the OOM killer of a worker's memory cgroup must pick its hog, not its init
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("-1000")
    except OSError:
        pass    # no CAP_SYS_RESOURCE (a container): the init is small and rarely picked
    os.chdir("/")
except Exception as exc:
    say("error %s" % exc)
    os._exit(1)
say("ok")
nul = os.open("/dev/null", os.O_RDONLY)
os.dup2(nul, 0)
os.dup2(logfd, 1)
os.dup2(logfd, 2)
os.close(logfd)
os.close(nul)
SIGS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
signal.pthread_sigmask(signal.SIG_BLOCK, SIGS)
def reap():
    while True:
        try:
            p, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if p == 0:
            return
def others():
    try:
        os.kill(-1, 0)
        return True
    except ProcessLookupError:
        return False
while True:
    s = signal.sigwait(SIGS)
    if s == signal.SIGCHLD:
        reap()
    elif s in (signal.SIGTERM, signal.SIGINT):
        break
try:
    os.kill(-1, signal.SIGTERM)
except ProcessLookupError:
    pass
deadline = time.monotonic() + float(cfg["grace"])
while time.monotonic() < deadline:
    reap()
    if not others():
        break
    time.sleep(0.01)
try:
    os.kill(-1, signal.SIGKILL)
except ProcessLookupError:
    pass
os._exit(0)
'''
# One small process forks the bootstrap of every worker of a batch (a fork costs far less than a
# Python start per worker). Input: [{"node", "cfg", "log"}] on stdin; output: "NODE pid N",
# "NODE ok" or "NODE error ..." lines, once every init has reported.
_SPAWN = r'''
import json, os, sys
init = os.environ.pop("TESTBED_INIT")
items = json.loads(sys.stdin.read())
pipes = []
for it in items:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            for _, rr, _ in pipes:
                os.close(rr)
            os.setsid()
            os.dup2(w, 1)
            os.close(w)
            log = os.open(it["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 2)
            os.close(log)
            os.environ["TESTBED_INIT_CONFIG"] = json.dumps(it["cfg"])
            exec(init, {"__name__": "testbed_init"})
        finally:
            os._exit(1)
    os.close(w)
    pipes.append((it["node"], r, pid))
out = []
for node, r, pid in pipes:
    data = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out += ["%s %s" % (node, line) for line in data.decode(errors="replace").splitlines()]
sys.stdout.write("\n".join(out) + "\n")
'''


def _visible_under_tmp(state_dir: Path) -> list[str]:
    """Host dirs a worker must still see though its /tmp is private: the state dir, the
    project and its venv, and the caller's working dir (a checkout under /tmp, a test's tmp)."""
    import sys

    import testbed

    wanted = [Path(state_dir), Path(testbed.__file__).resolve().parents[1], Path(sys.prefix).resolve(),
              Path.cwd()]
    tmp = [p for p in wanted if str(p).startswith("/tmp/")]
    # a dir inside another kept one comes along with it
    return sorted({str(p) for p in tmp if not any(q != p and q in p.parents for q in tmp)})


def hosts_text(testbed: str, node: str, hosts: Mapping[str, Any]) -> str:
    """The /etc/hosts of a worker: localhost, then every worker by name (its own name included)."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"# testbed {testbed}: its workers"]
    for name, addrs in hosts.items():
        if isinstance(addrs, str):
            addrs = [addrs]
        for a in addrs:
            lines.append(f"{a}\t{name}")
    if node not in hosts:
        lines.append(f"127.0.1.1\t{node}")
    return "\n".join(lines) + "\n"


class NetnsRuntime(Runtime):
    kind = "netns"

    def __init__(self, testbed: str):
        super().__init__(testbed)

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
            for node, netns, env, hosts in workers:
                rec, cfg = self._prepare(node, netns, env, hosts_text(self.testbed, node.name, hosts))
                prepared.append((node.name, rec, cfg))
            proc = self._spawn(prepared)
        except BaseException:
            abort()
            raise
        return PendingStart(finish=finish, abort=abort, records=[rec for _, rec, _ in prepared])

    def _prepare(self, node: Node, netns: str, env: Mapping[str, str], hosts: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Files, cgroup and init configuration of one worker; returns (record, init config)."""
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
            "dir": str(wdir), "log_dir": str(ldir), "share_ipc": share_ipc,
            # who and where the worker is, whatever else the caller's env says
            "env": {"TESTBED_NAME": self.testbed, "TESTBED_NODE": node.name, "TESTBED_LOG_DIR": str(ldir), **env},
            "node": node.to_json(),
        }
        cfg = {
            "netns": str(nspath), "cgroup_procs": cgroups.cgroup_procs_files(cg), "hostname": node.name,
            "share_ipc": share_ipc, "log": str(ldir / "init.log"), "grace": STOP_GRACE_S,
            "keep": _visible_under_tmp(paths.directory(self.testbed)),
            "binds": [[str(wdir / "etc" / "hosts"), "/etc/hosts"], [str(wdir / "etc" / "hostname"), "/etc/hostname"]]
            + ([[str(wdir / "etc" / "resolv.conf"), "/etc/resolv.conf"]] if os.path.exists("/etc/resolv.conf") else []),
        }
        return rec, cfg

    def _spawn(self, prepared: Sequence[tuple[str, dict[str, Any], dict[str, Any]]]) -> subprocess.Popen:
        """One spawner process forks every worker's bootstrap (see _SPAWN)."""
        items = [{"node": n, "cfg": cfg, "log": cfg["log"]} for n, _rec, cfg in prepared]
        logs = paths.directory(self.testbed) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "init-spawn.log", "ab") as err:
            try:
                ienv = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "TESTBED_INIT": _INIT}
                proc = subprocess.Popen([sys.executable, "-S", "-c", _SPAWN, "testbed-init"], env=ienv,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
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
        cmd = ["nsenter", "-t", str(pid), "-a", f"--wd={here}", "--", *inner, *argv]
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
        return self._start_prepared(n, record["netns"], record.get("env") or {}, hosts)

    def _start_prepared(self, node: Node, netns: str, env: Mapping[str, str], hosts: str) -> dict[str, Any]:
        rec, cfg = self._prepare(node, netns, env, hosts)
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


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def pids_in_pidns(init_pid: int) -> list[int]:
    """Host PIDs of the processes in the PID namespace whose init is init_pid (init first)."""
    target = _ns_inode(init_pid, "pid")
    if target is None:
        return []
    out = [init_pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != init_pid and _ns_inode(int(entry), "pid") == target:
            out.append(int(entry))
    return out
