"""The reduced fidelity matrix (bench/fidelity.py --quick): real testbeds, real gloo ranks, the model.

At the verdict's own tolerance (a class's: 10%, or its measured noise when that is larger). A cell is
held to its class's model, the one the verdict used (the run's own per-message cost, measured in the
run), so the moment the boot's calibration was taken does not decide the outcome (CI's run of
2026-12-02 failed when the cell used the calibration's alpha, 1.08 ms, and its class the run's):
- every cell gets a verdict, and a cell called faithful is within 10% of the model (its class's
  instances and its own loop: one further off within only its noise is undecided);
- the two clocks agree on every cell with a class: the benchmark's loop of calls and the probe's
  instances of the same calls, within 5% or the instances' own 95% interval when that is wider
  (the instances include the warm-up call). Measured here: all_reduce 16-64 MiB within 0.0-2.7%,
  all_gather within 9.6% at a 23% interval, 256 KiB within 11% at 35-44% (2026-12-02, 4 runs);
- the dumbbell's all_reduce of 16 MiB (what DDP sends, bound by its 1 Gbit/s middle link, on
  network-bound hosts: the default) is faithful: measured here at -0.3% to +1.1% of the model in
  five runs (2026-12-07, auto s=2). It was +5.3% to +6.2% while a link's default queue was 1000
  packets, and CI failed at +11% and +13% (docs/fidelity.md, "A link's default queue").
The star's all_reduce of 16 MiB at 10 Gbit/s is not asserted faithful: measured -8%, -4% and
+10.4% of the model in three runs at auto (s=4.7), so this machine does not yet hold it within
10% every time (the verdict says so when it does not). docs/fidelity.md has the misses
(all_gather, 64 MiB on the star) and why."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_reduced_fidelity_matrix(root, state_dir, tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import fidelity

    said: list[str] = []
    cells = []
    for kind, ranks, dilation, ops, sizes in fidelity.plan_matrix(quick=True):
        cells += fidelity.run_cell_group(kind, ranks, dilation, ops, sizes, tmp_path, min_iters=fidelity.MIN_ITERS,
                                         recheck=said.append)
    assert len(cells) == sum(len(ops) * len(sizes) for *_, ops, sizes in fidelity.QUICK)
    for c in cells:
        assert c.verdict in ("faithful", "not faithful", "inconclusive", "unverified"), c
        assert c.measured_s > 0 and c.model_s > 0 and 0 < c.links_s <= c.model_s, c
        if c.probe_s > 0:
            assert abs(c.probe_s / c.measured_s - 1) <= max(0.05, c.noise), c
        if c.verdict == "faithful":   # within the floor itself, never only within a noise-widened tolerance
            assert abs(c.probe_s / c.model_s - 1) <= 0.10 and abs(c.error) <= 0.10, c
    ddp = [c for c in cells if c.op == "all_reduce" and c.bytes == 16 << 20 and c.topology == "dumbbell"]
    assert len(ddp) == 1 and ddp[0].verdict == "faithful", (ddp, said)
