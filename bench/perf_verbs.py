#!/usr/bin/env python3
"""What users wait for: every testbed verb as a process, from Enter to prompt, against Mininet.

    sudo .venv/bin/python bench/perf_verbs.py                          # the full sweep (k = 4,6,8,12,16)
    sudo .venv/bin/python bench/perf_verbs.py --sizes 4 --repeats 2     # a quick one
    .venv/bin/python bench/perf_verbs.py --render                       # docs/performance.md from the JSON

testbed: each verb is `.venv/bin/testbed ...` started as a process (no shell), its wall time
from spawn to exit (perf_counter around Popen..communicate: Python's start, imports, the work,
the output) and the CPU it and its reaped children used. Per size, repeat and dilation setting
(--time-dilation, default `auto,none`: the default a user gets, and real time as Mininet runs):
`up fat-tree --set params.k=K --time-dilation D`, then `status --json`, `ls`, `link show`, `link
set` (a bandwidth change on w0's link) and `link reset` (each --repeats times), then `down`;
`--help` alone first. A setting D+no-netem (`auto+no-netem`) brings its testbeds up with
TESTBED_WITHOUT=netem: the no-netem column on a kernel that has netem. On a kernel without sch_netem, `auto` gives every link whose dilated delay
passes the machine's floor a delay line (userspace engines): the page states the kernel's
capabilities and, per size and setting, how many delay lines and engines `up` made. Where
up's time goes comes from the state file's `timings` (lifecycle's phases); the rest of the
process's wall time (start, imports, calibration lookup, the printed summary) is "process
overhead". The bench's testbeds live under a private state root (TESTBED_STATE_DIR, a fresh
directory in /run), so `ls` sees only them and nothing of anyone else's is touched; one
untimed k=4 up/down first fills that root's per-boot capability cache (a user pays it once
per boot; its time is kept as the warm-up row).

Mininet, the baseline: Debian's 2.3.0 driven through its Python API by Debian's python3 in a
subprocess (bench/mininet_fattree.py: the same graph, Linux bridges with STP on, TCLink
bw=1000, no controller). "Mininet up" is from spawn until the network is usable: STP has
settled (every bridge port forwarding or blocking) and then a round of pings between sampled
host pairs all answered. "Mininet stop" is net.stop(). Each size runs testbed, then Mininet,
alternating per repeat. A Mininet run whose up passes --timeout-per-size is stopped and
recorded "-" with the reason, and bigger sizes are not tried; repeats stop once a size has
spent that long on Mininet.

Memory (per size, each up): the RSS, PSS and USS of testbed's own processes (each worker's
init and anything under it, delay-line helpers) via psutil; switches are namespaces with no
process. The kernel's side: Slab and MemAvailable from /proc/meminfo before and after `up`,
the difference divided by the node count (machine-wide numbers: anything else running
moves them). Mininet's node shells (one bash per host and per switch) likewise.

Robustness: a size or verb that fails is recorded with its error and the sweep goes on.
Whatever a run brought up is brought down (testbed down NAME, then `testbed cleanup` on the
private root; Mininet's net.stop(), then only interfaces carrying the run's own unused name
prefix), also on Ctrl-C or SIGTERM (cleanup runs with both ignored). Results are written to
bench/results/performance.json after every size, then docs/performance.md and
docs/performance/up_down.png are rendered from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import random
import resource
import shlex
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / ".venv" / "bin" / "testbed"
MN_PYTHON = "/usr/bin/python3"            # Debian's, which has Debian's Mininet
MININET_PACKAGES = ("mininet", "openvswitch-switch", "bridge-utils", "mininet_python")   # versions() of the anchor
MN_SCRIPT = REPO / "bench" / "mininet_fattree.py"
RESULTS = REPO / "bench" / "results" / "performance.json"
DOC = REPO / "docs" / "performance.md"
PLOT = REPO / "docs" / "performance" / "up_down.png"
SCHEMA = 1

DEFAULT_SIZES = (4, 6, 8, 12, 16)
# read-only and light verbs timed while a testbed is up: (label, argv after `testbed`)
LIGHT_VERBS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("status --json", ("status", "--json", "{name}")),
    ("ls", ("ls",)),
    ("link show", ("link", "show", "--name", "{name}")),
    ("link set", ("link", "set", "w0", "edge0-0", "--bandwidth", "5gbit", "--name", "{name}")),
    ("link reset", ("link", "reset", "w0", "edge0-0", "--name", "{name}")),
)
VERB_ORDER = ("--help", "up", "status --json", "ls", "link show", "link set", "link reset", "down")
# lifecycle's phases in the order up runs them; shaping and routes+neigh are parts of configure
PHASE_ORDER = ("capabilities", "worker namespaces", "start workers", "switch namespaces", "worker sysctls",
               "links", "configure", "shaping", "routes+neigh", "wait ready", "total")
NESTED = {"shaping": "configure", "routes+neigh": "configure"}
# issue 13's targets: k -> {verb: seconds}; ratios: k -> Mininet up / testbed up at least
TARGETS: dict[int, dict[str, float]] = {4: {"up": 0.6, "down": 0.3}, 8: {"up": 2.5, "down": 1.0},
                                        16: {"up": 30.0, "down": 10.0, "status --json": 0.5}}
RATIO_TARGETS = {4: 4.0, 8: 9.0}
HELP_TARGET = 0.15
# issue 25: --help and the read-only verbs within this factor of the bare interpreter (`python -c pass`)
INTERPRETER_FACTOR = 3.5
READ_ONLY_VERBS = ("--help", "status --json", "ls", "link show")
BREAKDOWN = REPO / "bench" / "verb_breakdown.py"


def counts(k: int) -> dict[str, int]:
    """Workers, switches and links of the k-ary fat-tree (testbed's generator)."""
    w, s, links = k ** 3 // 4, 5 * k * k // 4, 3 * k ** 3 // 4
    return {"workers": w, "switches": s, "links": links, "nodes": w + s}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "Slab", "SUnreclaim", "SReclaimable"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _tail(text: str | bytes | None, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:].strip()


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored while cleanup runs (restored after)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# -- running a process -------------------------------------------------------------------------------------
def _end_child(p: subprocess.Popen, grace: float) -> None:
    """SIGINT (testbed rolls back, Mininet stops its net), then SIGKILL after `grace` seconds."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait()


def run_timed(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One command as a process: wall time spawn->exit, CPU of it and its reaped children, rc
    (and, under "stdout_text", the first 64 KiB of what it printed)."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True, cwd=REPO)   # own session: the terminal's Ctrl-C reaches us only
    try:
        out, err = p.communicate(timeout=timeout)
        wall = time.perf_counter() - t0
        timed_out = False
    except subprocess.TimeoutExpired:
        with shielded():
            _end_child(p, 300.0)
            out, err = p.communicate()
        wall, timed_out = time.perf_counter() - t0, True
    except KeyboardInterrupt as exc:
        with shielded():
            _end_child(p, 300.0)
        raise KeyboardInterrupt(f"{str(exc) or 'Ctrl-C'} during `testbed {' '.join(argv[1:3])}`") from None
    except BaseException:
        with shielded():
            _end_child(p, 300.0)
        raise
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    row: dict[str, Any] = {"t": _now(), "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "rc": p.returncode,
                           "load1": round(load, 2), "stdout_bytes": len(out),
                           "stdout_text": out[:65536].decode(errors="replace")}
    if timed_out:
        row["error"] = f"timed out after {timeout:g} s (sent SIGINT)"
    elif p.returncode != 0:
        row["error"] = f"exit {p.returncode}: {_tail(err) or _tail(out)}"
    return row


# -- the sweep ---------------------------------------------------------------------------------------------
class Sweep:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args = args
        self.out = out
        self.state_root = Path(tempfile.mkdtemp(prefix="tb-perf-", dir="/run"))   # 0700, root's
        self.env = {**os.environ, "TESTBED_STATE_DIR": str(self.state_root)}
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "command": "sudo .venv/bin/python bench/perf_verbs.py" + "".join(
                f" {shlex.quote(a)}" for a in sys.argv[1:]),
            "started": _now(), "finished": None, "interrupted": None,
            "config": {"sizes": args.sizes, "repeats": args.repeats, "mininet": not args.no_mininet,
                       "dilations": args.time_dilation,
                       "timeout_per_size_s": args.timeout_per_size, "state_root": str(self.state_root)},
            "machine": machine_facts(), "versions": versions(),
            "sizes": {}, "rows": [], "notes": [],
        }
        self.mn_skip: str | None = None if not args.no_mininet else "--no-mininet"
        if args.keep_mininet:   # testbed changed, Mininet did not: its rows from the last sweep stay
            old = json.loads(out.read_text())
            kept = [r for r in old.get("rows", []) if r.get("tool") == "mininet"]
            self.doc["rows"] += kept
            # (kept rows may be kept ones already: they name the sweep that measured them, its
            # timeout and the Mininet that ran)
            cfg = old.get("config") or {}
            self.kept_sizes = {k: {"mininet_timeout_s": cfg.get("timeout_per_size_s"),
                                   **{x: v for x, v in info.items() if x.startswith("mininet")}}
                               for k, info in (old.get("sizes") or {}).items()}
            self.doc["versions"].update({x: v for x, v in (old.get("versions") or {}).items()
                                         if x in MININET_PACKAGES})
            self.doc["config"]["mininet_from"] = cfg.get("mininet_from") or old.get("started")
            self.doc["config"]["mininet_command"] = cfg.get("mininet_command") or old.get("command")
            self.doc["notes"].append(f"Mininet rows kept from the sweep of {self.doc['config']['mininet_from']} "
                                     f"({self.doc['config']['mininet_command']}); testbed measured again in this one")
            self.mn_skip = "--keep-mininet"

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.out)

    def row(self, **kw: Any) -> dict[str, Any]:
        kw.pop("stdout_text", None)   # (only the breakdown reads it: not kept)
        self.doc["rows"].append(kw)
        what = f"{kw['tool']} k={kw.get('k', '-')} {kw['verb']}" + (f" #{kw['repeat'] + 1}" if "repeat" in kw else "")
        if kw.get("error"):
            print(f"  {what}: FAILED ({kw['error'][:300]})", flush=True)
        elif kw.get("wall_s") is not None:
            print(f"  {what}: {kw['wall_s']:.3f} s", flush=True)
        return kw

    def tb(self, *args: str) -> list[str]:
        return [str(TESTBED), *args]

    # testbed ----------------------------------------------------------------------------------------------
    def help_rows(self) -> None:
        """`--help`, alternating with the bare interpreter of the same venv (the floor it is held to)."""
        for r in range(max(5, self.args.repeats)):
            self.row(tool="python", verb="-c pass", repeat=r,
                     **run_timed([str(TESTBED.parent / "python"), "-c", "pass"], self.env, 60))
            self.row(tool="testbed", verb="--help", repeat=r,
                     **run_timed(self.tb("--help"), self.env, self.args.timeout_per_size))

    def breakdown_rows(self, k: int, name: str, dilation: str) -> None:
        """Where `status --json`'s time goes, in its own process (bench/verb_breakdown.py)."""
        for r in range(self.args.repeats):
            row = run_timed([str(TESTBED.parent / "python"), str(BREAKDOWN), "status", "--json", name],
                            self.env, self.args.timeout_per_size)
            parts = None
            if row["rc"] == 0:
                with contextlib.suppress(ValueError):
                    parts = json.loads(row.pop("stdout_text", "") or "{}")
            self.row(tool="breakdown", k=k, verb="status --json", repeat=r, dilation=dilation,
                     parts=parts, **{x: v for x, v in row.items() if x != "stdout_text"})

    def testbed_cycle(self, k: int, r: int, dilation: str, warmup: bool = False) -> dict[str, Any]:
        name = f"perf{k}-{os.urandom(2).hex()}"
        mark = {"warmup": True, "dilation": dilation} if warmup else {"dilation": dilation}
        limit = self.args.timeout_per_size
        setting = dilation.removesuffix(NO_NETEM)
        without = ",".join(filter(None, [self.env.get("TESTBED_WITHOUT", "").strip(), "netem"]))
        env = {**self.env, "TESTBED_WITHOUT": without} if setting != dilation else self.env
        mem0 = _meminfo()
        up: dict[str, Any] = {}
        try:
            up = self.row(tool="testbed", k=k, verb="up", repeat=r, name=name, **mark,
                          **run_timed(self.tb("up", "fat-tree", "--name", name, "--set", f"params.k={k}",
                                              "--time-dilation", setting),
                                      env, limit))
            if up["rc"] != 0:
                return up
            mem1 = _meminfo()
            state = self._state(name)
            up["phases"] = {p: round(v, 4) for p, v in (state.get("timings") or {}).items()
                            if isinstance(v, (int, float))}
            up["time_dilation"] = state.get("time_dilation")
            lines = (state.get("resources") or {}).get("delay_lines") or []
            up["delay_lines"] = len(lines)
            up["engines"] = len({(d.get("pid"), d.get("start")) for d in lines})
            if state.get("capabilities") and "capabilities" not in self.doc["machine"] and env is self.env:
                self.doc["machine"]["capabilities"] = state["capabilities"]
                self.doc["machine"]["delay_threshold_s"] = state.get("delay_threshold_s")
            if not warmup:
                up["memory"] = {"before": mem0, "after_up": mem1, **testbed_processes(state)}
                if k == self.args.sizes[0] and r == 0:
                    self.breakdown_rows(k, name, dilation)
                for label, argv in LIGHT_VERBS:
                    for i in range(self.args.repeats):
                        self.row(tool="testbed", k=k, verb=label, repeat=r * self.args.repeats + i,
                                 dilation=dilation, **run_timed(self.tb(*(a.format(name=name) for a in argv)), env, limit))
            down = self.row(tool="testbed", k=k, verb="down", repeat=r, name=name, **mark,
                            **run_timed(self.tb("down", name), env, limit))
            if not warmup and down["rc"] == 0:
                up["memory"]["after_down"] = _meminfo()
            return up
        finally:
            with shielded():
                self._ensure_down(name, k)

    def _state(self, name: str) -> dict[str, Any]:
        try:
            return json.loads((self.state_root / name / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def _ensure_down(self, name: str, k: int) -> None:
        """After a cycle (also an interrupted or failed one): nothing of testbed `name` stays."""
        if not (self.state_root / name).exists():
            return
        row = self.row(tool="testbed", k=k, verb="down (cleanup)", name=name,
                       **run_timed(self.tb("down", name), self.env, 600))
        if (self.state_root / name).exists() or row["rc"] != 0:
            self.row(tool="testbed", k=k, verb="cleanup", name=name,
                     **run_timed(self.tb("cleanup"), self.env, 600))

    # Mininet ----------------------------------------------------------------------------------------------
    def mininet_cycle(self, k: int, r: int) -> dict[str, Any]:
        prefix = _unused_prefix()
        limit = self.args.timeout_per_size
        row: dict[str, Any] = {"tool": "mininet", "k": k, "verb": "up", "repeat": r, "prefix": prefix,
                               "t": _now(), "load1": round(os.getloadavg()[0], 2)}
        events: dict[str, dict[str, Any]] = {}
        arrived: dict[str, float] = {}
        lines: queue.Queue[str | None] = queue.Queue()
        err: deque[str] = deque(maxlen=40)
        t0 = time.perf_counter()
        p = subprocess.Popen([MN_PYTHON, str(MN_SCRIPT), "--k", str(k), "--prefix", prefix, "--timeout", str(limit)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             start_new_session=True, cwd=REPO)
        readers = [threading.Thread(target=_pump, args=(p.stdout, lines.put, True), daemon=True),
                   threading.Thread(target=_pump, args=(p.stderr, err.append, False), daemon=True)]
        for th in readers:
            th.start()

        def wait_for(done: set[str], until: float) -> bool:
            while not done & events.keys():
                try:
                    line = lines.get(timeout=max(0.05, min(1.0, until - time.perf_counter())))
                except queue.Empty:
                    if time.perf_counter() > until or p.poll() is not None and lines.empty():
                        return bool(done & events.keys())
                    continue
                if line is None:
                    return bool(done & events.keys())
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    events[ev["event"]] = ev
                    arrived[ev["event"]] = time.perf_counter() - t0
            return True

        interrupted = ""
        try:
            ended = {"usable", "timeout", "error", "interrupted", "stopped", "stop_error"}
            if not wait_for(ended, t0 + limit + 30):
                row["error"] = f"no network after {limit:g} s (build or start still running): stopped"
                _signal(p, signal.SIGINT)
            wait_for({"stopped", "stop_error"}, time.perf_counter() + max(limit, 120))
        except KeyboardInterrupt as exc:   # recorded below, after the net is stopped; then raised again
            interrupted = str(exc) or "Ctrl-C"
            row["error"] = f"interrupted ({interrupted}): the net was stopped"
        finally:
            with shielded():
                if p.poll() is None:   # interrupted, or the stop hangs: ask once more, then kill
                    _signal(p, signal.SIGINT)
                    wait_for({"stopped", "stop_error"}, time.perf_counter() + max(limit, 120))
                    _end_child(p, 10.0)
                p.wait()
                for th in readers:
                    th.join(timeout=5)
                left = _remove_prefixed(prefix, events.get("built", {}).get("pids", []))
        row["rc"] = p.returncode
        if "usable" in events:
            row["wall_s"] = round(arrived["usable"], 4)     # from spawn, like testbed's verbs
            ev = {e: events[e]["t"] for e in ("built", "started", "converged", "usable") if e in events}
            row["phases"] = {"python + import": round(arrived["usable"] - ev["usable"], 4),
                             "build (nodes, links, tc)": ev["built"],
                             "start (bridges, STP on)": round(ev["started"] - ev["built"], 4),
                             "STP convergence": round(ev["converged"] - ev["started"], 4),
                             "pings": round(ev["usable"] - ev["converged"], 4)}
            row["stp_ports"] = events["converged"].get("ports")
            row["pairs"] = events["usable"].get("pairs")
        for bad in ("timeout", "error", "interrupted"):
            if bad in events and not row.get("error"):
                row["error"] = f"{bad}: {events[bad].get('error')}"
        if "memory" in events:
            m = events["memory"]
            row["memory"] = {"before": m["before"], "after_up": m["after"], "host_rss": m["host_rss"],
                             "host_pss": m["host_pss"], "switch_rss": m["switch_rss"], "switch_pss": m["switch_pss"],
                             "mininet_process_rss": m["self_rss"]}
        if left:
            row["leftovers_removed"] = left
        if not row.get("error") and p.returncode != 0:
            row["error"] = f"exit {p.returncode}: {' | '.join(list(err)[-5:])}"
        if row.get("error"):
            row["stderr_tail"] = "\n".join(list(err)[-15:])
        self.row(**row)
        stop = events.get("stopped") or events.get("stop_error")
        failed = {"after_failed_up": True} if row.get("error") else {}   # not counted: not a usable net's stop
        if stop:
            self.row(tool="mininet", k=k, verb="stop", repeat=r, prefix=prefix, t=_now(), wall_s=stop["stop_s"],
                     rc=0 if "stopped" in events else 1, **failed,
                     **({"error": stop["error"]} if "error" in stop else {}))
        else:
            self.row(tool="mininet", k=k, verb="stop", repeat=r, prefix=prefix, t=_now(), rc=p.returncode,
                     error="net.stop() did not finish (process ended)")
        row["elapsed_s"] = round(time.perf_counter() - t0, 2)
        if interrupted:
            raise KeyboardInterrupt(f"{interrupted} during Mininet k={k}")
        return row

    # the sweep --------------------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        why = mininet_missing() if not (a.no_mininet or a.keep_mininet) else None
        if why:
            self.mn_skip = "not installed"
            self.note(f"Mininet not run: {why}")
        print(f"state root {self.state_root}; load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus", flush=True)
        print("testbed --help:", flush=True)
        self.help_rows()
        print("warm-up (k=4, not counted: fills this state root's per-boot capability cache):", flush=True)
        self.testbed_cycle(4, 0, a.time_dilation[0], warmup=True)
        self.save()
        for k in a.sizes:
            info = self.doc["sizes"][str(k)] = {**counts(k), **getattr(self, "kept_sizes", {}).get(str(k), {})}
            print(f"\nfat-tree k={k}: {counts(k)}", flush=True)
            mn_spent = 0.0
            too_big = a.mininet_max_k is not None and k > a.mininet_max_k
            if too_big and not self.mn_skip:
                info["mininet_skipped"] = f"--mininet-max-k {a.mininet_max_k}"
            for r in range(a.repeats):
                for dilation in a.time_dilation:
                    self.guarded("testbed", k, r, self.testbed_cycle, dilation)
                    self.save()
                if self.mn_skip or too_big or info.get("mininet_repeats_skipped"):
                    continue
                if mn_spent > a.timeout_per_size:
                    info["mininet_repeats_skipped"] = (f"repeats {r + 1} to {a.repeats} not run: Mininet had "
                                                       f"spent {mn_spent:.0f} s on k={k}")
                    continue
                res = self.guarded("mininet", k, r, self.mininet_cycle)
                mn_spent += res.get("elapsed_s", 0.0)
                self.save()
                if res.get("error") and ("timeout" in res["error"] or "no network after" in res["error"]):
                    self.mn_skip = f"skipped: k={k} took over {a.timeout_per_size:g} s"
                    info["mininet_timeout"] = True
                    self.note(f"Mininet k={k} did not come up within {a.timeout_per_size:g} s; bigger sizes "
                              "not tried")
            if self.mn_skip and self.mn_skip != "--keep-mininet" and not info.get("mininet_timeout"):
                info["mininet_skipped"] = self.mn_skip
            print_size(self.doc, k)

    def guarded(self, tool: str, k: int, r: int, cycle: Any, *args: Any) -> dict[str, Any]:
        """One cycle; a bug or an unexpected failure in it is recorded, and the sweep goes on."""
        try:
            return cycle(k, r, *args)
        except Exception as exc:  # noqa: BLE001 - recorded with its traceback's last frame
            import traceback

            where = traceback.extract_tb(exc.__traceback__)[-1]
            return self.row(tool=tool, k=k, verb="up", repeat=r, t=_now(), rc=None,
                            **({"dilation": args[0]} if args else {}),
                            error=f"{type(exc).__name__}: {exc} (bench/{Path(where.filename).name}:{where.lineno})")

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)
        print(f"note: {text}", flush=True)

    def finish(self) -> None:
        self.doc["finished"] = _now()
        self.doc["machine"]["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
        self.doc["machine"]["ovs_daemons_running"] = ovs_daemons()
        self.save()
        left = [p.name for p in self.state_root.iterdir() if not p.name.startswith(".")]
        if left:
            self.note(f"state root {self.state_root} kept: testbeds {left} could not be brought down")
            self.save()
        else:
            shutil.rmtree(self.state_root, ignore_errors=True)


def _pump(stream: Any, put: Any, eof: bool) -> None:
    for line in stream:
        put(line.rstrip("\n"))
    if eof:
        put(None)


def _signal(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)


def _root_ifnames() -> list[str]:
    return os.listdir("/sys/class/net")


def _unused_prefix() -> str:
    """Three letters no interface in the root namespace starts with: every name the Mininet run
    makes there carries them, so what is left with them afterwards is provably that run's."""
    names = _root_ifnames()
    for _ in range(1000):
        p = "m" + "".join(random.choice(string.ascii_lowercase) for _ in range(2))
        if not any(n.startswith(p) for n in names):
            return p
    raise RuntimeError("no unused interface-name prefix")


def _remove_prefixed(prefix: str, pids: list[list[Any]]) -> list[str]:
    """What a Mininet run left: its interfaces (by the run's prefix), its node shells (by the PIDs it
    reported, when the process still runs `bash ... mininet:NODE` for that node). Removed, and listed."""
    removed = []
    for name in _root_ifnames():
        if name.startswith(prefix):
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
            removed.append(f"interface {name}")
    for node, pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"mininet:{node}".encode() in cmd and str(node).startswith(prefix):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid} ({node})")
    return removed


def testbed_processes(state: dict[str, Any]) -> dict[str, Any]:
    """RSS/PSS/USS of testbed's processes: each worker's init and its descendants, the delay-line engines."""
    import psutil

    def tree(pid: int) -> list[Any]:
        try:
            p = psutil.Process(pid)
            return [p, *p.children(recursive=True)]
        except psutil.Error:
            return []

    def mem(procs: list[Any]) -> tuple[int, int, int, int]:
        rss = pss = uss = n = 0
        for p in procs:
            try:
                m = p.memory_full_info()
            except psutil.Error:
                continue
            rss, pss, uss, n = rss + m.rss, pss + m.pss, uss + m.uss, n + 1
        return rss, pss, uss, n

    workers = [rec.get("pid") for rec in (state.get("runtime") or {}).get("workers", {}).values()]
    w = mem([p for pid in workers if pid for p in tree(pid)])
    engines = {d["pid"] for d in (state.get("resources") or {}).get("delay_lines", [])}   # (lines share engines)
    dl = mem([p for pid in sorted(engines) for p in tree(pid)])
    return {"worker_processes": w[3], "worker_rss": w[0], "worker_pss": w[1], "worker_uss": w[2],
            "delay_line_processes": dl[3], "delay_line_rss": dl[0], "delay_line_pss": dl[1], "delay_line_uss": dl[2]}


# -- facts -------------------------------------------------------------------------------------------------
def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError):
        mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    facts: dict[str, Any] = {
        "cpu": model, "cpus": os.cpu_count(), "mem_total_bytes": mem, "kernel": os.uname().release,
        "debian": _read("/etc/debian_version"), "load_at_start": [round(x, 2) for x in os.getloadavg()],
        "bridge_nf_call_iptables": _read("/proc/sys/net/bridge/bridge-nf-call-iptables") or "n/a",
        "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "ovs_daemons_at_start": ovs_daemons(),
    }
    return facts


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _dpkg(pkg: str) -> str:
    out = _cmd(["dpkg-query", "-W", "-f", "${Status} ${Version}", pkg])
    return out.split()[-1] if out.startswith("install ok installed") else "not installed"


def versions() -> dict[str, Any]:
    from importlib import metadata

    v: dict[str, Any] = {"python": sys.version.split()[0]}
    for dist in ("testbed", "pyroute2", "psutil", "matplotlib"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            v[dist] = metadata.version(dist)
    v["git_commit"] = _cmd(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    dirty = _cmd(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    v["git_uncommitted_files"] = len(dirty.splitlines()) if dirty else 0
    for pkg in ("mininet", "openvswitch-switch", "bridge-utils", "iproute2"):
        v[pkg] = _dpkg(pkg)
    v["mininet_python"] = _cmd([MN_PYTHON, "--version"]).replace("Python ", "")
    return v


def mininet_missing() -> str | None:
    if not Path(MN_PYTHON).exists():
        return f"{MN_PYTHON} not found"
    probe = subprocess.run([MN_PYTHON, "-c", "import mininet.net, mininet.nodelib"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return "Mininet is not installed (apt-get install -y mininet bridge-utils)"
    if not shutil.which("brctl"):
        return "brctl not found: Mininet's Linux bridges need bridge-utils (apt-get install -y bridge-utils)"
    return None


def ovs_daemons() -> list[str]:
    """Open vSwitch daemons running now (Debian's mininet recommends openvswitch-switch)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name"]):
        if p.info["name"] in ("ovs-vswitchd", "ovsdb-server"):
            found.append(f"{p.info['name']} {p.info['pid']}")
    return found


# -- summaries ---------------------------------------------------------------------------------------------
def settings(doc: dict[str, Any]) -> list[str]:
    """The dilation settings measured, auto first when measured (a results file from before settings
    were a dimension measured one: its command's --time-dilation, else `none`, the default then)."""
    if doc["config"].get("dilations"):
        return list(doc["config"]["dilations"])
    words = str(doc.get("command") or "").split()
    for i, w in enumerate(words):
        if w.startswith("--time-dilation="):
            return [w.split("=", 1)[1]]
        if w == "--time-dilation" and i + 1 < len(words):
            return [words[i + 1]]
    return ["none"]


def dilation_of(doc: dict[str, Any], row: dict[str, Any]) -> str:
    return row.get("dilation") or settings(doc)[0]


def stats(doc: dict[str, Any], tool: str, k: int | None, verb: str,
          dilation: str | None = None) -> dict[str, float] | None:
    """min/median/max of the successful, counted runs of one verb (testbed's: at one dilation
    setting, the first measured when None), or None."""
    if tool == "testbed" and verb != "--help" and dilation is None:
        dilation = settings(doc)[0]
    xs = [r["wall_s"] for r in doc["rows"] if r["tool"] == tool and r.get("k") == k and r["verb"] == verb
          and not r.get("warmup") and not r.get("error") and not r.get("after_failed_up")
          and r.get("wall_s") is not None
          and (tool != "testbed" or verb == "--help" or dilation_of(doc, r) == dilation)]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def errors_of(doc: dict[str, Any], tool: str, k: int, verb: str) -> list[str]:
    return [r["error"] for r in doc["rows"] if r["tool"] == tool and r.get("k") == k and r["verb"] == verb
            and r.get("error")]


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 0.001:
        return f"{v * 1000:.2f} ms"
    return f"{v:.3g} s"


def cell(s: dict[str, float] | None, why: str = "-") -> str:
    if s is None:
        return why
    if s["n"] == 1:
        return fmt_s(s["median"])
    return f"{fmt_s(s['median'])} ({fmt_s(s['min']).removesuffix(' s')}-{fmt_s(s['max'])})"


def ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> float | None:
    if not a or not b or not b["median"]:
        return None
    return a["median"] / b["median"]


def sizes_of(doc: dict[str, Any]) -> list[int]:
    return sorted(int(k) for k in doc["sizes"])


def mininet_gap(doc: dict[str, Any], k: int) -> str:
    """What a Mininet cell shows when there is no number: "-" and, briefly, why (the notes say more)."""
    info = doc["sizes"].get(str(k), {})
    if not doc["config"].get("mininet", True):
        return "- (--no-mininet)"
    if info.get("mininet_timeout"):
        return f"- (over {info.get('mininet_timeout_s') or doc['config'].get('timeout_per_size_s', 600):g} s)"
    if info.get("mininet_skipped"):
        return f"- ({info['mininet_skipped']})"
    if errors_of(doc, "mininet", k, "up"):
        return "- (failed: see notes)"
    return "-"


def up_facts(doc: dict[str, Any], k: int, dilation: str) -> str:
    """The dilation `up` chose at this size and setting, and the delay lines and engines it made."""
    ups = [r for r in doc["rows"] if r["tool"] == "testbed" and r.get("k") == k and r["verb"] == "up"
           and not r.get("warmup") and not r.get("error") and dilation_of(doc, r) == dilation]
    factors = sorted({f"{r['time_dilation']:g}" for r in ups if isinstance(r.get("time_dilation"), (int, float))})
    lines = sorted({(r["delay_lines"], r.get("engines", 0)) for r in ups if r.get("delay_lines") is not None})
    out = f"{dilation}" + (f" (s = {', '.join(factors)})" if factors and dilation.startswith("auto") else "")
    if lines:
        out += "; " + ", ".join(f"{n} delay line(s) in {e} engine(s)" if n else "no delay line" for n, e in lines)
    return out


def print_size(doc: dict[str, Any], k: int) -> None:
    mu, md = stats(doc, "mininet", k, "up"), stats(doc, "mininet", k, "stop")
    for d in settings(doc):
        tu, td = stats(doc, "testbed", k, "up", d), stats(doc, "testbed", k, "down", d)
        print(f"k={k} {up_facts(doc, k, d)} (medians): testbed up {fmt_s(tu and tu['median'])}, "
              f"down {fmt_s(td and td['median'])}, "
              f"status --json {fmt_s((stats(doc, 'testbed', k, 'status --json', d) or {}).get('median'))}",
              flush=True)
    tu, td = stats(doc, "testbed", k, "up"), stats(doc, "testbed", k, "down")   # (the first setting)
    print(f"k={k} (medians): Mininet up {fmt_s(mu and mu['median'])}, stop {fmt_s(md and md['median'])}", flush=True)
    ru, rd = ratio(mu, tu), ratio(md, td)
    if ru or rd:
        print(f"k={k} ratio Mininet/testbed at {settings(doc)[0]} ({'Mininet from ' + doc['config']['mininet_from'] if doc['config'].get('mininet_from') else 'same run'}): up {f'{ru:.1f}x' if ru else '-'}, "
              f"stop/down {f'{rd:.1f}x' if rd else '-'}", flush=True)
    else:
        print(f"k={k} ratio Mininet/testbed: - {mininet_gap(doc, k).removeprefix('- ')}", flush=True)


# -- rendering ---------------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    series = [("testbed", "up", f"testbed up ({d})", f"C{2 * i}", "o-", d) for i, d in enumerate(settings(doc))]
    series += [("testbed", "down", f"testbed down ({d})", f"C{2 * i}", "s--", d) for i, d in enumerate(settings(doc))]
    series += [("mininet", "up", "Mininet up (STP converged)", "C3", "o-", None),
               ("mininet", "stop", "Mininet stop", "C3", "s--", None)]
    drew = False
    for tool, verb, label, color, style, dilation in series:
        xs, ys, lo, hi = [], [], [], []
        for k in sizes_of(doc):
            s = stats(doc, tool, k, verb, dilation)
            if s:
                xs.append(counts(k)["nodes"])
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, color=color, label=label, capsize=3, ms=5)
            drew = True
    if not drew:
        plt.close(fig)
        return False
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ks = sizes_of(doc)
    ax.set_xticks([counts(k)["nodes"] for k in ks], [f"{counts(k)['nodes']}\nk={k}" for k in ks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g} s"))
    ax.set_xlabel("nodes (workers + switches) of the fat-tree")
    ax.set_ylabel("seconds, from Enter to prompt (median; bars: min-max)")
    ax.set_title("Fat-tree up and down: testbed vs Mininet (same machine"
                 + (", Mininet from an earlier sweep)" if doc["config"].get("mininet_from") else ", same run)"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2 ** 20:.2f} MiB"


def _kib(b: float | None) -> str:
    return "-" if b is None else f"{b / 1024:.0f} KiB"


def _median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def render(doc: dict[str, Any], plotted: bool, plot_rel: str) -> str:
    ks = sizes_of(doc)
    m, v, cfg = doc["machine"], doc["versions"], doc["config"]
    ovs = ", ".join(m.get("ovs_daemons_running") or []) or "none"
    ovs0 = ", ".join(m.get("ovs_daemons_at_start") or []) or ("none" if "ovs_daemons_at_start" in m else "not recorded")
    out = ["# Performance: what users wait for", "",
           ("<!-- generated by bench/perf_verbs.py from bench/results/performance.json; "
            "edit the script, not this file -->"), "",
           (f"Produced by `{doc['command']}` (as root, from the repository root), "
            f"{doc['started']} to {doc.get('finished') or '(unfinished)'}"
            + (f"; **interrupted**: {doc['interrupted']}" if doc.get("interrupted") else "") + ". "
            "`.venv/bin/python bench/perf_verbs.py --render` rewrites this page from the JSON without measuring."),
           "",
           (f"Machine: {m.get('cpu') or '?'}, {m.get('cpus')} CPUs, "
            f"{m.get('mem_total_bytes', 0) / 2 ** 30:.0f} GiB, kernel {m.get('kernel')}, Debian {m.get('debian')}; "
            f"load average at the start {m.get('load_at_start')}, at the end {m.get('load_at_end')} (1, 5, 15 min; "
            "each row of the JSON has the 1-minute load when it ran). "
            f"testbed {v.get('testbed')} at {str(v.get('git_commit'))[:12]}"
            + (f" with {v['git_uncommitted_files']} uncommitted file(s)" if v.get("git_uncommitted_files") else "")
            + f", Python {v.get('python')}, pyroute2 {v.get('pyroute2')}; Mininet {v.get('mininet')} "
            f"(Debian's, under Python {v.get('mininet_python')}), bridge-utils {v.get('bridge-utils')}, "
            f"openvswitch-switch {v.get('openvswitch-switch')} (pulled in as Mininet's recommendation, not used; "
            f"Open vSwitch daemons running at the start: {ovs0}, at the end: {ovs})."),
           "", kernel_line(m), "", "## Up, down and status against Mininet", ""]
    head = ["fat-tree", "workers", "switches", "links", "dilation", "testbed up", "testbed down", "status --json",
            "Mininet up", "Mininet stop", "up: Mininet / testbed", "stop: Mininet / testbed down"]
    rows = []
    for k in ks:
        c = counts(k)
        mu, md = stats(doc, "mininet", k, "up"), stats(doc, "mininet", k, "stop")
        gap = mininet_gap(doc, k)
        for d in settings(doc):
            tu, td = stats(doc, "testbed", k, "up", d), stats(doc, "testbed", k, "down", d)
            ru, rd = ratio(mu, tu), ratio(md, td)
            terr = [r["error"] for r in doc["rows"] if r["tool"] == "testbed" and r.get("k") == k
                    and r["verb"] == "up" and r.get("error") and dilation_of(doc, r) == d]
            rows.append([f"k={k}", str(c["workers"]), str(c["switches"]), str(c["links"]), up_facts(doc, k, d),
                         cell(tu, f"- ({terr[-1][:90]})" if terr else "-"), cell(td),
                         cell(stats(doc, "testbed", k, "status --json", d)), cell(mu, gap),
                         cell(md, "-" if mu else gap), f"{ru:.1f}x" if ru else "-", f"{rd:.1f}x" if rd else "-"])
    out += _table(head, rows)
    out += ["", (f"Medians of {cfg.get('repeats')} runs, (min-max) when there were more than one. Each testbed "
                 "time is the `.venv/bin/testbed` process from spawn to exit (Python's start and imports "
                 "included). Mininet up is from the spawn of its Python process until the fabric is usable: STP "
                 "settled (no bridge port listening or learning) and then one round of pings between sampled host "
                 "pairs all answered; Mininet stop is `net.stop()`. Ratios are of the medians"
                 + (f" (Mininet's from the sweep of {cfg['mininet_from']}, on the same machine: testbed changed "
                    "since, Mininet did not)" if cfg.get("mininet_from") else " from this run") + ". With "
                 "STP on, Linux bridges hold every port for 2 x the forward delay (15 s by default) before "
                 "forwarding, so Mininet's up cannot go under ~30 s at any size; the build and start before that "
                 "are in Mininet's phase table below."), ""]
    if plotted:
        out += [f"![up and down time against nodes]({plot_rel})", ""]

    out += ["## Every verb, as a process", ""]
    verbs = [vb for vb in VERB_ORDER
             if any(stats(doc, "testbed", k, vb, d) for k in ks for d in settings(doc)) or vb == "--help"]
    head = ["fat-tree", "dilation"] + [f"`{vb}`" for vb in verbs]
    rows = [["(any)", "", cell(stats(doc, "testbed", None, "--help"))] + [""] * (len(verbs) - 1)]
    rows += [[f"k={k}", d, ""] + [cell(stats(doc, "testbed", k, vb, d)) for vb in verbs[1:]]
             for k in ks for d in settings(doc)]
    out += _table(head, rows)
    out += ["", ("`link set` changes the bandwidth of w0's link (the whole process: start, lock, state, tc); "
                 "`link reset` puts it back. `ls`, `status` and `link show` only read the state."), ""]

    out += _breakdown_section(doc)
    out += ["## Where `up`'s time goes", ""]
    phase_rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    overhead: dict[tuple[int, str], list[float]] = {}
    for r in doc["rows"]:
        if r["tool"] == "testbed" and r["verb"] == "up" and not r.get("warmup") and not r.get("error") \
                and r.get("phases"):
            key = (r["k"], dilation_of(doc, r))
            phase_rows.setdefault(key, []).append(r["phases"])
            if "total" in r["phases"]:
                overhead.setdefault(key, []).append(r["wall_s"] - r["phases"]["total"])
    names = [p for p in PHASE_ORDER if any(p in ph for rows_ in phase_rows.values() for ph in rows_)]
    names += sorted({p for rows_ in phase_rows.values() for ph in rows_ for p in ph} - set(names))
    pk = [(k, d) for k in ks for d in settings(doc) if (k, d) in phase_rows]
    if pk:
        rows = []
        for p in names:
            label = "**total** (lifecycle.up)" if p == "total" else f"{p} (in {NESTED[p]})" if p in NESTED else p
            rows.append([label] + [fmt_s(_median_of([ph[p] for ph in phase_rows[key] if p in ph])) for key in pk])
        rows.append(["dilation chosen; delay lines"] + [up_facts(doc, k, d) for k, d in pk])
        rows.append(["process overhead (wall - total)"] + [fmt_s(_median_of(overhead.get(key, []))) for key in pk])
        rows.append(["**wall** (the process)"] + [fmt_s((stats(doc, "testbed", k, "up", d) or {}).get("median"))
                                                  for k, d in pk])
        out += _table(["phase"] + [f"k={k} {d}" for k, d in pk], rows)
        out += ["", ("Medians per phase over the runs (lifecycle's `timings` in the state file). The worker "
                     "inits start right after their namespaces and come up while the fabric is built, so `start "
                     "workers` (launch plus the final wait) overlaps the phases after it, and the phases do not "
                     "add up to the total. Process overhead: the interpreter, imports, loading the topology and "
                     "this boot's calibration, and printing the summary. The capability probe (`capabilities`) is "
                     "cached per boot in the state root; the bench's warm-up `up` filled it."), ""]
    mn_phases: dict[int, list[dict[str, float]]] = {}
    blocking: dict[int, Any] = {}
    for r in doc["rows"]:
        if r["tool"] == "mininet" and r["verb"] == "up" and r.get("phases"):
            mn_phases.setdefault(r["k"], []).append(r["phases"])
            blocking[r["k"]] = (r.get("stp_ports") or {}).get("blocking")
    mk = [k for k in ks if k in mn_phases]
    if mk:
        pnames = list(mn_phases[mk[0]][0])
        rows = [[p] + [fmt_s(_median_of([ph[p] for ph in mn_phases[k] if p in ph])) for k in mk] for p in pnames]
        rows.append(["started (spawn to net.start() returned)"]
                    + [fmt_s(_median_of([sum(v for n, v in ph.items() if n not in ("STP convergence", "pings"))
                                         for ph in mn_phases[k]])) for k in mk])
        rows.append(["**up** (spawn to usable)"] + [fmt_s((stats(doc, "mininet", k, "up") or {}).get("median"))
                                                   for k in mk])
        rows.append(["blocking bridge ports when settled"] + [str(blocking.get(k)) for k in mk])
        rows.append(["expected: switch-switch links - switches + 1"]
                    + [str(k ** 3 // 2 - 5 * k * k // 4 + 1) for k in mk])
        out += ["Mininet's up, by phase (medians):", ""]
        out += _table(["phase"] + [f"k={k}" for k in mk], rows)
        out += ["", ("\"started\" is where `net.start()` returns and where a timing of net.start() alone would "
                     "stop the clock; nothing crosses the fabric until STP has settled. A spanning tree over S "
                     "switches keeps S - 1 of the switch-to-switch links; each other one has one blocking end, so "
                     "the count of blocking ports says STP settled on a tree."), ""]

    rows = [row for k in ks for d in settings(doc) if (row := _memory_row(doc, k, d))]
    if rows:
        out += ["## Memory", ""]
        out += _table(["fat-tree", "dilation", "testbed: per worker (RSS / PSS / USS)", "testbed: per switch",
                       "testbed: delay-line processes (engines), PSS in all", "kernel Slab per node (testbed)",
                       "MemAvailable drop per node (testbed)", "Mininet: per host shell (RSS / PSS)",
                       "MemAvailable drop per node (Mininet)"], rows)
        out += ["", ("Per worker: the worker's init (`testbed-init NODE`) and anything under it, summed by psutil "
                     "and divided by the workers (RSS counts shared pages in full; PSS shares them out; USS is "
                     "what the process alone holds, what its exit frees). A switch is a network namespace with a "
                     "bridge and routes and no process: its cost is kernel memory only. Delay-line engines exist "
                     "only when links need a delay and the kernel has no netem (a few per testbed, each serving "
                     "many links). Kernel columns: the "
                     "machine-wide /proc/meminfo Slab increase and MemAvailable decrease from before `up` to just "
                     "after it, divided by the nodes (workers + switches): namespaces, devices, qdiscs, routes and "
                     "neighbours, plus (MemAvailable) the processes. Anything else running at the same time moves "
                     "them, so small sizes are noisy. Mininet: one bash per host (and one per switch, not counted "
                     "here) under mnexec."), ""]

    out += ["## Targets (issues 13 and 25)", ""]
    rows = _target_rows(doc)
    if rows:
        out += _table(["target", "measured (median)", ""], rows)
        out += ["", ("Each target at every `--time-dilation` setting measured"
                     + (" (`auto` is what a user gets; `none` is real time, as Mininet runs)"
                        if len(settings(doc)) > 1 else f" (here `{settings(doc)[0]}`)")
                     + ". Sizes not measured in this run have no row. The link-change target (<= 50 ms at k=16) "
                     "is about the change taking effect; `link set` above is the whole process."), ""]
    else:
        out += ["No target's size was measured in this run.", ""]

    notes = _notes(doc, ks)
    if notes:
        out += ["## Notes, errors and skips", ""] + [f"- {n}" for n in notes] + [""]
    out += ["## How it is measured", ""] + [f"- {line}" for line in METHOD] + [""]
    return "\n".join(out)


METHOD = (
    ("The full sweep, on a quiet machine: `sudo .venv/bin/python bench/perf_verbs.py` (k = 4, 6, 8, 12, 16; 3 "
     "repeats; Mininet as far as it comes up within 600 s a size). Mininet needs `apt-get install -y mininet "
     "bridge-utils`; without it the sweep says so and measures testbed alone (`--no-mininet` does that on "
     "purpose). `--sizes 4,8 --repeats 2` for a quick one; `--timeout-per-size S` to change the limit."),
    ("Each testbed verb is a process (`subprocess.Popen` of `.venv/bin/testbed`, no shell, output to a pipe), "
     "timed from spawn to exit with `time.perf_counter`, repeated and summarised as min / median / max. "
     "hyperfine (Debian has 1.15) was not used: `up` and `down` must alternate on one testbed with the state "
     "read in between (phases, memory), a failure must be recorded and cleaned up rather than abort the sweep, "
     "and Mininet's up ends on an event inside a running process, not on an exit. Spawning through Popen costs "
     "about what a shell's fork and exec do."),
    ("testbed runs under a private state root (`TESTBED_STATE_DIR`, a directory made for the run in /run): "
     "`up fat-tree --set params.k=K --time-dilation D` with the topology's defaults (10 Gbit/s and 2 us per "
     "tier, the netns runtime), for each setting D of `--time-dilation` (default `auto,none`). `auto` is what "
     "a user gets: it uses this boot's calibration when there is one (/run/testbed/.calibration.json, outside "
     "the private root), and the page's dilation column says what it chose. The capability probe is cached "
     "per state root, so the warm-up `up` pays what the first `up` of a boot pays for it. A setting D+no-netem "
     "(e.g. `auto+no-netem`) runs `up` with `TESTBED_WITHOUT=netem`: on a kernel with sch_netem, every delayed "
     "link then takes the delay line, as on a kernel without it (on one without, it is the same as D)."),
    ("Alternation: for each size and repeat, testbed's cycle runs once per dilation setting, then Mininet's, "
     "so a slow drift of the machine hits all of them."),
    ("Mininet: `bench/mininet_fattree.py` under Debian's python3 builds `Mininet(topo=FatTree(k), "
     "switch=LinuxBridge(stp=True), link=TCLink(bw=1000), controller=None, autoSetMacs=True)`, the API form of "
     "`mn --custom bench/mininet_fattree.py --topo fattree,K --switch lxbr,stp=1 --link tc,bw=1000 --controller "
     "none`. Debian's mininet package depends on cgroup-tools, iperf, net-tools, socat and telnet, and "
     "recommends openvswitch-switch (installed by default, with its systemd unit; Linux bridges need no OVS "
     "daemon); Linux bridges need bridge-utils (brctl), which the package does not pull in. Every node name "
     "carries a prefix no interface had before the run, so Mininet's own `ip link del` of the names it is about "
     "to create, and the bench's check for leftovers, touch only that run's interfaces; `mn -c` (it kills by "
     "name) is never used. Only process-local rlimits are raised, as `mn` does; `mn`'s machine-wide sysctls "
     "are left alone."),
)


def _breakdown_section(doc: dict[str, Any]) -> list[str]:
    """Where a read-only verb's time goes (bench/verb_breakdown.py in its own process), against the
    bare interpreter."""
    rows_ = [r for r in doc["rows"] if r["tool"] == "breakdown" and r.get("parts") and r["parts"].get("rc") == 0]
    py = stats(doc, "python", None, "-c pass")
    if not rows_ or not py:
        return []
    r0 = next((r for r in rows_ if dilation_of(doc, r) == settings(doc)[0]), rows_[0])
    rows_ = [r for r in rows_ if r.get("k") == r0.get("k") and dilation_of(doc, r) == dilation_of(doc, r0)]
    parts = [p for p in r0["parts"] if p not in ("rc", "in process")]
    table = [["interpreter start (`python -c pass`, whole process)", fmt_s(py["median"])]]
    table += [[p, fmt_s(_median_of([r["parts"][p] for r in rows_ if p in r["parts"]]))] for p in parts]
    table.append(["**the process** (spawn to exit)", fmt_s(_median_of([r["wall_s"] for r in rows_]))])
    return (["## Where a read-only verb's time goes", ""]
            + _table([f"`status --json`, k={r0['k']} ({dilation_of(doc, r0)})", "median"], table)
            + ["", ("`bench/verb_breakdown.py` runs the verb unchanged in a fresh interpreter and times the "
                    "argument parsing and the state's read and validation through wrappers. The interpreter's "
                    "own start is before its first line, so it is taken from `python -c pass` of the same venv. "
                    "typer (0.2x) builds a pydantic TypeAdapter per parameter while it parses the arguments, "
                    "and imports pydantic for it; the state's validation builds the state schema (pydantic). "
                    "Both are a floor for any verb that reads a testbed (`--help` needs neither): the state is "
                    "validated on every read because it is input from disk."),
               ""])


def kernel_line(m: dict[str, Any]) -> str:
    """What the kernel offers the data plane, from the capability probe of the sweep's first `up`."""
    caps = m.get("capabilities")
    if not caps:
        return "Kernel capabilities: not recorded in this results file."
    have = [c for c in ("netem", "htb", "tbf", "bpf", "nftables", "tun", "ifb") if caps.get(c)]
    lack = [c for c in ("netem", "htb", "tbf", "bpf", "nftables", "tun", "ifb") if c in caps and not caps[c]]
    floor = caps.get("latency_floor_s")
    delays = ("delays by sch_netem" if caps.get("netem") else
              "**no sch_netem**: a link whose delay (dilated) passes the threshold"
              + (f" ({m['delay_threshold_s'] * 1e6:.0f} us)" if m.get("delay_threshold_s") else "")
              + " is carried by a userspace delay line (testbed/net/delay_engine.py)" if caps.get("delay_line")
              else "no sch_netem and no delay lines: delays are not emulated")
    return (f"Kernel capabilities (the probe of the first `up`): {', '.join(have) or 'none'} present"
            + (f"; {', '.join(lack)} absent" if lack else "") + f"; {delays}"
            + (f"; latency floor (one unshaped hop, one way) {floor * 1e6:.1f} us" if floor else "") + ".")


def _memory_row(doc: dict[str, Any], k: int, dilation: str) -> list[str] | None:
    c = counts(k)
    tm = [r["memory"] for r in doc["rows"] if r["tool"] == "testbed" and r.get("k") == k and r["verb"] == "up"
          and r.get("memory") and not r.get("warmup") and dilation_of(doc, r) == dilation]
    mm = [r["memory"] for r in doc["rows"] if r["tool"] == "mininet" and r.get("k") == k and r.get("memory")]
    if not tm and not mm:
        return None

    def per(ms: list[dict[str, Any]], key: str, n: int) -> float | None:
        return _median_of([x[key] / n for x in ms if x.get(key) is not None])

    def drop(ms: list[dict[str, Any]], key: str, sign: int) -> float | None:
        return _median_of([sign * (x["after_up"][key] - x["before"][key]) / c["nodes"] for x in ms])

    w = [x for x in tm if x.get("worker_processes")]
    nw = c["workers"]
    return [f"k={k}", dilation,
            (f"{_mib(per(w, 'worker_rss', nw))} / {_mib(per(w, 'worker_pss', nw))} / "
             f"{_mib(per(w, 'worker_uss', nw))} ({w[0]['worker_processes'] / nw:g} process)") if w else "-",
            "no process (a namespace)" if tm else "-",
            (f"{tm[0]['delay_line_processes']}, PSS {_mib(_median_of([x['delay_line_pss'] for x in tm]))}"
             if tm else "-"),
            _kib(drop(tm, "Slab", 1)) if tm else "-",
            _kib(drop(tm, "MemAvailable", -1)) if tm else "-",
            f"{_mib(per(mm, 'host_rss', nw))} / {_mib(per(mm, 'host_pss', nw))}" if mm else "-",
            _kib(drop(mm, "MemAvailable", -1)) if mm else "-"]


def _target_rows(doc: dict[str, Any]) -> list[list[str]]:
    """Every target at every dilation setting measured (a row each: none is picked for the verdict)."""
    rows = []
    hs = stats(doc, "testbed", None, "--help")
    if hs:
        rows.append([f"`testbed --help` <= {HELP_TARGET * 1000:.0f} ms", fmt_s(hs["median"]),
                     _verdict(hs["median"], HELP_TARGET)])
    py = stats(doc, "python", None, "-c pass")
    ks = sizes_of(doc)
    several = len(settings(doc)) > 1

    def at(d: str) -> str:
        return f", {d}" if several else ""

    if py and hs:
        f = hs["median"] / py["median"]
        rows.append([f"`--help` within {INTERPRETER_FACTOR:g}x of `python -c pass` ({fmt_s(py['median'])})",
                     f"{fmt_s(hs['median'])}: {f:.1f}x", _verdict(f, INTERPRETER_FACTOR)])
    for d in settings(doc):
        for verb in READ_ONLY_VERBS[1:] if py and ks else ():
            s = stats(doc, "testbed", ks[0], verb, d)
            if s:
                f = s["median"] / py["median"]
                rows.append([f"`{verb}` (k={ks[0]}{at(d)}) within {INTERPRETER_FACTOR:g}x of `python -c pass` "
                             f"({fmt_s(py['median'])})", f"{fmt_s(s['median'])}: {f:.1f}x",
                             _verdict(f, INTERPRETER_FACTOR)])
        for k, tg in TARGETS.items():
            for verb, limit in tg.items():
                s = stats(doc, "testbed", k, verb, d)
                if s:
                    rows.append([f"k={k}{at(d)}: `{verb}` <= {limit:g} s", fmt_s(s["median"]),
                                 _verdict(s["median"], limit)])
        for k, want in RATIO_TARGETS.items():
            ru = ratio(stats(doc, "mininet", k, "up"), stats(doc, "testbed", k, "up", d))
            if ru:
                rows.append([f"k={k}{at(d)}: up >= {want:g}x faster than Mininet's", f"{ru:.1f}x",
                             "met" if ru >= want else f"missed ({want / ru:.1f}x short)"])
        s8, s16 = stats(doc, "testbed", 8, "up", d), stats(doc, "testbed", 16, "up", d)
        if s8 and s16:
            per8, per16 = s8["median"] / counts(8)["nodes"], s16["median"] / counts(16)["nodes"]
            rows.append([f"up time per node at k=16 no worse than at k=8{' (' + d + ')' if several else ''}",
                         f"{per16 * 1000:.1f} ms vs {per8 * 1000:.1f} ms", _verdict(per16, per8)])
    return rows


def _notes(doc: dict[str, Any], ks: list[int]) -> list[str]:
    notes = list(doc.get("notes") or [])
    for r in doc["rows"]:
        if r.get("error"):
            notes.append(f"{r['tool']} k={r.get('k', '-')} {r['verb']}: {r['error'][:300]}")
        if r.get("leftovers_removed"):
            notes.append(f"Mininet k={r['k']}: removed what its run left: {', '.join(r['leftovers_removed'][:10])}")
    for k in ks:
        if doc["sizes"][str(k)].get("mininet_repeats_skipped"):
            notes.append(f"Mininet k={k}: {doc['sizes'][str(k)]['mininet_repeats_skipped']}")
    warm = [r for r in doc["rows"] if r.get("warmup") and r["verb"] == "up"]
    if warm:
        notes.append(f"warm-up `up` (k=4, --time-dilation {dilation_of(doc, warm[0])}, the first in a fresh state "
                     "root: it pays the capability probe, as the first `up` of a boot does; not counted above): "
                     f"{fmt_s(warm[0].get('wall_s'))}")
    return notes


def _verdict(value: float, limit: float) -> str:
    return "met" if value <= limit else f"missed by {(value / limit - 1) * 100:.0f}%"


def outputs(results: Path) -> tuple[Path, Path]:
    """Where the page and the plot go: docs/ for the default results file, beside any other one."""
    if results.resolve() == RESULTS.resolve():
        return DOC, PLOT
    return results.with_suffix(".md"), results.with_name(results.stem + "-up_down.png")


def render_files(doc: dict[str, Any], results: Path) -> None:
    page, png = outputs(results)
    plotted = plot(doc, png)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render(doc, plotted, os.path.relpath(png, page.parent)) + "\n")
    print(f"wrote {page}" + (f" and {png}" if plotted else ""), flush=True)


def parse_sizes(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: comma-separated even numbers, e.g. 4,6,8 (got {text!r})")
    if not ks or any(k < 2 or k % 2 for k in ks):
        raise argparse.ArgumentTypeError(f"--sizes: every k must be even and >= 2 (got {text!r})")
    return ks


NO_NETEM = "+no-netem"   # a setting's suffix: its testbeds come up with TESTBED_WITHOUT=netem


def parse_dilations(text: str) -> list[str]:
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        x, flag = (x[:-len(NO_NETEM)], NO_NETEM) if x.endswith(NO_NETEM) else (x, "")
        if x not in ("auto", "none"):
            try:
                f = float(x)
            except ValueError:
                f = math.nan
            if not (math.isfinite(f) and f >= 1):
                raise argparse.ArgumentTypeError(f"--time-dilation: auto, none or a finite factor >= 1, each "
                                                 f"optionally with {NO_NETEM}, comma-separated (got {x!r} in {text!r})")
            x = f"{f:g}"
        out.append(x + flag)
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--time-dilation: one or more distinct settings (got {text!r})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                    help="fat-tree k values, comma-separated (default 4,6,8,12,16)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size and verb (default 3)")
    ap.add_argument("--no-mininet", action="store_true", help="testbed only")
    ap.add_argument("--keep-mininet", action="store_true",
                    help="measure testbed only and keep the Mininet rows of the results file (a later "
                         "testbed change against an unchanged baseline; the page says when each was measured)")
    ap.add_argument("--time-dilation", type=parse_dilations, default=["auto", "none"],
                    help="testbed up's --time-dilation settings, comma-separated, each measured at every size "
                         "(default auto,none: what a user gets, and real time as Mininet runs; auto dilates a "
                         "k=16 fat-tree's links by hundreds and, on a kernel without netem, puts every link on "
                         "a delay line); targets are judged on the first")
    ap.add_argument("--mininet-max-k", type=int, default=None,
                    help="run Mininet only up to this k (its k=16 needs about 8 minutes to come up here, and "
                         "as long to stop); bigger sizes measure testbed alone, and the page says why")
    ap.add_argument("--timeout-per-size", type=float, default=600.0,
                    help="seconds one up may take (Mininet's: then bigger sizes are skipped); default 600")
    ap.add_argument("--render", action="store_true", help="only write docs/performance.md from the JSON")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help=f"results file (default {RESULTS.relative_to(REPO)}, rendered to docs/performance.md; "
                         "any other is rendered beside itself)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.render:
        try:
            doc = json.loads(args.out.read_text())
        except (OSError, ValueError) as exc:
            print(f"cannot read {args.out}: {exc}", file=sys.stderr)
            return 2
        render_files(doc, args.out)
        return 0
    if os.geteuid() != 0:
        print("perf_verbs measures `testbed up` and Mininet: run it as root", file=sys.stderr)
        return 2
    if not TESTBED.exists():
        print(f"{TESTBED} not found: make the venv first", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    sweep = Sweep(args, args.out)
    rc = 0
    try:
        sweep.run()
    except KeyboardInterrupt as exc:
        sweep.doc["interrupted"] = f"{_now()}: {str(exc) or 'Ctrl-C'}"
        print("\ninterrupted: everything brought up was brought down; partial results kept", flush=True)
        rc = 130
    finally:
        with shielded():
            sweep.finish()
            render_files(sweep.doc, args.out)
    print("\nsummary (ratios are Mininet / testbed, this run):")
    for k in sizes_of(sweep.doc):
        print_size(sweep.doc, k)
    return rc


if __name__ == "__main__":
    sys.exit(main())
