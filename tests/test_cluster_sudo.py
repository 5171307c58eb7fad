"""The sudo path of a testbed over several hosts: the hosts file logs in as a user who is not root,
and every command runs as root through `sudo -n` (testbed/cluster/remote.py: SshHost decides from
the login user's uid, SudoRefused when sudo -n refuses).

Three emulated hosts (testbed/cluster/emulate.py, create(login_user=...)): each has its own user
USER (in its private /etc/passwd, never this machine's), whom hosts.yaml logs in as; h1 and h2 let
it sudo anything without a password, h3 has no sudo rule for it. The controller keeps its record in
a state root of its own (TESTBED_STATE_DIR). topologies/two-sides.yaml pinned across h1 and h2 goes
up, runs, and comes down through sudo; pinned across h1 and h3, `up` is refused. The CLI runs as a
process, as a user runs it. Needs sudo (skipped without it; .ci/run installs it).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import yaml

from cluster_hosts import PINS, TOPOLOGY, tb

# sudo: the hosts' login user runs commands as root through sudo -n
pytestmark = [pytest.mark.root, pytest.mark.requires("sshd", "sudo")]

USER = "tbsudo"   # made on the emulated hosts only


@pytest.fixture(scope="module")
def emulated_options() -> dict:
    """Three hosts that log in as USER, who may sudo on h1 and h2 only (`emu`, tests/conftest.py)."""
    return {"n": 3, "login_user": USER, "sudo": {"h3": "none"}}


def hosts_file(emu, names: list[str], where: Path) -> Path:
    """emu's hosts.yaml with only these hosts (the controller opens a session to every host in it)."""
    doc = yaml.safe_load(emu.hosts_file.read_text())
    doc["hosts"] = [h for h in doc["hosts"] if h["name"] in names]
    path = where / f"hosts-{'-'.join(names)}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def leftovers(emu, host: str, name: str) -> list[str]:
    """What testbed `name` left on `host`: its namespaces and its state directory, read from this
    machine through the host's holder process (h3's user cannot read them as root)."""
    run = Path(f"/proc/{emu.host(host).holder_pid}/root/run")
    assert (run / ".testbed-emulated-host").read_text().split()[1] == host   # really the host's own /run
    netns = [f"netns {ns}" for ns in os.listdir(run / "netns") if name in ns]
    return netns + [f"state {d}" for d in os.listdir(run / "testbed") if name in d]


def test_the_hosts_log_in_as_the_user_and_run_commands_as_root_through_sudo(emu):
    from testbed.cluster.host_checks import check_host

    assert [h.target.user for h in emu.load_hosts()] == [USER] * 3
    for ctl in emu.controls():
        with ctl:
            if ctl.name == "h3":
                continue
            rep = check_host(ctl, emu.testbed)
            assert rep.ok and rep.uid == 0 and rep.sudo is True, rep
            assert ctl.uses_sudo is True
            # root through sudo, logged in as USER
            assert ctl.run(["printenv", "SUDO_USER"], check=True).stdout.strip() == USER
            # nothing on stderr but the command's own (no sudo warning in every command's output)
            r = ctl.run(["sh", "-c", "cat; echo to-stderr >&2"], stdin=b"piped\n", check=True)
            assert (r.stdout, r.stderr) == ("piped\n", "to-stderr\n")


def test_a_host_without_a_sudo_rule_is_reported(emu):
    from testbed.cluster.host_checks import check_host
    from testbed.cluster.remote import SudoRefused

    ctl = next(c for c in emu.controls() if c.name == "h3")
    with ctl:
        rep = check_host(ctl, emu.testbed)
        assert rep.reachable and rep.sudo is True and not rep.ok and rep.uid is None
        assert len(rep.problems) == 1 and USER in rep.problems[0] and "NOPASSWD" in rep.problems[0], rep
        with pytest.raises(SudoRefused, match="a password is required"):
            ctl.run(["true"])


def test_up_exec_and_down_through_sudo(emu, tmp_path):
    from testbed.cluster import controller

    name = f"su{uuid.uuid4().hex[:6]}"
    hosts = hosts_file(emu, ["h1", "h2"], tmp_path)
    try:
        tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(hosts), "--known-hosts", str(emu.known_hosts),
           "--time-dilation", "none", *PINS)
        assert tb("exec", "w2", "--name", name, "--", "id", "-u").stdout.strip() == "0"
        tb("exec", "w0", "--name", name, "--", "ping", "-c", "1", "-W", "2", "w2")   # over the cut link
        assert all(leftovers(emu, h, name) for h in ("h1", "h2"))   # (what the check below looks for)
    finally:
        if controller.exists(name):
            r = tb("down", name, check=False)
            assert r.returncode == 0, r.stderr
    assert not controller.exists(name)
    assert leftovers(emu, "h1", name) == leftovers(emu, "h2", name) == []


def test_up_is_refused_where_the_user_may_not_sudo_and_nothing_is_left(emu, tmp_path):
    from testbed.cluster import controller

    name = f"sr{uuid.uuid4().hex[:6]}"
    pins = [p.replace("=h2", "=h3") for p in PINS]
    r = tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(hosts_file(emu, ["h1", "h3"], tmp_path)),
           "--known-hosts", str(emu.known_hosts), "--time-dilation", "none", *pins, check=False)
    if controller.exists(name):   # (a failure below must not strand a part on h1)
        tb("down", name, check=False)
    assert r.returncode != 0
    assert "h3" in r.stderr and f"{USER} is not root, and sudo -n refused" in r.stderr, r.stderr
    assert f"allow {USER} passwordless sudo (NOPASSWD)" in r.stderr, r.stderr
    assert not controller.exists(name)
    assert leftovers(emu, "h1", name) == leftovers(emu, "h3", name) == []
