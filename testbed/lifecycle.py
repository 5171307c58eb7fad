"""Bring testbeds up and down.

The functions every CLI verb (and tests, jobs, faults) call:

    up(topo, name=None, *, progress=None, runtime=None) -> state dict
    running(topo, name=None, **kw)     a `with` block with the testbed up, down afterwards
    down(name) -> None                 down_all() -> [names]
    load(name) -> state dict           runtime_for(state) -> Runtime
    node_netns(state, node) -> netns   health(state) -> [what is missing]
    set_link_state(name, index, "up"|"down") -> None  (records what a fault did)

Beside it: testbed.cleanup (what dead testbeds left), testbed.status (the list of testbeds and
`status --json`), testbed.node_exec (a command inside a node).

`up` is all-or-nothing. It validates and checks capabilities before creating
anything, then writes the state file (status "building", every namespace it
is about to make, its own PID) *before* creating anything, updates it as it
goes (delay-line PIDs, worker records), and on any exception, Ctrl-C or
SIGTERM rolls back everything and removes the state. If the process dies
harder than that (kill -9), `cleanup` finds the state of a "building" testbed
whose process is gone and removes what it lists.

Trust: the state is loaded through testbed.store, which accepts only what
testbed writes (this testbed's namespace names, cgroups under testbed/NAME/,
files under its directory, processes named by PID and start time), and every
mutation holds the testbed's lock. Teardown never forgets: what could not be
removed stays in the state (`leftovers`), `down` fails naming it, `cleanup`
retries. Ownership: lo in every namespace carries the alias
"testbed:NAME:STATE_ROOT", so namespaces without a trusted state are still
recognised as ours (and only those of this state root: tests running side by
side never touch each other); `cleanup` removes only what it can prove.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack, contextmanager, suppress
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from testbed import events, interrupts, paths, procs, store
from testbed.interrupts import checkpoint
from testbed.errors import CapabilityError, StateError, TestbedError
from testbed.net import limits, names, netns
from testbed.topology.model import LinkProfile, Topology

Progress = Callable[[str, int, int], None]

BUILDING, UP, REMOVING = "building", "up", "removing"


# -- small helpers ---------------------------------------------------------------------------------------

class TeardownError(TestbedError):
    """Something a testbed made could not be removed; it stays recorded for `cleanup` to retry."""

    exit_code = 1


def owner_label(name: str) -> str:
    return f"testbed:{name}:{paths.root()}"


def process_alive(pid: Any, start: Any) -> bool:
    """The process (pid, start ticks since boot) still runs: the wall clock plays no part."""
    if isinstance(pid, bool) or not isinstance(pid, int) or isinstance(start, bool) or not isinstance(start, int):
        return False
    return procs.alive(procs.ProcRef(pid, start))


def cores() -> int:
    """CPU cores this process may run on (what time-shared ranks divide)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _runtime_kind(topo: Topology, requested: str | None) -> str:
    from testbed.runtime import DEFAULT_RUNTIME

    return requested or topo.runtime or DEFAULT_RUNTIME


def make_runtime(kind: str, name: str, *, net_admin: bool = False):
    if kind == "bare":
        from testbed.runtime.bare import BareRuntime

        return BareRuntime(name)
    from testbed.runtime import get_runtime

    return get_runtime(kind, name, net_admin=net_admin)


def runtime_for(st: dict[str, Any]):
    return make_runtime(st.get("runtime", {}).get("kind", "bare"), st["name"])


def effective_topology(state: dict[str, Any]) -> Topology:
    """The topology a running testbed's links run at now (emulated units): the state's nominal
    snapshot with the profiles `link set` recorded (st["links"][i]["profile"]) in place."""
    from dataclasses import replace

    topo = Topology.from_json(state["topology"])
    links = list(topo.links)
    for i, rec in enumerate(state.get("links") or []):
        prof = rec.get("profile") if isinstance(rec, dict) else None
        if prof and i < len(links):
            links[i] = replace(links[i], ab=LinkProfile.from_json(prof["ab"]), ba=LinkProfile.from_json(prof["ba"]))
    return replace(topo, links=links)


def load(name: str) -> dict[str, Any]:
    return store.load(name)


def node_netns(st: dict[str, Any], node: str) -> str:
    return names.netns(st["name"], node)


def _profiles(topo: Topology) -> list[tuple[str, LinkProfile]]:
    out = []
    for i, link in enumerate(topo.links):
        out.append((f"links[{i}] {link.a}->{link.b}", link.ab))
        out.append((f"links[{i}] {link.b}->{link.a}", link.ba))
    return out


def _link_records(topo: Topology, plan: Any) -> list[dict[str, Any]]:
    out = []
    for lp in plan.links:
        link = topo.links[lp.index]
        out.append({"index": lp.index, "endpoints": [link.a, link.b], "tier": link.tier, "kind": lp.kind,
                    "ifnames": [lp.a.ifname, lp.b.ifname], "state": "up"})
    return out


def check_capabilities(topo: Topology, caps: Any = None) -> Any:
    """Probe the machine (cached) and refuse, before creating anything, what it cannot emulate."""
    if os.geteuid() != 0:
        raise CapabilityError("testbed up needs root (network namespaces and tc): run it with sudo")
    from testbed.net import capabilities, shaping

    given = caps is not None
    if caps is None:
        caps = capabilities.probe()
    try:
        shaping.check_supported(_profiles(topo), caps)
    except CapabilityError:
        if given or os.environ.get(capabilities.WITHOUT_VAR, "").strip():
            raise   # (what the variable turned off, a second probe would turn off again)
        # A probe on a loaded machine can fail spuriously; ask the kernel once more before refusing.
        caps = capabilities.probe(refresh=True)
        shaping.check_supported(_profiles(topo), caps)
    return caps


# -- up ------------------------------------------------------------------------------------------------

def _raise_open_files_limit(nodes: int) -> None:
    """The build holds a descriptor per namespace at once (linking them): a shell's usual soft limit
    of 1,024 is too few for a k=16 fat-tree's 1,344 nodes. Raise it toward the hard limit, for
    this process only (testbed.net.limits refuses a hard limit that is too low)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nodes + limits.FILES_SLACK
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(hard, want), hard))


def up(topo: Topology, name: str | None = None, *, progress: Progress | None = None,
       runtime: str | None = None, caps: Any = None, allow_gpu_sharing: bool = False,
       time_dilation: float | str | None = None, machine: Any = None, ranks: int | None = None,
       real_ranks: int | None = None,
       net_admin: bool = False, part: Any = None) -> dict[str, Any]:
    """Build testbed `name` (default: the topology's name) from a validated topology. All or nothing.

    time_dilation (a factor >= 1, "auto", "none", None for the topology's own setting, or a
    dilation.Choice made for several hosts by their controller): links
    are built at bandwidth/s and delay*s; the state keeps the topology's nominal profiles, s and
    why it was chosen. machine: the calibrated MachineConstants "auto" accounts the traffic with
    (testbed.jobs.calibration); without them "auto" counts ranks per core only. ranks: how many
    ranks the jobs will run (what "auto" divides the cores by; default one per worker).
    net_admin: workers get CAP_NET_ADMIN (they can then undo their own shaping; off by default).
    real_ranks: how many of the ranks compute (the rest phantoms, `testbed run --real`), for "auto".
    part: this host's part of a testbed over several hosts (testbed.cluster.part.Part, from the
    controller): only its nodes are built, its ends of cut links become tunnels; the state keeps
    the whole topology and the part, so faults and `down` act on what is here.
    """
    from testbed.runtime import gpu
    from testbed.runtime.env import worker_env
    from testbed.topology.dilation import choose as choose_dilation, dilate_topology
    from testbed.net.builder import Builder, cut_lines_here, no_delay_element
    from testbed.topology.plan import plan_network

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    name = name or topo.name

    def here(node: str) -> bool:
        return part is None or part.local(node)

    local_nodes = [n for n in topo.nodes if here(n)]
    local_workers = [w for w in topo.workers if here(w)]
    bad = limits.refusals(limits.check(len(local_nodes), len(local_workers), ranks))
    if bad:
        raise CapabilityError(f"this machine cannot hold {len(topo.nodes)} nodes: " + "; ".join(bad))
    _raise_open_files_limit(len(local_nodes))
    if not names.valid_testbed_name(name):
        raise TestbedError(f"invalid testbed name {name!r}: letters, digits, '.', '_', '-' "
                           "(at most 40, starting with a letter or digit)")
    topo.validate()
    plan = plan_network(topo)
    if part is not None:
        try:
            part.check_against(topo, plan, name)
        except ValueError as exc:
            raise TestbedError(f"this host's part of testbed {name!r} does not fit its topology: {exc}") from None
    if store.exists(name):
        raise StateError(f"a testbed named {name!r} is already up: bring it down first "
                         f"(testbed down {name}) or choose another --name")
    all_ns = [names.netns(name, n) for n in local_nodes]
    clash = [n for n in all_ns if netns.exists(n)]
    if clash:
        raise StateError(f"namespace {clash[0]} already exists (a leftover? try `testbed cleanup`); "
                         "refusing to adopt it")
    gplan = gpu.plan_topology(topo, allow_sharing=allow_gpu_sharing,   # refuses too few GPUs, before anything
                              only=None if part is None else set(local_workers))
    setting = time_dilation if time_dilation is not None else topo.time_dilation
    n_ranks = ranks if ranks is not None else len(topo.workers)
    if real_ranks is not None and not 1 <= real_ranks <= n_ranks:
        raise TestbedError(f"--real-ranks {real_ranks}: between 1 and the {n_ranks} ranks the jobs will run "
                           "(--ranks; default one per worker)")
    from testbed.topology.dilation import Choice

    try:
        # a Choice: made by the controller of a testbed over several hosts, for all of them
        dilation = setting if isinstance(setting, Choice) else \
            choose_dilation(setting, topo, plan, n_gpus=len(gplan.used), n_cpus=cores(), constants=machine,
                            ranks=ranks, real_ranks=real_ranks)
    except ValueError as exc:
        raise TestbedError(f"--time-dilation: {exc}") from None
    factor = dilation.factor
    nominal = topo
    # what the kernel gets; the state keeps `nominal`
    topo = dilate_topology(topo, factor, cap_cpu=dilation.cap_cpu, cap_cores=dilation.cap_cores)
    t0 = time.perf_counter()
    caps = check_capabilities(topo, caps)
    timings["capabilities"] = time.perf_counter() - t0
    from testbed.net.shaping import delay_threshold, floor_of

    floor = floor_of(caps)
    from testbed.net import delay_capacity

    short = delay_capacity.refusals(delay_capacity.check(delay_capacity.lines_needed(topo, caps, part),
                                                         len(local_nodes), len(local_workers)))
    if short:   # (the delay lines are known only now: they depend on the dilation and on sch_netem)
        raise CapabilityError(f"this machine cannot hold testbed {name!r}: " + "; ".join(short))
    kind = _runtime_kind(topo, runtime)
    rt = make_runtime(kind, name, net_admin=net_admin)
    checkpoint("checked")

    # Hold the testbed's lock for the whole build (`down`, faults and `cleanup` wait, or say who
    # holds it), and under it claim the name (a second `up` of the same name fails here): a claim
    # whose state is still empty while nobody holds the lock is one of an `up` that died.
    held = ExitStack()
    held.enter_context(store.lock(name, what="testbed up"))
    try:
        store.claim(name)
    except BaseException:
        held.close()
        raise
    pid = os.getpid()
    st: dict[str, Any] = {
        "name": name,
        "status": BUILDING,
        "pid": pid,
        "pid_start": procs.start_ticks(pid),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "state_root": str(paths.root()),
        "owner": owner_label(name),
        "topology": nominal.to_json(),
        "time_dilation": factor,
        "dilation": dilation.to_json(),
        "gpu": {**gplan.to_json(), "mps_daemon": None},
        "plan": plan.to_json(),
        "capabilities": caps.to_json() if hasattr(caps, "to_json") else None,
        "latency_floor_s": floor,
        "no_delay_element": no_delay_element(topo, caps),
        "delay_threshold_s": delay_threshold(caps),
        "runtime": {"kind": kind, "net_admin": bool(net_admin),
                    "workers": {w: {"netns": names.netns(name, w)} for w in local_workers}},
        "links": _link_records(topo, plan),
        "resources": {
            "switch_netns": [names.netns(name, s) for s in topo.switches if here(s)],
            "worker_netns": [names.netns(name, w) for w in local_workers],
            # (over several hosts, without netem) a namespace per delayed cut link whose line is here
            "cut_netns": [names.cut_netns(name, i) for i in cut_lines_here(topo, caps, part)],
            "delay_lines": [],
        },
        "timings": timings,
    }
    if part is not None:
        st["part"] = part.to_json()

    saved = [time.monotonic()]

    def record(kind_: str, item: Any) -> None:
        # Kept in memory at once (a rollback reads st); written at most once a second, and after the
        # links: at k=16 the 3.2 MB state written once per delay line took ~480 s of a 574 s up. A
        # kill -9 in between leaves the last second's lines out of the file, not unfound: each engine
        # names itself in a pid file before it serves a line (testbed.net.delayline), which cleanup reads.
        if kind_ == "delay_line":
            st["resources"]["delay_lines"].append(item)
            if time.monotonic() - saved[0] >= 1.0:
                store.save(name, st)
                saved[0] = time.monotonic()

    signals = interrupts.Handlers()   # SIGTERM and SIGHUP roll back like Ctrl-C
    builder = Builder(name, topo, plan, caps, record=record, owner_label=owner_label(name), progress=progress,
                      part=part, dilation=factor)
    pending = None
    try:
        store.save(name, st)
        t0 = time.perf_counter()
        workers = [topo.nodes[w] for w in local_workers]
        if progress:
            progress("worker namespaces", 0, len(workers))
        rt.prepare_many([(node, names.netns(name, node.name)) for node in workers])
        if progress:
            progress("worker namespaces", len(workers), len(workers))
        timings["worker namespaces"] = time.perf_counter() - t0
        checkpoint("workers")
        # The workers' inits start now and come up while the fabric is built (they need only
        # their namespace); their records are saved at once so cleanup finds them after kill -9.
        t0 = time.perf_counter()
        hosts = plan.hosts()
        mps = None
        if gplan.mps:
            mps = gpu.start_mps(paths.directory(name))
            st["gpu"]["mps_daemon"] = mps
            store.save(name, st)
        batch = []
        for node in workers:
            ifs = [p.ifname for p in plan.ports(node.name)]
            env = worker_env(name, node.name, ifs, cpus=node.cpus, gpu_env=gplan.env(node.name, mps),
                             extra={"TESTBED_TIME_DILATION": repr(factor)})
            batch.append((node, names.netns(name, node.name), env, hosts))
        if progress:
            progress("workers", 0, len(workers))
        pending = rt.begin_start_many(batch)
        for (node, ns, _env, _hosts), rec in zip(batch, pending.records):
            st["runtime"]["workers"][node.name] = {"netns": ns, **rec}
        store.save(name, st)
        t_launch = time.perf_counter() - t0
        builder.create_switch_namespaces()
        checkpoint("switches")
        builder.set_worker_sysctls()
        builder.create_links()
        store.save(name, st)   # every delay line recorded (record() writes at most once a second)
        checkpoint("links")
        builder.configure()
        builder.wait_ready()
        checkpoint("configured")
        t0 = time.perf_counter()
        recs, pending = pending.finish(), None
        for (node, ns, _env, _hosts), rec in zip(batch, recs):
            st["runtime"]["workers"][node.name] = {"netns": ns, **(rec or {})}
        # (saved with the status below: nothing but this process's memory changes in between)
        if progress:
            progress("workers", len(workers), len(workers))
        t0 -= t_launch  # launching + waiting; the inits' own start-up overlapped the fabric
        timings["start workers"] = time.perf_counter() - t0
        checkpoint("started")   # (also: the last chance for a swallowed TERM to roll back)
        timings.update(builder.timings)
        timings["total"] = time.perf_counter() - t_start
        st["status"] = UP
        st["timings"] = timings
        store.save(name, st)
        events.emit(name, "up", f"up: {len(topo.workers)} workers, {len(topo.switches)} switches, "
                    f"{len(topo.links)} links, runtime {kind}, time dilation {dilation.factor:g} "
                    f"({timings['total']:.1f} s)", workers=len(topo.workers), switches=len(topo.switches),
                    links=len(topo.links))
        return st
    except BaseException:
        signals.ignore_during_rollback()
        if pending is not None:
            with suppress(Exception):
                pending.abort()
        remove_recorded(st)   # what it cannot remove stays recorded for `cleanup`
        raise
    finally:
        signals.finish()
        held.close()


@contextmanager
def running(topo: Topology, name: str | None = None, **kw: Any) -> Iterator[dict[str, Any]]:
    """A testbed that is up for the `with` block and down after it, whatever happens in it (the
    calibration, benchmarks, scripts). Yields its state; keyword arguments go to `up`."""
    st = up(topo, name, **kw)
    try:
        yield st
    finally:
        if store.exists(st["name"]):
            down(st["name"])


# -- down / cleanup ----------------------------------------------------------------------------------------

def remove_recorded(st: dict[str, Any], refused: list[str] | None = None) -> list[str]:
    """Remove everything a validated state (complete or half-built) lists. Idempotent.

    Every step runs even when an earlier one failed; what could not be removed is returned and
    stays recorded in the state (status "removing", `leftovers`) for `cleanup` to retry. With
    nothing left, the state goes too. Entries a second proof says are not ours (a PID whose pid
    file or namespace disagrees) are not acted on and go to `refused`, to be reported."""
    from testbed.net.teardown import delete_namespaces, kill_processes_in, teardown
    from testbed.runtime import cgroups

    name = st["name"]
    left: list[str] = []
    refused = refused if refused is not None else []
    res = st.get("resources", {})
    workers = st.get("runtime", {}).get("workers", {})
    if workers:
        try:
            rt = runtime_for(st)
            rt.remove_many(list(workers.items()))
        except Exception:   # each worker on its own, so one failure keeps no other alive
            left += _each(lambda item: runtime_for(st).remove(*item), workers.items(),
                          lambda item: f"worker {item[0]}")
    for node, rec in ((st.get("faults") or {}).get("nodes") or {}).items():
        if rec.get("cgroup"):   # a straggler group `node slow` made itself
            left += _each(lambda paths_: cgroups.remove(paths_, kill=True), [rec["cgroup"]],
                          lambda _p: f"cgroup of node {node} (node slow)")
    # groups the state had no time to record (an `up` killed between making them and saving):
    # testbed/NAME/ and NAME.faults/ are ours by name
    left += _each(lambda group: cgroups.remove(group, kill=True), cgroups.groups_of(name),
                  lambda group: f"cgroup {group[0]}")
    mps = (st.get("gpu") or {}).get("mps_daemon")
    if mps:
        from testbed.runtime import gpu

        try:
            gpu.stop_mps(mps)
        except gpu.NotOurs as exc:
            refused.append(str(exc))
        except Exception as exc:
            left.append(f"MPS daemon (pid {mps['pid']}): {exc}")
    try:
        left += teardown(list(res.get("switch_netns", [])) + list(res.get("cut_netns", [])),
                         list(res.get("delay_lines", [])),
                         str(paths.directory(name)), refused)
    except Exception as exc:
        left.append(f"switch namespaces and delay lines: {exc}")
    rest = [n for n in res.get("worker_netns", []) + res.get("switch_netns", []) + res.get("cut_netns", [])
            if netns.exists(n)]
    if rest:
        kill_processes_in(rest)
        delete_namespaces(rest)
        left += [f"namespace {n}" for n in rest if netns.exists(n)]
    if (st.get("part") or {}).get("tunnels"):
        # this host's tunnel ends let their peers in through a filter of ours (testbed.net.underlay_filter)
        from testbed.net import underlay_filter

        try:
            underlay_filter.remove_testbed(name)
        except Exception as exc:
            left.append(f"underlay filter of the tunnel ends: {exc}")
    if left:
        st["status"] = REMOVING
        st["leftovers"] = [{"what": w, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
                           for w in left]
        with suppress(StateError):
            store.save(name, st)
    else:
        store.remove(name)
    return left


def _each(fn: Callable[[Any], Any], items: Any, what: Callable[[Any], str]) -> list[str]:
    """fn(item) for every item; the failures as 'what: error' (never stops at the first)."""
    out = []
    for item in items:
        try:
            fn(item)
        except Exception as exc:
            out.append(f"{what(item)}: {exc}")
    return out


def down(name: str) -> list[str]:
    """Remove testbed `name`; TeardownError (after removing all it could) names what is left.
    Returns the state's entries that were not acted on (not ours by a second proof), to report."""
    with store.lock(name, what="testbed down"):
        st = store.load(name)
        if st.get("status") == BUILDING and process_alive(st.get("pid"), st.get("pid_start")) \
                and st.get("pid") != os.getpid():
            raise StateError(f"testbed {name!r} is still being brought up (pid {st.get('pid')}); "
                             "wait for it, or interrupt that `testbed up`")
        st["status"] = REMOVING
        store.save(name, st)
        events.emit(name, "down", "down: removing the testbed (its event stream ends here)")
        refused: list[str] = []
        left = remove_recorded(st, refused)
    if left:
        raise TeardownError(f"testbed {name!r} is down, but {len(left)} thing(s) could not be removed: "
                            + "; ".join(left[:5]) + (" ..." if len(left) > 5 else "")
                            + ". They stay recorded: `testbed cleanup` tries again"
                            + (f" (not acted on, not ours: {'; '.join(refused)})" if refused else ""))
    return refused


def down_all() -> list[str]:
    done = []
    for name in store.list_names():
        try:
            down(name)
            done.append(name)
        except StateError:
            pass
    return done


def health(st: dict[str, Any]) -> list[str]:
    """What a testbed that says it is up is missing (empty: healthy)."""
    missing = []
    res = st.get("resources", {})
    for ns in res.get("switch_netns", []) + res.get("worker_netns", []) + res.get("cut_netns", []):
        if not netns.exists(ns):
            missing.append(f"namespace {ns}")
    engines: dict[tuple[Any, Any], bool] = {}   # k=16: 3,072 lines, 2 engines: each looked at once
    for rec in res.get("delay_lines", []):
        key = (rec.get("pid"), rec.get("start"))
        if key not in engines:
            engines[key] = process_alive(*key)
        if not engines[key]:
            missing.append(f"delay line of link {rec.get('link')} (pid {rec.get('pid')})")
    return missing


# -- status ------------------------------------------------------------------------------------------------

def set_link_state(name: str, index: int, link_state: str) -> None:
    with store.lock(name, what="link state"):
        st = store.load(name)
        st["links"][index]["state"] = link_state
        store.save(name, st)
