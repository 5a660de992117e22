"""The checks of what the attention should be (``declared``, ``reach``, ``scale``), on full tensors and on per-row
statistics. The registered functions in ``builtin.py`` call these; ``predicate.py`` says what is declared."""

from __future__ import annotations

import math

import torch

from .blocks import RowBlock
from .findings import CheckRun
from .intervals import Allowed, keys_of, leaks_in_blocks, missing_in_blocks, missing_in_interval
from .predicate import Bound
from .violations import Violation

#: What each bound confines a row to, in findings.
_WHAT = {
    "documents": "the query's own document",
    "sliding_window": "the query's sliding window",
    "chunk_size": "the query's own chunk",
}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _rows(p: RowBlock, t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(batch or 1, query)`` of the whole record, at this block's rows."""
    return t[:, p.start : p.start + p.Tq]


# --------------------------------------------------------------------------------------------------- declared
def declared(run: CheckRun, p: RowBlock) -> None:
    """Weight where a bound (documents, window, chunk) or ``mask_fn`` forbids, each finding naming its declaration."""
    decl = p.decl
    if not decl.bounds and decl.mask_fn is None:
        return
    if p.st is not None:
        _declared_from_stats(run, p)
        return
    if p.w is None and p.allowed is None:
        run.skip("declared", "no weights and no mask captured", p)
        return
    run.ran("declared", p)
    keys = torch.arange(p.Tk, device=p.device)
    for bound in decl.bounds:
        lo, hi = _rows(p, bound.lo), _rows(p, bound.hi)
        outside = ((keys < lo[..., None]) | (keys > hi[..., None]))[:, None]  # (batch or 1, 1, rows, key)
        _weight_where(run, p, bound.name, outside, f"{_WHAT[bound.name]} ({bound.source})")
    if decl.mask_fn is not None:
        outside = ~decl.mask_fn_block(p.start, p.start + p.Tq, 0, p.Tk, p.rec.heads)
        _weight_where(run, p, "mask_fn", outside, "what mask_fn allows (declared mask_fn=)")


def _weight_where(run: CheckRun, p: RowBlock, kind: str, forbidden: torch.Tensor, what: str) -> None:
    """Weight (or, without weights, permission) on ``forbidden`` keys ``(batch or 1, 1 or head, rows, key)``."""
    rows = p.checked[..., None]
    if p.w is not None:
        run.emit(
            p,
            "declared",
            kind,
            (p.w > p.tol.forbidden) & forbidden & rows,
            lambda n, worst: f"weight on {n} key(s) outside {what} (max {_fmt(worst)})",
            values=p.w,
        )
    elif p.allowed is not None:
        run.emit(
            p,
            "declared",
            kind,
            p.allowed & forbidden & rows,
            lambda n, _: f"the mask lets queries attend {n} key(s) outside {what} (no weights captured)",
        )


def _declared_from_stats(run: CheckRun, p: RowBlock) -> None:
    """Rows whose first or last key with weight lies outside a bound; ``mask_fn`` block by block."""
    st, decl = p.st, p.decl
    assert st is not None
    run.ran("declared", p)
    first, last = st["first_key"], st["last_key"]  # (B, H, rows)
    for bound in decl.bounds:
        lo, hi = _rows(p, bound.lo)[:, None, :], _rows(p, bound.hi)[:, None, :]  # (B or 1, 1, rows)
        bad = (first >= 0) & ((first < lo) | (last > hi)) & p.checked
        _row_finding(run, p, bound, bad)
    if decl.mask_fn is None:
        return
    if "first_allowed" not in st:
        run.skip("declared", "statistics captured before first_allowed/last_allowed existed: mask_fn not checked", p)
        return
    allowed = Allowed(st, p.key_pad)
    leak, undecided = leaks_in_blocks(st, allowed, lambda a, b: decl.mask_fn_block(a, b, 0, p.Tk, p.rec.heads), p.Tq)
    run.emit(
        p,
        "declared",
        "mask_fn",
        leak & p.checked,
        lambda n, _: f"{n} query row(s) put weight on keys outside what mask_fn allows (declared mask_fn=)",
    )
    _undecided(run, p, "declared", undecided & p.checked)


def _row_finding(run: CheckRun, p: RowBlock, bound: Bound, bad: torch.Tensor) -> None:
    run.emit(
        p,
        "declared",
        bound.name,
        bad,
        lambda n, _: f"{n} query row(s) put weight on keys outside {_WHAT[bound.name]} ({bound.source})",
    )


def _undecided(run: CheckRun, p: RowBlock, check: str, rows: torch.Tensor) -> None:
    n = int(rows.sum())
    if n:
        run.skip(
            check,
            f"statistics cannot decide {n} row(s) whose mask has holes no padding explains; capture weights "
            "(keep=('weights',)) to check them",
            p,
        )


# ------------------------------------------------------------------------------------------------------ reach
def _scope(p: RowBlock) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``(lo, hi, all)`` ``(batch or 1, rows)``: the keys ``reach`` holds rows to: everything declared where the user
    declared a shape for this layer (``all``), else only the keys an unasked opening (image block) lets a row see
    ahead; None when nothing says which keys a row must see."""
    decl = p.decl
    if decl.own is None or not (decl.user_shapes or decl.opened()):
        return None
    lo, hi = decl.interval(p.start, p.start + p.Tq, reach=True)
    if decl.user_shapes:
        return lo, hi, True
    own = p.own_keys()[None, :]  # (1, rows)
    return torch.maximum(lo, own + 1), hi, False


def reach(run: CheckRun, p: RowBlock) -> None:
    """Keys the declarations allow that the record masked (or gave exactly zero weight its scores cannot explain)."""
    scope = _scope(p)
    if scope is None:
        return
    if p.st is not None:
        _reach_from_stats(run, p, scope)
        return
    if p.w is None and p.allowed is None:
        run.skip("reach", "no weights and no mask captured", p)
        return
    run.ran("reach", p)
    lo, hi, everything = scope
    decl, keys = p.decl, torch.arange(p.Tk, device=p.device)
    want = ((keys >= lo[..., None]) & (keys <= hi[..., None]))[:, None]  # (batch or 1, 1, rows, key)
    if decl.mask_fn is not None and everything:
        want = want & decl.mask_fn_block(p.start, p.start + p.Tq, 0, p.Tk, p.rec.heads)
    if p.key_pad is not None:
        want = want & ~p.key_pad[:, None, None, :]
    want = want & p.real[..., None]
    ahead = keys > p.own_keys()[:, None]  # (rows, key)
    if p.allowed is not None:
        masked = want & ~p.allowed  # (batch, 1 or head, rows, key)
        _reach_emit(run, p, "ahead", masked & ahead, everything)
        _reach_emit(run, p, "behind", masked & ~ahead, everything)
    if p.w is not None and p.scores is not None:
        allowed = p.allowed if p.allowed is not None else torch.isfinite(p.scores)
        zero = want & allowed & (p.w == 0) & _should_weigh(p, allowed)
        _reach_emit(run, p, "zero", zero, everything)


def _should_weigh(p: RowBlock, allowed: torch.Tensor) -> torch.Tensor:
    """``(batch, head, rows, key)``: keys whose score is close enough to the row's largest allowed one that a softmax
    in the weights' dtype cannot round their weight to 0 (``exp(s - max) / keys`` above the smallest normal)."""
    assert p.scores is not None
    s = p.scores.to(p.cdtype)  # (batch, head, rows, key)
    top = torch.where(allowed, s, -math.inf).amax(-1, keepdim=True)  # (batch, head, rows, 1)
    dtype = p.w.dtype if p.w is not None else p.cdtype
    floor = math.log(torch.finfo(dtype).tiny) + math.log(max(p.Tk, 1)) + 1.0
    return (s - top) > floor


def _reach_emit(run: CheckRun, p: RowBlock, kind: str, bad: torch.Tensor, everything: bool) -> None:
    decl = p.decl
    opened = " and ".join(f"{o.name} ({o.source})" for o in decl.openings) or (
        "causal=False" if not decl.causal else "the declarations"
    )
    said = decl.names(users_only=False) or decl.causal_source
    messages = {
        "ahead": lambda n, _: (
            f"{n} key(s) after the query that {opened} lets it see were masked: the mask the model built is "
            "stricter than declared (an opening that never reached attention)"
        ),
        "behind": lambda n, _: (
            f"{n} key(s) up to the query that the declarations allow ({said}) were masked: the mask the model "
            "built is stricter than declared"
        ),
        "zero": lambda n, _: (
            f"{n} key(s) the declarations and the record's own mask allow got exactly zero weight although their "
            "scores are close to the row's largest: the kernel masked them elsewhere"
        ),
    }
    run.emit(p, "reach", kind, bad, messages[kind])


def _reach_from_stats(run: CheckRun, p: RowBlock, scope: tuple[torch.Tensor, torch.Tensor, bool]) -> None:
    st, decl = p.st, p.decl
    assert st is not None
    if "first_allowed" not in st:
        run.skip("reach", "statistics captured before first_allowed/last_allowed existed", p)
        return
    run.ran("reach", p)
    lo, hi, everything = scope
    allowed = Allowed(st, p.key_pad)
    keep = keys_of(p.key_pad, p.B, p.Tk, p.device)  # (B, 1, key)
    own = p.own_keys()[None, None, :]  # (1, 1, rows)
    lo, hi = lo[:, None, :], hi[:, None, :]  # (B or 1, 1, rows)
    if decl.mask_fn is not None and everything:
        keys = torch.arange(p.Tk, device=p.device)

        def want(a: int, b: int) -> torch.Tensor:
            inside = (keys >= lo[..., a:b, None]) & (keys <= hi[..., a:b, None])  # (B or 1, 1, rows, key)
            return inside & decl.mask_fn_block(a, b, 0, p.Tk, p.rec.heads)

        missing, undecided = missing_in_blocks(allowed, want, keep, p.Tq)
        _reach_emit(run, p, "behind", (missing > 0) & p.real, everything)
    else:
        undecided = torch.zeros_like(allowed.exact)
        for kind, a, b in (("ahead", torch.maximum(lo, own + 1), hi), ("behind", lo, torch.minimum(hi, own))):
            missing, unsure = missing_in_interval(allowed, keep, a, b)
            _reach_emit(run, p, kind, (missing > 0) & p.real, everything)
            undecided |= unsure
    _undecided(run, p, "reach", undecided & p.real)


# ------------------------------------------------------------------------------------------------------ scale
def effective_scale(rec) -> tuple[float, str]:
    """``(scale, how)``: the factor the logits got over the projections' ``q @ k``: the kernel's ``scaling`` times
    the factor q and k were multiplied by after their projections (``record.meta["projection_scale"]``, measured by
    the adapter from the projections' outputs), and how that was known."""
    scaling = float(rec.scaling)
    measured = rec.meta.get("projection_scale")
    if not isinstance(measured, dict):
        return scaling, f"the kernel's scaling {scaling:.4g} (the projections were not observed)"
    factor, said = 1.0, []
    for side in ("q", "k"):
        f = measured.get(side)
        if f is None:
            said.append(f"{side} is no multiple of its projection's output (a norm between them?): not measured")
        elif not math.isclose(f, 1.0, rel_tol=1e-4):
            factor *= f
            said.append(f"{side} was multiplied by {f:.4g} after {measured.get(side + '_proj', 'its projection')}")
    how = f"the kernel's scaling {scaling:.4g}" + (f", and {'; '.join(said)}" if said else "")
    return scaling * factor, how


def scale(run: CheckRun, p: RowBlock) -> None:
    """The effective softmax scale against the declared one (once per record)."""
    declared = p.decl.scale
    if declared is None or p.start != 0:
        return
    values, source, user = declared
    rec = p.rec
    if rec.scaling is None:
        run.skip("scale", "the record does not say the scaling its kernel applied", p)
        return
    effective, how = effective_scale(rec)
    if not effective > 0 or not math.isfinite(effective):
        run.skip("scale", f"the effective scale could not be measured ({how})", p)
        return
    run.ran("scale", p)
    if any(math.isclose(effective, v, rel_tol=1e-3) for v in values):
        return
    value = min(values, key=lambda v: abs(math.log(v / effective)))
    run.extra.append(
        Violation(
            check="scale",
            severity="error" if user else "warning",
            name=rec.name,
            layer=rec.layer,
            call=rec.call,
            step=rec.step,
            count=1,
            worst=effective,
            message=f"effective softmax scale {effective:.4g} ({how}) but {source}"
            + (f" {value:.4g}" if user else "")
            + ": "
            + ("q or k scaled twice?" if effective < value else "a scale left out?"),
        )
    )
