"""The calibration: deriving the constants, validating the per-boot cache (pure, no root),
and one real measurement (root)."""

import json

import pytest

from testbed.jobs import calibration
from testbed.topology.reference import cost_terms


def _rows(alpha: float, beta: float, ops=calibration.OPS):
    """What collectives_bench would report for two ranks if every op cost exactly alpha and beta."""
    rows = []
    for op in ops:
        for size in (calibration.SMALL, *calibration.LARGE):
            m, b = cost_terms(op, size)
            t = m * alpha + b * beta
            rows.append({"op": op, "bytes": size, "time_s": t, "times_s": [t * 1.02, t, t * 0.99]})
    return rows


def test_derive_recovers_the_constants_of_every_collective():
    ops = calibration.derive(_rows(300e-6, 1.2e-9))
    assert set(ops) == set(calibration.OPS)
    for op, v in ops.items():
        assert v["alpha_s"] == pytest.approx(300e-6, rel=1e-6), op
        assert v["beta_s_per_byte"] == pytest.approx(1.2e-9, rel=1e-6), op


def test_derive_refuses_nonsense():
    rows = _rows(300e-6, 1.2e-9, ops=("all_reduce",))
    for r in rows:
        if r["bytes"] == calibration.SMALL:
            r["times_s"] = [0.0, 0.0, 0.0]   # a small message cannot take no time
    with pytest.raises(calibration.CalibrationError, match="all_reduce"):
        calibration.derive(rows)


def _doc(**over):
    ops = {op: {"alpha_s": 3e-4, "beta_s_per_byte": 1.2e-9} for op in calibration.OPS}
    doc = {"alpha_s": 3e-4, "beta_s_per_byte": 1.2e-9, "ops": ops, "cores": calibration._cores(),
           "measured_at": 1.7e9, "boot_id": calibration.boot_id(), "torch": calibration._torch_version(),
           "busy_before": 0.05, "seconds": 10.0, "rows": []}
    doc.update(over)
    return doc


@pytest.mark.parametrize("field,value", [
    ("alpha_s", -1), ("alpha_s", "fast"), ("alpha_s", float("nan")), ("beta_s_per_byte", 0), ("cores", 0),
    ("cores", True), ("ops", {"all_reduce": {"alpha_s": 1e-4}}), ("ops", {"rm -rf": {}}), ("rows", "x"),
])
def test_parse_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        calibration.parse(_doc(**{field: value}))


def test_cache_is_per_boot_and_per_torch(tmp_path, monkeypatch):
    f = tmp_path / "cal.json"
    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(f))
    assert calibration.cached() is None                       # none yet
    f.write_text(json.dumps(_doc()))
    cal = calibration.cached()
    assert cal is not None and cal.constants().for_op("send_recv") == (3e-4, 1.2e-9)
    assert "calibrated" in cal.constants().source
    f.write_text(json.dumps(_doc(boot_id="another-boot")))
    assert calibration.cached() is None                       # an earlier boot's numbers are not used
    f.write_text(json.dumps(_doc(torch="0.0.1")))
    assert calibration.cached() is None                       # nor another torch's
    f.write_text("{not json")
    assert calibration.cached() is None
    f.write_text(json.dumps(_doc(alpha_s=-5)))
    assert calibration.cached() is None                       # nor a tampered file


def test_lines_describe_every_collective():
    text = "\n".join(calibration.parse(_doc()).lines())
    for op in calibration.OPS:
        assert op in text
    assert "Gbit/s" in text


@pytest.mark.slow
def test_measure_for_real(root, state_dir, tmp_path, monkeypatch):
    from testbed.net import netns

    monkeypatch.setenv("TESTBED_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    before = set(netns.list_names())
    cal = calibration.get(refresh=True)
    assert set(cal.ops) == set(calibration.OPS)
    # gloo on any machine: tens of microseconds to milliseconds per message, 0.1 to 100 Gbit/s per rank
    assert 5e-6 < cal.alpha_s < 5e-3
    assert 0.1e9 < 8 / cal.beta_s_per_byte < 100e9
    assert calibration.cached() == cal
    assert set(netns.list_names()) == before                  # its testbed is gone
    assert not [p for p in state_dir.iterdir() if not p.name.startswith(".")]   # nor its state
