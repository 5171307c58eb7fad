"""The agent (testbed.agent): its protocol, its loop, and a real testbed changed through it.

The protocol and the controller's reading of replies are pure logic (a host's reply is hostile
input: each refusal is tested with the line a host could send). The loop runs in process on byte
streams; the last tests run `testbed agent` as a process against a real star testbed, as a
controller does over SSH, and check the testbed's own record afterwards.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.agent import protocol
from testbed.agent.serve import LINE_MAX, serve

REPO = Path(__file__).resolve().parent.parent
IS_ROOT = os.geteuid() == 0


def _req(**fields):
    return protocol.request(fields)


# -- requests -----------------------------------------------------------------------------------------------


def test_a_request_round_trips_through_its_line():
    req = _req(op="link.set", name="tb1", a="s0", b="s1", changes={"bandwidth_bps": 1e8}, direction="A->B")
    again = protocol.read_request(protocol.request_line(req))
    assert again == req and again.changes == {"bandwidth_bps": 1e8}


@pytest.mark.parametrize("line, where", [
    ('{"op": "rm", "name": "tb1"}', "rm"),                                        # no such op
    ('{"op": "status", "name": "../etc"}', "name"),                               # not a testbed's name
    ('{"op": "status", "name": "tb1", "extra": 1}', "extra"),                    # a field the op lacks
    ('{"op": "link.down", "name": "tb1", "a": "s0"}', "b"),                       # a field missing
    ('{"op": "link.down", "name": "tb1", "a": "s0;rm", "b": "s1"}', "a"),        # not a node's name
    ('{"op": "link.set", "name": "tb1", "a": "s0", "b": "s1", "changes": {"mtu": 9000}}', "changes"),
    ('{"op": "link.set", "name": "tb1", "a": "s0", "b": "s1", "changes": {"delay_s": Infinity}}', "changes"),
    ('{"op": "link.set", "name": "tb1", "a": "s0", "b": "s1", "changes": {}}', "changes"),
    ('{"op": "node", "name": "tb1", "verb": "reboot", "node": "w0"}', "verb"),
    ('{"op": "node", "name": "tb1", "verb": "slow", "node": "w0", "cpus": -1}', "cpus"),
    ('[1, 2]', "request"),
    ('not json', "request"),
])
def test_a_request_out_of_protocol_is_refused_naming_its_field(line, where):
    with pytest.raises(protocol.ProtocolError, match=where):
        protocol.read_request(line)


# -- replies: what a host sends is hostile ---------------------------------------------------------------------

LINK = {"index": 0, "endpoints": ["s0", "s1"], "tier": "core", "state": "up", "down_by": [],
        "ab": {"bandwidth_bps": 1e9, "delay_s": 0.001}, "ba": {"bandwidth_bps": 1e9}, "changed": False}


def test_a_reply_value_is_checked_against_its_op():
    assert protocol.read_reply("link.down", '{"ok": true, "value": true}') is True
    assert protocol.read_reply("link.up", '{"ok": true, "value": ["node:s1"]}') == ["node:s1"]
    (rec,) = protocol.read_reply("link.show", json.dumps({"ok": True, "value": [LINK]}))
    assert rec.endpoints == ["s0", "s1"] and rec.ab.delay_s == 0.001
    st = protocol.read_reply("status", '{"ok": true, "value": {"name": "tb1", "status": "up", "nodes": []}}')
    assert st.status == "up" and st.model_dump()["nodes"] == []   # the rest passed on as given, for --json


@pytest.mark.parametrize("op, value", [
    ("link.down", "yes"),                                              # not a bool
    ("link.up", ["x" * 5000]),                                         # a reason over its bound
    ("link.show", [dict(LINK, endpoints=["s0", "[red]x[/]"])]),        # not a node's name
    ("link.show", [dict(LINK, ab={"loss": 7})]),                      # loss over 1
    ("link.show", [dict(LINK, ab={"delay_s": -1})]),
    ("node", -3),
    ("status", {"name": "tb1"}),                                       # no status
    ("status", {"name": "tb1", "status": "up", "links": "all"}),
    ("partition", [["w0", "w1;reboot"]]),
])
def test_a_reply_of_the_wrong_shape_is_refused(op, value):
    with pytest.raises(protocol.ProtocolError, match=op):
        protocol.read_reply(op, json.dumps({"ok": True, "value": value}))


def test_a_refusal_carries_the_hosts_words_and_a_bounded_exit_status():
    with pytest.raises(protocol.Refused) as exc:
        protocol.read_reply("link.down", '{"ok": false, "error": "no link s0-s9", "exit_code": 2}')
    assert str(exc.value) == "no link s0-s9" and exc.value.exit_code == 2
    with pytest.raises(protocol.Refused) as exc:
        protocol.read_reply("link.down", '{"ok": false, "error": "x", "exit_code": 1000}')
    assert exc.value.exit_code == 1
    with pytest.raises(protocol.ProtocolError):
        protocol.read_reply("link.down", '{"ok": "maybe"}')


def test_the_first_line_must_be_an_agent_of_this_protocol():
    assert protocol.read_hello(protocol.hello())
    for line in ('{"agent": 2, "version": "1"}', '{"version": "1"}', "Usage: testbed [OPTIONS]"):
        with pytest.raises(protocol.ProtocolError):
            protocol.read_hello(line)


# -- the controller's reading of a host's whole answer -----------------------------------------------------------


def _result(stdout, rc=0, stderr=""):
    from testbed.cluster.remote import RemoteResult

    return RemoteResult(rc=rc, stdout=stdout, stderr=stderr, host="h1", argv=("testbed", "agent"))


def test_answers_per_request_in_order_and_a_missing_one_is_a_failure():
    from testbed.cluster.agents import HostFailed, _answers

    reqs = [_req(op="link.down", name="tb1", a="s0", b="s1"), _req(op="heal", name="tb1")]
    out = _answers("h1", reqs, _result(protocol.hello() + '\n{"ok": true, "value": false}\n'))
    assert out[0] is False and isinstance(out[1], HostFailed) and "no answer to heal" in out[1].why


def test_a_host_without_the_agent_is_told_to_install_this_version():
    from testbed.cluster.agents import HostFailed, _answers

    (out,) = _answers("h1", [_req(op="heal", name="tb1")],
                      _result("", rc=2, stderr="Usage: testbed ...\nError: No such command 'agent'.\n"))
    assert isinstance(out, HostFailed) and "testbed install" in out.why and out.host == "h1"


def test_hosts_failed_names_each_hosts_word_and_where_it_was_done():
    from testbed.cluster.agents import HostFailed
    from testbed.handle.hosts import HostsFailed

    err = HostsFailed({"h2": HostFailed("h2", "no link s0-s9", 2), "h3": HostFailed("h3", "no link s0-s9", 2)},
                      ["h1"])
    assert str(err) == "no link s0-s9 (on h2, h3); done on h1" and err.exit_code == 2


# -- the loop ---------------------------------------------------------------------------------------------------


def _serve(text: bytes) -> list[dict]:
    out = io.StringIO()
    serve(io.BytesIO(text), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_the_loop_says_hello_and_answers_each_line_even_after_a_bad_one(state_dir):
    lines = _serve(b'not json\n\n{"op": "status", "name": "nosuch"}\n' + b"x" * (LINE_MAX + 10) + b"\n")
    assert lines[0]["agent"] == protocol.PROTOCOL
    bad, missing, long = lines[1:]
    assert (bad["ok"], bad["exit_code"]) == (False, 2) and "request" in bad["error"]
    assert missing["ok"] is False and "nosuch" in missing["error"] and missing["exit_code"] >= 1
    assert long["ok"] is False and "over" in long["error"]


# -- a real testbed, through `testbed agent` -------------------------------------------------------------------


def _agent(name: str, requests: list[dict]) -> list[dict]:
    text = "".join(json.dumps(r) + "\n" for r in requests)
    r = subprocess.run([sys.executable, "-m", "testbed", "agent", name], input=text, capture_output=True, text=True,
                       cwd=REPO, env=os.environ, timeout=120)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()][1:]


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_a_star_changed_through_the_agent_as_a_controller_would(testbed):
    from testbed.faults import control
    from testbed.topology.loader import load_topology

    st = testbed(load_topology("star", ["params.n=3", "tiers.host.delay=0"]))
    name = st["name"]
    down, show, refused, up, status, other = _agent(name, [
        {"op": "link.down", "name": name, "a": "w0", "b": "s0"},
        {"op": "link.show", "name": name},
        {"op": "link.down", "name": name, "a": "w0", "b": "w1"},
        {"op": "link.up", "name": name, "a": "w0", "b": "s0"},
        {"op": "status", "name": name},
        {"op": "status", "name": "another"},
    ])
    assert down == {"ok": True, "value": True}
    states = {frozenset(rec.endpoints): rec.state for rec in protocol.read_reply("link.show", json.dumps(show))}
    assert states[frozenset(("w0", "s0"))] == "down", states
    assert refused["ok"] is False and refused["exit_code"] == 2 and "w1" in refused["error"]
    assert up == {"ok": True, "value": []}
    assert protocol.read_reply("status", json.dumps(status)).status == "up"
    assert all(rec["state"] == "up" for rec in control.link_show(name))
    assert other["ok"] is False and "serves testbed" in other["error"]   # (one agent, one testbed)


# -- streams -----------------------------------------------------------------------------------------------------


def test_a_streams_items_come_before_its_reply_and_are_checked():
    from testbed.cluster.agents import HostFailed, Streamed, _answers

    reqs = [_req(op="events", name="tb1"), _req(op="heal", name="tb1")]
    rec = {"t": 1.0, "kind": "link", "what": "link down s0 s1", "by": "me"}
    out = _answers("h1", reqs, _result("\n".join([protocol.hello(), json.dumps({"item": rec}),
                                                   '{"ok": true, "value": {"skipped": 3}}',
                                                   '{"ok": true, "value": true}'])))
    assert isinstance(out[0], Streamed) and out[0].end.skipped == 3 and out[1] is True
    assert out[0].items[0].model_dump() == rec   # (its other fields passed on as given)
    bad = {"t": True, "kind": "link", "what": "x"}   # a bool is no time
    (out,) = _answers("h1", reqs[:1], _result(protocol.hello() + "\n" + json.dumps({"item": bad})))
    assert isinstance(out, HostFailed) and "item" in out.why


def test_an_item_where_no_stream_is_or_a_line_after_the_last_answer_breaks_the_host():
    from testbed.cluster.agents import HostFailed, _answers

    (out,) = _answers("h1", [_req(op="heal", name="tb1")],
                      _result(protocol.hello() + '\n{"item": {"t": 1, "kind": "up", "what": "up"}}\n'
                              '{"ok": true, "value": true}'))
    assert isinstance(out, HostFailed) and "no stream" in out.why
    (out,) = _answers("h1", [_req(op="heal", name="tb1")],
                      _result(protocol.hello() + '\n{"ok": true, "value": true}\n{"ok": true, "value": true}'))
    assert out is True   # (answered before it said too much: what came after is the host's problem)


def test_the_event_kinds_are_the_streams_own():
    from testbed import events

    assert protocol.EVENT_KINDS == events.KINDS


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root (namespaces, tc)")
def test_events_followed_through_the_agent_end_when_its_stdin_closes(testbed):
    """What a controller does for `events -f` across hosts: the request, then stdin kept open; the
    history and each new event come as items; closing stdin (a Ctrl-C passed on) ends the stream
    with its reply, and the agent with it."""
    from testbed.faults import control
    from testbed.topology.loader import load_topology

    name = testbed(load_topology("star", ["params.n=2", "tiers.host.delay=0"]))["name"]
    agent = subprocess.Popen([sys.executable, "-m", "testbed", "agent", name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO, env=os.environ)
    try:
        agent.stdin.write(json.dumps({"op": "events", "name": name, "kinds": ["up", "link"], "follow": True}) + "\n")
        agent.stdin.flush()
        assert protocol.read_hello(agent.stdout.readline())
        assert json.loads(agent.stdout.readline())["item"]["kind"] == "up"
        control.link_down(name, "w0", "s0")
        item = json.loads(agent.stdout.readline())["item"]
        assert (item["kind"], item["what"].split()[:2]) == ("link", ["link", "down"]), item
        agent.stdin.close()
        assert json.loads(agent.stdout.readline()) == {"ok": True, "value": {"skipped": 0}}
        assert agent.wait(timeout=10) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_a_hung_scenarios_stacks_come_from_every_hosts_agent(monkeypatch):
    """What a scenario across hosts saves when its job hangs: each host's ranks' stacks as its agent
    answered them, rendered; a host that failed says why."""
    from testbed.cluster import agents, scenario
    from testbed.cluster.agents import HostFailed

    rank = protocol.RankDoc(pid=7, rank=0, worker="w0", frames=[
        protocol.Frame(function="all_reduce", file="/x/torch/distributed/distributed_c10d.py", line=1)])
    monkeypatch.setattr(agents, "ask", lambda name, reqs, **kw: {"h1": [[rank]], "h2": [HostFailed("h2", "no py-spy")],
                                                                 "h3": [[]]})
    text = scenario._stacks("tb1")
    assert "== host h1 ==" in text and "all_reduce" in text
    assert "== host h2 ==\nno py-spy" in text and "== host h3 ==\nno rank of a job is running" in text


def test_a_bad_value_for_the_hosts_names_its_field_before_any_host_is_asked(monkeypatch):
    from testbed.cluster import agents
    from testbed.handle.hosts import HostsFailed, HostsTestbed
    from testbed.running import FaultError

    tb = HostsTestbed.__new__(HostsTestbed)
    tb.name, tb.hosts, tb._record = "tb1", ("h1",), {"placement": {"w0": "h1"}}
    monkeypatch.setattr(agents, "ask", lambda *a, **k: pytest.fail("a host was asked"))
    with pytest.raises(FaultError, match=r"^a: String should match pattern .*\(got 'w0;reboot'\)"):
        tb.link_down("w0;reboot", "s0")
    assert HostsFailed({}, []).exit_code == 1   # (no host's word: a failure all the same)
