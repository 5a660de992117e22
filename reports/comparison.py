"""The first divergence of ``attnprobe.compare`` drawn: reference, candidate and their difference side by side.

``divergence_axes(result, axes=None)`` draws the diverged tensor of the first divergent head (one batch row) into
three Axes and returns them; ``divergence_png(result)`` gives the figure as PNG bytes (the diff report embeds it),
``save_divergence(result, path)`` writes it. Cells that do not count in the comparison (masked scores, padded rows)
are left blank; the first differing cell is circled.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..probe.analyses.alignment import KV_FIELDS, Pair
from ..probe.analyses.compare import Comparison, Divergence
from ..probe.analyses.diagnoses import DIAGNOSES
from ..probe.analyses.differences import cells
from ..probe.errors import AttnprobeError

#: What the axes of each tensor are (rows, columns), for the labels.
_AXES = {"scores": ("query", "key"), "weights": ("query", "key"), "k": ("key", "dim"), "v": ("key", "dim")}


def _first_pair(result: Comparison) -> tuple[Pair, Divergence, int]:
    first = result.first
    if first is None:
        raise AttnprobeError("the two implementations agree within tolerance: there is no divergence to draw")
    pair = next(p for p in result.pairs if (p.ref.record.layer, p.ref.record.call) == (first.layer, first.call))
    heads = pair.kv_heads if first.tensor in KV_FIELDS else pair.heads
    return pair, first, heads.index(first.head)


def divergence_matrices(result: Comparison) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(reference, candidate, |difference|)`` of the first divergent head's tensor at its batch row, 2-D float
    arrays (statistics: one row), NaN where a cell does not count."""
    pair, first, i = _first_pair(result)
    c = cells(pair, first.tensor, i)
    counts = c.counting()[first.batch].numpy()
    ref, cand = c.ref[first.batch].numpy(), c.cand[first.batch].numpy()
    ref, cand = np.where(counts, ref, np.nan), np.where(counts, cand, np.nan)
    ref, cand = np.atleast_2d(ref), np.atleast_2d(cand)
    return ref, cand, np.abs(cand - ref)


def divergence_axes(result: Comparison, axes=None):
    """Draw the first divergence into three Axes (reference, candidate, difference); returns them."""
    if axes is None:
        import matplotlib.pyplot as plt  # only when the caller gave no Axes (notebook use)

        _, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
    if len(axes) != 3:
        raise AttnprobeError(
            f"divergence_axes draws into three Axes (reference, candidate, difference), got {len(axes)}"
        )
    _, first, _ = _first_pair(result)
    ref, cand, diff = divergence_matrices(result)
    both = np.concatenate([ref[np.isfinite(ref)], cand[np.isfinite(cand)]])
    vmin, vmax = (float(both.min()), float(both.max())) if both.size else (0.0, 1.0)
    rows, cols = _AXES.get(first.tensor, ("query", "dim"))
    if first.tensor not in _AXES and first.key is None and first.dim is None:
        rows, cols = "", "query"  # a statistic: one value per query row
    for ax, data, label, cmap, scale in (
        (axes[0], ref, "reference", "viridis", (vmin, vmax)),
        (axes[1], cand, "candidate", "viridis", (vmin, vmax)),
        (axes[2], diff, "|candidate - reference|", "magma", (0.0, _top(diff))),
    ):
        image = ax.imshow(data, cmap=cmap, vmin=scale[0], vmax=scale[1], aspect="auto", interpolation="nearest")
        ax.figure.colorbar(image, ax=ax, shrink=0.8)
        ax.set_title(f"{label}: layer {first.layer} head {first.head} {first.tensor}", fontsize=9)
        ax.set_xlabel(cols)
        ax.set_ylabel(rows)
        y, x = _cell(first)
        ax.plot([x], [y], marker="o", markersize=12, markerfacecolor="none", markeredgecolor="red")
    axes[0].figure.suptitle(f"first divergence, diagnosis: {result.diagnosis}", fontsize=10)
    return axes


def _top(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _cell(first: Divergence) -> tuple[int, int]:
    """(row, column) of the first differing cell in the drawn matrix."""
    if first.tensor in ("scores", "weights"):
        return first.query or 0, first.key or 0
    if first.tensor in KV_FIELDS:
        return first.key or 0, first.dim or 0
    if first.dim is not None:
        return first.query or 0, first.dim
    return 0, first.query or 0  # a statistic: one row; the column is the query


def _figure(result: Comparison):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), constrained_layout=True)
    divergence_axes(result, fig.subplots(1, 3))
    return fig


def divergence_png(result: Comparison, *, dpi: float = 100) -> bytes:
    """The figure of ``divergence_axes`` as PNG bytes (no pyplot state touched)."""
    buffer = io.BytesIO()
    _figure(result).savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def save_divergence(result: Comparison, path, *, dpi: float = 100, overwrite: bool = False):
    """Write the figure of ``divergence_axes`` to ``path`` (format by suffix; an existing file only with
    ``overwrite``); returns the path."""
    from .png import save_figure

    return save_figure(_figure(result), path, overwrite=overwrite, dpi=dpi)


def divergence_context(result: Comparison, record_ids: Mapping[tuple[int, int], int] | None = None) -> dict[str, Any]:
    """What the diff report's "First divergence" section shows (``templates/_divergence.html.j2``).
    ``record_ids``: ``{(layer, call): record id on the page}``, to link the head's detail view."""
    context: dict[str, Any] = {"ok": result.ok, "pairs": len(result.pairs), "rows": len(result.rows)}
    first = result.first
    if first is None:
        return context
    where = ", ".join(
        f"{k} {v}"
        for k, v in (("batch", first.batch), ("query", first.query), ("key", first.key), ("dim", first.dim))
        if v is not None
    )
    rid = (record_ids or {}).get((first.layer, first.call))
    drawn = first.tensor not in KV_FIELDS and rid is not None
    context.update(
        summary=f"The two implementations first differ at layer {first.layer}, head {first.head}, {first.tensor}.",
        first=first,
        where=where,
        diagnosis=result.diagnosis,
        meaning=DIAGNOSES.get(result.diagnosis or "unknown", ""),
        evidence=result.evidence,
        png=base64.b64encode(divergence_png(result)).decode("ascii"),
        target=f"#head-{rid}-{first.head}" if drawn else None,
    )
    return context
