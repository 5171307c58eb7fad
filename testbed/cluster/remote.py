"""Host control: run commands on and copy files to the hosts of a hosts file, over SSH with Fabric.

The controller reaches every host through one narrow interface, HostControl::

    name                                                      the host's name in the hosts file
    run(argv, *, stdin=None, timeout=None, check=False,
        on_stdout=None)                                       -> RemoteResult (rc, stdout, stderr)
    put(local, remote)                                        copy one file, atomically (a rename)
    close()

so that a second implementation (a host agent under Kubernetes, say) can drive the same
controller. Commands are argument vectors, never shell strings: the remote side gets
shlex.join(argv), so an argument is never split or expanded (write ["sh", "-c", SCRIPT, ...]
when a shell is wanted).

SshHost is the SSH implementation, a fabric.Connection built from a hosts-file entry
(testbed/cluster/hosts.py): user, address and port from `ssh:`, the private key from `key:`
(~ expanded), the SSH agent as `agent:` says; ~/.ssh/config still applies as for ssh(1) (a
`User`, `ProxyJump`, `IdentityFile`). It never prompts: no passwords, no passphrases (an
encrypted key belongs in the agent), no interactive sudo.

Host keys. testbed acts as root on every host, so a host's identity is checked, never assumed
(Fabric's own default accepts and remembers any new key: not used):

- known_hosts=FILE: keys are taken from FILE only; an unknown host is refused
  (HostKeyRejected), unless trust_new=True, which accepts a new host's key and appends it to
  FILE (ssh's StrictHostKeyChecking=accept-new);
- known_hosts=None: keys come from ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts; an
  unknown host is refused unless trust_new=True, which accepts it for this connection only.

A key that differs from the recorded one is always refused, whatever trust_new says.

Privilege. Commands run as root: directly when the login user is root (or has uid 0);
otherwise through `sudo -n`, checked once per host when the first connection is made. When sudo
would ask for a password every run raises SudoRefused, which says so.

Timeouts. run(timeout=T) runs the command under the host's `timeout -k 5 T` (coreutils), so
the remote process is ended, not merely abandoned, and raises RemoteTimeout; the local side
gives up T + 15 s later in case the host stopped answering.

What a host sends is bounded (it is hostile input, and testbed runs as root): without on_stdout,
stdout is kept up to STDOUT_MAX (64 MiB) and a host that sends more gets OutputTooLarge, naming it
(its session is closed, which ends the command); with on_stdout, the result keeps stdout's last
STREAM_KEEP (1 MiB) and what the callback keeps is its own (lines(): one line waits for its newline
up to LINE_MAX, 64 KiB, then is passed on cut); of stderr the last STDERR_KEEP (1 MiB) is kept.
So a command costs this process at most STDOUT_MAX + STDERR_KEEP of buffers, plus the decoded text.

Failures, all TestbedError: HostUnreachable (no session could be had, or it was lost;
HostKeyRejected and HostAuthFailed are kinds of it), RemoteError (check=True and the command
failed: host, command, exit status, the last lines of its stderr), RemoteTimeout, SudoRefused,
OutputTooLarge.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shlex
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, Self, TypeVar, runtime_checkable

from testbed.errors import TestbedError
from testbed.cluster import hostside
from testbed.cluster.host_keys import APPEND_LOCK, SYSTEM_KNOWN_HOSTS, KeyPolicy, UnknownHostKey, fingerprint
from testbed.cluster.hosts import Host

__all__ = ["HostAuthFailed", "HostControl", "HostKeyRejected", "HostUnreachable", "OutputTooLarge", "RemoteError",
           "RemoteResult", "RemoteTimeout", "SshHost", "SudoRefused", "lines", "run_parallel"]

T = TypeVar("T")

DEFAULT_CONNECT_TIMEOUT = 10.0   # s: TCP connect, SSH banner, authentication, opening a session
KILL_AFTER_S = 5                 # the remote `timeout -k`: SIGKILL this long after SIGTERM
LOCAL_GRACE_S = 15.0             # the local side waits this much longer than the remote timeout
DRAIN_S = 2.0                    # after the exit status, how long output may still trickle in without moving
STDERR_LINES = 5                 # lines of stderr a RemoteError quotes
STREAM_KEEP = 1 << 20            # with on_stdout, the result keeps this much of stdout's end
STDOUT_MAX = 64 << 20            # without on_stdout: a host that sends more is refused, not buffered
STDERR_KEEP = 1 << 20            # of stderr, its end is kept (what a failure quotes)
LINE_MAX = 1 << 16               # lines(): what waits for a newline (a longer line is passed on cut)


# -- errors ----------------------------------------------------------------------------------------------


class HostUnreachable(TestbedError):
    """No SSH session to `host` could be had, or the one we had was lost: one line naming the host,
    its SSH address and why (refused, timed out, host key, authentication, ...)."""

    def __init__(self, host: str, why: str, address: str | None = None):
        self.host, self.why, self.address = host, why, address
        where = f" ({address})" if address else ""
        super().__init__(f"cannot reach host {host} over SSH{where}: {why}")


class HostKeyRejected(HostUnreachable):
    """The host's key is unknown (and new keys are not trusted) or differs from the recorded one."""


class HostAuthFailed(HostUnreachable):
    """The host answered but refused our key / agent (or the key cannot be used without a prompt)."""


def tail_lines(text: str, n: int = STDERR_LINES) -> list[str]:
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    return [ln if len(ln) <= 300 else ln[:297] + "..." for ln in lines[-n:]]


def shown_argv(argv: Sequence[str]) -> str:
    text = shlex.join(argv)
    return text if len(text) <= 200 else text[:197] + "..."


class RemoteError(TestbedError):
    """A remote command failed: the host, the command, its exit status and the last lines of its
    stderr (of its stdout when stderr is empty)."""

    def __init__(self, host: str, argv: Sequence[str], rc: int, stderr: str = "", stdout: str = "",
                 why: str | None = None):
        self.host, self.argv, self.rc, self.stderr, self.stdout = host, tuple(argv), rc, stderr, stdout
        if why is None:
            why = "was killed by a signal" if rc < 0 else f"exited with status {rc}"
        text = f"on host {host}: `{shown_argv(argv)}` {why}"
        lines, label = tail_lines(stderr), "stderr"
        if not lines:
            lines, label = tail_lines(stdout), "stdout"
        if lines:
            text += f"; last lines of its {label}:\n" + "\n".join(f"  {ln}" for ln in lines)
        super().__init__(text)


class RemoteTimeout(RemoteError):
    """run(timeout=T): the command did not finish within T seconds (it was ended on the host)."""

    def __init__(self, host: str, argv: Sequence[str], timeout: float, stderr: str = "", stdout: str = ""):
        self.timeout = timeout
        super().__init__(host, argv, 124, stderr, stdout, why=f"did not finish within {timeout:g} s (ended)")


class OutputTooLarge(RemoteError):
    """The command sent more on stdout than testbed keeps of a command's output (and no reader was
    given to stream it to): given up on, its session closed."""

    def __init__(self, host: str, argv: Sequence[str], limit: int, stderr: str = ""):
        self.limit = limit
        super().__init__(host, argv, -1, stderr, "",
                         why=f"sent more than {limit >> 20} MiB on stdout, the most testbed keeps of a command's "
                             "output: given up on (its session closed), nothing of it used")


def lines(fn: Callable[[str], None], limit: int = LINE_MAX) -> Callable[[bytes], None]:
    """An on_stdout for run() that calls fn(line) for each whole line (decoded, undecodable bytes
    replaced, without its newline). What waits for a newline never grows past `limit` bytes: a
    longer line is passed on cut at `limit`, its rest dropped up to the next newline. The returned
    callable's close() passes on a last line that had no newline."""
    from testbed.safeio import Lines

    cut = Lines(lambda raw: fn(raw.decode(errors="replace")), limit)

    class _Feed:
        def __call__(self, data: bytes) -> None:
            cut.feed(data)

        def close(self) -> None:
            cut.close()

    return _Feed()


class SudoRefused(RemoteError):
    """The login user is not root and `sudo -n` refused (a password is needed, or no sudo at all)."""

    def __init__(self, host: str, user: str, stderr: str):
        self.user = user
        reason = (tail_lines(stderr, 1) or ["no reason given"])[0]
        super().__init__(host, ["sudo", "-n", "true"], 1, "", "",
                         why=f"failed: commands need root and {user} is not root, and sudo -n refused ({reason}); "
                             f"allow {user} passwordless sudo (NOPASSWD) or log in as root")


# -- results and the interface -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteResult:
    """What a remote command did. rc -1: it was killed by a signal (SSH reports no status then)."""

    rc: int
    stdout: str
    stderr: str
    host: str
    argv: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self) -> RemoteResult:
        """This result, or RemoteError when the command failed."""
        if self.rc != 0:
            raise RemoteError(self.host, self.argv, self.rc, self.stderr, self.stdout)
        return self


@runtime_checkable
class HostControl(Protocol):
    """How the controller acts on one host. Implementations raise HostUnreachable when the host
    cannot be reached, RemoteError (check=True) when a command fails, RemoteTimeout on timeout."""

    name: str

    def run(self, argv: Sequence[str], *, stdin: bytes | IO[bytes] | None = None, timeout: float | None = None,
            check: bool = False, on_stdout: Callable[[bytes], None] | None = None) -> RemoteResult:
        """Run argv as root on the host; stdin: bytes fed to it (then EOF), a binary file read until
        its EOF (a pipe: a dialogue), None: an empty stdin. on_stdout: called with each piece of
        stdout as it arrives (the result then holds its last MiB: a stream may run for hours)."""
        ...

    def put(self, local: Path, remote: str) -> None:
        """Copy the local file to `remote` on the host (parents made, mode kept, replaced atomically)."""
        ...

    def close(self) -> None:
        """Drop the connection (a later call reconnects)."""
        ...


# -- SSH --------------------------------------------------------------------------------------------------


def _close_quietly(conn: Any) -> None:
    """Close a fabric.Connection that may be half made or already broken. Fabric's close() does
    nothing for a connection whose open() failed (it never recorded the transport), so paramiko's
    client is closed too: else its socket stays open and the server waits for us."""
    import paramiko

    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        conn.close()
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        conn.client.close()


def _socket_why(exc: BaseException, address: str, port: int, timeout: float) -> str:
    where = f"{address}:{port}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {address} ({exc.strerror or exc})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer from {where} within {timeout:g} s (connect timed out)"
    code = getattr(exc, "errno", None)
    if code == errno.ECONNREFUSED:
        return f"connection refused at {where}: no SSH server listens there"
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"no route to {address} ({os.strerror(code)})"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return f"cannot connect to {where}: {text}"


class SshHost:
    """HostControl over SSH for one hosts-file entry (see the module's docstring for host keys,
    privilege and timeouts). Connects lazily on the first call, reconnects after a lost
    connection, and is safe to share between threads."""

    def __init__(self, host: Host, *, known_hosts: Path | str | None = None, trust_new: bool = False,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT):
        self.host = host
        self.name = host.name
        self.target = host.target
        self.address = str(self.target)
        self.known_hosts = Path(known_hosts).expanduser() if known_hosts is not None else None
        self.trust_new = trust_new
        self.connect_timeout = float(connect_timeout)
        self._lock = threading.Lock()
        self._conn: Any = None
        self._sudo: bool | None = None          # None: not known yet (set by the first connection)
        self._sudo_refused: tuple[str, str] | None = None   # (user, sudo's stderr)

    def __repr__(self) -> str:
        return f"SshHost({self.name!r}, {self.address!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def uses_sudo(self) -> bool | None:
        """Whether commands go through `sudo -n` (None until the first connection)."""
        return self._sudo

    # -- connecting

    def _unreachable(self, why: str, kind: type[HostUnreachable] = HostUnreachable) -> HostUnreachable:
        return kind(self.name, why, self.address)

    def _key_file(self) -> str | None:
        if self.host.key is None:
            return None
        key = os.path.expanduser(self.host.key)
        if not os.path.isfile(key):
            raise self._unreachable(f"the private key {key} (key: in the hosts file) does not exist on this "
                                    "machine", HostAuthFailed)
        return key

    def _load_host_keys(self, client: Any) -> None:
        import paramiko
        from paramiko.hostkeys import InvalidHostKey

        files = ([self.known_hosts] if self.known_hosts is not None
                 else [Path(p).expanduser() for p in SYSTEM_KNOWN_HOSTS])
        for path in files:
            if not path.is_file():
                continue
            try:
                if self.known_hosts is not None:
                    client.get_host_keys().load(str(path))
                else:
                    client.load_system_host_keys(str(path))
            except (OSError, ValueError, paramiko.SSHException, InvalidHostKey) as exc:   # a malformed file
                raise self._unreachable(f"cannot read the known hosts file {path}: {exc}", HostKeyRejected) from None

    def _where_keys(self) -> str:
        if self.known_hosts is not None:
            return str(self.known_hosts)
        return " or ".join(SYSTEM_KNOWN_HOSTS)

    def _open(self) -> Any:
        """A connected fabric.Connection, or HostUnreachable (or a kind of it) saying why not."""
        import paramiko
        from fabric import Connection

        key = self._key_file()
        t = self.connect_timeout
        try:
            # forward_agent=False: a host we command as root never gets this machine's agent, whatever
            # ~/.ssh/config says (Fabric follows its ForwardAgent when this is left unset)
            conn = Connection(self.target.address, user=self.target.user, port=self.target.port,
                              connect_timeout=max(1, math.ceil(t)), forward_agent=False,
                              connect_kwargs={"key_filename": [key] if key else [],
                                              "allow_agent": self.host.uses_agent, "look_for_keys": False,
                                              "banner_timeout": t, "auth_timeout": t, "channel_timeout": t})
        except paramiko.ConfigParseError as exc:
            raise self._unreachable(f"cannot read the SSH client configuration: {exc}") from None
        # the same host-key rules for a ProxyJump host from ~/.ssh/config (Fabric would auto-add its key;
        # a ProxyCommand is ssh(1)'s business)
        hop = conn
        while isinstance(hop, Connection):
            self._load_host_keys(hop.client)
            hop.client.set_missing_host_key_policy(KeyPolicy(self.trust_new, self.known_hosts, APPEND_LOCK))
            hop = hop.gateway
        how = " and ".join(([f"the key {key}"] if key else []) + (["the SSH agent"] if self.host.uses_agent else []))
        try:
            conn.open()
        except BaseException as exc:
            _close_quietly(conn)
            if isinstance(exc, UnknownHostKey):
                raise self._unreachable(
                    f"its host key ({fingerprint(exc.key)}) is not in {self._where_keys()}; unknown host keys "
                    "are refused (add the key, e.g. from ssh-keyscan checked out of band, or pass trust_new=True "
                    "to accept new keys)", HostKeyRejected) from None
            if isinstance(exc, paramiko.BadHostKeyException):
                raise self._unreachable(
                    f"its host key ({fingerprint(exc.key)}) differs from the one recorded in {self._where_keys()} "
                    f"({fingerprint(exc.expected_key)}): another machine answers, or the host's key changed; "
                    "refused", HostKeyRejected) from None
            if isinstance(exc, paramiko.PasswordRequiredException):
                raise self._unreachable(
                    f"the key {key} is encrypted and testbed never asks for a passphrase: add it to the SSH "
                    "agent (ssh-add) and set agent: true", HostAuthFailed) from None
            if isinstance(exc, paramiko.AuthenticationException):
                raise self._unreachable(f"the host refused {conn.user} with {how or 'no key and no agent'} "
                                        f"({exc})", HostAuthFailed) from None
            if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
                first = next(iter(exc.errors.values()), exc)
                raise self._unreachable(_socket_why(first, self.target.address, self.target.port, t)) from None
            if isinstance(exc, (OSError, socket.timeout)):
                raise self._unreachable(_socket_why(exc, self.target.address, self.target.port, t)) from None
            if isinstance(exc, (paramiko.SSHException, EOFError)):
                raise self._unreachable(f"the SSH handshake with {self.target.address}:{self.target.port} "
                                        f"failed: {exc or type(exc).__name__}") from None
            raise
        return conn

    def _transport(self) -> Any:
        """The live SSH transport, connecting (and learning whether sudo is needed) when there is none."""
        with self._lock:
            if self._conn is not None and self._conn.is_connected:
                return self._conn.transport
            self._drop()
            conn = self._open()
            if self._sudo is None:
                try:
                    self._probe_privilege(conn)
                except BaseException:
                    _close_quietly(conn)
                    raise
            self._conn = conn
            return conn.transport

    def connect(self) -> None:
        """Connect now (run() would on its first call): HostUnreachable or SudoRefused says why not."""
        self._transport()
        if self._sudo_refused is not None:
            raise SudoRefused(self.name, *self._sudo_refused)

    def _probe_privilege(self, conn: Any) -> None:
        """Root, or sudo without a password? Decided once per host: from the login user's uid."""
        if conn.user == "root":
            self._sudo = False
            return
        rc, out, err, _ = self._exec(conn.transport, "id -u", None, 30.0)
        if rc == 0 and out.decode(errors="replace").strip() == "0":
            self._sudo = False
            return
        rc, out, err, _ = self._exec(conn.transport, "sudo -n true", None, 30.0)
        if rc != 0:
            self._sudo_refused = (conn.user, err.decode(errors="replace") or out.decode(errors="replace"))
        self._sudo = True

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            _close_quietly(conn)

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- running

    def _exec(self, transport: Any, command: str, stdin: bytes | IO[bytes] | None, wait_s: float | None,
              on_stdout: Callable[[bytes], None] | None = None) -> tuple[int | None, bytearray, bytearray, str | None]:
        """Run `command` in a new session: (rc or None, stdout, stderr, why), the output as received (not
        copied). rc None: no exit status (why says: "timeout", "lost" (the connection died), "signal"
        (killed on the host) or "overflow" (more than STDOUT_MAX on stdout without on_stdout))."""
        import paramiko

        lost = (OSError, EOFError, paramiko.SSHException)   # what paramiko raises when a session breaks
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(command)
        except lost as exc:
            if not transport.is_active():
                raise self._unreachable(f"lost the connection while starting `{command[:200]}`: {exc}") from None
            raise self._unreachable(f"the host refused a new session for `{command[:200]}`: {exc}") from None
        out, err = bytearray(), bytearray()
        moved = [time.monotonic(), False]   # when output last came in or was passed on; passing it on now

        def drain(recv: Callable[[int], bytes], buf: bytearray, tell: Callable[[bytes], None] | None,
                  keep: int | None = None) -> None:
            while True:
                try:
                    data = recv(1 << 16)
                except lost:   # the channel was closed under us (timeout, lost connection)
                    return
                if not data:
                    return
                moved[0] = time.monotonic()
                if tell is None and keep is None and len(buf) + len(data) > STDOUT_MAX:
                    overflow[0] = True   # what a host sends is bounded: the command is given up on
                    chan.close()
                    return
                buf += data
                if tell is not None:
                    moved[1] = True   # (tell may wait: a streamed copy's reader is slower than the network)
                    try:
                        tell(data)
                    finally:
                        moved[:] = [time.monotonic(), False]
                    if len(buf) > STREAM_KEEP:   # streamed: the caller has it; keep the tail only
                        del buf[:len(buf) - STREAM_KEEP]
                elif keep is not None and len(buf) > keep:
                    del buf[:len(buf) - keep]

        def feed() -> None:
            # the command may exit without reading all of its input: as with a pipe, not an error;
            # nor is a stdin the caller closed meanwhile (ValueError: it gave up on the command)
            with contextlib.suppress(*lost, ValueError):
                if isinstance(stdin, (bytes, bytearray, memoryview)):
                    chan.sendall(bytes(stdin))
                elif stdin is not None:
                    while chunk := stdin.read(1 << 16):
                        chan.sendall(chunk)
                chan.shutdown_write()

        overflow = [False]
        threads = [threading.Thread(target=drain, args=(chan.recv, out, on_stdout), daemon=True),
                   threading.Thread(target=drain, args=(chan.recv_stderr, err, None, STDERR_KEEP), daemon=True)]
        if stdin is None:
            chan.shutdown_write()
        else:
            threads.append(threading.Thread(target=feed, daemon=True))
        for th in threads:
            th.start()
        end = None if wait_s is None else time.monotonic() + wait_s
        why = None
        try:
            while not chan.status_event.wait(0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))):
                if end is not None and time.monotonic() >= end:
                    why = "timeout"
                    break
                if not transport.is_active() or overflow[0]:
                    break
            if why is None:
                # output sent before the status may still be on its way, or still be passed on to a
                # slow reader; a background process that keeps stdout open must not hold us forever:
                # waited for while it moves, given up after DRAIN_S without any
                moved[0] = max(moved[0], time.monotonic())
                while any(th.is_alive() for th in threads[:2]) and (moved[1] or time.monotonic() - moved[0] < DRAIN_S):
                    threads[0].join(0.05)
        finally:
            chan.close()
            for th in threads:
                th.join(1.0)
        if overflow[0]:
            out.clear()   # (nothing of it is used)
            return None, out, err, "overflow"
        if why is None:
            if chan.exit_status != -1:
                return chan.exit_status, out, err, None
            why = "signal" if transport.is_active() else "lost"
        return None, out, err, why

    def _command(self, argv: Sequence[str], timeout: float | None) -> str:
        words = list(argv)
        if timeout is not None:
            words = ["timeout", "-k", str(KILL_AFTER_S), f"{max(timeout, 0.001):.3f}s", *words]
        if self._sudo:
            words = ["sudo", "-n", "--", *words]
        return shlex.join(words)

    def run(self, argv: Sequence[str], *, stdin: bytes | IO[bytes] | None = None, timeout: float | None = None,
            check: bool = False, on_stdout: Callable[[bytes], None] | None = None) -> RemoteResult:
        """Run argv as root on the host (see the module's docstring and HostControl.run)."""
        args = tuple(os.fspath(a) for a in argv)
        if not args:
            raise ValueError("run: empty argv")
        transport = self._transport()
        if self._sudo_refused is not None:
            raise SudoRefused(self.name, *self._sudo_refused)
        t0 = time.monotonic()
        rc, out, err, why = self._exec(transport, self._command(args, timeout), stdin,
                                       None if timeout is None else timeout + LOCAL_GRACE_S, on_stdout)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        del out, err
        if why == "overflow":
            raise OutputTooLarge(self.name, args, STDOUT_MAX, stderr)
        if why == "lost":
            self.close()
            raise self._unreachable(f"lost the connection while running `{shown_argv(args)}`")
        if why == "timeout" or (timeout is not None and rc in (124, 128 + 9)
                                and time.monotonic() - t0 >= timeout):
            raise RemoteTimeout(self.name, args, timeout or 0.0, stderr, stdout)
        result = RemoteResult(rc=-1 if rc is None else rc, stdout=stdout, stderr=stderr, host=self.name, argv=args)
        return result.check() if check else result

    _PUT = hostside.text("put.sh")   # sh -c _PUT sh PATH MODE, the file on stdin

    def put(self, local: Path, remote: str) -> None:
        """Copy `local` to `remote` on the host as root, streamed through the SSH session (works the
        same through sudo), written to a temporary name and renamed: readers never see half a file."""
        local = Path(local)
        mode = local.stat().st_mode & 0o7777
        with local.open("rb") as fh:
            self.run(["sh", "-c", self._PUT, "sh", remote, f"{mode:o}"], stdin=fh, check=True)


# -- parallel work ---------------------------------------------------------------------------


def run_parallel(ctls: Sequence[HostControl], fn: Callable[[HostControl], T]) -> list[T | Exception]:
    """fn(ctl) for every host at once, one thread per host; results in the order of `ctls`, an
    exception raised by fn in its host's place (captured, never raised)."""
    results: list[Any] = [None] * len(ctls)

    def one(i: int, ctl: HostControl) -> None:
        try:
            results[i] = fn(ctl)
        except Exception as exc:  # noqa: BLE001 - captured: the caller gets it in the host's place
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i, c), name=f"host-{getattr(c, 'name', i)}", daemon=True)
               for i, c in enumerate(ctls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results
