"""Reports of long inputs: a statistics capture (``capture(keep=("stats",), overview=...)``) has no
``(query x key)`` matrix, and the report never makes one.

Per record and head the page holds (``to_html`` switches here by itself for a statistics-only capture):

- the overview: the weights pooled (max and mean) to at most ``Overview.cells`` cells a side, computed by the
  statistics engine block by block from q and k (``probe.pooling``), exact float32 values of the pooling;
- per-row statistics along the sequence (``ROW_PLOTS``: entropy, max weight, first-key, diagonal and
  previous-token mass, ...), one value per query row;
- the exact weights of the windows chosen at capture time (``Overview.windows``, ``--window`` on the command line).

PNG: ``save_long_grid`` draws the overviews (mean) and the windows of every head.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from ..probe.errors import AttnprobeError
from ..probe.record import AttentionRecord
from ..probe.stats import OVERVIEW_STATS
from ..probe.violations import CheckResult
from . import encoding
from ._common import check_batch, output_path

#: Per-row statistics drawn along the sequence, in the page's order.
ROW_PLOTS: tuple[str, ...] = ("entropy", "max_weight", "first_key_mass", "diagonal_mass", "previous_mass",
                              "masked_mass")


def stats_only(capture) -> bool:
    """Whether every record of ``capture`` carries statistics and no weights or scores (a long-input capture)."""
    records = list(capture)
    return bool(records) and all(r.stats is not None and r.weights is None and r.scores is None for r in records)


def windows_of(record: AttentionRecord) -> list[tuple[int, int, int, int]]:
    """The windows ``(q0, q1, k0, k1)`` whose exact weights ``record.stats["window_<i>"]`` holds."""
    return [tuple(w) for w in (record.meta or {}).get("stats_windows", [])]


def _floats(t, precision: str) -> bytes:
    return encoding.shuffled_floats(t.float().numpy(), precision)


def build_long_data(records: list[AttentionRecord], batch: int, precision: str, blobs: encoding.Blobs,
                    tokens=None) -> list[dict[str, Any]]:
    """Per record: its facts and, per head, the blob ids of its overviews, row statistics and windows."""
    out = []
    for rid, r in enumerate(records):
        check_batch(r, batch)
        st = r.stats
        q_len, k_len = int(st["entropy"].shape[2]), int(st["key_weight"].shape[2])
        meta: dict[str, Any] = {"id": rid, "layer": r.layer, "call": r.call, "name": r.name, "kind": r.kind,
                                "heads": list(r.heads), "queries": q_len, "keys": k_len,
                                "source": (r.meta or {}).get("stats_source"), "heads_data": []}
        ov = st.get("overview_mean")
        meta["cells"] = None if ov is None else [int(ov.shape[2]), int(ov.shape[3])]
        meta["cellSize"] = None if ov is None else [-(-q_len // int(ov.shape[2])), -(-k_len // int(ov.shape[3]))]
        meta["windows"] = [list(w) for w in windows_of(r)]
        meta["plots"] = [name for name in ROW_PLOTS if name in st]
        for i, head in enumerate(r.heads):
            hd: dict[str, Any] = {"head": head}
            if ov is not None:
                for name in OVERVIEW_STATS:
                    hd[name] = blobs.add(functools.partial(_floats, st[name][batch, i], precision))
            hd["rows"] = {name: blobs.add(functools.partial(_floats, st[name][batch, i], "exact"))
                          for name in meta["plots"]}
            hd["windows"] = [blobs.add(functools.partial(_floats, st[f"window_{w}"][batch, i], precision))
                             for w in range(len(meta["windows"])) if f"window_{w}" in st]
            meta["heads_data"].append(hd)
        out.append(meta)
    return out


def to_html_long(capture, path=None, *, batch: int = 0, checks: CheckResult | bool | None = True,
                 title: str | None = None, precision: str = "exact", overwrite: bool = False):
    """The HTML report of a statistics-only capture (see the module doc); ``to_html`` calls it for one."""
    from .html import check_precision, describe_info, render, script_json, write_or_return

    started = time.perf_counter()
    check_precision(precision)
    if path is not None:
        output_path(path, overwrite=overwrite)
    records = list(capture)
    if not stats_only(capture):
        raise AttnprobeError("to_html_long takes a statistics-only capture (keep=('stats',)); use to_html")
    if checks is True:
        from ..probe.checks import check

        checks = check(capture)
    blobs = encoding.Blobs()
    try:
        data = build_long_data(records, batch, precision, blobs)
        ids = blobs.results()
    except BaseException:
        blobs.close()
        raise
    model = capture.info.get("model_class", "model")
    chunks = render(
        "long.html.j2",
        script_name="long.js",
        title=title or f"attnprobe report: {model}",
        info=describe_info(capture.info),
        records=data,
        batch=batch,
        precision=precision,
        checks_text=None if not checks else checks.table(),
        checks_ok=None if not checks else checks.ok,
        meta_json=script_json({"records": data, "precision": precision}),
        blobs=ids,
        elapsed=time.perf_counter() - started,
    )
    return write_or_return(chunks, path, overwrite)


def save_long_grid(capture, path, *, batch: int = 0, dpi: float = 100, overwrite: bool = False):
    """PNG of a statistics-only capture: per head its pooled overview (mean weight, log colour scale) and, for
    each window the capture holds, the window's exact weights. Returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    from .png import image_path, save_figure

    image_path(path, overwrite=overwrite)  # fail before drawing
    records = list(capture)
    if not stats_only(capture):
        raise AttnprobeError("save_long_grid takes a statistics-only capture (keep=('stats',))")
    panels = []
    for r in records:
        check_batch(r, batch)
        for i, head in enumerate(r.heads):
            if "overview_mean" in r.stats:
                panels.append((f"L{r.layer} H{head} mean (pooled)", r.stats["overview_mean"][batch, i], None))
            for w, (q0, q1, k0, k1) in enumerate(windows_of(r)):
                panels.append((f"L{r.layer} H{head} q{q0}:{q1} k{k0}:{k1}", r.stats[f"window_{w}"][batch, i],
                               (q0, q1, k0, k1)))
    if not panels:
        raise AttnprobeError("nothing to draw: the capture has no overview or window (capture with overview=)")
    cols = min(8, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(2.6 * cols, 2.6 * rows), layout="constrained")
    for n, (label, t, window) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, n + 1)
        a = t.float().numpy()
        positive = a[a > 0]
        norm = LogNorm(vmin=max(float(positive.min()), 1e-8), vmax=float(positive.max())) if positive.size else None
        extent = None if window is None else (window[2] - 0.5, window[3] - 0.5, window[1] - 0.5, window[0] - 0.5)
        ax.imshow(np.where(a > 0, a, np.nan), cmap="viridis", norm=norm, interpolation="nearest", aspect="auto",
                  extent=extent)
        ax.set_title(label, fontsize=7)
        ax.tick_params(labelsize=6)
    return save_figure(fig, path, overwrite=overwrite, dpi=dpi)
