"""The built-in checks, one function each, registered in the order they run and are reported.

Each runs over one ``RowBlock`` (query rows ``a:b`` of a record; a full record is a few such blocks) and
reports through ``CheckRun.emit`` / ``CheckRun.skip``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..engine.sinks import sink_mass
from . import shaped
from .blocks import RowBlock, all_finite, allowed_extent
from .declarations import declared_for
from .findings import CheckRun
from .registry import register


def _needed(run: CheckRun, p: RowBlock, check: str, *fields: str) -> tuple[torch.Tensor, ...] | None:
    """The tensors ``check`` needs, in the order asked (``weights``, ``scores``, ``allowed``, ``output``: the block's
    rows; ``v``: the record's); None, after saying which are missing and skipping, when the record lacks some."""
    tensors = {"weights": p.w, "scores": p.scores, "allowed": p.allowed, "output": p.output, "v": p.rec.v}
    got = [tensors[f] for f in fields]
    missing = [f for f, t in zip(fields, got) if t is None]
    if missing:
        names = ["mask (allowed)" if f == "allowed" else f for f in missing]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        run.skip(check, f"no {listed} captured", p)
        return None
    return tuple(t for t in got if t is not None)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


@register(
    "finite", severity="error", doc="no NaN/inf in weights and outputs (any row), nor in scores at allowed positions"
)
def check_finite(run: CheckRun, p: RowBlock) -> None:
    if p.w is None and p.output is None and p.scores is None and p.st is None:
        run.skip("finite", "no weights, output or scores captured", p)
        return
    run.ran("finite", p)
    dont_care = ~p.checked  # padded and fully masked query rows

    def both(what: str, bad: torch.Tensor) -> None:
        rows = dont_care if bad.dim() == 3 else dont_care[..., None]
        run.emit(p, "finite", what + ":real", bad & ~rows, lambda n, _: f"{n} NaN/inf {what} in real query rows")
        run.emit(
            p,
            "finite",
            what + ":dont_care",
            bad & rows,
            lambda n, _: (
                f"{n} NaN/inf {what} in padded or fully masked query rows (a softmax over only -inf?): they reach "
                "real rows of the next layer through 0 * NaN; zero such rows after the softmax"
            ),
        )

    if p.st is not None:  # statistics: one flag per row (weights, scores at allowed keys, observed output)
        both("row(s) (weights, scores at allowed keys or output)", ~p.st["finite"])
        return
    if p.w is not None and not all_finite(p.w):
        both("weight(s)", ~torch.isfinite(p.w))
    if p.output is not None and not all_finite(p.output):
        both("output row(s)", ~torch.isfinite(p.output).all(-1))
    if p.scores is not None and not all_finite(p.scores):
        s = p.scores
        allowed = p.allowed if p.allowed is not None else p.declared
        if allowed is None:  # -inf may be how the scores were masked: count NaN and +inf only
            bad = torch.isnan(s) | (s == math.inf)
        else:
            bad = ~torch.isfinite(s) & allowed
        overflow = None
        if p.w is not None and torch.finfo(s.dtype).max < torch.finfo(torch.float32).max:  # float16's narrow range
            # a score beyond the stored dtype's range (float16: 65504) is stored as inf; a softmax that saw
            # +inf gives NaN and one that saw -inf gives 0 there, as the finite score would: with finite
            # weights in the row that agree with the score's size, the inf is how the score was stored,
            # not what the attention computed
            # (the weights agree: no finite-score key weighs more than a +inf one, nor less than a -inf one)
            w, finite_w, known = p.w, torch.isfinite(p.w).all(-1, keepdim=True), torch.isfinite(s)
            if allowed is not None:
                known = known & allowed
            top = torch.where(known, w, -math.inf).amax(-1, keepdim=True)
            low = torch.where(known, w, math.inf).amin(-1, keepdim=True)
            agree = torch.where(s > 0, w >= top - p.tol.atol, w <= low + p.tol.atol)
            overflow = bad & torch.isinf(s) & finite_w & agree
            bad = bad & ~overflow
        run.emit(p, "finite", "scores", bad, lambda n, _: f"{n} NaN/inf score(s) at allowed positions")
        if overflow is not None:
            run.emit(
                p,
                "finite",
                "scores:overflow",
                overflow,
                lambda n, _: (
                    f"{n} score(s) stored as inf in rows whose weights are finite and agree (no finite-score key "
                    "weighs more than a +inf one or less than a -inf one): scores beyond the range of the model's "
                    "dtype (float16: 65504) that the attention itself kept finite; softmax_match cannot compare "
                    "those rows"
                ),
                severity="info",
            )


@register("range", severity="error", doc="weights within [0, 1]")
def check_range(run: CheckRun, p: RowBlock) -> None:
    if p.st is not None:
        run.ran("range", p)
        low, high = p.st["min_weight"], p.st["max_weight"]
        bad = ((low < -p.tol.atol) | (high > 1 + p.tol.atol)) & p.finite_rows()
        run.emit(
            p,
            "range",
            "range",
            bad,
            lambda n, worst: f"{n} row(s) with weights outside [0, 1] (worst {_fmt(worst)})",
            values=torch.maximum(-low, high - 1),
        )
        return
    needed = _needed(run, p, "range", "weights")
    if needed is None:
        return
    run.ran("range", p)
    (w,), atol = needed, p.tol.atol
    low, high = torch.aminmax(w)  # NaN fails both tests below and takes the long way
    if float(low) >= -atol and float(high) <= 1 + atol:
        return
    bad = ((w < -atol) | (w > 1 + atol)) & p.finite_rows()[..., None]
    run.emit(
        p,
        "range",
        "range",
        bad,
        lambda n, worst: f"{n} weight(s) outside [0, 1] (worst {_fmt(worst)})",
        values=torch.where(w < 0, -w, w - 1),
    )


def _sink_logits(p: RowBlock, sinks: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, 1) the sink logit of each head (``sinks`` ``(H,)``)."""
    sinks = sinks.to(p.device, p.cdtype).reshape(1, -1, 1, 1)
    return sinks.expand(p.B, sinks.shape[1], p.Tq, 1)


def _masked_scores(p: RowBlock, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, Tk) scores with disallowed keys at -inf (NaN scores of keys never computed are disallowed too)."""
    return torch.where(allowed, scores.to(p.cdtype), -math.inf)


@register(
    "row_sum", severity="error", doc="weights of each real query row sum to 1 (1 - sink mass with attention sinks)"
)
def check_row_sum(run: CheckRun, p: RowBlock) -> None:
    if p.st is not None:  # the engine measured each row against 1 - sink mass itself
        run.ran("row_sum", p)
        err, tol = p.st["row_sum_error"], p.tol.row_sum
        what = "1" if p.rec.sinks is None else "1 - sink mass"
        run.emit(
            p,
            "row_sum",
            "row_sum",
            (err > tol) & p.finite_rows(),
            lambda n, worst: (
                f"{n} row(s) do not sum to {what} (worst error {_fmt(worst)}, tolerance {tol:.2g}): a softmax over "
                "the wrong axis, weights changed after the softmax, or dropout on the weights"
            ),
            values=err,
        )
        return
    needed = _needed(run, p, "row_sum", "weights")
    if needed is None:
        return
    (w,) = needed
    expected: torch.Tensor | float = 1.0
    what = "1"
    if p.rec.sinks is not None:
        if p.scores is None or p.allowed is None:
            run.skip("row_sum", "the record has attention sinks but no scores or mask to compute the sink mass", p)
            return
        expected = 1.0 - sink_mass(p.scores.to(p.cdtype), p.allowed, p.rec.sinks)  # (B, H, Tq)
        what = "1 - sink mass"
    run.ran("row_sum", p)
    err = (w.sum(-1) - expected).abs()  # (B, H, Tq)
    tol = p.tol.row_sum
    if float(err.amax()) <= tol:  # fast path
        return
    run.emit(
        p,
        "row_sum",
        "row_sum",
        (err > tol) & p.finite_rows(),
        lambda n, worst: (
            f"{n} row(s) do not sum to {what} (worst error {_fmt(worst)}, tolerance {tol:.2g}): a softmax over "
            "the wrong axis, weights changed after the softmax, or dropout on the weights"
        ),
        values=err,
    )


@register(
    "causal", severity="error", doc="no weight on keys after the query's position (or outside the sliding window)"
)
def check_causal(run: CheckRun, p: RowBlock) -> None:
    rec = p.rec
    if rec.kind == "cross" and rec.causal and p.Tq > 1:
        _causal_cross(run, p)
    if rec.kind != "self":
        return  # causality is about self-attention
    if p.causal is None:
        run.skip("causal", "the record does not say whether it is causal; declare causal=True or False", p)
        return
    if p.diag is None:
        run.skip("causal", "query positions unknown (more queries than keys)", p)
        return
    if p.w is None and p.allowed is None and p.st is None:
        run.skip("causal", "no weights and no mask captured", p)
        return
    if not p.causal and not p.causal_declared:
        return  # a bidirectional record: nothing to hold it to
    run.ran("causal", p)
    if p.st is not None:
        _causal_from_stats(run, p, p.st, p.diag, p.causal_source)
    elif not p.causal:
        _bidirectional_seen(run, p)
    else:
        _causal_cells(run, p)
        _causal_own(run, p)


def _causal_cross(run: CheckRun, p: RowBlock) -> None:
    """A cross-attention call the kernel ran causally (sdpa's ``is_causal``, aligned to the upper left): query ``i``
    of one sequence sees the first ``i + 1`` keys of another. transformers' sdpa takes a module with no ``is_causal``
    for a causal one when no mask is given (Mllama's cross-attention, transformers #48172). Reported only where the
    kernel's mask has that shape (a module's own ``is_causal=True`` is not applied where a mask is given)."""
    rows = torch.arange(p.start, p.start + p.Tq, device=p.device)  # (rows,): each row's index in the call
    if p.allowed is None and p.st is None:
        return
    last = allowed_extent(p.allowed, p.st, p.device)[2]  # (B, 1 or H, rows): last allowed key, -1 where none
    could = p.checked & (rows < p.Tk - 1)  # rows with keys past their index to cut
    cut = could & (last <= rows)
    if not bool(could.any()) or not bool((cut | ~could).all()):  # the kernel's mask lets a row past its index
        return
    run.ran("causal", p)
    run.emit(
        p,
        "causal",
        "cross",
        cut,
        lambda n, _: (
            f"{n} query row(s) of a cross-attention call the kernel ran causally (is_causal): each query sees only "
            "as many keys of the other sequence as its own index; the module sets no is_causal=False (transformers' "
            "sdpa takes a missing one as True when no mask is given)"
        ),
    )


def _bidirectional_seen(run: CheckRun, p: RowBlock) -> None:
    """Declared bidirectional: count the later real keys the rows could attend and whether any got weight (or,
    without weights, permission); ``CheckRun.violations`` reports a record where none did."""
    future, rows = p.future(), p.checked[..., None]  # (Tq, Tk), (B, 1 or H, Tq, 1)
    later = future if p.key_pad is None else future & ~p.key_pad[:, None, None, :]
    # rows whose weights are NaN/inf (in any head) say nothing about what they attend (``finite`` reports them)
    candidates = later & (rows if p.w is None else (rows & p.finite_rows().all(1, keepdim=True)[..., None]))
    attended = (p.w > p.tol.forbidden) if p.w is not None else p.allowed
    assert attended is not None  # check_causal skips a record with neither weights nor a mask
    seen = run.bidirectional.setdefault(p.index, [p.rec, 0, False])
    seen[1] += int(candidates.sum())
    seen[2] = seen[2] or bool((attended & candidates).any())


def _causal_cells(run: CheckRun, p: RowBlock) -> None:
    """Weight (or, without weights, permission) on keys after the query's position or older than its window."""
    rec, source, thr = p.rec, p.causal_source, p.tol.forbidden
    future, window, rows = p.future(), p.outside_window(), p.checked[..., None]
    if p.w is not None:
        run.emit(
            p,
            "causal",
            "future",
            (p.w > thr) & future & rows,
            lambda n, worst: (
                f"weight on {n} key(s) after the query's position{_opened(p)} (max {_fmt(worst)}; {source}): the "
                "causal mask is missing or shifted"
            ),
            values=p.w,
        )
        if window is not None:
            run.emit(
                p,
                "causal",
                "window",
                (p.w > thr) & window & rows,
                lambda n, worst: (
                    f"weight on {n} key(s) older than the sliding window of {rec.sliding_window} (max {_fmt(worst)})"
                ),
                values=p.w,
            )
    elif p.allowed is not None:  # no weights: what the mask lets the queries attend
        run.emit(
            p,
            "causal",
            "future",
            p.allowed & future & rows,
            lambda n, _: (
                f"the mask lets queries attend {n} key(s) after their position ({source}; no weights captured)"
            ),
        )
        if window is not None:
            run.emit(
                p,
                "causal",
                "window",
                p.allowed & window & rows,
                lambda n, _: (
                    f"the mask lets queries attend {n} key(s) older than the sliding window of {rec.sliding_window}"
                ),
            )


def _opened(p: RowBlock) -> str:
    """How far the declared openings let rows see ahead, for the messages of ``causal``."""
    if not p.decl.opened():
        return ""
    return " and past what " + " and ".join(f"{o.name} ({o.source})" for o in p.decl.openings) + " opens"


def _causal_own(run: CheckRun, p: RowBlock) -> None:
    if p.own is None or p.own_excused is None or p.own_selected is None:
        return
    # a causal mask lets every real query attend its own position; one shifted by one lets none, and keeps the rest
    bad = ~p.own & ~p.own_excused & p.checked
    run.emit(
        p,
        "causal",
        "own",
        bad & ~p.own_selected,
        lambda n, _: (
            f"{n} query row(s) may not attend their own position: the causal mask is shifted by one (tril(diagonal=-1))"
        ),
    )
    run.emit(  # a mask that selects keys (top-k sparse attention, Doge's dynamic mask) may drop a row's own key
        p,
        "causal",
        "own_selected",
        bad & p.own_selected,
        lambda n, _: (
            f"{n} query row(s) may not attend their own position, where other rows may attend theirs or the mask "
            "drops other keys of the row's range too: a mask that selects keys (top-k sparse attention, a dynamic "
            "mask) does this, a causal mask does not"
        ),
        severity="info",
    )


def _causal_from_stats(
    run: CheckRun, p: RowBlock, st: Mapping[str, torch.Tensor], own: torch.Tensor, source: str
) -> None:
    """``causal`` from per-row statistics ``st``: the last key a row gives weight says "after my position" (``own``
    ``(rows,)``, each row's own key), the first key "older than the window" (``stats.WEIGHT_THRESHOLD`` decides what
    counts as weight)."""
    rec, diag = p.rec, own.view(1, 1, -1)
    first, last = st["first_key"], st["last_key"]  # (B, H, rows)
    limit = p.ahead()[:, None, :] if p.decl.opened() else diag  # (B or 1, 1, rows): the last key a row may see
    if not p.causal:  # declared bidirectional: some query must attend some later real key
        later = (p.Tk - 1 - own).clamp(min=0).view(1, 1, -1).to(torch.long)  # later keys per row
        if p.key_pad is not None:
            pad = torch.cat([torch.zeros(p.B, 1, dtype=torch.long, device=p.device), p.key_pad.long().cumsum(-1)], -1)
            later = later - (pad[:, -1:] - pad[:, (own + 1).clamp(max=p.Tk)])[:, None, :]
        candidates = p.checked & p.finite_rows().all(1, keepdim=True)
        seen = run.bidirectional.setdefault(p.index, [rec, 0, False])
        seen[1] += int((later * candidates).sum())
        seen[2] = seen[2] or bool(((last > diag) & candidates & (later > 0)).any())
        return
    run.emit(
        p,
        "causal",
        "future",
        (last > limit) & p.checked,
        lambda n, _: (
            f"{n} query row(s) put weight on keys after their position{_opened(p)} ({source}): the causal mask is "
            "missing or shifted"
        ),
    )
    if rec.sliding_window:
        old = (first >= 0) & (first <= diag - rec.sliding_window) & p.checked
        run.emit(
            p,
            "causal",
            "window",
            old,
            lambda n, _: f"{n} query row(s) put weight on keys older than the sliding window of {rec.sliding_window}",
        )
    _causal_own(run, p)


def _check_forbidden(run: CheckRun, p: RowBlock, check: str, forbidden: torch.Tensor, what: str, why: str) -> None:
    """Weight (or, without weights, permission) on keys that ``forbidden`` rules out, in checked rows."""
    rows = p.checked[..., None]
    if p.w is not None:
        if float(torch.where(forbidden, p.w, 0.0).amax()) <= p.tol.forbidden:  # fast path: nothing there
            return
        run.emit(
            p,
            check,
            check,
            (p.w > p.tol.forbidden) & forbidden & rows,
            lambda n, worst: f"weight on {n} {what} (max {_fmt(worst)}{why})",
            values=p.w,
        )
    elif p.allowed is not None:  # no weights: what the mask lets the queries attend
        run.emit(
            p,
            check,
            check,
            p.allowed & forbidden & rows,
            lambda n, _: f"the mask lets queries attend {n} {what} (no weights captured{why})",
        )


@register(
    "padding", severity="error", doc="no weight on padded keys (declared attention_mask, else the record's own padding)"
)
def check_padding(run: CheckRun, p: RowBlock) -> None:
    if p.key_pad is None:
        if declared_for(run.attention_mask, p.rec) is None:
            run.skip("padding", "no key padding known from the record; declare attention_mask=(batch, key)", p)
        return
    if p.st is not None:
        run.ran("padding", p)
        _padding_from_stats(run, p, p.st, p.key_pad)
        return
    if p.w is None and p.allowed is None:
        run.skip("padding", "no weights and no mask captured", p)
        return
    run.ran("padding", p)
    _check_forbidden(
        run, p, "padding", p.key_pad[:, None, None, :], "padded key(s)", f"; padding from {p.key_pad_source}"
    )


def _padding_from_stats(run: CheckRun, p: RowBlock, st: Mapping[str, torch.Tensor], pad: torch.Tensor) -> None:
    """Rows whose first or last attended key is padding (left and right padding), and the padded keys that got
    weight from any counted row (``key_weight``: holes in the middle too); ``st`` the block's statistics, ``pad``
    ``(B, Tk)`` the key padding."""

    def padded(key):  # (B, H, rows) -> is that key padding
        at = pad.gather(1, key.clamp(min=0).flatten(1)).view_as(key)
        return at & (key >= 0)

    rows = (padded(st["first_key"]) | padded(st["last_key"])) & p.checked
    keys = (st["key_weight"] > p.tol.forbidden) & pad[:, None, :]
    run.emit(
        p,
        "padding",
        "padding",
        rows,
        lambda n, _: f"{n} query row(s) put weight on padded keys (padding from {p.key_pad_source})",
        keys=keys,
    )


@register("mask", severity="error", doc="no weight where the record's own mask disallows")
def check_mask(run: CheckRun, p: RowBlock) -> None:
    if p.st is not None:
        run.ran("mask", p)
        bad = (p.st["masked_max"] > p.tol.forbidden) & p.checked
        run.emit(
            p,
            "mask",
            "mask",
            bad,
            lambda n, worst: (
                f"{n} query row(s) put weight on keys the record's own mask disallows (max {_fmt(worst)}): the mask "
                "the module built did not reach the softmax"
            ),
            values=p.st["masked_max"],
        )
        return
    needed = _needed(run, p, "mask", "weights", "allowed")
    if needed is None:
        return
    run.ran("mask", p)
    _, allowed = needed
    _check_forbidden(
        run,
        p,
        "mask",
        ~allowed,
        "key(s) the record's own mask disallows",
        "; the mask the module built did not reach the softmax: not applied, applied inverted, or applied to a copy",
    )


def _score_slack(p: RowBlock) -> torch.Tensor | float:
    """Relative error the rounding of the scores can cause in the weights: ``expm1(2 * eps * max|score|)`` per row.

    Rounding moves each logit by at most ``eps * |score|`` and the row's log-normaliser by as much again,
    so ``log(weight / ref)`` stays within ``2 * eps * max|score|``: the weight within a factor ``exp`` of
    that. The exponential matters once scores are large (bf16 logits of 100 give a factor 2.2, not 1.8)."""
    if p.scores is None or p.tol.eps < 1e-6:  # negligible in fp32 and fp64
        return 0.0
    s = p.scores.to(p.cdtype).abs()
    s = torch.where(p.allowed if p.allowed is not None else torch.isfinite(s), s, 0.0).nan_to_num(0.0)
    return torch.expm1(2 * p.tol.eps * s.amax(-1, keepdim=True))


@register(
    "declared",
    severity="error",
    doc="no weight outside what documents=, sliding_window=, chunk_size= and mask_fn= allow (declared, or by the "
    "model's config and inputs)",
)
def check_declared(run: CheckRun, p: RowBlock) -> None:
    shaped.declared(run, p)


@register(
    "reach",
    severity="error",
    doc="keys the declarations allow are not masked (nor given exactly zero weight the scores cannot explain)",
)
def check_reach(run: CheckRun, p: RowBlock) -> None:
    shaped.reach(run, p)


@register("softmax_match", severity="error", doc="weights equal the softmax of the masked scores")
def check_softmax_match(run: CheckRun, p: RowBlock) -> None:
    if p.st is not None:
        run.skip(
            "softmax_match",
            "statistics only: the weights were computed from the scores, so they match by "
            "construction; keep weights and scores to compare a kernel's own weights",
            p,
        )
        return
    needed = _needed(run, p, "softmax_match", "weights", "scores", "allowed")
    if needed is None:
        return
    run.ran("softmax_match", p)
    w, scores, allowed = needed
    logits = _masked_scores(p, scores, allowed)  # (B, H, Tq, Tk)
    if p.rec.sinks is not None:
        ref = torch.softmax(torch.cat([logits, _sink_logits(p, p.rec.sinks)], dim=-1), dim=-1)[..., :-1]
    else:
        ref = torch.softmax(logits, dim=-1)  # (B, H, Tq, Tk)
    diff = torch.sub(w, ref).abs_()  # (B, H, Tq, Tk)
    if float(diff.amax()) <= p.tol.atol:  # fast path (NaN in rows left out fails it and goes the long way)
        return
    tol = p.tol.atol + (p.tol.rtol + _score_slack(p)) * ref
    run.emit(
        p,
        "softmax_match",
        "softmax_match",
        (diff > tol) & p.finite_rows()[..., None],
        lambda n, worst: (
            f"{n} weight(s) differ from the softmax of the masked scores (worst {_fmt(worst)}): the weights were "
            "not computed from these scores (scale, bias or mask applied elsewhere)"
        ),
        values=diff,
    )


@register(
    "output_match",
    severity="error",
    doc="per-head output equals weights @ v (grouped-query heads mapped to their kv head)",
)
def check_output_match(run: CheckRun, p: RowBlock) -> None:
    rec = p.rec
    if p.st is not None:
        err, scale = p.st["output_error"], p.st["output_scale"]
        if bool(torch.isnan(scale).all()):
            run.skip("output_match", "statistics only and the adapter observed no output", p)
            return
        run.ran("output_match", p)
        slack = 0.0 if p.tol.eps < 1e-6 else torch.expm1(2 * p.tol.eps * p.st["max_score"].abs().nan_to_num(0.0))
        bad = (err > p.tol.atol + (p.tol.rtol + slack) * scale) & p.finite_rows() & torch.isfinite(err)
        run.emit(
            p,
            "output_match",
            "output_match",
            bad,
            lambda n, w: (
                f"{n} output row(s) differ from weights @ v (worst {_fmt(w)}): the kernel computed something else "
                "than its weights say (mask dropped inside the kernel, wrong kv head for grouped-query heads, "
                "another scale, dropout)"
            ),
            values=err,
        )
        return
    needed = _needed(run, p, "output_match", "weights", "v", "output")
    if needed is None:
        return
    w, v, output = needed
    if rec.num_kv_heads <= 0 or rec.num_heads % rec.num_kv_heads:
        run.skip("output_match", f"{rec.num_heads} heads do not group over {rec.num_kv_heads} kv heads", p)
        return
    group = rec.num_heads // rec.num_kv_heads
    try:
        kv_index = [rec.kv_heads.index(h // group) for h in rec.heads]
    except ValueError:
        run.skip("output_match", "the kv heads of some stored query heads were not captured", p)
        return
    run.ran("output_match", p)
    v = v.to(p.device, p.cdtype)  # (B, KV, Tk, D)
    if kv_index != list(range(v.shape[1])):
        v = v[:, kv_index]  # (B, H, Tk, D): query head h reads kv head h // group
    diff = (output.to(p.cdtype) - w @ v).abs()  # (B, H, Tq, D)
    if float(diff.amax()) <= p.tol.atol:  # fast path
        return
    scale = w.abs() @ v.abs()  # (B, H, Tq, D): what the rounding error of a weighted sum scales with
    tol = p.tol.atol + (p.tol.rtol + _score_slack(p)) * scale
    rows = (diff > tol).any(-1) & p.finite_rows() & torch.isfinite(output).all(-1)
    run.emit(
        p,
        "output_match",
        "output_match",
        rows,
        lambda n, w: (
            f"{n} output row(s) differ from weights @ v (worst {_fmt(w)}): the kernel computed something else "
            "than its weights say (mask dropped inside the kernel, wrong kv head for grouped-query heads, "
            "another scale, dropout)"
        ),
        values=diff.amax(-1),
    )


@register(
    "scale",
    severity="error",
    doc="the effective softmax scale (the kernel's, times any factor q and k got after their projections) is the "
    "declared one (a warning where only the config says so)",
)
def check_scale(run: CheckRun, p: RowBlock) -> None:
    shaped.scale(run, p)


@register(
    "empty_rows", severity="info", doc="real query rows with no allowed key (information; left out of the other checks)"
)
def check_empty_rows(run: CheckRun, p: RowBlock) -> None:
    if not p.empty_known:
        run.skip("empty_rows", "no mask recorded (allowed is None) and none declared", p)
        return
    run.ran("empty_rows", p)
    rows = p.empty & p.real
    if p.query_pad is not None and p.own_excused is not None:
        # a token the model's mask (or the declared one) says is real may attend its own position, whatever else
        # the mask forbids: a row that may attend no key at all is a mask that drops it (MiniMax's decode mask)
        dropped = rows & ~p.own_excused
        run.emit(
            p,
            "empty_rows",
            "dropped",
            dropped,
            lambda n, _: (
                f"{n} query row(s) of real tokens (by the attention mask) may attend no key, not even their own "
                "position: the mask drops the whole row"
            ),
            severity="error",
        )
        rows = rows & ~dropped
    run.emit(
        p,
        "empty_rows",
        "rows",
        rows,
        lambda n, _: (
            f"{n} query row(s) not marked as padding have no allowed key; left out of the other checks "
            "(expected only for padded queries)"
        ),
        severity="info",
    )
