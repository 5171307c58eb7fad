"""How the controller merges what every host of a run over several hosts wrote (pure: no host,
no kernel): testbed.cluster.controller's _merge_phantoms and _merge_monitors. What a host wrote is
not trusted: values of the wrong type are left out, never raised on."""

from __future__ import annotations


def test_the_hosts_phantom_records_merge_into_one():
    """Pure: every host's `phantoms` record in one. Under torchrun a host knows only its own
    phantoms (it calls every other rank real): a rank is phantom if any host says so. The lateness
    is the latest host's median, the one every collective waits for."""
    from testbed.cluster.job import _merge_phantoms

    merged = _merge_phantoms({
        "h1": {"real_workers": ["w0"], "real_ranks": [0, 2, 3], "phantom_ranks": [1], "ops_mirrored": [45],
               "errors": [], "warnings": ["send"], "announce_late_p50_s": 0.0004, "announce_late_max_s": 0.003,
               "relayed_lines": 47},
        "h2": {"real_workers": ["w0"], "real_ranks": [0, 1], "phantom_ranks": [2, 3], "ops_mirrored": [45, 45],
               "errors": ["rank 3: size mismatch"], "warnings": ["send"], "announce_late_p50_s": 0.0023,
               "announce_late_max_s": 0.009},
        "h3": {"real_ranks": "garbage", "ops_mirrored": None, "announce_late_p50_s": True, "relayed_lines": "x"},
    })
    assert merged["real_ranks"] == [0] and merged["phantom_ranks"] == [1, 2, 3]
    assert merged["ops_mirrored"] == [45, 45, 45] and merged["warnings"] == ["send"]
    assert merged["errors"] == ["h2: rank 3: size mismatch"]
    assert merged["announce_late_p50_s"] == 0.0023 and merged["announce_late_max_s"] == 0.009
    assert merged["announce_late_by_host"] == {"h1": 0.0004, "h2": 0.0023} and merged["relayed_lines"] == 47


def test_the_hosts_monitors_merge_into_one_the_verdict_reads():
    """Every host's queues and delay lines (each samples its own nodes and links); the CPU samples
    of the host that decides (the most loaded machine's); cores: the world's compute devices, the
    sampled machine's own in cpu_cores; garbage from a host is left out."""
    from testbed.cluster.job import _merge_monitors

    h1 = {"t0": 10.0, "t1": 20.0, "cores": 8, "cpu": [{"t": 11.0, "busy": 0.5, "runnable": 4}],
          "psi_cpu_some_share": 0.1, "qdiscs": {"w0": {"eth0": {"drops": 0}}, "s0": {"s0-s1": {"drops": 3}}},
          "delay_lines": {"first": {"0": {"ab": {}}}, "last": {"0": {"ab": {}}}}}
    h2 = {"t0": 9.5, "t1": 21.0, "cores": 4, "cpu": [{"t": 11.0, "busy": 0.9, "runnable": 9}],
          "psi_cpu_some_share": 0.4, "qdiscs": {"w2": {"eth0": {"drops": 1}}}, "delay_lines": "garbage"}
    m = _merge_monitors({"h1": h1, "h2": h2, "h3": {"qdiscs": ["x"], "t0": "soon"}}, "h2", 12)
    assert sorted(m["qdiscs"]) == ["s0", "w0", "w2"]
    assert m["delay_lines"] == {"first": {"0": {"ab": {}}}, "last": {"0": {"ab": {}}}}
    assert m["cpu"] == h2["cpu"] and m["psi_cpu_some_share"] == 0.4 and m["cpu_from"] == "h2"
    assert m["cores"] == 12 and m["cpu_cores"] == 4
    assert (m["t0"], m["t1"]) == (9.5, 21.0) and m["hosts"] == ["h1", "h2", "h3"]


def test_a_cut_links_two_delay_lines_are_both_kept():
    """Without netem a delayed cut link has a delay line on each of its hosts, under one link id:
    both reach the verdict, named by host; a line only one host has keeps its plain id."""
    from testbed.cluster.job import _merge_monitors

    line = {"ab": {"delay_s": 0.001}}
    h1 = {"delay_lines": {"first": {"4": line, "0": line}, "last": {"4": line, "0": line}}}
    h2 = {"delay_lines": {"first": {"4": line}, "last": {"4": {"ab": {"delay_s": 0.002}}}}}
    m = _merge_monitors({"h1": h1, "h2": h2}, "h1", 4)
    assert sorted(m["delay_lines"]["last"]) == ["0", "4 on h1", "4 on h2"]
    assert m["delay_lines"]["last"]["4 on h2"] == {"ab": {"delay_s": 0.002}}
    assert sorted(m["delay_lines"]["first"]) == ["0", "4 on h1", "4 on h2"]
