"""Whether a host can hold part of a testbed, asked over its HostControl: reachable, running this
testbed version, root (directly or through sudo -n), and what its `testbed doctor` says it can and
cannot emulate. One HostReport per host; the checks of several hosts run in parallel."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from testbed import __version__
from testbed.cluster.remote import (HostControl, HostUnreachable, RemoteError, RemoteResult, SudoRefused, run_parallel,
                                    shown_argv, tail_lines)

__all__ = ["HostReport", "check_host", "check_hosts", "report_from_answers"]


@dataclass
class HostReport:
    """What check_host found on one host. `problems`: what stops a testbed from using the host, as
    sentences; `warnings`: what it can do without (links needing it will be refused at `up`)."""

    name: str
    address: str
    reachable: bool = False
    uid: int | None = None               # the uid commands run as (0: root, directly or through sudo)
    sudo: bool | None = None             # commands go through `sudo -n`
    version: str | None = None           # `testbed version` there
    version_info: dict[str, Any] | None = None   # `testbed version --json`, when the host's testbed has it
    doctor: dict[str, Any] | None = None         # `testbed doctor --json`
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.reachable and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _json_object(text: str) -> dict[str, Any] | None:
    """The JSON object in a command's stdout (anything printed before its first '{' is skipped)."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        data = json.loads(text[start:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _outcome(future: Any) -> Any:
    """A check's RemoteResult, or the exception it raised (raised again where it is judged)."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - judged in order by check_host
        return exc


def _answer(ctl: HostControl, argv: list[str], timeout: float, ready: Any) -> RemoteResult:
    if ready is None:
        return ctl.run(argv, timeout=timeout)
    if isinstance(ready, Exception):
        raise ready
    return ready


def _check_version(ctl: HostControl, cmd: list[str], rep: HostReport, expect: str | None, timeout: float,
                   ready: Any = None) -> bool:
    """Fill rep.version; False when testbed is not usable there (nothing more to ask it). ready: the
    answer to `version --json` when it was asked already."""
    r = _answer(ctl, [*cmd, "version", "--json"], timeout, ready)
    if r.rc != 0 and "no such option" in (r.stderr + r.stdout).lower():
        r = ctl.run([*cmd, "version"], timeout=timeout)   # a testbed from before `version --json`
    if r.rc in (126, 127):
        rep.problems.append(f"testbed is not installed on {rep.name} at `{shown_argv(cmd)}` "
                            f"({(tail_lines(r.stderr, 1) or ['not found'])[0]}): `testbed install --hosts FILE` "
                            "installs this controller's version there")
        return False
    if r.rc != 0:
        last = (tail_lines(r.stderr, 1) or tail_lines(r.stdout, 1) or ["no output"])[0]
        rep.problems.append(f"`{shown_argv([*cmd, 'version'])}` failed on {rep.name} (exit status {r.rc}): {last}")
        return False
    info = _json_object(r.stdout)
    if info is not None:
        rep.version_info = info
        rep.version = str(info.get("version")) if info.get("version") is not None else None
    else:
        lines = r.stdout.strip().splitlines()
        rep.version = lines[-1].strip() if lines else None
    if expect is not None and rep.version != expect:
        rep.problems.append(f"{rep.name} runs testbed {rep.version or '(unknown version)'} and this controller "
                            f"{expect}: install the same version there (`testbed install --hosts FILE` "
                            "ships this controller's version)")
    return True


def _check_doctor(ctl: HostControl, cmd: list[str], rep: HostReport, doctor_args: Sequence[str],
                  timeout: float, ready: Any = None) -> None:
    r = _answer(ctl, [*cmd, "doctor", "--json", *doctor_args], timeout, ready)
    doc = _json_object(r.stdout) if r.rc == 0 else None
    if doc is None:
        last = (tail_lines(r.stderr, 1) or tail_lines(r.stdout, 1) or ["no JSON on stdout"])[0]
        rep.problems.append(f"`{shown_argv([*cmd, 'doctor', '--json'])}` failed on {rep.name} "
                            f"(exit status {r.rc}): {last}")
        return
    rep.doctor = doc
    if doc.get("is_root") is False:
        rep.problems.append(f"testbed doctor on {rep.name} does not run as root: namespaces and tc need root")
    for chk in (doc.get("limits") or {}).get("checks") or []:
        if chk.get("ok"):
            continue
        text = (f"{rep.name}: {chk.get('name')}: {chk.get('have')} here, {chk.get('need')} needed "
                f"({chk.get('fix')})")
        (rep.problems if chk.get("blocks_up") else rep.warnings).append(text)
    if doc.get("htb") is False:
        rep.warnings.append(f"{rep.name} has no sch_htb: links with a bandwidth cannot be emulated there")
    if not doc.get("netem") and not doc.get("tun"):
        rep.warnings.append(f"{rep.name} has neither sch_netem nor /dev/net/tun: no link delay there")
    if not doc.get("netem") and not doc.get("bpf"):
        rep.warnings.append(f"{rep.name} has neither sch_netem nor cls_bpf: no link loss there")


def check_host(ctl: HostControl, testbed_cmd: Sequence[str], *, expect_version: str | None = __version__,
               doctor_args: Sequence[str] = (), timeout: float = 120.0) -> HostReport:
    """Is `ctl`'s host usable? Reachable, commands run as uid 0 (as root or through sudo),
    `<testbed_cmd> version [--json]` equal to expect_version (this controller's; None: any) and
    `<testbed_cmd> doctor --json [doctor_args]` parsed. Never raises for what it finds on the host:
    every finding is in the report (problems, warnings)."""
    t0 = time.monotonic()
    rep = HostReport(name=ctl.name, address=str(getattr(ctl, "address", ctl.name)))
    cmd = [os.fspath(w) for w in testbed_cmd]
    try:
        # the three questions at once, on one connection (the answers are judged in order below:
        # an `up` waits for the slowest host's checks)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=2) as pool:
            ahead = {"version": pool.submit(ctl.run, [*cmd, "version", "--json"], timeout=timeout),
                     "doctor": pool.submit(ctl.run, [*cmd, "doctor", "--json", *doctor_args], timeout=timeout)}
            r = ctl.run(["id", "-u"], timeout=min(timeout, 30.0))
            done = {k: _outcome(f) for k, f in ahead.items()}
        _judge(ctl, cmd, rep, r.stdout, done["version"], done["doctor"], expect_version, doctor_args, timeout)
    except HostUnreachable as exc:
        rep.problems.append(str(exc))
    except SudoRefused as exc:
        rep.reachable = True
        rep.sudo = True
        rep.problems.append(str(exc))
    except RemoteError as exc:   # a timeout of one of the checks
        rep.problems.append(str(exc))
    rep.seconds = round(time.monotonic() - t0, 3)
    return rep


def _judge(ctl: HostControl, cmd: list[str], rep: HostReport, uid_text: str, version: Any, doctor: Any,
           expect_version: str | None, doctor_args: Sequence[str], timeout: float) -> None:
    """Fill rep from the answers to `id -u`, `version --json` and `doctor --json` (RemoteResults, or
    the exceptions asking raised)."""
    rep.reachable = True
    rep.sudo = getattr(ctl, "uses_sudo", None)
    try:
        rep.uid = int(uid_text.strip())
    except ValueError:
        rep.problems.append(f"`id -u` on {rep.name} printed {uid_text.strip()[:80]!r}, not a uid")
    if rep.uid is not None and rep.uid != 0:
        rep.problems.append(f"commands on {rep.name} run as uid {rep.uid}, not root: log in as root or allow "
                            "passwordless sudo")
    elif rep.uid == 0 and _check_version(ctl, cmd, rep, expect_version, timeout, version):
        _check_doctor(ctl, cmd, rep, doctor_args, timeout, doctor)


def report_from_answers(ctl: HostControl, testbed_cmd: Sequence[str], answers: Mapping[str, Any], *,
                        expect_version: str | None = __version__, seconds: float = 0.0) -> HostReport:
    """check_host's report from answers a host gave in one go (`testbed part up --check`: {"uid",
    "version" (version --json's document), "doctor" (doctor --json's)}), judged exactly as the
    answers to the separate commands are. Never raises for what the answers say."""
    rep = HostReport(name=ctl.name, address=str(getattr(ctl, "address", ctl.name)), seconds=round(seconds, 3))
    cmd = [os.fspath(w) for w in testbed_cmd]

    def said(key: str) -> RemoteResult:
        value = answers.get(key)
        ok = isinstance(value, dict)
        why = str(answers.get(f"{key}_error") or f"no {key} in the host's answers")
        return RemoteResult(rc=0 if ok else 1, stdout=json.dumps(value) if ok else "", stderr="" if ok else why,
                            host=ctl.name,
                            argv=(*cmd, key, "--json"))

    uid = answers.get("uid")
    _judge(ctl, cmd, rep, str(uid) if isinstance(uid, int) and not isinstance(uid, bool) else repr(uid),
           said("version"), said("doctor"), expect_version, (), 0.0)
    return rep


def check_hosts(ctls: Sequence[HostControl], testbed_cmd: Sequence[str] | Mapping[str, Sequence[str]],
                **kw: Any) -> list[HostReport]:
    """check_host on every host in parallel; reports in the order of `ctls`. testbed_cmd: one command
    for all hosts, or a mapping from host name to its command. kw: check_host's options."""
    def one(ctl: HostControl) -> HostReport:
        cmd = testbed_cmd[ctl.name] if isinstance(testbed_cmd, Mapping) else testbed_cmd
        return check_host(ctl, cmd, **kw)

    reports: list[HostReport] = []
    for ctl, res in zip(ctls, run_parallel(ctls, one)):
        if isinstance(res, Exception):   # a bug in a check, not a finding: still one report per host
            res = HostReport(name=ctl.name, address=str(getattr(ctl, "address", ctl.name)),
                             problems=[f"checking {ctl.name} failed: {type(res).__name__}: {res}"])
        reports.append(res)
    return reports
