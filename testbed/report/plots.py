"""PNG plots of a run: step time per rank, and link utilisation drawn on the topology."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def step_times(a: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in a["ranks"]:
        pts = r["step_times"]
        if pts:
            ax.plot([p["t"] for p in pts], [p["dt"] * 1e3 for p in pts], marker=".", lw=1,
                    label=f"r{r['rank']} {r['worker'] or ''}")
    ax.set_xlabel("time since first step (s, undilated)")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(f"step time per rank (dilation {a['dilation']:g})")
    if a["ranks"] and len(a["ranks"]) <= 16:
        ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def _layers(topo: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Workers at the bottom, each switch one row above its lowest neighbour."""
    import networkx as nx

    g = nx.Graph()
    kinds = {n["name"]: n["kind"] for n in topo["nodes"]}
    g.add_nodes_from(kinds)
    for l in topo["links"]:
        g.add_edge(*l["endpoints"])
    workers = [n for n, k in kinds.items() if k == "worker"]
    level = {w: 0 for w in workers}
    frontier = list(workers)
    while frontier:
        nxt = []
        for u in frontier:
            for v in g.neighbors(u):
                if v not in level:
                    level[v] = level[u] + 1
                    nxt.append(v)
        frontier = nxt
    rows: dict[int, list[str]] = {}
    for n in kinds:  # topology order keeps racks together
        rows.setdefault(level.get(n, 0), []).append(n)
    pos = {}
    for lv, ns in rows.items():
        for i, n in enumerate(ns):
            pos[n] = ((i + 0.5) / len(ns), float(lv))
    return pos


def links(a: dict[str, Any], topo: dict[str, Any], out: Path) -> Path:
    pos = _layers(topo)
    fig, ax = plt.subplots(figsize=(11, 6))
    cmap = plt.get_cmap("viridis")
    utils = []
    for l in a["links"]:
        u = max((l.get("util") or {}).values(), default=0.0)
        utils.append(u)
    vmax = max(utils + [1e-9])
    for l, u in zip(a["links"], utils):
        (x0, y0), (x1, y1) = pos[l["a"]], pos[l["b"]]
        ax.plot([x0, x1], [y0, y1], color=cmap(u / vmax), lw=0.8 + 5 * u / vmax, zorder=1)
    kinds = {n["name"]: n["kind"] for n in topo["nodes"]}
    for n, (x, y) in pos.items():
        w = kinds[n] == "worker"
        ax.scatter([x], [y], s=90 if w else 140, marker="o" if w else "s", color="tab:orange" if w else "tab:blue",
                   zorder=2)
        ax.annotate(n, (x, y), fontsize=6, ha="center", va="top" if w else "bottom",
                    xytext=(0, -7 if w else 7), textcoords="offset points")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, vmax * 100))
    fig.colorbar(sm, ax=ax, label="peak direction utilisation (% of dilated rate)")
    over = "while the job communicated" if (a.get("util_window") or {}).get("kind") == "comm" else "over the run"
    ax.set_title(f"link utilisation {over} ({a['summary'].get('testbed')})")
    ax.axis("off")
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def _save(fig, out) -> None:
    """The figure into the run directory, through no link a job planted there (rundir.write_bytes)."""
    import io

    from testbed.jobs import rundir

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    rundir.write_bytes(out, buf.getvalue())
