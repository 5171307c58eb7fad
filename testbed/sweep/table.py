"""The results of a sweep as one table: a row per run (point, repeat), written as CSV and JSON.

A row holds the point's parameter values, how the testbed got there (a fresh `up` or the links
reconfigured in place), the iteration time (emulated, the median of the ranks' p50), the expected
iteration (the main job's: the slowest rank's own compute plus the model's all_reduce), every
collective class against the reference model, and the verdict. Rows are kept one file per run
in the sweep directory (results/RUN.json, written when the run is judged); the table is made
from them after every run, so an interrupted sweep leaves a whole table of what it finished.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from pathlib import Path
from typing import Any, Sequence

from testbed import safeio

RESULTS = "results"
TABLE_CSV = "table.csv"
TABLE_JSON = "table.json"
ROW_MAX_BYTES = 1 << 20
FIXED = ("point", "repeat")
AFTER = ("build", "dilation", "outcome", "iteration_ms", "iteration_p95_ms", "expected_ms", "expected_error",
         "verdict", "other_work", "loadavg", "wall_s", "run_dir")


def class_key(op: str, nbytes: int) -> str:
    from testbed.topology.units import format_size

    return f"{op} {format_size(nbytes)}"


def row(point: Any, repeat: int, build: str, analysis: dict[str, Any] | None, verdict: Any,
        expected_s: float | None, wall_s: float, run_dir: str | None, outcome: str,
        other_work: float | None = None, loadavg: float | None = None) -> dict[str, Any]:
    """One run's row. analysis: testbed.report's (None when the run made no probe data); verdict:
    testbed.report.verdict.Verdict (None when the run could not be judged); other_work: the share
    of the CPUs other work took during the run (the run monitor's); loadavg: the machine's 1-minute
    load when the run started."""
    ranks = (analysis or {}).get("ranks") or []
    p50 = [r["iter_p50_s"] for r in ranks if r.get("iter_p50_s")]
    p95 = [r["iter_p95_s"] for r in ranks if r.get("iter_p95_s")]
    it = statistics.median(p50) if p50 else None
    classes = []
    for c in getattr(verdict, "classes", None) or []:
        classes.append({"class": class_key(c.op, c.nbytes), "op": c.op, "bytes": c.nbytes, "count": c.count,
                        "measured_ms": c.measured_s * 1e3, "model_ms": c.model_s * 1e3, "links_ms": c.links_s * 1e3,
                        "error": c.error, "tolerance": c.tolerance, "share": c.share, "status": c.status})
    return {
        "point": point.id, "repeat": repeat, "params": {k: v for k, v in point.params},
        "label": point.label, "build": build,
        "dilation": ((analysis or {}).get("dilation")),
        "outcome": outcome,
        "iteration_ms": None if it is None else it * 1e3,
        "iteration_p95_ms": statistics.median(p95) * 1e3 if p95 else None,
        "expected_ms": None if expected_s is None else expected_s * 1e3,
        "expected_error": None if it is None or not expected_s else it / expected_s - 1,
        "verdict": getattr(verdict, "status", None) or "none",
        "reasons": list(getattr(verdict, "reasons", None) or []),
        "collectives": classes,
        "other_work": other_work,
        "loadavg": loadavg,
        "wall_s": wall_s,
        "run_dir": run_dir,
    }


def _read_row(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(safeio.read_regular(path, ROW_MAX_BYTES))
    except (OSError, ValueError, safeio.Unsafe):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("point"), str) else None


def load_rows(directory: Path, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The rows of the runs done (results/KEY.json), by run key; a file that is not a row is passed over."""
    out = {}
    for key in keys:
        r = _read_row(directory / RESULTS / f"{key}.json")
        if r is not None:
            out[key] = r
    return out


def save_row(directory: Path, key: str, data: dict[str, Any]) -> None:
    """One run's row, written whole (a new file renamed over: never half a row)."""
    os.close(safeio.open_dir_beneath(directory, RESULTS, create=True))
    safeio.write_beneath(directory, f"{RESULTS}/{key}.json", json.dumps(data, indent=1, default=str).encode())


def columns(rows: Sequence[dict[str, Any]], swept: Sequence[str]) -> list[str]:
    """The CSV's columns: point, repeat, the swept parameters, the fixed ones, then per collective
    class its measured and model time, error and status (classes in order of first appearance)."""
    classes: list[str] = []
    for r in rows:
        for c in r.get("collectives") or []:
            if c["class"] not in classes:
                classes.append(c["class"])
    per_class = [f"{c} {what}" for c in classes for what in ("measured_ms", "model_ms", "error", "status")]
    return [*FIXED, *swept, *AFTER, *per_class]


def _flat(r: dict[str, Any], swept: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: r.get(k) for k in (*FIXED, *AFTER)}
    for k in swept:
        out[k] = (r.get("params") or {}).get(k)
    for c in r.get("collectives") or []:
        for what in ("measured_ms", "model_ms", "error", "status"):
            out[f"{c['class']} {what}"] = c.get(what)
    return out


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def csv_text(rows: Sequence[dict[str, Any]], swept: Sequence[str]) -> str:
    cols = columns(rows, swept)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        flat = _flat(r, swept)
        w.writerow([_cell(flat.get(c)) for c in cols])
    return buf.getvalue()


def write_table(directory: Path, rows: Sequence[dict[str, Any]], swept: Sequence[str], meta: dict[str, Any]) -> list[Path]:
    """table.csv and table.json of `rows` (in plan order), each written whole."""
    safeio.write_beneath(directory, TABLE_CSV, csv_text(rows, swept).encode())
    doc = {**meta, "swept": list(swept), "rows": list(rows)}
    safeio.write_beneath(directory, TABLE_JSON, json.dumps(doc, indent=1, default=str).encode())
    return [directory / TABLE_CSV, directory / TABLE_JSON]


def summary_by_point(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: its parameters, the median, lowest and highest iteration time over its repeats,
    the verdicts, the expected iteration (median)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["point"], []).append(r)
    out = []
    for point, rs in by.items():
        its = [r["iteration_ms"] for r in rs if isinstance(r.get("iteration_ms"), (int, float))]
        exp = [r["expected_ms"] for r in rs if isinstance(r.get("expected_ms"), (int, float))]
        out.append({"point": point, "params": rs[0].get("params") or {}, "label": rs[0].get("label"),
                    "runs": len(rs), "iterations_ms": its,
                    "median_ms": statistics.median(its) if its else None,
                    "min_ms": min(its) if its else None, "max_ms": max(its) if its else None,
                    "expected_ms": statistics.median(exp) if exp else None,
                    "verdicts": [r.get("verdict") for r in rs], "builds": [r.get("build") for r in rs]})
    return out
