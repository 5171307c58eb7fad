"""Draw a topology as a layered picture (PNG, matplotlib's Agg backend: no display needed).

Nodes sit where testbed.topology.layout puts them: workers at the bottom, each switch one row
above per hop of distance to its nearest worker, a fat-tree's pods as columns.

Edges are coloured by link rate (the slower direction; grey when unshaped)
or, when `utilisation` is given, by utilisation (0..1, green to red; grey
where the value is None or missing), with a colour bar. Small drawings get
node names and edge labels (rate, and utilisation in percent); above
LABEL_NODES nodes / LABEL_EDGES edges the labels are left out, so a
1000-node topology still renders (as a picture of its shape) in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from testbed.topology.layout import layout
from testbed.topology.model import Topology
from testbed.topology.units import format_bandwidth

__all__ = ["draw_topology", "LABEL_NODES", "LABEL_EDGES"]

LABEL_NODES = 120   # draw node names up to this many nodes
LABEL_EDGES = 64    # draw edge labels up to this many links


def _edge_key(utilisation: Mapping | None, a: str, b: str):
    if not utilisation:
        return None
    if (a, b) in utilisation:
        return utilisation[(a, b)]
    return utilisation.get((b, a))


def draw_topology(topo: Topology, out_png: str | Path,
                  utilisation: Mapping[tuple[str, str], float | None] | None = None,
                  title: str | None = None) -> Path:
    """Write a PNG of `topo` to `out_png` and return its path. `utilisation`: (a, b) -> 0..1 or None
    (either orientation of the pair is accepted)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors
    from matplotlib.collections import LineCollection

    out = Path(out_png)
    pos = layout(topo)
    n_nodes, n_links = len(topo.nodes), len(topo.links)
    label_nodes = n_nodes <= LABEL_NODES
    label_edges = n_links <= LABEL_EDGES
    widest = max((sum(1 for p in pos.values() if p[1] == y) for y in {p[1] for p in pos.values()}), default=1)
    levels = max((p[1] for p in pos.values()), default=0) + 1
    width = min(40.0 if label_nodes else 24.0, max(8.0, widest * (0.75 if label_nodes else 0.05)))
    height = min(20.0, max(4.0, levels * 1.8))
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    try:
        segments, values, labels = [], [], []
        for link in topo.links:
            (xa, ya), (xb, yb) = pos[link.a], pos[link.b]
            segments.append([(xa, ya), (xb, yb)])
            rates = [p.bandwidth_bps for p in (link.ab, link.ba)]
            rate = None if None in rates else min(rates)
            text = "unshaped" if rate is None else format_bandwidth(rate)
            if utilisation is not None:
                u = _edge_key(utilisation, link.a, link.b)
                values.append(u)
                if u is not None:
                    text += f"\n{u * 100:.0f}%"
            else:
                values.append(rate)
            labels.append(text)

        if utilisation is not None:
            cmap = plt.get_cmap("RdYlGn_r")
            norm = colors.Normalize(vmin=0.0, vmax=1.0)
            bar_label = "utilisation"
        else:
            cmap = plt.get_cmap("viridis")
            shaped = [v for v in values if v is not None]
            lo, hi = (min(shaped), max(shaped)) if shaped else (1.0, 10.0)
            if lo == hi:
                lo, hi = lo / 10, hi * 10
            norm = colors.LogNorm(vmin=lo, vmax=hi)
            bar_label = "link rate (bit/s)"
        edge_colors = [(0.7, 0.7, 0.7, 1.0) if v is None else cmap(norm(v)) for v in values]
        lw = 2.0 if n_links <= 100 else (1.0 if n_links <= 1000 else 0.4)
        ax.add_collection(LineCollection(segments, colors=edge_colors, linewidths=lw, zorder=1))
        distinct = {v for v in values if v is not None}
        if utilisation is not None or len(distinct) > 1:
            mappable = cm.ScalarMappable(norm=norm, cmap=cmap)
            mappable.set_array([])
            fig.colorbar(mappable, ax=ax, label=bar_label, fraction=0.03, pad=0.01)

        if label_edges:
            for (p, q), text in zip(segments, labels):
                lo, hi = (p, q) if p[1] <= q[1] else (q, p)  # 30% up from the lower end: less overlap
                ax.text(lo[0] + 0.3 * (hi[0] - lo[0]), lo[1] + 0.3 * (hi[1] - lo[1]), text, fontsize=6, ha="center", va="center",
                        zorder=3, bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))

        size = 300 if label_nodes else max(4.0, 2000.0 / max(1, n_nodes))
        for kind, plural, marker, color in (("worker", "workers", "s", "#4c72b0"),
                                            ("switch", "switches", "o", "#dd8452")):
            names = [n for n, node in topo.nodes.items() if node.kind == kind]
            if not names:
                continue
            ax.scatter([pos[n][0] for n in names], [pos[n][1] for n in names], s=size, marker=marker,
                       c=color, edgecolors="black", linewidths=0.5 if label_nodes else 0.0, zorder=2,
                       label=f"{plural} ({len(names)})" + (
                           f"; every link {format_bandwidth(distinct.pop())}"
                           if kind == "worker" and utilisation is None and len(distinct) == 1 else ""))
        if label_nodes:
            font = 7 if widest <= 24 else 5
            for n, (x, y) in pos.items():
                ax.text(x, y - 0.12, n, fontsize=font, ha="center", va="top", zorder=4,
                        rotation=0 if widest <= 24 else 60)
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.6, levels - 0.4)
        ax.set_axis_off()
        gpus = sum(node.gpus for node in topo.nodes.values())
        subtitle = f"{len(topo.workers)} workers, {len(topo.switches)} switches, {n_links} links"
        if gpus:
            subtitle += f", {gpus} GPUs"
        ax.set_title(f"{title or topo.name}\n{subtitle}", fontsize=11)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out

