"""Where each node of a topology goes in a drawing, in tiers. Pure.

Workers sit at the bottom, each switch one row above per hop of distance to its nearest worker
(edge/leaf, then aggregation/spine, then core), nodes no worker reaches on a row of their own at
the top. Within a row nodes are ordered by the mean position of their neighbours below (a
barycentre sweep), so a fat-tree's pods come out as columns. The report's picture
(testbed.report.draw) and the live page (testbed.observe.graph) both draw from it.
"""

from __future__ import annotations

from testbed.topology.analysis import switch_layers
from testbed.topology.model import Topology


def _layers(topo: Topology) -> dict[str, int]:
    """Drawing row of every node: hops to the nearest worker; unreachable nodes on top."""
    dist = switch_layers(topo)
    top = max(dist.values(), default=0) + 1
    for n in topo.nodes:
        dist.setdefault(n, top)
    return dist


def layout(topo: Topology) -> dict[str, tuple[float, float]]:
    """Node -> (x, y): y is the layer (0 = workers), x in [0, 1] within the layer."""
    layer = _layers(topo)
    rows: dict[int, list[str]] = {}
    for n in topo.nodes:  # topology order first: generators number nodes rack by rack
        rows.setdefault(layer[n], []).append(n)
    adj: dict[str, list[str]] = {n: [] for n in topo.nodes}
    for link in topo.links:
        adj[link.a].append(link.b)
        adj[link.b].append(link.a)
    pos: dict[str, tuple[float, float]] = {}

    def place(row: list[str], y: int) -> None:
        m = len(row)
        for i, n in enumerate(row):
            pos[n] = ((i + 0.5) / m if m else 0.5, float(y))

    levels = sorted(rows)
    place(rows[levels[0]], levels[0])
    for y in levels[1:]:
        row = rows[y]
        index = {n: i for i, n in enumerate(row)}

        def key(n: str) -> tuple[float, int]:
            below = [pos[v][0] for v in adj[n] if v in pos and pos[v][1] < y]
            return (sum(below) / len(below) if below else 2.0, index[n])

        rows[y] = sorted(row, key=key)
        place(rows[y], y)
    return pos
