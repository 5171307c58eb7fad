"""Parsing and formatting of the units used in topology files. Pure functions.

Every parser takes what YAML gives (a number or a string) and either returns
the value in base units or raises ValueError whose message is only the reason;
the loader wraps it into a TopologyError that names the file, field and value.

Conventions (chosen to match what people write for links and containers):

- bandwidth: bits per second. tc-style suffixes ``bit, kbit, mbit, gbit, tbit``
  and the common ``bps, kbps, mbps, gbps, tbps`` spellings, case-insensitive,
  all *bits* per second and decimal (k = 1000). Note that tc itself reads
  ``kbps`` as kilobytes/s; we do not, because link speeds are quoted in bits
  ("10 Gbps") and that is what users mean. A bare number is bit/s.
- time: ``s, ms, us (or µs), ns``; a bare number is seconds.
- loss: ``"2%"`` is 0.02; a bare number is a fraction in [0, 1] (0.5 is 50%).
  A bare number above 1 is refused rather than guessed: say ``5%``.
- size (memory): bytes, binary multiples (k = 1024), like ``docker --memory``:
  ``k, kb, kib, m, mb, mib, g, gb, gib, t, tb, tib``; a bare number is bytes.

Numbers are parsed with Decimal so that "0.01%" is exactly the float 0.0001.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from collections.abc import Mapping
from typing import Any

__all__ = ["parse_bandwidth", "parse_time", "parse_loss", "parse_size",
           "format_bandwidth", "format_time", "format_size", "BANDWIDTH_UNITS", "TIME_UNITS", "SIZE_UNITS", "format_profile"]

BANDWIDTH_UNITS: dict[str, int] = {
    "": 1, "bit": 1, "bps": 1,
    "kbit": 10**3, "kbps": 10**3,
    "mbit": 10**6, "mbps": 10**6,
    "gbit": 10**9, "gbps": 10**9,
    "tbit": 10**12, "tbps": 10**12,
}

TIME_UNITS: dict[str, Decimal] = {
    "": Decimal(1), "s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6"),
    "µs": Decimal("1e-6"), "ns": Decimal("1e-9"),
}

SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    for _suffix in (_p, _p + "b", _p + "ib"):
        SIZE_UNITS[_suffix] = 1024**_i

# A decimal number (optionally signed, optional exponent) then an optional unit.
_QUANTITY = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S*?)\s*$")


def _split(value: Any, what: str, example: str) -> tuple[Decimal, str]:
    """(number, lower-case unit) of a YAML value; the unit is '' for a bare number."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected a {what} like {example}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{what} must be a finite number")
        return Decimal(str(value)), ""
    if not isinstance(value, str):
        raise ValueError(f"expected a {what} like {example}, not a {type(value).__name__}")
    m = _QUANTITY.match(value)
    if not m:
        raise ValueError(f"not a {what}: expected a number with a unit, like {example}")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:  # pragma: no cover - the regex only lets valid numbers through
        raise ValueError(f"not a {what}: bad number {m.group(1)!r}") from None
    return number, m.group(2).lower()


def _units_list(units: dict[str, Any]) -> str:
    return ", ".join(u for u in units if u)


def parse_bandwidth(value: Any) -> int:
    """A bandwidth in bit/s (int, > 0). '10gbit', '100Mbps', '1.5gbit', 1e9."""
    number, unit = _split(value, "bandwidth", "10gbit")
    if unit not in BANDWIDTH_UNITS:
        raise ValueError(f"unknown bandwidth unit {unit!r}; use one of {_units_list(BANDWIDTH_UNITS)} "
                         f"(all bits per second)")
    bps = number * BANDWIDTH_UNITS[unit]
    if bps <= 0:
        raise ValueError("bandwidth must be positive")
    result = int(bps.to_integral_value())
    if result < 1:
        raise ValueError("bandwidth must be at least 1 bit/s")
    return result


def parse_time(value: Any) -> float:
    """A duration in seconds (float, >= 0). '2us', '1.5ms', '1s', 0.001."""
    number, unit = _split(value, "duration", "10us or 1ms")
    if unit not in TIME_UNITS:
        raise ValueError(f"unknown time unit {unit!r}; use one of {_units_list(TIME_UNITS)}")
    if number < 0:
        raise ValueError("a duration must not be negative")
    return float(number * TIME_UNITS[unit])


def parse_loss(value: Any) -> float:
    """A loss rate as a fraction in [0, 1]. '0.01%' -> 0.0001, '2%' -> 0.02, 0.5 -> 0.5."""
    number, unit = _split(value, "loss rate", "0.1%")
    if unit == "%":
        if number < 0 or number > 100:
            raise ValueError("loss must be between 0% and 100%")
        return float(number / 100)
    if unit:
        raise ValueError(f"unknown loss unit {unit!r}; write a percentage like 0.1% or a fraction in [0, 1]")
    if number < 0:
        raise ValueError("loss must not be negative")
    if number > 1:
        raise ValueError("a bare loss number is a fraction in [0, 1]; for a percentage write e.g. 5%")
    return float(number)


def parse_size(value: Any) -> int:
    """A size in bytes (int, >= 0), binary multiples: '2g' -> 2 GiB, '512m', '1.5GiB', 1048576."""
    number, unit = _split(value, "size", "2g or 512m")
    if unit not in SIZE_UNITS:
        raise ValueError(f"unknown size unit {unit!r}; use one of {_units_list(SIZE_UNITS)} "
                         f"(binary: k = 1024)")
    if number < 0:
        raise ValueError("a size must not be negative")
    return int((number * SIZE_UNITS[unit]).to_integral_value())


def _num(x: float) -> str:
    """A short decimal: 10, 1.5, 0.125 (no exponent, no trailing zeros)."""
    text = f"{x:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def format_bandwidth(bps: int | float) -> str:
    """10_000_000_000 -> '10gbit', 1.5e9 -> '1.5gbit', 100e6 -> '100mbit' (parse_bandwidth reads it back)."""
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if abs(bps) >= scale:
            return _num(bps / scale) + unit
    return _num(bps) + "bit"


def format_time(seconds: float) -> str:
    """2e-6 -> '2us', 0.0015 -> '1.5ms', 0.02 -> '20ms', 0 -> '0s' (parse_time reads it back)."""
    if seconds == 0:
        return "0s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale * (1 - 1e-12):
            return _num(seconds / scale) + unit
    return _num(seconds / 1e-9) + "ns"


def format_size(nbytes: float) -> str:
    """1024 -> '1 KiB', 16777216 -> '16 MiB', 1.5 * 2**20 -> '1.5 MiB', 8 -> '8 B' (binary units)."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def format_profile(p: Mapping[str, Any]) -> str:
    """One direction's link profile (its JSON form) for people: '100mbit 5ms ±1ms loss 1% q 100'
    (`testbed link show`, the web view)."""
    parts = [format_bandwidth(p["bandwidth_bps"]) if p.get("bandwidth_bps") else "unshaped"]
    if p.get("delay_s"):
        parts.append(format_time(p["delay_s"]))
    if p.get("jitter_s"):
        parts.append("±" + format_time(p["jitter_s"]))
    if p.get("loss"):
        parts.append(f"loss {p['loss'] * 100:g}%")
    if p.get("queue"):
        parts.append(f"q {p['queue']}")
    return " ".join(parts)

