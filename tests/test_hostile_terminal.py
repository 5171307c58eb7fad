"""What ranks and hosts say, on its way to the operator's terminal (issue #23).

A rank's line or a remote host's stdout and stderr can hold Rich markup (`[/tmp]` is a closing tag
to Rich: printed as markup it raises MarkupError and the command dies in its error handler) and
escape sequences (OSC to retitle the terminal or fill the clipboard, CSI to clear the screen, a
carriage return to overwrite what was said). Every verb that shows such text shows it as written
and inert (testbed.terminal). The consoles here are real Rich consoles writing as to a terminal;
only the hosts' answers are stand-ins (pure logic: what a verb does with a host's text).
"""

from __future__ import annotations

import io
import os
from types import SimpleNamespace

import pytest
from rich.console import Console

# a host's or a rank's words: markup, an OSC title, a bell, a screen clear, a carriage return
HOSTILE = "boom [/tmp] [bold red]x[/] \x1b]0;pwned\x07 \x1b[2J\rdone"
SENT = ("\x1b]", "\x07", "\x1b[2J", "\r")   # what must never reach the terminal as sent


def _console() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=300)


def _shown(*consoles: Console) -> str:
    return "".join(c.file.getvalue() for c in consoles)


def _assert_inert(text: str) -> None:
    for seq in SENT:
        assert seq not in text, (seq, text)
    # shown as written: the markup as text, the control characters as \xNN
    # (a carriage return may also have ended a line: str.splitlines() cuts there)
    assert "[/tmp] [bold red]x[/]" in text and "\\x1b]0;pwned\\x07" in text and "\\x1b[2J" in text, text


@pytest.fixture
def consoles(monkeypatch):
    """A real Rich console for stdout and one for stderr, in place of the CLI's, in every module here."""
    from testbed.cli import cleanup, common, events, node, ps, run, scenario, status

    out, err = _console(), _console()
    for mod in (common, cleanup, events, node, ps, run, scenario, status):
        if hasattr(mod, "console"):
            monkeypatch.setattr(mod, "console", out)
        if hasattr(mod, "err_console"):
            monkeypatch.setattr(mod, "err_console", err)
    monkeypatch.setattr(common, "err_console", err)
    return out, err


def test_a_scenario_error_from_a_rank_is_shown_as_written(consoles):
    from testbed.cli import scenario
    from testbed.faults.expect import Verdict

    verdict = Verdict(expect=f"no rank says {HOSTILE}", ok=False, measured=None, detail=HOSTILE)
    scenario._print_outcome(SimpleNamespace(outcome="failed", error=HOSTILE, expectations=[verdict]))
    text = _shown(*consoles)
    assert "failed\x1b[0m: boom [/tmp]" in text and "\\x1b[2J\\x0ddone" in text
    _assert_inert(text)


def _spread_testbed(monkeypatch, answers):
    """The CLI's handle of a testbed `tb` over hosts h1 (w0) and h2 (w1), whose agents answer
    `answers(host, request)` (values as the controller reads them: testbed.cluster.agents.ask)."""
    from testbed import handle
    from testbed.cluster import agents
    from testbed.handle.hosts import HostsTestbed
    from testbed.topology.loader import load_topology

    tb = HostsTestbed.__new__(HostsTestbed)
    tb.name, tb.hosts = "tb", ("h1", "h2")
    tb._record = {"placement": {"s0": "h1", "w0": "h1", "w1": "h2"},
                  "topology": load_topology("star", ["params.n=2"]).to_json()}
    monkeypatch.setattr(handle, "open_testbed", lambda name, **kw: tb)

    def ask(name, requests, **kw):
        per_host = requests if isinstance(requests, dict) else {h: requests for h in tb.hosts}
        return {h: [answers(h, r) for r in reqs] for h, reqs in per_host.items()}

    monkeypatch.setattr(agents, "ask", ask)


def _cli(monkeypatch, *argv):
    """The command line as `testbed` runs it (its errors printed by run_app): its exit status."""
    import sys

    from testbed.cli import app, common

    monkeypatch.setattr(common, "require_root", lambda what: None)
    monkeypatch.setattr(sys, "argv", ["testbed", *argv])
    try:
        common.run_app(app.app)
    except SystemExit as exc:
        return exc.code
    return 0


def test_hosts_refusals_of_node_are_shown_as_written(consoles, monkeypatch):
    from testbed.cluster.agents import HostFailed

    _spread_testbed(monkeypatch, lambda h, r: HostFailed(h, HOSTILE, 2) if h == "h2" else None)
    assert _cli(monkeypatch, "node", "down", "w0", "--name", "tb") == 2
    text = _shown(*consoles)
    assert "(on h2); done on h1" in text
    _assert_inert(text)


def test_hosts_process_rows_are_shown_as_written(consoles, monkeypatch):
    from testbed.agent.protocol import ProcessRow
    from testbed.cluster.agents import HostFailed

    row = ProcessRow(node="w1", pid=7, command=HOSTILE, user="root")
    _spread_testbed(monkeypatch, lambda h, r: [row] if h == "h2" else HostFailed(h, HOSTILE))
    assert _cli(monkeypatch, "ps", "--name", "tb") == 1   # (h1 failed: named, h2's rows still shown)
    text = _shown(*consoles)
    assert text.count("[/tmp]") == 2 and "h2" in text
    _assert_inert(text)


def test_hosts_status_is_shown_as_written(consoles, monkeypatch):
    from testbed.agent.protocol import HostStatus
    from testbed.cluster.agents import HostFailed

    st = HostStatus(name="tb", status=HOSTILE, missing=[HOSTILE])
    _spread_testbed(monkeypatch, lambda h, r: st if h == "h2" else HostFailed(h, HOSTILE))
    assert _cli(monkeypatch, "status", "--name", "tb") == 0
    text = _shown(*consoles)
    assert text.count("[/tmp]") == 3 and "lost" in text   # h1 lost (why), h2's status and what it misses
    _assert_inert(text)


def test_hosts_answers_to_cleanup_are_shown_as_written(consoles):
    from testbed.cli import cleanup

    assert cleanup._print_host("h1 (tb)", SimpleNamespace(rc=0, stdout=f"removed {HOSTILE}\n", stderr=""))
    assert not cleanup._print_host("h2 (tb)", SimpleNamespace(rc=1, stdout="", stderr=HOSTILE))
    assert not cleanup._print_host("h3 (tb)", RuntimeError(HOSTILE))
    text = _shown(*consoles)
    assert text.count("[/tmp]") == 3
    _assert_inert(text)


def test_hosts_events_are_shown_as_written(consoles, monkeypatch):
    from testbed.agent.protocol import EventRecord, EventsEnd
    from testbed.cluster.agents import HostFailed, Streamed

    said = {"h1": Streamed([EventRecord(t=1.0, kind="link", what=HOSTILE)], EventsEnd(skipped=2)),
            "h2": HostFailed("h2", HOSTILE)}
    _spread_testbed(monkeypatch, lambda h, r: said[h])
    assert _cli(monkeypatch, "events", "--name", "tb") == 1   # (h2 failed)
    text = _shown(*consoles)
    assert text.count("[/tmp]") == 2 and "h1: 2 line(s)" in text   # h1's event, h2's failure; h1's note
    _assert_inert(text)


def test_ranks_lines_of_a_run_over_hosts_are_shown_as_written(consoles):
    from testbed.cli import run

    run._show_line("h1", f"[w0:r0] {HOSTILE}")
    run._show_line("h1", f"[testbed] {HOSTILE}")
    text = _shown(*consoles)
    assert "[w0:r0] boom" in text and "[testbed h1] boom" in text
    _assert_inert(text)


def test_cp_on_one_remote_host_passes_its_words_on_inert(monkeypatch, capsys):
    from testbed.cluster import controller, cp

    said = SimpleNamespace(rc=0, stdout=HOSTILE + "\n", stderr=HOSTILE + "\n")
    monkeypatch.setattr(controller, "load", lambda tb: {"placement": {"a": "h1", "b": "h1"}})
    monkeypatch.setattr(controller, "run_on_node_host", lambda *a, **k: said)
    assert cp.copy_across("tb", "a:/x", "b:/y") == 0
    got = capsys.readouterr()
    text = got.out + got.err
    assert text.count("[/tmp]") == 2
    _assert_inert(text)


def test_logs_of_a_remote_node_pass_its_words_on_inert(monkeypatch, capsys):
    from testbed.agent.protocol import LogsEnd
    from testbed.cluster import agents
    from testbed.cluster.agents import Streamed

    _spread_testbed(monkeypatch, lambda h, r: Streamed([HOSTILE + "\n"], LogsEnd(shown=1, directory="/d")))
    assert _cli(monkeypatch, "logs", "w1", "--name", "tb") == 0

    def streamed(name, req, on_item, *, hosts=None, **kw):   # logs -f: the output in pieces, as read there
        assert hosts == ["h2"] and req.follow
        for piece in ("é", HOSTILE[:9], HOSTILE[9:]):
            on_item("h2", piece)
        return {"h2": LogsEnd(shown=0, directory=HOSTILE)}
    monkeypatch.setattr(agents, "stream", streamed)
    assert _cli(monkeypatch, "logs", "w1", "-f", "--name", "tb") == 0
    got = capsys.readouterr()
    text = got.out + got.err
    assert text.count("[/tmp]") == 2 and "é" in got.out
    _assert_inert(text)


def test_logs_shows_plain_files_only_and_what_they_hold_inert(tmp_path):
    """testbed logs NODE reads the job's log folder, which the job can fill: a link to a file of
    root's is not followed, a FIFO not waited on, and what the job printed is shown inert."""
    import threading

    from testbed.observe import logs

    d = tmp_path / "logs"
    d.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    (d / "a.log").write_text(f"hello {HOSTILE}\n")
    (d / "b.log").symlink_to(secret)
    os.mkfifo(d / "c.log")
    out = io.BytesIO()
    done = threading.Event()
    box: dict = {}
    threading.Thread(target=lambda: (box.update(n=logs.show(d, out=out)), done.set()), daemon=True).start()
    if not done.wait(20):
        fd = os.open(d / "c.log", os.O_RDWR | os.O_NONBLOCK)   # (releases the blocked reader)
        os.close(fd)
        pytest.fail("testbed logs waited on a FIFO the job made")
    text = out.getvalue().decode()
    assert box["n"] == 1 and "secret" not in text and "hello boom" in text
    _assert_inert(text)
