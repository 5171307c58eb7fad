"""Unit parsers and formatters of testbed.topology.units."""

import math

import pytest
from hypothesis import given, strategies as st

from testbed.topology.units import (format_bandwidth, format_time, parse_bandwidth, parse_loss, parse_size,
                                    parse_time)


@pytest.mark.parametrize("text,bps", [
    (1000, 1000), (2.5e9, 2_500_000_000), ("1000", 1000), ("1000bit", 1000), ("1000bps", 1000),
    ("10kbit", 10_000), ("10Kbps", 10_000), ("100mbit", 100_000_000), ("100Mbps", 100_000_000),
    ("10gbit", 10 * 10**9), ("10Gbps", 10 * 10**9), ("10GBIT", 10 * 10**9), ("1.5gbit", 1_500_000_000),
    ("1tbit", 10**12), ("2Tbps", 2 * 10**12), (" 40 gbit ", 40 * 10**9), ("1e9", 10**9), ("1e3kbit", 10**6),
])
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == bps
    assert isinstance(parse_bandwidth(text), int)


@pytest.mark.parametrize("bad,reason", [
    ("10gbps/s", "unknown bandwidth unit"), ("fast", "not a bandwidth"), ("-1gbit", "positive"),
    ("0", "positive"), (0, "positive"), ("0gbit", "positive"), ("10 gigabits", "unknown bandwidth unit"),
    ("10g", "unknown bandwidth unit"), ("", "not a bandwidth"), (None, "bandwidth"), (True, "bandwidth"),
    ([1], "bandwidth"), (float("inf"), "finite"), ("0.1bit", "at least 1"),
])
def test_parse_bandwidth_rejects(bad, reason):
    with pytest.raises(ValueError, match=reason):
        parse_bandwidth(bad)


@pytest.mark.parametrize("text,seconds", [
    (0, 0.0), (1, 1.0), (0.001, 0.001), ("2", 2.0), ("1s", 1.0), ("20ms", 0.02), ("1.5ms", 0.0015),
    ("2us", 2e-6), ("2µs", 2e-6), ("500ns", 5e-7), ("10 MS", 0.01),
])
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds, rel=1e-12, abs=0)


@pytest.mark.parametrize("bad,reason", [
    ("-1ms", "negative"), ("5min", "unknown time unit"), ("soon", "not a duration"), (None, "duration"),
])
def test_parse_time_rejects(bad, reason):
    with pytest.raises(ValueError, match=reason):
        parse_time(bad)


@pytest.mark.parametrize("text,fraction", [
    ("0.01%", 0.0001), ("2%", 0.02), ("100%", 1.0), ("0%", 0.0), (0.5, 0.5), ("0.5", 0.5), (0, 0.0), (1, 1.0),
    (" 1.5 % ", 0.015),
])
def test_parse_loss(text, fraction):
    assert parse_loss(text) == fraction


@pytest.mark.parametrize("bad,reason", [
    (2, "use|write|%"), ("5", "%"), ("101%", "100%"), ("-1%", "between"), (-0.1, "negative"),
    ("1x", "unknown loss unit"), ("lots", "not a loss"),
])
def test_parse_loss_rejects(bad, reason):
    with pytest.raises(ValueError, match=reason):
        parse_loss(bad)


@pytest.mark.parametrize("text,size", [
    (1024, 1024), ("512", 512), ("1b", 1), ("1k", 1024), ("1kb", 1024), ("1KiB", 1024), ("512m", 512 * 2**20),
    ("512MB", 512 * 2**20), ("2g", 2 * 2**30), ("2GiB", 2 * 2**30), ("1.5g", 3 * 2**29), ("1t", 2**40),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["-1g", "2 gigs", "big", None])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("bps,text", [
    (10 * 10**9, "10gbit"), (100 * 10**6, "100mbit"), (1_500_000_000, "1.5gbit"), (999, "999bit"),
    (1000, "1kbit"), (2 * 10**12, "2tbit"),
])
def test_format_bandwidth(bps, text):
    assert format_bandwidth(bps) == text


@pytest.mark.parametrize("s,text", [(2e-6, "2us"), (0.0015, "1.5ms"), (0.02, "20ms"), (0, "0s"), (1, "1s"),
                                    (5e-7, "500ns"), (90, "90s")])
def test_format_time(s, text):
    assert format_time(s) == text


@given(st.integers(min_value=1, max_value=10**15))
def test_bandwidth_round_trip(bps):
    back = parse_bandwidth(format_bandwidth(bps))
    assert math.isclose(back, bps, rel_tol=1e-5, abs_tol=1)


@given(st.floats(min_value=1e-9, max_value=1e4, allow_nan=False))
def test_time_round_trip(s):
    assert math.isclose(parse_time(format_time(s)), s, rel_tol=1e-5, abs_tol=1e-15)


@given(st.decimals(min_value=0, max_value=100, places=4))
def test_loss_percent_in_range(pct):
    assert 0 <= parse_loss(f"{pct}%") <= 1


@given(st.one_of(st.text(max_size=12), st.integers(), st.floats(), st.none(), st.booleans()))
def test_parsers_raise_only_value_error(value):
    for fn in (parse_bandwidth, parse_time, parse_loss, parse_size):
        try:
            fn(value)
        except ValueError:
            pass
