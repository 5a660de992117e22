"""``monitor_plot``: a training history of ``attnprobe.monitor`` drawn against the step (matplotlib)."""

from __future__ import annotations

#: statistics a history holds, and the aggregate over heads that makes sense for each when drawing per layer
_AGGREGATE = {"entropy": "mean", "entropy_min": "min", "max_weight": "mean", "max_weight_max": "max",
              "first_key_mass": "mean", "diagonal_mass": "mean", "previous_mass": "mean", "masked_mass": "max",
              "row_sum_error": "max", "max_score": "mean", "max_score_max": "max", "nonfinite_rows": "sum"}


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
        raise TypeError(f"monitor_plot draws a monitor's history (mon.history, a DataFrame), not {type(history).__name__}")
    if stat not in _AGGREGATE or stat not in history.columns:
        known = ", ".join(c for c in _AGGREGATE if c in history.columns)
        raise ValueError(f"no statistic {stat!r} in this history; it holds {known}")
    if by not in ("layer", "head"):
        raise ValueError(f"by must be 'layer' or 'head', not {by!r}")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7, 3.5))
    data = history if layers is None else history[history["layer"].isin(list(layers))]
    if by == "layer":
        lines = data.groupby(["layer", "step"])[stat].agg(_AGGREGATE[stat]).reset_index()
        for layer, rows in lines.groupby("layer"):
            ax.plot(rows["step"], rows[stat], label=f"layer {layer}")
        how = {"mean": "mean", "min": "lowest", "max": "highest", "sum": "total"}[_AGGREGATE[stat]]
        ax.set_ylabel(f"{stat} ({how} over heads)")
    else:
        for (layer, head), rows in data.groupby(["layer", "head"]):
            ax.plot(rows["step"], rows[stat], label=f"layer {layer} head {head}", linewidth=0.8)
        ax.set_ylabel(stat)
    ax.set_xlabel("step")
    if len(ax.get_lines()) <= 12:
        ax.legend(fontsize=7)
    return ax
