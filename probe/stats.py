"""Per-row attention statistics without a ``(query x key)`` tensor: the statistics engine.

``attention_stats(call)`` computes, for every selected head and every query row of one attention call
(``probe.attention_math.AttentionCall``), the statistics below, block by block: query rows in blocks,
and keys in blocks too when one row is too long for the byte target, with a running max (flash-style:
pass 1 finds each row's log-normaliser, pass 2 turns each block into exact weights). No tensor larger
than one block (``block_bytes``) is ever made, so memory grows as ``T``, not ``T^2``.

``stats_from_weights(...)`` computes the same statistics from full tensors (a full capture's weights),
through the same accumulator: the reference the engine is tested against, and how a full record gets
statistics.

Per ``(batch, head, query)`` (``ROW_STATS``):

- ``entropy``: ``-sum w log w`` over the keys (nats);
- ``max_weight``, ``min_weight``, ``argmax_key`` (key index; the first one on ties);
- ``first_key_mass`` (key index 0), ``diagonal_mass`` (the query's own key), ``previous_mass`` (the key
  before it); NaN where that key does not exist (cross-attention, the first query);
- ``masked_mass``, ``masked_max``: weight on keys the call's own mask forbids (sum, largest);
- ``row_sum_error``: ``|sum w - expected|``, expected 1, or 1 minus the sink mass with attention sinks;
- ``max_score``: the largest logit at an allowed key (``-inf`` when none is allowed);
- ``finite``: no NaN/inf weight, no NaN/inf logit at an allowed key, and a finite observed output row;
- ``output_error``: ``max |weights @ v - observed output|`` over the row (where the output was observed),
  ``output_scale``: ``max (|weights| @ |v|)`` over the row (what its rounding error scales with);
- ``first_key``, ``last_key``: the first and last key index whose weight exceeds ``WEIGHT_THRESHOLD``
  (-1 when none: what causal and sliding-window verdicts need);
- ``allowed_keys``: how many keys the call's mask lets the row attend (0 = an empty row);
- ``diagonal_allowed``: whether the mask lets the query attend its own key.

Per ``(batch, head, key)`` (``KEY_STATS``): ``key_weight``, the weight summed over the query rows that
count (not padding, not empty), and ``key_allowed``, whether any query may attend the key (padding
verdicts). Everything is O(T).
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping

import torch

from .attention_math import AttentionCall, sink_logsumexp

#: Statistics with one value per (batch, head, query), in order.
ROW_STATS: tuple[str, ...] = (
    "entropy", "max_weight", "min_weight", "argmax_key", "first_key_mass", "diagonal_mass", "previous_mass",
    "masked_mass", "masked_max", "row_sum_error", "max_score", "finite", "output_error", "output_scale",
    "first_key", "last_key", "allowed_keys", "diagonal_allowed",
)
#: Statistics with one value per (batch, head, key).
KEY_STATS: tuple[str, ...] = ("key_weight", "key_allowed")

#: A weight above this counts as attention for ``first_key``/``last_key`` (the checks' ``FORBIDDEN_WEIGHT``).
WEIGHT_THRESHOLD = 1e-6

#: Default memory target of one block: the largest (batch, head, rows, keys) temporary is about this size.
DEFAULT_BLOCK_BYTES = 32 << 20

#: How many (rows, keys) float temporaries one block of the engine holds at once.
_TEMPORARIES = 4


class _Rows:
    """Statistics of query rows ``a:b`` accumulated over key blocks (one accumulator, two sources: the
    engine's exact weights, or a full capture's weights)."""

    def __init__(self, B: int, h: int, a: int, b: int, Tk: int, *, diag_offset: int | None, device, dtype,
                 dv: int | None) -> None:
        n = b - a
        self.a, self.b, self.Tk = a, b, Tk
        z = torch.zeros(B, h, n, device=device, dtype=dtype)
        self.sum, self.entropy, self.masked_mass = z.clone(), z.clone(), z.clone()
        self.max = torch.full_like(z, -math.inf)
        self.min = torch.full_like(z, math.inf)
        self.masked_max = torch.zeros_like(z)
        self.argmax = torch.zeros(B, h, n, dtype=torch.long, device=device)
        self.first = torch.full((B, h, n), Tk, dtype=torch.long, device=device)
        self.last = torch.full((B, h, n), -1, dtype=torch.long, device=device)
        self.allowed_keys = torch.zeros(B, h, n, dtype=torch.long, device=device)
        nan = torch.full_like(z, math.nan)
        self.first_mass, self.diag_mass, self.prev_mass = nan.clone(), nan.clone(), nan.clone()
        self.diag_allowed = torch.zeros(B, h, n, dtype=torch.bool, device=device)
        self.max_score = torch.full_like(z, -math.inf)
        self.min_score = torch.full_like(z, math.inf)
        # key index of each row's own key (self-attention), else None
        self.diag = None if diag_offset is None else torch.arange(a, b, device=device) + diag_offset
        self.out = None if dv is None else torch.zeros(B, h, n, dv, device=device, dtype=dtype)
        self.scale = None if dv is None else torch.zeros(B, h, n, dv, device=device, dtype=dtype)

    def _at(self, t: torch.Tensor, key: torch.Tensor | int, c: int, d: int, out: torch.Tensor) -> None:
        """``out[..., i] = t[..., i, key_i]`` for rows whose key ``key_i`` lies in ``c:d``."""
        if isinstance(key, int):
            if c <= key < d:
                out.copy_(t[..., key - c])
            return
        inside = (key >= c) & (key < d)
        if bool(inside.any()):
            got = t.gather(-1, (key - c).clamp(0, d - c - 1).view(1, 1, -1, 1).expand(*t.shape[:3], 1))[..., 0]
            out.copy_(torch.where(inside, got, out))

    def add(self, w: torch.Tensor, c: int, *, scores: torch.Tensor | None, allowed: torch.Tensor | None,
            v: torch.Tensor | None, exact_zero_outside: bool) -> None:
        """Fold in keys ``c:c + w.shape[-1]``: weights ``w`` ``(B, h, rows, keys)``, the logits ``scores`` (None:
        unknown), ``allowed`` (None: every key allowed). ``exact_zero_outside``: the weights are 0 at every
        forbidden key by construction (the engine's softmax), so the masked sums need no pass."""
        d = c + w.shape[-1]
        keys = torch.arange(c, d, device=w.device)
        self.sum += w.sum(-1)
        self.entropy -= torch.special.xlogy(w, w).sum(-1)
        bmax, barg = w.max(-1)
        better = bmax > self.max  # strict: the first key keeps a tie
        self.argmax = torch.where(better, barg + c, self.argmax)
        self.max = torch.maximum(self.max, bmax)  # NaN propagates
        self.min = torch.minimum(self.min, w.amin(-1))
        hit = w > WEIGHT_THRESHOLD
        self.first = torch.minimum(self.first, torch.where(hit, keys, self.Tk).amin(-1))
        self.last = torch.maximum(self.last, torch.where(hit, keys, -1).amax(-1))
        self._at(w, 0, c, d, self.first_mass)
        if self.diag is not None:
            self._at(w, self.diag, c, d, self.diag_mass)
            self._at(w, self.diag - 1, c, d, self.prev_mass)
        if allowed is None:
            self.allowed_keys += d - c
            if self.diag is not None:
                self.diag_allowed |= ((self.diag >= c) & (self.diag < d)).view(1, 1, -1)
        else:
            allowed = allowed.expand(*w.shape[:2], *allowed.shape[2:]) if allowed.shape[1] != w.shape[1] else allowed
            self.allowed_keys += allowed.sum(-1).expand_as(self.allowed_keys)
            if self.diag is not None:
                got = torch.zeros_like(self.diag_allowed)
                self._at(allowed.expand(*w.shape), self.diag, c, d, got)
                self.diag_allowed |= got
            if not exact_zero_outside:
                outside = torch.where(allowed, 0.0, w)
                self.masked_mass += outside.sum(-1)
                self.masked_max = torch.maximum(self.masked_max, outside.amax(-1))
        if scores is not None:
            if allowed is None:
                self.max_score = torch.maximum(self.max_score, scores.amax(-1))
                self.min_score = torch.minimum(self.min_score, scores.amin(-1))
            else:
                self.max_score = torch.maximum(self.max_score, torch.where(allowed, scores, -math.inf).amax(-1))
                self.min_score = torch.minimum(self.min_score, torch.where(allowed, scores, math.inf).amin(-1))
        if v is not None and self.out is not None:
            vb = v[:, :, c:d].to(w.dtype)
            self.out += w @ vb
            self.scale += w.abs() @ vb.abs()

    def finish(self, *, expected: torch.Tensor | float, output: torch.Tensor | None, scores_known: bool,
               empty_uniform: bool = False) -> dict[str, torch.Tensor]:
        empty = self.allowed_keys == 0
        finite = torch.isfinite(self.sum) & torch.isfinite(self.max) & torch.isfinite(self.min)
        if scores_known:
            # a NaN/inf logit at an allowed key (the "-inf at an allowed key" signal comes from the min)
            finite &= empty | (torch.isfinite(self.max_score) & torch.isfinite(self.min_score))
        out = {
            "entropy": self.entropy, "max_weight": self.max, "min_weight": self.min, "argmax_key": self.argmax,
            "first_key_mass": self.first_mass, "diagonal_mass": self.diag_mass, "previous_mass": self.prev_mass,
            "masked_mass": self.masked_mass, "masked_max": self.masked_max,
            "row_sum_error": (self.sum - expected).abs(),
            "max_score": self.max_score if scores_known else torch.full_like(self.max, math.nan),
            "first_key": torch.where(self.first >= self.Tk, -1, self.first), "last_key": self.last,
            "allowed_keys": self.allowed_keys, "diagonal_allowed": self.diag_allowed,
        }
        if output is not None and self.out is not None:
            obs = output[:, :, self.a:self.b].to(self.out.dtype)
            out["output_error"] = (self.out - obs).abs().amax(-1)
            out["output_scale"] = self.scale.amax(-1)
            finite &= torch.isfinite(obs).all(-1)
        else:
            nan = torch.full_like(self.max, math.nan)
            out["output_error"], out["output_scale"] = nan, nan.clone()
        out["finite"] = finite
        return out


def _rows_per_block(B: int, h: int, keys: int, itemsize: int, block_bytes: int) -> int:
    return max(1, block_bytes // max(1, B * h * keys * itemsize * _TEMPORARIES))


def _counted_rows(query_padding: torch.Tensor | None, B: int, Tq: int, device) -> torch.Tensor:
    """(B, Tq) float: 1 for the query rows whose weights count in ``key_weight``."""
    if query_padding is None:
        return torch.ones(B, Tq, device=device)
    return (~query_padding.to(device, torch.bool)).float()


def _collect(parts: list[dict], key_weight: torch.Tensor, key_allowed: torch.Tensor) -> Mapping[str, torch.Tensor]:
    stats = {name: torch.cat([p[name] for p in parts], dim=2) for name in ROW_STATS}
    stats["key_weight"], stats["key_allowed"] = key_weight, key_allowed
    return MappingProxyType(stats)


def attention_stats(call: AttentionCall, *, diag_offset: int | None = None, query_padding: torch.Tensor | None = None,
                    block_bytes: int = DEFAULT_BLOCK_BYTES) -> Mapping[str, torch.Tensor]:
    """Every statistic of ``call`` (``ROW_STATS`` ``(batch, head, query)``, ``KEY_STATS`` ``(batch, head, key)``),
    exact, without a tensor larger than ``block_bytes`` (a few of them at once).

    ``diag_offset``: key index of query 0 in self-attention (its own key), None for cross-attention.
    ``query_padding`` ``(batch, query)``: rows left out of ``key_weight``.

    Example::

        >>> import torch
        >>> from attnprobe.probe.attention_math import AttentionCall
        >>> q = k = torch.zeros(1, 1, 3, 4)
        >>> s = attention_stats(AttentionCall(q, k, scaling=0.5, causal=True), diag_offset=0)
        >>> [round(x, 4) for x in s["max_weight"][0, 0].tolist()]
        [1.0, 0.5, 0.3333]
        >>> s["last_key"][0, 0].tolist(), s["key_weight"][0, 0].tolist()[0] > 1.8
        ([0, 1, 2], True)
    """
    B, h, Tq, Tk = call.shape
    dtype, device = call.compute_dtype, call.q.device
    itemsize = torch.finfo(dtype).bits // 8
    key_block = max(1, block_bytes // max(1, B * h * itemsize * _TEMPORARIES))  # keys of one row that fit
    rows_step = _rows_per_block(B, h, Tk, itemsize, block_bytes) if key_block >= Tk else 1
    if key_block < Tk:  # one row is longer than the target: a few rows, keys in blocks
        rows_step = max(1, min(64, Tq))
        key_block = max(1, block_bytes // max(1, B * h * rows_step * itemsize * _TEMPORARIES))
    counted = _counted_rows(query_padding, B, Tq, device).to(dtype)
    key_weight = torch.zeros(B, h, Tk, device=device, dtype=dtype)
    key_allowed = torch.zeros(B, h, Tk, dtype=torch.bool, device=device)
    v = None if call.output is None or call.v is None else call.v
    dv = None if v is None else v.shape[-1]
    sinks = None if call.sinks is None else call.sinks.to(device, dtype)
    parts = []
    with torch.no_grad():
        for a in range(0, Tq, rows_step):
            b = min(a + rows_step, Tq)
            reach = call.key_limit(b)
            blocks = [(c, min(c + key_block, reach)) for c in range(0, reach, key_block)]
            # pass 1: each row's running max m and sum l = sum exp(z - m), rescaled when m grows
            m = torch.full((B, h, b - a), -math.inf, device=device, dtype=dtype)
            l = torch.zeros_like(m)
            kept = None  # the one block of a row that fits whole: pass 2 reuses it
            for c, d in blocks:
                s = call.logits(a, b, c, d)
                allowed = call.allowed(a, b, c, d)
                z = s if allowed is None else s.masked_fill(~allowed, -math.inf)  # -inf, never a finite sentinel
                m_new = torch.maximum(m, z.amax(-1))
                safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
                l = l * torch.exp(torch.where(torch.isfinite(m), m - safe, -math.inf)) + torch.exp(z - safe[..., None]).sum(-1)
                m = m_new
                if len(blocks) == 1:
                    kept = (s, allowed, z)
            lse = torch.where(l > 0, torch.log(l) + torch.where(torch.isfinite(m), m, 0.0), -math.inf)
            lse = torch.where(torch.isnan(m), math.nan, lse)
            lse_all = sink_logsumexp(lse, sinks)
            empty = ~(torch.isfinite(m) | torch.isnan(m)) if sinks is None else torch.zeros_like(m, dtype=torch.bool)
            uniform = empty if call.additive else None  # additive masks turn an empty row uniform
            real = (counted[:, a:b].view(B, 1, -1) * ~empty).to(dtype)  # rows that count in key_weight
            acc = _Rows(B, h, a, b, Tk, diag_offset=diag_offset, device=device, dtype=dtype, dv=dv)
            for c, d in blocks:
                s, allowed, z = kept if kept is not None else (None, None, None)
                if s is None:
                    s = call.logits(a, b, c, d)
                    allowed = call.allowed(a, b, c, d)
                    z = s if allowed is None else s.masked_fill(~allowed, -math.inf)
                w = torch.exp(z - torch.where(torch.isfinite(lse_all), lse_all, 0.0)[..., None])
                if uniform is not None:
                    w = torch.where(uniform[..., None], 1.0 / Tk, w)
                acc.add(w, c, scores=s, allowed=allowed, v=v, exact_zero_outside=not call.additive)
                key_weight[..., c:d] += torch.einsum("bhq,bhqk->bhk", real, w)
                if allowed is None:
                    key_allowed[..., c:d] = True
                else:
                    key_allowed[..., c:d] |= allowed.any(-2).expand(B, h, -1)
            expected = 1.0 if sinks is None else 1.0 - torch.exp(sinks.view(1, -1, 1) - lse_all).nan_to_num(0.0)
            part = acc.finish(expected=expected, output=call.output, scores_known=True)
            parts.append(part)
    return _collect(parts, key_weight, key_allowed)


def stats_from_weights(weights: torch.Tensor, *, scores: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                       v: torch.Tensor | None = None, output: torch.Tensor | None = None,
                       sinks: torch.Tensor | None = None, diag_offset: int | None = None,
                       query_padding: torch.Tensor | None = None,
                       block_bytes: int = DEFAULT_BLOCK_BYTES) -> Mapping[str, torch.Tensor]:
    """The same statistics as ``attention_stats``, from full tensors: ``weights`` ``(batch, head, query, key)``,
    ``scores`` (the logits; None: ``max_score`` NaN, finiteness from the weights alone), ``allowed`` ``(batch,
    1 or head, query, key)`` (None: every key allowed), ``v`` ``(batch, head, key, d)`` (each query head's kv
    head) with the observed ``output``, ``sinks`` ``(head,)``."""
    B, h, Tq, Tk = weights.shape
    dtype = torch.promote_types(weights.dtype, torch.float32)
    device = weights.device
    counted = _counted_rows(query_padding, B, Tq, device).to(dtype)
    key_weight = torch.zeros(B, h, Tk, device=device, dtype=dtype)
    key_allowed = torch.ones(B, h, Tk, dtype=torch.bool, device=device) if allowed is None else \
        allowed.any(-2).expand(B, h, Tk).clone()
    dv = None if v is None or output is None else v.shape[-1]
    step = _rows_per_block(B, h, Tk, torch.finfo(dtype).bits // 8, block_bytes)
    parts = []
    with torch.no_grad():
        for a in range(0, Tq, step):
            b = min(a + step, Tq)
            w = weights[:, :, a:b].to(dtype)
            s = None if scores is None else scores[:, :, a:b].to(dtype)
            al = None if allowed is None else allowed[:, :, a:b].to(torch.bool)
            acc = _Rows(B, h, a, b, Tk, diag_offset=diag_offset, device=device, dtype=dtype, dv=dv)
            acc.add(w, 0, scores=s, allowed=al, v=v, exact_zero_outside=False)
            real = counted[:, a:b].view(B, 1, -1) * (1.0 if al is None else al.any(-1).to(dtype))
            key_weight += torch.einsum("bhq,bhqk->bhk", real.expand(B, h, -1), w.nan_to_num(0.0))
            if sinks is not None and s is not None:
                z = s if al is None else s.masked_fill(~al, -math.inf)
                lse = sink_logsumexp(torch.logsumexp(z, -1), sinks.to(device, dtype))
                expected = 1.0 - torch.exp(sinks.to(device, dtype).view(1, -1, 1) - lse)
            else:
                expected = 1.0
            parts.append(acc.finish(expected=expected, output=output, scores_known=s is not None))
    return _collect(parts, key_weight, key_allowed)


def record_stats(record) -> Mapping[str, torch.Tensor] | None:
    """The statistics of a full record (``stats_from_weights`` over its weights, scores, mask, v and output);
    None when it has no weights."""
    from .record import AttentionRecord

    if not isinstance(record, AttentionRecord):
        raise TypeError(f"record_stats takes an AttentionRecord, got {type(record).__name__}")
    if record.weights is None:
        return None
    B, h, q_len, k_len = record.weights.shape
    diag = None
    if record.kind == "self":
        offset = record.query_offset if record.query_offset + q_len <= k_len else k_len - q_len
        diag = offset if offset >= 0 else None
    v = output = None
    if record.v is not None and record.output is not None and record.num_kv_heads > 0 \
            and record.num_heads % record.num_kv_heads == 0:
        group = record.num_heads // record.num_kv_heads
        try:
            index = [record.kv_heads.index(hd // group) for hd in record.heads]
        except ValueError:
            index = None
        if index is not None:
            v, output = record.v[:, index], record.output
    return stats_from_weights(record.weights, scores=record.scores, allowed=record.allowed, v=v, output=output,
                              sinks=record.sinks, diag_offset=diag, query_padding=record.query_padding)
