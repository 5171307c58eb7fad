"""A run's ranks from their start to the run's end: started through the testbed's runtime, their
output tagged and logged, and watched until every one has ended. On the way a failed group is
started again (up to its restarts), an elastic agent lost with its node comes back when the node
is up, the first failure stops the rest after the grace, and a timeout, a stop or Ctrl-C stops
them all; at the end whatever still carries the run's tag is ended by PID (no orphans)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from testbed import events, procs, safeio, terminal
from testbed.jobs.ranks import Rank, exit_status, signal_all, signal_group, tagged_pids
from testbed.jobs.run_groups import RESTART_DELAY_S, GroupState, fresh_records, workers_down
from testbed.jobs.target import Cluster
from testbed.jobs.torchrun import RANK_PREFIX

PHANTOM_GRACE_S = 10.0     # after the real ranks ended: time for the phantoms to read "end" and leave
LINE_MAX = 1 << 16         # a rank's output line longer than this is cut
KILL_AFTER_S = 2.0         # SIGTERM, then this long, then SIGKILL
LOST_DECIDE_S = 2.0        # an elastic agent ended: this long for the state to say its node crashed
POLL_S = 0.05


class Supervisor:
    """One run's ranks. `start()`, then `watch()` until they ended (KeyboardInterrupt: `interrupted()`),
    then always `reap()`. rc, reason and first_fail say how the run ended."""

    def __init__(self, cluster: Cluster, run_id: str, ranks: list[Rank], *, common_env: Mapping[str, str],
                 workdir: str, logs: Mapping[str, Any], echo: Callable[[str], None] | None, grace: float,
                 timeout: float | None, stop: threading.Event | None, groups: Sequence[Any] = (),
                 elastic: bool = False, with_phantoms: bool = False,
                 leader_ended: Callable[[], bool] | None = None,
                 every_second: Callable[[], None] = lambda: None,
                 on_timeout: Callable[[], None] = lambda: None):
        self.cluster, self.run_id, self.ranks = cluster, run_id, ranks
        self.common_env, self.workdir, self.logs, self.echo = dict(common_env), workdir, logs, echo
        self.grace, self.timeout, self.stop = grace, timeout, stop
        self.groups = {g.name: GroupState(g, g.restarts) for g in groups}
        self.elastic = elastic
        self.with_phantoms = with_phantoms   # real ranks with phantoms: the phantoms end after the real ones
        self.leader_ended = leader_ended     # a host of phantoms only: the leader (on another host) said its end
        self.every_second, self.on_timeout = every_second, on_timeout
        self.rc, self.reason = 0, "completed"
        self.first_fail: Rank | None = None
        self.leftovers: list[int] = []
        self._lost: dict[str, list[Any]] = {}   # elastic agents that ended: label -> [rank, decide by, with its node]
        self._stop_at: float | None = None
        self._killed_at: float | None = None
        self._readers: list[threading.Thread] = []
        self._log_lock = threading.Lock()
        self._t_start = time.monotonic()   # (start() sets it again: the timeout counts from the ranks' start)

    def _say(self, line: str) -> None:
        if self.echo is not None:
            self.echo(line)

    # -- the processes

    def start(self) -> None:
        self._t_start = time.monotonic()
        for r in self.ranks:
            self._spawn(r)

    def _spawn(self, r: Rank) -> None:
        full_env = {**self.common_env, **r.env}
        argv = self.cluster.executor.argv(r.worker, r.argv, r.env, self.workdir)
        r.started, r.rc, r.ended = time.time(), None, None
        r.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=self._pump, args=(r, r.proc), daemon=True)
        t.start()
        self._readers.append(t)

    def _pump(self, r: Rank, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        label = r.label
        # a line waiting for its newline is bounded (LINE_MAX); what a rank prints is shown inert
        for raw in safeio.lines_of_fd(proc.stdout.fileno(), LINE_MAX):
            line = terminal.inert(raw.decode(errors="replace"))
            if r.local_rank is None:   # torchrun: "[rN]:line" is rank N's
                m = RANK_PREFIX.match(line)
                label = (f"{r.worker}:{(r.group + '.') if r.group else ''}{'p' if r.phantom else 'r'}{m.group(1)}"
                         if m else r.label)
                if m:
                    line = line[m.end():]
            with self._log_lock:
                self.logs[r.worker].write(f"[{label.split(':', 1)[1]}] {line}\n")
                if self.echo is not None:
                    self.echo(f"[{label}] {line}")
        proc.stdout.close()

    # -- watching

    def watch(self) -> None:
        """Until every rank (and every group between two lives, every lost agent) has ended."""
        next_poll = 0.0
        next_lost_check = 0.0
        while True:
            now = time.monotonic()
            alive = self._poll_ranks(now)
            if self._lost and self._stop_at is None and now >= next_lost_check:
                next_lost_check = now + 0.2
                self._check_lost(now)
            if self._stop_at is None:
                alive += len(self._lost)
            if self.groups:
                alive += self._tend_groups(now, self._stop_at is None)
                if self._stop_at is None and all(r.rc is not None for r in self.ranks if not r.service) \
                        and all(g.state == "running" for g in self.groups.values()):
                    # every group is done: the services (a lighthouse) have nothing left to serve
                    self.reason, self._stop_at = ("completed" if self.rc == 0 else self.reason), now
            if alive == 0:
                return
            if self.with_phantoms and self._stop_at is None and self._real_ranks_done():
                # the real ranks are done (on a host of phantoms only: the leader said its end):
                # a phantom has nothing left to mirror
                self.reason, self._stop_at = ("completed" if self.rc == 0 else self.reason), now + PHANTOM_GRACE_S
            if now >= next_poll:
                next_poll = now + 1.0
                self.every_second()
            if self.timeout is not None and self._stop_at is None and now - self._t_start > self.timeout:
                self.reason, self.rc, self._stop_at = "timeout", 124, now
                self._say(f"[testbed] timeout after {self.timeout:g}s: taking every rank's stack, then stopping "
                          "all ranks")
                self.on_timeout()
            if self.stop is not None and self._stop_at is None and self.stop.is_set():
                self.reason, self.rc, self._stop_at = "stopped", 143, now
                self._say("[testbed] asked to stop: stopping all ranks")
            if self._stop_at is not None and now >= self._stop_at:
                if self._killed_at is None:
                    signal_all(self.ranks, self.run_id, signal.SIGTERM)
                    self._killed_at = now
                elif now - self._killed_at > KILL_AFTER_S:
                    signal_all(self.ranks, self.run_id, signal.SIGKILL)
            time.sleep(POLL_S)

    def _real_ranks_done(self) -> bool:
        real = [r for r in self.ranks if not r.phantom]
        if real:
            return all(r.rc is not None for r in real)
        return self.leader_ended is not None and self.leader_ended()

    def _poll_ranks(self, now: float) -> int:
        """Note the ranks that ended (and what their end means); how many are still running."""
        alive = 0
        for r in self.ranks:
            if r.rc is not None or r.proc is None:
                continue
            code = r.proc.poll()
            if code is None:
                alive += 1
                continue
            r.rc, r.ended = code, time.time()
            gs = self.groups.get(r.group or "")
            if gs is not None and gs.state != "running":
                continue   # a group being ended for its restart: its ranks' statuses are ours
            if code == 0 or self._stop_at is not None:
                continue
            if gs is not None and gs.left > 0:
                self._group_failed(gs, r, now)
            elif self.elastic and r.local_rank is None:
                # an elastic agent: lost with its node (crashed, down), or failed? the state says,
                # within a moment (node crash records the crash after its kills)
                self._lost[r.label] = [r, now + LOST_DECIDE_S, False]
            elif self.first_fail is None:
                self._failed(r, now)
        return alive

    def _failed(self, r: Rank, now: float) -> None:
        """The run's first failure: the others get the grace, then are stopped."""
        self.first_fail, self.rc, self.reason = r, exit_status(r.rc), "rank failed"
        self._stop_at = now + self.grace
        self._say(f"[testbed] {r.label} exited with status {self.rc}; stopping the others in {self.grace:g}s")

    def _check_lost(self, now: float) -> None:
        """Elastic agents that ended: back when their node is up, or the run's failure."""
        name, run_id = self.cluster.name, self.run_id
        for label, entry in list(self._lost.items()):
            r, decide_by, with_node = entry
            down = bool(workers_down(self.cluster, [r.worker]))
            if down and not with_node:
                entry[2] = with_node = True
                msg = (f"{r.label} (the torchrun agent) was lost with its node; it is started again "
                       f"when {r.worker} is up (testbed node up {r.worker})")
                events.emit(name, "run", f"run {run_id}: {msg}", run_id=run_id, worker=r.worker)
                self._say(f"[testbed] {msg}")
            if with_node and not down:
                del self._lost[label]
                fresh_records(self.cluster)
                r.starts += 1
                self._spawn(r)
                events.emit(name, "run", f"run {run_id}: {r.label} started again on {r.worker}", run_id=run_id,
                            worker=r.worker)
                self._say(f"[testbed] {r.label} started again: it joins the job's next rendezvous")
            elif not with_node and now >= decide_by:   # its node is up: the agent itself failed
                del self._lost[label]
                if self.first_fail is None:
                    self._failed(r, now)

    # -- groups

    def _group_failed(self, gs: GroupState, r: Rank, now: float) -> None:
        """A rank of a group that may restart failed: its other ranks are ended, then it starts again."""
        code = exit_status(r.rc)
        gs.state, gs.since, gs.killed = "stopping", now, False
        gs.failures.append({"label": r.label, "rc": code, "t": time.time()})
        n = gs.group.restarts - gs.left + 1
        msg = f"group {gs.group.name}: {r.label} exited with status {code}; restart {n} of {gs.group.restarts}"
        events.emit(self.cluster.name, "run", f"run {self.run_id}: {msg}", run_id=self.run_id, group=gs.group.name,
                    rc=code)
        self._say(f"[testbed] {msg} once its workers are up")
        signal_group([x for x in self.ranks if x.group == gs.group.name], f"{self.run_id}.{gs.group.name}",
                     signal.SIGTERM)

    def _tend_groups(self, now: float, may_start: bool) -> int:
        """Move failed groups on: ended -> waiting for their workers -> started again. Returns how many
        groups are between two lives (the run is not over while one is)."""
        between = 0
        for gs in self.groups.values():
            mine = [x for x in self.ranks if x.group == gs.group.name]
            tag = f"{self.run_id}.{gs.group.name}"
            if gs.state == "stopping":
                if all(x.proc is None or x.proc.poll() is not None for x in mine) \
                        and not procs.pids_with_env("TESTBED_GROUP_RUN", tag, include_self=False):
                    gs.state, gs.restart_at = "waiting", now + RESTART_DELAY_S
                elif now - gs.since > KILL_AFTER_S and not gs.killed:
                    signal_group(mine, tag, signal.SIGKILL)
                    gs.killed = True
            if gs.state == "waiting" and may_start and now >= gs.restart_at:
                if workers_down(self.cluster, gs.group.workers):
                    gs.restart_at = now + 0.5   # a crashed node: started again by `node up` (or a scenario)
                else:
                    fresh_records(self.cluster)
                    gs.left -= 1
                    gs.state = "running"
                    for x in mine:
                        if x.proc is not None and x.rc is None:
                            x.rc = x.proc.poll()
                        x.starts += 1
                        x.env["TORCHELASTIC_RESTART_COUNT"] = str(x.starts - 1)
                        x.env["TESTBED_GROUP_RESTART"] = str(x.starts - 1)
                        self._spawn(x)
                    self._say(f"[testbed] group {gs.group.name} started again on {', '.join(gs.group.workers)}")
            if gs.state != "running":
                between += 1
        return between

    # -- the end

    def interrupted(self) -> None:
        """Ctrl-C (or SIGTERM, which the launcher raises as one): every rank is stopped."""
        self.reason, self.rc = "interrupted", 130
        self._say("[testbed] interrupted: stopping all ranks")
        signal_all(self.ranks, self.run_id, signal.SIGTERM)
        deadline = time.monotonic() + KILL_AFTER_S
        while time.monotonic() < deadline and any(r.proc and r.proc.poll() is None for r in self.ranks):
            time.sleep(POLL_S)

    def reap(self) -> None:
        """No orphans: whatever still carries the run's tag goes, by PID; every rank's status noted,
        its output read to the end and its log closed."""
        self.leftovers = tagged_pids(self.run_id)
        if self.leftovers:
            signal_all(self.ranks, self.run_id, signal.SIGKILL)
        for r in self.ranks:
            if r.proc is not None:
                try:
                    r.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                if r.rc is None:
                    r.rc, r.ended = r.proc.returncode, time.time()
        deadline = time.monotonic() + 5
        while tagged_pids(self.run_id) and time.monotonic() < deadline:
            signal_all([], self.run_id, signal.SIGKILL)
            time.sleep(POLL_S)
        for t in self._readers:
            t.join(2)
        for f in self.logs.values():
            f.close()
