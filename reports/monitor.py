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


#: statistics the page draws unless told otherwise
PAGE_STATS = ("entropy_min", "max_score_max", "entropy")
#: the most values (lines' points) one page holds: a larger history is thinned by the caller
MAX_PAGE_VALUES = 4_000_000


def _frames_of(monitor, alerts):
    """(history, alerts or None) from a Monitor, an ``AttnprobeCallback`` (anything with ``history`` and ``alerts``
    frames), or a history frame (and the ``alerts`` frame given beside it)."""
    import pandas as pd

    if isinstance(monitor, pd.DataFrame):
        history = monitor
    elif isinstance(getattr(monitor, "history", None), pd.DataFrame):
        history = monitor.history
        if alerts is None:
            alerts = getattr(monitor, "alerts", None)
    else:
        raise TypeError(f"monitor_html draws a monitor (attnprobe.monitor(...), AttnprobeCallback) or its history "
                        f"(mon.history, a DataFrame), not {type(monitor).__name__}")
    missing = [c for c in ("step", "layer", "head") if c not in history.columns]
    if missing:
        raise ValueError(f"this frame is not a monitor's history: it has no {', '.join(missing)} column; pass "
                         "mon.history (or the frame read back from mon.to_parquet)")
    if alerts is not None and not isinstance(alerts, pd.DataFrame):
        raise TypeError(f"alerts= takes the monitor's alerts frame (mon.alerts), not {type(alerts).__name__}")
    return history, alerts


def _lines(history, stat: str) -> dict:
    """One statistic as the page draws it: per layer (the heads aggregated as ``monitor_plot`` does) and per head."""
    how = _AGGREGATE[stat]
    per_layer = history.groupby(["layer", "step"])[stat].agg(how).reset_index()
    layers = [{"layer": int(layer), "steps": rows["step"].astype(int).tolist(),
               "values": rows[stat].astype(float).tolist()} for layer, rows in per_layer.groupby("layer")]
    heads = [{"layer": int(layer), "head": int(head), "steps": rows["step"].astype(int).tolist(),
              "values": rows[stat].astype(float).tolist()}
             for (layer, head), rows in history.sort_values("step").groupby(["layer", "head"])]
    return {"name": stat, "how": {"mean": "mean", "min": "lowest", "max": "highest", "sum": "total"}[how],
            "layers": layers, "heads": heads}


def _alert_rows(alerts) -> tuple[list[dict], int]:
    """The first firing of each (layer, head, alert), in step order, with how often and until when it fired."""
    if alerts is None or not len(alerts):
        return [], 0
    grouped = alerts.sort_values("step", kind="stable").groupby(["layer", "head", "alert"], sort=False)
    rows = []
    for (layer, head, alert), fired in grouped:
        first = fired.iloc[0]
        rows.append({"step": int(first["step"]), "layer": int(layer), "head": int(head), "alert": str(alert),
                     "column": str(first["column"]), "value": float(first["value"]),
                     "threshold": float(first["threshold"]), "times": len(fired), "last": int(fired["step"].max())})
    rows.sort(key=lambda r: (r["step"], r["layer"], r["head"], r["alert"]))
    return rows, len(alerts)


def monitor_html(monitor, path=None, *, alerts=None, stats=PAGE_STATS, title: str | None = None,
                 overwrite: bool = False):
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

    from ..probe.errors import AttnprobeError
    from ._common import output_path
    from .html import render, script_json, write_or_return

    started = time.perf_counter()
    history, alerts = _frames_of(monitor, alerts)
    if isinstance(stats, str):
        stats = (stats,)
    stats = tuple(stats)
    unknown = [s for s in stats if s not in _AGGREGATE or s not in history.columns]
    if unknown or not stats:
        known = ", ".join(c for c in _AGGREGATE if c in history.columns)
        raise ValueError(f"no statistic {', '.join(map(repr, unknown)) or '(none given)'} in this history; it holds {known}")
    if path is not None:
        output_path(path, overwrite=overwrite)  # fail before the work
    values = len(history) * len(stats) * 2  # per head and (at most as many) per layer
    if values > MAX_PAGE_VALUES:
        raise AttnprobeError(
            f"this history would put {values:,} values on the page (more than {MAX_PAGE_VALUES:,}): draw fewer "
            f"statistics (stats=...), fewer layers (history[history.layer.isin([...])]) or fewer steps "
            f"(history[history.step % 10 == 0])")
    plots = [_lines(history, stat) for stat in stats]
    alert_rows, fired = _alert_rows(alerts)
    steps = sorted(int(s) for s in history["step"].unique())
    facts = {
        "sampled steps": f"{len(steps)}" + (f" (steps {steps[0]} to {steps[-1]})" if steps else ""),
        "layers": ", ".join(str(int(x)) for x in sorted(history["layer"].unique())) or "none",
        "heads per layer": ", ".join(sorted({str(n) for n in history.groupby("layer")["head"].nunique()})) or "none",
    }
    if "rows" in history.columns and len(history):
        rows = history["rows"]
        facts["query rows per head and step"] = (f"{int(rows.min())}" if rows.min() == rows.max()
                                                 else f"{int(rows.min())} to {int(rows.max())}") + " (real rows counted)"
    chunks = render(
        "monitor.html.j2",
        script_name="monitor.js",
        title=title or "attnprobe monitor",
        facts=list(facts.items()),
        stats=stats,
        alerts=alert_rows,
        fired=fired,
        meta_json=script_json({"plots": plots, "alerts": alert_rows}),
        elapsed=time.perf_counter() - started,
    )
    return write_or_return(chunks, path, overwrite)
