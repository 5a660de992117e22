"""Attention invariants: ``check`` re-derives the math of every record and names what breaks.

Each check has a stable name (``CHECKS``) and returns ``Violation`` records, one per
(record, head, batch row) that breaks it, with the offending query and key positions:

- ``finite``: no NaN or inf in weights and outputs, nor in scores at allowed positions. This one also
  looks at padded and fully masked query rows: a NaN there reaches the real rows of the next layer
  through ``0 * NaN`` (the naive ``-inf`` softmax bug), so it is never "don't care".
- ``range``: weights within [0, 1].
- ``row_sum``: every real query row sums to 1 (1 minus the sink mass where ``record.sinks`` exist).
- ``causal``: no weight on keys after the query's position (``record.query_offset`` places the queries
  of a KV-cache step; a sliding-window cache that dropped old keys holds the latest ones, and keys are
  reported by position, not cache slot; ``record.sliding_window`` also forbids keys older than the
  window), and a causal mask lets each real query attend its own position (a right-padded query whose
  own key is padding is padding, not a shifted mask). With ``causal=False`` declared, a model that
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
rounding of the scores (relative error ``expm1(2 * eps * max|score|)``). A weight on a forbidden key counts
when it exceeds ``FORBIDDEN_WEIGHT`` (correct masking gives exact zeros in every dtype) or ``atol``
when given. A check that needs a field the record lacks is skipped and says so in
``CheckResult.skipped``; it never passes silently.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import AttnprobeWarning
from .record import AttentionRecord
from .sinks import sink_mass
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

#: Query rows are checked in chunks so that no (batch, head, rows, key) temporary passes this many
#: elements (16 MiB in float32): checking a long-context capture needs a bounded amount of extra memory.
CHUNK_ELEMENTS = 1 << 22

#: Where a record's key padding came from (``_Facts.key_pad_source``).
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
    row_sum: float
    """Largest tolerated |row sum - expected|: ``atol + 2 * eps`` (rounding each weight moves a sum of
    one by at most ``eps``)."""


def tolerance(*dtypes: torch.dtype | None, atol: float | None = None, rtol: float | None = None) -> Tolerance:
    """The tolerance for values computed or stored in ``dtypes`` (the coarsest one decides)."""
    known = [d for d in dtypes if d is not None and d.is_floating_point]
    coarse = max(known, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(coarse, DEFAULT_TOLERANCES[torch.bfloat16])
    abs_tol = default_atol if atol is None else float(atol)
    eps = torch.finfo(coarse).eps / 2  # unit roundoff
    return Tolerance(
        atol=abs_tol,
        rtol=default_rtol if rtol is None else float(rtol),
        eps=eps,
        forbidden=FORBIDDEN_WEIGHT if atol is None else abs_tol,
        row_sum=abs_tol + 2 * eps,
    )


# --------------------------------------------------------------------------- declarations
def _declared_for(value, record: AttentionRecord):
    """A declaration given for every layer, or as ``{layer: value}``."""
    if isinstance(value, Mapping):
        return value.get(record.layer)
    return value


_MASK_FORM = "the input padding mask (batch, key) with 1 = real token and 0 = padding (the Hugging Face convention)"


def _mask_tensor(mask, what: str) -> torch.Tensor:
    """A declared padding mask as bool ``(batch, key)``, True = real token; a clear error for anything else."""
    if isinstance(mask, Mapping):
        hint = (" (this looks like a tokenizer's output: pass inputs['attention_mask'])"
                if "attention_mask" in mask or "input_ids" in mask else "")
        raise TypeError(f"{what} must be {_MASK_FORM}, got a {type(mask).__name__}{hint}")
    if not isinstance(mask, torch.Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what} must be {_MASK_FORM}, got a {type(mask).__name__}") from exc
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if mask.dim() != 2:
        raise ValueError(
            f"{what} must be {_MASK_FORM}, got shape {tuple(mask.shape)}; a 4-D mask is the model's own "
            "business: checks read it from the record"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or not (mask.is_floating_point() or mask.dtype in _INTEGER_DTYPES):
        raise TypeError(f"{what} must be {_MASK_FORM}, got dtype {mask.dtype}")
    values = torch.unique(mask)
    if not bool(((values == 0) | (values == 1)).all()):
        shown = ", ".join(f"{x:g}" for x in values[:6].tolist()) + (", ..." if len(values) > 6 else "")
        raise ValueError(
            f"{what} must hold 1 for real tokens and 0 for padding (or True/False), got values {shown}: pass "
            "the tokenizer's attention_mask (not input_ids, nor an additive mask of 0 and -inf)"
        )
    return mask != 0


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _validate_declarations(causal, attention_mask) -> None:
    items = causal.items() if isinstance(causal, Mapping) else [(None, causal)]
    for layer, value in items:
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise TypeError(f"causal={{layer: bool}} needs integer layer numbers (record.layer), got {layer!r}")
        if value is not None and not isinstance(value, bool):
            where = "" if layer is None else f" for layer {layer!r}"
            raise TypeError(f"causal{where} must be True, False or None (not declared), got {value!r}")
    if isinstance(attention_mask, Mapping) and not ("attention_mask" in attention_mask or "input_ids" in attention_mask):
        for layer, mask in attention_mask.items():
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise TypeError(f"attention_mask={{layer: mask}} needs integer layer numbers (record.layer), "
                                f"got {layer!r}")
            if mask is not None:
                _mask_tensor(mask, f"attention_mask[{layer}]")
    elif attention_mask is not None:
        _mask_tensor(attention_mask, "attention_mask")


def _declared_layers_exist(causal, attention_mask, records: list[AttentionRecord], stacklevel: int) -> None:
    """Warn when ``{layer: ...}`` declarations name layers no record has (a typo, or another numbering)."""
    layers = {r.layer for r in records}
    for what, value in (("causal", causal), ("attention_mask", attention_mask)):
        if isinstance(value, Mapping) and records:
            unknown = sorted(set(value) - layers)
            if unknown:
                warnings.warn(
                    f"{what} was declared for layer(s) {unknown} but the records have layers {sorted(layers)}: "
                    "those declarations were not used (layers are record.layer, counted over every attention "
                    "module of the model; a capture of some layers keeps the model's numbers)",
                    AttnprobeWarning, stacklevel=stacklevel,
                )


# --------------------------------------------------------------------------- record shapes
#: The axes of each record field (see ``attnprobe.probe.record``); "heads" = the stored query heads,
#: "heads|1" = one entry shared by the heads or one per head.
_AXES: dict[str, tuple[str, ...]] = {
    "q": ("batch", "heads", "query", "d_qk"),
    "k": ("batch", "kv_heads", "key", "d_qk"),
    "v": ("batch", "kv_heads", "key", "d_v"),
    "scores": ("batch", "heads", "query", "key"),
    "weights": ("batch", "heads", "query", "key"),
    "output": ("batch", "heads", "query", "d_v"),
    "allowed": ("batch", "heads|1", "query", "key"),
    "query_padding": ("batch", "query"),
    "sinks": ("heads",),
}


def _record_shapes(rec: AttentionRecord, index: int) -> None:
    """Raise a ValueError naming the record when its tensors disagree on a size (instead of a broadcasting
    error deep inside a check)."""
    where = f"record {index} ({rec.name!r}, layer {rec.layer}, call {rec.call})"
    sizes: dict[str, dict[int, list[str]]] = {
        "heads": {len(rec.heads): ["heads"]}, "kv_heads": {len(rec.kv_heads): ["kv_heads"]},
    }
    problems = []
    for name, axes in _AXES.items():
        t = getattr(rec, name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} is a {type(t).__name__}, not a tensor")
            continue
        if t.dim() != len(axes):
            problems.append(f"{name} has shape {tuple(t.shape)}, expected ({', '.join(axes)})")
            continue
        for axis, size in zip(axes, t.shape):
            if axis == "heads|1":
                if size == 1:
                    continue
                axis = "heads"
            sizes.setdefault(axis, {}).setdefault(int(size), []).append(name)
    for axis, seen in sizes.items():
        if len(seen) > 1:
            said = "; ".join(f"{size} in {', '.join(names)}" for size, names in seen.items())
            problems.append(f"the {axis.replace('|1', '')} sizes disagree ({said})")
    if problems:
        shapes = ", ".join(f"{f}={tuple(getattr(rec, f).shape)}" for f in _AXES
                           if isinstance(getattr(rec, f), torch.Tensor))
        raise ValueError(
            f"{where} has inconsistent tensors: {'; '.join(problems)} [{shapes}]. Every field follows the "
            "notation of attnprobe.AttentionRecord (q (batch, head, query, d_head), weights (batch, head, query, "
            "key), ...); a record edited with dataclasses.replace must change every field together "
            "(Capture.select slices them consistently)"
        )


# --------------------------------------------------------------------------- one record
class _Facts:
    """What holds for a whole record: sizes, tolerance, declarations, key padding, query positions.

    Nothing quadratic is computed here; ``_Rows(facts, a, b)`` holds the tensors of query rows ``a:b``.
    """

    def __init__(self, run: "_Run", rec: AttentionRecord, index: int) -> None:
        self.rec, self.index = rec, index
        self.B, self.Tq, self.Tk = rec.batch_size, rec.query_len, rec.key_len
        stored = [getattr(rec, f) for f in ("weights", "scores", "output", "v")]
        wide = any(t is not None and t.dtype == torch.float64 for t in stored)
        self.cdtype = torch.float64 if wide else torch.float32
        self.device = next((t.device for t in stored + [rec.allowed] if t is not None), torch.device("cpu"))
        self.tol = tolerance(rec.dtype, *(t.dtype for t in stored if t is not None), atol=run.atol, rtol=run.rtol)
        self.allowed = None if rec.allowed is None else rec.allowed.to(self.device, torch.bool)
        self.qpos = torch.arange(self.Tq, device=self.device) + rec.query_offset  # reported query positions
        self.kpos = torch.arange(self.Tk, device=self.device)  # reported key positions
        self.diag = None  # key index (cache slot) of each query (self-attention only)
        self.offset = None
        self.key_start = 0  # position of the first key: > 0 when a sliding-window cache dropped older keys
        if rec.kind == "self":
            # the queries sit at query_offset in the keys; a cache that dropped old keys (sliding window)
            # keeps the most recent ones, so the queries are then the last keys
            offset = rec.query_offset if rec.query_offset + self.Tq <= self.Tk else self.Tk - self.Tq
            if offset >= 0:
                self.offset = offset
                self.diag = torch.arange(self.Tq, device=self.device) + offset
                self.key_start = rec.key_start
                self.kpos = self.kpos + self.key_start

        self.causal = _declared_for(run.causal, rec)
        self.causal_declared = self.causal is not None
        if self.causal is None:
            self.causal = rec.causal

        self.key_pad, self.key_pad_source, declared_query_pad = self._padding(run)
        query_pad = rec.query_padding.to(self.device, torch.bool) if rec.query_padding is not None else None
        if declared_query_pad is not None:
            query_pad = declared_query_pad if query_pad is None else query_pad | declared_query_pad
        self.query_pad = query_pad  # (B, Tq) or None
        self.own, self.own_excused = self._own_position()

    def _own_position(self):
        """(may each query attend its own position, is that position a padded key): ``(B, 1 or H, Tq)`` each,
        or None without a mask. Linear in the sequence: one entry per query row."""
        if self.diag is None or self.allowed is None:
            return None, None
        own_key = self.diag.clamp(max=self.Tk - 1)
        own = self.allowed[..., torch.arange(self.Tq, device=self.device), own_key]  # (B, 1 or H, Tq)
        if self.key_pad is None:
            return own, torch.zeros_like(own)
        excused = self.key_pad[:, own_key][:, None, :].expand_as(own)  # a padded token: its row is padding too
        if self.key_pad_source == _MASK_PADDING:
            # padding read off the mask (keys no query attends) is also what a mask shifted by one gives
            # the last key; trust it only where no other row of that (batch, head) misses its own key
            real = torch.ones_like(own) if self.query_pad is None else ~self.query_pad[:, None, :]
            shifted = (~own & ~excused & real & self.allowed.any(-1)).any(-1, keepdim=True)
            excused = excused & ~shifted
        return own, excused

    def _padding(self, run: "_Run"):
        """(key padding (B, Tk) or None, where it comes from, declared query padding or None)."""
        rec = self.rec
        declared = _declared_for(run.attention_mask, rec)
        if declared is not None:
            mask = _mask_tensor(declared, "attention_mask").to(self.device)
            B, L = mask.shape
            if B != self.B:
                run.skip("padding", f"the declared attention_mask has batch {B}, the record batch {self.B}", self)
            elif rec.kind == "self" and rec.meta.get("stack") == "decoder" and not isinstance(run.attention_mask,
                                                                                            Mapping):
                # one mask for every layer of an encoder-decoder is the encoder input's; these keys are decoder tokens
                run.skip("padding", "one attention_mask declared for every layer is the encoder input's, but the "
                         "keys of a decoder self-attention are decoder tokens; declare attention_mask={layer: mask} "
                         "with the decoder's mask for these layers", self)
            elif rec.kind == "cross":
                if L == self.Tk:
                    run.mask_fitted = True
                    return ~mask, _DECLARED_PADDING, None
                run.skip("padding", f"the declared attention_mask has {L} positions but this cross-attention "
                         f"has {self.Tk} keys; pass attention_mask={{layer: mask}} per layer", self)
            elif self.offset is not None and L >= self.key_start + self.Tk:
                # positions of the whole sequence: a KV-cache step reads the positions of its keys (a
                # sliding-window cache keeps only the most recent ones); later positions are not used
                run.mask_fitted = True
                real = mask[:, self.key_start : self.key_start + self.Tk]
                return ~real, _DECLARED_PADDING, ~real[:, self.offset : self.offset + self.Tq]
            elif self.offset is not None and L == self.Tk:
                run.mask_fitted = True  # one entry per cache slot
                return ~mask, _DECLARED_PADDING, ~mask[:, self.offset : self.offset + self.Tq]
            elif self.offset is not None and not rec.query_offset and rec.step is None:
                run.skip("padding", f"the declared attention_mask has {L} positions but the record has {self.Tk} "
                         "keys", self)
            elif self.offset is not None:
                run.skip("padding", f"the declared attention_mask has {L} positions, fewer than the keys of "
                         "these records reach (KV-cache steps?); under generate, declare the mask of the whole "
                         "sequence: the prompt's mask followed by ones for the generated tokens", self)
            else:
                run.skip("padding", f"the declared attention_mask has {L} positions but the record has "
                         f"{self.Tq} queries and {self.Tk} keys, which no cache layout explains", self)
            return None, "", None
        if rec.kind == "self" and self.offset == 0 and self.Tq == self.Tk and rec.query_padding is not None:
            return rec.query_padding.to(self.device, torch.bool), _QUERY_PADDING, None
        if self.allowed is not None and (rec.kind == "cross" or (self.offset == 0 and self.Tq == self.Tk)):
            return ~self.allowed.any(1).any(1), _MASK_PADDING, None
        return None, "", None

    def chunks(self):
        """Row ranges ``(a, b)`` such that no (batch, head, rows, key) temporary passes ``CHUNK_ELEMENTS``."""
        per_row = self.B * max(len(self.rec.heads), 1) * self.Tk
        step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
        for a in range(0, self.Tq, step):
            yield a, min(a + step, self.Tq)


class _Rows:
    """Query rows ``a:b`` of one record, in compute precision, with the rows every value check looks at."""

    def __init__(self, facts: _Facts, a: int, b: int) -> None:
        rec = facts.rec
        self.rec, self.index = rec, facts.index
        self.B, self.Tq, self.Tk = facts.B, b - a, facts.Tk
        self.device, self.cdtype, self.tol = facts.device, facts.cdtype, facts.tol
        self.causal, self.causal_declared = facts.causal, facts.causal_declared
        self.key_pad, self.key_pad_source = facts.key_pad, facts.key_pad_source
        self.start, self.all_qpos = a, facts.qpos
        self.qpos = facts.qpos[a:b]
        self.diag = None if facts.diag is None else facts.diag[a:b]
        self.kpos = facts.kpos
        self.own = None if facts.own is None else facts.own[:, :, a:b]
        self.own_excused = None if facts.own_excused is None else facts.own_excused[:, :, a:b]

        def rows(t):
            return None if t is None else t[:, :, a:b]

        self.w = None if rec.weights is None else rows(rec.weights).to(self.device, self.cdtype)
        self.scores, self.output = rows(rec.scores), rows(rec.output)
        self.allowed = rows(facts.allowed)
        self.query_pad = None if facts.query_pad is None else facts.query_pad[:, a:b]

        # rows with no allowed key: under the record's own mask, or under what was declared
        self.empty_known = False
        empty = torch.zeros(self.B, 1, self.Tq, dtype=torch.bool, device=self.device)
        if self.allowed is not None:
            empty = empty | ~self.allowed.any(-1)
            self.empty_known = True
        self.declared = self._declared_allowed()
        if self.declared is not None:
            empty = empty | ~self.declared.any(-1)
            self.empty_known = True
        self.empty = empty  # (B, 1 or H, Tq)
        self.real = torch.ones_like(empty) if self.query_pad is None else ~self.query_pad[:, None, :]
        self.checked = self.real & ~empty  # (B, 1 or H, Tq): the rows every value check looks at
        self._finite_rows = None

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

    def _declared_allowed(self) -> torch.Tensor | None:
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

    def finite_rows(self) -> torch.Tensor:
        """Checked rows whose weights are all finite (non-finite ones are ``finite``'s business)."""
        if self._finite_rows is None:
            w = self.w
            self._finite_rows = self.checked if _all_finite(w) else self.checked & torch.isfinite(w).all(-1)
        return self._finite_rows


# --------------------------------------------------------------------------- the run
@dataclass
class _Group:
    """What one (batch row, head) contributes to one finding, summed over row chunks."""

    count: int = 0
    worst: float | None = None
    rows: torch.Tensor | None = None
    """(query,) bool: offending query rows of the whole record."""
    keys: torch.Tensor | None = None
    """(key,) bool: offending keys (None for findings about rows)."""

    def add(self, count: int, worst: float | None, rows: torch.Tensor, keys: torch.Tensor | None, *,
            start: int = 0, queries: int | None = None) -> None:
        """Add offending ``rows`` (query rows ``start:start + len(rows)`` of a record of ``queries`` rows)
        and ``keys``; one allocation per group, then in-place unions (a long record has many chunks)."""
        self.count += count
        if worst is not None:
            self.worst = worst if self.worst is None else max(self.worst, worst)
        if self.rows is None:
            self.rows = torch.zeros(len(rows) if queries is None else queries, dtype=torch.bool, device=rows.device)
        self.rows[start : start + len(rows)] |= rows
        if keys is not None:
            if self.keys is None:
                self.keys = keys.clone()
            else:
                self.keys |= keys


def _listed(flags: torch.Tensor | None, positions: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(the first ``MAX_POSITIONS`` flagged positions, how many are flagged)."""
    if flags is None:
        return (), 0
    where = flags.nonzero().flatten()
    return tuple(positions[where[:MAX_POSITIONS]].tolist()), int(where.numel())


@dataclass
class _Finding:
    """One kind of violation of one check in one record, per (batch, head) group."""

    rec: AttentionRecord
    check: str
    severity: str
    message: Callable[[int, float | None], str]
    axis: int  # size of the head axis of the offending tensor (1 = a mask shared by the heads)
    qpos: torch.Tensor  # (query,) reported position of each query row of the record
    kpos: torch.Tensor  # (key,) reported position of each key
    groups: dict = field(default_factory=dict)


class _Run:
    def __init__(self, *, causal, attention_mask, checks, atol, rtol) -> None:
        self.causal = causal
        self.attention_mask = attention_mask
        self.atol, self.rtol = atol, rtol
        self.selected, self.lint_names = _select(checks)
        self.findings: dict[tuple, _Finding] = {}
        self.lint: list[Violation] = []
        self.lint_seen: list[str] = []
        self.skips: dict[tuple[str, str], dict[int, int]] = {}
        self.ran_on: dict[str, set[int]] = {c: set() for c in self.selected}
        self.bidirectional: dict[int, list] = {}  # record index -> [record, later real keys, any attended]
        self.dropout_layers: dict[int, float] = {}
        self.mask_fitted = False

    def skip(self, check: str, reason: str, where) -> None:
        """Say that ``check`` could not run on the record of ``where`` (anything with ``index`` and ``rec``)."""
        if check in self.selected:
            self.skips.setdefault((check, reason), {})[where.index] = where.rec.layer

    def ran(self, check: str, p: _Rows) -> None:
        self.ran_on[check].add(p.index)

    def emit(
        self,
        p: _Rows,
        check: str,
        kind: str,
        bad: torch.Tensor,
        message: Callable[[int, float | None], str],
        *,
        values: torch.Tensor | None = None,
        severity: str = "error",
    ) -> None:
        """Add offending cells ``(B, 1 or H, Tq, Tk)`` or rows ``(B, 1 or H, Tq)`` of one kind of finding.

        ``values`` (broadcastable to ``bad``) gives the error size for ``worst``. Positions and counts
        are reduced on the tensor; Python only walks the (batch, head) groups that have any.
        """
        if not bool(bad.any()):
            return
        rec = p.rec
        if check in _DROPOUT_SENSITIVE and rec.dropout > 0:
            self.dropout_layers[rec.layer] = rec.dropout
            if rec.meta.get("dropout_in_eval"):
                why = (f"dropout p={rec.dropout:g} was applied although the module is in eval mode (the code passes "
                       "dropout_p to scaled_dot_product_attention whatever module.training is), so weights and "
                       "outputs after dropout cannot sum to one or match; pass dropout_p=0 when not training")
            else:
                why = (f"dropout p={rec.dropout:g} is active (train mode), so weights and outputs after dropout "
                       "cannot sum to one or match; call model.eval() before capturing")
            self.skip(check, why, p)
            return
        per_key = bad.dim() == 4
        finding = self.findings.setdefault(
            (p.index, check, kind),
            _Finding(rec, check, severity, message, axis=bad.shape[1], qpos=p.all_qpos, kpos=p.kpos),
        )
        flat = bad.flatten(2)
        counts = flat.sum(-1)  # (B, 1 or H)
        worst = None
        if values is not None:
            worst = torch.where(bad, values, -math.inf).flatten(2).amax(-1).tolist()
        rows = bad.any(-1) if per_key else bad  # (B, 1 or H, Tq)
        keys = bad.any(-2) if per_key else None  # (B, 1 or H, Tk)
        for b, h in (counts > 0).nonzero().tolist():
            finding.groups.setdefault((b, h), _Group()).add(
                int(counts[b, h]), None if worst is None else worst[b][h], rows[b, h],
                keys[b, h] if per_key else None, start=p.start, queries=len(p.all_qpos),
            )

    def violations(self) -> list[Violation]:
        out = []
        for finding in self.findings.values():
            rec, groups = finding.rec, finding.groups
            if len(groups) > MAX_GROUPS:  # too many batch rows to list one by one: sum them per head
                per_head: dict = {}
                for (_, h), g in groups.items():
                    per_head.setdefault((None, h), _Group()).add(g.count, g.worst, g.rows, g.keys)
                groups = per_head
            for (b, h), g in sorted(groups.items(), key=lambda kv: (-1 if kv[0][0] is None else kv[0][0], kv[0][1])):
                head = rec.heads[h] if finding.axis > 1 else (rec.heads[0] if len(rec.heads) == 1 else None)
                queries, query_count = _listed(g.rows, finding.qpos)
                keys, key_count = _listed(g.keys, finding.kpos)
                out.append(Violation(
                    check=finding.check, severity=finding.severity, name=rec.name, layer=rec.layer, head=head,
                    batch=b, call=rec.call, step=rec.step, queries=queries, keys=keys, count=g.count,
                    worst=g.worst, message=finding.message(g.count, g.worst), query_count=query_count,
                    key_count=key_count,
                ))
        for rec, later, attended in self.bidirectional.values():
            if later and not attended:
                out.append(Violation(
                    check="causal", severity="error", name=rec.name, layer=rec.layer, call=rec.call, step=rec.step,
                    count=later,
                    message="declared causal=False, but no query attends any later key: the model applied a "
                            "causal mask (is_causal left on, or a decoder mask in an encoder)",
                ))
        return out


def _select(checks) -> tuple[tuple[str, ...], str | frozenset | None]:
    """(built-in checks to run, lint selection: "all", a set of lint names, or None)."""
    if checks is None:
        return CHECKS, "all"
    if not isinstance(checks, (str, Iterable)):
        raise TypeError(f"checks must be a check name or a list of them, got {checks!r}; choose from {list(CHECKS)}")
    names = (checks,) if isinstance(checks, str) else tuple(checks)
    if not names:
        raise ValueError(f"checks={checks!r} selects nothing; leave it None for every check, or choose from "
                         f"{list(CHECKS)}")
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
        if all(isinstance(r, AttentionRecord) for r in records):
            return records, None
    raise TypeError(
        f"check() takes a Capture, an AttentionRecord or a list of records, got {type(capture_or_record).__name__}; "
        "capture first: `with attnprobe.capture(model) as cap: model(...)`, then check(cap)"
    )


# --------------------------------------------------------------------------- the checks
def _has(run: _Run, p: _Rows, check: str, *fields: str) -> bool:
    """True when the record has every field ``check`` needs; otherwise say which are missing and skip."""
    missing = [f for f in fields if getattr(p.rec, f) is None]
    if missing:
        names = ["mask (allowed)" if f == "allowed" else f for f in missing]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        run.skip(check, f"no {listed} captured", p)
    return not missing


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _all_finite(t: torch.Tensor) -> bool:
    """Fast path: a finite float32 sum means every entry is finite (an overflowing sum falls back)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)))


def _check_empty_rows(run: _Run, p: _Rows) -> None:
    if not p.empty_known:
        run.skip("empty_rows", "no mask recorded (allowed is None) and none declared", p)
        return
    run.ran("empty_rows", p)
    run.emit(p, "empty_rows", "rows", p.empty & p.real, lambda n, _: (
        f"{n} query row(s) not marked as padding have no allowed key; left out of the other checks "
        "(expected only for padded queries)"), severity="info")


def _check_finite(run: _Run, p: _Rows) -> None:
    if p.w is None and p.output is None and p.scores is None:
        run.skip("finite", "no weights, output or scores captured", p)
        return
    run.ran("finite", p)
    dont_care = ~p.checked  # padded and fully masked query rows

    def both(what: str, bad: torch.Tensor) -> None:
        rows = dont_care if bad.dim() == 3 else dont_care[..., None]
        run.emit(p, "finite", what + ":real", bad & ~rows, lambda n, _: f"{n} NaN/inf {what} in real query rows")
        run.emit(p, "finite", what + ":dont_care", bad & rows, lambda n, _: (
            f"{n} NaN/inf {what} in padded or fully masked query rows (a softmax over only -inf?): they reach "
            "real rows of the next layer through 0 * NaN; zero such rows after the softmax"))

    if p.w is not None and not _all_finite(p.w):
        both("weight(s)", ~torch.isfinite(p.w))
    if p.output is not None and not _all_finite(p.output):
        both("output row(s)", ~torch.isfinite(p.output).all(-1))
    if p.scores is not None and not _all_finite(p.scores):
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
            run.emit(p, "finite", "scores:overflow", overflow, lambda n, _: (
                f"{n} score(s) stored as inf in rows whose weights are finite and agree (no finite-score key weighs "
                "more than a +inf one or less than a -inf one): scores beyond the range of the model's dtype "
                "(float16: 65504) that the attention itself kept finite; softmax_match cannot compare those "
                "rows"), severity="info")


def _check_range(run: _Run, p: _Rows) -> None:
    if not _has(run, p, "range", "weights"):
        return
    run.ran("range", p)
    atol, w = p.tol.atol, p.w
    low, high = torch.aminmax(w)  # NaN fails both tests below and takes the long way
    if float(low) >= -atol and float(high) <= 1 + atol:
        return
    bad = ((w < -atol) | (w > 1 + atol)) & p.finite_rows()[..., None]
    run.emit(p, "range", "range", bad, lambda n, worst: f"{n} weight(s) outside [0, 1] (worst {_fmt(worst)})",
             values=torch.where(w < 0, -w, w - 1))


def _sink_logits(p: _Rows) -> torch.Tensor:
    """(B, H, Tq, 1) the sink logit of each head."""
    sinks = p.rec.sinks.to(p.device, p.cdtype).reshape(1, -1, 1, 1)
    return sinks.expand(p.B, sinks.shape[1], p.Tq, 1)


def _masked_scores(p: _Rows) -> torch.Tensor:
    """Scores with disallowed keys at -inf (NaN scores of keys never computed are disallowed too)."""
    return torch.where(p.allowed, p.scores.to(p.cdtype), -math.inf)


def _check_row_sum(run: _Run, p: _Rows) -> None:
    if not _has(run, p, "row_sum", "weights"):
        return
    expected, what = 1.0, "1"
    if p.rec.sinks is not None:
        if p.scores is None or p.allowed is None:
            run.skip("row_sum", "the record has attention sinks but no scores or mask to compute the sink mass", p)
            return
        expected = 1.0 - sink_mass(p.scores.to(p.cdtype), p.allowed, p.rec.sinks)  # (B, H, Tq)
        what = "1 - sink mass"
    run.ran("row_sum", p)
    err = (p.w.sum(-1) - expected).abs()
    tol = p.tol.row_sum
    if float(err.amax()) <= tol:  # fast path
        return
    run.emit(p, "row_sum", "row_sum", (err > tol) & p.finite_rows(), lambda n, worst: (
        f"{n} row(s) do not sum to {what} (worst error {_fmt(worst)}, tolerance {tol:.2g}): a softmax over "
        "the wrong axis, weights changed after the softmax, or dropout on the weights"), values=err)


def _check_causal(run: _Run, p: _Rows) -> None:
    rec = p.rec
    if rec.kind != "self":
        return  # causality is about self-attention
    if p.causal is None:
        run.skip("causal", "the record does not say whether it is causal; declare causal=True or False", p)
        return
    if p.diag is None:
        run.skip("causal", "query positions unknown (more queries than keys)", p)
        return
    if p.w is None and p.allowed is None:
        run.skip("causal", "no weights and no mask captured", p)
        return
    if not p.causal and not p.causal_declared:
        return  # a bidirectional record: nothing to hold it to
    run.ran("causal", p)
    source = "declared causal=True" if p.causal_declared else "the module says it is causal"
    thr = p.tol.forbidden
    future = p.future()
    rows = p.checked[..., None]
    if not p.causal:  # declared bidirectional: some query must attend some later real key
        later = future if p.key_pad is None else future & ~p.key_pad[:, None, None, :]
        # rows whose weights are NaN/inf (in any head) say nothing about what they attend (``finite`` reports them)
        candidates = later & (rows if p.w is None else (rows & p.finite_rows().all(1, keepdim=True)[..., None]))
        attended = (p.w > thr) if p.w is not None else p.allowed
        seen = run.bidirectional.setdefault(p.index, [rec, 0, False])
        seen[1] += int(candidates.sum())
        seen[2] = seen[2] or bool((attended & candidates).any())
        return
    window = p.outside_window()
    if p.w is not None:
        run.emit(p, "causal", "future", (p.w > thr) & future & rows, lambda n, worst: (
            f"weight on {n} key(s) after the query's position (max {_fmt(worst)}; {source}): the causal mask is "
            "missing or shifted"), values=p.w)
        if window is not None:
            run.emit(p, "causal", "window", (p.w > thr) & window & rows, lambda n, worst: (
                f"weight on {n} key(s) older than the sliding window of {rec.sliding_window} (max {_fmt(worst)})"),
                values=p.w)
    else:
        run.emit(p, "causal", "future", p.allowed & future & rows, lambda n, _: (
            f"the mask lets queries attend {n} key(s) after their position ({source}; no weights captured)"))
        if window is not None:
            run.emit(p, "causal", "window", p.allowed & window & rows, lambda n, _: (
                f"the mask lets queries attend {n} key(s) older than the sliding window of {rec.sliding_window}"))
    if p.own is not None:  # a causal mask lets every real query attend its own position
        bad = ~p.own & ~p.own_excused & p.checked
        run.emit(p, "causal", "own", bad, lambda n, _: (
            f"{n} query row(s) may not attend their own position: the causal mask is shifted by one "
            "(tril(diagonal=-1))"))


def _check_forbidden(run: _Run, p: _Rows, check: str, forbidden: torch.Tensor, what: str, why: str) -> None:
    """Weight (or, without weights, permission) on keys that ``forbidden`` rules out, in checked rows."""
    rows = p.checked[..., None]
    if p.w is not None:
        if float(torch.where(forbidden, p.w, 0.0).amax()) <= p.tol.forbidden:  # fast path: nothing there
            return
        run.emit(p, check, check, (p.w > p.tol.forbidden) & forbidden & rows,
                 lambda n, worst: f"weight on {n} {what} (max {_fmt(worst)}{why})", values=p.w)
    else:
        run.emit(p, check, check, p.allowed & forbidden & rows,
                 lambda n, _: f"the mask lets queries attend {n} {what} (no weights captured{why})")


def _check_padding(run: _Run, p: _Rows) -> None:
    if p.key_pad is None:
        if _declared_for(run.attention_mask, p.rec) is None:
            run.skip("padding", "no key padding known from the record; declare attention_mask=(batch, key)", p)
        return
    if p.w is None and p.allowed is None:
        run.skip("padding", "no weights and no mask captured", p)
        return
    run.ran("padding", p)
    _check_forbidden(run, p, "padding", p.key_pad[:, None, None, :], "padded key(s)",
                     f"; padding from {p.key_pad_source}")


def _check_mask(run: _Run, p: _Rows) -> None:
    if not _has(run, p, "mask", "weights", "allowed"):
        return
    run.ran("mask", p)
    _check_forbidden(run, p, "mask", ~p.allowed, "key(s) the record's own mask disallows",
                     "; the mask the module built did not reach the softmax: not applied, applied inverted, "
                     "or applied to a copy")


def _score_slack(p: _Rows) -> torch.Tensor | float:
    """Relative error the rounding of the scores can cause in the weights: ``expm1(2 * eps * max|score|)`` per row.

    Rounding moves each logit by at most ``eps * |score|`` and the row's log-normaliser by as much again,
    so ``log(weight / ref)`` stays within ``2 * eps * max|score|``: the weight within a factor ``exp`` of
    that. The exponential matters once scores are large (bf16 logits of 100 give a factor 2.2, not 1.8)."""
    if p.scores is None or p.tol.eps < 1e-6:  # negligible in fp32 and fp64
        return 0.0
    s = p.scores.to(p.cdtype).abs()
    s = torch.where(p.allowed if p.allowed is not None else torch.isfinite(s), s, 0.0).nan_to_num(0.0)
    return torch.expm1(2 * p.tol.eps * s.amax(-1, keepdim=True))


def _check_softmax_match(run: _Run, p: _Rows) -> None:
    if not _has(run, p, "softmax_match", "weights", "scores", "allowed"):
        return
    run.ran("softmax_match", p)
    logits = _masked_scores(p)
    if p.rec.sinks is not None:
        ref = torch.softmax(torch.cat([logits, _sink_logits(p)], dim=-1), dim=-1)[..., :-1]
    else:
        ref = torch.softmax(logits, dim=-1)
    diff = torch.sub(p.w, ref).abs_()
    if float(diff.amax()) <= p.tol.atol:  # fast path (NaN in rows left out fails it and goes the long way)
        return
    tol = p.tol.atol + (p.tol.rtol + _score_slack(p)) * ref
    run.emit(p, "softmax_match", "softmax_match", (diff > tol) & p.finite_rows()[..., None], lambda n, worst: (
        f"{n} weight(s) differ from the softmax of the masked scores (worst {_fmt(worst)}): the weights were "
        "not computed from these scores (scale, bias or mask applied elsewhere)"), values=diff)


def _check_output_match(run: _Run, p: _Rows) -> None:
    rec = p.rec
    if not _has(run, p, "output_match", "weights", "v", "output"):
        return
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
    v = rec.v.to(p.device, p.cdtype)
    if kv_index != list(range(v.shape[1])):
        v = v[:, kv_index]  # (B, H, Tk, D): query head h reads kv head h // group
    diff = (p.output.to(p.cdtype) - p.w @ v).abs()
    if float(diff.amax()) <= p.tol.atol:  # fast path
        return
    scale = p.w.abs() @ v.abs()  # what the rounding error of a weighted sum scales with
    tol = p.tol.atol + (p.tol.rtol + _score_slack(p)) * scale
    rows = (diff > tol).any(-1) & p.finite_rows() & torch.isfinite(p.output).all(-1)
    run.emit(p, "output_match", "output_match", rows, lambda n, w: (
        f"{n} output row(s) differ from weights @ v (worst {_fmt(w)}): the kernel computed something else "
        "than its weights say (mask dropped inside the kernel, wrong kv head for grouped-query heads, "
        "another scale, dropout)"), values=diff.amax(-1))


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


def _lint(run: _Run, rec: AttentionRecord, index: int) -> None:
    """Findings an adapter recorded at capture time (``record.meta["lint"]``), as selected."""
    findings = rec.meta.get("lint", ()) if run.lint_names is not None else ()
    for v in findings:
        if not isinstance(v, Violation):
            reason = f"a lint finding is not a Violation ({type(v).__name__})"
            run.skips.setdefault(("lint", reason), {})[index] = rec.layer
            continue
        if run.lint_names == "all" or v.check in run.lint_names:
            run.lint.append(v)
            if v.check not in run.lint_seen:
                run.lint_seen.append(v.check)


# --------------------------------------------------------------------------- public API
def check(capture_or_record, *, causal=None, attention_mask=None, checks=None, atol=None, rtol=None) -> CheckResult:
    """Check attention invariants on a ``Capture``, one ``AttentionRecord`` or a list of records.

    ``causal``: declare the self-attention causal (True) or bidirectional (False), for every layer
    or as ``{layer: bool}``; None uses each record's own flag. ``attention_mask``: the input padding
    mask ``(batch, key)``, 1 = real token (Hugging Face convention), for every layer or as
    ``{layer: mask}`` (encoder-decoder models: the encoder mask for the encoder and cross-attention
    layers). For a capture of ``generate``, declare the mask of the whole sequence (the prompt's mask
    followed by ones for the generated tokens): each KV-cache step reads the positions of its own keys,
    also when a sliding-window cache kept only the latest ones. Without declarations each record's own
    mask is the reference. Reported key positions are positions in the sequence, not cache slots. ``checks``: names from
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
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise ValueError(f"{name} must be a non-negative finite number (or None for the dtype's default, "
                             f"see DEFAULT_TOLERANCES), got {value!r}")
    records, keep = _records(capture_or_record)
    _declared_layers_exist(causal, attention_mask, records, stacklevel=3)
    run = _Run(causal=causal, attention_mask=attention_mask, checks=checks, atol=atol, rtol=rtol)
    weightless: dict[int, str] = {}
    prepared = 0
    with torch.no_grad():
        for index, rec in enumerate(records):
            _lint(run, rec, index)
            if not run.selected:
                continue
            _record_shapes(rec, index)
            if rec.batch_size is None or rec.query_len is None or rec.key_len is None:
                for c in run.selected:
                    run.skips.setdefault((c, "the record has no tensors"), {})[index] = rec.layer
                continue
            if rec.weights is None and keep is not None and "weights" in keep:
                weightless[rec.layer] = rec.backend
            facts = _Facts(run, rec, index)
            prepared += 1
            for a, b in facts.chunks():
                rows = _Rows(facts, a, b)
                for name in CHECKS:
                    if name in run.selected:
                        _RUNNERS[name](run, rows)
    if attention_mask is not None and not isinstance(attention_mask, Mapping) and prepared and not run.mask_fitted:
        shape = tuple(_mask_tensor(attention_mask, "attention_mask").shape)
        batches = sorted({r.batch_size for r in records if r.batch_size is not None})
        if shape[0] not in batches:
            raise ValueError(
                f"attention_mask has batch {shape[0]} but the records have batch {', '.join(map(str, batches))}: "
                "declare the mask of the inputs that were captured (generate with num_return_sequences or beam "
                "search repeats each row: torch.repeat_interleave(mask, n, dim=0))"
            )
        raise ValueError(
            f"attention_mask of shape {shape} fits none of the {len(records)} record(s) "
            f"(batch, key) shapes {sorted({(r.batch_size, r.key_len) for r in records})}; pass the input "
            "padding mask (batch, key), or {layer: mask} for models whose layers see different sequences"
        )
    _warn(run, records, weightless, stacklevel=3)
    skipped = tuple(
        f"{c}: {reason} ({_layer_list(list(layers.values()))})"
        for (c, reason), layers in sorted(run.skips.items(), key=lambda kv: _order(kv[0][0]))
    )
    coverage = {c: len(indices) for c, indices in run.ran_on.items()}
    for name in run.lint_seen:
        coverage[name] = sum(1 for r in records if any(getattr(v, "check", None) == name for v in r.meta.get("lint", ())))
    violations = sorted(run.violations() + run.lint,
                        key=lambda v: (v.layer if v.layer is not None else -1, v.call, _order(v.check)))
    return CheckResult(
        violations=tuple(violations),
        checks=run.selected + tuple(run.lint_seen),
        records=len(records),
        skipped=skipped,
        coverage=coverage,
    )


def _order(check: str) -> int:
    return CHECKS.index(check) if check in CHECKS else len(CHECKS)


def _layers_only(layers) -> str:
    unique = sorted(set(layers))
    shown = ", ".join(map(str, unique[:12])) + (", ..." if len(unique) > 12 else "")
    return f"layer{'s' if len(unique) > 1 else ''} {shown}"


def _layer_list(layers: list[int]) -> str:
    return f"{len(layers)} record(s), {_layers_only(layers)}"


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
            f"weights were asked for but {_layers_only(weightless)} came without them "
            f"(backend: {backends}), so range, row_sum, mask, softmax_match and output_match could not run "
            "there: that backend returns no weights. Capture through an adapter that recomputes them (the "
            "Hugging Face adapter does for sdpa) or switch the model to eager attention "
            "(model.set_attn_implementation('eager'))",
            AttnprobeWarning, stacklevel=stacklevel,
        )
    if run.dropout_layers:
        ps = ", ".join(sorted({f"{p:g}" for p in run.dropout_layers.values()}))
        warnings.warn(
            f"dropout (p={ps}) was active in {_layers_only(run.dropout_layers)}: weights and outputs "
            "after dropout cannot sum to one or match, so those failures were not reported. Call model.eval() "
            "(and pass dropout_p=0 to scaled_dot_product_attention outside training) before capturing to check them",
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
    return result.raise_if_failed()


__all__ = ["CHECKS", "CHECK_DESCRIPTIONS", "DEFAULT_TOLERANCES", "FORBIDDEN_WEIGHT", "Tolerance", "assert_invariants",
           "check", "tolerance"]
