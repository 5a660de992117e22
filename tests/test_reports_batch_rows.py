"""Every batch row in the HTML report (up to MAX_BATCH_ROWS, with a selector), and the Overview's lines."""

from __future__ import annotations

import re

import numpy as np
import pytest
from reports_helpers import cross_capture, stack_capture, words
from test_reports_html import report_meta

from attnprobe import AttnprobeError, CheckResult, Violation
from attnprobe.reports import to_html
from attnprobe.reports.encoding import decode_floats
from attnprobe.reports.html import MAX_BATCH_ROWS, layer_ranges


def test_every_batch_row_is_on_the_page(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=3)
    tokens = [words(5, "a"), words(5, "b"), words(5, "c")]
    document = to_html(cap, tokens=tokens)
    meta, blobs = report_meta(document)
    rows = [meta, *meta["moreRows"]]
    assert [r["batch"] for r in rows] == [0, 1, 2]
    for b, row in enumerate(rows):  # each row's matrices are that row's
        src = row["records"][1]["sources"][0]
        weights = decode_floats(blobs[src["weights"][1]], 25, "exact").reshape(5, 5)
        np.testing.assert_array_equal(weights, cap[1].weights[b, 1].float().numpy())
    assert len({r["thumbBlob"] for r in rows}) == 3
    assert (
        meta["records"][0]["sources"][0]["padding"] == [0, 1] and rows[1]["records"][0]["sources"][0]["padding"] == []
    )
    options = re.findall(r'<option value="(\d)">(\d): ([^<]*)</option>', document)
    assert [(v, b) for v, b, _ in options] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert options[1][2].startswith("b0 b1")
    assert "3 rows; all shown: choose one with the <i>batch row</i> selector" in document
    assert "summary>Tokens of batch row 2 (5)</summary>" in document
    # one row asked for: one row, no selector
    single = to_html(cap, tokens=tokens, batch=2)
    meta, _ = report_meta(single)
    assert meta["batch"] == 2 and meta["moreRows"] == [] and 'id="batch-row"' not in single
    assert "this report shows row 2 (choose another with <code>batch=</code>" in single
    meta, _ = report_meta(to_html(cap, batch=[2, 0]))
    assert [meta["batch"]] + [r["batch"] for r in meta["moreRows"]] == [2, 0]
    with pytest.raises(AttnprobeError, match="batch row 5 does not exist"):
        to_html(cap, batch=[0, 5])


def test_rows_past_the_bound_or_the_budget_are_left_to_batch(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=4, batch=MAX_BATCH_ROWS + 3, padded=False)
    document = to_html(cap)
    meta, _ = report_meta(document)
    assert 1 + len(meta["moreRows"]) == MAX_BATCH_ROWS
    assert (
        f"{MAX_BATCH_ROWS + 3} rows; rows 0, 1, 2, 3, 4, 5, 6, 7 shown (at most {MAX_BATCH_ROWS} per report" in document
    )
    per_row = 2 * 16  # weights and scores of one 4 x 4 head
    meta, _ = report_meta(to_html(cap, max_values=3 * per_row))
    assert 1 + len(meta["moreRows"]) == 3  # as many rows as fit max_values
    with pytest.raises(AttnprobeError, match=r"\(2 batch rows\).*one batch row \(batch=\)"):
        to_html(cap, batch=[0, 1], max_values=per_row)


def test_findings_link_to_their_row_and_are_marked_there(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=2)
    checks = CheckResult(
        violations=(
            Violation(
                "causal",
                "error",
                "layers.1",
                1,
                head=1,
                batch=1,
                queries=(2,),
                keys=(4,),
                count=1,
                worst=0.5,
                message="weight on a future key",
            ),
        ),
        checks=("causal",),
        records=2,
    )
    document = to_html(cap, checks=checks)
    meta, _ = report_meta(document)
    assert meta["flags"]["1-1"]["marks"] == []  # not in row 0
    assert meta["moreRows"][0]["flags"]["1-1"]["marks"] == [{"check": "causal", "queries": [2], "keys": [4]}]
    assert 'href="#head-1-1-b1"' in document and "not shown here" not in document


def test_overview_sequence_lines_name_layers_not_modules(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=3, heads=1, length=5)
    document = to_html(cap)
    assert "<dt>sequence</dt><dd>5 positions (layers 0–2)</dd>" in document
    cross = to_html(cross_capture(assert_no_hooks, queries=5, keys=9))
    assert re.search(r"<dt>cross-attention keys</dt><dd>9 keys \(layers? [0-9, –]+\)</dd>", cross)
    assert layer_ranges([0, 1, 2, 3, 5, 7, 8]) == "0–3, 5, 7, 8"


def test_cli_report_shows_every_row_unless_batch_is_given(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from attnprobe.cli import main

    monkeypatch.chdir(tmp_path)
    ids = ["--ids", "1 2 3 4", "--ids", "5 6"]
    result = CliRunner().invoke(main, ["report", "cli_factories:tiny", *ids, "--out", "all.html", "-q"])
    assert result.exit_code == 0, result.output
    meta, _ = report_meta((tmp_path / "all.html").read_text())
    assert meta["batch"] == 0 and [r["batch"] for r in meta["moreRows"]] == [1]
    result = CliRunner().invoke(main, ["report", "cli_factories:tiny", *ids, "--out", "one.html", "--batch", "1", "-q"])
    assert result.exit_code == 0, result.output
    meta, _ = report_meta((tmp_path / "one.html").read_text())
    assert meta["batch"] == 1 and meta["moreRows"] == []


def test_notebook_view_shows_every_row_when_they_fit(assert_no_hooks):
    import base64

    from attnprobe.reports import inline
    from attnprobe.reports.page import estimate_view_bytes

    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=5, batch=2)

    def page(view):
        return base64.b64decode(view.split("base64,", 1)[1].split('"', 1)[0]).decode()

    meta, _ = report_meta(page(inline.repr_html(cap)))
    assert [r["batch"] for r in meta["moreRows"]] == [1]
    small = inline.MAX_BYTES
    try:
        inline.MAX_BYTES = estimate_view_bytes(list(cap), "exact") + 1  # one row fits, two do not
        view = inline.repr_html(cap)
    finally:
        inline.MAX_BYTES = small
    assert "batch row 0 of 2" in view and report_meta(page(view))[0]["moreRows"] == []
