"""PNG figures of the analyses: kept attention against the cache budget per eviction policy, a rollout (or flow)
matrix, a span x span table. Each follows the ``ax=None`` convention: draws, returns the Axes, never shows."""

from __future__ import annotations

import numpy as np

#: Line colours of the eviction policies (matplotlib's tab10, one per policy, in ``POLICIES`` order).
POLICY_COLORS = {"streaming": "tab:blue", "h2o": "tab:orange", "snapkv": "tab:green", "oracle": "tab:gray"}


def _axes(ax, size=(6.0, 3.6)):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt  # only when the caller gave no Axes (notebook use)

    return plt.subplots(figsize=size)[1]


def eviction_plot(profile, *, ax=None, layers=None, heads=None, band: tuple[float, float] = (0.1, 0.9)):
    """Kept attention against the budget (keys kept), one line per policy: the mean over the (layer, head) rows of
    ``profile`` (``attnprobe.eviction_profile``; ``layers``/``heads`` pick some), shaded between the ``band``
    quantiles over heads. The budget axis is logarithmic. Returns the Axes.

    Example::

        >>> import torch, attnprobe
        >>> from matplotlib.figure import Figure
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn, keep=("weights",)) as cap:
        ...     _ = attn(torch.randn(1, 64, 8))
        >>> profile = attnprobe.eviction_profile(cap, budgets=[4, 8, 16, 32], plan=attnprobe.EvictionPlan(observe=8))
        >>> ax = attnprobe.reports.eviction_plot(profile, ax=Figure().add_subplot())
        >>> [line.get_label() for line in ax.get_lines()]
        ['streaming', 'h2o', 'snapkv', 'oracle']
    """
    import pandas as pd

    if not isinstance(profile, pd.DataFrame) or not {"policy", "budget", "kept"} <= set(profile.columns):
        raise TypeError("eviction_plot draws attnprobe.eviction_profile(...)'s frame (policy, budget, kept columns)")
    data = profile if layers is None else profile[profile["layer"].isin(list(layers))]
    data = data if heads is None else data[data["head"].isin(list(heads))]
    if data.empty:
        raise ValueError("no row of the profile is left to draw (layers=/heads= select none)")
    ax = _axes(ax)
    order = [p for p in POLICY_COLORS if p in set(data["policy"])]
    for policy in order:
        rows = data[data["policy"] == policy].groupby("budget")["kept"]
        mean, low, high = rows.mean(), rows.quantile(band[0]), rows.quantile(band[1])
        color = POLICY_COLORS[policy]
        ax.plot(mean.index, mean.values, marker="o", color=color, label=policy)
        ax.fill_between(mean.index, low.values, high.values, color=color, alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (keys kept before the split)")
    ax.set_ylabel("attention kept (mean over heads)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return ax


def attribution_plot(attribution, *, layer: int = -1, batch: int = 0, ax=None, tokens=None, cmap="viridis"):
    """The ``(query, key)`` matrix of ``attribution`` (``attnprobe.rollout``) at ``layer`` (an index along its layer
    axis, -1: the last), batch row ``batch``; ``tokens`` label the axes. Returns the Axes."""
    values = attribution.values[batch, layer].numpy()
    ax = _axes(ax, (5.0, 4.4))
    image = ax.imshow(values, cmap=cmap, vmin=0.0, aspect="auto", interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if tokens is not None:
        ticks = np.arange(len(tokens))
        ax.set_xticks(ticks, labels=list(tokens), rotation=90, fontsize="x-small")
        ax.set_yticks(ticks, labels=list(tokens), fontsize="x-small")
    ax.set_xlabel("input token")
    ax.set_ylabel("token")
    ax.set_title(f"{attribution.method} through layer {attribution.layers[layer]}")
    return ax


def span_plot(table, *, layer: int, head: int = -1, batch: int = 0, value: str = "mass", ax=None, cmap="magma"):
    """The span x span table of one (layer, head, batch row) of ``attnprobe.spans.attention``'s frame (``head=-1``:
    a ``level="layer"`` frame), each cell annotated. Returns the Axes."""
    rows = table[(table["layer"] == layer) & (table["head"] == head) & (table["batch"] == batch)]
    if rows.empty:
        raise ValueError(f"the span table has no rows for layer {layer}, head {head}, batch row {batch}")
    grid = rows.pivot(index="query_span", columns="key_span", values=value)
    order = list(dict.fromkeys(rows["query_span"])) + list(dict.fromkeys(rows["key_span"]))
    order = list(dict.fromkeys(order))
    grid = grid.reindex(index=[s for s in order if s in grid.index], columns=[s for s in order if s in grid.columns])
    ax = _axes(ax, (5.5, 4.4))
    ax.imshow(grid.to_numpy(dtype=float), cmap=cmap, vmin=0.0, aspect="auto", interpolation="nearest")
    for (i, j), v in np.ndenumerate(grid.to_numpy(dtype=float)):
        if not np.isnan(v):
            ax.text(
                j, i, f"{v:.2f}", ha="center", va="center", fontsize="x-small", color="white" if v < 0.5 else "black"
            )
    ax.set_xticks(range(grid.shape[1]), labels=list(grid.columns), rotation=30, ha="right", fontsize="x-small")
    ax.set_yticks(range(grid.shape[0]), labels=list(grid.index), fontsize="x-small")
    ax.set_xlabel("key span")
    ax.set_ylabel("query span")
    ax.set_title(f"layer {layer}" + ("" if head < 0 else f", head {head}") + f": {value}")
    return ax
