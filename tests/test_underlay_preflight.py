"""nft is checked before anything is built (testbed/net/underlay_filter.py `usable`): `testbed doctor`
says whether this host can filter its tunnel ends' underlay, and `testbed up --hosts` refuses a host
a cut link joins that cannot, naming it and how to install nft, before any host builds or the
controller records anything (issue #23).

A host without nft is made for real: its testbed runs in a mount namespace of its own where nft is
covered by /dev/null (not executable: not found), so nothing on this machine changes. The
controller's judgement of the answers is pure and is also fed hostile answers.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass

import pytest
import yaml
from cluster_hosts import PINS, REPO, TOPOLOGY, on_host, tb

from testbed.cluster import controller
from testbed.cluster import up as hosts_up
from testbed.net.underlay_filter import INSTALL_HINT


def _without_nft(argv: list[str]) -> list[str]:
    """argv run where nft is not installed: a private mount namespace with every nft covered."""
    nft = shutil.which("nft")
    assert nft is not None
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind /dev/null {shlex.quote(nft)} && exec "$@"', "sh", *argv]


# -- the controller's judgement (pure) -------------------------------------------------------------

@dataclass(frozen=True)
class _Cut:
    host_a: str
    host_b: str


@dataclass(frozen=True)
class _Placement:
    cut_links: tuple[_Cut, ...]


def _doctor(uf: object) -> dict:
    return {"doctor": {"kernel": "6.1", "underlay_filter": uf}}


def test_only_hosts_a_cut_link_joins_need_nft():
    placement = _Placement((_Cut("h1", "h2"),))
    bad = _doctor({"ok": False, "why": f"nft is not installed: {INSTALL_HINT}"})
    answers = {"h1": _doctor({"ok": True, "why": None}), "h2": bad, "h3": bad}   # h3: no tunnel end
    (problem,) = hosts_up._filter_problems(answers, placement)
    assert problem.startswith("h2: a cut link joins it") and "nft is not installed" in problem
    assert problem.count(INSTALL_HINT) == 1, problem   # said once, not twice
    assert hosts_up._filter_problems(answers, _Placement(())) == []   # no cut link: nothing needed


@pytest.mark.parametrize("uf", [None, "ok", {"ok": "true"}, {"ok": 1}, {"why": None}, {"ok": False, "why": 7}])
def test_an_answer_that_does_not_say_ok_is_refused_with_the_hint(uf):
    answers = {"h1": _doctor(uf), "h2": _doctor({"ok": True, "why": None})}
    (problem,) = hosts_up._filter_problems(answers, _Placement((_Cut("h1", "h2"),)))
    assert problem.startswith("h1: ") and INSTALL_HINT in problem and "on h1" in problem, problem


def test_a_hosts_words_are_shown_inert_and_short():
    said = "\x1b]0;owned\x07\x1b[2J[red]x[/]" + "y" * 10_000
    answers = {"h1": _doctor({"ok": False, "why": said}), "h2": _doctor({"ok": True})}
    (problem,) = hosts_up._filter_problems(answers, _Placement((_Cut("h1", "h2"),)))
    assert "\x1b" not in problem and "\x07" not in problem and len(problem) < 800, problem[:200]


def test_a_host_without_answers_is_left_to_its_check_report():
    answers = {"h2": _doctor({"ok": True}), "h1": {"doctor_error": "boom"}}
    assert hosts_up._filter_problems(answers, _Placement((_Cut("h1", "h2"),))) == []


def test_a_doctor_from_before_the_check_is_left_to_the_tunnel_end():
    # the same version built before underlay_filter existed (an install from an older tree): making
    # its tunnel end refuses without nft, with a rollback; this check cannot tell
    answers = {"h1": {"doctor": {"kernel": "6.1"}}, "h2": _doctor({"ok": True})}
    assert hosts_up._filter_problems(answers, _Placement((_Cut("h1", "h2"),))) == []


# -- doctor on this machine -------------------------------------------------------------------------

def _doctor_json(hide_nft: bool) -> dict:
    argv = [sys.executable, "-m", "testbed", "doctor", "--json", "--cached", "--for", ""]
    r = subprocess.run(_without_nft(argv) if hide_nft else argv, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.root
@pytest.mark.requires("nft", "unshare")
def test_doctor_says_whether_the_underlay_filter_works_here():
    assert _doctor_json(False)["underlay_filter"] == {"ok": True, "why": None}
    missing = _doctor_json(True)["underlay_filter"]
    assert missing["ok"] is False and missing["why"] == f"nft is not installed: {INSTALL_HINT}", missing
    r = subprocess.run(_without_nft([sys.executable, "-m", "testbed", "doctor", "--cached", "--for", ""]),
                       capture_output=True, text=True, timeout=300, cwd=REPO, env={"COLUMNS": "250",
                                                                                  "PATH": "/usr/bin:/bin"})
    row = next((ln for ln in r.stdout.splitlines() if "nft (underlay filter)" in ln), "")
    assert " no " in row and "apt-get install nftables" in row and "cut link" in row, r.stdout + r.stderr


# -- up --hosts: a host without nft is refused before anything is built ------------------------------

@pytest.mark.root
@pytest.mark.requires("sshd", "unshare")   # (emulated hosts: multihost, in make test-rest)
def test_up_over_hosts_refuses_a_host_without_nft_before_building(emu, tmp_path):
    doc = yaml.safe_load(emu.hosts_file.read_text())
    for h in doc["hosts"]:
        if h["name"] == "h2":
            h["testbed"] = shlex.join(_without_nft(shlex.split(h["testbed"])))
    hosts = tmp_path / "hosts-h2-without-nft.yaml"
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))

    name = f"nf{uuid.uuid4().hex[:6]}"
    r = tb("up", str(TOPOLOGY), "--name", name, "--hosts", str(hosts), "--known-hosts", str(emu.known_hosts),
           "--time-dilation", "none", *PINS, check=False)
    try:
        text = " ".join(r.stderr.split())
        assert r.returncode != 0, r.stdout + r.stderr
        assert "hosts not ready" in text and "h2: a cut link joins it" in text, r.stderr
        assert "nft is not installed" in text and "apt-get install nftables" in text, r.stderr
        assert "h1: a cut link" not in text, r.stderr   # h1 has nft
        # nothing made: no record here, no namespace and no state on either host
        assert not controller.exists(name)
        for host in ("h1", "h2"):
            assert not [ns for ns in on_host(emu, host, "ip", "netns", "list").stdout.split() if name in ns]
            state = on_host(emu, host, "sh", "-c", "ls -A /run/testbed 2>/dev/null || true").stdout.split()
            assert not [d for d in state if name in d], state
    finally:
        if controller.exists(name):
            tb("down", name, check=False)
