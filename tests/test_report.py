"""The report of a run directory: analysis (dilation applied), table, plots."""

import json

import pytest

from testbed.report import report
from testbed.report.analyze import analyze, percentile


def _fake_run(tmp_path, s=2.0):
    run = tmp_path / "runs" / "x-tb"
    (run / "probe").mkdir(parents=True)
    topo = {"name": "t", "nodes": [{"name": "w0", "kind": "worker"}, {"name": "w1", "kind": "worker"},
                                   {"name": "sw", "kind": "switch"}],
            "links": [{"endpoints": ["w0", "sw"], "tier": "host"}, {"endpoints": ["w1", "sw"], "tier": "host"}]}
    (run / "topology.json").write_text(json.dumps(topo))
    links = [{"index": i, "a": w, "b": "sw", "tier": "host", "bytes_ab": 1_000_000, "bytes_ba": 500_000,
              "bandwidth_ab": 1e9, "bandwidth_ba": 1e9} for i, w in enumerate(["w0", "w1"])]
    (run / "summary.json").write_text(json.dumps({"testbed": "tb", "status": "completed", "rc": 0, "world_size": 2,
                                                  "duration_s": 10.0, "links": links,
                                                  "time_dilation": {"factor": s, "source": "test"}}))
    for rank in (0, 1):
        recs = [{"ev": "start", "t": 100.0, "worker": f"w{rank}"}]
        t = 100.0
        for n in range(1, 6):
            t += 0.2  # raw step time 0.2 s
            recs.append({"ev": "coll", "op": "all_reduce", "bytes": 400, "t": t - 0.05, "dur": 0.05, "src": "ddp"})
            recs.append({"ev": "step", "t": t, "dur": 0.01, "n": n, "samples": 8})
        recs.append({"ev": "end", "t": t})
        (run / "probe" / f"rank-{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return run


def test_percentile():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 50) is None
    assert percentile([5], 95) == 5


def test_analyze_applies_dilation(tmp_path):
    a = analyze(_fake_run(tmp_path, s=2.0))
    assert a["dilation"] == 2.0
    assert len(a["ranks"]) == 2
    r0 = a["ranks"][0]
    assert r0["steps"] == 5
    assert r0["iter_p50_s"] == pytest.approx(0.1)  # 0.2 s raw / 2
    assert r0["samples_per_s"] == pytest.approx(80)  # 8 samples per 0.1 s
    assert r0["comm_share"] == pytest.approx(0.25)
    assert a["tiers"]["host"]["bytes"] == 3_000_000
    # 1 MB on a 1 Gbit/s link dilated to 0.5 Gbit/s, over the window the job communicated:
    # first collective starts at 100.15, the last one ends at 101.0 (raw), not the 10 s wall time
    assert a["util_window"]["kind"] == "comm"
    assert a["util_window"]["raw_s"] == pytest.approx(0.85)
    assert a["tiers"]["host"]["max_util"] == pytest.approx(8e6 / 0.85 / 5e8)


def test_utilisation_falls_back_to_wall_time_without_collectives(tmp_path):
    run = _fake_run(tmp_path, s=2.0)
    for f in (run / "probe").glob("*.jsonl"):
        f.write_text("\n".join(l for l in f.read_text().splitlines() if '"coll"' not in l) + "\n")
    a = analyze(run)
    assert a["util_window"]["kind"] == "wall"
    assert a["tiers"]["host"]["max_util"] == pytest.approx(8e6 / 10 / 5e8)
    assert "whole wall time" in report(run, plots=False)[0]


def test_report_writes_table_and_plots(tmp_path):
    run = _fake_run(tmp_path)
    text, a, plots = report(run)
    assert "iter p50 ms" in text and "host" in text and "time dilation 2" in text
    assert "s the job communicated (first to last collective)" in text
    assert (run / "report.txt").is_file()
    names = sorted(p.name for p in plots)
    assert names == ["links.png", "step_times.png"]
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
