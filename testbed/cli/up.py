"""testbed up TOPOLOGY [--name NAME] [--set path=value ...]: build a testbed and leave it running."""

from __future__ import annotations

import time
from typing import Any, Optional

import typer
from rich.table import Table

from testbed.cli.common import console, err_console, fail, print_dilation, require_root, testbed_command


class _DelayedProgress:
    """A rich progress bar that appears only once the work has taken more than `after` seconds."""

    def __init__(self, after: float = 1.0):
        self.after = after
        self.t0 = time.monotonic()
        self.progress: Any = None   # (rich's progress is imported only for a build that takes that long)
        self.tasks: dict[str, Any] = {}
        self.started = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.started:
            if time.monotonic() - self.t0 < self.after:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=err_console, transient=True)
            self.progress.start()
            self.started = True
        task = self.tasks.get(phase)
        if task is None:
            task = self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(task, completed=done, total=total)

    def stop(self) -> None:
        if self.started:
            self.progress.stop()


_ROWS = 16


def _head(items: list[str], table: Table) -> list[str]:
    """The first rows of a long table; the last row says how many more `testbed status` lists."""
    if len(items) <= _ROWS:
        return items
    table.caption = f"... and {len(items) - _ROWS + 1} more (testbed status)"
    return items[:_ROWS - 1]


def _summary(st: dict[str, Any], seconds: float) -> None:
    from testbed.topology.model import Topology
    from testbed.topology.units import format_time

    topo = Topology.from_json(st["topology"])
    plan = st["plan"]
    name = st["name"]
    addr: dict[str, list[str]] = {}
    for lp in plan["links"]:
        for side in ("a", "b"):
            p = lp[side]
            if p.get("address") and topo.nodes[p["node"]].is_worker:
                addr.setdefault(p["node"], []).append(f"{p['ifname']} {p['address']}")
    console.print(f"[bold green]testbed {name} is up[/] ({topo.name}, runtime {st['runtime']['kind']}) "
                  f"in {seconds:.2f} s")
    t = Table(title="workers", title_justify="left")
    t.add_column("worker")
    t.add_column("addresses")
    for w in _head(topo.workers, t):
        t.add_row(w, ", ".join(addr.get(w, [])))
    console.print(t)
    subnets = plan.get("subnets", {})
    sw = Table(title="switches", title_justify="left")
    sw.add_column("switch")
    sw.add_column("serves")
    sw.add_column("links", justify="right")
    for s in _head(topo.switches, sw):
        sw.add_row(s, subnets.get(s, {}).get("network", "-"), str(len(topo.links_of(s))))
    if topo.switches:
        console.print(sw)
    from testbed.topology import analysis

    lt = Table(title="links per tier (both directions)", title_justify="left")
    for col in analysis.TIER_COLUMNS:
        lt.add_column(col, justify="right" if col == "links" else "left")
    for row in analysis.tier_rows(topo):
        lt.add_row(*row.cells())
    console.print(lt)
    print_dilation(st)
    if st["runtime"].get("net_admin"):
        console.print("[yellow]workers have CAP_NET_ADMIN[/] (--net-admin): a job can change or remove its "
                      "links' shaping; the numbers are then no longer the topology's", highlight=False)
    floor = st.get("latency_floor_s")
    if floor is not None:
        console.print(f"latency floor (one unshaped hop, one way): {floor * 1e6:.1f} us")
    nd = st.get("no_delay_element") or []
    if nd:
        shown = ", ".join(f"{d['from']}->{d['to']} ({format_time(d['delay_s'])})" for d in nd[:6])
        more = f" and {len(nd) - 6} more" if len(nd) > 6 else ""
        limit = st.get("delay_threshold_s") or floor or 0.0
        console.print(f"[yellow]{len(nd)} link direction(s) got no delay element[/] (delay at or below "
                      f"{format_time(limit)}: an unshaped hop already takes the floor"
                      + ("" if (st.get("capabilities") or {}).get("netem") else
                         ", and a delay line would add ~100 us of its own") + f"): {shown}{more}")
    w0 = topo.workers[0]
    w1 = topo.workers[-1]
    peer = addr.get(w1, ["? ?"])[0].split()[1].split("/")[0]
    tb = testbed_command()
    console.print("\nnext:")
    for line in (f"{tb} exec {w0} --name {name} -- ping -c 3 {w1}    # {w1} is {peer}",
                 f"{tb} attach {w0} --name {name}                    # a shell inside {w0}",
                 f"{tb} run --name {name} -- python examples/train_ddp.py",
                 f"{tb} status {name}",
                 f"{tb} down {name}"):
        console.print(f"  {line}", highlight=False, soft_wrap=True)   # whole lines, to copy as they are


def machine_constants(setting: Any) -> Any:
    """The calibrated constants `auto` needs (measured once per boot, saying so), else None."""
    if not (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return None
    from testbed.jobs import calibration

    return calibration.constants_or_none(progress=lambda m: err_console.print(m, highlight=False))


def up_cmd(
    topology: str = typer.Argument(..., help="A topology file (YAML, or a Mininet custom .py), the name of one "
                                             "in topologies/ (fat-tree, ...), or mininet:tree,depth=2,..."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Testbed name (default: the topology's name)."),
    sets: list[str] = typer.Option([], "--set", help="Override a topology field: path=value (repeatable)."),
    runtime: Optional[str] = typer.Option(None, "--runtime", "-r",
                                          help="Where workers run: netns (default, no daemon) or docker."),
    time_dilation: Optional[str] = typer.Option(
        None, "--time-dilation",
        help="Slow links by a factor s (bandwidth/s, delay*s) to keep time-shared compute in proportion. "
             "'auto' (the default unless the topology says otherwise): the smallest s at which the run is "
             "network-bound, from ranks per core (or GPU) and this machine's calibrated cost per byte against "
             "the hosts the topology declares (host_rate: network-bound by default); a number; or 'none' "
             "for real time."),
    ranks: Optional[int] = typer.Option(None, "--ranks", min=1,
                                        help="How many ranks your jobs will run, for `auto` (default: one per "
                                             "worker); a run with another count is judged against it."),
    real_ranks: Optional[int] = typer.Option(None, "--real-ranks", min=1,
                                             help="How many of those ranks compute, for `auto`, when the others "
                                                  "will be phantoms (testbed run --real): compute counts these, "
                                                  "the traffic counts every rank."),
    allow_gpu_sharing: bool = typer.Option(False, "--allow-gpu-sharing",
                                           help="Let several workers share a GPU when there are too few."),
    net_admin: bool = typer.Option(False, "--net-admin",
                                   help="Give workers CAP_NET_ADMIN (for jobs that configure their own "
                                        "interfaces or tc). A job can then change or remove its links' "
                                        "shaping, and the run's numbers stop being the topology's."),
    hosts_file: Optional[str] = typer.Option(None, "--hosts", metavar="HOSTS.yaml",
                                             help="Spread the testbed over these hosts, driven over SSH "
                                                  "(docs/multi-host.md); links between hosts become VXLAN "
                                                  "tunnels."),
    pins: list[str] = typer.Option([], "--pin", metavar="NODE=HOST", help="With --hosts: keep NODE on HOST "
                                                                          "(repeatable)."),
    known_hosts: Optional[str] = typer.Option(None, "--known-hosts", metavar="FILE",
                                              help="With --hosts: the SSH host keys to accept (default: "
                                                   "~/.ssh/known_hosts); other keys are refused."),
    trust_new_host_keys: bool = typer.Option(False, "--trust-new-host-keys",
                                             help="With --hosts: accept hosts whose key is not known yet "
                                                  "(and remember it)."),
) -> None:
    """Build a testbed from TOPOLOGY and leave it running."""
    from testbed import lifecycle
    from testbed.topology.mininet_import import load_any

    require_root("testbed up")
    if runtime is not None and runtime not in ("netns", "docker"):
        fail(f"--runtime must be netns or docker (got {runtime!r})", 2)
    if (pins or known_hosts or trust_new_host_keys) and not hosts_file:
        fail("--pin, --known-hosts and --trust-new-host-keys go with --hosts", 2)
    topo, warnings = load_any(topology, sets)
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
    if hosts_file:
        _up_over_hosts(topo, name, hosts_file, pins, time_dilation, runtime, net_admin, known_hosts,
                       trust_new_host_keys)
        return
    setting = time_dilation or topo.time_dilation or "auto"
    t0 = time.perf_counter()
    machine = machine_constants(setting)
    progress = _DelayedProgress()
    try:
        st = lifecycle.up(topo, name, progress=progress, runtime=runtime, time_dilation=setting,
                          allow_gpu_sharing=allow_gpu_sharing, machine=machine, ranks=ranks, real_ranks=real_ranks,
                          net_admin=net_admin)
    finally:
        progress.stop()
    _summary(st, time.perf_counter() - t0)


def _up_over_hosts(topo: Any, name: Optional[str], hosts_file: str, pins: list[str], time_dilation: Optional[str],
                   runtime: Optional[str], net_admin: bool, known_hosts: Optional[str], trust_new: bool) -> None:
    from testbed.cluster import up as hosts_up
    from testbed.cluster.hosts import load_hosts
    from testbed.cluster.placement import parse_pins

    hosts = load_hosts(hosts_file)
    t0 = time.perf_counter()
    doc = hosts_up.up(topo, hosts, name, pins=parse_pins(pins), time_dilation=time_dilation, runtime=runtime,
                        net_admin=net_admin, known_hosts=known_hosts, trust_new=trust_new,
                        progress=lambda m: err_console.print(m, highlight=False))
    name = doc["name"]
    console.print(f"[bold green]testbed {name} is up[/] on {len(doc['hosts'])} hosts ({topo.name}) "
                  f"in {time.perf_counter() - t0:.2f} s")
    t = Table(title="hosts", title_justify="left")
    for col in ("host", "nodes", "workers", "tunnel ends", "built in"):
        t.add_column(col, justify="left" if col == "host" else "right")
    for h, info in doc["hosts"].items():
        secs = info.get("seconds")
        nodes = info.get("nodes")
        t.add_row(h, str(len(nodes) if isinstance(nodes, list) else nodes),
                  str(len(info.get("workers", []))), str(info.get("tunnels", 0)),
                  f"{secs:.2f} s" if isinstance(secs, (int, float)) else "-")
    console.print(t)
    print_dilation(doc)
    cuts = doc.get("cut_links") or []
    console.print(f"{len(cuts)} link(s) cross hosts as VXLAN tunnels"
                  + (": " + ", ".join(f"{c['endpoints'][0]}-{c['endpoints'][1]}" for c in cuts[:6])
                     + (" ..." if len(cuts) > 6 else "") if cuts else ""), highlight=False)
    for pair, s in (doc.get("underlay_one_way_s") or {}).items():
        console.print(f"underlay {pair.replace('|', ' <-> ')}: {s * 1e6:.0f} us one way (taken off the cut "
                      "links' delay)", highlight=False)
    tb = testbed_command()
    w0, w1 = topo.workers[0], topo.workers[-1]
    console.print("\nnext:")
    for line in (f"{tb} exec {w0} --name {name} -- ping -c 3 {w1}",
                 f"{tb} status {name}",
                 f"{tb} down {name}"):
        console.print(f"  {line}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("up")(up_cmd)
