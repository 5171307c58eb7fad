"""Mininet's side of bench/perf_verbs.py: the k-ary fat-tree of testbed's generator, and one timed run.

The graph is node for node and link for link the one testbed.topology.generators.fat_tree
builds (k^3/4 hosts, 5k^2/4 switches, 3k^3/4 links, wired in the same order): testbed's
worker w{i} is host h{i+1}; its switches, in the generator's order (edges, then aggregations,
pod by pod, then cores), are s1, s2, ... `fat_tree_graph` needs no Mininet (tests use it).

As a custom topology, the way a user would run it (Linux bridges with STP: the fat-tree has
loops, and without STP it floods; bridge-utils provides the brctl Mininet drives them with):

    sudo mn --custom bench/mininet_fattree.py --topo fattree,4 --switch lxbr,stp=1 \\
        --link tc,bw=1000 --controller none

As the benchmark's timed run (Debian's python3, which has Debian's Mininet), one JSON object
per line on stdout, times in seconds since the start:

    sudo /usr/bin/python3 bench/mininet_fattree.py --k 4 --prefix mqk --timeout 600

  built      Mininet(...).build() returned: every host and switch shell started, every link
             made and shaped (TCLink bw=1000: HTB at 1 Gbit/s, Mininet's maximum)
  started    net.start() returned: every bridge up with STP on
  converged  every port of every bridge is forwarding or blocking (sysfs brif/*/state: no port
             listening, learning or disabled), i.e. STP has settled on a spanning tree
  usable     after that, one round of pings between sampled host pairs (across pods, within a
             pod, within an edge) all answered: "Mininet up" is this event's time
  memory     MemAvailable and Slab before the build and at `usable`; the node shells' RSS/PSS
  stopped    net.stop() returned; stop_s is its duration ("Mininet stop")
  timeout / error / interrupted: why the run ended early (net.stop() still runs)

--prefix goes in front of every node name, so every interface this run makes in the root
namespace (switch ports, bridges) carries it: the bench picks a prefix no interface has, and
anything left with it afterwards is provably this run's. Mininet's own cleanup (`mn -c`) kills
processes by name and is never used. Only process-local limits are raised (as `mn` does:
RLIMIT_NOFILE, RLIMIT_NPROC; every node holds a pty); `mn`'s machine-wide sysctls are not set.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time

PORT_STATES = {0: "disabled", 1: "listening", 2: "learning", 3: "forwarding", 4: "blocking"}


def fat_tree_graph(k: int, prefix: str = "") -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(hosts, switches, links) of the k-ary fat-tree, in testbed's generator order, Mininet names."""
    if k < 2 or k % 2:
        raise ValueError(f"k must be even and >= 2 (got {k})")
    half = k // 2
    hosts: list[str] = []
    switch_of: dict[str, str] = {}   # generator name -> Mininet name

    def sw(name: str) -> str:
        if name not in switch_of:
            switch_of[name] = f"{prefix}s{len(switch_of) + 1}"
        return switch_of[name]

    host_links: list[tuple[str, str]] = []
    ea_links: list[tuple[str, str]] = []
    ac_links: list[tuple[str, str]] = []
    for pod in range(k):
        for i in range(half):
            edge = sw(f"edge{pod}-{i}")
            for _ in range(half):
                h = f"{prefix}h{len(hosts) + 1}"
                hosts.append(h)
                host_links.append((h, edge))
    for pod in range(k):     # the generator's switch order: edges and aggs pod by pod, then cores
        for j in range(half):
            sw(f"agg{pod}-{j}")
    for pod in range(k):
        for i in range(half):
            for j in range(half):
                ea_links.append((sw(f"edge{pod}-{i}"), sw(f"agg{pod}-{j}")))
        for j in range(half):
            for c in range(j * half, (j + 1) * half):
                ac_links.append((sw(f"agg{pod}-{j}"), sw(f"core{c}")))
    return hosts, list(switch_of.values()), host_links + ea_links + ac_links


def _switch_order(k: int) -> list[str]:
    """The generator's switch names in the order fat_tree_graph numbers them."""
    half = k // 2
    return ([f"edge{p}-{i}" for p in range(k) for i in range(half)]
            + [f"agg{p}-{j}" for p in range(k) for j in range(half)]
            + [f"core{c}" for c in range(half * half)])


def generator_names(k: int, prefix: str = "") -> dict[str, str]:
    """Mininet name -> testbed generator name (h1 -> w0, s1 -> edge0-0, ...)."""
    hosts, switches, _ = fat_tree_graph(k, prefix)
    names = {h: f"w{i}" for i, h in enumerate(hosts)}
    names.update(zip(switches, _switch_order(k)))
    return names


def sample_pairs(hosts: list[str], k: int, limit: int = 10) -> list[tuple[str, str]]:
    """Host pairs the `usable` check pings: first to last, across pods, within a pod, within an edge."""
    per_pod = k * k // 4
    pairs = [(hosts[0], hosts[-1]), (hosts[0], hosts[1])]    # first to last; the same edge switch
    if per_pod > k // 2:
        pairs.append((hosts[0], hosts[per_pod - 1]))           # the same pod, another edge
    for p in range(k):                                         # pod p to pod p + k/2
        q = (p + k // 2) % k
        pairs.append((hosts[p * per_pod], hosts[q * per_pod + per_pod - 1]))
    seen: list[tuple[str, str]] = []
    for a, b in pairs:
        if a != b and (a, b) not in seen:
            seen.append((a, b))
    return seen[:limit]


try:   # the Topo for `mn --custom`; the rest of this file works without Mininet
    from mininet.topo import Topo
except ImportError:   # pragma: no cover - Mininet absent (tests, the venv)
    Topo = object


class FatTree(Topo):  # type: ignore[misc, valid-type]
    """k-ary fat-tree, the same graph as testbed's `fat-tree` generator."""

    def build(self, k: int = 4, prefix: str = "") -> None:  # Topo.__init__ passes its arguments here
        hosts, switches, links = fat_tree_graph(int(k), prefix)
        for h in hosts:
            self.addHost(h)
        for s in switches:
            self.addSwitch(s)
        for a, b in links:
            self.addLink(a, b)


topos = {"fattree": FatTree}


# -- the timed run -----------------------------------------------------------------------------------------
def _emit(t0: float, event: str, **kw: object) -> None:
    print(json.dumps({"event": event, "t": round(time.perf_counter() - t0, 4), **kw}), flush=True)


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "Slab", "SUnreclaim", "SReclaimable"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _proc_mem(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes; (0, 0) when it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


def _port_states(bridges: list[str]) -> dict[str, int]:
    counts = {name: 0 for name in PORT_STATES.values()}
    for br in bridges:
        base = f"/sys/class/net/{br}/brif"
        try:
            ports = os.listdir(base)
        except OSError:
            counts["disabled"] += 1   # no bridge (yet): not converged
            continue
        for port in ports:
            try:
                with open(f"{base}/{port}/state") as f:
                    counts[PORT_STATES.get(int(f.read().strip()), "disabled")] += 1
            except (OSError, ValueError):
                counts["disabled"] += 1
    return counts


class _Timeout(Exception):
    pass


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(k: int, prefix: str, timeout: float, poll: float = 0.5) -> int:
    from functools import partial

    from mininet.link import TCLink
    from mininet.log import setLogLevel
    from mininet.net import Mininet
    from mininet.nodelib import LinuxBridge

    t0 = time.perf_counter()
    deadline = t0 + timeout
    setLogLevel("warning")
    for limit, want in ((resource.RLIMIT_NOFILE, 16384), (resource.RLIMIT_NPROC, 8192)):   # as `mn` does
        soft, hard = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(limit, (min(want, hard) if hard != resource.RLIM_INFINITY else want, hard))
    hosts, switches, _links = fat_tree_graph(k, prefix)
    mem0 = _meminfo()
    net = Mininet(topo=FatTree(k=k, prefix=prefix), switch=partial(LinuxBridge, stp=True),
                  link=partial(TCLink, bw=1000), controller=None, autoSetMacs=True, build=False,
                  waitConnected=False)
    rc = 0
    try:
        net.build()
        _emit(t0, "built", hosts=len(net.hosts), switches=len(net.switches), links=len(net.links),
              pids=[[n.name, n.pid] for n in net.hosts + net.switches])
        net.start()
        _emit(t0, "started")
        while True:
            counts = _port_states(switches)
            if not counts["listening"] + counts["learning"] + counts["disabled"]:
                break
            if time.perf_counter() > deadline:
                raise _Timeout(f"STP not converged after {timeout:g} s: ports {counts}")
            time.sleep(poll)
        _emit(t0, "converged", ports=counts)
        pairs = sample_pairs(hosts, k)
        while True:
            failed = []
            for a, b in pairs:
                out = net[a].cmd("ping -c1 -W1 -q", net[b].IP())
                if " 1 received" not in out:
                    failed.append(f"{a}->{b}")
            if not failed:
                break
            if time.perf_counter() > deadline:
                raise _Timeout(f"pings still failing {timeout:g} s after the start: {', '.join(failed)}")
            time.sleep(poll)
            counts = _port_states(switches)
        _emit(t0, "usable", pairs=[f"{a}->{b}" for a, b in pairs])
        mem1 = _meminfo()
        host_mem = [_proc_mem(h.pid) for h in net.hosts]
        sw_mem = [_proc_mem(s.pid) for s in net.switches]
        _emit(t0, "memory", before=mem0, after=mem1,
              host_rss=sum(m[0] for m in host_mem), host_pss=sum(m[1] for m in host_mem),
              switch_rss=sum(m[0] for m in sw_mem), switch_pss=sum(m[1] for m in sw_mem),
              self_rss=_proc_mem(os.getpid())[0])
    except _Timeout as exc:
        _emit(t0, "timeout", error=str(exc))
        rc = 3
    except KeyboardInterrupt as exc:
        _emit(t0, "interrupted", error=str(exc) or "interrupted")
        rc = 130
    except Exception as exc:  # noqa: BLE001 - reported to the bench, and the net is still stopped
        _emit(t0, "error", error=f"{type(exc).__name__}: {exc}")
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C must not cut net.stop() short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        t1 = time.perf_counter()
        for node in net.hosts + net.switches:   # a shell interrupted mid-command takes no other
            if node.waiting:
                try:
                    node.waitOutput()
                except Exception:  # noqa: BLE001, S110 - stop() below still tries the rest
                    pass
        try:
            net.stop()
            _emit(t0, "stopped", stop_s=round(time.perf_counter() - t1, 4))
        except Exception as exc:  # noqa: BLE001 - the bench removes what carries the prefix
            _emit(t0, "stop_error", stop_s=round(time.perf_counter() - t1, 4), error=f"{type(exc).__name__}: {exc}")
            rc = rc or 4
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--prefix", default="", help="in front of every node name (letters only)")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up waiting for `usable` after this")
    args = ap.parse_args(argv)
    if not args.prefix.isalpha() and args.prefix:
        ap.error("--prefix: letters only (Mininet takes a switch's datapath id from the first number in its name)")
    if len(f"{args.prefix}s{5 * args.k * args.k // 4}-eth{args.k}") > 15:
        ap.error("--prefix too long: interface names would pass 15 characters")
    if os.geteuid() != 0:
        print(json.dumps({"event": "error", "t": 0, "error": "Mininet needs root"}), flush=True)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    return run(args.k, args.prefix, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
