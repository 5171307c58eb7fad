"""bench/fidelity.py's page keeps the findings written above its generated part, and a cell is
faithful only within the verdict's floor. Pure."""

from bench_modules import load

fid = load("fidelity")
META = {"command": "sudo .venv/bin/python bench/fidelity.py --dilations auto", "date": "d", "machine": "m",
        "constants": "c", "seconds": 60.0}


def test_a_new_matrix_keeps_the_findings_above_it(tmp_path):
    page = tmp_path / "fidelity.md"
    page.write_text(fid.render_doc([], META, [], "## Since then\n\n- a finding measured by hand"))
    assert fid.kept_findings(page) == "## Since then\n\n- a finding measured by hand"
    again = fid.render_doc([], {**META, "date": "later"}, [], fid.kept_findings(page))
    assert again.count("a finding measured by hand") == 1 and "on later" in again
    assert again.index("a finding measured by hand") < again.index(fid.FINDINGS_END)


def test_a_page_without_findings_or_without_a_page_keeps_nothing(tmp_path):
    assert fid.kept_findings(tmp_path / "missing.md") == ""
    page = tmp_path / "fidelity.md"
    page.write_text(fid.render_doc([], META, []))
    assert fid.kept_findings(page) == ""


def test_a_finding_that_quotes_the_generated_line_is_kept(tmp_path):
    quoting = "- the old page said:\nMade by `sudo .venv/bin/python bench/fidelity.py` on 2026-11-30\n- and more"
    page = tmp_path / "fidelity.md"
    page.write_text(fid.render_doc([], META, [], quoting))
    assert fid.kept_findings(page) == quoting


def test_a_page_without_a_generated_part_is_kept_whole(tmp_path):
    page = tmp_path / "fidelity.md"
    page.write_text("\n" + fid.TITLE + "\n\n## Notes by hand\n\n- one\n- two\n")
    assert fid.kept_findings(page) == "## Notes by hand\n\n- one\n- two"
    page.write_text("## Untitled notes\n- one\n")
    assert fid.kept_findings(page) == "## Untitled notes\n- one"


def _row(error: float, tolerance: float, status: str = "within"):
    from testbed.report.verdict import ClassRow
    return ClassRow("all_reduce", 1 << 24, 6, 1 + error, 1.0, 1.0, 1.0, error, 1.0, "link",
                    tolerance=tolerance, status=status)


def test_a_cell_further_off_than_the_floor_is_never_faithful():
    assert fid.cell_status(_row(0.03, 0.10), 0.04, [])[0] == "faithful"
    # the class within, the cell's own loop 12% off inside a noise-widened 15%: undecided, not faithful
    status, why = fid.cell_status(_row(0.03, 0.15), 0.12, [])
    assert status == "inconclusive" and "undecided" in why, why
    assert fid.cell_status(_row(0.12, 0.15, "undecided"), 0.05, [])[0] == "inconclusive"
    assert fid.cell_status(_row(0.03, 0.15), 0.16, [])[0] == "not faithful"
    assert fid.cell_status(_row(0.30, 0.10, "off"), 0.30, [])[0] == "not faithful"
    assert fid.cell_status(_row(0.03, 0.10), 0.04, ["cpu: oversubscribed"])[0] == "not faithful"
    assert fid.cell_status(None, 0.0, [])[0] == "unverified"
