"""The reduced fidelity matrix (bench/fidelity.py --quick): real testbeds, real gloo ranks, the model.

Loose bounds, as the issue asks of CI, on bandwidth-bound cells (16 MiB and more): every cell gets a
verdict; no cell off the model by more than 20% is called faithful; the all_reduce cells (what DDP
sends) land within 25% of the model. docs/fidelity.md has the full matrix and the real numbers,
latency-bound cells included."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_reduced_fidelity_matrix(root, state_dir, tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import fidelity

    cells = []
    for kind, ranks, dilation, ops, sizes in fidelity.plan_matrix(quick=True):
        cells += fidelity.run_cell_group(kind, ranks, dilation, ops, sizes, tmp_path)
    assert len(cells) == sum(len(ops) * len(sizes) for *_, ops, sizes in fidelity.QUICK)
    for c in cells:
        assert c.verdict in ("faithful", "not faithful", "unverified"), c
        assert c.measured_s > 0 and c.model_s > 0, c
        if abs(c.error) > 0.20:
            # no silent error: the verdict times each call from the last rank's arrival, the benchmark a
            # loop of calls (scheduling gaps between calls included), so near the 10% line they can
            # disagree (33 of 1476 cells in docs/fidelity.md); well past it they must not
            assert c.verdict != "faithful", c
    big = [c for c in cells if c.op == "all_reduce"]
    assert big and all(abs(c.error) <= 0.25 for c in big), [(c.topology, c.bytes, c.error) for c in big]
