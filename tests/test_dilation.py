"""Time dilation: pure functions of testbed.jobs.dilation."""

import pytest

from testbed.topology.dilation import auto_factor, dilate, undilate
from testbed.topology.model import LinkProfile


def test_dilate_scales_bandwidth_and_delay():
    p = LinkProfile(bandwidth_bps=10_000_000_000, delay_s=2e-6, jitter_s=1e-6, loss=0.01, queue=100, mtu=9000)
    d = dilate(p, 4)
    assert d.bandwidth_bps == 2_500_000_000
    assert d.delay_s == pytest.approx(8e-6) and d.jitter_s == pytest.approx(4e-6)
    assert (d.loss, d.queue, d.mtu) == (0.01, 100, 9000)


def test_dilate_identity_and_unshaped():
    p = LinkProfile(bandwidth_bps=None, delay_s=0.001)
    assert dilate(p, 1) == p
    assert dilate(p, 2).bandwidth_bps is None and dilate(p, 2).delay_s == pytest.approx(0.002)


@pytest.mark.parametrize("s", [0, 0.5, -1, float("nan"), float("inf")])
def test_dilate_rejects_bad_factor(s):
    with pytest.raises(ValueError):
        dilate(LinkProfile(), s)


@pytest.mark.parametrize("ranks,gpus,cpus,s", [
    (16, 0, 2, 8.0), (16, 2, 2, 8.0), (16, 8, 2, 2.0), (4, 8, 2, 1.0), (1, 0, 2, 1.0), (0, 0, 2, 1.0),
    (3, 0, 2, 1.5), (16, 0, 0, 16.0),
])
def test_auto_factor(ranks, gpus, cpus, s):
    assert auto_factor(ranks, gpus, cpus) == pytest.approx(s)


def test_undilate():
    assert undilate(8.0, 4) == 2.0
