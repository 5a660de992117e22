"""The report's Analyses section: rollout or flow, value-weighted norms, span x span attention and eviction profiles,
rendered on the server as heat tables and an inline SVG chart (the page's Content-Security-Policy loads no image, and
nothing here needs the page script).

``analysis_context(analyses, tokens=..., spans=...)`` turns the results a user passes to ``reports.to_html(cap,
analyses=[...])`` into the template's context (``_analyses.html.j2``); ``span_tokens`` colours the token lists by
declared span.
"""

from __future__ import annotations

import math
from typing import Any

#: Largest rollout matrix drawn cell by cell (tokens a side); longer inputs get each token's top inputs instead.
MAX_MATRIX_TOKENS = 96
#: Span colours (a qualitative palette; spans past its end reuse it).
SPAN_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
POLICY_COLORS = {"streaming": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#2ca02c", "oracle": "#7f7f7f"}


def heat(value: float, top: float) -> str:
    """A CSS colour for ``value`` on a white-to-blue scale up to ``top`` (NaN: light grey)."""
    if value is None or math.isnan(value) or top <= 0:
        return "#eeeeee"
    t = max(0.0, min(1.0, value / top))
    r, g, b = (round(255 + (c - 255) * t) for c in (0x1A, 0x5F, 0xB4))
    return f"#{r:02x}{g:02x}{b:02x}"


def ink(value: float, top: float) -> str:
    """Text colour that reads on ``heat(value, top)``."""
    return "#ffffff" if top > 0 and not math.isnan(value) and value / top > 0.55 else "#1d1f21"


def _token(tokens, i: int) -> str:
    return tokens[i] if tokens is not None and i < len(tokens) else str(i)


def attribution_part(attribution, *, tokens=None, batch: int = 0) -> dict[str, Any]:
    """The last layer of a rollout or flow: a heat table, or for long inputs each token's three heaviest inputs."""
    values = attribution.values[batch, -1]  # (T, T)
    T = values.shape[0]
    top = float(values.max())
    title = f"Attention {attribution.method} through layer {attribution.layers[-1]}"
    note = (
        f"residual share {attribution.options.get('residual')}, heads fused by their "
        f"{attribution.options.get('head_fusion')}; row = token, column = input token"
    )
    if T <= MAX_MATRIX_TOKENS:
        rows = [
            {
                "label": _token(tokens, i),
                "cells": [
                    {
                        "v": f"{float(values[i, j]):.3f}",
                        "bg": heat(float(values[i, j]), top),
                        "fg": ink(float(values[i, j]), top),
                    }
                    for j in range(T)
                ],
            }
            for i in range(T)
        ]
        return {
            "kind": "matrix",
            "anchor": attribution.method,
            "title": title,
            "note": note,
            "columns": [_token(tokens, j) for j in range(T)],
            "rows": rows,
        }
    best = values.topk(3, dim=-1)
    rows = [
        {
            "label": _token(tokens, i),
            "top": [(_token(tokens, int(j)), f"{float(v):.3f}") for v, j in zip(best.values[i], best.indices[i])],
        }
        for i in range(T)
    ]
    return {
        "kind": "top",
        "anchor": attribution.method,
        "title": title,
        "note": note + f" ({T} tokens: each token's three heaviest inputs)",
        "rows": rows,
    }


def value_norm_part(norms, *, tokens=None, batch: int = 0) -> dict[str, Any]:
    """Per layer: each key token's share of the weight and of the value-weighted norm it receives (averaged over the
    queries and heads), side by side; where they differ, the weight overstates (or understates) the key's effect."""
    layers = []
    for r in norms.records:
        weight = r.weights[batch].mean(0).mean(0)  # (key,): the mean weight a key receives
        norm = (r.summed[batch] if r.summed is not None else r.norm[batch].square().sum(0).sqrt()).mean(0)
        weight, norm = weight / weight.sum(), norm / norm.sum()
        top = float(max(weight.max(), norm.max()))
        cells = [
            {
                "token": _token(tokens, j),
                "weight": f"{float(w):.3f}",
                "norm": f"{float(n):.3f}",
                "wbg": heat(float(w), top),
                "nbg": heat(float(n), top),
                "wfg": ink(float(w), top),
                "nfg": ink(float(n), top),
            }
            for j, (w, n) in enumerate(zip(weight, norm))
        ]
        layers.append({"layer": r.layer, "call": r.call, "projected": r.summed is not None, "cells": cells})
    return {
        "kind": "norms",
        "anchor": "norms",
        "title": "Value-weighted norms (Kobayashi et al., 2020)",
        "note": "each key token's share of the attention weight and of the norm ||sum_h a v W_O|| it contributes "
        "(without the output projection, ||a v|| of the heads side by side, where the layer says so)",
        "layers": layers,
        "projection": {str(k): v for k, v in norms.projection.items()},
    }


def span_part(table, *, batch: int = 0) -> dict[str, Any]:
    """Span x span mass of every layer (the heads' mean) as heat tables."""
    rows = table[table["batch"] == batch]
    layers = []
    for layer, part in rows.groupby("layer", sort=True):
        mean = part.groupby(["query_span", "key_span"], sort=False)["mass"].mean()
        queries = list(dict.fromkeys(part["query_span"]))
        keys = list(dict.fromkeys(part["key_span"]))
        grid = [
            {
                "label": q,
                "cells": [
                    {
                        "v": f"{mean.get((q, k), math.nan):.2f}",
                        "bg": heat(float(mean.get((q, k), math.nan)), 1.0),
                        "fg": ink(float(mean.get((q, k), math.nan)), 1.0),
                    }
                    for k in keys
                ],
            }
            for q in queries
        ]
        layers.append({"layer": int(layer), "key_spans": keys, "rows": grid})
    return {
        "kind": "spans",
        "anchor": "spans",
        "title": "Attention between spans",
        "note": "mean over the query span's rows of the weight on the key span's keys (heads averaged)",
        "layers": layers,
    }


def eviction_part(profile, *, width: int = 520, height: int = 240) -> dict[str, Any]:
    """Kept attention against the budget per policy: an inline SVG line chart (mean over heads) and its table."""
    budgets = sorted({int(b) for b in profile["budget"]})
    means = profile.groupby(["policy", "budget"])["kept"].mean()
    worst = profile.groupby(["policy", "budget"])["kept"].min()
    pad, legend = 40, 90  # the plot's margin, and the room on the right for the policies' names
    logs = [math.log2(b) for b in budgets]
    lo, hi = min(logs), max(logs)

    def x(b: int) -> float:
        return pad + (width - 2 * pad - legend) * ((math.log2(b) - lo) / (hi - lo) if hi > lo else 0.5)

    def y(v: float) -> float:
        return height - pad - (height - 2 * pad) * v

    lines, table = [], []
    for policy in [p for p in POLICY_COLORS if p in set(profile["policy"])]:
        points = [(x(b), y(float(means[(policy, b)]))) for b in budgets if (policy, b) in means]
        lines.append(
            {
                "policy": policy,
                "color": POLICY_COLORS[policy],
                "points": " ".join(f"{px:.1f},{py:.1f}" for px, py in points),
                "dots": points,
            }
        )
        table.append(
            {
                "policy": policy,
                "cells": [(f"{float(means[(policy, b)]):.3f}", f"{float(worst[(policy, b)]):.3f}") for b in budgets],
            }
        )
    ticks = [{"x": x(b), "label": str(b)} for b in budgets]
    grid = [{"y": y(v), "label": f"{v:g}"} for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return {
        "kind": "eviction",
        "anchor": "eviction",
        "title": "KV-cache eviction profile",
        "note": "attention kept at each budget (keys kept before the split), mean over layers and heads; the table "
        "adds the smallest head's",
        "width": width,
        "height": height,
        "pad": pad,
        "right": width - pad - legend,
        "lines": lines,
        "ticks": ticks,
        "grid": grid,
        "budgets": budgets,
        "table": table,
    }


def analysis_context(analyses, *, tokens=None, batch: int = 0) -> list[dict[str, Any]]:
    """The Analyses section's parts, one per result in ``analyses``: an ``Attribution`` (``attnprobe.rollout``), a
    ``ValueNorms`` (``attnprobe.value_norms``), a span table (``attnprobe.spans.attention``) or an eviction profile
    (``attnprobe.eviction_profile``). ``tokens``: the shown batch row's tokens."""
    from ..probe.analyses.rollout import Attribution
    from ..probe.analyses.value_norms import ValueNorms

    parts = []
    for item in analyses:
        if isinstance(item, Attribution):
            parts.append(attribution_part(item, tokens=tokens, batch=batch))
        elif isinstance(item, ValueNorms):
            parts.append(value_norm_part(item, tokens=tokens, batch=batch))
        elif hasattr(item, "columns") and {"query_span", "key_span", "mass"} <= set(item.columns):
            parts.append(span_part(item, batch=batch))
        elif hasattr(item, "columns") and {"policy", "budget", "kept"} <= set(item.columns):
            parts.append(eviction_part(item))
        else:
            raise TypeError(
                "analyses= takes results of attnprobe.rollout, attnprobe.value_norms, attnprobe.spans.attention or "
                f"attnprobe.eviction_profile, not {type(item).__name__}"
            )
    return parts


def span_tokens(spans, batch: int, length: int) -> list[dict[str, Any] | None] | None:
    """Per token of batch row ``batch`` its span's label and colour (None: no span), for the token lists."""
    if spans is None:
        return None
    ids = spans.for_keys(1, length) if spans.ids.shape[0] == 1 else spans.for_keys(spans.ids.shape[0], length)
    ids = ids[min(batch, ids.shape[0] - 1)]
    return [
        None if int(s) < 0 else {"label": spans.labels[int(s)], "color": SPAN_COLORS[int(s) % len(SPAN_COLORS)]}
        for s in ids.tolist()
    ]
