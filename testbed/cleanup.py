"""`testbed cleanup`: what dead testbeds left, removed, and only what is provably ours.

A testbed whose state is valid is removed when its `up` died, when it was being removed, or when
it says it is up but none of its workers' inits runs any more. A state that is not valid is not
acted on: only namespaces labelled ours (lo's alias: testbed:NAME:STATE_ROOT), the delay-line
helpers its pid files name, its cgroups (by name) and labelled containers go. Healthy,
in-progress and running testbeds are left alone."""

from __future__ import annotations

from typing import Any

from testbed import names, paths, store
from testbed.errors import StateError
from testbed.lifecycle import BUILDING, REMOVING, UP, health, process_alive, remove_recorded
from testbed.net import netns


def read_owner(ns: str) -> str | None:
    """lo's alias inside namespace `ns` (our ownership label), or None.

    Read from a thread of its own: `ns` may be another testbed's, and its `down` ends every process
    whose main thread sits in one of its namespaces (/proc/PID/ns/net is the main thread's). A
    cleanup that entered with its main thread was killed with them."""
    from pyroute2 import IPRoute

    def read() -> str | None:
        with IPRoute() as ipr:
            lo = ipr.get_links(ipr.link_lookup(ifname="lo")[0])[0]
            return lo.get_attr("IFLA_IFALIAS")

    try:
        return netns.run_in_netns(ns, read)
    except Exception:
        return None


def _inits_alive(st: dict[str, Any]) -> bool:
    """Any of the workers' init processes still runs (checked by PID and start time)."""
    return any(process_alive(rec.get("pid"), rec.get("starttime"))
               for rec in (st.get("runtime") or {}).get("workers", {}).values())


def cleanup() -> list[tuple[str, str]]:
    """Remove what dead testbeds left; leave healthy, in-progress and running ones alone.

    A testbed whose state is valid is removed when its `up` died, when it was being removed, or
    when it says it is up but none of its workers' inits runs any more (a testbed with live
    inits is kept, even with parts missing: `testbed down` is for that). A state that is not
    valid is not acted on: only namespaces labelled ours and labelled containers go."""
    from testbed.net.teardown import delete_namespaces, kill_processes_in

    removed: list[tuple[str, str]] = []
    keep: set[str] = set()
    base = paths.check_root()
    dirs = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if base.is_dir() else []
    for name in dirs:
        if not names.valid_testbed_name(name):
            continue
        try:
            with store.lock(name, timeout=2.0, what="testbed cleanup"):
                outcome = _cleanup_one(name)
        except StateError as exc:   # busy: an up, down or fault holds it
            keep.add(name)
            removed.append((name, f"kept: {exc}"))
            continue
        if outcome is None:
            keep.add(name)
        else:
            removed.append((name, outcome))
    # Namespaces with our label and no state (or a state we just removed, or one we do not trust).
    labelled: set[str] = set()
    for ns in netns.list_names(names.PREFIX):
        label = read_owner(ns)
        if not label or not label.startswith("testbed:"):
            continue
        _, _, rest = label.partition(":")
        tb, _, root = rest.partition(":")
        if root != str(base) or tb in keep or store.exists(tb) and _trusted(tb):
            continue
        kill_processes_in([ns])
        delete_namespaces([ns])
        removed.append((tb, f"namespace {ns} (labelled ours, no trusted state)"))
        labelled.add(tb)
    for name in dirs:   # what an untrusted state's testbed left that we can prove ours, then the state
        if name not in keep and store.exists(name) and not _trusted(name):
            removed += _remove_provable(name)
            store.remove(name)
            labelled.discard(name)
    for tb in sorted(labelled):   # a testbed known by its labels alone: its groups, by name
        if names.valid_testbed_name(tb) and not store.exists(tb):
            removed += _remove_provable(tb)
    removed += _cleanup_containers(keep, base)
    from testbed.net import underlay_filter

    try:   # tunnel ends' filters of testbeds no longer here, labelled with this state root
        removed += underlay_filter.sweep(keep | {n for n in store.list_names() if _trusted(n)})
    except underlay_filter.FilterError as exc:
        removed.append(("-", f"underlay filters not checked: {exc}"))
    from testbed.net.capabilities import sweep_stale_probes

    removed += [("-", f"namespace {ns} (a capability probe that was killed)") for ns in sweep_stale_probes()]
    return removed


def _remove_provable(name: str) -> list[tuple[str, str]]:
    """Without a trusted state: the delay-line helpers its pid files name (written by us when they
    started, PID and start time) and its cgroups (testbed/NAME/ is ours by name, made 0755 by root)."""
    from testbed.net import delayline
    from testbed.runtime import cgroups

    out = []
    d = paths.directory(name)
    if d.is_dir() and not d.is_symlink():
        n = delayline.stop_all(d)
        if n:
            out.append((name, f"{n} delay-line helper(s) named by their pid files"))
    for group in cgroups.groups_of(name):
        try:
            cgroups.remove(group, kill=True)
            out.append((name, f"cgroup {group[0]}"))
        except OSError as exc:
            out.append((name, f"cgroup {group[0]} could not be removed: {exc}"))
    return out


def _trusted(name: str) -> bool:
    try:
        store.load(name)
        return True
    except StateError:
        return False


def _cleanup_one(name: str) -> str | None:
    """Under the testbed's lock: what was done to it, or None to keep it."""
    sf = paths.state_file(name)
    try:
        st = store.load(name)
    except StateError as exc:
        if not sf.exists() or sf.stat().st_size == 0:   # we hold the lock: its `up` is gone
            store.remove(name)
            return "claimed by an `up` that died before writing its state"
        return f"state not trusted, only what is labelled ours is removed ({exc})"
    status = st.get("status")
    if status == BUILDING and process_alive(st.get("pid"), st.get("pid_start")):
        return None
    if status == UP:
        workers = (st.get("runtime") or {}).get("workers", {}).values()
        if _inits_alive(st):
            return None   # running: kept even with parts missing (`testbed down` removes it)
        if not any(rec.get("pid") for rec in workers) and not health(st):
            return None   # no inits to go by (the bare runtime), and nothing missing
        what = "up, but none of its workers runs any more"
    elif status == REMOVING and st.get("leftovers"):
        what = f"retried {len(st['leftovers'])} leftover(s)"
    else:
        what = f"left {status} by a process that is gone (pid {st.get('pid')})"
    refused: list[str] = []
    left = remove_recorded(st, refused)
    return (what + (f"; still left: {'; '.join(left[:3])}" if left else "")
            + (f"; not acted on, not ours: {'; '.join(refused)}" if refused else ""))


def _cleanup_containers(keep: set[str], base: Any) -> list[tuple[str, str]]:
    """Docker containers labelled ours (this state root) whose testbed has no trusted state."""
    try:
        from testbed.runtime import docker as dk

        if not dk.daemon_available():
            return []
        out = []
        for c in dk.list_containers():
            tb = c.labels.get("testbed.name")
            root = c.labels.get("testbed.state_root")
            if tb and tb not in keep and root in (None, str(base)) and not (store.exists(tb) and _trusted(tb)):
                out += [(tb, f"container {n} (labelled ours, no state)") for n in dk.cleanup_by_label(tb)]
        return out
    except Exception:
        return []
