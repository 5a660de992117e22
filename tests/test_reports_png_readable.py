"""PNG readability: cell numbers only where they fit at 7 pt, titles that say what is shown, token labels
on grids, and `report --out NAME.png` choosing the format by the suffix."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image
from reports_helpers import cross_capture, stack_capture, words

from attnprobe.cli import main
from attnprobe.probe.outputs.frames import SUMMARY_SCHEMA
from attnprobe.reports import head_grid, heatmap, save_summary, summary_plot
from attnprobe.reports.png import CELL_FONT_POINTS, GRID_TOKEN_POINTS


def summary_frame(layers: int, heads: int, value: float) -> pd.DataFrame:
    rows = [
        {"layer": layer, "name": f"l{layer}", "head": h, "rows": 4, **dict.fromkeys(list(SUMMARY_SCHEMA)[4:], value)}
        for layer in range(layers)
        for h in range(heads)
    ]
    return pd.DataFrame(rows).astype(SUMMARY_SCHEMA)


def cell_labels_after_draw(frame, figsize, dpi):
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    summary_plot(frame, "entropy", ax=ax)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    (labels,) = ax.artists
    return labels, canvas.get_renderer(), ax


@pytest.mark.parametrize("dpi", [50, 100, 200])
def test_summary_numbers_appear_only_where_they_fit_at_7_points(dpi):
    few, renderer, ax = cell_labels_after_draw(summary_frame(2, 3, 0.00094), (4.2, 3.4), dpi)
    assert few.shown and {t.get_text() for t in few.texts} == {"9e-04"}
    assert all(t.get_fontsize() == CELL_FONT_POINTS for t in few.texts)
    (x0, _), (x1, _) = ax.transData.transform([(0, 0), (1, 1)])
    assert all(t.get_window_extent(renderer).width < abs(x1 - x0) for t in few.texts)  # inside its cell
    # MiniLM's 6 layers x 12 heads in one panel of save_summary: the numbers would not fit; none are drawn,
    # whatever the DPI (the decision is in points), and the colour bar is there
    many, _, ax = cell_labels_after_draw(summary_frame(6, 12, 0.00094), (4.2, 3.4), dpi)
    assert many.shown is False and len(ax.figure.axes) == 2


def test_summary_numbers_never_shrink_below_7_points_in_the_saved_file(tmp_path):
    path = save_summary(summary_frame(6, 12, 0.5), tmp_path / "s.png", dpi=100)
    with Image.open(path) as image:
        assert image.size == (1260, 680)
    for annotate, expected in ((True, True), (False, None)):
        fig = Figure(figsize=(4.2, 3.4))
        ax = fig.add_subplot()
        summary_plot(summary_frame(6, 12, 0.5), "entropy", ax=ax, annotate=annotate)
        FigureCanvasAgg(fig).draw()
        assert [a.shown for a in ax.artists] == ([expected] if annotate else [])


def test_heatmap_title_names_module_layer_head_and_batch_row(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5)
    ax = heatmap(cap[1], head=1, batch=1, ax=Figure().add_subplot())
    assert ax.get_title(loc="left") == "layers.1 · layer 1 · head 1 · batch row 1"
    cross = cross_capture(assert_no_hooks)
    record = next(r for r in cross if r.kind == "cross")
    title = heatmap(record, head=0, ax=Figure().add_subplot()).get_title(loc="left")
    assert title.endswith("head 0 · batch row 0 · cross-attention") and record.name in title


def test_grid_says_which_batch_row_and_labels_tokens_when_they_fit(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=4, length=13)
    tokens = [words(13, "a"), words(13, "b")]
    fig = head_grid(cap, batch=1, tokens=tokens)
    assert fig._suptitle.get_text().startswith("attention weights of batch row 1 (of 2)")
    panels = fig.axes[:4]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == tokens[1]  # every token: they fit
    assert all([t.get_text() for t in ax.get_xticklabels()] == tokens[1] for ax in panels)
    assert all(t.get_fontsize() == GRID_TOKEN_POINTS for t in panels[0].get_yticklabels())
    assert [t.get_text() for t in panels[1].get_yticklabels()] == []  # queries on the first column only
    # no tokens: no labels (positions only as before)
    assert [t.get_text() for t in head_grid(cap).axes[0].get_yticklabels()] == []


def test_grid_thins_token_labels_that_do_not_fit(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=3, heads=3, length=60, batch=1, padded=False)
    fig = head_grid(cap, tokens=words(60))
    shown = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert 2 < len(shown) < 60 and shown[0] == "w0"
    step = int(shown[1][1:])
    assert shown == [f"w{i}" for i in range(0, 60, step)]  # every k-th token
    cell_points = fig.get_size_inches()[1] * 72 / 3
    assert len(shown) * GRID_TOKEN_POINTS <= cell_points  # they fit along the cell
    bottom = [fig.axes[i] for i in (6, 7, 8)]
    assert all([t.get_text() for t in ax.get_xticklabels()] == shown for ax in bottom)
    assert [t.get_text() for t in fig.axes[3].get_xticklabels()] == []  # keys on the bottom row only


def test_grid_labels_the_context_of_cross_attention(assert_no_hooks):
    cap = cross_capture(assert_no_hooks, queries=5, keys=9)
    fig = head_grid(cap, tokens=words(5, "q"), key_tokens=words(9, "k"))
    rows = {}
    for r, ax in zip(cap, fig.axes[:: max(len(r.heads) for r in cap)]):
        rows[r.kind] = ([t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()])
    assert rows["cross"] == (words(5, "q"), words(9, "k"))


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_report_out_png_chooses_png_by_the_suffix(cli, tmp_path):
    ids = ["--ids", "1 2 3 4", "--ids", "5 6"]
    result = cli("report", "cli_factories:tiny", *ids, "--out", "grid.png", "-q")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = cli("report", "cli_factories:tiny", *ids, "--out", "page.html", "-q")
    assert result.exit_code == 0 and (tmp_path / "page.html").read_text().startswith("<!doctype html>")
    result = cli("report", "cli_factories:tiny", *ids, "--out", "x.png", "--format", "html")
    assert result.exit_code == 2 and "is a PNG file but --format html asks for HTML" in result.stderr
    assert not (tmp_path / "x.png").exists()
    result = cli("report", "cli_factories:tiny", *ids, "--out", "folder", "-q")
    assert result.exit_code == 0 and (tmp_path / "folder" / "report.html").exists()
    result = cli("report", "cli_factories:tiny", *ids, "--out", "b1.png", "--batch", "1", "-q")
    assert result.exit_code == 0
    with Image.open(tmp_path / "b1.png") as image:
        assert np.asarray(image).std() > 0
