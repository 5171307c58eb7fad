"""bench/perf_verbs.py and bench/mininet_fattree.py without root, a kernel or Mininet: the Mininet
fat-tree is testbed's graph, and the page is rendered from a results document as the sweep writes it."""

import argparse

import pytest
from bench_modules import load

from testbed.topology.generators import GENERATORS

mft = load("mininet_fattree")
pv = load("perf_verbs")


@pytest.mark.parametrize("k", [2, 4, 6, 8, 12])
def test_mininet_fat_tree_is_testbeds_graph(k):
    nodes, links = GENERATORS["fat-tree"].generate({"k": k})
    hosts, switches, mlinks = mft.fat_tree_graph(k, "mab")
    names = mft.generator_names(k, "mab")
    assert [names[h] for h in hosts] == [n for n, node in nodes.items() if node.is_worker]
    assert [names[s] for s in switches] == [n for n, node in nodes.items() if not node.is_worker]
    assert [(names[a], names[b]) for a, b in mlinks] == [(link.a, link.b) for link in links]
    c = pv.counts(k)
    assert (len(hosts), len(switches), len(mlinks)) == (c["workers"], c["switches"], c["links"])


def test_mininet_names_fit_interface_names():
    k = 16   # the biggest size of the sweep: the longest switch name, the most ports
    hosts, switches, links = mft.fat_tree_graph(k, "mab")
    ports: dict[str, int] = {}
    for a, b in links:
        for n in (a, b):
            ports[n] = ports.get(n, 0) + 1
    longest = max(f"{n}-eth{ports[n]}" for n in hosts + switches)
    assert max(len(f"{n}-eth{ports[n]}") for n in hosts + switches) <= 15, longest
    with pytest.raises(ValueError):
        mft.fat_tree_graph(5)


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_sampled_pairs_cross_pods_and_stay_distinct(k):
    hosts, _, _ = mft.fat_tree_graph(k)
    pairs = mft.sample_pairs(hosts, k)
    assert pairs and len(pairs) == len(set(pairs)) <= 10
    assert all(a != b and a in hosts and b in hosts for a, b in pairs)
    per_pod = k * k // 4
    pod = {h: i // per_pod for i, h in enumerate(hosts)}
    assert any(pod[a] != pod[b] for a, b in pairs)


def test_sizes_flag():
    assert pv.parse_sizes("4,6,8") == [4, 6, 8]
    for bad in ("5", "4,x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            pv.parse_sizes(bad)


def _doc():
    mem = {"before": {"MemAvailable": 10 << 30, "Slab": 1 << 30}, "after_up": {"MemAvailable": (10 << 30) - (36 << 20),
                                                                               "Slab": (1 << 30) + (36 << 10)}}
    rows = [{"tool": "testbed", "verb": "--help", "repeat": i, "wall_s": w, "rc": 0} for i, w in enumerate((0.1, 0.2))]
    rows += [{"tool": "testbed", "k": 4, "verb": "up", "warmup": True, "wall_s": 9.0, "rc": 0},
             {"tool": "testbed", "k": 4, "verb": "up", "repeat": 0, "wall_s": 1.0, "rc": 0,
              "phases": {"capabilities": 0.001, "configure": 0.3, "shaping": 0.2, "total": 0.6},
              "memory": {**mem, "worker_processes": 16, "worker_rss": 16 << 20, "worker_pss": 16 << 19,
                         "worker_uss": 16 << 18, "delay_line_processes": 0, "delay_line_pss": 0}},
             {"tool": "testbed", "k": 4, "verb": "up", "repeat": 1, "wall_s": 3.0, "rc": 0},
             {"tool": "testbed", "k": 4, "verb": "down", "repeat": 0, "wall_s": 0.5, "rc": 0},
             {"tool": "testbed", "k": 4, "verb": "status --json", "repeat": 0, "wall_s": 0.2, "rc": 0},
             {"tool": "mininet", "k": 4, "verb": "up", "repeat": 0, "wall_s": 40.0, "rc": 0,
              "phases": {"python + import": 0.1, "build (nodes, links, tc)": 2.0, "STP convergence": 31.0},
              "stp_ports": {"blocking": 13}, "memory": {**mem, "host_rss": 16 << 20, "host_pss": 16 << 18}},
             {"tool": "mininet", "k": 4, "verb": "stop", "repeat": 0, "wall_s": 2.0, "rc": 0},
             {"tool": "testbed", "k": 8, "verb": "up", "repeat": 0, "rc": 3, "wall_s": 1.0, "error": "exit 3: boom"},
             {"tool": "mininet", "k": 8, "verb": "up", "repeat": 0, "rc": 3, "error": "timeout: STP not converged"},
             {"tool": "mininet", "k": 8, "verb": "stop", "repeat": 0, "rc": 0, "wall_s": 9.0, "after_failed_up": True}]
    return {"schema": 1, "command": "sudo .venv/bin/python bench/perf_verbs.py --sizes 4,8,12", "started": "s",
            "finished": "f", "interrupted": None, "notes": ["Mininet k=8 did not come up within 600 s"],
            "config": {"sizes": [4, 8, 12], "repeats": 2, "mininet": True, "timeout_per_size_s": 600},
            "machine": {"cpus": 2}, "versions": {"mininet": "2.3.0-1"},
            "sizes": {"4": pv.counts(4), "8": {**pv.counts(8), "mininet_timeout": True},
                      "12": {**pv.counts(12), "mininet_skipped": "skipped: k=8 took over 600 s"}},
            "rows": rows}


def test_stats_count_only_successful_counted_runs():
    doc = _doc()
    assert pv.stats(doc, "testbed", 4, "up") == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 2}   # not the warm-up
    assert pv.stats(doc, "testbed", None, "--help")["median"] == pytest.approx(0.15)
    assert pv.stats(doc, "testbed", 8, "up") is None
    assert pv.stats(doc, "mininet", 8, "stop") is None    # the stop of a net that never came up


def test_render_tables_ratios_gaps_and_targets():
    page = pv.render(_doc(), False, "performance/up_down.png")
    row4 = next(line for line in page.splitlines() if line.startswith("| k=4 | 16 | 20 | 48 |"))
    assert "2 s (1-3 s)" in row4 and "40 s" in row4 and "20.0x" in row4 and "4.0x" in row4
    row8 = next(line for line in page.splitlines() if line.startswith("| k=8 | 128 | 80 | 384 |"))
    assert "- (exit 3: boom)" in row8 and "- (over 600 s)" in row8
    row12 = next(line for line in page.splitlines() if line.startswith("| k=12 |"))
    assert "- (skipped: k=8 took over 600 s)" in row12
    assert "| k=4: `up` <= 0.6 s | 2 s | missed by 233% |" in page
    assert "| k=4: up >= 4x faster than Mininet's | 20.0x | met |" in page
    assert "shaping (in configure)" in page and "process overhead (wall - total)" in page
    assert "| blocking bridge ports when settled | 13 |" in page
    assert "1.00 MiB / 0.50 MiB / 0.25 MiB (1 process)" in page      # per worker RSS / PSS / USS
    assert "1024 KiB" in page and "1 KiB" in page                    # MemAvailable, Slab per node (36 nodes)
    assert "testbed k=8 up: exit 3: boom" in page and "warm-up `up`" in page
    assert "sudo .venv/bin/python bench/perf_verbs.py --sizes 4,8,12" in page
    assert "![" not in page    # no plot: no image link


def test_outputs_follow_the_results_file(tmp_path):
    assert pv.outputs(pv.RESULTS) == (pv.DOC, pv.PLOT)
    page, png = pv.outputs(tmp_path / "x.json")
    assert page == tmp_path / "x.md" and png == tmp_path / "x-up_down.png"


def test_dilation_flag():
    assert pv.parse_dilations("auto,none") == ["auto", "none"]
    assert pv.parse_dilations("8") == ["8"]
    assert pv.parse_dilations("8.0,auto") == ["8", "auto"]
    assert pv.parse_dilations("auto,auto+no-netem,8.0+no-netem") == ["auto", "auto+no-netem", "8+no-netem"]
    for bad in ("", "auto,auto", "fast", "0.5", "nan", "inf", "1e309", "8,8.0", "+no-netem", "auto+netem",
                "auto+no-netem,auto+no-netem"):
        with pytest.raises(argparse.ArgumentTypeError):
            pv.parse_dilations(bad)


def _two_settings_doc():
    rows = [{"tool": "python", "verb": "-c pass", "repeat": 0, "wall_s": 0.03, "rc": 0},
            {"tool": "testbed", "verb": "--help", "repeat": 0, "wall_s": 0.04, "rc": 0},
            {"tool": "testbed", "k": 4, "verb": "up", "repeat": 0, "dilation": "auto", "wall_s": 0.5, "rc": 0,
             "time_dilation": 10.7, "delay_lines": 0, "engines": 0},
            {"tool": "testbed", "k": 4, "verb": "up", "repeat": 0, "dilation": "none", "wall_s": 0.9, "rc": 0,
             "time_dilation": 1.0, "delay_lines": 0, "engines": 0},
            {"tool": "testbed", "k": 4, "verb": "down", "repeat": 0, "dilation": "auto", "wall_s": 0.2, "rc": 0},
            {"tool": "testbed", "k": 4, "verb": "down", "repeat": 0, "dilation": "none", "wall_s": 0.4, "rc": 0},
            {"tool": "testbed", "k": 4, "verb": "status --json", "repeat": 0, "dilation": "auto", "wall_s": 0.3,
             "rc": 0},
            {"tool": "testbed", "k": 16, "verb": "up", "repeat": 0, "dilation": "auto", "wall_s": 20.0, "rc": 0,
             "time_dilation": 682.2, "delay_lines": 3072, "engines": 2},
            {"tool": "breakdown", "k": 4, "verb": "status --json", "repeat": 0, "dilation": "auto", "wall_s": 0.3,
             "rc": 0, "parts": {"rc": 0, "cli imports": 0.07, "argument parsing (typer)": 0.1, "state read": 0.001,
                                "state validation": 0.02, "the verb's own work and output": 0.003,
                                "in process": 0.2}}]
    return {"schema": 1, "command": "c", "started": "s", "finished": "f", "interrupted": None, "notes": [],
            "config": {"sizes": [4, 16], "repeats": 1, "mininet": False, "dilations": ["auto", "none"]},
            "machine": {"cpus": 2, "capabilities": {"netem": False, "htb": True, "delay_line": True,
                                                    "latency_floor_s": 2.5e-05},
                        "delay_threshold_s": 1.3e-04},
            "versions": {}, "sizes": {"4": pv.counts(4), "16": pv.counts(16)}, "rows": rows}


def test_each_dilation_setting_is_its_own_row_and_every_one_is_judged():
    doc = _two_settings_doc()
    assert pv.stats(doc, "testbed", 4, "up")["median"] == 0.5                # the first setting, auto
    assert pv.stats(doc, "testbed", 4, "up", "none")["median"] == 0.9
    assert pv.stats(doc, "testbed", None, "--help")["median"] == 0.04       # --help has no setting
    page = pv.render(doc, False, "x.png")
    lines = page.splitlines()
    auto16 = next(line for line in lines if line.startswith("| k=16 |") and "auto" in line)
    assert "s = 682.2" in auto16 and "3072 delay line(s) in 2 engine(s)" in auto16
    assert any(line.startswith("| k=4 |") and "| none; no delay line |" in line for line in lines)
    assert "| k=4, auto: `up` <= 0.6 s | 0.5 s | met |" in page
    assert "| k=4, none: `up` <= 0.6 s | 0.9 s | missed by 50% |" in page   # a miss at one setting stays a miss
    assert "| k=4, none: `down` <= 0.3 s | 0.4 s | missed by 33% |" in page
    assert "| `status --json` (k=4, auto) within 3.5x of `python -c pass` (0.03 s) | 0.3 s: 10.0x | missed by 186% |" \
        in page
    assert "| `--help` within 3.5x of `python -c pass` (0.03 s) | 0.04 s: 1.3x | met |" in page
    assert "**no sch_netem**" in page and "(130 us)" in page
    assert "| argument parsing (typer) | 0.1 s |" in page   # (a results file names its parts)
    assert "| `status --json`, k=4 (auto) | median |" in page


def test_the_breakdown_takes_one_setting_and_size():
    doc = _two_settings_doc()
    other = {**doc["rows"][-1], "dilation": "none", "wall_s": 9.0,
             "parts": {**doc["rows"][-1]["parts"], "state validation": 5.0}}
    doc["rows"].append(other)
    page = pv.render(doc, False, "x.png")
    assert "| state validation | 0.02 s |" in page and "| **the process** (spawn to exit) | 0.3 s |" in page


def test_a_results_file_from_before_settings_reads_its_command():
    doc = _doc()
    assert pv.settings(doc) == ["none"]
    assert pv.dilation_of(doc, doc["rows"][2]) == "none"
    doc["command"] += " --time-dilation auto"
    assert pv.settings(doc) == ["auto"] and pv.dilation_of(doc, doc["rows"][2]) == "auto"
    doc["command"] = "sudo .venv/bin/python bench/perf_verbs.py --time-dilation=8"
    assert pv.settings(doc) == ["8"]
