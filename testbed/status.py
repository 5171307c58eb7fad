"""What a testbed is now, from its state: the list of testbeds with how each is (up, dead, degraded,
removing), and `testbed status --json`'s document (nodes with their addresses, links with the
profiles they run at, faults, what is missing)."""

from __future__ import annotations

from typing import Any

from testbed import store
from testbed.errors import StateError
from testbed.lifecycle import BUILDING, REMOVING, UP, health, process_alive
from testbed.net import names
from testbed.topology.model import LinkProfile


def list_testbeds() -> list[dict[str, Any]]:
    out = []
    for name in store.list_names():
        try:
            st = store.load(name)
        except StateError:
            out.append({"name": name, "status": "untrusted state (testbed cleanup)"})
            continue
        topo = st.get("topology", {})
        nodes = topo.get("nodes", [])
        status_ = st.get("status")
        if status_ == BUILDING and not process_alive(st.get("pid"), st.get("pid_start")):
            status_ = "dead (run testbed cleanup)"
        elif status_ == UP and health(st):
            status_ = "degraded: parts missing (testbed status; testbed down)"
        elif status_ == REMOVING and st.get("leftovers"):
            status_ = f"removing: {len(st['leftovers'])} leftover(s) (testbed cleanup)"
        out.append({
            "name": name, "status": status_, "topology": topo.get("name"),
            "workers": sum(1 for n in nodes if n["kind"] == "worker"),
            "switches": sum(1 for n in nodes if n["kind"] == "switch"),
            "links": len(topo.get("links", [])),
            "runtime": st.get("runtime", {}).get("kind"), "created": st.get("created"),
        })
    return out


def status(name: str) -> dict[str, Any]:
    """The `testbed status --json` document."""
    st, topo = store.load_with_topology(name)
    plan = st.get("plan", {})
    addrs: dict[str, list[str]] = {n: [] for n in topo.nodes}
    for sw, sub in plan.get("subnets", {}).items():
        addrs[sw].append(sub["gateway"])
    for lp in plan.get("links", []):
        for side in ("a", "b"):
            p = lp[side]
            if p.get("address"):
                addrs[p["node"]].append(p["address"])
    nodes = [{"name": n.name, "kind": n.kind, "addresses": addrs[n.name], "netns": names.netns(name, n.name)}
             for n in topo.nodes.values()]
    fields = ("bandwidth_bps", "delay_s", "jitter_s", "loss", "queue")
    links = []
    for rec, link in zip(st.get("links", []), topo.links):
        ab, ba = link.ab, link.ba
        if rec.get("profile"):  # changed at run time (testbed link set); nominal (undilated) values
            ab, ba = LinkProfile.from_json(rec["profile"]["ab"]), LinkProfile.from_json(rec["profile"]["ba"])
        d = {"index": rec["index"], "endpoints": [link.a, link.b], "tier": link.tier,
             "ifnames": rec.get("ifnames"), **{k: getattr(ab, k) for k in fields},
             "state": rec.get("state", "up"), "changed": bool(rec.get("profile"))}
        if ab != ba:
            d["reverse"] = {k: getattr(ba, k) for k in fields}
        links.append(d)
    missing = health(st) if st.get("status") == UP else []
    return {
        "name": name, "status": st.get("status") if not missing else "degraded", "missing": missing,
        "topology": topo.name, "runtime": st.get("runtime", {}).get("kind"), "created": st.get("created"),
        "net_admin": bool(st.get("runtime", {}).get("net_admin")),
        "latency_floor_s": st.get("latency_floor_s"), "no_delay_element": st.get("no_delay_element", []),
        "time_dilation": st.get("time_dilation", 1.0), "dilation": st.get("dilation"),
        "nodes": nodes, "links": links, "faults": st.get("faults") or {},
    }
