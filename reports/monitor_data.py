"""A monitor's history as a page draws it (``monitor_html``'s page, the Monitor section of ``to_html``): per
statistic one line per layer and per head, the alerts table, the facts. Data only: ``reports.html`` renders it."""

from __future__ import annotations

#: statistics a history holds, and the aggregate over heads that makes sense for each when drawing per layer
AGGREGATE = {
    "entropy": "mean",
    "entropy_min": "min",
    "max_weight": "mean",
    "max_weight_max": "max",
    "first_key_mass": "mean",
    "diagonal_mass": "mean",
    "previous_mass": "mean",
    "masked_mass": "max",
    "row_sum_error": "max",
    "max_score": "mean",
    "max_score_max": "max",
    "nonfinite_rows": "sum",
}


#: statistics the page draws unless told otherwise
PAGE_STATS = ("entropy_min", "max_score_max", "entropy")
#: the most values (lines' points) one page holds: a larger history is thinned by the caller
MAX_PAGE_VALUES = 4_000_000


def _frames_of(monitor, alerts, report: bool = False):
    """(history, alerts or None) from a Monitor, an ``AttnprobeCallback`` (anything with ``history`` and ``alerts``
    frames), or a history frame (and the ``alerts`` frame given beside it). ``report``: the errors name
    ``to_html``'s arguments (``monitor=``, ``monitor_alerts=``), not ``monitor_html``'s."""
    caller, alerts_arg = ("to_html(monitor=) takes", "monitor_alerts=") if report else ("monitor_html draws", "alerts=")
    import pandas as pd

    if isinstance(monitor, pd.DataFrame):
        history = monitor
    elif isinstance(getattr(monitor, "history", None), pd.DataFrame):
        history = monitor.history
        if alerts is None:
            alerts = getattr(monitor, "alerts", None)
    else:
        raise TypeError(
            f"{caller} a monitor (attnprobe.monitor(...), AttnprobeCallback) or its history "
            f"(mon.history, a DataFrame), not {type(monitor).__name__}"
        )
    missing = [c for c in ("step", "layer", "head") if c not in history.columns]
    if missing:
        raise ValueError(
            f"this frame is not a monitor's history: it has no {', '.join(missing)} column; pass "
            "mon.history (or the frame read back from mon.to_parquet)"
        )
    if alerts is not None and not isinstance(alerts, pd.DataFrame):
        raise TypeError(f"{alerts_arg} takes the monitor's alerts frame (mon.alerts), not {type(alerts).__name__}")
    return history, alerts


def _lines(history, stat: str) -> dict:
    """One statistic as the page draws it: per layer (the heads aggregated as ``monitor_plot`` does) and per head."""
    how = AGGREGATE[stat]
    per_layer = history.groupby(["layer", "step"])[stat].agg(how).reset_index()
    layers = [
        {"layer": int(layer), "steps": rows["step"].astype(int).tolist(), "values": rows[stat].astype(float).tolist()}
        for layer, rows in per_layer.groupby("layer")
    ]
    heads = [
        {
            "layer": int(layer),
            "head": int(head),
            "steps": rows["step"].astype(int).tolist(),
            "values": rows[stat].astype(float).tolist(),
        }
        for (layer, head), rows in history.sort_values("step").groupby(["layer", "head"])
    ]
    return {
        "name": stat,
        "how": {"mean": "mean", "min": "lowest", "max": "highest", "sum": "total"}[how],
        "layers": layers,
        "heads": heads,
    }


def _alert_rows(alerts) -> tuple[list[dict], int]:
    """The first firing of each (layer, head, alert), in step order, with how often and until when it fired."""
    if alerts is None or not len(alerts):
        return [], 0
    grouped = alerts.sort_values("step", kind="stable").groupby(["layer", "head", "alert"], sort=False)
    rows = []
    for (layer, head, alert), fired in grouped:
        first = fired.iloc[0]
        rows.append(
            {
                "step": int(first["step"]),
                "layer": int(layer),
                "head": int(head),
                "alert": str(alert),
                "column": str(first["column"]),
                "value": float(first["value"]),
                "threshold": float(first["threshold"]),
                "times": len(fired),
                "last": int(fired["step"].max()),
            }
        )
    rows.sort(key=lambda r: (r["step"], r["layer"], r["head"], r["alert"]))
    return rows, len(alerts)


def monitor_context(monitor, *, alerts=None, stats=PAGE_STATS, report: bool = False) -> dict:
    """What a page's monitor section shows (the standalone page of ``monitor_html``, the Monitor section of
    ``to_html(cap, monitor=mon)``): ``facts`` (label, text) pairs, the ``stats`` drawn, the ``alerts`` table's rows
    (first firing of each layer, head and alert), how many firings there were (``fired``) and ``meta``, the data
    ``monitor.js`` draws from (``reports.html.monitor_section`` writes it as the page's JSON). Refuses, naming what
    it takes, anything that is not a monitor or its history, a statistic the history lacks, and a history too large
    for a page (``report``: in ``to_html``'s words)."""
    from ..probe.errors import AttnprobeError

    history, alerts = _frames_of(monitor, alerts, report)
    if isinstance(stats, str):
        stats = (stats,)
    stats = tuple(stats)
    unknown = [s for s in stats if s not in AGGREGATE or s not in history.columns]
    if unknown or not stats:
        known = ", ".join(c for c in AGGREGATE if c in history.columns)
        raise ValueError(
            f"no statistic {', '.join(map(repr, unknown)) or '(none given)'} in this history; it holds {known}"
        )
    values = len(history) * len(stats) * 2  # per head and (at most as many) per layer
    if values > MAX_PAGE_VALUES:
        stats_arg = "monitor_stats" if report else "stats"
        raise AttnprobeError(
            f"this history would put {values:,} values on the page (more than {MAX_PAGE_VALUES:,}): draw fewer "
            f"statistics ({stats_arg}=...), fewer layers (history[history.layer.isin([...])]) or fewer steps "
            f"(history[history.step % 10 == 0])"
        )
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
        facts["query rows per head and step"] = (
            f"{int(rows.min())}" if rows.min() == rows.max() else f"{int(rows.min())} to {int(rows.max())}"
        ) + " (real rows counted)"
    return {
        "facts": list(facts.items()),
        "stats": stats,
        "alerts": alert_rows,
        "fired": fired,
        "meta": {"plots": plots, "alerts": alert_rows},
    }
