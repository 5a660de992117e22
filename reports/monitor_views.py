"""A training history of ``attnprobe.monitor`` drawn against the step: ``monitor_plot`` (matplotlib) and
``monitor_html`` (one self-contained page; its data from ``monitor_data``, as the Monitor section of ``to_html``)."""

from __future__ import annotations

from .monitor_data import AGGREGATE, PAGE_STATS


def monitor_plot(history, stat: str = "entropy_min", *, by: str = "layer", ax=None, layers=None):
    """One line per layer (``by="layer"``: the heads aggregated, e.g. the lowest ``entropy_min``) or per
    (layer, head) (``by="head"``) of ``stat`` against the step. ``history``: ``mon.history`` (or the frame
    read back from ``mon.to_parquet``). Returns the Axes.

    Example::

        >>> import torch, attnprobe
        >>> from matplotlib.figure import Figure
        >>> model = torch.nn.Sequential(attnprobe.MultiHeadAttention(8, num_heads=2, causal=True))
        >>> with attnprobe.monitor(model, every=1) as mon:
        ...     for _ in range(3):
        ...         _ = model(torch.randn(1, 5, 8))
        >>> ax = attnprobe.reports.monitor_plot(mon.history, ax=Figure().add_subplot())
        >>> [line.get_label() for line in ax.get_lines()]
        ['layer 0']
    """
    import pandas as pd

    if not isinstance(history, pd.DataFrame):
        raise TypeError(
            f"monitor_plot draws a monitor's history (mon.history, a DataFrame), not {type(history).__name__}"
        )
    if stat not in AGGREGATE or stat not in history.columns:
        known = ", ".join(c for c in AGGREGATE if c in history.columns)
        raise ValueError(f"no statistic {stat!r} in this history; it holds {known}")
    if by not in ("layer", "head"):
        raise ValueError(f"by must be 'layer' or 'head', not {by!r}")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7, 3.5))
    data = history if layers is None else history[history["layer"].isin(list(layers))]
    if by == "layer":
        lines = data.groupby(["layer", "step"])[stat].agg(AGGREGATE[stat]).reset_index()
        for layer, rows in lines.groupby("layer"):
            ax.plot(rows["step"], rows[stat], label=f"layer {layer}")
        how = {"mean": "mean", "min": "lowest", "max": "highest", "sum": "total"}[AGGREGATE[stat]]
        ax.set_ylabel(f"{stat} ({how} over heads)")
    else:
        for (layer, head), rows in data.groupby(["layer", "head"]):
            ax.plot(rows["step"], rows[stat], label=f"layer {layer} head {head}", linewidth=0.8)
        ax.set_ylabel(stat)
    ax.set_xlabel("step")
    if len(ax.get_lines()) <= 12:
        ax.legend(fontsize=7)
    return ax


def monitor_html(
    monitor, path=None, *, alerts=None, stats=PAGE_STATS, title: str | None = None, overwrite: bool = False
):
    """One self-contained HTML page of a training run watched by ``attnprobe.monitor``: per statistic a plot
    against the step, one line per layer (the heads aggregated: the lowest ``entropy_min``, the highest
    ``max_score_max``, the mean ``entropy``) or, chosen on the page, one line per head of a layer; and the alerts
    (the first firing of each layer, head and alert). ``monitor``: the monitor, an ``AttnprobeCallback``, or a
    history frame (``mon.history``, or read back from ``mon.to_parquet``) with ``alerts=mon.alerts`` beside it.
    Like ``to_html``: no network, no external code (the report's Content-Security-Policy); returns the document when
    ``path`` is None, else writes it (an existing file only with ``overwrite=True``) and returns the path.

    Example::

        >>> import torch, attnprobe
        >>> model = torch.nn.Sequential(attnprobe.MultiHeadAttention(8, num_heads=2, causal=True))
        >>> with attnprobe.monitor(model, every=1, alerts={"entropy_below": 5.0}) as mon:
        ...     for _ in range(3):
        ...         _ = model(torch.randn(1, 5, 8))
        >>> page = attnprobe.reports.monitor_html(mon)
        >>> page.startswith("<!doctype html>"), "entropy_below" in page
        (True, True)
    """
    import time

    from ._common import output_path
    from .html import monitor_section, render, write_or_return

    started = time.perf_counter()
    if path is not None:
        output_path(path, overwrite=overwrite)  # fail before the work
    context = monitor_section(monitor, alerts=alerts, stats=stats, report=False)
    chunks = render(
        "monitor.html.j2",
        script_name="monitor.js",
        title=title or "attnprobe monitor",
        monitor=context,
        elapsed=time.perf_counter() - started,
    )
    return write_or_return(chunks, path, overwrite)
