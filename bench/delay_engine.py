#!/usr/bin/env python3
"""The delay-line engine against the per-link helpers it replaced: memory, start-up, delay accuracy.

On a kernel without sch_netem every delayed link is a userspace delay line. Until issue 25 each
line was its own helper process (testbed/net/delayline.py at commit 715495e, a select() loop);
now a few engines (testbed/net/delay_engine.py, epoll + a timerfd) serve them all. This bench
runs both designs in the same run, on the same namespaces:

- `--links N` lines (default 64) between two namespaces, all at 1 ms one way except line 1
  (10 ms): the time to start them, the processes, their RSS and PSS (psutil memory_full_info);
- accuracy: the median RTT over 100 pings (50 at 10 ms) against the asked 2 x delay;
- under load: iperf3 through line 2 for `--seconds`, while line 0 is pinged every 20 ms: the
  goodput, line 2's p99 lateness (the lines' own histogram, which the verdict reads) and line 0's
  p99 RTT against its 2 ms;
- `--timers`: how a sleeping loop wakes at an absolute time, five ways (epoll_wait's ms timeout,
  a timerfd in epoll, select on the epoll fd, epoll_pwait2, epoll then a spin): lateness and CPU
  per wake, at SCHED_FIFO 1 like the engine. This is what chose the timerfd.
- `--k16`: `testbed up fat-tree --set params.k=16` at the default auto dilation, as a process,
  then the engines' memory and descriptors, a ping across pods, and `testbed down`.

The designs run `--repeat` times, interleaved (helpers, engine, the engine without its final spin);
prints the median of each figure and the ratios to the helpers'; writes bench/results/delay_engine.json
(every run kept; sections not run this time stay as an earlier run left them).

    sudo .venv/bin/python bench/delay_engine.py [--links 64] [--seconds 5] [--repeat 3] [--timers] [--k16]

The old design is read from git (`git show 715495e:testbed/net/delayline.py`), so the bench needs
the repository's history; it is loaded as a module of its own and its helper is started by path.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OLD_COMMIT = "715495e"   # the last commit with a helper process per delayed link
RESULTS = REPO / "bench" / "results" / "delay_engine.json"


# -- the old design, from git ---------------------------------------------------------------------------

def load_old(tmp: Path) -> types.ModuleType:
    """The per-link helper module of OLD_COMMIT, importable as tb_old_delayline; its helper starts
    from a small entry script instead of `-m testbed.net.delayline_main` (which is the engine now)."""
    import importlib.util

    src = subprocess.run(["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:testbed/net/delayline.py"],
                         capture_output=True, text=True, check=True).stdout
    (tmp / "tb_old_delayline.py").write_text(src)
    entry = tmp / "old_helper.py"
    entry.write_text(f"import json, sys\nsys.path.insert(0, {str(tmp)!r})\nimport tb_old_delayline\n"
                     "tb_old_delayline.serve(json.loads(sys.argv[1]))\n")
    spec = importlib.util.spec_from_file_location("tb_old_delayline", tmp / "tb_old_delayline.py")
    old = importlib.util.module_from_spec(spec)
    sys.modules["tb_old_delayline"] = old   # (its dataclasses look their module up)
    spec.loader.exec_module(old)

    def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
        assert argv[1:3] == ["-m", "testbed.net.delayline_main"], argv
        return subprocess.Popen([argv[0], str(entry), *argv[3:]], **kw)

    old.subprocess = types.SimpleNamespace(Popen=popen, DEVNULL=subprocess.DEVNULL)
    os.environ["PYTHONPATH"] = str(REPO)   # (the old code prepends its own parent's parent, here /tmp's)
    return old


# -- two namespaces joined by N lines ------------------------------------------------------------------

def ip(i: int, side: int) -> str:
    return f"10.{80 + i // 256}.{i % 256}.{side}"


class Bed:
    def __init__(self, tag: str):
        from testbed.net import netns

        self.a, self.b = f"tb-be{tag}-a", f"tb-be{tag}-b"
        for ns in (self.a, self.b):
            netns.create(ns)
        self.state = tempfile.mkdtemp(prefix="tbde-")

    def address(self, i: int) -> None:
        from pyroute2 import IPRoute

        for ns, side in ((self.a, 1), (self.b, 2)):
            with IPRoute(netns=ns) as ipr:
                idx = ipr.link_lookup(ifname=f"d{i}")[0]
                ipr.addr("add", index=idx, address=ip(i, side), prefixlen=24)
                ipr.link("set", index=idx, state="up")
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")

    def ping(self, i: int, count: int, interval: float) -> list[float]:
        r = subprocess.run(["ip", "netns", "exec", self.a, "ping", "-n", "-c", str(count), "-i", str(interval),
                            "-W", "2", ip(i, 2)], capture_output=True, text=True, timeout=count * interval + 60)
        return [float(x) / 1e3 for x in re.findall(r"time=([0-9.]+) ms", r.stdout)]

    def close(self) -> None:
        import shutil

        from testbed.net import netns

        for ns in (self.a, self.b):
            netns.delete(ns)
        shutil.rmtree(self.state, ignore_errors=True)


def memory(pids: set[int]) -> dict[str, float]:
    import psutil

    rss = pss = 0
    fds = 0
    for pid in pids:
        m = psutil.Process(pid).memory_full_info()
        rss, pss = rss + m.rss, pss + m.pss
        fds += len(os.listdir(f"/proc/{pid}/fd"))
    return {"processes": len(pids), "rss_mib": rss / 2**20, "pss_mib": pss / 2**20, "fds": fds}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1)]


def iperf(bed: Bed, i: int, seconds: int) -> float:
    srv = subprocess.Popen(["ip", "netns", "exec", bed.b, "iperf3", "-s", "-1", "-B", ip(i, 2)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):   # until the server listens
            r = subprocess.run(["ip", "netns", "exec", bed.a, "iperf3", "-c", ip(i, 2), "-J", "-t", str(seconds),
                                "-O", "1"], capture_output=True, text=True, timeout=seconds + 60)
            out = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
            if r.returncode == 0 and "error" not in out:
                return float(out["end"]["sum_received"]["bits_per_second"])
            time.sleep(0.05)
        raise RuntimeError("iperf3 did not connect")
    finally:
        srv.kill()
        srv.wait()


def hist_delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before)]


def run_design(name: str, mod: Any, n: int, seconds: int, stop_all: Callable[[Any, list[Any]], None]) -> dict[str, Any]:
    from testbed.net import delayline
    from testbed.topology.model import LinkProfile

    bed = Bed(uuid.uuid4().hex[:4])
    links: list[Any] = []
    try:
        t0 = time.perf_counter()
        for i in range(n):
            prof = LinkProfile(delay_s=0.010 if i == 1 else 0.001)
            links.append(mod.start_delay_link("bench", str(i), bed.a, f"d{i}", bed.b, f"d{i}", prof, prof, 1500,
                                              bed.state))
        start_s = time.perf_counter() - t0
        for i in (0, 1, 2):
            bed.address(i)
            bed.ping(i, 2, 0.2)   # ARP across the line first
        rtt1 = bed.ping(0, 100, 0.01)
        rtt10 = bed.ping(1, 50, 0.01)
        before = {i: mod.stats(links[i]) for i in (0, 2)}
        pinger = subprocess.Popen(["ip", "netns", "exec", bed.a, "ping", "-n", "-c", str(seconds * 50), "-i", "0.02",
                                   "-W", "2", ip(0, 2)], stdout=subprocess.PIPE, text=True)
        gbps = iperf(bed, 2, seconds) / 1e9
        loaded_rtt = [float(x) / 1e3 for x in re.findall(r"time=([0-9.]+) ms", pinger.communicate(timeout=120)[0])]
        after = {i: mod.stats(links[i]) for i in (0, 2)}
        late2 = hist_delta(after[2]["ab"]["late_hist_us_log2"], before[2]["ab"]["late_hist_us_log2"])
        late0 = hist_delta(after[0]["ab"]["late_hist_us_log2"], before[0]["ab"]["late_hist_us_log2"])
        mem = memory({l.pid for l in links})
        t0 = time.perf_counter()
        stop_all(mod, links)
        links = []
        stop_s = time.perf_counter() - t0
        out = {
            "design": name, "links": n, "start_s": start_s, "stop_s": stop_s, **mem,
            "rtt_1ms_median_over_asked": statistics.median(rtt1) / 0.002, "rtt_1ms_p99_ms": pct(rtt1, 99) * 1e3,
            "rtt_10ms_median_over_asked": statistics.median(rtt10) / 0.020,
            "load_gbps": gbps, "loaded_line_late_p99_us": delayline.lateness_percentile(late2, 99) * 1e6,
            "loaded_line_late_mean_us": delayline.lateness_mean(late2) * 1e6,
            "loaded_line_drops": after[2]["ab"]["drops"] - before[2]["ab"]["drops"],
            "neighbour_late_p99_us": (delayline.lateness_percentile(late0, 99) or 0) * 1e6,
            "neighbour_rtt_p99_ms": pct(loaded_rtt, 99) * 1e3, "neighbour_pings": len(loaded_rtt),
        }
        return out
    finally:
        if links:
            stop_all(mod, links)
        bed.close()


def _stop_old(mod: Any, links: list[Any]) -> None:
    for link in links:
        mod.stop(link)


def _stop_engine(mod: Any, links: list[Any]) -> None:
    mod.stop_all(os.path.dirname(links[0].pid_file))


# -- waking at a time: five ways ----------------------------------------------------------------------

def timers_child(n: int) -> dict[str, Any]:
    """Runs in a child at SCHED_FIFO 1 (the engine's priority): n sleeps to a random 50-2000 us ahead."""
    from testbed.net.timerfd import Timer

    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        policy = "SCHED_FIFO 1"
    except OSError:
        policy = "SCHED_OTHER"
    ep = select.epoll()
    tep = select.epoll()
    timer = Timer()
    tep.register(timer.fd, select.EPOLLIN)
    libc = ctypes.CDLL(None, use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    events = ctypes.create_string_buffer(12 * 8)
    pwait2 = getattr(libc, "epoll_pwait2", None)
    now = time.monotonic

    def epoll_ms(t: float) -> None:
        while (left := t - now()) > 0:
            ep.poll(left)   # CPython rounds the timeout up to whole milliseconds

    def timerfd(t: float) -> None:
        timer.arm(t)
        while now() < t:
            tep.poll()
        timer.fired()

    def timerfd_spin(early: float) -> Callable[[float], None]:
        def sleep(t: float) -> None:
            timer.arm(t - early)
            while now() < t - early:
                tep.poll()
            timer.fired()
            while now() < t:
                pass
        return sleep

    def select_epfd(t: float) -> None:
        while (left := t - now()) > 0:
            select.select([ep.fileno()], [], [], left)   # (the epoll fd is low: what select can take)

    def epoll_pwait2(t: float) -> None:
        while (left := t - now()) > 0:
            ts = Timespec(int(left), int((left - int(left)) * 1e9))
            pwait2(ep.fileno(), events, 8, ctypes.byref(ts), None)

    def epoll_spin(t: float) -> None:
        left = t - now()
        if left > 0.0015:
            ep.poll(left - 0.0015)   # (rounded up to ms: wakes 0.5-1.5 ms early)
        while now() < t:
            pass

    rng = random.Random(25)
    out: dict[str, Any] = {"policy": policy, "wakes": n}
    ways = {"epoll_wait timeout": epoll_ms, "timerfd in epoll (engine)": timerfd,
            "select on the epoll fd (old helpers' select)": select_epfd, "epoll then spin": epoll_spin}
    if pwait2 is not None:
        ways["epoll_pwait2"] = epoll_pwait2
    for early in (50, 100):
        ways[f"timerfd {early} us early, then spin"] = timerfd_spin(early * 1e-6)
    for name, sleep in ways.items():
        late = []
        c0 = time.process_time()
        for _ in range(n):
            t = now() + rng.uniform(50e-6, 2e-3)
            sleep(t)
            late.append(now() - t)
        cpu = (time.process_time() - c0) / n
        out[name] = {"late_median_us": statistics.median(late) * 1e6, "late_p99_us": pct(late, 99) * 1e6,
                     "late_max_us": max(late) * 1e6, "cpu_us_per_wake": cpu * 1e6}
    return out


def timers(n: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, __file__, "--timers-child", str(n)], capture_output=True, text=True,
                       timeout=600, check=True)
    return json.loads(r.stdout)


# -- k=16 -------------------------------------------------------------------------------------------

def k16() -> dict[str, Any]:
    from testbed import lifecycle

    name = f"k16e{uuid.uuid4().hex[:4]}"
    tb = [sys.executable, "-m", "testbed"]
    t0 = time.perf_counter()
    r = subprocess.run([*tb, "up", "fat-tree", "--set", "params.k=16", "--name", name], capture_output=True,
                       text=True, timeout=3600)
    up_s = time.perf_counter() - t0
    out: dict[str, Any] = {"up_rc": r.returncode, "up_s": up_s, "up_tail": (r.stdout + r.stderr)[-1500:]}
    try:
        if r.returncode == 0:
            st = lifecycle.load(name)
            lines = st["resources"]["delay_lines"]
            out.update(time_dilation=st["time_dilation"], delay_lines=len(lines), **memory({l["pid"] for l in lines}),
                       timings=st.get("timings"))
            workers = list(st["runtime"]["workers"])
            ping = subprocess.run([*tb, "exec", workers[0], "--name", name, "--", "ping", "-n", "-c", "5", "-i", "0.2",
                                   f"{workers[-1]}"], capture_output=True, text=True, timeout=120)
            out["ping_first_last"] = [float(x) for x in re.findall(r"time=([0-9.]+) ms", ping.stdout)]
            out["ping_tail"] = (ping.stdout + ping.stderr)[-400:]
    finally:
        t0 = time.perf_counter()
        d = subprocess.run([*tb, "down", name], capture_output=True, text=True, timeout=1800)
        out.update(down_rc=d.returncode, down_s=time.perf_counter() - t0, down_tail=(d.stdout + d.stderr)[-800:])
    return out


# -- main -------------------------------------------------------------------------------------------

ROWS = [("start_s", "start {n} lines, s"), ("stop_s", "stop them, s"), ("processes", "processes"),
        ("rss_mib", "RSS, MiB"), ("pss_mib", "PSS, MiB"), ("fds", "open files"),
        ("rtt_1ms_median_over_asked", "median RTT / asked, 1 ms line"),
        ("rtt_10ms_median_over_asked", "median RTT / asked, 10 ms line"), ("rtt_1ms_p99_ms", "p99 RTT, 1 ms line, ms"),
        ("load_gbps", "iperf3 through a 1 ms line, Gbit/s"),
        ("loaded_line_late_mean_us", "loaded line: mean lateness, us"),
        ("loaded_line_late_p99_us", "loaded line: p99 lateness, us (bucket edge)"),
        ("loaded_line_drops", "loaded line: drops"),
        ("neighbour_rtt_p99_ms", "idle neighbour under load: p99 RTT, ms (asked 2)"),
        ("neighbour_late_p99_us", "idle neighbour under load: p99 lateness, us")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each design (medians printed)")
    ap.add_argument("--timers", action="store_true", help="also compare the ways of waking at a time")
    ap.add_argument("--wakes", type=int, default=2000)
    ap.add_argument("--k16", action="store_true", help="also bring a k=16 fat-tree up and down at auto dilation")
    ap.add_argument("--no-designs", action="store_true", help="skip the engine-vs-helpers comparison")
    ap.add_argument("--timers-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.timers_child:
        print(json.dumps(timers_child(args.timers_child)))
        return 0
    if os.geteuid() != 0:
        print("needs root (namespaces, TAP devices)", file=sys.stderr)
        return 2
    from testbed.net import delayline

    result: dict[str, Any] = {"kernel": os.uname().release, "cpus": os.cpu_count(),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if args.timers:
        result["timers"] = t = timers(args.wakes)
        print(f"waking at a time ({t['policy']}, {t['wakes']} wakes 50-2000 us ahead):")
        print(f"  {'':46} {'median':>9} {'p99':>9} {'max':>9} {'CPU/wake':>9}  (us)")
        for name, v in t.items():
            if isinstance(v, dict):
                print(f"  {name:46} {v['late_median_us']:9.1f} {v['late_p99_us']:9.1f} {v['late_max_us']:9.1f} "
                      f"{v['cpu_us_per_wake']:9.1f}")
    if not args.no_designs:
        runs: dict[str, list[dict[str, Any]]] = {"helpers": [], "engine": [], "engine_no_spin": []}
        with tempfile.TemporaryDirectory(prefix="tbold-") as tmp:
            old = load_old(Path(tmp))
            for _ in range(args.repeat):   # interleaved: what the machine does meanwhile hits all three alike
                runs["helpers"].append(run_design(f"per-link helpers ({OLD_COMMIT})", old, args.links,
                                                  args.seconds, _stop_old))
                runs["engine"].append(run_design("engine", delayline, args.links, args.seconds, _stop_engine))
                delayline.ENGINE_SPIN_S = 0.0   # the same engine, its timer at the due time and no spin
                runs["engine_no_spin"].append(run_design("engine without the spin", delayline, args.links,
                                                         args.seconds, _stop_engine))
                delayline.ENGINE_SPIN_S = None
        med = {k: {key: statistics.median(r[key] for r in v) for key, _ in ROWS} for k, v in runs.items()}
        result["designs"] = {"runs": runs, "median": med, "links": args.links, "seconds": args.seconds}
        helpers, engine, nospin = med["helpers"], med["engine"], med["engine_no_spin"]
        print(f"\n{args.links} delay lines, {args.seconds} s of load ({result['kernel']}, {result['cpus']} CPUs), "
              f"median of {args.repeat} run(s):")
        print(f"  {'':52} {'helpers':>9} {'engine':>9} {'no spin':>9} {'engine/helpers':>15} {'no spin/helpers':>16}")
        for key, label in ROWS:
            h, e, ns = helpers[key], engine[key], nospin[key]
            ratios = f"{e / h:15.3f} {ns / h:16.3f}" if h else f"{'-':>15} {'-':>16}"
            print(f"  {label.format(n=args.links):52} {h:9.3f} {e:9.3f} {ns:9.3f} {ratios}")
        per_line = helpers["pss_mib"] / args.links
        print(f"  (helpers at k=16's 3,072 lines: ~{per_line * 3072 / 1024:.1f} GiB PSS and 3,072 processes, "
              f"from {per_line:.2f} MiB PSS a line here)")
    if args.k16:
        result["k16"] = k = k16()
        print(f"\nk=16 fat-tree, auto dilation: up rc {k['up_rc']} in {k['up_s']:.1f} s, down rc {k['down_rc']} "
              f"in {k['down_s']:.1f} s")
        if k["up_rc"] == 0:
            print(f"  dilation {k['time_dilation']:g}, {k['delay_lines']} delay lines in {k['processes']} engine(s): "
                  f"RSS {k['rss_mib']:.1f} MiB, PSS {k['pss_mib']:.1f} MiB, {k['fds']} open files")
            print(f"  ping first -> last worker: {k['ping_first_last']} ms")
        else:
            print(k["up_tail"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    try:   # sections not run this time stay as an earlier run left them (each carries its own date)
        kept = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        kept = {}
    for section in ("timers", "designs", "k16"):
        if section in result:
            result[section]["date"] = result["date"]
        elif section in kept:
            result[section] = kept[section]
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten: {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
