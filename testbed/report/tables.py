"""The text report of a run (rich table and plain text)."""

from __future__ import annotations

from typing import Any

from testbed.topology.units import format_size


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render(a: dict[str, Any]) -> str:
    s = a["summary"]
    lines = [f"run {a['run']}",
             f"testbed {s.get('testbed')}  launcher {s.get('launcher')}  world size {s.get('world_size')}  "
             f"status {s.get('status')} (exit {s.get('rc')})  wall {s.get('duration_s', 0):.1f} s",
             f"time dilation {a['dilation']:g} ({_dilation_how(s)}): times below are divided by it; "
             f"the ranks' clocks {'ran emulated' if s.get('emulated_clock') else 'were real'}", ""]
    hdr = f"{'rank':>5} {'worker':>8} {'steps':>6} {'iter p50 ms':>12} {'iter p95 ms':>12} {'samples/s':>10} {'comm %':>7}"
    lines += [hdr, "-" * len(hdr)]
    for r in a["ranks"]:
        sps = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}"
        cs = "-" if r["comm_share"] is None else f"{100 * r['comm_share']:.1f}"
        lines.append(f"{r['rank']:>5} {str(r['worker'] or '-'):>8} {r['steps']:>6} {_ms(r['iter_p50_s']):>12} "
                     f"{_ms(r['iter_p95_s']):>12} {sps:>10} {cs:>7}")
    if a.get("samples_per_s"):
        lines.append(f"total throughput: {a['samples_per_s']:.0f} samples/s")
    win = a.get("util_window") or {}
    if win.get("kind") == "comm":
        what = f"over the {win['s']:.2f} s the job communicated (first to last collective)"
    else:
        what = f"over the whole wall time ({win.get('s', 0):.2f} s: no collectives in the probe)"
    lines += ["", f"link utilisation {what}",
              f"{'tier':>12} {'links':>6} {'bytes':>12} {'peak util %':>12}"]
    for tier, t in a["tiers"].items():
        lines.append(f"{tier:>12} {t['links']:>6} {format_size(t['bytes']):>12} {100 * t['max_util']:>12.2f}")
    happened = [e for e in a.get("events") or [] if e["kind"] not in ("run", "verdict")]
    if happened:
        t0 = s.get("started") or happened[0]["t"]
        lines += ["", f"during the run ({len(happened)} event(s), testbed-events.jsonl; times from the start, wall clock)"]
        lines += [f"{e['t'] - t0:>9.2f} s  {e['kind']:<9} {e['what']}" for e in happened[:20]]
        if len(happened) > 20:
            lines.append(f"  ... {len(happened) - 20} more")
        files = sorted({e["file"] for e in happened if e["kind"] == "capture" and isinstance(e.get("file"), str)})
        if files:
            lines.append("captures taken: " + ", ".join(files))
    v = a.get("verdict")
    if v is not None:
        if v.classes:
            lines += ["", "collectives against the reference model (emulated time, mean instance; links: the links "
                          "alone, the textbook time; model: with this machine's per-message cost and the declared hosts)",
                      f"{'collective':>15} {'size':>10} {'count':>6} {'links ms':>9} {'model ms':>9} {'measured ms':>12} "
                      f"{'error':>7} {'tol':>5} {'share':>6} {'status':>7}  limited by"]
            for c in v.classes:
                lines.append(f"{c.op:>15} {format_size(c.nbytes):>10} {c.count:>6} {c.links_s * 1e3:>9.3f} "
                             f"{c.model_s * 1e3:>9.3f} {c.measured_s * 1e3:>12.3f} {100 * c.error:>+6.1f}% "
                             f"{100 * c.tolerance:>4.0f}% {100 * c.share:>5.0f}% {c.status:>7}  {c.bottleneck}")
            for u in v.unjudged:
                lines.append(f"{u.op:>15} {format_size(u.nbytes):>10} {u.count:>6}  not judged: {u.why}")
            if v.constants:
                lines.append(f"model constants: {v.constants}")
        lines += [""] + v.lines()
    return "\n".join(lines)


def _dilation_how(summary: dict[str, Any]) -> str:
    td = summary.get("time_dilation") or {}
    return td.get("setting") or td.get("source") or "none"
