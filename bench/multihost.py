#!/usr/bin/env python3
"""One testbed over two hosts against the same testbed on one: issue 15's targets (benchmark).

    sudo .venv/bin/python bench/multihost.py [--repeats 5]

Two emulated hosts (testbed.cluster.emulate: namespaces with their own /run and sshd, reached
over SSH like real hosts) are made out of this machine at the start and removed at the end.

1. `up` and `down` of the k=4 fat-tree (`fat-tree`, --time-dilation none), each a whole
   `.venv/bin/testbed` process timed from spawn to exit (what a user waits for): on one host,
   and over the two emulated hosts (`--hosts HOSTS.yaml --known-hosts FILE`). Each repeat runs
   both, alternating which goes first. Right after each multi-host `up` the controller's record
   (<state root>/.clusters/NAME.json) gives its phases ("timings": placement, check hosts,
   underlay, build parts), its own total and each host's part. One untimed warm-up of each
   first (a fresh state root and fresh hosts pay the per-boot capability probe once).
2. A cut link against the same link on one host: the 4-worker "line" of tests/test_cluster.py
   (w0,w1 - s0 ==1 Gbit/s== s1 - w2,w3; pinned so that s0-s1 crosses the hosts). Both testbeds
   are up at once and sampled alternately: iperf3 TCP goodput w0 -> w2 (3 s, median of 3) and
   ping RTT (20 pings at 50 ms, the mean; median of 3 rounds). The link has delay 1ms, as the
   issue's target says: netem's where the kernel has it, else delay lines (on one host a line
   between the two switches; across the hosts one at each end, steered to the tunnel).
3. A table of the ratios against the targets (up < 2x single-host, down < 2 s, goodput within
   5%, RTT within 10%), and bench/results/multihost.json with every sample, the machine, the
   dates and the command line.

Robustness: the single-host testbeds live under a private state root (TESTBED_STATE_DIR, a
fresh directory in /run, as bench/perf_verbs.py does: the controller's record goes there too,
and nothing of anyone else's is touched); names are unique per run; every testbed brought up is
taken down in a finally, then the emulated hosts are removed, also on Ctrl-C or SIGTERM (cleanup
runs with both ignored). Only processes this script starts are ever signalled. At the end,
`ip netns list` must show what it showed at the start: the difference is reported, and a
namespace left with this run's names (its testbeds' or its emulated hosts') fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
TESTBED = REPO / ".venv" / "bin" / "testbed"
RESULTS = REPO / "bench" / "results" / "multihost.json"
SCHEMA = 1

UP_TARGET_RATIO = 2.0       # multi-host up < 2x the single-host up
DOWN_TARGET_S = 2.0         # multi-host down < 2 s
GOODPUT_TOL = 0.05          # a cut link's goodput within 5% of a local one's
RTT_TOL = 0.10              # and its RTT within 10%
IPERF_S = 3
PING_COUNT, PING_INTERVAL = 20, 0.05
LINK_ROUNDS = 3             # goodput and RTT: median of this many samples each
UP_TIMEOUT_S, DOWN_TIMEOUT_S = 300.0, 120.0

# two workers per side of a 1 Gbit/s link between two switches (as the multi-host tests use it)
LINE = (REPO / "topologies" / "two-sides.yaml").read_text()   # s0-s1, 1 Gbit/s, is the link between hosts
PINS = ["--pin", "w0=h1", "--pin", "w1=h1", "--pin", "s0=h1", "--pin", "w2=h2", "--pin", "w3=h2", "--pin", "s1=h2"]
PHASES = ("placement", "check hosts", "underlay", "build parts")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# the same process helpers as the verbs benchmark (bench/perf_verbs.py, beside this file)
from perf_verbs import _end_child, _raise_interrupt, _tail, shielded  # noqa: E402


def run_timed(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One command as a process (no shell, output to pipes): wall time spawn -> exit, rc, output."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True, cwd=REPO, text=True)   # the terminal's Ctrl-C reaches us only
    try:
        out, err = p.communicate(timeout=timeout)
        wall, timed_out = time.perf_counter() - t0, False
    except subprocess.TimeoutExpired:
        with shielded():
            _end_child(p, 120.0)
            out, err = p.communicate()
        wall, timed_out = time.perf_counter() - t0, True
    except BaseException:
        with shielded():
            _end_child(p, 120.0)
        raise
    row: dict[str, Any] = {"t": _now(), "wall_s": round(wall, 4), "rc": p.returncode, "load1": round(load, 2),
                           "stdout": out, "stderr": err}
    if timed_out:
        row["error"] = f"timed out after {timeout:g} s (sent SIGINT)"
    elif p.returncode != 0:
        row["error"] = f"exit {p.returncode}: {_tail(err) or _tail(out)}"
    return row


def _slim(row: dict[str, Any]) -> dict[str, Any]:
    """A timed row without its output (kept only when it failed)."""
    out = {k: v for k, v in row.items() if k not in ("stdout", "stderr")}
    if row.get("error"):
        out["stderr_tail"] = _tail(row.get("stderr"), 800)
    return out


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_gib"] = round(int(line.split()[1]) / 1024 ** 2, 1)
    with contextlib.suppress(OSError):
        osr = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
        info["os"] = osr.get("PRETTY_NAME", "").strip('"')
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10, check=False).stdout.splitlines()
        info["testbed_commit"] = rev
        info["uncommitted_files"] = len(dirty)
    return info


# -- the bench ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tag = secrets.token_hex(2)
        self.state_root = Path(tempfile.mkdtemp(prefix="tb-mh-", dir="/run"))   # 0700, root's
        self.work = Path(tempfile.mkdtemp(prefix="tb-mh-"))                     # topology file, emulated hosts
        self.emu_dir = self.work / "hosts"
        self.env = {**os.environ, "TESTBED_STATE_DIR": str(self.state_root), "COLUMNS": "200"}
        self.maybe_up: list[str] = []           # names brought up (or tried): each gets a `down` at the end
        self.emulated = False
        self.hosts_file = self.known_hosts = ""
        self.counter = 0
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "command": "sudo .venv/bin/python bench/multihost.py" + "".join(f" {shlex.quote(a)}"
                                                                            for a in sys.argv[1:]),
            "argv": [sys.executable, *sys.argv],
            "started": _now(), "finished": None, "interrupted": None,
            "machine": machine(), "load_start": [round(x, 2) for x in os.getloadavg()], "load_end": None,
            "repeats": args.repeats, "state_root": str(self.state_root),
            "netns_before": netns_names(), "netns_after": None, "leftovers": None,
            "emulated_hosts": {}, "up_down": [], "warmup": [], "link": {}, "cleanup": [], "errors": [],
        }

    # -- helpers --
    def name(self, kind: str) -> str:
        self.counter += 1
        return f"mh{self.tag}{kind}{self.counter}"

    def tb(self, *args: str, timeout: float = 120.0) -> dict[str, Any]:
        return run_timed([str(TESTBED), *args], self.env, timeout)

    def up_argv(self, topo: str, name: str, multi: bool, extra: Sequence[str] = ()) -> list[str]:
        argv = ["up", topo, "--name", name, "--time-dilation", "none"]
        if multi:
            argv += ["--hosts", self.hosts_file, "--known-hosts", self.known_hosts, *extra]
        return argv

    def up(self, topo: str, name: str, multi: bool, extra: Sequence[str] = ()) -> dict[str, Any]:
        self.maybe_up.append(name)
        return self.tb(*self.up_argv(topo, name, multi, extra), timeout=UP_TIMEOUT_S)

    def down(self, name: str) -> dict[str, Any]:
        r = self.tb("down", name, timeout=DOWN_TIMEOUT_S)
        if r["rc"] == 0 or "no testbed" in (r["stderr"] + r["stdout"]).lower():
            with contextlib.suppress(ValueError):
                self.maybe_up.remove(name)
        return r

    def cluster_record(self, name: str) -> dict[str, Any] | None:
        p = self.state_root / ".clusters" / f"{name}.json"
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    def note(self, msg: str) -> None:
        self.doc["errors"].append(f"{_now()} {msg}")
        print(f"  ! {msg}", flush=True)

    # -- emulated hosts --
    def make_hosts(self) -> None:
        print(f"making 2 emulated hosts in {self.emu_dir} ...", flush=True)
        self.emulated = True   # from the spawn on: `down --dir` is safe even if nothing was made
        r = run_timed([str(PYTHON), "-m", "testbed.cluster.emulate", "up", "--hosts", "2", "--dir",
                       str(self.emu_dir), "--cores", "8"], self.env, 120.0)
        self.doc["emulated_hosts"] = {"up": _slim(r), "dir": str(self.emu_dir)}
        if r.get("error"):
            raise RuntimeError(f"emulated hosts: {r['error']}")
        self.hosts_file, self.known_hosts = str(self.emu_dir / "hosts.yaml"), str(self.emu_dir / "known_hosts")
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.doc["emulated_hosts"]["id"] = json.loads((self.emu_dir / "emulated.json").read_text())["id"]
        print(f"  {r['wall_s']:.2f} s: " + "; ".join(ln for ln in r["stdout"].splitlines() if ln.startswith("h")),
              flush=True)

    # -- 1. up and down of the fat-tree --
    def cycle(self, multi: bool, repeat: int | None) -> dict[str, Any]:
        kind = "multi" if multi else "single"
        n = self.name("m" if multi else "s")
        u = self.up("fat-tree", n, multi)
        row: dict[str, Any] = {"setup": kind, "repeat": repeat, "name": n, "up": _slim(u)}
        if multi and not u.get("error"):
            rec = self.cluster_record(n)
            if rec is None:
                self.note(f"{n}: no controller record after up")
            else:
                row["controller"] = {"timings": rec.get("timings"), "seconds": rec.get("seconds"),
                                     "hosts": {h: {k: len(v) if isinstance(v, list) else v
                                                   for k, v in (info or {}).items()
                                                   if k in ("nodes", "tunnels", "seconds", "workers")}
                                               for h, info in (rec.get("hosts") or {}).items()},
                                     "cut_links": len(rec.get("cut_links") or []),
                                     "underlay_one_way_s": rec.get("underlay_one_way_s")}
        d = self.down(n)
        row["down"] = _slim(d)
        label = "warm-up" if repeat is None else f"repeat {repeat + 1}"
        msg = f"  {label} {kind:6s}: up {u['wall_s']:.3f} s, down {d['wall_s']:.3f} s"
        if row.get("controller"):
            t = row["controller"].get("timings") or {}
            msg += " (" + ", ".join(f"{p} {t.get(p, float('nan')):.3f}" for p in PHASES) + ")"
        print(msg, flush=True)
        for what, r in (("up", u), ("down", d)):
            if r.get("error"):
                self.note(f"{kind} {what} {n}: {r['error'][:400]}")
        return row

    def up_down(self) -> None:
        print("fat-tree k=4 (--time-dilation none): up and down as processes, single host vs 2 emulated hosts",
              flush=True)
        for multi in (False, True):
            self.doc["warmup"].append(self.cycle(multi, None))
        for r in range(self.args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            for multi in order:
                self.doc["up_down"].append(self.cycle(multi, r))

    # -- 2. a cut link against a local one --
    def goodput(self, name: str, src: str, dst: str) -> dict[str, Any]:
        """TCP goodput src -> dst by iperf3 (server and client through `testbed exec`)."""
        last = ""
        for attempt in range(1, 6):
            server = subprocess.Popen([str(TESTBED), "exec", dst, "--name", name, "--", "timeout", str(IPERF_S + 30),
                                       "iperf3", "-s", "-1"], cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                time.sleep(1.5)   # the server's exec (over SSH for a host) before the client's
                r = self.tb("exec", src, "--name", name, "--", "iperf3", "-c", dst, "-t", str(IPERF_S), "-J",
                            timeout=IPERF_S + 60)
            finally:
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _end_child(server, 5.0)
            try:
                doc = json.loads(r["stdout"] or "{}")
            except ValueError:
                doc = {}
            end = doc.get("end", {})
            if "sum_received" in end:
                return {"t": r["t"], "bps": end["sum_received"]["bits_per_second"],
                        "retransmits": end.get("sum_sent", {}).get("retransmits"), "attempts": attempt}
            last = doc.get("error") or r.get("error") or "no result"
        raise RuntimeError(f"iperf3 {src} -> {dst} on {name}: {last}")

    def rtt(self, name: str, src: str, dst: str) -> dict[str, Any]:
        r = self.tb("exec", src, "--name", name, "--", "ping", "-n", "-c", str(PING_COUNT), "-i", str(PING_INTERVAL),
                    "-q", dst, timeout=60)
        m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", r["stdout"])
        loss = re.search(r"([\d.]+)% packet loss", r["stdout"])
        if not m:
            raise RuntimeError(f"ping {src} -> {dst} on {name}: {r.get('error') or _tail(r['stdout'])}")
        return {"t": r["t"], "min_ms": float(m.group(1)), "mean_ms": float(m.group(2)), "max_ms": float(m.group(3)),
                "mdev_ms": float(m.group(4)), "loss_pct": float(loss.group(1)) if loss else None}

    def link(self) -> None:
        # the kernel probe, run under the private state root (it caches per boot there)
        r = run_timed([str(PYTHON), "-c", "from testbed.net import capabilities as c; print(int(c.probe().netem))"],
                      self.env, 120.0)
        if r.get("error") or r["stdout"].strip() not in ("0", "1"):
            raise RuntimeError(f"capability probe: {r.get('error') or _tail(r['stdout'])}")
        netem = r["stdout"].strip() == "1"
        text = LINE.replace("bandwidth: 1gbit}", "bandwidth: 1gbit, delay: 1ms}")
        topo = self.work / "line.yaml"
        topo.write_text(text)
        L = self.doc["link"] = {"netem": netem, "delay": "1ms", "delay_by": "netem" if netem else "delay lines",
                                "topology": text, "pins": PINS[1::2], "single": {}, "multi": {}, "samples": []}
        print(f"line topology, s0-s1 1 Gbit/s + 1ms delay ({'netem' if netem else 'no sch_netem: delay lines'}): "
              "one host vs cut across 2 emulated hosts, sampled alternately", flush=True)
        names = {"single": self.name("ls"), "multi": self.name("lm")}
        for kind, n in names.items():
            r = self.up(str(topo), n, kind == "multi", PINS if kind == "multi" else [])
            L[kind] = {"name": n, "up": _slim(r)}
            if r.get("error"):
                raise RuntimeError(f"line {kind} up: {r['error']}")
        st = self.tb("status", names["multi"], "--json")
        try:
            cuts = [c["endpoints"] for c in json.loads(st["stdout"])["cut_links"]]
        except (ValueError, KeyError, TypeError):
            cuts = None
        L["multi"]["cut_links"] = cuts
        if cuts != [["s0", "s1"]]:
            raise RuntimeError(f"the multi-host line should cut exactly s0-s1, cuts {cuts}")
        for i in range(LINK_ROUNDS):
            order = ("single", "multi") if i % 2 == 0 else ("multi", "single")
            for kind in order:
                g = self.goodput(names[kind], "w0", "w2")
                L["samples"].append({"setup": kind, "round": i, "what": "goodput", **g})
                print(f"  round {i + 1} {kind:6s}: goodput {g['bps'] / 1e6:.1f} Mbit/s "
                      f"(retransmits {g['retransmits']})", flush=True)
        for i in range(LINK_ROUNDS):
            order = ("single", "multi") if i % 2 == 0 else ("multi", "single")
            for kind in order:
                p = self.rtt(names[kind], "w0", "w2")
                L["samples"].append({"setup": kind, "round": i, "what": "rtt", **p})
                print(f"  round {i + 1} {kind:6s}: RTT mean {p['mean_ms']:.3f} ms (min {p['min_ms']:.3f}, "
                      f"max {p['max_ms']:.3f}, loss {p['loss_pct']}%)", flush=True)
        for kind, n in names.items():
            L[kind]["down"] = _slim(self.down(n))

    # -- cleanup --
    def finish(self) -> None:
        for n in list(self.maybe_up):
            r = self.down(n)
            self.doc["cleanup"].append({"down": n, **_slim(r)})
            if n in self.maybe_up:
                self.note(f"cleanup: testbed down {n} failed: {r.get('error', '')[:300]}")
        ls = self.tb("ls", "--json")
        try:
            left = json.loads(ls["stdout"] or "[]")
        except ValueError:
            left = [{"unreadable": _tail(ls["stdout"])}]
        if left:
            self.note(f"cleanup: testbeds still listed in {self.state_root}: {left}")
            c = self.tb("cleanup", timeout=DOWN_TIMEOUT_S)
            self.doc["cleanup"].append({"cleanup": _slim(c)})
        if self.emulated:
            r = run_timed([str(PYTHON), "-m", "testbed.cluster.emulate", "down", "--dir", str(self.emu_dir)],
                          self.env, 120.0)
            self.doc["emulated_hosts"]["down"] = _slim(r)
            if r.get("error"):
                self.note(f"cleanup: emulated hosts: {r['error'][:400]}")
            else:
                self.emulated = False
        if not left and not self.emulated:
            shutil.rmtree(self.state_root, ignore_errors=True)
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            self.note(f"cleanup: kept {self.state_root} and {self.work} (something is still recorded there)")
        after = netns_names()
        before = set(self.doc["netns_before"])
        self.doc["netns_after"] = after
        new = sorted(set(after) - before)
        eid = self.doc["emulated_hosts"].get("id")
        ours = [ns for ns in new if f"mh{self.tag}" in ns or (eid and ns.startswith(f"tbh{eid}-"))]
        self.doc["leftovers"] = {"netns_new": new, "netns_gone": sorted(before - set(after)), "netns_ours": ours,
                                 "same_as_start": after == self.doc["netns_before"]}
        self.doc["finished"] = _now()
        self.doc["load_end"] = [round(x, 2) for x in os.getloadavg()]

    def run(self) -> None:
        self.make_hosts()
        self.up_down()
        self.link()


# -- summary -----------------------------------------------------------------------------------------------


def _ok_rows(rows: list[dict[str, Any]], kind: str, verb: str) -> list[float]:
    return [r[verb]["wall_s"] for r in rows if r["setup"] == kind and not r[verb].get("error")]


def summarise(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc["up_down"]
    s: dict[str, Any] = {}
    for kind in ("single", "multi"):
        for verb in ("up", "down"):
            s[f"{kind} {verb}"] = stats(_ok_rows(rows, kind, verb))
    ctl = [r["controller"] for r in rows if r.get("controller")]
    phases: dict[str, Any] = {}
    for p in PHASES:
        phases[p] = stats([c["timings"][p] for c in ctl if isinstance(c.get("timings"), dict) and p in c["timings"]])
    phases["controller total (up's record)"] = stats([c["seconds"] for c in ctl if c.get("seconds") is not None])
    for h in sorted({h for c in ctl for h in c.get("hosts", {})}):
        phases[f"part up on {h} (its lifecycle.up)"] = stats(
            [c["hosts"][h]["seconds"] for c in ctl if (c["hosts"].get(h) or {}).get("seconds") is not None])
    over = [r["up"]["wall_s"] - r["controller"]["seconds"] for r in rows
            if r.get("controller") and r["controller"].get("seconds") is not None]
    phases["process overhead (wall - controller total)"] = stats(over)
    s["multi up phases"] = phases
    L = doc.get("link") or {}
    for what, key in (("goodput", "bps"), ("rtt", "mean_ms")):
        for kind in ("single", "multi"):
            s[f"{what} {kind}"] = stats([x[key] for x in L.get("samples", [])
                                         if x["what"] == what and x["setup"] == kind])
    return s


def _ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> float | None:
    return a["median"] / b["median"] if a and b and b["median"] else None


def targets(doc: dict[str, Any], s: dict[str, Any]) -> list[list[str]]:
    rows = []
    r = _ratio(s["multi up"], s["single up"])
    if r is None:
        rows.append(["k=4 up over 2 hosts < 2x single-host", "-", "not measured"])
    else:
        rows.append(["k=4 up over 2 hosts < 2x single-host",
                     f"{r:.2f}x ({s['multi up']['median']:.2f} s vs {s['single up']['median']:.2f} s)",
                     "met" if r < UP_TARGET_RATIO else f"MISSED by {(r / UP_TARGET_RATIO - 1) * 100:.0f}%"])
    d = s["multi down"]
    rows.append([f"k=4 down over 2 hosts < {DOWN_TARGET_S:g} s", f"{d['median']:.2f} s" if d else "-",
                 ("met" if d["median"] < DOWN_TARGET_S else f"MISSED by {(d['median'] / DOWN_TARGET_S - 1) * 100:.0f}%")
                 if d else "not measured"])
    g = _ratio(s["goodput multi"], s["goodput single"])
    if g is None:
        rows.append(["cut link goodput within 5% of local", "-", "not measured"])
    else:
        off = abs(g - 1)
        rows.append(["cut link goodput within 5% of local",
                     (f"{g:.3f} ({s['goodput multi']['median'] / 1e6:.0f} vs "
                      f"{s['goodput single']['median'] / 1e6:.0f} Mbit/s)"),
                     "met" if off <= GOODPUT_TOL else f"MISSED: {off * 100:.1f}% off (limit 5%)"])
    t = _ratio(s["rtt multi"], s["rtt single"])
    L = doc.get("link") or {}
    if t is None:
        rows.append(["cut link RTT within 10% of local", "-", "not measured"])
    elif not L.get("delay"):   # (a result of a run from before cut links took delay lines)
        rows.append(["cut link RTT within 10% of local (1ms delay)", f"{t:.3f}, no delay",
                     "n/a: no sch_netem, no delay (the bare path's RTT)"])
    else:
        off = abs(t - 1)
        meas = (f"{t:.3f} ({s['rtt multi']['median']:.3f} vs {s['rtt single']['median']:.3f} ms, "
                f"{L.get('delay_by') or 'netem'})")
        rows.append(["cut link RTT within 10% of local (1ms delay)", meas,
                     "met" if off <= RTT_TOL else f"MISSED: {off * 100:.1f}% off (limit 10%)"])
    return rows


def fmt_stat(st: dict[str, float] | None, unit: str = "s", scale: float = 1.0, nd: int = 3) -> str:
    if not st:
        return "-"
    return (f"{st['median'] * scale:.{nd}f} {unit} ({st['min'] * scale:.{nd}f}-{st['max'] * scale:.{nd}f}, "
            f"n={st['n']})")


def table(rows: list[list[str]], head: list[str]) -> str:
    w = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(head)).rstrip(),
             "  ".join("-" * x for x in w)]
    lines += ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def report(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    m = doc["machine"]
    out = [(f"\nmachine: {m.get('cpu', '?')}, {m['nproc']} CPUs, kernel {m['kernel']}; "
            f"{doc['started']} to {doc['finished']}; {doc['command']}")]
    rows = [[f"{kind} {verb}", fmt_stat(s[f"{kind} {verb}"])] for verb in ("up", "down") for kind in ("single", "multi")]
    for verb in ("up", "down"):
        r = _ratio(s[f"multi {verb}"], s[f"single {verb}"])
        rows.append([f"{verb}: multi / single", f"{r:.2f}x" if r else "-"])
    out += ["\nfat-tree k=4, whole processes: median (min-max)", table(rows, ["", "wall"])]
    prow = [[p, fmt_stat(st)] for p, st in s["multi up phases"].items()]
    out += ["\nmulti-host up, where the time goes (controller's record; medians)", table(prow, ["phase", "time"])]
    L = doc.get("link") or {}
    lrow = [["goodput w0->w2", fmt_stat(s["goodput single"], "Mbit/s", 1e-6, 1),
             fmt_stat(s["goodput multi"], "Mbit/s", 1e-6, 1)],
            ["RTT mean w0->w2" + ("" if L.get("delay") else " (no delay: no netem)"),
             fmt_stat(s["rtt single"], "ms"), fmt_stat(s["rtt multi"], "ms")]]
    out += ["\nline, s0-s1 1 Gbit/s" + (f" + {L['delay']} ({L.get('delay_by') or 'netem'})" if L.get("delay") else "")
            + ": median (min-max)",
            table(lrow, ["", "one host", "cut across 2 hosts"])]
    out += ["\ntargets (issue 15)", table(targets(doc, s), ["target", "measured (median)", "verdict"])]
    lo = doc.get("leftovers") or {}
    out.append(f"\nleft behind: ip netns list {'as at the start' if lo.get('same_as_start') else 'DIFFERS'}"
               + (f"; new: {lo['netns_new']}" if lo.get("netns_new") else "")
               + (f"; gone (not ours): {lo['netns_gone']}" if lo.get("netns_gone") else "")
               + (f"; OURS LEFT: {lo['netns_ours']}" if lo.get("netns_ours") else
                  ("; none of them ours" if lo.get("netns_new") else "")))
    if doc["errors"]:
        out += ["\nerrors and notes:"] + [f"  - {e}" for e in doc["errors"]]
    if doc.get("interrupted"):
        out.append(f"\ninterrupted: {doc['interrupted']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="up/down cycles per setup (default 5)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS.relative_to(REPO)})")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if os.geteuid() != 0:
        print("multihost.py builds testbeds and emulated hosts: run it as root", file=sys.stderr)
        return 2
    if not TESTBED.exists():
        print(f"{TESTBED} not found: make the venv first", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    bench = Bench(args)
    rc = 0
    try:
        bench.run()
    except KeyboardInterrupt as exc:
        bench.doc["interrupted"] = f"{_now()}: {str(exc) or 'Ctrl-C'}"
        rc = 130
    except Exception as exc:  # noqa: BLE001 - recorded, cleaned up, reported
        bench.note(f"stopped: {type(exc).__name__}: {exc}")
        rc = 1
    finally:
        with shielded():
            bench.finish()
            bench.doc["summary"] = summarise(bench.doc)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(bench.doc, indent=1) + "\n")
    print(report(bench.doc))
    print(f"\nwrote {args.out}")
    if (bench.doc.get("leftovers") or {}).get("netns_ours"):
        rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
