"""Reports: PNG heatmaps (matplotlib) and one self-contained HTML file per capture or comparison.

    >>> import torch, attnprobe
    >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    >>> out, cap = attnprobe.run(attn, torch.randn(1, 4, 8))
    >>> from matplotlib.figure import Figure
    >>> ax = attnprobe.reports.heatmap(cap[0], head=0, ax=Figure().add_subplot(), tokens=list("abcd"))
    >>> attnprobe.reports.to_html(cap).startswith("<!doctype html>")
    True

matplotlib, pandas and jinja2 are imported inside the functions that use them.
"""

from __future__ import annotations

from .analysis_plots import attribution_plot, eviction_plot, span_plot
from .diff import compare, diff_html
from .html import to_html
from .inline import view
from .monitor_views import monitor_html, monitor_plot
from .overlay import overlay, save_overlay
from .png import head_grid, heatmap, save_grid, save_heatmap, save_summary, summary_plot

__all__ = [
    "attribution_plot",
    "compare",
    "diff_html",
    "eviction_plot",
    "head_grid",
    "heatmap",
    "monitor_html",
    "monitor_plot",
    "overlay",
    "save_grid",
    "save_heatmap",
    "save_overlay",
    "save_summary",
    "span_plot",
    "summary_plot",
    "to_html",
    "view",
]
