"""Attention invariants: ``check`` re-derives the math of every record and names what breaks.

Each check has a stable name (``CHECKS``) and returns ``Violation`` records, one per
(record, head, batch row) that breaks it, with the offending query and key positions:

- ``finite``: no NaN or inf in weights and outputs, nor in scores at allowed positions. This one also
  looks at padded and fully masked query rows: a NaN there reaches the real rows of the next layer
  through ``0 * NaN`` (the naive ``-inf`` softmax bug), so it is never "don't care".
- ``range``: weights within [0, 1].
- ``row_sum``: every real query row sums to 1 (1 minus the sink mass where ``record.sinks`` exist).
- ``causal``: no weight on keys after the query's position (``record.query_offset`` places the queries
  of a KV-cache step, ``record.sliding_window`` also forbids keys older than the window), and a causal
  mask lets each real query attend its own position. With ``causal=False`` declared, a model that
  masks every later key is reported.
- ``padding``: no weight on padded keys, from the declared ``attention_mask`` or the record's own.
- ``mask``: no weight where the record's own ``allowed`` mask disallows.
- ``softmax_match``: weights equal the softmax of the masked scores (sinks included).
- ``output_match``: the per-head output equals ``weights @ v``, grouped-query heads mapped to their
  kv head. This catches a kernel that computes something else than its scores say: a mask dropped
  inside a fused kernel, a wrong grouped-query head mapping, a doubled scale, dropout left on in eval.
- ``empty_rows`` (info): real query rows with no allowed key. Such rows, and padded query rows
  (``record.query_padding`` or the declared mask), are left out of every other check but ``finite``.

Tolerances depend on the coarsest dtype involved (``DEFAULT_TOLERANCES``); matches also allow for the
rounding of the scores (relative error ``2 * eps * max|score|``). A weight on a forbidden key counts
when it exceeds ``FORBIDDEN_WEIGHT`` (correct masking gives exact zeros in every dtype) or ``atol``
when given. A check that needs a field the record lacks is skipped and says so in
``CheckResult.skipped``; it never passes silently.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import AttnprobeWarning
from .modules import key_padding_to_bool
from .record import AttentionRecord
from .violations import MAX_POSITIONS, CheckResult, InvariantError, Violation

#: Built-in checks, in the order they run and are reported.
CHECKS: tuple[str, ...] = (
    "finite", "range", "row_sum", "causal", "padding", "mask", "softmax_match", "output_match", "empty_rows",
)

#: One line per check (docs, CLI help).
CHECK_DESCRIPTIONS: dict[str, str] = {
    "finite": "no NaN/inf in weights and outputs (any row), nor in scores at allowed positions",
    "range": "weights within [0, 1]",
    "row_sum": "weights of each real query row sum to 1 (1 - sink mass with attention sinks)",
    "causal": "no weight on keys after the query's position (or outside the sliding window)",
    "padding": "no weight on padded keys (declared attention_mask, else the record's own padding)",
    "mask": "no weight where the record's own mask disallows",
    "softmax_match": "weights equal the softmax of the masked scores",
    "output_match": "per-head output equals weights @ v (grouped-query heads mapped to their kv head)",
    "empty_rows": "real query rows with no allowed key (information; left out of the other checks)",
}

#: (atol, rtol) by dtype; the coarsest dtype of the record's computation and stored tensors decides.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-7),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 4e-3),
    torch.bfloat16: (4e-3, 1.6e-2),
}

#: A weight above this on a key that may not be attended is a violation (unless ``atol`` is given).
FORBIDDEN_WEIGHT = 1e-6

#: Above this many (head, batch) groups per check and record, violations are summed over the batch.
MAX_GROUPS = 64

#: Where a record's key padding came from (``_Prepared.key_pad_source``).
_DECLARED_PADDING = "the declared attention_mask"
_QUERY_PADDING = "the record's query_padding"
_MASK_PADDING = "keys the record's mask lets no query attend"

_DROPOUT_SENSITIVE = frozenset({"range", "row_sum", "softmax_match", "output_match"})


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    eps: float
    """Unit roundoff of the coarsest dtype (used to allow for rounded scores)."""
    forbidden: float
    """Largest weight tolerated on a key that may not be attended."""


def tolerance(*dtypes: torch.dtype | None, atol: float | None = None, rtol: float | None = None) -> Tolerance:
    """The tolerance for values computed or stored in ``dtypes`` (the coarsest one decides)."""
    known = [d for d in dtypes if d is not None and d.is_floating_point]
    coarse = max(known, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(coarse, DEFAULT_TOLERANCES[torch.bfloat16])
    return Tolerance(
        atol=default_atol if atol is None else float(atol),
        rtol=default_rtol if rtol is None else float(rtol),
        eps=torch.finfo(coarse).eps / 2,
        forbidden=FORBIDDEN_WEIGHT if atol is None else float(atol),
    )


# --------------------------------------------------------------------------- declarations
def _declared_for(value, record: AttentionRecord):
    """A declaration given for every layer, or as ``{layer: value}``."""
    if isinstance(value, Mapping):
        return value.get(record.layer)
    return value


def _mask_tensor(mask, what: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what} must be a tensor (batch, key) with 1 = real token, 0 = padding") from exc
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if mask.dim() != 2:
        raise ValueError(
            f"{what} must be the input padding mask (batch, key) with 1 = real token and 0 = padding "
            f"(the Hugging Face convention), got shape {tuple(mask.shape)}; a 4-D mask is the model's own "
            "business: checks read it from the record"
        )
    return key_padding_to_bool(mask)


def _validate_declarations(causal, attention_mask) -> None:
    items = causal.items() if isinstance(causal, Mapping) else [(None, causal)]
    for layer, value in items:
        if value is not None and not isinstance(value, bool):
            where = "" if layer is None else f" for layer {layer!r}"
            raise TypeError(f"causal{where} must be True, False or None (not declared), got {value!r}")
    if isinstance(attention_mask, Mapping):
        for layer, mask in attention_mask.items():
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise TypeError(f"attention_mask={{layer: mask}} needs integer layer numbers, got {layer!r}")
            if mask is not None:
                _mask_tensor(mask, f"attention_mask[{layer}]")
    elif attention_mask is not None:
        _mask_tensor(attention_mask, "attention_mask")


# --------------------------------------------------------------------------- one record, prepared
class _Prepared:
    """The tensors of one record in compute precision, and the rows and keys that count."""

    def __init__(self, run: "_Run", rec: AttentionRecord) -> None:
        self.rec = rec
        self.B, self.Tq, self.Tk = rec.batch_size, rec.query_len, rec.key_len
        stored = [getattr(rec, f) for f in ("weights", "scores", "output", "v")]
        wide = any(t is not None and t.dtype == torch.float64 for t in stored)
        self.cdtype = torch.float64 if wide else torch.float32
        self.device = next((t.device for t in stored + [rec.allowed] if t is not None), torch.device("cpu"))
        self.w = None if rec.weights is None else rec.weights.to(self.cdtype)
        self.tol = tolerance(rec.dtype, *(t.dtype for t in stored if t is not None), atol=run.atol, rtol=run.rtol)
        self.allowed = None if rec.allowed is None else rec.allowed.to(self.device, torch.bool)
        self.qpos = torch.arange(self.Tq or 0, device=self.device) + rec.query_offset
        self.diag = None  # key index of each query (self-attention only)
        self.offset = None
        if rec.kind == "self" and self.Tq is not None and self.Tk is not None:
            offset = rec.query_offset if rec.query_offset + self.Tq <= self.Tk else self.Tk - self.Tq
            if offset >= 0:
                self.offset = offset
                self.diag = torch.arange(self.Tq, device=self.device) + offset

        self.causal = _declared_for(run.causal, rec)
        self.causal_declared = self.causal is not None
        if self.causal is None:
            self.causal = rec.causal

        self.key_pad, self.key_pad_source, declared_query_pad = self._padding(run)
        query_pad = rec.query_padding.to(self.device, torch.bool) if rec.query_padding is not None else None
        if declared_query_pad is not None:
            query_pad = declared_query_pad if query_pad is None else query_pad | declared_query_pad
        self.query_pad = query_pad

        # rows with no allowed key: under the record's own mask, or under what was declared
        self.empty_known = False
        empty = torch.zeros(self.B, 1, self.Tq, dtype=torch.bool, device=self.device)
        if self.allowed is not None:
            empty = empty | ~self.allowed.any(-1)
            self.empty_known = True
        declared = self.declared_allowed()
        if declared is not None:
            empty = empty | ~declared.any(-1)
            self.empty_known = True
        self.empty = empty  # (B, 1 or H, Tq)
        real = torch.ones_like(empty) if query_pad is None else ~query_pad[:, None, :]
        self.real = real  # (B, 1, Tq) or broadcastable
        self.checked = real & ~empty  # (B, 1 or H, Tq): rows every value check looks at
        self.finite_rows = None  # checked rows with finite weights, computed on first use

    # -- declared padding and causality ----------------------------------------------------
    def _padding(self, run: "_Run"):
        """(key padding (B, Tk) or None, where it comes from, declared query padding or None)."""
        rec = self.rec
        declared = _declared_for(run.attention_mask, rec)
        if declared is not None:
            mask = _mask_tensor(declared, "attention_mask").to(self.device)
            B, L = mask.shape
            if B != self.B:
                run.skip("padding", f"the declared attention_mask has batch {B}, the record batch {self.B}", rec)
            elif rec.kind == "cross":
                if L == self.Tk:
                    run.mask_fitted = True
                    return ~mask, _DECLARED_PADDING, None
                run.skip("padding", f"the declared attention_mask has {L} positions but this cross-attention "
                         f"has {self.Tk} keys; pass attention_mask={{layer: mask}} per layer", rec)
            elif self.offset is not None and (L == self.Tk or (L > self.Tk and self.offset + self.Tq == self.Tk)):
                run.mask_fitted = True
                real = mask[:, : self.Tk]
                return ~real, _DECLARED_PADDING, ~real[:, self.offset : self.offset + self.Tq]
            else:
                run.skip("padding", f"the declared attention_mask has {L} positions but the record has "
                         f"{self.Tk} keys (a compressed or sliding-window cache?)", rec)
            return None, "", None
        # the record's own padding
        if rec.kind == "self" and self.offset == 0 and self.Tq == self.Tk:
            if rec.query_padding is not None:
                return rec.query_padding.to(self.device, torch.bool), _QUERY_PADDING, None
        if self.allowed is not None and (rec.kind == "cross" or (self.offset == 0 and self.Tq == self.Tk)):
            return ~self.allowed.any(1).any(1), _MASK_PADDING, None
        return None, "", None

    def future(self) -> torch.Tensor:
        """(Tq, Tk) bool: key index after the query's own key index."""
        keys = torch.arange(self.Tk, device=self.device)
        return keys[None, :] > self.diag[:, None]

    def outside_window(self) -> torch.Tensor | None:
        """(Tq, Tk) bool: keys older than a causal sliding window (the window includes the query)."""
        window = self.rec.sliding_window
        if not window:
            return None
        keys = torch.arange(self.Tk, device=self.device)
        return keys[None, :] <= self.diag[:, None] - window

    def declared_allowed(self) -> torch.Tensor | None:
        """(B, 1, Tq, Tk) what the declarations allow, or None when nothing was declared."""
        allowed = None
        if self.causal_declared and self.causal and self.diag is not None:
            allowed = ~self.future()
            window = self.outside_window()
            if window is not None:
                allowed = allowed & ~window
            allowed = allowed.expand(self.B, 1, self.Tq, self.Tk)
        if self.key_pad is not None and self.key_pad_source == _DECLARED_PADDING:
            keys = ~self.key_pad[:, None, None, :]
            allowed = keys.expand(self.B, 1, self.Tq, self.Tk) if allowed is None else allowed & keys
        return allowed

    def head_label(self, index: int, axis_size: int) -> int | None:
        if axis_size == 1:
            return self.rec.heads[0] if len(self.rec.heads) == 1 else None
        return self.rec.heads[index]


# --------------------------------------------------------------------------- the run
class _Run:
    def __init__(self, *, causal, attention_mask, checks, atol, rtol) -> None:
        self.causal = causal
        self.attention_mask = attention_mask
        self.atol, self.rtol = atol, rtol
        self.selected, self.lint_names = _select(checks)
        self.violations: list[Violation] = []
        self.skips: dict[tuple[str, str], list[int]] = {}
        self.coverage: dict[str, int] = {c: 0 for c in self.selected}
        self.lint_seen: list[str] = []
        self.dropout_layers: dict[int, float] = {}
        self.mask_fitted = False

    def skip(self, check: str, reason: str, rec: AttentionRecord) -> None:
        if check in self.selected:
            self.skips.setdefault((check, reason), []).append(rec.layer)

    def ran(self, check: str) -> None:
        self.coverage[check] += 1

    # -- turning a bool tensor of offending rows/cells into Violations ------------------------
    def emit(
        self,
        p: _Prepared,
        check: str,
        bad: torch.Tensor,
        message: Callable[[int, float | None], str],
        *,
        values: torch.Tensor | None = None,
        severity: str = "error",
    ) -> None:
        """``bad``: (B, 1 or H, Tq, Tk) offending cells or (B, 1 or H, Tq) offending rows."""
        if not bool(bad.any()):
            return
        rec = p.rec
        if check in _DROPOUT_SENSITIVE and rec.dropout > 0:
            self.dropout_layers[rec.layer] = rec.dropout
            self.skip(check, f"dropout p={rec.dropout:g} is active (train mode), so weights and outputs after "
                      "dropout cannot sum to one or match; call model.eval() before capturing", rec)
            return
        per_key = bad.dim() == 4
        axis = bad.shape[1]
        if values is not None:
            values = values.expand(bad.shape)
        by_group = bad.flatten(2).any(-1)  # (B, 1 or H)
        groups = by_group.nonzero().tolist()  # [(b, h), ...]
        if len(groups) > MAX_GROUPS:  # sum over the batch rows instead
            groups = [(None, h) for h in by_group.any(0).nonzero().flatten().tolist()]
        for b, h in groups:
            cells = bad[:, h] if b is None else bad[b, h][None]  # (B or 1, Tq[, Tk])
            rows = cells.any(-1).any(0) if per_key else cells.any(0)  # (Tq,)
            queries = p.qpos[rows.nonzero().flatten()[:MAX_POSITIONS]].tolist()
            keys = cells.any(-2).any(0).nonzero().flatten()[:MAX_POSITIONS].tolist() if per_key else []
            count = int(cells.sum())
            worst = None
            if values is not None:
                picked = values[:, h] if b is None else values[b, h][None]
                worst = float(torch.where(cells, picked, -math.inf).amax())
            self.violations.append(Violation(
                check=check, severity=severity, name=rec.name, layer=rec.layer,
                head=p.head_label(h, axis), batch=b, call=rec.call, step=rec.step,
                queries=tuple(queries), keys=tuple(keys), count=count, worst=worst,
                message=message(count, worst),
            ))


def _select(checks) -> tuple[tuple[str, ...], str | frozenset | None]:
    """(built-in checks to run, lint selection: "all", a set of lint names, or None)."""
    if checks is None:
        return CHECKS, "all"
    names = (checks,) if isinstance(checks, str) else tuple(checks)
    bad = [n for n in names if not isinstance(n, str) or (n not in CHECKS and n != "lint" and not n.startswith("lint_"))]
    if bad:
        raise ValueError(
            f"unknown check name(s) {bad}; choose from {list(CHECKS)}, 'lint' (every lint_* finding) "
            "or a lint_* name"
        )
    builtin = tuple(c for c in CHECKS if c in names)
    if "lint" in names:
        lint = "all"
    else:
        lint = frozenset(n for n in names if n.startswith("lint_")) or None
    return builtin, lint


def _records(capture_or_record) -> tuple[list[AttentionRecord], tuple[str, ...] | None]:
    """The records to check, and the tensors the capture was asked to keep (None when unknown)."""
    if isinstance(capture_or_record, AttentionRecord):
        return [capture_or_record], None
    from .capture import Capture

    if isinstance(capture_or_record, Capture):
        keep = capture_or_record.info.get("selection", {}).get("keep")
        return list(capture_or_record), (tuple(keep) if keep is not None else None)
    if isinstance(capture_or_record, Iterable) and not isinstance(capture_or_record, (str, bytes, torch.Tensor)):
        records = list(capture_or_record)
        wrong = [type(r).__name__ for r in records if not isinstance(r, AttentionRecord)]
        if not wrong:
            return records, None
    raise TypeError(
        f"check() takes a Capture, an AttentionRecord or a list of records, got {type(capture_or_record).__name__}; "
        "capture first: `with attnprobe.capture(model) as cap: model(...)`, then check(cap)"
    )


# --------------------------------------------------------------------------- the checks
def _has(run: _Run, p: _Prepared, check: str, *fields: str) -> bool:
    """True when the record has every field ``check`` needs; otherwise say which are missing and skip."""
    missing = [f for f in fields if getattr(p.rec, f) is None]
    if missing:
        names = ["mask (allowed)" if f == "allowed" else f for f in missing]
        run.skip(check, f"no {' and '.join(names)} captured", p.rec)
    return not missing


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _check_empty_rows(run: _Run, p: _Prepared) -> None:
    if not p.empty_known:
        run.skip("empty_rows", "no mask recorded (allowed is None) and none declared", p.rec)
        return
    run.ran("empty_rows")
    rows = p.empty & p.real
    run.emit(p, "empty_rows", rows, lambda n, _: f"{n} query row(s) not marked as padding have no allowed key; "
             "left out of the other checks (expected only for padded queries)", severity="info")


def _all_finite(t: torch.Tensor) -> bool:
    """Fast path: a finite float32 sum means every entry is finite (an overflowing sum falls back)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)))


def _check_finite(run: _Run, p: _Prepared) -> None:
    rec = p.rec
    if rec.weights is None and rec.output is None and rec.scores is None:
        run.skip("finite", "no weights, output or scores captured", rec)
        return
    run.ran("finite")
    dont_care = ~p.checked  # padded and fully masked query rows

    def both(what: str, bad: torch.Tensor) -> None:
        rows = dont_care if bad.dim() == 3 else dont_care[..., None]
        run.emit(p, "finite", bad & ~rows, lambda n, _: f"{n} NaN/inf {what} in real query rows")
        run.emit(p, "finite", bad & rows, lambda n, _: (
            f"{n} NaN/inf {what} in padded or fully masked query rows (a softmax over only -inf?): they reach "
            "real rows of the next layer through 0 * NaN; zero such rows after the softmax"))

    if rec.weights is not None and not _all_finite(rec.weights):
        both("weight(s)", ~torch.isfinite(rec.weights))
    if rec.output is not None and not _all_finite(rec.output):
        both("output row(s)", ~torch.isfinite(rec.output).all(-1))
    if rec.scores is not None and not _all_finite(rec.scores):
        s = rec.scores
        allowed = p.allowed if p.allowed is not None else p.declared_allowed()
        if allowed is None:  # -inf may be how the scores were masked: count NaN and +inf only
            bad = torch.isnan(s) | (s == math.inf)
        else:
            bad = ~torch.isfinite(s) & allowed
        run.emit(p, "finite", bad, lambda n, _: f"{n} NaN/inf score(s) at allowed positions")


def _finite_rows(p: _Prepared) -> torch.Tensor:
    """Checked rows whose weights are all finite (non-finite ones are ``finite``'s business)."""
    if p.finite_rows is None:
        p.finite_rows = p.checked if _all_finite(p.w) else p.checked & torch.isfinite(p.w).all(-1)
    return p.finite_rows


def _check_range(run: _Run, p: _Prepared) -> None:
    if not _has(run, p, "range", "weights"):
        return
    run.ran("range")
    atol = p.tol.atol
    w = p.w
    low, high = torch.aminmax(w)  # NaN fails both tests below and takes the long way
    if float(low) >= -atol and float(high) <= 1 + atol:
        return
    bad = ((w < -atol) | (w > 1 + atol)) & _finite_rows(p)[..., None]
    run.emit(p, "range", bad, lambda n, worst: f"{n} weight(s) outside [0, 1] (worst {_fmt(worst)})",
             values=torch.where(w < 0, w, w - 1).abs() if bool(bad.any()) else None)


def _sink_logits(p: _Prepared) -> torch.Tensor:
    """(B, H, Tq, 1) the sink logit of each head."""
    sinks = p.rec.sinks.to(p.device, p.cdtype).reshape(1, -1, 1, 1)
    return sinks.expand(p.B, sinks.shape[1], p.Tq, 1)


def _masked_scores(p: _Prepared) -> torch.Tensor:
    """Scores with disallowed keys at -inf (NaN scores of keys never computed are disallowed too)."""
    return torch.where(p.allowed, p.rec.scores.to(p.cdtype), -math.inf)


def _check_row_sum(run: _Run, p: _Prepared) -> None:
    rec = p.rec
    if not _has(run, p, "row_sum", "weights"):
        return
    expected = 1.0
    what = "1"
    if rec.sinks is not None:
        if rec.scores is None or p.allowed is None:
            run.skip("row_sum", "the record has attention sinks but no scores or mask to compute the sink mass", rec)
            return
        logits = torch.cat([_masked_scores(p), _sink_logits(p)], dim=-1)
        expected = 1.0 - torch.softmax(logits, dim=-1)[..., -1]  # (B, H, Tq)
        what = "1 - sink mass"
    run.ran("row_sum")
    err = (p.w.sum(-1) - expected).abs()
    tol = p.tol.atol + p.tol.rtol
    if float(err.amax()) <= tol:  # fast path
        return
    bad = (err > tol) & _finite_rows(p)
    run.emit(p, "row_sum", bad, lambda n, worst: (
        f"{n} row(s) do not sum to {what} (worst error {_fmt(worst)}, tolerance {tol:.2g}): a softmax over "
        "the wrong axis, weights changed after the softmax, or dropout on the weights"), values=err)


def _check_causal(run: _Run, p: _Prepared) -> None:
    rec = p.rec
    if rec.kind != "self":
        return  # causality is about self-attention
    if p.causal is None:
        run.skip("causal", "the record does not say whether it is causal; declare causal=True or False", rec)
        return
    if p.diag is None:
        run.skip("causal", "query positions unknown (more queries than keys)", rec)
        return
    if p.w is None and p.allowed is None:
        run.skip("causal", "no weights and no mask captured", rec)
        return
    if not p.causal and not p.causal_declared:
        return  # a bidirectional record: nothing to hold it to
    run.ran("causal")
    source = "declared causal=True" if p.causal_declared else "the module says it is causal"
    thr = p.tol.forbidden
    future = p.future()
    rows = p.checked[..., None]
    if not p.causal:
        later = future if p.key_pad is None else future & ~p.key_pad[:, None, None, :]
        candidates = later & rows
        attended = (p.w > thr) if p.w is not None else p.allowed
        if bool(candidates.any()) and not bool((attended & candidates).any()):
            run.violations.append(Violation(
                check="causal", severity="error", name=rec.name, layer=rec.layer, call=rec.call, step=rec.step,
                count=int(candidates.sum()),
                message="declared causal=False, but no query attends any later key: the model applied a causal "
                        "mask (is_causal left on, or a decoder mask in an encoder)",
            ))
        return
    window = p.outside_window()
    if p.w is not None:
        run.emit(p, "causal", (p.w > thr) & future & rows, lambda n, worst: (
            f"weight on {n} key(s) after the query's position (max {_fmt(worst)}; {source}): the causal mask is "
            "missing or shifted"), values=p.w)
        if window is not None:
            run.emit(p, "causal", (p.w > thr) & window & rows, lambda n, worst: (
                f"weight on {n} key(s) older than the sliding window of {rec.sliding_window} (max {_fmt(worst)})"),
                values=p.w)
    else:
        run.emit(p, "causal", p.allowed & future & rows, lambda n, _: (
            f"the mask lets queries attend {n} key(s) after their position ({source}; no weights captured)"))
        if window is not None:
            run.emit(p, "causal", p.allowed & window & rows, lambda n, _: (
                f"the mask lets queries attend {n} key(s) older than the sliding window of {rec.sliding_window}"))
    if p.allowed is not None:
        inside = p.diag < p.Tk
        own = p.allowed[..., torch.arange(p.Tq, device=p.device), p.diag.clamp(max=p.Tk - 1)]  # (B, 1|H, Tq)
        bad = ~own & p.checked & inside
        if p.key_pad is not None and p.key_pad_source != _MASK_PADDING:  # a buggy mask says nothing here
            bad = bad & ~p.key_pad[:, None, :].gather(-1, p.diag.clamp(max=p.Tk - 1).expand(p.B, 1, p.Tq))
        run.emit(p, "causal", bad, lambda n, _: (
            f"{n} query row(s) may not attend their own position: the causal mask is shifted by one "
            "(tril(diagonal=-1))"))


def _check_forbidden(run: _Run, p: _Prepared, check: str, forbidden: torch.Tensor, what: str, why: str) -> None:
    """Weight (or, without weights, permission) on keys that ``forbidden`` rules out, in checked rows."""
    rows = p.checked[..., None]
    if p.w is not None:
        if float(torch.where(forbidden, p.w, 0.0).amax()) <= p.tol.forbidden:  # fast path: nothing there
            return
        run.emit(p, check, (p.w > p.tol.forbidden) & forbidden & rows,
                 lambda n, worst: f"weight on {n} {what} (max {_fmt(worst)}{why})", values=p.w)
    else:
        run.emit(p, check, p.allowed & forbidden & rows,
                 lambda n, _: f"the mask lets queries attend {n} {what} (no weights captured{why})")


def _check_padding(run: _Run, p: _Prepared) -> None:
    rec = p.rec
    if p.key_pad is None:
        if _declared_for(run.attention_mask, rec) is None:
            run.skip("padding", "no key padding known from the record; declare attention_mask=(batch, key)", rec)
        return
    if p.w is None and p.allowed is None:
        run.skip("padding", "no weights and no mask captured", rec)
        return
    run.ran("padding")
    _check_forbidden(run, p, "padding", p.key_pad[:, None, None, :], "padded key(s)",
                     f"; padding from {p.key_pad_source}")


def _check_mask(run: _Run, p: _Prepared) -> None:
    if not _has(run, p, "mask", "weights", "allowed"):
        return
    run.ran("mask")
    _check_forbidden(run, p, "mask", ~p.allowed, "key(s) the record's own mask disallows",
                     "; the mask the module built did not reach the softmax: not applied, applied inverted, "
                     "or applied to a copy")


def _score_slack(p: _Prepared) -> torch.Tensor | float:
    """Relative error the rounding of the scores can cause in the weights: 2 * eps * max|score| per row."""
    if p.rec.scores is None or p.tol.eps < 1e-6:  # negligible in fp32 and fp64
        return 0.0
    s = p.rec.scores.to(p.cdtype).abs()
    s = torch.where(p.allowed if p.allowed is not None else torch.isfinite(s), s, 0.0).nan_to_num(0.0)
    return 2 * p.tol.eps * s.amax(-1, keepdim=True)


def _check_softmax_match(run: _Run, p: _Prepared) -> None:
    rec = p.rec
    if not _has(run, p, "softmax_match", "weights", "scores", "allowed"):
        return
    run.ran("softmax_match")
    logits = _masked_scores(p)
    if rec.sinks is not None:
        ref = torch.softmax(torch.cat([logits, _sink_logits(p)], dim=-1), dim=-1)[..., :-1]
    else:
        ref = torch.softmax(logits, dim=-1)
    diff = torch.sub(p.w, ref).abs_()
    if float(diff.amax()) <= p.tol.atol:  # fast path (NaN in rows left out fails it and goes the long way)
        return
    tol = p.tol.atol + (p.tol.rtol + _score_slack(p)) * ref
    bad = (diff > tol) & _finite_rows(p)[..., None]
    run.emit(p, "softmax_match", bad, lambda n, worst: (
        f"{n} weight(s) differ from the softmax of the masked scores (worst {_fmt(worst)}): the weights were "
        "not computed from these scores (scale, bias or mask applied elsewhere)"), values=diff)


def _check_output_match(run: _Run, p: _Prepared) -> None:
    rec = p.rec
    if not _has(run, p, "output_match", "weights", "v", "output"):
        return
    if rec.num_kv_heads <= 0 or rec.num_heads % rec.num_kv_heads:
        run.skip("output_match", f"{rec.num_heads} heads do not group over {rec.num_kv_heads} kv heads", rec)
        return
    group = rec.num_heads // rec.num_kv_heads
    try:
        kv_index = [rec.kv_heads.index(h // group) for h in rec.heads]
    except ValueError:
        run.skip("output_match", "the kv heads of some stored query heads were not captured", rec)
        return
    run.ran("output_match")
    v = rec.v.to(p.device, p.cdtype)
    if kv_index != list(range(v.shape[1])):
        v = v[:, kv_index]  # (B, H, Tk, D): query head h reads kv head h // group
    ref = p.w @ v
    diff = (rec.output.to(p.cdtype) - ref).abs()
    if float(diff.amax()) <= p.tol.atol:  # fast path
        return
    scale = p.w.abs() @ v.abs()  # what the rounding error of a weighted sum scales with
    slack = _score_slack(p)
    tol = p.tol.atol + (p.tol.rtol + slack) * scale
    rows = (diff > tol).any(-1) & _finite_rows(p) & torch.isfinite(rec.output).all(-1)
    worst = diff.amax(-1)
    run.emit(p, "output_match", rows, lambda n, w: (
        f"{n} output row(s) differ from weights @ v (worst {_fmt(w)}): the kernel computed something else "
        "than its weights say (mask dropped inside the kernel, wrong kv head for grouped-query heads, "
        "another scale, dropout)"), values=worst)


_RUNNERS = {
    "empty_rows": _check_empty_rows,
    "finite": _check_finite,
    "range": _check_range,
    "row_sum": _check_row_sum,
    "causal": _check_causal,
    "padding": _check_padding,
    "mask": _check_mask,
    "softmax_match": _check_softmax_match,
    "output_match": _check_output_match,
}


def _lint(run: _Run, rec: AttentionRecord) -> None:
    findings = rec.meta.get("lint", ()) if run.lint_names is not None else ()
    for v in findings:
        if not isinstance(v, Violation):
            run.skips.setdefault(("lint", f"a lint finding is not a Violation ({type(v).__name__})"), []).append(rec.layer)
            continue
        if run.lint_names == "all" or v.check in run.lint_names:
            run.violations.append(v)
            if v.check not in run.lint_seen:
                run.lint_seen.append(v.check)


# --------------------------------------------------------------------------- public API
def check(capture_or_record, *, causal=None, attention_mask=None, checks=None, atol=None, rtol=None) -> CheckResult:
    """Check attention invariants on a ``Capture``, one ``AttentionRecord`` or a list of records.

    ``causal``: declare the self-attention causal (True) or bidirectional (False), for every layer
    or as ``{layer: bool}``; None uses each record's own flag. ``attention_mask``: the input padding
    mask ``(batch, key)``, 1 = real token (Hugging Face convention), for every layer or as
    ``{layer: mask}`` (encoder-decoder models: the encoder mask for the encoder and cross-attention
    layers). Without declarations each record's own mask is the reference. ``checks``: names from
    ``CHECKS``, ``"lint"`` or ``lint_*`` names (None = all). ``atol``/``rtol`` override the dtype
    defaults (``DEFAULT_TOLERANCES``).

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn) as cap:
        ...     _ = attn(torch.randn(2, 5, 8), attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
        >>> result = attnprobe.check(cap, causal=True)
        >>> result.ok, len(result.errors)
        (True, 0)
    """
    _validate_declarations(causal, attention_mask)
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    records, keep = _records(capture_or_record)
    run = _Run(causal=causal, attention_mask=attention_mask, checks=checks, atol=atol, rtol=rtol)
    weightless: dict[int, str] = {}
    prepared = 0
    with torch.no_grad():
        for rec in records:
            _lint(run, rec)
            if not run.selected:
                continue
            if rec.batch_size is None or rec.query_len is None or rec.key_len is None:
                for c in run.selected:
                    run.skip(c, "the record has no tensors", rec)
                continue
            if rec.weights is None and keep is not None and "weights" in keep:
                weightless[rec.layer] = rec.backend
            p = _Prepared(run, rec)
            prepared += 1
            for name in CHECKS:
                if name in run.selected:
                    _RUNNERS[name](run, p)
    if isinstance(attention_mask, torch.Tensor) and prepared and not run.mask_fitted:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} fits none of the {len(records)} record(s) "
            f"(batch, key) shapes {sorted({(r.batch_size, r.key_len) for r in records})}; pass the input "
            "padding mask (batch, key), or {layer: mask} for models whose layers see different sequences"
        )
    _warn(run, records, weightless, stacklevel=3)
    skipped = tuple(
        f"{c}: {reason} ({_layer_list(layers)})"
        for (c, reason), layers in sorted(run.skips.items(), key=lambda kv: _order(kv[0][0]))
    )
    coverage = dict(run.coverage)
    for name in run.lint_seen:
        coverage[name] = sum(1 for r in records if any(getattr(v, "check", None) == name for v in r.meta.get("lint", ())))
    return CheckResult(
        violations=tuple(sorted(run.violations, key=lambda v: (v.layer if v.layer is not None else -1, v.call,
                                                               _order(v.check)))),
        checks=run.selected + tuple(run.lint_seen),
        records=len(records),
        skipped=skipped,
        coverage=coverage,
    )


def _order(check: str) -> int:
    return CHECKS.index(check) if check in CHECKS else len(CHECKS)


def _layer_list(layers: list[int]) -> str:
    unique = sorted(set(layers))
    shown = ", ".join(map(str, unique[:12])) + (", ..." if len(unique) > 12 else "")
    return f"{len(layers)} record(s), layer{'s' if len(unique) > 1 else ''} {shown}"


def _warn(run: _Run, records: list[AttentionRecord], weightless: dict[int, str], stacklevel: int) -> None:
    if not records:
        warnings.warn(
            "nothing to check: the capture holds no attention records (the model was not called inside the "
            "`with attnprobe.capture(...)` block, or the selected layers never ran)",
            AttnprobeWarning, stacklevel=stacklevel,
        )
    if weightless:
        backends = ", ".join(sorted({b for b in weightless.values()}))
        warnings.warn(
            f"weights were asked for but layer(s) {_layer_list(list(weightless))} came without them "
            f"(backend: {backends}), so range, row_sum, mask, softmax_match and output_match could not run "
            "there: that backend returns no weights. Capture through an adapter that recomputes them (the "
            "Hugging Face adapter does for sdpa) or switch the model to eager attention "
            "(model.set_attn_implementation('eager'))",
            AttnprobeWarning, stacklevel=stacklevel,
        )
    if run.dropout_layers:
        ps = ", ".join(sorted({f"{p:g}" for p in run.dropout_layers.values()}))
        warnings.warn(
            f"dropout (p={ps}) was active in layer(s) {_layer_list(list(run.dropout_layers))}: weights and outputs "
            "after dropout cannot sum to one or match, so those failures were not reported. Call model.eval() "
            "before capturing to check them",
            AttnprobeWarning, stacklevel=stacklevel,
        )


def assert_invariants(capture_or_record, *, causal=None, attention_mask=None, checks=None, atol=None,
                      rtol=None) -> CheckResult:
    """``check`` and raise ``InvariantError`` (an AssertionError whose message is the violation table)
    when an invariant is broken, or when nothing at all could be verified. Returns the result.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn) as cap:
        ...     _ = attn(torch.randn(1, 4, 8))
        >>> attnprobe.assert_invariants(cap, causal=True).ok
        True
    """
    __tracebackhide__ = True  # pytest shows the caller's line
    result = check(capture_or_record, causal=causal, attention_mask=attention_mask, checks=checks, atol=atol, rtol=rtol)
    if not result.verified:
        raise InvariantError(result)
    return result.raise_if_failed()


__all__ = ["CHECKS", "CHECK_DESCRIPTIONS", "DEFAULT_TOLERANCES", "FORBIDDEN_WEIGHT", "Tolerance", "assert_invariants",
           "check", "tolerance"]
