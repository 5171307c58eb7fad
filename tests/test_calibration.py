"""The calibration: deriving the constants, validating the per-boot cache (pure, no root),
and one real measurement (root)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.jobs import calibration
from testbed.topology.reference import cost_terms
from waiting import wait_for


def _rows(alpha: float, beta: float, ops=calibration.OPS):
    """What collectives_bench would report for two ranks if every op cost exactly alpha and beta."""
    rows = []
    for op in ops:
        for size in (calibration.SMALL, *calibration.LARGE):
            m, b = cost_terms(op, size)
            t = m * alpha + b * beta
            rows.append({"op": op, "bytes": size, "time_s": t, "times_s": [t * 1.02, t, t * 0.99]})
    return rows


def test_derive_recovers_the_constants_of_every_collective():
    ops = calibration.derive(_rows(300e-6, 1.2e-9))
    assert set(ops) == set(calibration.OPS)
    for op, v in ops.items():
        assert v["alpha_s"] == pytest.approx(300e-6, rel=1e-6), op
        assert v["beta_s_per_byte"] == pytest.approx(1.2e-9, rel=1e-6), op


def test_derive_refuses_nonsense():
    rows = _rows(300e-6, 1.2e-9, ops=("all_reduce",))
    for r in rows:
        if r["bytes"] == calibration.SMALL:
            r["times_s"] = [0.0, 0.0, 0.0]   # a small message cannot take no time
    with pytest.raises(calibration.CalibrationError, match="all_reduce"):
        calibration.derive(rows)


def _doc(**over):
    ops = {op: {"alpha_s": 3e-4, "beta_s_per_byte": 1.2e-9} for op in calibration.OPS}
    doc = {"alpha_s": 3e-4, "beta_s_per_byte": 1.2e-9, "ops": ops, "cores": calibration._cores(),
           "measured_at": 1.7e9, "boot_id": calibration.boot_id(), "torch": calibration._torch_version(),
           "busy_before": 0.05, "seconds": 10.0, "rows": []}
    doc.update(over)
    return doc


@pytest.mark.parametrize("field,value", [
    ("alpha_s", -1), ("alpha_s", "fast"), ("alpha_s", float("nan")), ("beta_s_per_byte", 0), ("cores", 0),
    ("cores", True), ("ops", {"all_reduce": {"alpha_s": 1e-4}}), ("ops", {"rm -rf": {}}), ("rows", "x"),
])
def test_parse_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        calibration.parse(_doc(**{field: value}))


def test_cache_is_per_boot_and_per_torch(tmp_path, monkeypatch):
    f = tmp_path / "cal.json"
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(f))
    assert calibration.cached() is None                       # none yet
    f.write_text(json.dumps(_doc()))
    cal = calibration.cached()
    assert cal is not None and cal.constants().for_op("send_recv") == (3e-4, 1.2e-9)
    assert "calibrated" in cal.constants().source
    f.write_text(json.dumps(_doc(boot_id="another-boot")))
    assert calibration.cached() is None                       # an earlier boot's numbers are not used
    f.write_text(json.dumps(_doc(torch="0.0.1")))
    assert calibration.cached() is None                       # nor another torch's
    f.write_text("{not json")
    assert calibration.cached() is None
    f.write_text(json.dumps(_doc(alpha_s=-5)))
    assert calibration.cached() is None                       # nor a tampered file


def test_spread_is_the_standard_error_of_the_constants_over_the_repetitions():
    import statistics

    rows = _rows(300e-6, 1.2e-9, ops=("all_reduce",))
    for r in rows:   # repetitions 1.0, 1.1 and 0.95 times the time in every size: alpha and beta alike
        t = r["time_s"]
        r["times_s"] = [t, t * 1.1, t * 0.95]
    xs = [1.0, 1.1, 0.95]
    assert calibration.spread_of(rows) == pytest.approx(statistics.stdev(xs) / statistics.fmean(xs) / 3 ** 0.5,
                                                        rel=1e-6)
    for r in rows:
        if r["bytes"] == calibration.SMALL:
            r["times_s"][1] = 0.0      # a repetition that gives no constants: the spread is unbounded
    assert calibration.spread_of(rows) == float("inf")


def test_a_calibration_not_kept_serves_only_a_while(tmp_path, monkeypatch):
    f = tmp_path / "cal.json"
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(f))
    f.write_text(json.dumps(_doc(kept=False, why_not_kept="too spread", spread=0.4, measured_at=time.time() - 60)))
    cal = calibration.cached()
    assert cal is not None and not cal.kept and cal.constants().spread == 0.4
    assert "provisional: too spread" in cal.constants().source
    assert any("not kept (too spread)" in line for line in cal.lines())
    f.write_text(json.dumps(_doc(kept=False, why_not_kept="too spread",
                                 measured_at=time.time() - calibration.PROVISIONAL_S - 1)))
    assert calibration.cached() is None                       # then the next command measures again
    f.write_text(json.dumps(_doc(spread=-1)))
    assert calibration.cached() is None


def test_history_keeps_the_last_attempts_and_passes_over_bad_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    cal = calibration.parse(_doc(spread=0.03, foreign=0.4, kept=False, why_not_kept="other work took 40%"))
    for i in range(calibration.HISTORY_KEEP + 5):
        calibration._remember(cal, 1 + i % 3)
    with open(calibration.history_file(), "a") as f:
        f.write("{broken\n[1, 2]\n")
    h = calibration.history()
    assert len(h) == calibration.HISTORY_KEEP
    assert h[-1]["foreign"] == 0.4 and h[-1]["kept"] is False and h[-1]["why_not_kept"] == "other work took 40%"
    out = subprocess.run([sys.executable, "-m", "testbed", "calibrate", "--history"], capture_output=True, text=True,
                         env={**os.environ, "TESTBED_CALIBRATION_FILE": str(tmp_path / "cal.json")}, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "busy before" in lines[0] and "spread" in lines[0]
    assert sum("no: other work took 40%" in x for x in lines) == calibration.HISTORY_KEEP
    assert "+-3%" in lines[1] and "40%" in lines[1]


def test_auto_plans_for_the_slowest_per_byte_cost_this_boot_measured(tmp_path, monkeypatch):
    """This VM moves bytes in two modes 1.5-1.7x apart and one calibration sees one: auto plans host
    work for the slowest cost this boot measured (this calibration's slowest repetition, this boot's
    kept calibrations), never above SLOW_MODE_MAX times this one's; the model keeps this one's."""
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    rows = _rows(300e-6, 1.0e-9, ops=("all_reduce",))
    cal = calibration.parse(_doc(beta_s_per_byte=1.0e-9, rows=rows))
    assert cal.slowest_beta() == pytest.approx(1.02e-9, rel=1e-6)       # no history: its slowest repetition
    for r in rows:   # the last repetition 10% slower at both large sizes: its own beta is 1.1 ns/B
        if r["bytes"] != calibration.SMALL:
            r["times_s"][2] = r["time_s"] * 1.1
    cal = calibration.parse(_doc(beta_s_per_byte=1.0e-9, rows=rows))
    assert cal.slowest_beta() == pytest.approx(1.1e-9, rel=1e-3)

    def remember(beta, **over):
        calibration._remember(calibration.parse(_doc(beta_s_per_byte=beta, **over)), 1)

    remember(1.4e-9)                                          # kept, this boot: planned for
    remember(1.9e-9, kept=False, why_not_kept="busy")         # not kept: passed over
    remember(1.8e-9, boot_id="another-boot")                  # another boot's: passed over
    with open(calibration.history_file(), "a") as f:           # hostile lines: passed over
        for v in ('"fast"', "true", "-1e-9", "1.0", "1e309"):
            f.write('{"measured_at": 1.7e9, "boot_id": "%s", "kept": true, "beta_s_per_byte": %s}\n'
                    % (calibration.boot_id(), v))
        f.write("[" * 100_000 + "\n")                          # deeper than json recurses: not a crash
    m = cal.constants()
    assert m.beta_s_per_byte == pytest.approx(1.0e-9) and m.planning_beta == pytest.approx(1.4e-9)
    assert "slowest this boot 5.71 Gbit/s per rank" in m.describe()
    remember(3.5e-9)                                          # beyond SLOW_MODE_MAX x this one's: bounded
    assert cal.constants().planning_beta == pytest.approx(calibration.SLOW_MODE_MAX * 1.0e-9)
    again = type(m).from_json(m.to_json())
    assert again.planning_beta == pytest.approx(m.planning_beta)
    assert type(m).from_json({**m.to_json(), "beta_slow_s_per_byte": "x"}).beta_slow_s_per_byte == 0.0


def test_lines_describe_every_collective():
    text = "\n".join(calibration.parse(_doc()).lines())
    for op in calibration.OPS:
        assert op in text
    assert "Gbit/s" in text


@pytest.mark.slow
def _our_namespaces() -> list[str]:
    """Namespaces of a calibration's testbed (calib-HEX) labelled with this test's state root: beside
    other tests (and other sessions' calibrations) the machine's list of namespaces changes anyway."""
    from testbed import paths
    from testbed.cleanup import read_owner
    from testbed.net import netns

    return [n for n in netns.list_names("tb-calib-") if (read_owner(n) or "").endswith(f":{paths.root()}")]


def test_measure_for_real(root, state_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    assert not _our_namespaces()
    cal = calibration.get(refresh=True)
    assert set(cal.ops) == set(calibration.OPS)
    # Measured on this kind of machine (2 cores, 2026-12-02, quiet and with the test suite running):
    # all_reduce alpha 0.6-1.1 ms per message, 6.2-7.4 Gbit/s per rank; a machine 10x faster or 4x
    # slower still passes, a unit slip (us for s, bits for bytes) does not.
    assert 50e-6 < cal.alpha_s < 5e-3
    assert 1e9 < 8 / cal.beta_s_per_byte < 60e9
    assert calibration.cached() == cal
    # every attempt is remembered; the one kept (or, when none was clean, the least disturbed) among them
    assert cal.measured_at in [r["measured_at"] for r in calibration.history()]
    assert not _our_namespaces()                              # its testbed is gone
    assert not [p for p in state_dir.iterdir() if not p.name.startswith(".")]   # nor its state


@pytest.mark.slow
def test_a_busy_machine_is_waited_for_then_not_kept(root, state_dir, tmp_path, monkeypatch):
    """Two processes of ours keep both cores busy for the whole calibration: it waits (bounded,
    saying so), measures, sees others took the CPUs, measures again, and keeps none of it."""
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    monkeypatch.setattr(calibration, "QUIET_WAIT_S", 3.0)
    monkeypatch.setattr(calibration, "ATTEMPTS", 2)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    said: list[str] = []
    try:
        cal = calibration.get(refresh=True, progress=said.append)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert any("waiting for a quiet machine" in m for m in said), said
    assert any("measuring again (2 of 2)" in m for m in said), said
    assert not cal.kept and "other work took" in cal.why_not_kept, cal
    h = calibration.history()
    assert [r["attempt"] for r in h] == [1, 2] and all(r["foreign"] > calibration.FOREIGN_MAX for r in h), h
    assert calibration.cached() == cal                       # provisional: it serves, for a while
    assert "provisional" in cal.constants().source


@pytest.mark.slow
def test_a_failed_calibration_job_says_why_and_keeps_nothing(root, state_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    monkeypatch.setattr(calibration, "OPS", ("all_reduce", "no_such_collective"))
    assert not _our_namespaces()
    with pytest.raises(calibration.CalibrationError, match="failed with status") as exc:
        calibration.get(refresh=True)
    assert "no_such_collective" in str(exc.value)           # the job's own words come along
    assert not (tmp_path / "cal.json").exists()
    assert not _our_namespaces()


def test_one_calibration_at_a_time(tmp_path, monkeypatch):
    """Two commands that calibrate at once would each measure the other: the second waits for the
    first (saying so) and takes what it measured."""
    import threading

    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    monkeypatch.setattr(calibration.os, "geteuid", lambda: 0)
    measured: list[int] = []
    gate = threading.Event()

    def measure(progress=None):
        measured.append(1)
        gate.wait(10)
        doc = _doc(measured_at=time.time())
        (tmp_path / "cal.json").write_text(json.dumps(doc))
        return calibration.parse(doc)

    monkeypatch.setattr(calibration, "measure", measure)
    said: list[str] = []
    first = threading.Thread(target=calibration.get)
    first.start()
    wait_for(lambda: measured, timeout=10, what="the first command to start measuring")
    second: list = []
    t = threading.Thread(target=lambda: second.append(calibration.get(progress=said.append)))
    t.start()
    wait_for(lambda: any("another command is calibrating" in m for m in said), timeout=10,
             what="the second command to say it waits for the first")
    assert not second   # and it does wait (the first holds its measurement until the gate opens)
    gate.set()
    first.join(10)
    t.join(10)
    assert len(measured) == 1 and second and second[0].alpha_s == 3e-4


PIN_PROBE = """
import json, os, sys, threading
from testbed.jobs.collectives_bench import pin_to_own_cpu
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()   # a thread that exists before the pin: it is pinned too
cpu = pin_to_own_cpu(int(sys.argv[1]))
after = threading.Thread(target=stop.wait)
after.start()   # and one started after it inherits the pin
seen = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps({"cpu": cpu, "allowed": sorted(set(map(tuple, seen.values()))), "threads": len(seen)}))
"""


def test_pin_cpu_puts_every_thread_of_a_rank_on_its_own_core():
    """The calibration runs collectives_bench --pin-cpu: rank r on the r-th allowed CPU, all its threads.
    Unpinned, a calibration now and then ran both ranks on one core and measured 1.6x the cost per byte."""
    cpus = sorted(os.sched_getaffinity(0))
    for rank in range(len(cpus) + 1):
        out = subprocess.run([sys.executable, "-c", PIN_PROBE, str(rank)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        want = cpus[rank % len(cpus)]
        assert got["cpu"] == want and got["allowed"] == [[want]] and got["threads"] >= 3, got
