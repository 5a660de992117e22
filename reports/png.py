"""Heatmaps with matplotlib: one head into an Axes, a layer x head grid, a per-head summary plot.

Axes-level functions take ``ax=None`` (then the current pyplot Axes, as seaborn and pandas do), draw,
and return the Axes; nothing here calls ``show()``. The ``save_*`` writers build a
``matplotlib.figure.Figure`` directly, so writing files never touches pyplot's global state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ..probe.errors import AttnprobeError
from ..probe.files import atomic_open
from ..probe.record import AttentionRecord
from ._common import (
    DISALLOWED_COLOR,
    LEAK_COLOR,
    check_batch,
    display_token,
    head_view,
    matrix_shape,
    output_path,
    record_labels,
    require_record,
    require_records,
    resolve_head,
)

VALUES = ("weights", "scores")
#: Summary columns drawn by ``save_summary`` by default (see ``attnprobe.probe.outputs.frames.SUMMARY_SCHEMA``).
SUMMARY_COLUMNS = ("entropy", "max_weight", "first_key_mass", "diagonal_mass", "previous_mass", "masked_mass")
#: Size of the token labels of ``head_grid`` (every k-th token is labelled when they do not all fit).
GRID_TOKEN_POINTS = 7.0
#: Size of the numbers written into summary cells; smaller text is not drawn at all (see ``cell_labels``).
CELL_FONT_POINTS = 7.0


def _current_axes():
    import matplotlib.pyplot as plt  # only when the caller gave no Axes (notebook use)

    return plt.gca()


def _check_value(value: str) -> None:
    if value not in VALUES:
        raise AttnprobeError(f"value must be 'weights' (post-softmax) or 'scores' (pre-softmax), got {value!r}")


def tick_positions(n: int, max_ticks: int) -> np.ndarray:
    """Every k-th position so that at most ``max_ticks`` labels are drawn (all of them when n is small)."""
    if max_ticks < 1:
        return np.arange(0)
    step = max(1, math.ceil(n / max_ticks))
    return np.arange(0, n, step)


def _set_ticks(
    ax, axis: str, labels: list[str] | None, n: int, offset: int, max_ticks: int, fontsize, limit: int = 24
) -> None:
    pos = tick_positions(n, max_ticks)
    text = [display_token(labels[i], limit) if labels is not None else str(i + offset) for i in pos]
    if axis == "x":
        ax.set_xticks(pos, text, rotation=90, fontsize=fontsize, parse_math=False)
    else:
        ax.set_yticks(pos, text, fontsize=fontsize, parse_math=False)


def _legend(ax, view, value: str) -> bool:
    from matplotlib.patches import Patch

    handles = []
    if not view.allowed.all():
        handles.append(Patch(facecolor=DISALLOWED_COLOR, edgecolor="none", label="not allowed (masked)"))
    if value == "weights" and view.leaks.any():
        handles.append(Patch(facecolor=LEAK_COLOR, edgecolor="none", label="weight on a masked key"))
    if view.query_padding.any():
        handles.append(Patch(facecolor="white", edgecolor="0.5", hatch="///", label="padded query"))
    if handles:  # one row just above the Axes, under the title
        ax.legend(
            handles=handles,
            loc="lower left",
            bbox_to_anchor=(0.0, 1.0),
            ncols=len(handles),
            fontsize="x-small",
            frameon=False,
            borderaxespad=0.1,
            borderpad=0.1,
            handlelength=1.2,
            columnspacing=1.0,
        )
    return bool(handles)


def draw_head(ax, view, value: str = "weights", *, cmap="viridis", vmin=None, vmax=None, interpolation=None):
    """Draw a ``HeadView`` into ``ax``: masked cells grey, weight on masked cells in the leak colour,
    padded query rows hatched. Returns the AxesImage (for a colour bar)."""
    import matplotlib as mpl

    data = view.weights if value == "weights" else view.scores
    if data is None:
        raise AttnprobeError(
            f"layer {view.record.layer} ({view.record.name!r}) has no {value} captured; "
            f"capture with keep=[..., {value!r}] or draw value={'scores' if value == 'weights' else 'weights'!r}"
        )
    shown = np.ma.masked_array(data, mask=~view.allowed | ~np.isfinite(data))
    colormap = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    colormap = colormap.with_extremes(bad=DISALLOWED_COLOR)
    if vmin is None and value == "weights":
        vmin = 0.0
    tq, tk = view.shape
    if interpolation is None:  # nearest keeps cells crisp; past ~300 cells resample so thin lines survive
        interpolation = "nearest" if max(tq, tk) <= 300 else "antialiased"
    aspect = "equal" if tq == tk else "auto"
    image = ax.imshow(
        shown, cmap=colormap, vmin=vmin, vmax=vmax, interpolation=interpolation, aspect=aspect, origin="upper"
    )
    if value == "weights":
        leaks = view.leaks
        if leaks.any():
            overlay = np.zeros((tq, tk, 4))
            overlay[leaks] = mpl.colors.to_rgba(LEAK_COLOR)
            ax.imshow(overlay, interpolation="nearest", aspect=aspect, origin="upper")
    for row in np.flatnonzero(view.query_padding):
        ax.add_patch(
            mpl.patches.Rectangle(
                (-0.5, row - 0.5), tk, 1, facecolor="white", alpha=0.55, hatch="///", edgecolor="0.5", linewidth=0
            )
        )
    return image


def heatmap(
    record: AttentionRecord,
    head: int | None = None,
    *,
    ax=None,
    tokens=None,
    key_tokens=None,
    batch: int = 0,
    value: str = "weights",
    cmap="viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    robust: bool = True,
    colorbar: bool = True,
    max_ticks: int = 40,
    fontsize="x-small",
    title: str | bool = True,
):
    """Draw one head of ``record`` (queries down, keys across) into ``ax`` and return the Axes.

    ``head`` is the model head number (optional when the record holds one head); ``batch`` the batch
    row. ``tokens`` label the query axis (and the key axis of self-attention): one list, or one list
    per batch row; ``key_tokens`` label the keys of cross-attention. At most ``max_ticks`` labels per
    axis are drawn (every k-th when the input is long). Cells the query may not attend are light grey,
    never the colour of a zero weight; a masked cell that carries weight anyway is drawn in a signal
    colour; padded query rows are hatched. ``value="scores"`` draws the pre-softmax scores.
    With ``robust`` (and no ``vmax``) the colour scale of weights ends at their 99th percentile, so
    the forced weight of 1 on the first rows of a causal head does not wash out a long input; larger
    weights take the top colour (the colour bar's arrow).

    Example::

        >>> import torch, attnprobe
        >>> from matplotlib.figure import Figure
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 5, 8))
        >>> ax = Figure().add_subplot()
        >>> attnprobe.reports.heatmap(cap[0], head=1, ax=ax, tokens=list("abcde")) is ax
        True
    """
    record = require_record(record, "heatmap")
    _check_value(value)
    head = resolve_head(record, head)
    view = head_view(record, head, batch)
    labels = record_labels(record, batch, tokens, key_tokens)
    if ax is None:
        ax = _current_axes()
    extend = "neither"
    if robust and vmax is None and value == "weights" and view.weights is not None:
        allowed = view.weights[view.allowed & np.isfinite(view.weights)]
        if allowed.size:
            vmax = float(np.quantile(allowed, 0.99))
            extend = "max" if vmax < allowed.max() else "neither"
            vmax = vmax or None
    image = draw_head(ax, view, value, cmap=cmap, vmin=vmin, vmax=vmax)
    tq, tk = view.shape
    _set_ticks(ax, "x", labels.key, tk, record.key_start, max_ticks, fontsize)
    _set_ticks(ax, "y", labels.query, tq, record.query_offset, max_ticks, fontsize)
    ax.set_xlabel("key" + (" (context)" if record.kind == "cross" else ""))
    ax.set_ylabel("query")
    legend = _legend(ax, view, value)
    if title:
        text = title if isinstance(title, str) else head_title(record, head, batch)
        ax.set_title(text, loc="left", fontsize="small", pad=18 if legend else 6)
    if colorbar:
        ax.figure.colorbar(
            image,
            ax=ax,
            label="weight" if value == "weights" else "score (pre-softmax)",
            fraction=0.046,
            pad=0.03,
            extend=extend,
        )
    return ax


def _grid_records(capture) -> list[AttentionRecord]:
    records = require_records(capture, "head_grid")
    if any(r.step is not None for r in records):  # a generation: one stitched matrix per module, as in the HTML
        from ..probe.outputs.generation import shown

        records = shown(records)[0]
    records = [r for r in records if r.weights is not None or r.scores is not None]
    if not records:
        raise AttnprobeError("nothing to draw: no record in this capture has weights or scores")
    return records


def head_grid(
    capture,
    *,
    fig=None,
    batch: int = 0,
    value: str = "weights",
    cmap="viridis",
    normalize: str = "shared",
    cell_inches: float | None = None,
    tokens=None,
    key_tokens=None,
    title: str | bool = True,
):
    """A grid of small heatmaps, one row per record (layer, call), one column per head; returns the Figure.

    ``normalize="shared"`` uses one colour scale for every head (with one colour bar; weights end at
    their 99th percentile, as in ``heatmap``);
    ``"head"`` scales each head to its own range (to see the pattern of weak heads). ``fig=None``
    builds a new ``matplotlib.figure.Figure`` (pyplot is not used). ``tokens`` / ``key_tokens`` (as in
    ``heatmap``) label the queries of each row's first panel and the keys of the bottom row (and of a row
    whose keys differ from the row below, cross-attention), at ``GRID_TOKEN_POINTS``; every k-th token
    when they do not all fit. The title says which batch row is shown.
    """
    _check_value(value)
    if normalize not in ("shared", "head"):
        raise AttnprobeError(f"normalize must be 'shared' or 'head', got {normalize!r}")
    records = _grid_records(capture)
    for r in records:
        check_batch(r, batch)
    labels = [record_labels(r, batch, tokens, key_tokens) for r in records]
    ncols = max(len(r.heads) for r in records)
    nrows = len(records)
    labelled = tokens is not None or key_tokens is not None
    if cell_inches is None:
        cell_inches = _grid_cell_inches(records, labelled, ncols, nrows)
    if fig is None:
        from matplotlib.figure import Figure

        extra = 0.9 if labelled else 0.0  # the token labels' margins
        fig = Figure(
            figsize=(ncols * cell_inches + 1.6 + extra, nrows * cell_inches + 1.0 + extra), layout="constrained"
        )
    views = [[head_view(r, h, batch) for h in r.heads] for r in records]
    vmin, vmax, extend = _shared_range(views, value) if normalize == "shared" else (None, None, "neither")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    image = None
    fit = max(1, int(cell_inches * 72 / (GRID_TOKEN_POINTS * 1.3)))  # labels that fit along one cell
    for i, row in enumerate(views):
        for j in range(ncols):
            ax = axes[i, j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(row):
                ax.set_axis_off()
                continue
            view = row[j]
            if _matrix(view, value) is None:
                ax.text(0.5, 0.5, f"no {value}", ha="center", va="center", fontsize="xx-small", transform=ax.transAxes)
                continue
            image = draw_head(ax, view, value, cmap=cmap, vmin=vmin, vmax=vmax)
            _label_grid_cell(ax, records, labels, i, j, fit)
    if title:
        fig.suptitle(_grid_title(title, value, batch, records[0].batch_size), fontsize="small", x=0.01, ha="left")
    if normalize == "shared" and image is not None:
        fig.colorbar(
            image, ax=axes, label="weight" if value == "weights" else "score (pre-softmax)", shrink=0.8, extend=extend
        )
    return fig


def _matrix(view, value: str) -> np.ndarray | None:
    """The ``(query, key)`` weights or scores of a head view, as ``value`` names them."""
    return view.weights if value == "weights" else view.scores


def _grid_cell_inches(records: list[AttentionRecord], labelled: bool, ncols: int, nrows: int) -> float:
    """The side of one panel: room for every token label when the grid is small (one layer of 4 heads, 13 tokens)."""
    longest = max(max(r.query_len or 0, r.key_len or 0) for r in records)
    wanted = longest * GRID_TOKEN_POINTS * 1.3 / 72 if labelled else 1.3
    return max(0.35, min(max(1.3, wanted), 3.0, 18.0 / max(ncols, nrows)))


def _shared_range(views, value: str) -> tuple[float | None, float | None, str]:
    """(vmin, vmax, colour-bar extension) of one colour scale over every head's allowed cells; weights end at
    their 99th percentile, as in ``heatmap``."""
    values = [m[v.allowed] for row in views for v in row if (m := _matrix(v, value)) is not None]
    finite = np.concatenate([x[np.isfinite(x)] for x in values]) if values else np.zeros(0)
    vmin = 0.0 if value == "weights" else (float(finite.min()) if finite.size else None)
    vmax = float(finite.max()) if finite.size else None
    extend = "neither"
    if value == "weights" and finite.size:  # robust: see heatmap()
        vmax = float(np.quantile(finite, 0.99)) or vmax
        extend = "max" if vmax is not None and vmax < finite.max() else "neither"
    return vmin, vmax, extend


def _label_grid_cell(ax, records: list[AttentionRecord], labels, i: int, j: int, fit: int) -> None:
    """The head title over a row's first panels, the layer and tokens beside its first panel, and the keys' tokens
    under the bottom row (and under a row whose keys differ from the next row's: cross-attention)."""
    r = records[i]
    head = r.heads[j]
    if i == 0 or len(r.heads) != len(records[i - 1].heads):
        ax.set_title(f"H{head}", fontsize="x-small")
    if j == 0:
        label = f"L{r.layer}" + (f" c{r.call}" if r.call else "") + (" x" if r.kind == "cross" else "")
        ax.set_ylabel(label, fontsize="x-small")
    tq, tk = matrix_shape(r)
    if j == 0 and labels[i].query is not None:
        _set_ticks(ax, "y", labels[i].query, tq, r.query_offset, fit, GRID_TOKEN_POINTS, limit=10)
    last_of_its_keys = i == len(records) - 1 or labels[i + 1].key != labels[i].key
    if labels[i].key is not None and last_of_its_keys:
        _set_ticks(ax, "x", labels[i].key, tk, r.key_start, fit, GRID_TOKEN_POINTS, limit=10)


def _grid_title(title: str | bool, value: str, batch: int, size: int | None) -> str:
    if isinstance(title, str):
        return title
    rows = f" (of {size})" if size and size > 1 else ""
    return f"attention {value} of batch row {batch}{rows} · rows: layer (L), columns: head (H)"


def cell_label(v: float) -> str:
    """A value short enough for a cell: two decimals, or one significant digit in e-notation below 0.01."""
    if v == 0:
        return "0"
    if 0.01 <= abs(v) < 1000:
        return f"{v:.2f}"
    return f"{v:.0e}"


def cell_labels(cells, *, always: bool = False, fontsize: float = CELL_FONT_POINTS):
    """One artist writing ``cells`` ``(x, y, text, colour)`` centred in the cells of an image, drawn only when
    every one fits inside its cell (or ``always``).

    The decision is taken at draw time, so it holds for the figure's final layout and the DPI it is saved
    at; the text is ``fontsize`` points, never smaller. The artist's ``shown`` says what its last draw did
    (None before the first draw).
    """
    return _cell_labels_class()(cells, always=always, fontsize=fontsize)


@functools.cache
def _cell_labels_class():
    from matplotlib.artist import Artist
    from matplotlib.text import Text

    class CellLabels(Artist):
        def __init__(self, cells, *, always: bool, fontsize: float):
            super().__init__()
            self.texts = [
                Text(x, y, label, ha="center", va="center", fontsize=fontsize, color=color)
                for x, y, label, color in cells
            ]
            self.always, self.shown = always, None

        def draw(self, renderer):
            if not self.get_visible() or not self.texts:
                return
            ax = self.axes
            for t in self.texts:
                t.set_figure(self.figure)
                t.set_transform(ax.transData)
                t.set_clip_path(ax.patch)
            (x0, y0), (x1, y1) = ax.transData.transform([(0, 0), (1, 1)])
            width, height = abs(x1 - x0), abs(y1 - y0)  # one cell, in pixels at this draw's DPI
            boxes = [t.get_window_extent(renderer) for t in self.texts]
            self.shown = self.always or all(b.width <= 0.85 * width and b.height <= 0.9 * height for b in boxes)
            if self.shown:
                for t in self.texts:
                    t.draw(renderer)

    return CellLabels


def head_title(record: AttentionRecord, head: int, batch: int) -> str:
    """'module · layer L · head H · batch row B' (+ call, cross): which matrix a heatmap shows."""
    name = record.name if len(record.name) <= 40 else "…" + record.name[-39:]
    parts = [name] if name else []
    parts += [f"layer {record.layer}", f"head {head}", f"batch row {batch}"]
    if record.call:
        parts.append(f"call {record.call}")
    if record.kind == "cross":
        parts.append("cross-attention")
    return " · ".join(parts)


def _summary_frame(data):
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        return data
    summary = getattr(data, "summary", None)
    if summary is None:
        hint = " (a record: pass the Capture it came from)" if isinstance(data, AttentionRecord) else ""
        raise TypeError(f"expected a Capture or the frame of Capture.summary(), got {type(data).__name__}{hint}")
    return summary()


def summary_plot(
    data, column: str = "entropy", *, ax=None, cmap="viridis", annotate: bool | None = None, colorbar: bool = True
):
    """One statistic of ``Capture.summary()`` as a layer x head map; returns the Axes.

    ``data`` is a Capture or its summary frame; ``column`` one of the summary's numeric columns
    (entropy, max_weight, first_key_mass, diagonal_mass, previous_mass, masked_mass, row_sum_error).
    Values are written into the cells (``annotate=None``) when every one fits its cell at
    ``CELL_FONT_POINTS`` (7 pt) in the drawn figure; otherwise the colour bar alone gives them.
    ``annotate=True`` writes them whatever the size, ``False`` never.
    """
    frame = _summary_frame(data)
    numeric = [c for c in frame.columns if c not in ("layer", "name", "head", "rows")]
    if column not in numeric:
        raise AttnprobeError(f"column must be one of {numeric}, got {column!r}")
    if frame.empty:
        raise AttnprobeError("the summary is empty: the capture has no weights to summarise")
    table = frame.pivot_table(index="layer", columns="head", values=column, aggfunc="first", dropna=False)
    if ax is None:
        ax = _current_axes()
    values = table.to_numpy(dtype=float)
    import matplotlib as mpl

    colormap = (mpl.colormaps[cmap] if isinstance(cmap, str) else cmap).with_extremes(bad=DISALLOWED_COLOR)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=colormap, aspect="auto", interpolation="nearest")
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() == finite.max():
        # one value everywhere (masked_mass 0 in a correct model): matplotlib would widen the scale to
        # v - 0.1 .. v + 0.1, a colour bar with negative masses; span from 0 to the value instead
        v = float(finite[0])
        image.set_clim(min(0.0, v), max(0.0, v) or 1.0)
    ax.set_xticks(range(values.shape[1]), [str(h) for h in table.columns], fontsize="x-small")
    ax.set_yticks(range(values.shape[0]), [str(layer) for layer in table.index], fontsize="x-small")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(column, loc="left", fontsize="small")
    if annotate is None or annotate:
        # numbers only where every one fits its cell at CELL_FONT_POINTS, decided when the figure is drawn
        # (at its final layout and DPI); otherwise the colour bar alone tells the values
        middle = (finite.min() + finite.max()) / 2 if finite.size else 0
        cells = [
            (j, i, cell_label(v), "white" if v < middle else "black")
            for (i, j), v in np.ndenumerate(values)
            if np.isfinite(v)
        ]
        ax.add_artist(cell_labels(cells, always=annotate is True))
    if colorbar:
        bar = ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
        # nearly equal heads (entropy 1.97081 to 1.97086) would otherwise get ticks "3.5 .. 6.0" and an
        # offset "1e-5+1.9708" printed over the neighbouring panel: label the ticks with the values themselves
        bar.formatter.set_useOffset(False)
        bar.update_ticks()
    return ax


# ------------------------------------------------------------------------------------ file writers
#: File suffix -> matplotlib format of the ``save_*`` writers.
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def image_path(path, *, overwrite: bool):
    """(path, format) for a ``save_*`` writer: the suffix names the format; existing files are refused."""
    p = output_path(path, overwrite=overwrite)
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise AttnprobeError(f"cannot tell the image format of {p}: name the file {', '.join(FORMATS)}")
    return p, fmt


def save_figure(fig, path, *, overwrite: bool, dpi: float):
    """Write a matplotlib figure to ``path`` (format by suffix; an existing file only with ``overwrite``)."""
    p, fmt = image_path(path, overwrite=overwrite)
    # savefig would add a suffix of its own choosing and replace any file; write exactly here, complete or
    # not at all (an interrupted or failed write leaves the old file, if any, as it was)
    with atomic_open(p, "wb", overwrite=overwrite) as f:
        fig.savefig(f, dpi=dpi, format=fmt)
    return p


def save_heatmap(
    record: AttentionRecord,
    path,
    head: int | None = None,
    *,
    figsize=(6.4, 5.6),
    dpi: float = 100,
    overwrite: bool = False,
    **options,
):
    """Write ``heatmap(record, head, **options)`` to ``path`` (PNG, SVG or PDF by the suffix).

    The image is ``figsize`` x ``dpi`` pixels. An existing file is replaced only with ``overwrite=True``.
    Returns the path.
    """
    from matplotlib.figure import Figure

    record = require_record(record, "save_heatmap")
    image_path(path, overwrite=overwrite)  # fail before drawing
    fig = Figure(figsize=figsize, layout="constrained")
    heatmap(record, head, ax=fig.add_subplot(), **options)
    return save_figure(fig, path, overwrite=overwrite, dpi=dpi)


def save_grid(capture, path, *, figsize=None, dpi: float = 100, overwrite: bool = False, **options):
    """Write ``head_grid(capture, **options)`` to ``path`` (``tokens=`` labels the axes); returns the path. A
    statistics-only capture (long inputs, no weights) is drawn by ``save_long_grid`` (pooled overviews and exact
    windows)."""
    from matplotlib.figure import Figure

    from .long import stats_only

    require_records(capture, "save_grid")
    if stats_only(capture):
        return save_long_grid(capture, path, batch=options.get("batch", 0), dpi=dpi, overwrite=overwrite)
    image_path(path, overwrite=overwrite)
    fig = None if figsize is None else Figure(figsize=figsize, layout="constrained")
    fig = head_grid(capture, fig=fig, **options)
    return save_figure(fig, path, overwrite=overwrite, dpi=dpi)


def save_summary(
    data,
    path,
    columns: Sequence[str] = SUMMARY_COLUMNS,
    *,
    figsize=None,
    dpi: float = 100,
    overwrite: bool = False,
    **options,
):
    """Write one ``summary_plot`` panel per summary column to ``path``; returns the path."""
    from matplotlib.figure import Figure

    image_path(path, overwrite=overwrite)
    frame = _summary_frame(data)
    columns = list(columns)
    if not columns:
        raise AttnprobeError("columns is empty: name at least one summary column")
    ncols = min(3, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig = Figure(figsize=figsize or (4.2 * ncols, 3.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, column in zip(axes, columns):
        summary_plot(frame, column, ax=ax, **options)
    for ax in axes[len(columns) :]:
        ax.set_axis_off()
    return save_figure(fig, path, overwrite=overwrite, dpi=dpi)


def save_long_grid(capture, path, *, batch: int = 0, dpi: float = 100, overwrite: bool = False):
    """PNG of a statistics-only capture: per head its pooled overview (mean weight, log colour scale; axes in
    token positions) and, for each window the capture holds, the window's exact weights. Returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    from .long import stats_only, windows_of

    image_path(path, overwrite=overwrite)  # fail before drawing
    records = list(capture)
    if not stats_only(capture):
        raise AttnprobeError("save_long_grid takes a statistics-only capture (keep=('stats',))")
    panels = []
    for r in records:
        check_batch(r, batch)
        for i, head in enumerate(r.heads):
            if "overview_mean" in r.stats:
                q_len, k_len = int(r.stats["entropy"].shape[2]), int(r.stats["key_weight"].shape[2])
                panels.append(
                    (f"L{r.layer} H{head} mean (pooled)", r.stats["overview_mean"][batch, i], (0, q_len, 0, k_len))
                )
            for w, (q0, q1, k0, k1) in enumerate(windows_of(r)):
                panels.append(
                    (f"L{r.layer} H{head} q{q0}:{q1} k{k0}:{k1}", r.stats[f"window_{w}"][batch, i], (q0, q1, k0, k1))
                )
    if not panels:
        raise AttnprobeError("nothing to draw: the capture has no overview or window (capture with overview=)")
    cols = min(8, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(2.2 * cols, 2.2 * rows), layout="constrained")
    for n, (label, t, window) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, n + 1)
        a = t.float().numpy()
        positive = a[a > 0]
        norm = LogNorm(vmin=max(float(positive.min()), 1e-8), vmax=float(positive.max())) if positive.size else None
        extent = (window[2] - 0.5, window[3] - 0.5, window[1] - 0.5, window[0] - 0.5)  # token positions
        ax.imshow(
            np.where(a > 0, a, np.nan), cmap="viridis", norm=norm, interpolation="nearest", aspect="auto", extent=extent
        )
        ax.set_title(label, fontsize=7)
        ax.tick_params(labelsize=6)
    return save_figure(fig, path, overwrite=overwrite, dpi=dpi)
