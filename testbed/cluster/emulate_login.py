"""An emulated host's login user: the files that make it exist on that host only, and the checks before.

The user is never added to this machine's /etc: each host gets its own copies (DIR/hN/etc) of
/etc/passwd, group, shadow, hosts and sudoers.d with the user added, and a home under DIR/hN/home,
which the host's holder binds in the host's mount namespace (hostside/emulated_holder.sh).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from testbed.cluster.emulate_record import EmulatedHost, EmulatedRecord
from testbed.errors import CapabilityError, StateError, TestbedError

SUDO_MODES = ("nopasswd", "none")
LOGIN_UIDS = range(50000, 60000)   # the login user's uid (= gid): the first free on this machine
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")


def sudo_modes(names: list[str], sudo: str | Mapping[str, str]) -> dict[str, str]:
    """Each host's sudo mode: `sudo` for all, or host -> mode (a host not named: nopasswd)."""
    modes = ({n: sudo for n in names} if isinstance(sudo, str)
             else {n: sudo.get(n, SUDO_MODES[0]) for n in names})
    if not isinstance(sudo, str) and set(sudo) - set(names):
        raise TestbedError(f"--sudo names no such host: {', '.join(sorted(set(sudo) - set(names)))}")
    bad = sorted({m for m in modes.values() if m not in SUDO_MODES})
    if bad:
        raise TestbedError(f"--sudo: {', '.join(bad)} is not one of {', '.join(SUDO_MODES)}")
    return modes


def check_login_user(user: str, modes: dict[str, str]) -> None:
    if not _USER_RE.match(user) or user == "root":
        raise TestbedError(f"--login-user {user!r}: a user name (lowercase letters, digits, '_', '-'), not root")
    for lookup, what in ((pwd.getpwnam, "a user"), (grp.getgrnam, "a group")):
        try:
            lookup(user)
        except KeyError:
            continue
        raise TestbedError(f"--login-user {user}: {what} of that name exists on this machine; the emulated "
                           "hosts add their own (pick another name)")
    if "nopasswd" in modes.values() and (shutil.which("sudo") is None or not os.path.isdir("/etc/sudoers.d")):
        raise CapabilityError("a login user with sudo needs sudo (and /etc/sudoers.d): apt-get install sudo")


def free_login_uid() -> int:
    """A uid free on this machine that is also free as a gid (the login user's own group)."""
    used = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for uid in LOGIN_UIDS:
        if uid not in used:
            return uid
    raise StateError(f"no uid free in {LOGIN_UIDS.start}-{LOGIN_UIDS.stop - 1} for the login user")


def _copy_as(src: str, dst: Path, extra: str = "") -> None:
    """`src` copied to `dst` with its mode and owner, `extra` (a line) appended."""
    st = os.stat(src)
    text = Path(src).read_bytes()
    if extra:
        text += (b"" if not text or text.endswith(b"\n") else b"\n") + extra.encode() + b"\n"
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(text)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))


def make_login(emu: EmulatedRecord, h: EmulatedHost) -> None:
    """Host `h`'s login user, in files under DIR/hN that the holder binds in the host's mount
    namespace only: etc/passwd, group and shadow (this machine's, plus the user), etc/hosts (plus
    the host's name), etc/sudoers.d (this machine's, plus its NOPASSWD rule when h.sudo says so)
    and home/NAME with the client key."""
    user, uid = emu.login_user, emu.login_uid
    assert user and uid is not None
    etc = h.path / "etc"
    etc.mkdir(mode=0o755)
    _copy_as("/etc/passwd", etc / "passwd", f"{user}:x:{uid}:{uid}:testbed emulated host login:{emu.login_home}:/bin/sh")
    _copy_as("/etc/group", etc / "group", f"{user}:x:{uid}:")
    # "*": no password can match, and the account is not locked ("!" is: sshd would refuse the key)
    _copy_as("/etc/shadow", etc / "shadow", f"{user}:*:::::::")
    # the host's name, as Debian's installer writes it (sudo warns on every command when it cannot be resolved)
    _copy_as("/etc/hosts", etc / "hosts", f"127.0.1.1\t{h.name}")
    if os.path.isdir("/etc/sudoers.d"):
        sudoers = etc / "sudoers.d"
        sudoers.mkdir(mode=0o755)
        for entry in sorted(os.listdir("/etc/sudoers.d")):
            src = os.path.join("/etc/sudoers.d", entry)
            if os.path.isfile(src) and not os.path.islink(src):
                _copy_as(src, sudoers / entry)
        if h.sudo == "nopasswd":
            rule = sudoers / f"zz-testbed-emulated-{user}"   # read last: it is not overridden
            fd = os.open(rule, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o440)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"# made by testbed.cluster.emulate for host {h.name}\n{user} ALL=(ALL) NOPASSWD: ALL\n")
    homes = h.path / "home"
    homes.mkdir(mode=0o755)
    home = homes / user
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, parents=True)
    keys = ssh / "authorized_keys"
    keys.write_text(emu.authorized_keys.read_text())
    keys.chmod(0o600)
    for p in (home, ssh, keys):
        os.chown(p, uid, uid)
    home.chmod(0o755)
