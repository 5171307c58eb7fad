"""Running a sweep: each point's testbed, its runs, their verdicts, the sweep directory.

For every run of the plan (points in order, a point's repeats one after the other):
1. The testbed is brought to the point. When the testbed up now (made by this sweep) has the
   point's topology but for link profiles, and `up` would choose the same time dilation for the
   point, the links that differ are changed in place (testbed.faults.control.link_set, as
   `testbed link set` and scenario `set:` do); a link that would need a delay line that it lacks
   (or has one it would not get) rules that out. Otherwise the testbed is brought down and up
   again (testbed.lifecycle). A point with a scenario always starts from its topology's own
   profiles (the scenario's end restores them).
2. The job runs: the main job (testbed.mainjob: the training on every worker; the expected
   iteration from the slowest rank's own compute and the model's all_reduce), a command
   (testbed.jobs.run) or the point's scenario (testbed.faults.player). The run's topology is the
   one its links run at (the state's profiles), so the model judges what ran.
3. testbed.report judges it; the row goes to results/RUN.json, the table and plots are made again.

The sweep directory (sweeps/NAME by default) holds sweep.json (the plan and its fingerprint),
results/, the run directories (runs/), table.csv, table.json and the plots. Running the same
sweep again continues where it stopped (the runs that have a row are not run again); a directory
of another plan is refused. Ctrl-C stops the run going on (it is not kept), writes the table and
plots of what is done and brings the testbed down. One sweep at a time per directory (a lock).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from testbed import safeio
from testbed.errors import TestbedError
from testbed.sweep import plots as sweep_plots
from testbed.sweep import table
from testbed.sweep.plan import (Plan, Point, Run, direction_changes, effective_topology, estimate_seconds,
                                format_duration, profile_changes)
from testbed.topology.model import Topology

STATE = "sweep.json"
LOCK = ".lock"
PROGRESS_EVERY_S = 15.0


class SweepError(TestbedError):
    exit_code = 2


FRESH, IN_PLACE, KEPT = "fresh", "in place", "kept"


@dataclass
class Outcome:
    status: str                          # "complete" | "interrupted" | "failed"
    done: int
    total: int
    files: list[Path] = field(default_factory=list)
    error: str | None = None


# -- the directory -------------------------------------------------------------------------------------------


def default_directory(plan: Plan) -> Path:
    return Path("sweeps") / plan.sweep.name


class Directory:
    """A sweep directory, locked for this process while open."""

    def __init__(self, path: Path, plan: Plan):
        self.path = Path(path)
        self.plan = plan
        self._lock_fd: int | None = None

    def open(self, restart: bool = False) -> dict[str, Any]:
        """Lock it, check it holds this plan (or nothing yet), write sweep.json; returns the earlier
        sweep.json (empty for a new directory)."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = safeio.open_beneath(self.path, LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SweepError(f"{self.path}: another `testbed sweep` is using this directory") from None
        self._lock_fd = fd
        before = self.read_state()
        if before and before.get("fingerprint") != self.plan.fingerprint() and not restart:
            self.close()
            raise SweepError(f"{self.path} holds another sweep ({before.get('name')!r}, other points, job or "
                             "repeats): give another --dir, or --restart to start this one there afresh")
        if restart:
            for key in [r.key for r in self.plan.runs] + [f.stem for f in (self.path / table.RESULTS).glob("*.json")]:
                try:
                    (self.path / table.RESULTS / f"{key}.json").unlink()
                except FileNotFoundError:
                    pass
            before = {}
        return before

    def read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(safeio.read_regular(self.path / STATE, 16 << 20))
        except (OSError, ValueError, safeio.Unsafe):
            return {}
        return data if isinstance(data, dict) else {}

    def write_state(self, **fields: Any) -> None:
        doc = {**self.read_state(), **fields, "name": self.plan.sweep.name, "fingerprint": self.plan.fingerprint(),
               "plan": self.plan.to_json()}
        safeio.write_beneath(self.path, STATE, json.dumps(doc, indent=1, default=str).encode())

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# -- reaching a point ----------------------------------------------------------------------------------------


def same_dilation(setting: str, topo: Topology, st: dict[str, Any] | None, machine: Any, n_gpus: int,
                  cores: int, other: tuple[str, Topology] | None = None) -> bool:
    """Whether `up` would choose for `topo` at `setting` the factor (and CPU cap) the testbed has
    (its state `st`), or that it would choose for `other` (a setting, a topology)."""
    from testbed.topology.dilation import Choice, choose
    from testbed.topology.plan import plan_network

    def choice(s: str, t: Topology) -> Any:
        return choose(s if s != "none" else None, t, plan_network(t), n_gpus=n_gpus, n_cpus=cores, constants=machine)

    try:
        new = choice(setting, topo)
        old = Choice.from_json(st["dilation"]) if st is not None else choice(*other)   # type: ignore[misc]
    except (ValueError, KeyError, TypeError):
        return False
    return (abs(new.factor - old.factor) < 1e-9 and new.cap_cpu == old.cap_cpu
            and abs(new.cap_cores - old.cap_cores) < 1e-9)


def predict_builds(plan: Plan, runs: list[Run], machine: Any, cores: int, first_up: bool = True) -> list[bool]:
    """For each run, whether it should need a fresh `up` (the dry run's and the estimate's guess;
    the runner decides with the live testbed in hand)."""
    out = []
    prev: Point | None = None
    for i, run in enumerate(runs):
        p = run.point
        if prev is None:
            build = first_up
        elif p is prev:
            build = False
        else:
            changes = profile_changes(plan.topology(prev), plan.topology(p))
            build = (changes is None or (p.scenario is not None and bool(changes))
                     or not same_dilation(p.dilation, plan.topology(p), None, machine, 0, cores,
                                          other=(prev.dilation, plan.topology(prev))))
        out.append(build)
        prev = p
    return out


def _gpus(st: dict[str, Any]) -> int:
    return len({u for us in ((st.get("gpu") or {}).get("assignment") or {}).values() for u in us})


def _delay_line_links(st: dict[str, Any]) -> set[int]:
    out = set()
    for rec in (st.get("resources") or {}).get("delay_lines") or []:
        i = rec.get("link") if isinstance(rec, dict) else None
        if isinstance(i, int):
            out.add(i)
    return out


def in_place_problem(st: dict[str, Any], changes: list[tuple[int, Any, Any]]) -> str | None:
    """Why changing these links in place would not give what a fresh `up` builds (None: it would):
    a link that needs a delay line and has none, or has one that a fresh `up` would not make."""
    from testbed.net.builder import needs_delay_line
    from testbed.net.capabilities import Capabilities
    from testbed.topology.dilation import dilate

    caps = Capabilities.from_json(st["capabilities"]) if isinstance(st.get("capabilities"), dict) else None
    if caps is None:
        return "the state records no capabilities"
    s = float(st.get("time_dilation") or 1.0)
    lines = _delay_line_links(st)
    topo = st["topology"]
    for i, ab, ba in changes:
        wants = needs_delay_line(dilate(ab, s), caps) or needs_delay_line(dilate(ba, s), caps)
        if wants != (i in lines):
            a, b = topo["links"][i]["endpoints"]
            return (f"link {a}-{b} {'needs a delay line, which it lacks' if wants else 'is a delay line, which a fresh up would not make'}")
        if (ab.loss or ba.loss) and not caps.can_lose:
            return "loss needs sch_netem or cls_bpf"
    return None


# -- the runner ----------------------------------------------------------------------------------------------


class Runner:
    """Runs a plan in a sweep directory. say: progress lines; echo: the ranks' output (None: quiet)."""

    def __init__(self, plan: Plan, directory: Directory, *, say: Callable[[str], None],
                 echo: Callable[[str], None] | None = None, keep_up: bool = False, workdir: str | None = None):
        self.plan = plan
        self.dir = directory
        self.say = say
        self.echo = echo
        self.keep_up = keep_up
        self.workdir = workdir or os.getcwd()
        self.name = plan.sweep.testbed
        self.machine: Any = None
        self.run_s: list[float] = []
        self.build_s: list[float] = []
        self.made: str | None = None            # the `created` stamp of the testbed this sweep brought up

    # the testbed

    def _ours(self, st: dict[str, Any]) -> bool:
        return bool(self.made) and st.get("created") == self.made

    def _down(self) -> None:
        from testbed import lifecycle, store

        if store.exists(self.name):
            lifecycle.down(self.name)
        self.made = None

    def _up(self, point: Point) -> None:
        from testbed import lifecycle

        st = lifecycle.up(self.plan.topology(point), self.name, time_dilation=point.dilation, machine=self.machine)
        self.made = st.get("created")
        self.dir.write_state(testbed={"name": self.name, "created": self.made})

    def reach(self, point: Point) -> str:
        """Bring the testbed to `point`: FRESH, IN_PLACE or KEPT (it was there already)."""
        from testbed import lifecycle, store

        topo = self.plan.topology(point)
        if store.exists(self.name):
            st = lifecycle.load(self.name)
            if not self._ours(st):
                raise SweepError(f"a testbed named {self.name!r} is up and this sweep did not bring it up: bring "
                                 f"it down (testbed down {self.name}) or give the sweep another testbed name "
                                 "(--testbed, or testbed: in the sweep file)")
            live = effective_topology(st)
            changes = profile_changes(live, topo)
            why = None
            if changes is None:
                why = "the topology changes"
            elif not same_dilation(point.dilation, topo, st, self.machine, _gpus(st), lifecycle.cores()):
                why = "`up` would choose another time dilation"
            elif point.scenario and (changes or profile_changes(Topology.from_json(st["topology"]), topo)):
                why = "a scenario starts from its topology's own profiles"
            else:
                why = in_place_problem(st, changes)
            if why is None:
                if not changes:
                    return KEPT
                t0 = time.monotonic()
                self._apply(changes, live)
                self.say(f"  reconfigured {len(changes)} link(s) in place in {time.monotonic() - t0:.1f} s")
                return IN_PLACE
            self.say(f"  rebuilding: {why}")
            t0 = time.monotonic()
            self._down()
        else:
            t0 = time.monotonic()
        self._up(point)
        self.say(f"  testbed {self.name} up in {time.monotonic() - t0:.1f} s")
        return FRESH

    def _apply(self, changes: list[tuple[int, Any, Any]], live: Topology) -> None:
        """Each changed link through the fault layer (one locked state change per direction that differs)."""
        from testbed.faults import control

        for i, ab, ba in changes:
            link = live.links[i]
            fwd, rev = direction_changes(link.ab, ab), direction_changes(link.ba, ba)
            if fwd and fwd == rev:
                control.link_set(self.name, link.a, link.b, fwd, "both")
                continue
            if fwd:
                control.link_set(self.name, link.a, link.b, fwd, "A->B")
            if rev:
                control.link_set(self.name, link.a, link.b, rev, "B->A")

    # one run

    def _cluster(self) -> Any:
        from testbed.jobs.target import cluster_from_state

        return cluster_from_state(self.name)   # its topology: what the links run at (link set's profiles)

    def _watch(self, box: dict[str, Path], total: int | None, stop: threading.Event, t0: float) -> None:
        from testbed.jobs.rundir import StepReader

        reader: StepReader | None = None
        while not stop.wait(PROGRESS_EVERY_S):
            if "probe" in box and reader is None:
                reader = StepReader(box["probe"])
            if reader is not None:
                reader.poll()
            steps = reader.max_rank_steps if reader is not None else 0
            self.say(f"    ... step {steps}" + (f" of {total}" if total else "")
                     + f", {format_duration(time.monotonic() - t0)}")

    def run_one(self, run: Run, build: str) -> dict[str, Any]:
        """The point's job on the testbed as it is now, judged; its row."""
        from testbed.report import report, tell_verdict

        point = run.point
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        expected = None
        box: dict[str, Path] = {}
        stop = threading.Event()
        job = point.job
        watcher = threading.Thread(target=self._watch, args=(box, job.steps if job.main else None, stop, t0),
                                   daemon=True)
        watcher.start()
        try:
            if point.scenario:
                from testbed.faults.player import play
                from testbed.faults.scenario_loader import load_scenario

                res = play(self.name, load_scenario(point.scenario), echo=self.echo or False, base_dir=str(self.dir.path))
                run_dir, rc, outcome = res.run_dir, res.rc, res.outcome
            else:
                run_dir, rc, expected = self._job(point, box)
                outcome = "completed" if rc == 0 else ("interrupted" if rc == 130 else f"failed (exit status {rc})")
        finally:
            stop.set()
            watcher.join(1)
        if rc == 130:
            raise KeyboardInterrupt
        text, analysis, _ = report(run_dir, plots=False, expected_iteration_s=expected)
        verdict = analysis["verdict"]
        tell_verdict(self.name, run_dir, verdict)
        from testbed.jobs import rundir as rundir_mod

        monitor = rundir_mod.read_json(run_dir / "monitor.json", {}) or {}
        others = monitor.get("others_cpu_share") if isinstance(monitor, dict) else None
        wall = time.monotonic() - t0
        row = table.row(point, run.repeat, build, analysis, verdict, expected, wall, str(run_dir), outcome,
                        other_work=others if isinstance(others, (int, float)) else None, loadavg=load)
        return row

    def _job(self, point: Point, box: dict[str, Path]) -> tuple[Path, int, float | None]:
        """The main job or the sweep's command on the testbed now: (run dir, exit status, expected iteration)."""
        from testbed.jobs.run import run as run_job

        job = point.job
        cluster = self._cluster()
        on_start = lambda rd, probe: box.update(rd=rd, probe=probe)   # noqa: E731 (the progress lines read its steps)
        if not job.main:
            res = run_job(cluster, list(job.command or ()) + list(job.args), workers=job.workers, timeout=job.timeout_s,
                          echo=self.echo or False, base_dir=str(self.dir.path), workdir=self.workdir,
                          machine=self.machine, on_start=on_start)
            return res.run_dir, res.rc, None
        from testbed import lifecycle, mainjob
        from testbed.topology.plan import plan_network
        from testbed.topology.reference import predict

        cmd = [sys.executable, str(mainjob.REPO / "examples" / "train_ddp.py"), "--steps", str(job.steps),
               "--batch-size", str(job.batch_size), "--log-every", str(max(1, job.steps // 4)),
               *mainjob.MODEL_ARGS, *job.args]
        res = run_job(cluster, cmd, workers=job.workers, echo=self.echo or False, on_start=on_start,
                      workdir=str(mainjob.REPO), base_dir=str(self.dir.path), timeout=job.timeout_s,
                      machine=self.machine)
        s = float(lifecycle.load(self.name).get("time_dilation") or 1.0)
        compute = mainjob.step_compute(res.run_dir, s) if res.rc == 0 else None
        if compute:
            self.say(f"  {mainjob.compute_line(compute)}")
        exp = mainjob.expected_iteration(res.run_dir, cluster, compute["compute_s"], self.machine, predict,
                                         plan_network) if compute else None
        return res.run_dir, res.rc, (exp or {}).get("iteration_s")

    # the whole sweep

    def _calibrate(self) -> None:
        """This boot's constants (measured once per boot if missing), as `testbed run` gets them: the
        verdict, `auto` dilation and the main job's expected iteration need them."""
        from testbed.jobs import calibration

        self.machine = calibration.constants_or_none(progress=self.say)

    def _rows(self) -> dict[str, dict[str, Any]]:
        return table.load_rows(self.dir.path, [r.key for r in self.plan.runs])

    def write_results(self) -> list[Path]:
        rows = self._rows()
        ordered = [rows[r.key] for r in self.plan.runs if r.key in rows]
        meta = {"sweep": self.plan.sweep.name, "topology": self.plan.sweep.topology, "testbed": self.name,
                "fingerprint": self.plan.fingerprint(), "runs_planned": len(self.plan.runs), "runs_done": len(ordered)}
        files = table.write_table(self.dir.path, ordered, self.plan.sweep.swept, meta)
        title = (f"{self.plan.sweep.name}: {self.plan.sweep.topology}, "
                 f"{'main job' if self.plan.sweep.job.main else ' '.join(self.plan.sweep.job.command or ())[:40]}, "
                 f"{len(ordered)} of {len(self.plan.runs)} runs")
        try:
            files += sweep_plots.write_plots(self.dir.path, ordered, self.plan.sweep.swept, title)
        except Exception as exc:   # a plot that fails must not hide the table
            self.say(f"plots not made: {exc}")
        return files

    def run(self) -> Outcome:
        """Every run that has no row yet. Ctrl-C (KeyboardInterrupt) ends it as `interrupted`."""
        from testbed import lifecycle, store

        runs = self.plan.runs
        done = self._rows()
        left = [r for r in runs if r.key not in done]
        self.run_s = [r["wall_s"] for r in done.values() if isinstance(r.get("wall_s"), (int, float))]
        before = self.dir.read_state()
        was = before.get("testbed") or {}
        if store.exists(self.name) and was.get("name") == self.name:   # left up by this directory's last sweep
            if lifecycle.load(self.name).get("created") == was.get("created"):
                self.made = was.get("created")
        status, error = "interrupted", None
        self.dir.write_state(status="running", started=time.time(), pid=os.getpid())
        if done:
            self.say(f"continuing: {len(done)} of {len(runs)} runs done already ({self.dir.path / table.RESULTS})")
        t_start = time.monotonic()
        try:
            if left:
                self._calibrate()
            for n, run in enumerate(left):
                builds = predict_builds(self.plan, left[n:], self.machine, lifecycle.cores(),
                                        first_up=not store.exists(self.name))
                remaining = estimate_seconds(self.plan, left[n:], builds, self.run_s, self.build_s)
                idx = runs.index(run) + 1
                self.say(f"[{idx}/{len(runs)}] {run.point.id} {run.point.label}, repeat {run.repeat} of "
                         f"{self.plan.sweep.repeats} (elapsed {format_duration(time.monotonic() - t_start)}, "
                         f"about {format_duration(remaining)} left)")
                t0 = time.monotonic()
                build = self.reach(run.point)
                t_built = time.monotonic()
                row = self.run_one(run, build)
                if build == FRESH:
                    self.build_s.append(t_built - t0)
                self.run_s.append(row["wall_s"])
                table.save_row(self.dir.path, run.key, row)
                self.write_results()
                self.say(_row_line(row))
            status = "complete"
        except KeyboardInterrupt:
            status = "interrupted"
            self.say("interrupted: the run going on is not kept")
        except TestbedError as exc:
            status, error = "failed", str(exc)
            raise
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) \
                if threading.current_thread() is threading.main_thread() else None
            try:
                files = self.write_results()
                if not (self.keep_up and status == "complete"):
                    if self.made and store.exists(self.name):
                        self.say(f"bringing {self.name} down ...")
                        self._down()
                self.dir.write_state(status=status, ended=time.time(), error=error,
                                     testbed={"name": self.name, "created": self.made} if self.made else None)
            finally:
                if previous is not None:
                    signal.signal(signal.SIGINT, previous)
        n_done = len(self._rows())
        return Outcome(status, n_done, len(runs), files, error)


def _row_line(row: dict[str, Any]) -> str:
    it = row.get("iteration_ms")
    exp = row.get("expected_ms")
    parts = [f"  {row['build']}: {row['outcome']}",
             f"iteration {it:.1f} ms" if isinstance(it, (int, float)) else "no iteration time"]
    if isinstance(exp, (int, float)) and isinstance(it, (int, float)):
        parts.append(f"expected {exp:.1f} ms ({100 * (it / exp - 1):+.1f}%)")
    for c in row.get("collectives") or []:
        if c.get("share", 0) >= 0.1:
            parts.append(f"{c['class']} {100 * c['error']:+.1f}% ({c['status']})")
    parts.append(f"verdict {row['verdict']}")
    parts.append(f"{format_duration(row['wall_s'])}")
    return ", ".join(parts)

