"""PNG heatmaps: Axes-level drawing, tick labels, masked cells, file writers without pyplot."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import matplotlib as mpl
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image
from reports_helpers import cross_capture, generation_capture, stack_capture, words

from attnprobe import AttnprobeError
from attnprobe.reports import head_grid, heatmap, save_grid, save_heatmap, save_summary, summary_plot
from attnprobe.reports._common import DISALLOWED_COLOR, LEAK_COLOR


def pixel(ax, q: int, k: int) -> tuple[int, int, int]:
    """RGB of the rendered figure at the centre of cell (query q, key k)."""
    fig = ax.figure
    canvas = FigureCanvasAgg(fig) if fig.canvas is None or not isinstance(fig.canvas, FigureCanvasAgg) else fig.canvas
    canvas.draw()
    buf = np.asarray(canvas.buffer_rgba())
    x, y = ax.transData.transform((k, q))
    return tuple(int(c) for c in buf[int(buf.shape[0] - y), int(x), :3])


def rgb(colour) -> tuple[int, int, int]:
    return tuple(round(c * 255) for c in mpl.colors.to_rgb(colour))


def close(a, b, tol=3) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_heatmap_draws_into_the_given_axes_with_token_ticks_and_a_colour_bar(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=7)
    fig = Figure()
    ax = fig.add_subplot()
    out = heatmap(cap[1], head=2, ax=ax, tokens=words(7), batch=1)
    assert out is ax and len(ax.images) >= 1
    assert [t.get_text() for t in ax.get_xticklabels()] == words(7)
    assert [t.get_text() for t in ax.get_yticklabels()] == words(7)
    assert len(fig.axes) == 2  # the heatmap and its colour bar
    assert fig.axes[1].get_ylabel() == "weight"
    assert ax.get_title(loc="left") == "layers.1 · layer 1 · head 2 · batch row 1"  # module, layer, head, batch row
    shown = ax.images[0].get_array()
    np.testing.assert_array_equal(shown.data, cap[1].weights[1, 2].numpy())
    np.testing.assert_array_equal(shown.mask, ~cap[1].allowed[1, 0].numpy())


def test_masked_cells_are_grey_not_the_colour_of_zero_weight(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=6, batch=1, padded=False)
    rec = cap[0]
    ax = heatmap(rec, head=0, ax=Figure(figsize=(4, 4), dpi=100).add_subplot(), colorbar=False)
    masked = pixel(ax, 1, 4)  # causal: query 1 may not attend key 4
    assert close(masked, rgb(DISALLOWED_COLOR))
    assert not close(masked, rgb(mpl.colormaps["viridis"](0.0)), tol=40)
    assert not close(pixel(ax, 4, 1), rgb(DISALLOWED_COLOR), tol=20)  # an allowed cell has a map colour


def test_weight_on_a_masked_key_is_shown_in_the_signal_colour(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=5, batch=1, padded=False)
    rec = cap[0]
    leaky = rec.weights.clone()
    leaky[0, 0, 1, 3] = 0.2  # a masking bug: weight on a future key
    ax = heatmap(replace(rec, weights=leaky), ax=Figure(figsize=(4, 4)).add_subplot(), colorbar=False)
    assert close(pixel(ax, 1, 3), rgb(LEAK_COLOR))
    assert close(pixel(ax, 1, 4), rgb(DISALLOWED_COLOR))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["not allowed (masked)", "weight on a masked key"]


def test_long_inputs_get_thinned_tick_labels(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=100, batch=1, padded=False)
    ax = heatmap(cap[0], ax=Figure().add_subplot(), tokens=words(100), max_ticks=20)
    ticks = ax.get_xticks()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert 10 <= len(labels) <= 20
    assert labels == [f"w{int(i)}" for i in ticks]  # each label sits on its own position


def test_token_text_is_not_parsed_as_math_or_markup(assert_no_hooks):
    tokens = ["$x$", "$", "\\alpha", "<b>", "a\nb"]
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=5, batch=1, padded=False)
    fig = Figure()
    ax = heatmap(cap[0], ax=fig.add_subplot(), tokens=tokens)
    FigureCanvasAgg(fig).draw()  # a lone "$" would fail mathtext parsing
    assert [t.get_text() for t in ax.get_yticklabels()] == ["$x$", "$", "\\alpha", "<b>", "a\\nb"]


def test_cross_attention_uses_key_tokens_on_the_key_axis(assert_no_hooks):
    cap = cross_capture(assert_no_hooks, queries=5, keys=9)
    rec = next(r for r in cap if r.kind == "cross")
    ax = heatmap(rec, head=0, ax=Figure().add_subplot(), tokens=words(5, "dec"), key_tokens=words(9, "enc"))
    assert [t.get_text() for t in ax.get_xticklabels()] == words(9, "enc")
    assert [t.get_text() for t in ax.get_yticklabels()] == words(5, "dec")
    assert ax.get_xlabel() == "key (context)"


def test_bad_arguments_are_named(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=3, length=5, batch=1)
    ax = Figure().add_subplot()
    with pytest.raises(AttnprobeError, match=r"has 3 heads .* say which one with head="):
        heatmap(cap[0], ax=ax)
    with pytest.raises(KeyError, match=r"head 7 .* was not captured"):
        heatmap(cap[0], head=7, ax=ax)
    with pytest.raises(AttnprobeError, match="batch row 2 does not exist"):
        heatmap(cap[0], head=0, ax=ax, batch=2)
    with pytest.raises(AttnprobeError, match=r"tokens has 3 entries but layer 0 .* 5 query positions"):
        heatmap(cap[0], head=0, ax=ax, tokens=words(3))
    with pytest.raises(AttnprobeError, match="value must be 'weights'"):
        heatmap(cap[0], head=0, ax=ax, value="pattern")
    no_scores = stack_capture(assert_no_hooks, layers=1, heads=1, length=4, batch=1, keep=["weights"])
    with pytest.raises(AttnprobeError, match="has no scores captured"):
        heatmap(no_scores[0], ax=ax, value="scores")


def test_save_heatmap_writes_a_png_of_the_requested_size_and_never_overwrites(tmp_path, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=6, batch=1)
    path = save_heatmap(cap[0], tmp_path / "head.png", head=1, figsize=(5, 4), dpi=80, tokens=words(6))
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (400, 320)
        image.load()
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_heatmap(cap[0], path, head=0)
    assert path.read_bytes() == before
    save_heatmap(cap[0], path, head=0, figsize=(5, 4), dpi=80, overwrite=True)
    assert path.read_bytes() != before
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_heatmap(cap[0], tmp_path / "missing" / "x.png", head=0)


def test_head_grid_has_one_panel_per_layer_and_head(tmp_path, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=3, heads=4, length=6)
    fig = head_grid(cap)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 12
    assert [ax.get_title() for ax in panels[:4]] == ["H0", "H1", "H2", "H3"]
    assert [ax.get_ylabel() for ax in panels[::4]] == ["L0", "L1", "L2"]
    assert fig.axes[-1].get_ylabel() == "weight"  # one shared colour bar
    path = save_grid(cap, tmp_path / "grid.png", figsize=(8, 6), dpi=50)
    with Image.open(path) as image:
        assert image.size == (400, 300)


def test_head_grid_of_a_generation_draws_one_stitched_matrix_per_layer(tmp_path, assert_no_hooks):
    steps, full = generation_capture(assert_no_hooks, length=8, prefill=4)
    fig = head_grid(steps)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 * 2  # 2 layers x 2 heads, not one row per generation step
    assert [ax.get_ylabel() for ax in panels[::2]] == ["L0", "L1"]
    shown = panels[0].images[0].get_array()
    assert shown.shape == (8, 8)
    expected = full[0].weights[0, 0].numpy()
    allowed = ~np.ma.getmaskarray(shown)
    assert allowed.sum() == 8 * 9 // 2  # the causal triangle, every step's row
    np.testing.assert_allclose(shown.data[allowed], expected[allowed], rtol=0, atol=0)
    path = save_grid(steps, tmp_path / "generation.png", dpi=40)
    with Image.open(path) as image:
        assert image.format == "PNG"


def test_image_writers_follow_the_suffix_and_never_overwrite(tmp_path, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=1)
    svg = save_grid(cap, tmp_path / "grid.svg", dpi=40)
    assert svg == tmp_path / "grid.svg" and b"<svg" in svg.read_bytes()[:400]
    for writer, args in ((save_grid, (cap,)), (save_summary, (cap,)), (save_heatmap, (cap[0],))):
        for name in ("heads", "heads.txt"):  # matplotlib would have written heads.png / refused late
            with pytest.raises(AttnprobeError, match="cannot tell the image format"):
                writer(*args, tmp_path / name, **({"head": 0} if writer is save_heatmap else {}))
            assert not (tmp_path / name).exists() and not (tmp_path / (name + ".png")).exists()
        mine = tmp_path / "mine.png"
        mine.write_bytes(b"mine")
        with pytest.raises(FileExistsError, match="overwrite=True"):
            writer(*args, mine, **({"head": 0} if writer is save_heatmap else {}))
        assert mine.read_bytes() == b"mine"
        writer(*args, mine, overwrite=True, dpi=30, **({"head": 0} if writer is save_heatmap else {}))
        assert mine.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        mine.unlink()


def test_summary_plot_draws_a_layer_by_head_map(tmp_path, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=6)
    ax = Figure().add_subplot()
    assert summary_plot(cap, "entropy", ax=ax) is ax
    values = ax.images[0].get_array()
    assert values.shape == (2, 3)
    frame = cap.summary()
    np.testing.assert_allclose(values[1, 2], frame.query("layer == 1 and head == 2")["entropy"].item(), rtol=1e-6)
    (labels,) = ax.artists  # the cell numbers, drawn when they fit (they do: 2 x 3 cells)
    ax.figure.draw_without_rendering()
    assert labels.shown and [t.get_fontsize() for t in labels.texts] == [7.0] * 6
    with pytest.raises(AttnprobeError, match="column must be one of"):
        summary_plot(frame, "nope", ax=ax)
    path = save_summary(frame, tmp_path / "summary.png", dpi=50)
    with Image.open(path) as image:
        assert image.size == (630, 340)


def test_summary_colour_bar_labels_nearly_equal_values_as_themselves(assert_no_hooks):
    frame = stack_capture(assert_no_hooks, layers=2, heads=2, length=6).summary()
    frame["entropy"] = 1.9708 + np.array([3.2, 6.1, 4.4, 5.0]) * 1e-5  # heads that differ in the 5th digit
    ax = Figure().add_subplot()
    summary_plot(frame, "entropy", ax=ax)
    FigureCanvasAgg(ax.figure).draw()
    bar = ax.figure.axes[-1]
    assert bar is not ax and bar.yaxis.get_offset_text().get_text() == ""
    ticks = [float(t.get_text().replace("\u2212", "-")) for t in bar.get_yticklabels() if t.get_text()]
    assert ticks and all(abs(t - 1.97084) < 1e-4 for t in ticks), ticks  # the values, not "3.5 .. 6.0"


@pytest.mark.parametrize("value", [0.0, 2.5])
def test_summary_colour_bar_of_one_value_everywhere_starts_at_zero(assert_no_hooks, value):
    frame = stack_capture(assert_no_hooks, layers=2, heads=2, length=6).summary()
    frame["masked_mass"] = value  # a correct model puts no weight on masked keys in any head
    ax = Figure().add_subplot()
    summary_plot(frame, "masked_mass", ax=ax)
    FigureCanvasAgg(ax.figure).draw()
    ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.figure.axes[-1].get_yticklabels() if t.get_text()]
    assert ticks and min(ticks) >= 0 and max(ticks) >= value, ticks  # was -0.1 .. 0.1: negative masses
    assert ax.images[0].get_clim() == (0.0, value or 1.0)


def test_file_writers_do_not_touch_pyplot(tmp_path):
    code = f"""
import sys, torch, attnprobe
attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
_, cap = attnprobe.run(attn, torch.randn(1, 5, 8))
attnprobe.reports.save_heatmap(cap[0], {str(tmp_path / "a.png")!r}, head=0)
attnprobe.reports.save_grid(cap, {str(tmp_path / "b.png")!r})
attnprobe.reports.save_summary(cap, {str(tmp_path / "c.png")!r})
assert "matplotlib.pyplot" not in sys.modules, "pyplot was imported"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all((tmp_path / name).stat().st_size > 0 for name in ("a.png", "b.png", "c.png"))


def test_importing_reports_loads_no_plotting_or_table_library():
    code = """
import sys, attnprobe
assert "matplotlib" not in sys.modules and "pandas" not in sys.modules
import attnprobe.reports
heavy = [m for m in ("matplotlib", "pandas", "jinja2", "PIL") if m in sys.modules]
assert not heavy, heavy
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
