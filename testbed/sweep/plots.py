"""The plots of a sweep (matplotlib, written as PNG next to the table).

iteration.png: the iteration time (emulated, ms) against the first swept parameter: every repeat a
  dot coloured by its verdict, the median joined by a line, the spread (lowest to highest repeat)
  as a bar, the expected iteration (the main job's) dashed; one series per value of the other
  parameters.
heatmap.png: with two swept parameters, the median iteration time of every combination, each
  cell saying its verdicts.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from testbed.sweep.plan import numeric, unit

VERDICT_COLOURS = {"faithful": "#2e7d32", "not faithful": "#c62828", "inconclusive": "#ef6c00",
                   "unverified": "#757575", "none": "#000000"}
VERDICT_LETTERS = {"faithful": "F", "not faithful": "N", "inconclusive": "I", "unverified": "U", "none": "-"}
ITERATION_PNG = "iteration.png"
HEATMAP_PNG = "heatmap.png"


def _axis_label(key: str) -> str:
    u = unit(key)
    return f"{key} ({u})" if u else key


def _positions(key: str | None, values: Sequence[Any]) -> tuple[list[float], list[str] | None, bool]:
    """Where each value goes on the x axis: numbers where every value is one (log scale when they
    span 8x or more), else categories in the order first seen."""
    if key is not None:
        nums = [numeric(key, v) for v in values]
        if all(n is not None for n in nums):
            pos = [float(n) for n in nums]   # type: ignore[arg-type]
            positive = [p for p in pos if p > 0]
            log = len(positive) == len(pos) and max(pos) / min(pos) >= 8
            return pos, None, log
    cats: list[str] = []
    for v in values:
        if str(v) not in cats:
            cats.append(str(v))
    return [float(cats.index(str(v))) for v in values], cats, False


def _series_key(params: dict[str, Any], others: Sequence[str]) -> str:
    return ", ".join(f"{k}={params.get(k)}" for k in others)


def iteration_plot(rows: Sequence[dict[str, Any]], swept: Sequence[str], path: Path, title: str) -> Path | None:
    """iteration.png; None when no run measured an iteration time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if isinstance(r.get("iteration_ms"), (int, float))]
    if not rows:
        return None
    key = swept[0] if swept else None
    others = list(swept[1:])
    xs_all = [(r.get("params") or {}).get(key) if key else "base" for r in rows]
    pos, cats, log = _positions(key, xs_all)
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for x, r in zip(pos, rows):
        series.setdefault(_series_key(r.get("params") or {}, others), []).append((x, r))
    shown_verdicts: set[str] = set()
    shown_builds: set[bool] = set()
    for si, (name, pts) in enumerate(series.items()):
        by_x: dict[float, list[dict[str, Any]]] = {}
        for x, r in pts:
            by_x.setdefault(x, []).append(r)
        xs = sorted(by_x)
        offset = (si - (len(series) - 1) / 2) * 0.04 * (1 if cats else 0)   # categories: series side by side
        med = [statistics.median(r["iteration_ms"] for r in by_x[x]) for x in xs]
        lo = [min(r["iteration_ms"] for r in by_x[x]) for x in xs]
        hi = [max(r["iteration_ms"] for r in by_x[x]) for x in xs]
        line, = ax.plot([x + offset for x in xs], med, "-", lw=1.6, label=name or "median of the repeats")
        ax.errorbar([x + offset for x in xs], med, yerr=[[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]],
                    fmt="none", ecolor=line.get_color(), capsize=5, lw=1.2)
        exp = [(x, statistics.median(e)) for x in xs
               if (e := [r["expected_ms"] for r in by_x[x] if isinstance(r.get("expected_ms"), (int, float))])]
        if exp:
            ax.plot([x + offset for x, _ in exp], [e for _, e in exp], "--", color=line.get_color(), lw=1, alpha=0.7,
                    label=("expected " + name) if name else "expected (compute + model all_reduce)")
        for x in xs:
            for r in by_x[x]:
                v = r.get("verdict") or "none"
                shown_verdicts.add(v)
                in_place = r.get("build") == "in place"
                shown_builds.add(in_place)
                ax.scatter([x + offset], [r["iteration_ms"]], s=36, zorder=3, color=VERDICT_COLOURS.get(v, "#000"),
                           marker="D" if in_place else "o", edgecolors="white", linewidths=0.6)
    for v in sorted(shown_verdicts):
        ax.scatter([], [], s=36, color=VERDICT_COLOURS.get(v, "#000"), label=f"verdict: {v}")
    if True in shown_builds:   # the marker says how the testbed reached the point
        ax.scatter([], [], s=30, marker="D", color="#999", label="links reconfigured in place")
    if cats is not None:
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats, rotation=20 if max(len(c) for c in cats) > 8 else 0)
    elif log:
        ax.set_xscale("log")
        ticks = sorted(set(pos))
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel(_axis_label(key) if key else "")
    ax.set_ylabel("iteration time, emulated (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def heatmap(rows: Sequence[dict[str, Any]], swept: Sequence[str], path: Path, title: str) -> Path | None:
    """heatmap.png for exactly two swept parameters; None otherwise or without iteration times."""
    if len(swept) != 2:
        return None
    rows = [r for r in rows if isinstance(r.get("iteration_ms"), (int, float))]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kx, ky = swept
    def ordered(key: str) -> list[Any]:
        vals: list[Any] = []
        for r in rows:
            v = (r.get("params") or {}).get(key)
            if v not in vals:
                vals.append(v)
        nums = [numeric(key, v) for v in vals]
        return [v for _, v in sorted(zip(nums, vals), key=lambda t: t[0])] if all(n is not None for n in nums) else vals

    xv, yv = ordered(kx), ordered(ky)
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        p = r.get("params") or {}
        cells.setdefault((xv.index(p.get(kx)), yv.index(p.get(ky))), []).append(r)
    grid = [[math.nan] * len(xv) for _ in yv]
    for (i, j), rs in cells.items():
        grid[j][i] = statistics.median(r["iteration_ms"] for r in rs)
    fig, ax = plt.subplots(figsize=(max(6.5, 2.2 + 1.3 * len(xv)), max(3.6, 1.8 + 0.8 * len(yv))), dpi=110)
    im = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    fig.colorbar(im, ax=ax, label="median iteration, emulated (ms)")
    finite = [v for row in grid for v in row if not math.isnan(v)]
    mid = (min(finite) + max(finite)) / 2 if finite else 0
    for (i, j), rs in cells.items():
        letters = "".join(VERDICT_LETTERS.get(r.get("verdict") or "none", "?") for r in rs)
        ax.text(i, j, f"{grid[j][i]:.1f}\n{letters}", ha="center", va="center", fontsize=8,
                color="white" if grid[j][i] < mid else "black")
    ax.set_xticks(range(len(xv)))
    ax.set_xticklabels([str(v) for v in xv])
    ax.set_yticks(range(len(yv)))
    ax.set_yticklabels([str(v) for v in yv])
    ax.set_xlabel(_axis_label(kx))
    ax.set_ylabel(_axis_label(ky))
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 90)) + "\nverdicts: F faithful, N not faithful, I inconclusive, "
                 "U unverified", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(directory: Path, rows: Sequence[dict[str, Any]], swept: Sequence[str], title: str) -> list[Path]:
    """The sweep's plots into `directory` (written whole: a temporary name, then renamed)."""
    import os
    import secrets

    made = []
    for name, fn in ((ITERATION_PNG, iteration_plot), (HEATMAP_PNG, heatmap)):
        tmp = directory / f".{name}.{secrets.token_hex(4)}.tmp.png"
        try:
            out = fn(rows, swept, tmp, title)
            if out is not None:
                os.replace(tmp, directory / name)
                made.append(directory / name)
        finally:
            if tmp.exists():
                tmp.unlink()
    return made
