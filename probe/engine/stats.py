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
- ``first_key_mass`` (the first key any query may attend: the first one that is not padding), ``diagonal_mass`` (the query's own key), ``previous_mass`` (the key
  before it); NaN where that key does not exist (cross-attention, the first query);
- ``masked_mass``, ``masked_max``: weight on keys the call's own mask forbids (sum, largest);
- ``row_sum_error``: ``|sum w - expected|``, expected 1, or 1 minus the sink mass with attention sinks;
- ``max_score``: the largest logit at an allowed key (``-inf`` when none is allowed);
- ``finite``: no NaN/inf weight, no NaN/inf logit at an allowed key, and a finite observed output row;
- ``output_error``: ``max |weights @ v - observed output|`` over the row (where the output was observed),
  ``output_scale``: ``|weights| @ max|v|``, each key's largest ``|v|`` weighted (what its rounding error scales
  with: a bound of ``max (|weights| @ |v|)`` over the row that costs a matrix-vector product, not a second ``@ v``);
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
from collections.abc import Mapping
from types import MappingProxyType

import torch

from .attention_math import AttentionCall, sink_logsumexp
from .pooling import Overview, Pooler

#: Statistics with one value per (batch, head, query), in order.
ROW_STATS: tuple[str, ...] = (
    "entropy",
    "max_weight",
    "min_weight",
    "argmax_key",
    "first_key_mass",
    "diagonal_mass",
    "previous_mass",
    "masked_mass",
    "masked_max",
    "row_sum_error",
    "max_score",
    "finite",
    "output_error",
    "output_scale",
    "first_key",
    "last_key",
    "allowed_keys",
    "diagonal_allowed",
)
#: Statistics with one value per (batch, head, key).
KEY_STATS: tuple[str, ...] = ("key_weight", "key_allowed")

#: Per (batch, head, query cell, key cell): the weights pooled to at most ``Overview.cells`` cells a side
#: (``capture(overview=...)``); and ``window_<i>`` ``(batch, head, q1 - q0, k1 - k0)``: exact weights of window i.
OVERVIEW_STATS: tuple[str, ...] = ("overview_max", "overview_mean")

#: A weight above this counts as attention for ``first_key``/``last_key`` (the checks' ``FORBIDDEN_WEIGHT``).
WEIGHT_THRESHOLD = 1e-6

#: Default memory target of one block: its two (batch, head, rows, keys) buffers (logits, weights) take at most this
#: much together; when one row's keys do not fit, keys come in blocks and each temporary is about a quarter of it.
DEFAULT_BLOCK_BYTES = 128 << 20

#: How many (rows, keys) float temporaries a block of the engine holds at once when keys come in blocks too.
_TEMPORARIES = 4

#: A block's rows: as many as fill this many bytes of logits, but at least ``_MIN_ROWS``. Fewer rows make its
#: products slower (65 GFLOP/s with 32 rows, 73 with 64, on one AVX-512 core); a larger block outgrows the CPU's
#: caches. Engine time / sdpa, one thread: 2.05 with 64 rows and 2.12 with 128 at 16k tokens; 2.05 with 64 and 2.12
#: with 32 at 32k; 2.16 with 64, 2.26 with 128 and 2.37 with 32 at 4k. Short rows get more of them (all 128 rows of
#: 8 x 12 heads x 128 keys: one block per layer, not two).
_CACHE_BYTES = 8 << 20
_MIN_ROWS = 64


class _Rows:
    """Statistics of query rows ``a:b`` accumulated over key blocks (one accumulator, two sources: the
    engine's exact weights, or a full capture's weights)."""

    def __init__(
        self,
        B: int,
        h: int,
        a: int,
        b: int,
        Tk: int,
        *,
        diag_offset: int | None,
        device,
        dtype,
        dv: int | None,
        positions: torch.Tensor | None = None,
    ) -> None:
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
        rows = torch.arange(a, b, device=device) if positions is None else positions[a:b].to(device)
        self.diag = None if diag_offset is None else rows + diag_offset
        self.out = None if dv is None else torch.zeros(B, h, n, dv, device=device, dtype=dtype)
        self.first_key = None  # (B, h, 1) the first key any query may attend; None = key 0
        self.scale = None if dv is None else torch.zeros(B, h, n, device=device, dtype=dtype)

    def _at(self, t: torch.Tensor, key, c: int, d: int, out: torch.Tensor) -> None:
        _gather(t, key, c, d, out)

    def add(
        self,
        w: torch.Tensor,
        c: int,
        *,
        scores: torch.Tensor | None,
        allowed: torch.Tensor | None,
        v: torch.Tensor | None,
        exact_zero_outside: bool,
    ) -> None:
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
        self._at(w, 0 if self.first_key is None else self.first_key.expand(*w.shape[:3]), c, d, self.first_mass)
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
            self.scale += (w.abs() @ vb.abs().amax(-1, keepdim=True)).squeeze(-1)

    def finish(
        self,
        *,
        expected: torch.Tensor | float,
        output: torch.Tensor | None,
        scores_known: bool,
        empty_uniform: bool = False,
    ) -> dict[str, torch.Tensor]:
        empty = self.allowed_keys == 0
        finite = torch.isfinite(self.sum) & torch.isfinite(self.max) & torch.isfinite(self.min)
        if scores_known:
            # a NaN/inf logit at an allowed key (the "-inf at an allowed key" signal comes from the min)
            finite &= empty | (torch.isfinite(self.max_score) & torch.isfinite(self.min_score))
        out = {
            "entropy": self.entropy,
            "max_weight": self.max,
            "min_weight": self.min,
            "argmax_key": self.argmax,
            "first_key_mass": self.first_mass,
            "diagonal_mass": self.diag_mass,
            "previous_mass": self.prev_mass,
            "masked_mass": self.masked_mass,
            "masked_max": self.masked_max,
            "row_sum_error": (self.sum - expected).abs(),
            "max_score": self.max_score if scores_known else torch.full_like(self.max, math.nan),
            "first_key": torch.where(self.first >= self.Tk, -1, self.first),
            "last_key": self.last,
            "allowed_keys": self.allowed_keys,
            "diagonal_allowed": self.diag_allowed,
        }
        if output is not None and self.out is not None:
            obs = output[:, :, self.a : self.b].to(self.out.dtype)
            out["output_error"] = (self.out - obs).abs().amax(-1)
            out["output_scale"] = self.scale
            finite &= torch.isfinite(obs).all(-1)
        else:
            nan = torch.full_like(self.max, math.nan)
            out["output_error"], out["output_scale"] = nan, nan.clone()
        out["finite"] = finite
        return out


def _rows_per_block(B: int, h: int, keys: int, itemsize: int, block_bytes: int) -> int:
    """Rows of a block whose rows fit one block of keys: as many as fill ``_CACHE_BYTES``, at least ``_MIN_ROWS``,
    and never more than ``block_bytes`` holds in the block's two buffers (logits, weights)."""
    row = max(1, B * h * keys * itemsize)
    return max(1, min(max(_MIN_ROWS, _CACHE_BYTES // row), block_bytes // (2 * row)))


def _counted_rows(query_padding: torch.Tensor | None, B: int, Tq: int, device) -> torch.Tensor:
    """(B, Tq) float: 1 for the query rows whose weights count in ``key_weight``."""
    if query_padding is None:
        return torch.ones(B, Tq, device=device)
    return (~query_padding.to(device, torch.bool)).float()


def _collect(
    parts: list[dict], key_weight: torch.Tensor, key_allowed: torch.Tensor, extra: dict | None = None
) -> Mapping[str, torch.Tensor]:
    if len(parts) == 1:  # one block of rows (every row of a short input): its tensors as they are
        stats = {name: parts[0][name] for name in ROW_STATS}
    else:
        stats = {name: torch.cat([p[name] for p in parts], dim=2) for name in ROW_STATS}
    stats["key_weight"], stats["key_allowed"] = key_weight, key_allowed
    stats.update(extra or {})
    return MappingProxyType(stats)


def attention_stats(
    call: AttentionCall,
    *,
    diag_offset: int | None = None,
    query_padding: torch.Tensor | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    overview: Overview | None = None,
    rows: torch.Tensor | None = None,
    workspace: dict | None = None,
) -> Mapping[str, torch.Tensor]:
    """Every statistic of ``call`` (``ROW_STATS`` ``(batch, head, query)``, ``KEY_STATS`` ``(batch, head, key)``),
    exact, without a tensor larger than ``block_bytes`` (a few of them at once).

    ``diag_offset``: key index of query 0 in self-attention (its own key), None for cross-attention.
    ``query_padding`` ``(batch, query)``: rows left out of ``key_weight``.
    ``overview``: also the pooled weights and exact windows (``Overview``), from the same exact weights.
    ``rows``: only these query rows (``(n,)`` ascending indices, a sample): row statistics ``(batch, head, n)``,
    and ``key_weight`` summed over them alone.
    ``workspace``: a dict the engine keeps its block buffers in, to reuse them in the next call (a capture passes one
    per capture: fresh buffers for every layer cost page faults, about a fifth of the engine's time at 8 x 128
    tokens). Without it, they are made for this call and freed after it.

    Example::

        >>> import torch
        >>> from attnprobe.probe.engine.attention_math import AttentionCall
        >>> q = k = torch.zeros(1, 1, 3, 4)
        >>> s = attention_stats(AttentionCall(q, k, scaling=0.5, causal=True), diag_offset=0)
        >>> [round(x, 4) for x in s["max_weight"][0, 0].tolist()]
        [1.0, 0.5, 0.3333]
        >>> s["last_key"][0, 0].tolist(), s["key_weight"][0, 0].tolist()[0] > 1.8
        ([0, 1, 2], True)
    """
    if rows is not None:
        if overview is not None:
            raise ValueError("attention_stats: an overview needs every query row, not a sample (rows=)")
        call = call.take_rows(rows)
        if query_padding is not None:
            query_padding = query_padding.index_select(1, rows.to(query_padding.device, torch.long))
    B, h, Tq, Tk = call.shape
    dtype, device = call.compute_dtype, call.q.device
    itemsize = torch.finfo(dtype).bits // 8
    key_block = max(1, block_bytes // max(1, B * h * itemsize * _TEMPORARIES))  # keys of one row that fit
    if key_block >= Tk:
        rows_step = _rows_per_block(B, h, Tk, itemsize, block_bytes)
    else:  # one row is longer than the target: a few rows, keys in blocks
        rows_step = max(1, min(64, Tq))
        key_block = max(1, block_bytes // max(1, B * h * rows_step * itemsize * _TEMPORARIES))
    counted = _counted_rows(query_padding, B, Tq, device).to(dtype)
    stats = _Engine(call, B, h, Tq, Tk, dtype, device, diag_offset, {} if workspace is None else workspace)
    if overview is not None:
        stats.pool = Pooler(overview, B, h, Tq, Tk, device)
    with torch.no_grad():
        for a in range(0, Tq, rows_step):
            b = min(a + rows_step, Tq)
            reach = call.key_limit(b)
            stats.rows(a, b, [(c, min(c + key_block, reach)) for c in range(0, reach, key_block)], counted[:, a:b])
    return stats.result()


class _Engine:
    """The engine's two passes over the key blocks of each block of query rows.

    Pass 1 finds each row's max ``m`` (and its key) and ``l = sum exp(z - m)`` with a running max (flash-style);
    a row that fits one block does it in one go. Pass 2 turns each key block into ``e = exp(z - m)``: the
    weights are ``e / l``, so every sum is accumulated in units of ``e`` and divided by ``l`` once at the end.
    Weights at forbidden keys are exactly 0 (their logit is ``-inf``, never a finite sentinel: exp of a huge
    negative number is slow on CPUs), so the masked sums need no pass. An empty row of an additive mask is
    uniform over every key (see ``attention_math``): its statistics are written directly.
    """

    def __init__(self, call: AttentionCall, B, h, Tq, Tk, dtype, device, diag_offset, buffers: dict) -> None:
        self.call, self.B, self.h, self.Tq, self.Tk = call, B, h, Tq, Tk
        self.dtype, self.device, self.diag_offset = dtype, device, diag_offset
        self.sinks = None if call.sinks is None else call.sinks.to(device, dtype).view(1, -1, 1)
        self.v = None if call.output is None or call.v is None else call.v.to(dtype)
        # the largest |v| of each key: e @ v_max bounds max_d (e @ |v|)_d, what the output's rounding error scales with
        # (the larger of the max and minus the min: two reductions, no |v| tensor)
        self.v_max = None if self.v is None else torch.maximum(self.v.amax(-1), self.v.amin(-1).neg_())
        self.key_weight = torch.zeros(B, h, Tk, device=device, dtype=dtype)
        self.key_allowed = torch.zeros(B, h, Tk, dtype=torch.bool, device=device)
        self.parts: list[dict] = []
        self.first_key = self._first_attendable()  # (B, h, 1): the key first_key_mass reads
        self.pool: Pooler | None = None
        self._buffers = buffers

    def _scratch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``shape`` view of buffer ``name``, made once at the size of the largest block (the first block of rows
        against every key) and reused by every block: blocks of many sizes would otherwise fragment the heap
        (resident memory 2.5x the plain forward at 16k tokens) and page in fresh memory each time."""
        need = math.prod(shape)
        key = (name, self.dtype, self.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < need:
            size = max(need, math.prod(shape[:-1]) * self.Tk)
            buf = self._buffers[key] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buf[:need].view(shape)

    def _first_attendable(self) -> torch.Tensor:
        """``(B, h, 1)`` the first key some query may attend (0 under a causal mask alone), read from the mask a
        block of rows at a time."""
        B, h, Tq, Tk, call = self.B, self.h, self.Tq, self.Tk, self.call
        if call.mask is None:
            return torch.zeros(B, h, 1, dtype=torch.long, device=self.device)
        seen = torch.zeros(B, h, Tk, dtype=torch.bool, device=self.device)
        step = max(1, (1 << 24) // max(1, B * h * Tk))
        for a in range(0, Tq, step):
            b = min(a + step, Tq)
            seen |= call.allowed(a, b, 0, Tk).any(-2).expand(B, h, Tk)
        return seen.to(torch.uint8).argmax(-1, keepdim=True)

    def _block(self, a, b, c, d):
        """(logits, allowed or None, softmax input with -inf where forbidden): keys ``c:d`` of rows ``a:b``."""
        s = self.call.logits(a, b, c, d)
        if self.call.mask is not None:
            allowed = self.call.allowed(a, b, c, d)
            forbidden = ~allowed
        else:  # a causal mask alone (or nothing): built as "later than the query", no negation
            allowed, forbidden = None, self.call.forbidden(a, b, c, d)
        z = s if forbidden is None else s.masked_fill(forbidden, -math.inf)
        if forbidden is not None:
            # the logits at forbidden keys no longer matter (their weight is 0): zero them, so that a NaN/inf
            # there cannot reach the entropy's sum of e * s, where a NaN/inf at an allowed key must show
            s = s.masked_fill_(forbidden, 0.0)
        # a causal mask alone is counted from positions (in rows()), anything else from the mask itself
        return s, allowed, z

    def rows(self, a: int, b: int, blocks: list[tuple[int, int]], counted: torch.Tensor) -> None:
        if len(blocks) == 1:
            return self._one_block(a, b, *blocks[0], counted)
        B, h, n, dtype, device = self.B, self.h, b - a, self.dtype, self.device
        m = torch.full((B, h, n), -math.inf, device=device, dtype=dtype)
        arg = torch.zeros(B, h, n, dtype=torch.long, device=device)
        l = torch.zeros_like(m)
        kept = None
        if len(blocks) == 1:  # the whole row in one block: one pass
            kept = self._block(a, b, *blocks[0])
            m, arg = kept[2].max(-1)
            arg = arg + blocks[0][0]
        else:  # pass 1: running max, rescaled sum
            for c, d in blocks:
                _, _, z = self._block(a, b, c, d)
                bm, barg = z.max(-1)
                m_new = torch.maximum(m, bm)
                arg = torch.where(bm > m, barg + c, arg)
                safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
                l = l * torch.exp(torch.where(torch.isfinite(m), m - safe, -math.inf)) + torch.exp(
                    z - safe[..., None]
                ).sum(-1)
                m = m_new
        shift = torch.where(torch.isfinite(m), m, 0.0)  # e = exp(z - shift); -inf rows stay 0
        empty = torch.isneginf(m)  # no allowed key (NaN rows are not empty: they are not finite)
        positions = self.call.row_positions(a, b)
        diag = None if self.diag_offset is None else positions + self.diag_offset
        dv = None if self.v is None else self.v.shape[-1]
        z_ = torch.zeros(B, h, n, device=device, dtype=dtype)
        acc = {
            "l": z_.clone(),
            "dot": z_.clone(),
            "min": torch.full_like(z_, math.inf),
            "first_e": z_.clone(),
            "diag_e": torch.full_like(z_, math.nan),
            "prev_e": torch.full_like(z_, math.nan),
            "allowed_keys": torch.zeros(B, h, n, dtype=torch.long, device=device),
            "diag_allowed": torch.zeros(B, h, n, dtype=torch.bool, device=device),
            "first": torch.full((B, h, n), self.Tk, dtype=torch.long, device=device),
            "last": torch.full((B, h, n), -1, dtype=torch.long, device=device),
            "a": a,
        }
        out = None if dv is None else torch.zeros(B, h, n, dv, device=device, dtype=dtype)
        scale = None if dv is None else torch.zeros_like(z_)
        pending = []  # key-block sums of e that need l: (c, d, e-block summed against counted rows)
        real = counted.view(B, 1, n) * ~empty
        for c, d in blocks:
            s, allowed, z = kept if kept is not None else self._block(a, b, c, d)
            # z is not needed again: in place, unless z is the logits themselves (nothing masked)
            x = z - shift[..., None] if z is s else z.sub_(shift[..., None])
            e = _exp(x, out=x)
            acc["l"] += e.sum(-1)
            acc["min"] = torch.minimum(acc["min"], e.amin(-1))
            _gather(e, self.first_key.expand(B, h, n), c, d, acc["first_e"])
            if diag is not None:
                _gather(e, diag, c, d, acc["diag_e"])
                _gather(e, diag - 1, c, d, acc["prev_e"])
            if allowed is None:  # every key, or a causal mask alone: counted from positions
                limit = positions + self.call.causal_offset + 1 if self.call.causal else torch.full_like(positions, d)
                acc["allowed_keys"] += (limit.clamp(c, d) - c).view(1, 1, -1)
                reach = min(d, self.call.key_limit(b)) if self.call.causal else d
                self.key_allowed[..., c : max(c, reach)] = True
                if diag is not None:
                    acc["diag_allowed"] |= ((diag >= c) & (diag < d) & (diag < limit)).view(1, 1, -1)
            else:
                acc["allowed_keys"] += allowed.sum(-1, dtype=torch.long).expand(B, h, n)
                self.key_allowed[..., c:d] |= allowed.any(-2).expand(B, h, d - c)
                if diag is not None:
                    rows = allowed.expand(*allowed.shape[:2], n, d - c)  # a mask the same for every query: a view
                    got = torch.zeros(rows.shape[:3], dtype=torch.bool, device=device)
                    _gather(rows, diag, c, d, got)
                    acc["diag_allowed"] |= got
            if out is not None:
                o, sc = self._products(e, c, d)
                out += o
                scale += sc
            # entropy needs sum e * z over the allowed keys: s (zero at forbidden keys) times e, in place in s,
            # which nothing reads again
            acc["dot"] += s.mul_(e).sum(-1)
            pending.append((c, d, e if len(blocks) == 1 else None))
            if len(blocks) > 1:
                pending[-1] = (c, d, None)
                self._key_sums(e, c, d, real, acc, l_final=self._total(l, shift))
        if not blocks or blocks[-1][1] < self.Tk:  # keys this block of rows cannot reach weigh 0
            acc["min"].clamp_(max=0.0)
        if len(blocks) == 1:
            l = acc["l"]
            c, d, e = pending[0]
            self._key_sums(e, c, d, real, acc, l_final=self._total(l, shift))
        self.parts.append(self._finish(a, b, m, arg, l, shift, empty, diag, acc, out, scale))

    def _one_block(self, a: int, b: int, c: int, d: int, counted: torch.Tensor) -> None:
        """Rows ``a:b`` whose keys ``c:d`` fit one block: every statistic in one pass over the block, with as few
        full-size passes as the math allows. The logits get ``-inf`` where the row may not attend (a causal mask
        alone: only the tile of keys some row of the block may not see), then their max and its key (``_row_max``: a
        max with indices costs ten times an ``amax`` on CPUs), ``e = exp(logits - max)`` in a second buffer,
        reductions of ``e``, and the first and last key above the threshold (``_hits``). The logits and ``e`` live in
        two buffers reused by every block (``_scratch``)."""
        B, h, n, dtype, device, call = self.B, self.h, b - a, self.dtype, self.device, self.call
        positions = call.row_positions(a, b)
        diag = None if self.diag_offset is None else positions + self.diag_offset
        shape = (B, h, n, d - c)
        # (B, h, n, K), ours to change: log2(e) times the logits, so that e is one exp2 (see _exp) and its max is
        # the block's max, exactly 0 once shifted
        s = call.logits(a, b, c, d, out=self._scratch("logits", shape), times=_LOG2E)
        allowed, forbidden, cut = None, None, 0
        if call.mask is not None:
            allowed = call.allowed(a, b, c, d)  # (B or 1, 1 or h, n, K), usually the same for every head
            forbidden = ~allowed
        elif call.causal:  # keys from `lo` on are later than some row's own position: mask that tile only
            limit = positions + call.causal_offset + 1  # (n,) the first key each row may not attend
            # the block's first row has the smallest position (they ascend): known on the host for contiguous rows
            start = a if call.positions is None else int(call.positions[a])
            lo = min(max(start + call.causal_offset + 1 - c, 0), d - c)
            if lo < d - c:
                forbidden, cut = torch.arange(c + lo, d, device=device)[None, :] >= limit[:, None], lo
        weights = self._scratch("weights", shape)
        if forbidden is not None:
            # -inf where the row may not attend (never a finite sentinel), as the min with a bound that is -inf there
            # and +inf elsewhere: a masked fill costs ten times as much on CPUs (1 ms against 0.1 for 8 x 12 x 128
            # rows of 128 keys). A NaN logit at a forbidden key survives the min and makes its row's max NaN;
            # blocks with a NaN max are filled again exactly, so that such a logit does not count.
            torch.minimum(s[..., cut:], _bound(forbidden, -math.inf, math.inf, dtype), out=s[..., cut:])
        # the largest logit at an allowed key (-inf: none is allowed; NaN: a NaN logit), base 2, and its key; s minus
        # that max in place from here on; the weights buffer is scratch until e takes it
        m2, arg = _row_max(s, scratch=weights)
        if forbidden is not None and bool(torch.isnan(m2).any()):
            s = call.logits(a, b, c, d, out=self._scratch("logits", shape), times=_LOG2E)
            s[..., cut:].masked_fill_(forbidden, -math.inf)
            m2, arg = _row_max(s, scratch=weights)
        arg = arg + c
        e = torch.exp2(s, out=weights)
        m = m2 * _LN2  # the natural logit's max; e = exp(logits - shift) to float rounding
        shift = torch.where(torch.isfinite(m), m, 0.0)
        if forbidden is not None:  # the entropy's sum of e * s must see 0 there, not 0 * -inf: the max with 0 there
            torch.maximum(s[..., cut:], _bound(forbidden, 0.0, -math.inf, dtype), out=s[..., cut:])
        empty = torch.isneginf(m)
        l = e.sum(-1)
        total = self._total(l, shift)
        # sum e * (logits - max), forbidden keys 0: the entropy without adding the max and taking it off again
        dot = s.mul_(e).sum(-1).mul_(_LN2)  # in place: s is only a scratch buffer from here on
        first, last = _hits(e, WEIGHT_THRESHOLD * total, scratch=s)  # s is not read again
        acc = {
            "l": l,
            "dot": dot,
            "dot_shifted": True,
            "min": e.amin(-1),
            "a": a,
            "first_e": torch.zeros_like(l),
            "diag_e": torch.full_like(l, math.nan),
            "prev_e": torch.full_like(l, math.nan),
            "first": torch.where(first >= 0, first + c, self.Tk),
            "last": torch.where(last >= 0, last + c, -1),
        }
        _gather(e, self.first_key.expand(B, h, n), c, d, acc["first_e"])
        if diag is not None:
            _gather(e, diag, c, d, acc["diag_e"])
            _gather(e, diag - 1, c, d, acc["prev_e"])
        if allowed is None:  # every key, or a causal mask alone: counted from positions
            limit = positions + call.causal_offset + 1 if call.causal else torch.full_like(positions, d)
            acc["allowed_keys"] = (limit.clamp(c, d) - c).view(1, 1, -1).expand(B, h, n).clone()
            reach = min(d, call.key_limit(b)) if call.causal else d
            self.key_allowed[..., c : max(c, reach)] = True
            acc["diag_allowed"] = torch.zeros(B, h, n, dtype=torch.bool, device=device)
            if diag is not None:
                acc["diag_allowed"] |= ((diag >= c) & (diag < d) & (diag < limit)).view(1, 1, -1)
        else:
            acc["allowed_keys"] = allowed.sum(-1, dtype=torch.long).expand(B, h, n).clone()
            self.key_allowed[..., c:d] |= allowed.any(-2).expand(B, h, d - c)
            acc["diag_allowed"] = torch.zeros(B, h, n, dtype=torch.bool, device=device)
            if diag is not None:
                rows = allowed.expand(*allowed.shape[:2], n, d - c)  # a mask the same for every query: a view
                _gather(rows, diag, c, d, acc["diag_allowed"])
        if d < self.Tk or c > 0:  # keys this block of rows cannot reach weigh 0
            acc["min"].clamp_(max=0.0)
        inv = torch.where(total > 0, 1.0 / total, 0.0)
        real = counted.view(B, 1, n) * ~empty
        self.key_weight[..., c:d] += (real * inv).unsqueeze(-2).matmul(e).squeeze(-2)
        if self.pool is not None:
            self.pool.add(e, a, c, row_scale=inv)
        out, scale = self._products(e, c, d)
        self.parts.append(self._finish(a, b, m, arg, l, shift, empty, diag, acc, out, scale))

    def _products(self, e: torch.Tensor, c: int, d: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(e @ v, e @ max|v|)`` over keys ``c:d``, each undivided by the normaliser: the output (a new tensor) and
        its scale (None, None without an observed output). The scale is a matrix-vector product, taken as
        ``max|v| @ e^T``: the orientation that runs at memory speed (``e @ max|v|`` costs as much as ``e @ v``)."""
        if self.v is None:
            return None, None
        scale = torch.matmul(self.v_max[:, :, None, c:d], e.transpose(-1, -2)).squeeze(-2)
        return e @ self.v[:, :, c:d], scale

    def _key_sums(self, e, c, d, real, acc, *, l_final) -> None:
        """Sums over this block's keys that need each row's normaliser: key_weight, first/last key."""
        inv = torch.where(l_final > 0, 1.0 / l_final, 0.0)
        self.key_weight[..., c:d] += (real * inv).unsqueeze(-2).matmul(e).squeeze(-2)
        first, last = _hits(e, WEIGHT_THRESHOLD * l_final)  # weight > threshold, e not divided
        acc["first"] = torch.where(first >= 0, torch.minimum(acc["first"], first + c), acc["first"])
        acc["last"] = torch.where(last >= 0, torch.maximum(acc["last"], last + c), acc["last"])
        if self.pool is not None:
            self.pool.add(e, acc["a"], c, row_scale=inv)

    def _total(self, l: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """The softmax normaliser in units of ``e``: ``l``, plus ``exp(sink - shift)`` with attention sinks."""
        return l if self.sinks is None else l + torch.exp(self.sinks - shift)

    def _finish(self, a, b, m, arg, l, shift, empty, diag, acc, out, scale) -> dict:
        Tk, sinks = self.Tk, self.sinks
        total = self._total(l, shift)
        expected = 1.0 if sinks is None else 1.0 - torch.exp(sinks - shift) / total
        inv = torch.where(total > 0, 1.0 / total, 0.0)
        # entropy = log(total) + shift - sum(e * z) / total, with the shift taken out of both where it was
        lse = torch.log(total) + (0.0 if acc.get("dot_shifted") else shift)
        stats = {
            "entropy": torch.where(l > 0, lse * (l * inv) - acc["dot"] * inv, 0.0),
            "max_weight": torch.where(empty, 0.0, torch.exp(m - shift) * inv),
            "min_weight": acc["min"] * inv,
            "argmax_key": torch.where(empty, 0, arg),
            "first_key_mass": acc["first_e"] * inv,
            "diagonal_mass": acc["diag_e"] * inv,
            "previous_mass": acc["prev_e"] * inv,
            "masked_mass": torch.zeros_like(m),
            "masked_max": torch.zeros_like(m),
            "row_sum_error": (acc["l"] * inv - expected).abs(),
            "max_score": m,
            "first_key": torch.where(acc["first"] >= Tk, -1, acc["first"]),
            "last_key": acc["last"],
            "allowed_keys": acc["allowed_keys"],
            "diagonal_allowed": acc["diag_allowed"],
        }
        finite = torch.isfinite(acc["dot"]) & torch.isfinite(total) & ~torch.isnan(m)
        finite = finite | (empty & (acc["dot"] == 0))
        if out is not None:
            obs = self.call.output[:, :, a:b].to(self.dtype)
            stats["output_error"] = out.mul_(inv[..., None]).sub_(obs).abs_().amax(-1)  # out is ours
            stats["output_scale"] = scale * inv
            finite &= torch.isfinite(stats["output_error"])  # NaN/inf in the observed row (or in v) reaches it
        else:
            stats["output_error"] = torch.full_like(m, math.nan)
            stats["output_scale"] = torch.full_like(m, math.nan)
        if self.call.additive and sinks is None:  # an empty row of an additive mask is uniform over every key
            stats = self._uniform_rows(stats, empty, diag, a, b)
            if self.pool is not None:
                self.pool.add_uniform(empty, a, 1.0 / Tk)
        stats["finite"] = finite
        return stats

    def _uniform_rows(self, stats: dict, empty: torch.Tensor, diag, a: int, b: int) -> dict:
        Tk, u = self.Tk, 1.0 / self.Tk
        put = {
            "entropy": math.log(Tk),
            "max_weight": u,
            "min_weight": u,
            "argmax_key": 0,
            "first_key_mass": u,
            "masked_mass": 1.0,
            "masked_max": u,
            "row_sum_error": 0.0,
            "first_key": 0 if u > WEIGHT_THRESHOLD else -1,
            "last_key": Tk - 1 if u > WEIGHT_THRESHOLD else -1,
        }
        out = {name: (torch.where(empty, put[name], t) if name in put else t) for name, t in stats.items()}
        if diag is not None:
            out["diagonal_mass"] = torch.where(empty & (diag < Tk), u, stats["diagonal_mass"])
            out["previous_mass"] = torch.where(empty & (diag >= 1) & (diag - 1 < Tk), u, stats["previous_mass"])
        if self.v is not None:
            mean = self.v.mean(-2, keepdim=True)  # (B, h, 1, d): the output of a uniform row
            obs = self.call.output[:, :, a:b].to(self.dtype)
            err = (mean - obs).abs().amax(-1)
            out["output_error"] = torch.where(empty, err, stats["output_error"])
            out["output_scale"] = torch.where(empty, self.v_max.mean(-1, keepdim=True), stats["output_scale"])
        return out

    def result(self) -> Mapping[str, torch.Tensor]:
        return _collect(
            self.parts, self.key_weight, self.key_allowed, None if self.pool is None else self.pool.result()
        )


#: Keys per chunk of ``_chunk_max``: index statistics look inside one chunk per row. A max over chunks of 256 costs
#: what a max over the whole row costs; chunks of 64 cost twice that, of 16 twenty times.
_CHUNK = 256

#: Rows of at least this many keys are searched by chunks (``_hits``, ``_row_max``); shorter ones by float
#: arithmetic over the whole block.
_LONG_ROW = 1024

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _chunk_max(e: torch.Tensor) -> torch.Tensor:
    """``(..., K) -> (..., ceil(K / _CHUNK))``: the largest value of each chunk of ``_CHUNK`` keys."""
    K = e.shape[-1]
    whole = K - K % _CHUNK
    parts = []
    if whole:
        parts.append(e[..., :whole].unflatten(-1, (whole // _CHUNK, _CHUNK)).amax(-1))
    if whole < K:
        parts.append(e[..., whole:].amax(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _inside(e: torch.Tensor, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of chunk ``chunk`` ``(...)`` of each row of ``e`` ``(..., K)``: ``(..., _CHUNK)`` values and their
    key indices (keys past ``K`` repeat the last key and are never reported: callers mask them with ``valid``)."""
    K = e.shape[-1]
    keys = chunk.unsqueeze(-1) * _CHUNK + torch.arange(_CHUNK, device=e.device)
    return e.gather(-1, keys.clamp(max=K - 1)), keys


def _first_true(found: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last axis (0 when there is none)."""
    return found.to(torch.uint8).argmax(-1)


def _last_true(found: torch.Tensor) -> torch.Tensor:
    """Index of the last True along the last axis (the last index when there is none)."""
    return found.shape[-1] - 1 - found.flip(-1).to(torch.uint8).argmax(-1)


def _hits(
    e: torch.Tensor, threshold: torch.Tensor, *, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)`` ``(...)``: the first and last key whose value in ``e`` ``(..., K)`` is ``> threshold``
    (``(...)``), -1 when none is (NaN is never above). Long rows go by chunk maxima: one cheap pass over ``e``, then a
    look inside the first and the last chunk that holds a hit. Short rows by float arithmetic over the whole block
    (``scratch``: a buffer of ``e``'s shape to work in, else one is made): the sign of ``e - threshold`` times a
    ramp of key numbers, whose max is the hit's key. On CPUs, comparisons to bool and index reductions cost several
    times more than either (the block's ``uint8`` argmax alone cost more than its ``q @ k``)."""
    K = e.shape[-1]
    if K < _LONG_ROW:
        x = torch.sub(e, threshold.unsqueeze(-1), out=scratch).sign_()  # 1 above, 0 at, -1 below, NaN stays
        up = torch.arange(1, K + 1, device=e.device, dtype=e.dtype)
        last = x.mul_(up).amax(-1)  # (last hit + 1), <= 0 when there is none
        first = x.sign_().mul_(up.flip(0)).amax(-1)  # (K - first hit): the signs back, times K..1
        some = last > 0
        return torch.where(some, K - first, -1).long(), torch.where(some, last - 1, -1).long()
    threshold = threshold.unsqueeze(-1)
    in_chunk = _chunk_max(e) > threshold
    some = in_chunk.any(-1)
    values, keys = _inside(e, _first_true(in_chunk))
    first = keys.gather(-1, _first_true((values > threshold) & (keys < K)).unsqueeze(-1)).squeeze(-1)
    values, keys = _inside(e, _last_true(in_chunk))
    last = keys.gather(-1, _last_true((values > threshold) & (keys < K)).unsqueeze(-1)).squeeze(-1)
    return torch.where(some, first, -1), torch.where(some, last, -1)


def _row_max(s: torch.Tensor, *, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, key)`` ``(...)`` of each row of ``s`` ``(..., K)``, the key of the first max as a max with indices gives
    it (costs ten times an ``amax`` on CPUs); and ``s`` minus its row's max, in place (rows whose max is not finite
    keep their values). Long rows by chunk maxima (the first chunk that holds the max, then inside it), which also
    give the max; short rows by float arithmetic over the shifted block (see ``_hits``; ``scratch``: a buffer of
    ``s``'s shape to work in). Rows whose max is NaN or +inf take the max with indices (that NaN's or inf's key);
    rows with no allowed key (max ``-inf``) get some key, which callers replace."""
    K = s.shape[-1]
    if K >= _LONG_ROW:
        chunks = _chunk_max(s)
        m = chunks.amax(-1)
        values, keys = _inside(s, _first_true(chunks == m.unsqueeze(-1)))
        arg = keys.gather(-1, _first_true((values == m.unsqueeze(-1)) & (keys < K)).unsqueeze(-1)).squeeze(-1)
    else:
        m, arg = s.amax(-1), None
    odd = torch.isnan(m) | torch.isposinf(m)
    # rare: a NaN or +inf logit; those rows keep their values through the shift, but other rows do not
    odd_arg = s.max(-1)[1] if bool(odd.any()) else None
    s.sub_(torch.where(torch.isfinite(m), m, 0.0).unsqueeze(-1))
    if arg is None:
        down = K - torch.arange(K, device=s.device, dtype=s.dtype)  # K..1
        # sign + 1 is 1 where the shifted logit is 0 (the max), 0 below; times K - key; its max is K - the first max
        arg = K - torch.sign(s, out=scratch).add_(1.0).mul_(down).amax(-1).nan_to_num_(0.0, 0.0, 0.0).long()
    if odd_arg is not None:
        arg = torch.where(odd, odd_arg, arg)
    return m, arg.clamp_(0, K - 1)


def _bound(forbidden: torch.Tensor, there: float, elsewhere: float, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor of ``forbidden``'s shape: ``there`` where it is True, ``elsewhere`` where it is False."""
    return torch.where(forbidden, there, elsewhere).to(dtype)


def _exp(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` into ``out`` (which may be ``x``), as ``exp2(x * log2(e))``: torch's CPU ``exp`` costs 4.4x its
    ``exp2`` (0.63 against 0.14 ns a float32 on AVX-512). Rounding the product moves each value by at most
    ``|x| * 2^-24`` relative: under 1e-6 for every weight above 1e-7 of its row's largest, and far below a weight's
    own size below that. (A one-block row gets its logits in base 2 from the product itself: ``_one_block``.)"""
    return torch.mul(x, _LOG2E, out=out).exp2_()


def _gather(t: torch.Tensor, key, c: int, d: int, out: torch.Tensor) -> None:
    """``out[..., i] = t[..., i, key_i - c]`` for the rows whose key lies in ``c:d`` (``key`` an int or ``(rows,)``)."""
    if isinstance(key, int):
        if c <= key < d:
            out.copy_(t[..., key - c])
        return
    inside = (key >= c) & (key < d)
    index = (key - c).clamp(0, d - c - 1)
    index = index.view(1, 1, -1, 1).expand(*t.shape[:3], 1) if index.dim() == 1 else index.unsqueeze(-1)
    got = t.gather(-1, index)[..., 0]
    out.copy_(torch.where(inside, got.to(out.dtype), out))


def stats_from_weights(
    weights: torch.Tensor,
    *,
    scores: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    diag_offset: int | None = None,
    query_padding: torch.Tensor | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    rows: torch.Tensor | None = None,
) -> Mapping[str, torch.Tensor]:
    """The same statistics as ``attention_stats``, from full tensors: ``weights`` ``(batch, head, query, key)``,
    ``scores`` (the logits; None: ``max_score`` NaN, finiteness from the weights alone), ``allowed`` ``(batch,
    1 or head, query or 1, key)`` (None: every key allowed), ``v`` ``(batch, head, key, d)`` (each query head's kv
    head) with the observed ``output``, ``sinks`` ``(head,)``. ``rows``: only these query rows, as in
    ``attention_stats`` (the diagonal read at each row's own position)."""
    if rows is not None:
        rows = rows.to(weights.device, torch.long)

        def cut(t: torch.Tensor | None, axis: int = 2) -> torch.Tensor | None:
            return t if t is None or t.shape[axis] == 1 else t.index_select(axis, rows.to(t.device))

        weights, scores, allowed, output = cut(weights), cut(scores), cut(allowed), cut(output)
        query_padding = cut(query_padding, 1)
    B, h, Tq, Tk = weights.shape
    dtype = torch.promote_types(weights.dtype, torch.float32)
    device = weights.device
    counted = _counted_rows(query_padding, B, Tq, device).to(dtype)
    key_weight = torch.zeros(B, h, Tk, device=device, dtype=dtype)
    key_allowed = (
        torch.ones(B, h, Tk, dtype=torch.bool, device=device)
        if allowed is None
        else allowed.any(-2).expand(B, h, Tk).clone()
    )
    dv = None if v is None or output is None else v.shape[-1]
    step = _rows_per_block(B, h, Tk, torch.finfo(dtype).bits // 8, block_bytes)
    parts = []
    with torch.no_grad():
        for a in range(0, Tq, step):
            b = min(a + step, Tq)
            w = weights[:, :, a:b].to(dtype)
            s = None if scores is None else scores[:, :, a:b].to(dtype)
            al = None if allowed is None else (allowed if allowed.shape[2] == 1 else allowed[:, :, a:b]).to(torch.bool)
            acc = _Rows(B, h, a, b, Tk, diag_offset=diag_offset, device=device, dtype=dtype, dv=dv, positions=rows)
            acc.first_key = key_allowed.to(torch.uint8).argmax(-1, keepdim=True)
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
    from ..record import AttentionRecord

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
    if (
        record.v is not None
        and record.output is not None
        and record.num_kv_heads > 0
        and record.num_heads % record.num_kv_heads == 0
    ):
        group = record.num_heads // record.num_kv_heads
        try:
            index = [record.kv_heads.index(hd // group) for hd in record.heads]
        except ValueError:
            index = None
        if index is not None:
            v, output = record.v[:, index], record.output
    return stats_from_weights(
        record.weights,
        scores=record.scores,
        allowed=record.allowed,
        v=v,
        output=output,
        sinks=record.sinks,
        diag_offset=diag,
        query_padding=record.query_padding,
    )
