"""Compare two captures of the same model and input: which heads changed, by how much, side by side.

Typical pairs: before and after a code change, ``sdpa`` vs ``eager``, float32 vs bfloat16.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..probe.errors import AttnprobeError
from ..probe.record import AttentionRecord
from ._common import output_path

#: Column -> dtype of ``compare()``.
COMPARE_SCHEMA: dict[str, str] = {
    "layer": "int64",
    "call": "int64",
    "head": "int64",
    "name": "object",
    "kind": "object",
    "max_abs_weight_diff": "float64",  # largest |after - before| of a weight, any cell either side allows
    "mean_tvd": "float64",  # mean over real query rows of the total variation distance of the two weight rows
    "max_tvd": "float64",  # worst row
    "argmax_agreement": "float64",  # fraction of real query rows whose most-attended key is the same
    "max_abs_score_diff": "float64",  # largest |after - before| of a score, cells both sides allow
    "mask_changed": "int64",  # cells allowed on one side only
    "changed": "bool",  # max_abs_weight_diff > atol, or the mask changed (scores when weights are missing)
}

#: Default tolerance by the coarser stored dtype of the two captures.
ATOL = {torch.float64: 1e-6, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _float64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def _describe(r: AttentionRecord) -> str:
    return f"layer {r.layer} call {r.call} {r.name!r} ({r.kind}, heads {list(r.heads)}, {r.batch_size}x{r.query_len}x{r.key_len})"


def match_records(before: list[AttentionRecord], after: list[AttentionRecord]) -> None:
    """Raise unless ``before`` and ``after`` hold the same attention calls in the same shapes."""
    if len(before) != len(after):
        raise AttnprobeError(
            f"the captures hold {len(before)} and {len(after)} drawable records; compare two captures of the same "
            "model and input with the same layer and head selection"
        )
    for a, b in zip(before, after):
        same = (a.layer, a.call, a.name, a.kind, a.heads, a.batch_size, a.query_len, a.key_len, a.query_offset) == (
            b.layer, b.call, b.name, b.kind, b.heads, b.batch_size, b.query_len, b.key_len, b.query_offset)
        if not same:
            raise AttnprobeError(
                f"the captures differ: {_describe(a)} vs {_describe(b)}; compare two captures of the same model and "
                "input with the same layer and head selection"
            )


def _default_atol(records) -> float:
    worst = 0.0
    for r in records:
        t = r.weights if r.weights is not None else r.scores
        worst = max(worst, ATOL.get(t.dtype, 1e-6))
    return worst


def compare(before, after, *, atol: float | None = None):
    """One row per (layer, call, head) saying how much ``after`` differs from ``before`` (see ``COMPARE_SCHEMA``).

    Over every batch row; padded query rows and rows with no allowed key are left out of the
    row statistics. ``atol`` decides ``changed`` (default by the coarser stored dtype: 1e-6 for
    float32, 1e-3 for float16, 1e-2 for bfloat16). Generation captures are compared stitched.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2).eval()
        >>> x = torch.randn(1, 5, 8)
        >>> _, a = attnprobe.run(attn, x)
        >>> _, b = attnprobe.run(attn, x, dtype=torch.bfloat16)
        >>> frame = attnprobe.reports.compare(a, b)
        >>> list(frame["head"]), bool((frame["max_abs_weight_diff"] > 0).all())
        ([0, 1], True)
    """
    import pandas as pd

    from .html import shown_records

    rows_a, _, _ = shown_records(before)
    rows_b, _, _ = shown_records(after)
    match_records(rows_a, rows_b)
    if atol is None:
        atol = _default_atol(rows_a + rows_b)
    out = []
    for a, b in zip(rows_a, rows_b):
        wa, wb, sa, sb = _float64(a.weights), _float64(b.weights), _float64(a.scores), _float64(b.scores)
        B = a.batch_size
        shape = (B, len(a.heads), a.query_len, a.key_len)
        al = torch.ones(shape, dtype=torch.bool) if a.allowed is None else a.allowed_for_heads().cpu().expand(shape)
        bl = torch.ones(shape, dtype=torch.bool) if b.allowed is None else b.allowed_for_heads().cpu().expand(shape)
        either, both = al | bl, al & bl
        real = either.any(-1)  # (B, H, Tq)
        for pad in (a.query_padding, b.query_padding):
            if pad is not None:
                real &= ~pad.cpu()[:, None, :]
        stats: dict[str, torch.Tensor] = {}
        if wa is not None and wb is not None:
            d = (wb - wa).abs()
            d = torch.where(either | (d != 0), d, 0.0)  # a masked cell that gained weight counts
            tvd = 0.5 * d.sum(-1)  # (B, H, Tq)
            n = real.sum(dim=(0, 2)).clamp_min(1)
            stats["max_abs_weight_diff"] = d.nan_to_num(math.inf).amax(dim=(0, 2, 3))
            stats["mean_tvd"] = torch.where(real, tvd, 0.0).sum(dim=(0, 2)) / n
            stats["max_tvd"] = torch.where(real, tvd, 0.0).amax(dim=(0, 2))
            agree = wa.argmax(-1) == wb.argmax(-1)
            stats["argmax_agreement"] = torch.where(real, agree, False).sum(dim=(0, 2)) / n
            no_rows = real.sum(dim=(0, 2)) == 0
            for col in ("mean_tvd", "argmax_agreement"):
                stats[col] = torch.where(no_rows, math.nan, stats[col])
        if sa is not None and sb is not None:
            ds = (sb - sa).abs()
            ok = both & torch.isfinite(sa) & torch.isfinite(sb)
            stats["max_abs_score_diff"] = torch.where(ok, ds, 0.0).amax(dim=(0, 2, 3))
            # a score that became non-finite (or stopped being) is an infinite change
            flipped = both & (torch.isfinite(sa) != torch.isfinite(sb))
            stats["max_abs_score_diff"] = torch.where(flipped.any(-1).any(-1).any(0), math.inf, stats["max_abs_score_diff"])
        mask_changed = (al != bl).sum(dim=(0, 2, 3))
        for i, head in enumerate(a.heads):
            row = {"layer": a.layer, "call": a.call, "head": head, "name": a.name, "kind": a.kind}
            for col in ("max_abs_weight_diff", "mean_tvd", "max_tvd", "argmax_agreement", "max_abs_score_diff"):
                row[col] = float(stats[col][i]) if col in stats else math.nan
            row["mask_changed"] = int(mask_changed[i])
            measure = row["max_abs_weight_diff"] if "max_abs_weight_diff" in stats else row["max_abs_score_diff"]
            row["changed"] = bool(row["mask_changed"] > 0 or not (measure <= atol))
            out.append(row)
    frame = pd.DataFrame(out, columns=list(COMPARE_SCHEMA))
    return frame.astype(COMPARE_SCHEMA)


def diff_html(
    before,
    after,
    path=None,
    *,
    labels: tuple[str, str] = ("before", "after"),
    tokens=None,
    key_tokens=None,
    batch: int = 0,
    atol: float | None = None,
    title: str | None = None,
    precision: str = "exact",
    masked_scores: bool = False,
    overwrite: bool = False,
    max_values: int | None = None,
):
    """A self-contained HTML comparison of two captures of the same model and input.

    The grid shows |after - before| per head on one colour scale, the table ranks heads by how much
    they changed (``compare``), and a head's detail view shows before, after and their difference
    side by side, scrolled, zoomed and pointed together (exact values of both and the difference).
    Options as in ``to_html``; returns the document when ``path`` is None, else writes it and returns
    the path.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2).eval()
        >>> x = torch.randn(1, 5, 8)
        >>> _, a = attnprobe.run(attn, x)
        >>> _, b = attnprobe.run(attn, x, dtype=torch.float16)
        >>> attnprobe.reports.diff_html(a, b, labels=("fp32", "fp16")).startswith("<!doctype html>")
        True
    """
    from .html import (
        MAX_VALUES,
        build_data,
        describe_info,
        finite_or_none,
        input_facts,
        render,
        script_json,
        shown_records,
        write_or_return,
    )

    started = time.perf_counter()
    if path is not None:
        output_path(path, overwrite=overwrite)
    if len(labels) != 2 or not all(isinstance(x, str) for x in labels):
        raise AttnprobeError(f"labels must be two strings (before, after), got {labels!r}")
    rows_a, undrawn, stitched = shown_records(before)
    rows_b, _, _ = shown_records(after)
    match_records(rows_a, rows_b)
    frame = compare(before, after, atol=atol)
    if atol is None:
        atol = _default_atol(rows_a + rows_b)
    data = build_data([rows_a, rows_b], batch=batch, tokens=tokens, key_tokens=key_tokens, precision=precision,
                      masked_scores=masked_scores, max_values=MAX_VALUES if max_values is None else max_values)
    rid = {(m["layer"], m["call"]): m["id"] for m in data.meta["records"]}
    rows = []
    changes = {}
    for row in frame.to_dict("records"):
        r = rid[(row["layer"], row["call"])]
        row["target"] = f"#head-{r}-{row['head']}"
        rows.append(row)
        changes[f"{r}-{row['head']}"] = {
            "max_abs_weight_diff": finite_or_none(row["max_abs_weight_diff"]),
            "mean_tvd": finite_or_none(row["mean_tvd"]),
            "changed": row["changed"],
        }
    rows.sort(key=lambda row: -np.nan_to_num(row["max_abs_weight_diff"], nan=-1.0, posinf=np.inf))
    data.meta.update(labels=list(labels), changes=changes, flags={})
    model = before.info.get("model_class", "model")
    chunks = render(
        "report.html.j2",
        title=title or f"attnprobe comparison: {model}, {labels[0]} vs {labels[1]}",
        mode="diff",
        labels=labels,
        sides=[{"label": labels[0], "info": describe_info(before.info)}, {"label": labels[1], "info": describe_info(after.info)}],
        changed_count=int(frame["changed"].sum()),
        head_count=len(frame),
        atol=atol,
        records=list(zip(rows_a, data.meta["records"])),
        undrawn=undrawn,
        stitched=stitched,
        input=input_facts(rows_a, batch, data, tokens, key_tokens),
        precision=precision,
        masked_scores=masked_scores,
        compare_columns=[c for c in COMPARE_SCHEMA if c != "kind"],
        compare_rows=rows,
        meta_json=script_json(data.meta),
        blobs=data.blobs,
        elapsed=time.perf_counter() - started,
    )
    return write_or_return(chunks, path, overwrite)
