"""Runtime control of a running testbed: links, nodes, partitions.

Every operation works from the testbed's state file alone (so it works from
any shell), takes effect in a few netlink round trips (well under 100 ms),
and records what it did in the state, under:

  st["links"][i]["state"]        "up" | "down" (lifecycle's field)
  st["links"][i]["down_by"]      why it is down: ["link"], ["node:core1"], ...
  st["links"][i]["profile"]      {"ab": LinkProfile, "ba": LinkProfile} when it differs from the
                                 topology (emulated values, before time dilation)
  st["faults"]["nodes"][NODE]    {"state": "down"|"crashed"|"up", "cpus": x, "cgroup": [...]}
  st["faults"]["partition"]      {"groups": [[w..], ..], "netns": [...]} while partitioned
  st["faults"]["log"]            the last changes (time, what)

Link down/up sets both ends of the link admin down/up in their namespaces.
On switches `ignore_routes_with_linkdown=1` and dead ECMP next hops make
traffic fail over with no control plane; then the switches' routes converge
to the plan's tables for the links down now (`NetworkPlan.switch_routes`;
only the routes that differ are replaced or deleted). Admin-down also flushes
routes and neighbour entries that used the interface, so `up` re-installs
all routes and permanent neighbours on both endpoints (idempotent `replace`).

Shaping changes honour the testbed's time-dilation factor: the user speaks
in emulated units, the kernel gets `dilate(profile, s)`.

A partition drops, in each worker's namespace, packets *arriving* from
workers of other groups (nftables, hook input): traffic vanishes silently
like on a real partition (no EPERM to the sender, as an output drop would).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any, Sequence

from testbed.errors import CapabilityError, TestbedError
from testbed import names, procs, running
from testbed.faults.link_admin import down_reasons, down_set, hold_down, ipr_in, release, sync_routes
from testbed.net import netns
# The running testbed and a worker's CPU limit live below faults/, since a run caps CPUs too; the
# verbs and scenario steps still reach them here.
from testbed.node_cpus import node_restore, node_slow
from testbed.running import FaultError, Handle, locked  # noqa: F401
from testbed.topology.model import LinkProfile

PROFILE_FIELDS = ("bandwidth_bps", "delay_s", "jitter_s", "loss", "queue")
NFT_TABLE = "testbed_partition"
STOP_GRACE_S = 2.0


# -- links ----------------------------------------------------------------------------------------------------------


def _fmt_profile(p: LinkProfile) -> dict[str, Any]:
    return {k: getattr(p, k) for k in PROFILE_FIELDS}


def link_show(name: str) -> list[dict[str, Any]]:
    """Every link: endpoints, tier, state, why it is down, the profile it runs at (emulated units)."""
    h = Handle(name)
    out = []
    for i, link in enumerate(h.topo.links):
        rec = h.st["links"][i]
        ab, ba = h.profiles(i)
        out.append({"index": i, "endpoints": [link.a, link.b], "tier": link.tier,
                    "state": rec.get("state", "up"), "down_by": down_reasons(rec),
                    "ab": _fmt_profile(ab), "ba": _fmt_profile(ba), "changed": bool(rec.get("profile")),
                    "ifnames": rec.get("ifnames")})
    return out


def _delay_line_of(h: Handle, i: int) -> dict[str, Any] | None:
    for rec in h.st.get("resources", {}).get("delay_lines", []):
        if rec.get("link") == i or str(rec.get("link_id")) == str(i):
            return rec
    return None


def _apply_profiles(h: Handle, i: int, new_ab: LinkProfile, new_ba: LinkProfile) -> None:
    """Install new emulated profiles on link i (dilated for the kernel); record them."""
    from testbed.topology.dilation import dilate
    from testbed.net import shaping

    link = h.topo.links[i]
    rec = h.st["links"][i]
    old_ab, old_ba = h.profiles(i)
    s = h.dilation
    caps = h.caps
    dl = _delay_line_of(h, i)
    under = ((h.st.get("part") or {}).get("underlay_s") or {}).get(str(i))   # a cut link: its underlay's latency
    # Refuse before touching anything.
    # end B of a cut link built with a delay line: end A's host holds both directions' delay
    held_there = (dl is None and under is not None and not h.here(link.a)
                  and shaping.link_needs_delay_line(dilate(link.ab, s), dilate(link.ba, s), caps))
    for direction, prof in (("A->B", new_ab), ("B->A", new_ba)):
        if dl is None and not held_there and shaping.needs_delay_line(prof, caps):
            raise CapabilityError(
                f"link {link.a}-{link.b} {direction}: delay {prof.delay_s * 1e3:g}ms needs sch_netem, which this "
                "kernel lacks; without netem only links built with a delay (delay lines) can change their delay")
        if prof.loss > 0 and not caps.can_lose:
            raise CapabilityError("loss needs sch_netem or cls_bpf, and this kernel has neither")
        if under and prof.delay_s * s > shaping.delay_threshold(caps):   # as `up` refuses it
            from testbed.net.tunnels import delay_problem

            why = delay_problem(prof.delay_s * s, float(under))
            if why:
                raise TestbedError(f"link {link.a}-{link.b} {direction} crosses hosts: {why}")

    def sent(p: LinkProfile) -> LinkProfile:
        """As the sending end shapes it: on a cut link, less the underlay's own latency (the builder's rule)."""
        p = dilate(p, s)
        if under and p.delay_s > 0:
            from testbed.net.tunnels import netem_delay_for

            # (the queue is the whole link's, sized before the underlay's share of the delay is cut)
            p = p.with_changes(queue=p.queue_packets(), delay_s=netem_delay_for(p.delay_s, float(under)))
        return p

    for node, ifname, old, new in ((link.a, rec["ifnames"][0], old_ab, new_ab),
                                   (link.b, rec["ifnames"][1], old_ba, new_ba)):
        if old == new or not h.here(node):
            continue
        with ipr_in(h.netns(node)) as ipr:
            shaping.change(ipr, ifname, sent(old), sent(new), caps)
    if dl is not None and ((old_ab.delay_s, old_ab.jitter_s, old_ba.delay_s, old_ba.jitter_s) !=
                           (new_ab.delay_s, new_ab.jitter_s, new_ba.delay_s, new_ba.jitter_s)):
        from testbed.net import delayline

        if dl.get("ns_b") == names.cut_netns(h.name, i):
            # a cut link's one line (on end A's host): both directions, less the underlay's latency
            delayline.update(dl.get("control"), sent(new_ab), sent(new_ba))
        else:
            delayline.update(dl.get("control"), dilate(new_ab, s), dilate(new_ba, s))
    if (new_ab, new_ba) == (link.ab, link.ba):
        rec.pop("profile", None)
    else:
        rec["profile"] = {"ab": new_ab.to_json(), "ba": new_ba.to_json()}


def _directions(direction: str) -> tuple[bool, bool]:
    if direction == "both":
        return True, True
    if direction == "A->B":
        return True, False
    if direction == "B->A":
        return False, True
    raise FaultError(f"--direction must be both, A->B or B->A (got {direction!r})")


def _changed(p: LinkProfile, changes: dict[str, Any]) -> LinkProfile:
    unknown = set(changes) - set(PROFILE_FIELDS)
    if unknown:
        raise FaultError(f"cannot change {', '.join(sorted(unknown))}; fields: {', '.join(PROFILE_FIELDS)}")
    return p.with_changes(**changes)


def link_set(name: str, a: str, b: str, changes: dict[str, Any], direction: str = "both") -> dict[str, Any]:
    """Change link a-b's profile (emulated units: bandwidth_bps, delay_s, jitter_s, loss, queue).

    direction: "both", "A->B" (traffic from a to b) or "B->A". Returns the link as `link_show` does.
    """
    fwd, rev = _directions(direction)
    with locked(name) as h:
        i, _ = h.link(a, b)
        link = h.topo.links[i]
        if (link.a, link.b) != (a, b):   # the user's A is the link's b
            fwd, rev = rev, fwd
        ab, ba = h.profiles(i)
        new_ab = _changed(ab, changes) if fwd else ab
        new_ba = _changed(ba, changes) if rev else ba
        _apply_profiles(h, i, new_ab, new_ba)
        from testbed.faults.scenario import format_changes

        h.log(f"link set {a} {b} {format_changes(changes)} ({direction})")
    return link_show(name)[i]


def link_restore(name: str, a: str, b: str, fields: Sequence[str], direction: str = "both") -> None:
    """Put `fields` of link a-b back to the topology's values (in the given directions)."""
    fwd, rev = _directions(direction)
    with locked(name) as h:
        i, _ = h.link(a, b)
        link = h.topo.links[i]
        if (link.a, link.b) != (a, b):
            fwd, rev = rev, fwd
        ab, ba = h.profiles(i)
        new_ab = ab.with_changes(**{f: getattr(link.ab, f) for f in fields}) if fwd else ab
        new_ba = ba.with_changes(**{f: getattr(link.ba, f) for f in fields}) if rev else ba
        _apply_profiles(h, i, new_ab, new_ba)
        h.log(f"link restore {a} {b} {','.join(fields)} ({direction})")


def link_down(name: str, a: str, b: str) -> bool:
    """Take link a-b down (both ends admin down). False if it was down already."""
    with locked(name) as h:
        i, _ = h.link(a, b)
        old = down_set(h)
        went = hold_down(h, i, "link")
        sync_routes(h, old)
        h.log(f"link down {a} {b}")
        return went


def link_up(name: str, a: str, b: str) -> list[str]:
    """Undo `link down a b`. Returns what still holds it down (e.g. ["node:core1"]); [] if it is up."""
    with locked(name) as h:
        i, rec = h.link(a, b)
        old = down_set(h)
        if release(h, i, "link"):
            sync_routes(h, old, h.topo.links[i].endpoints)
        h.log(f"link up {a} {b}")
        return down_reasons(rec)


def link_reset(name: str, a: str, b: str) -> None:
    """Link a-b back to the topology: its profile, and up (unless a downed node holds it)."""
    with locked(name) as h:
        i, rec = h.link(a, b)
        link = h.topo.links[i]
        _apply_profiles(h, i, link.ab, link.ba)
        old = down_set(h)
        if release(h, i, "link"):
            sync_routes(h, old, link.endpoints)
        h.log(f"link reset {a} {b}")


# -- nodes ----------------------------------------------------------------------------------------------------------


def _kill(refs: Sequence[procs.ProcRef], sig: int, wait: float) -> None:
    """Signal the processes that are still the ones found (PID and start time) and wait up to
    `wait` for them to end. Never reaps: a caller's own child (a test's, a run's rank) keeps its
    exit status for its Popen."""
    for r in refs:
        procs.signal_ref(r, sig)
    deadline = time.monotonic() + wait
    while wait and time.monotonic() < deadline and any(procs.alive(r) for r in refs):
        time.sleep(0.02)


def node_down(name: str, node: str) -> None:
    """A switch: all its links down. A worker: its container stopped, and its links down.

    On a host of a testbed over several hosts (every host is sent the command): the worker is
    stopped only on its own host; each host downs its own ends of the node's links and converges
    its own switches' routes, and records the node down."""
    with locked(name) as h:
        n = h.node(node)
        ns = h.faults()["nodes"].setdefault(node, {})
        if n.is_worker and h.here(node) and ns.get("state") not in ("down", "crashed"):
            rt = running.runtime_of(h)
            rec = running.worker_record(h, node)
            strays = running.strays(h, rt, node, rec)
            try:
                rt.stop(node, rec)
            except NotImplementedError:
                pass
            except Exception as exc:  # a runtime without a running init: nothing to stop
                h.log(f"node down {node}: runtime stop: {exc}")
            _kill(strays, signal.SIGTERM, STOP_GRACE_S)
            _kill(strays, signal.SIGKILL, 1.0)
        old = down_set(h)
        for link in h.topo.links_of(node):
            hold_down(h, h.topo.link_index(link.a, link.b), f"node:{node}")
        sync_routes(h, old)
        ns["state"] = "down"
        ns["since"] = time.time()
        h.log(f"node down {node}")


def node_up(name: str, node: str) -> None:
    """Undo node down/crash: a worker's container started again; its links up. Over several hosts,
    as node_down: the worker restarted on its host, link ends and routes on each."""
    with locked(name) as h:
        n = h.node(node)
        ns = h.faults()["nodes"].setdefault(node, {})
        if n.is_worker and h.here(node) and ns.get("state") in ("down", "crashed"):
            rt = running.runtime_of(h)
            rec = running.worker_record(h, node)
            try:
                new = rt.restart(node, rec)
                if isinstance(new, dict):
                    rec.update(new)
            except NotImplementedError:
                pass   # the bare runtime has nothing to start: the namespace is the node
        old = down_set(h)
        touched: list[str] = []
        for link in h.topo.links_of(node):
            if release(h, h.topo.link_index(link.a, link.b), f"node:{node}"):
                touched += link.endpoints
        sync_routes(h, old, touched)
        ns["state"] = "up"
        ns.pop("since", None)
        h.log(f"node up {node}")


def node_crash(name: str, node: str) -> int:
    """kill -9 of everything in worker `node` (its links stay up). Returns how many processes
    (0 on a host of a testbed over several hosts that does not hold it: it only records the crash)."""
    with locked(name) as h:
        n = h.node(node)
        if not n.is_worker:
            raise FaultError(f"node: {node} is a switch; crash acts on workers (use `node down` for a switch)")
        if not h.here(node):   # on another host, which kills it: the record only, kept the same here
            ns = h.faults()["nodes"].setdefault(node, {})
            ns["state"] = "crashed"
            ns["since"] = time.time()
            h.log(f"node crash {node} (on another host)")
            return 0
        rt = running.runtime_of(h)
        rec = running.worker_record(h, node)
        before = set(netns.pids_in([h.netns(node)]))
        strays = running.strays(h, rt, node, rec)  # in the namespace, unknown to the runtime (nsenter'd)
        try:
            rt.kill(node, rec)  # the runtime decides what a crash kills (docker keeps its init)
        except NotImplementedError:
            strays = running.refs(sorted(before))
        except Exception as exc:
            h.log(f"node crash {node}: runtime kill: {exc}")
        _kill(strays, signal.SIGKILL, 1.0)
        count = len(before - set(netns.pids_in([h.netns(node)])))
        ns = h.faults()["nodes"].setdefault(node, {})
        ns["state"] = "crashed"
        ns["since"] = time.time()
        h.log(f"node crash {node} ({count} processes killed)")
        return count


# -- partitions -------------------------------------------------------------------------------------------------------


def _nft(ns: str, commands: list[dict[str, Any]]) -> subprocess.CompletedProcess:
    """Run nft's JSON commands in a namespace (data, never nft program text: see net/underlay_filter)."""
    return subprocess.run(["nsenter", f"--net={netns.path(ns)}", "--", "nft", "-j", "-f", "-"],
                          input=json.dumps({"nftables": commands}), text=True, capture_output=True, check=False,
                          timeout=10)


def _partition_rules(blocked: list[str]) -> list[dict[str, Any]]:
    """A worker's side of a partition: frames from the other groups' addresses are dropped on input."""
    table = {"family": "ip", "table": NFT_TABLE}
    blocked_set = {**table, "name": "blocked", "type": "ipv4_addr", **({"elem": blocked} if blocked else {})}
    return [
        {"add": {"table": {"family": "ip", "name": NFT_TABLE}}},
        {"add": {"set": blocked_set}},
        {"add": {"chain": {**table, "name": "input", "type": "filter", "hook": "input", "prio": -10,
                           "policy": "accept"}}},
        {"add": {"rule": {**table, "chain": "input", "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": "@blocked"}},
            {"drop": None}]}}},
    ]


_DELETE_PARTITION = [{"delete": {"table": {"family": "ip", "name": NFT_TABLE}}}]


def partition(name: str, groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """Split the workers into groups that cannot reach each other (see the module docstring).

    A switch in a group stands for the workers attached to it; workers in no group form one more
    group. Replaces a partition in place. Returns the groups of workers.
    """
    from testbed.faults.scenario import ScenarioError
    from testbed.faults.scenario_planner import resolve_partition_groups

    with locked(name) as h:
        try:
            resolved = resolve_partition_groups(groups, h.topo, path="partition")
        except ScenarioError as e:
            raise FaultError(str(e)) from None
        _heal(h)
        member = {w: j for j, g in enumerate(resolved) for w in g}
        done = []
        try:
            for w, j in member.items():
                if not h.here(w):
                    continue   # over several hosts: each host filters at its own workers
                blocked = [addr.split("/")[0] for v, k in member.items() if k != j
                           for addr in h.plan.addresses(v)]
                ns = h.netns(w)
                r = _nft(ns, _partition_rules(blocked))
                if r.returncode != 0:
                    raise CapabilityError(f"partition: nft failed in {ns}: {r.stderr.strip()}")
                done.append(ns)
        except BaseException:
            for ns in done:
                _nft(ns, _DELETE_PARTITION)
            raise
        h.faults()["partition"] = {"groups": [list(g) for g in resolved], "netns": done, "since": time.time()}
        h.log("partition " + " | ".join(",".join(g) for g in resolved))
        return [list(g) for g in resolved]


def _heal(h: Handle) -> bool:
    part = h.faults().pop("partition", None)
    if not part:
        return False
    for ns in part.get("netns", []):
        if netns.exists(ns):
            _nft(ns, _DELETE_PARTITION)
    return True


def heal(name: str) -> bool:
    """Undo a partition. False if there was none."""
    with locked(name) as h:
        healed = _heal(h)
        if healed:
            h.log("heal")
        return healed


# -- everything back --------------------------------------------------------------------------------------------------


def restore_all(name: str) -> list[str]:
    """Put the testbed back as its topology describes it: partition healed, nodes up (crashed
    workers restarted), CPU limits restored, every link up with its topology profile.
    Returns what it changed."""
    changed: list[str] = []
    h = Handle(name)
    if h.faults().get("partition"):
        heal(name)
        changed.append("heal")
    for node, ns in sorted(h.faults()["nodes"].items()):
        if ns.get("state") in ("down", "crashed"):
            node_up(name, node)
            changed.append(f"node up {node}")
        if "cpus" in ns or ns.get("cgroup"):
            node_restore(name, node)
            changed.append(f"node restore {node}")
    h = Handle(name)
    for i, link in enumerate(h.topo.links):
        rec = h.st["links"][i]
        if rec.get("profile") or rec.get("state") == "down" or rec.get("down_by"):
            with locked(name) as hh:
                _apply_profiles(hh, i, link.ab, link.ba)
                old = down_set(hh)
                if release(hh, i, None):
                    sync_routes(hh, old, link.endpoints)
                hh.log(f"link reset {link.a} {link.b}")
            changed.append(f"link reset {link.a} {link.b}")
    return changed


def apply_step(name: str, step: Any) -> str:
    """Apply one planned scenario step (testbed.faults.scenario_plan.Step); returns what changed."""
    op, tgt, p = step.op, step.target, step.kwargs
    if op == "link_down":
        link_down(name, *tgt)
    elif op == "link_up":
        left = link_up(name, *tgt)
        if left:
            return step.describe() + f" (still down: {', '.join(left)})"
    elif op == "link_set":
        link_set(name, *tgt, dict(p["changes"]), p.get("direction", "both"))
    elif op == "link_restore":
        link_restore(name, *tgt, p["fields"], p.get("direction", "both"))
    elif op == "link_reset":
        link_reset(name, *tgt)
    elif op == "node_down":
        node_down(name, tgt[0])
    elif op == "node_up":
        node_up(name, tgt[0])
    elif op == "node_crash":
        n = node_crash(name, tgt[0])
        return step.describe() + f" ({n} processes killed)"
    elif op == "node_slow":
        node_slow(name, tgt[0], p["cpus"])
    elif op == "node_restore":
        node_restore(name, tgt[0])
    elif op == "partition":
        partition(name, p["groups"])
    elif op == "heal":
        heal(name)
    else:  # pragma: no cover - the planner makes only the ops above
        raise FaultError(f"unknown step {op!r}")
    return step.describe()
