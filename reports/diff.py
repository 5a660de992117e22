"""Compare two captures of the same model and input: which heads changed, by how much, side by side.

Typical pairs: before and after a code change, ``sdpa`` vs ``eager``, float32 vs bfloat16.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from ..probe.errors import AttnprobeError
from ..probe.record import AttentionRecord
from ._common import matrix_rows, matrix_shape, output_path
from .html import describe_info, page_data, page_number, render, script_json, write_or_return
from .page import MAX_VALUES, describe_record, match_records, plan_diff, shown_records

#: Column -> dtype of ``compare()``.
COMPARE_SCHEMA: dict[str, str] = {
    "layer": "int64",
    "call": "int64",
    "head": "int64",
    "name": "object",
    "kind": "object",
    "max_abs_weight_diff": "float64",  # largest |after - before| of a weight, any key of a real query row
    "mean_tvd": "float64",  # mean over real query rows of the total variation distance of the two weight rows
    "max_tvd": "float64",  # worst row
    "argmax_agreement": "float64",  # fraction of real query rows whose most-attended key is the same
    "max_abs_score_diff": "float64",  # largest |after - before| of a score, cells both sides allow, real rows
    "mask_changed": "int64",  # cells allowed on one side only
    "changed": "bool",  # max_abs_weight_diff > atol, or the mask changed (scores when weights are missing)
}

#: Default tolerance by the coarser stored dtype of the two captures.
ATOL = {torch.float64: 1e-6, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _slice64(t: torch.Tensor, batch: int, head: int) -> torch.Tensor:
    """One (query, key) matrix as float64 on the CPU: never a float64 copy of a whole record."""
    return t[batch, head].detach().to("cpu", torch.float64)


def _allowed(r: AttentionRecord, batch: int, head: int) -> torch.Tensor:
    allowed = r.allowed_for_heads()
    if allowed is None:
        return torch.ones(matrix_shape(r), dtype=torch.bool)
    return allowed[min(batch, allowed.shape[0] - 1), head].cpu()


def _head_stats(a: AttentionRecord, b: AttentionRecord, i: int) -> dict[str, float]:
    """The ``compare`` columns of head index ``i``, one batch row at a time (memory: a few (query, key) matrices)."""
    wa, wb, sa, sb = a.weights, b.weights, a.scores, b.scores
    weights = wa is not None and wb is not None
    scores = sa is not None and sb is not None
    if not weights and not scores:
        raise AttnprobeError(
            f"{describe_record(a)}: the captures share neither weights nor scores to compare "
            f"(before has {_has(a)}, after has {_has(b)}); capture the same quantities on both sides"
        )
    max_w = max_s = 0.0
    tvd_sum = tvd_max = agree = 0.0
    rows = mask_changed = 0
    for batch in range(matrix_rows(a)):
        al, bl = _allowed(a, batch, i), _allowed(b, batch, i)
        mask_changed += int((al != bl).sum())
        # real rows: some key allowed on either side, not padding on either side (padded rows are "don't care")
        real = (al | bl).any(-1)
        for pad in (a.query_padding, b.query_padding):
            if pad is not None:
                real &= ~pad[batch].cpu()
        n = int(real.sum())
        rows += n
        if n == 0:
            continue
        if wa is not None and wb is not None:
            x, y = _slice64(wa, batch, i)[real], _slice64(wb, batch, i)[real]  # (rows, key)
            d = (y - x).abs()  # every key of a real row: a masked cell that gained weight counts
            max_w = max(max_w, float(d.nan_to_num(math.inf).max()))
            tvd = 0.5 * d.sum(-1)
            tvd_sum += float(tvd.sum())
            tvd_max = max(tvd_max, float(tvd.nan_to_num(math.inf).max()))
            agree += float((x.argmax(-1) == y.argmax(-1)).sum())
            del x, y, d
        if sa is not None and sb is not None:
            both = (al & bl)[real]
            x, y = _slice64(sa, batch, i)[real], _slice64(sb, batch, i)[real]  # (rows, key)
            fx, fy = torch.isfinite(x), torch.isfinite(y)
            if (both & (fx != fy)).any():  # a score that became non-finite (or stopped being) is an infinite change
                max_s = math.inf
            ok = both & fx & fy
            if ok.any():
                max_s = max(max_s, float((y - x).abs()[ok].max()))
            del x, y
    nan = math.nan
    return {
        "max_abs_weight_diff": max_w if weights else nan,
        "mean_tvd": tvd_sum / rows if weights and rows else nan,
        "max_tvd": tvd_max if weights else nan,
        "argmax_agreement": agree / rows if weights and rows else nan,
        "max_abs_score_diff": max_s if scores else nan,
        "mask_changed": mask_changed,
    }


def _has(r: AttentionRecord) -> str:
    found = [name for name in ("weights", "scores") if getattr(r, name) is not None]
    return " and ".join(found) or "neither weights nor scores"


def _default_atol(records) -> float:
    worst = 0.0
    for r in records:
        t = r.weights if r.weights is not None else r.scores
        worst = max(worst, ATOL.get(t.dtype, 1e-6))
    return worst


def compare(before, after, *, atol: float | None = None):
    """One row per (layer, call, head) saying how much ``after`` differs from ``before`` (see ``COMPARE_SCHEMA``).

    Over every batch row; padded query rows (don't care) and rows with no allowed key are left out
    of every statistic but ``mask_changed``. Memory: one head of one batch row at a time is compared
    in float64, never whole records. ``atol`` decides ``changed`` (default by the coarser stored dtype: 1e-6 for
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
    rows_a, _, _ = shown_records(before)
    rows_b, _, _ = shown_records(after)
    match_records(rows_a, rows_b)
    return _compare_records(rows_a, rows_b, atol)


def _compare_records(rows_a: list[AttentionRecord], rows_b: list[AttentionRecord], atol: float | None):
    """``compare`` of two matched lists of drawable records (generation steps already stitched)."""
    import pandas as pd

    if atol is None:
        atol = _default_atol(rows_a + rows_b)
    out = []
    for a, b in zip(rows_a, rows_b):
        for i, head in enumerate(a.heads):
            row: dict[str, Any] = {"layer": a.layer, "call": a.call, "head": head, "name": a.name, "kind": a.kind}
            row.update(_head_stats(a, b, i))
            both_weights = a.weights is not None and b.weights is not None
            measure = row["max_abs_weight_diff"] if both_weights else row["max_abs_score_diff"]
            row["changed"] = bool(row["mask_changed"] > 0 or not (measure <= atol))
            out.append(row)
    frame = pd.DataFrame(out, columns=list(COMPARE_SCHEMA))
    return frame.astype(COMPARE_SCHEMA)


def diff_html(
    before,
    after=None,
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

    ``before`` may instead be the result of ``attnprobe.compare`` (two implementations of one model), with ``after``
    left out (``diff_html(comparison, path)``): the page then draws its two sides lined up
    (``Comparison.aligned()``: the reference's layer and head numbers, the candidate's heads in the matched order;
    labels "reference" and "candidate" unless given) and opens with a "First divergence" section: where the two
    first differ, the diagnosis and its evidence, the diverged tensor of that head side by side with the difference
    (q, k and v too, which the head views do not draw), and a link to the head's detail view.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2).eval()
        >>> x = torch.randn(1, 5, 8)
        >>> _, a = attnprobe.run(attn, x)
        >>> _, b = attnprobe.run(attn, x, dtype=torch.float16)
        >>> attnprobe.reports.diff_html(a, b, labels=("fp32", "fp16")).startswith("<!doctype html>")
        True
    """
    started = time.perf_counter()
    if path is None and isinstance(after, (str, os.PathLike)):  # diff_html(comparison, "page.html")
        after, path = None, after
    before, after, labels, comparison = _sides(before, after, labels)
    if path is not None:
        output_path(path, overwrite=overwrite)
    if len(labels) != 2 or not all(isinstance(x, str) for x in labels):
        raise AttnprobeError(f"labels must be two strings (before, after), got {labels!r}")
    plan = plan_diff(
        before,
        after,
        tokens=tokens,
        key_tokens=key_tokens,
        batch=batch,
        precision=precision,
        masked_scores=masked_scores,
        max_values=MAX_VALUES if max_values is None else max_values,
    )
    chunks = _page(plan, before, after, labels, comparison, atol=atol, title=title, started=started)
    return write_or_return(chunks, path, overwrite)


def _page(plan, before, after, labels, comparison, *, atol, title, started):
    """The diff page of ``plan`` as text chunks: the ranked heads, and the first divergence of ``comparison``."""
    rows_a, rows_b = plan.sources
    frame = _compare_records(rows_a, rows_b, atol)  # the stitched records once, not a second copy
    data = page_data(plan)
    rows, changes = _ranked_heads(frame, data.meta["records"])
    data.meta.update(labels=list(labels), changes=changes, flags={})
    model = before.info.get("model_class", "model")
    divergence = None
    if comparison is not None:
        from .comparison import divergence_context

        divergence = divergence_context(comparison, {(m["layer"], m["call"]): m["id"] for m in data.meta["records"]})
    return render(
        "report.html.j2",
        data_images=divergence is not None and not divergence["ok"],
        divergence=divergence,
        title=title or f"attnprobe comparison: {model}, {labels[0]} vs {labels[1]}",
        mode="diff",
        labels=labels,
        sides=[
            {"label": labels[0], "info": describe_info(before.info)},
            {"label": labels[1], "info": describe_info(after.info)},
        ],
        changed_count=int(frame["changed"].sum()),
        head_count=len(frame),
        atol=_default_atol(rows_a + rows_b) if atol is None else atol,
        **data.context,
        compare_columns=[c for c in COMPARE_SCHEMA if c != "kind"],
        compare_rows=rows,
        monitor=None,
        meta_json=script_json(data.meta),
        blobs=data.blobs,
        elapsed=time.perf_counter() - started,
    )


def _sides(before, after, labels: tuple[str, str]):
    """``(before, after, labels, comparison)``: two captures as given, or the two sides of one ``attnprobe.compare``
    result (then ``comparison``)."""
    from ..probe.analyses.compare import Comparison

    if isinstance(before, Comparison):
        if after is not None:
            raise AttnprobeError(
                "diff_html(comparison) draws the two sides of one attnprobe.compare result: pass no second capture "
                "(the file goes to path=...)"
            )
        first, second = before.aligned()
        return first, second, ("reference", "candidate") if labels == ("before", "after") else labels, before
    if after is None:
        raise AttnprobeError(
            "diff_html needs two captures (before, after) of the same model and input, or one attnprobe.compare result"
        )
    return before, after, labels, None


def _ranked_heads(frame, records_meta: list[dict]) -> tuple[list[dict], dict[str, dict]]:
    """The comparison table's rows, most changed first, each linked to its head's detail view; and per head
    (``"<record id>-<head>"``) the figures the page shows."""
    rid = {(m["layer"], m["call"]): m["id"] for m in records_meta}
    rows = []
    changes = {}
    for row in frame.to_dict("records"):
        r = rid[(row["layer"], row["call"])]
        row["target"] = f"#head-{r}-{row['head']}"
        rows.append(row)
        changes[f"{r}-{row['head']}"] = {
            "max_abs_weight_diff": page_number(row["max_abs_weight_diff"]),
            "max_abs_score_diff": page_number(row["max_abs_score_diff"]),
            "mean_tvd": page_number(row["mean_tvd"]),
            "changed": row["changed"],
        }

    def size(row) -> float:  # largest change first; scores stand in for missing weights; NaN last
        x = row["max_abs_weight_diff"]
        x = row["max_abs_score_diff"] if math.isnan(x) else x
        return -1.0 if math.isnan(x) else x

    rows.sort(key=lambda row: (not row["changed"], -size(row)))
    return rows, changes
