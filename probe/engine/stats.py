"""Per-row attention statistics without a ``(query x key)`` tensor: the statistics engine.

``attention_stats(call)`` computes, for every selected head and every query row of one attention call
(``probe.engine.attention_math.AttentionCall``), the statistics below, block by block: query rows in blocks,
and keys in blocks too when one row is too long for the byte target, with a running max (flash-style:
pass 1 finds each row's log-normaliser, pass 2 turns each block into exact weights). No tensor larger
than one block (``block_bytes``) is ever made, so memory grows as ``T``, not ``T^2``.

``stats_from_weights(...)`` computes the same statistics from full tensors (a full capture's weights), with an
accumulator of its own written as plainly as the definitions (``_Rows``): the reference the engine is tested
against, and how a full record gets statistics.

Per ``(batch, head, query)`` (``ROW_STATS``):

- ``entropy``: ``-sum w log w`` over the keys (nats);
- ``max_weight``, ``min_weight``, ``argmax_key`` (key index; the first one on ties);
- ``first_key_mass`` (the first key any query may attend: the first one that is not padding), ``diagonal_mass``
  (the query's own key), ``previous_mass`` (the key before it); NaN where that key does not exist
  (cross-attention, the first query);
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
- ``diagonal_allowed``: whether the mask lets the query attend its own key;
- ``first_allowed``, ``last_allowed``: the first and last key index the mask lets the row attend (-1 when none):
  with ``allowed_keys`` and ``key_allowed`` they say which keys a row may attend wherever its mask is one span less
  keys no query attends (what the checks of declarations read, ``probe/checks/intervals.py``).

With ``key_set`` ``(batch, key)`` bool (a subset of the keys, e.g. a picture's patch tokens): ``key_set_mass``
``(batch, head, query)``, each row's weight on those keys, summed block by block like the other masses
(``capture(..., image_grid=)`` stores it as ``record.stats["image_mass"]``).

Per ``(batch, head, key)`` (``KEY_STATS``): ``key_weight``, the weight summed over the query rows that
count (not padding, not empty), and ``key_allowed``, whether any query may attend the key (padding
verdicts). Everything is O(T).

Shapes are written in the notation of ``probe/record.py``: q ``(batch, head, query, d_head)``, k and v
``(batch, kv_head, key, d_head)`` (here each selected query head's kv head, so ``head``), logits and weights
``(batch, head, query, key)``, per-row statistics ``(batch, head, query)``. Inside one block, ``query`` counts the
block's rows and ``key`` its keys.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import torch

from . import native_rows
from .attention_math import AttentionCall, grouped_matmul, per_query_head, sink_logsumexp
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
    "first_allowed",
    "last_allowed",
)
#: Statistics with one value per (batch, head, key).
KEY_STATS: tuple[str, ...] = ("key_weight", "key_allowed")

#: With ``key_set=``: each row's weight on the keys of the set, one value per (batch, head, query).
KEY_SET_STAT = "key_set_mass"

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

#: Rows a block needs for the fused pass (``native_rows.fused``), which computes four rows at a time, unless a head's
#: keys times its size are at most ``_FUSED_FEW_KEYS``. A decoding step's single row then costs four rows' arithmetic
#: and a copy of each head's keys and values (the pass lays them out), which is less than what the row pass adds
#: (its logits and weights tensors, ``e @ v`` and each key's largest ``|v|`` in torch's ops: 0.2-0.3 ms a call at
#: 128-1k keys, 8 heads of 64; ``benchmarks/bench_long.py --decode``). Past it the copies cost more: one row at 16k
#: keys of 64 took 1.3x the row pass's time, at 8k keys 0.96x (32 heads of 128 at 8k keys: 0.78x).
_FUSED_ROWS = 4
_FUSED_FEW_KEYS = 1 << 19

#: What the fused pass's block holds a row and head, statistics and their temporaries (``_Engine.fused_step``).
_FUSED_ROW_BYTES = 256

#: ``exp(x) = exp2(x * log2(e))`` (``_exp``), and back: a max found in base 2 times ln 2 is the natural one.
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _rows_per_block(B: int, h: int, keys: int, itemsize: int, block_bytes: int) -> int:
    """Rows of a block whose rows fit one block of keys: as many as fill ``_CACHE_BYTES``, at least ``_MIN_ROWS``,
    and never more than ``block_bytes`` holds in the block's two buffers (logits, weights)."""
    row = max(1, B * h * keys * itemsize)
    return max(1, min(max(_MIN_ROWS, _CACHE_BYTES // row), block_bytes // (2 * row)))


def _block_plan(B: int, h: int, Tq: int, Tk: int, itemsize: int, block_bytes: int) -> tuple[int, int]:
    """``(rows, keys)`` of one block: every key in one block when a row's keys fit ``block_bytes``
    (``_TEMPORARIES`` of them), else a few rows against blocks of keys."""
    key_block = max(1, block_bytes // max(1, B * h * itemsize * _TEMPORARIES))  # keys of one row that fit
    if key_block >= Tk:
        return _rows_per_block(B, h, Tk, itemsize, block_bytes), key_block
    rows_step = max(1, min(64, Tq))  # one row is longer than the target: a few rows, keys in blocks
    return rows_step, max(1, block_bytes // max(1, B * h * rows_step * itemsize * _TEMPORARIES))


def _counted_rows(query_padding: torch.Tensor | None, B: int, Tq: int, device: torch.device) -> torch.Tensor:
    """``(batch, query)`` float: 1 for the query rows whose weights count in ``key_weight``."""
    if query_padding is None:
        return torch.ones(B, Tq, device=device)
    return (~query_padding.to(device, torch.bool)).float()


def _collect(
    parts: list[dict[str, torch.Tensor]],
    key_weight: torch.Tensor,
    key_allowed: torch.Tensor,
    extra: dict[str, torch.Tensor] | None = None,
) -> Mapping[str, torch.Tensor]:
    """The row statistics of every block of rows, joined along ``query``, with the key statistics (and ``extra``)."""
    names = ROW_STATS + ((KEY_SET_STAT,) if parts and KEY_SET_STAT in parts[0] else ())
    if len(parts) == 1:  # one block of rows (every row of a short input): its tensors as they are
        stats = {name: parts[0][name] for name in names}
    else:
        stats = {name: torch.cat([p[name] for p in parts], dim=2) for name in names}
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
    key_set: torch.Tensor | None = None,
    native: bool = False,
    report: dict | None = None,
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
    ``key_set`` ``(batch, key)`` bool: also ``key_set_mass``, each row's weight on those keys.
    ``native``: float32 blocks on the CPU take their per-element work through the native row pass
    (``probe/engine/native_rows.py``) where it is built; a call its fused pass may take comes in blocks of as many
    rows as its mask's bools and the rows' statistics fit in ``block_bytes`` (``_Engine.fused_step``; a block it
    refuses is taken again in the engine's own blocks). ``report``: a dict that gets ``"native_blocks"``, how many
    blocks the native path took (0: torch's ops alone).

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
    rows_step, key_block = _block_plan(B, h, Tq, Tk, torch.finfo(dtype).bits // 8, block_bytes)
    counted = _counted_rows(query_padding, B, Tq, device).to(dtype)  # (batch, query)
    buffers = {} if workspace is None else workspace
    engine = _Engine(call, diag_offset=diag_offset, buffers=buffers, overview=overview, key_set=key_set, native=native)

    def take(a: int, b: int, *, fused_only: bool = False) -> bool:  # query rows a:b against every key they reach
        reach = call.key_limit(b)
        blocks = [(c, min(c + key_block, reach)) for c in range(0, reach, key_block)]
        return engine.rows(a, b, blocks, counted[:, a:b], fused_only=fused_only)

    step = engine.fused_step(rows_step, key_block, block_bytes)
    with torch.no_grad():
        for a in range(0, Tq, step):
            b = min(a + step, Tq)
            if step > rows_step and take(a, b, fused_only=True):
                continue
            for a_small in range(a, b, rows_step):  # the engine's own blocks (and the fused pass's, refused whole)
                take(a_small, min(a_small + rows_step, b))
    if report is not None:
        report["native_blocks"] = engine.native_blocks
    return engine.result()


def attendable_keys(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_allowed, first)``: ``(batch, head, key)`` bool, whether some query of ``call`` may attend each key
    (``KEY_STATS``' ``key_allowed``), and ``(batch, head, 1)`` long, the first such key (what ``first_key_mass``
    reads; 0 when there is none), read from the call's mask a block of rows at a time."""
    B, h, Tq, Tk = call.shape
    device = call.q.device
    if call.mask is None:
        seen = torch.ones(B, h, Tk, dtype=torch.bool, device=device)  # (batch, head, key)
        if call.causal:
            seen[..., call.key_limit(Tq) if Tq else 0 :] = False
        return seen, torch.zeros(B, h, 1, dtype=torch.long, device=device)
    seen = torch.zeros(B, h, Tk, dtype=torch.bool, device=device)  # (batch, head, key)
    step = max(1, (1 << 24) // max(1, B * h * Tk))
    for a in range(0, Tq, step):
        allowed = call.allowed(a, min(a + step, Tq), 0, Tk)  # (batch or 1, 1 or head, query, key)
        if allowed is not None:  # never None: the call has a mask
            seen |= allowed.any(-2).expand(B, h, Tk)
    return seen, seen.to(torch.uint8).argmax(-1, keepdim=True)


class _FusedMask(NamedTuple):
    """A block's mask as the fused pass takes it: ``start`` and ``limit`` ``(items, query)`` (``limit`` also
    ``(query,)``: a causal mask alone), the first key each row may attend and the first past those (None: 0, every
    key), items being the batch items (or one for all), or the batch items' heads (a mask per head); ``keep``
    ``(items, key)`` the keys some row of each item may attend (None: every key)."""

    start: torch.Tensor | None
    limit: torch.Tensor | None
    keep: torch.Tensor | None
    read: native_rows.Intervals | None
    """The mask read row by row (None: no mask)."""
    heads: int = 1
    """1, or the heads of a mask per head (its items are the batch items' heads)."""


@dataclass(frozen=True)
class _RowBlock:
    """Query rows ``a:b`` of the call: what every key block of theirs reads."""

    a: int
    b: int
    positions: torch.Tensor
    """``(query,)`` long: each row's position among the call's queries (what causal masks count from)."""
    diag: torch.Tensor | None
    """``(query,)`` long: each row's own key (self-attention); None for cross-attention."""
    counted: torch.Tensor
    """``(batch, query)`` float: 1 for the rows whose weights count in ``key_weight`` (not padding)."""


@dataclass(frozen=True)
class _Normaliser:
    """Each row's softmax normaliser, per ``(batch, head, query)``: the weights are ``e / total``, with
    ``e = exp(logit - shift)``, so a sweep over the keys (``_RowSums``) works in units of ``e`` and divides once.

    The engine fills it from each row's largest logit (``shift`` = that max): in one go when the row fits one block,
    else with a running max over the key blocks (``_Engine._running_max``). A sweep that takes each row's logsumexp
    from the model's own kernel fits beside them, with no first pass: ``shift`` = that lse, ``e`` is then the weight
    itself (``p = exp(s - lse)``), ``total`` = 1, ``sum_e`` = 1 less the sinks' share and ``empty`` where the lse
    is ``-inf``; its sweep accumulates the same ``_RowSums`` and finds ``max_score`` and ``argmax`` on the way (set
    with ``dataclasses.replace`` before ``_finish``)."""

    max_score: torch.Tensor
    """The largest logit at an allowed key (natural units; ``-inf``: no key allowed; NaN: a NaN logit)."""
    argmax: torch.Tensor
    """long: the key of the first largest logit."""
    shift: torch.Tensor
    """What every logit of the row is shifted by before ``exp``: the max where it is finite, else 0."""
    sum_e: torch.Tensor
    """``l = sum exp(logit - shift)`` over the row's allowed keys."""
    total: torch.Tensor
    """The normaliser in units of ``e``: ``l``, plus ``exp(sink - shift)`` with attention sinks."""
    inv: torch.Tensor
    """``1 / total``; 0 where ``total`` is (a row with no allowed key)."""
    empty: torch.Tensor
    """bool: the rows with no allowed key, whose max is ``-inf`` (a NaN row is not empty: it is not finite)."""


@dataclass
class _RowSums:
    """What a sweep over the key blocks of query rows accumulates, in units of ``e`` (see ``_Normaliser``); every
    field is ``(batch, head, query)`` unless it says otherwise, and becomes a statistic once divided by the
    normaliser (``_Engine._finish``)."""

    sum_e: torch.Tensor
    """``sum e`` over the keys: the row's weight sum times ``total`` (``row_sum_error``)."""
    dot: torch.Tensor
    """``sum e * logit`` over the allowed keys (forbidden keys count 0): the entropy's second term. Of the logits
    less the row's max when ``dot_shifted``."""
    min_e: torch.Tensor
    """The smallest ``e``; 0 once some key lies beyond the rows' reach."""
    first_e: torch.Tensor
    """``e`` at the first key any query may attend (``first_key_mass``)."""
    diag_e: torch.Tensor
    """``e`` at the row's own key; NaN where it has none (``diagonal_mass``)."""
    prev_e: torch.Tensor
    """``e`` at the key before the row's own; NaN where it has none (``previous_mass``)."""
    first: torch.Tensor
    """long: the first key whose weight exceeds ``WEIGHT_THRESHOLD`` (the key count: none yet)."""
    last: torch.Tensor
    """long: the last such key (-1: none yet)."""
    allowed_keys: torch.Tensor
    """long: the keys the call's mask lets the row attend."""
    diag_allowed: torch.Tensor
    """bool: whether the mask lets the row attend its own key."""
    first_allowed: torch.Tensor
    """long: the first key the mask lets the row attend (the key count: none yet)."""
    last_allowed: torch.Tensor
    """long: the last such key (-1: none yet)."""
    out: torch.Tensor | None = None
    """``(batch, head, query, d_head)``: ``sum e * v`` (None without an observed output, or before a block adds to it:
    ``add_out``)."""
    scale: torch.Tensor | None = None
    """``sum e * max|v|``: what the output's rounding error scales with (None without an observed output)."""
    set_e: torch.Tensor | None = None
    """``sum e`` over the keys of the call's key set (``key_set_mass``; None without one)."""
    dot_shifted: bool = False
    """``dot`` is of the logits less each row's max (the one-block pass): ``_finish`` leaves ``shift`` out of the
    entropy's lse."""

    @classmethod
    def start(
        cls, shape: tuple[int, int, int], keys: int, d_v: int | None, *, device: torch.device, dtype: torch.dtype
    ) -> _RowSums:
        """Nothing summed yet, for rows of ``shape`` ``(batch, head, query)`` among ``keys`` keys; ``d_v``: the
        output's size per head (None: no observed output)."""
        zeros = torch.zeros(shape, device=device, dtype=dtype)
        return cls(
            sum_e=zeros.clone(),
            dot=zeros.clone(),
            min_e=torch.full_like(zeros, math.inf),
            first_e=zeros.clone(),
            diag_e=torch.full_like(zeros, math.nan),
            prev_e=torch.full_like(zeros, math.nan),
            first=torch.full(shape, keys, dtype=torch.long, device=device),
            last=torch.full(shape, -1, dtype=torch.long, device=device),
            allowed_keys=torch.zeros(shape, dtype=torch.long, device=device),
            diag_allowed=torch.zeros(shape, dtype=torch.bool, device=device),
            first_allowed=torch.full(shape, keys, dtype=torch.long, device=device),
            last_allowed=torch.full(shape, -1, dtype=torch.long, device=device),
            scale=None if d_v is None else torch.zeros_like(zeros),
        )

    def add_out(self, out: torch.Tensor) -> None:
        """A block's ``sum e * v`` ``(batch, head, query, d_head)``, a tensor of its own, added to ``out`` (the first
        block's is kept as it is: no zeros to add to)."""
        self.out = out if self.out is None else self.out.add_(out)


@dataclass(frozen=True)
class _Observed:
    """What the output check reads, in the compute dtype: the values and the output the call returned."""

    v: torch.Tensor
    """``(batch, head / group, key, d_head)``: the selected query heads' kv heads (``AttentionCall.kv_group``)."""
    output: torch.Tensor
    """``(batch, head, query, d_head)``: what the attention returned."""
    group: int = 1
    """Heads that read each head of ``v``, consecutive ones."""

    @functools.cached_property
    def v_max(self) -> torch.Tensor:
        """``(batch, head, key)``: each key's largest ``|v|``: ``e @ v_max`` bounds ``max_d (e @ |v|)_d``, what the
        output's rounding error scales with (the larger of the max and minus the min: two reductions, no ``|v|``).
        Taken where a path reads it: the fused pass takes its own, head by head."""
        return self.per_head(torch.maximum(self.v.amax(-1), self.v.amin(-1).neg_()))

    def per_head(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ``(batch, head / group, ...)``, a value per kv head, repeated for each head that reads it."""
        return per_query_head(t, self.group)

    @classmethod
    def of(cls, call: AttentionCall, dtype: torch.dtype) -> _Observed | None:
        if call.output is None or call.v is None:
            return None
        return cls(v=call.v.to(dtype), output=call.output, group=call.kv_group)

    def times_v(self, e: torch.Tensor, c: int, d: int) -> torch.Tensor:
        """``e @ v`` over keys ``c:d``: ``(batch, head, query, key) x (batch, head / group, key, d_head)``."""
        return grouped_matmul(e, self.v[:, :, c:d], self.group)

    def products(self, e: torch.Tensor, c: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e @ v, e @ max|v|)`` over keys ``c:d``, each undivided by the normaliser: the output (a new tensor) and
        its scale. The scale is a matrix-vector product, taken as ``max|v| @ e^T``: the orientation that runs at
        memory speed (``e @ max|v|`` costs as much as ``e @ v``)."""
        # (batch, head, 1, key) x (batch, head, key, query) -> (batch, head, query)
        scale = torch.matmul(self.v_max[:, :, None, c:d], e.transpose(-1, -2)).squeeze(-2)
        return self.times_v(e, c, d), scale  # (batch, head, query, d_head)


class _Logits(NamedTuple):
    """One block of logits, as the two-pass sweep reads them."""

    scores: torch.Tensor
    """``(batch, head, query, key)``: the logits, 0 at forbidden keys (a NaN/inf there must not reach the entropy's
    sum of ``e * logit``, where a NaN/inf at an allowed key must show)."""
    allowed: torch.Tensor | None
    """``(batch or 1, 1 or head, query, key)`` bool; None: every key, or a causal mask alone (counted from the
    rows' positions)."""
    z: torch.Tensor
    """``(batch, head, query, key)``: the softmax input, ``-inf`` at forbidden keys (``scores`` itself when none
    is)."""


class _Forbidden(NamedTuple):
    """Where the rows of one block may not attend, as the one-block pass masks it."""

    allowed: torch.Tensor | None
    """``(batch or 1, 1 or head, query, key)`` bool: the call's mask; None when it has none."""
    forbidden: torch.Tensor | None
    """bool, keys ``c + cut:d`` of the block: True where the row may not attend; None: it may attend every key."""
    cut: int
    """The first key (block-relative) ``forbidden`` covers: a causal mask alone masks only the tile of late keys."""


@dataclass
class _Sweep:
    """What the one sweep of rows whose normaliser the kernel gave carries from key block to key block
    (``_Engine._with_lse``); each tensor ``(batch, head, query)``."""

    lse2: torch.Tensor
    """The kernel's lse in base 2 (0 where it is not finite)."""
    sums: _RowSums
    best: torch.Tensor
    """The largest logit so far, base 2 (``-inf``: none allowed yet)."""
    best_key: torch.Tensor
    """long: its key."""
    whole: bool
    """Every key of the rows in one block."""
    norm: _Normaliser
    """The normaliser the weights are summed per key with until the rows' sums are known."""


#: Largest ``|sum e - 1|`` of a row whose weights were taken with the kernel's lse (``_Engine._with_lse``): kernels
#: compute it within 1e-6 (float32) to 1e-4 (half precision) of the logits' own; further off, it is not theirs.
_LSE_FIT = 1e-3


class _Engine:
    """The statistics of one call, a block of query rows at a time (``rows``).

    When one block holds a row's keys (``_one_block``): the logits, their max, ``e = exp(logit - max)`` and every
    sum in one pass. Else two passes over the key blocks (``_two_passes``): pass 1 finds each row's max ``m`` and
    ``l = sum exp(z - m)`` with a running max, rescaling ``l`` by ``exp(m_old - m_new)`` whenever the max grows
    (flash attention's online softmax); pass 2 turns each key block into ``e = exp(z - m)`` with the final ``m``.
    Either way the weights are ``e / l`` (``l`` plus ``exp(sink - m)`` with attention sinks): every sum is accumulated
    in units of ``e`` (``_RowSums``) and divided once at the end (``_finish``), where ``lse = m + log l`` and the
    entropy ``H = lse - sum(e * z) / l``.

    Weights at forbidden keys are exactly 0 (their logit is ``-inf``, never a finite sentinel: exp of a huge
    negative number is slow on CPUs), so the masked sums need no pass. An empty row of an additive mask is
    uniform over every key (see ``attention_math``): its statistics are written directly (``_uniform_rows``).
    """

    def __init__(
        self,
        call: AttentionCall,
        *,
        diag_offset: int | None,
        buffers: dict,
        overview: Overview | None,
        key_set: torch.Tensor | None = None,
        native: bool = False,
    ) -> None:
        self.call, self.diag_offset, self._buffers = call, diag_offset, buffers
        # the native row pass: float32 on the CPU, without sinks (whose share of the normaliser it does not take)
        self.native = native and call.sinks is None and call.compute_dtype == torch.float32
        self.native = self.native and call.q.device.type == "cpu" and native_rows.available()
        self.native_blocks = 0
        self._fused_keys: native_rows.FusedKeys | None = None  # made on the first block the fused pass takes
        self.B, self.h, self.Tq, self.Tk = call.shape
        self.dtype, self.device = call.compute_dtype, call.q.device
        # (1, head, 1): the sink logits
        self.sinks = None if call.sinks is None else call.sinks.to(self.device, self.dtype).view(1, -1, 1)
        self.observed = _Observed.of(call, self.dtype)
        # an overview's pooled weights cannot be taken back when a row block falls back to the other path
        usable = call.lse is not None and call.sinks is None and overview is None
        self.lse: torch.Tensor | None = None  # (batch, head, query): the kernel's lse in base 2, 0 where not finite
        if usable and call.lse is not None:
            lse2 = call.lse.to(self.device, self.dtype) * _LOG2E  # finfo.min (an additive mask's empty row) -> -inf
            self.lse = lse2.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
        per_key = (self.B, self.h, self.Tk)  # (batch, head, key)
        self.key_weight = torch.zeros(per_key, device=self.device, dtype=self.dtype)
        self.key_allowed = torch.zeros(per_key, dtype=torch.bool, device=self.device)
        self.parts: list[dict[str, torch.Tensor]] = []
        self.first_key = self._first_attendable()  # (batch, head, 1): the key first_key_mass reads
        self.pool = None if overview is None else Pooler(overview, self.B, self.h, self.Tq, self.Tk, self.device)
        # (batch, 1, key, 1): the key set as a column to multiply the weights by (None: no key set)
        self.key_set = None if key_set is None else key_set.to(self.device, self.dtype).view(self.B, 1, self.Tk, 1)

    def _scratch(self, name: str, shape: tuple[int, ...], *, every_key: bool = True) -> torch.Tensor:
        """A ``shape`` view of buffer ``name``, made once at the size of the largest block (the first block of rows
        against every key; ``every_key=False``: the block's own size, when keys come in blocks) and reused by every
        block: blocks of many sizes would otherwise fragment the heap (resident memory 2.5x the plain forward at 16k
        tokens) and page in fresh memory each time."""
        need = math.prod(shape)
        key = (name, self.dtype, self.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < need:
            size = max(need, math.prod(shape[:-1]) * self.Tk) if every_key else need
            buf = self._buffers[key] = torch.empty(size, dtype=self.dtype, device=self.device)
        return buf[:need].view(shape)

    def _first_attendable(self) -> torch.Tensor:
        """``(batch, head, 1)`` the first key some query may attend (0 under a causal mask alone)."""
        if self.call.mask is None:
            return torch.zeros(self.B, self.h, 1, dtype=torch.long, device=self.device)
        return attendable_keys(self.call)[1]

    def fused_step(self, rows_step: int, key_block: int, block_bytes: int) -> int:
        """Rows of a block when the fused pass may take the call (``_fusable``, the kernel's lse, every key in one
        block): it holds no (rows x keys) block, only the mask's bools (one a row and key of each of the mask's items)
        and the rows' statistics, so as many rows as those fit in ``block_bytes`` (each block lays out its heads' keys
        again and costs a few hundred small ops: at 16k tokens, blocks of 64 rows cost 28% of the statistics' time);
        else ``rows_step``."""
        if not (self.native and self.lse is not None and key_block >= self.Tk and self._fusable()):
            return rows_step
        mask, B, h = self.call.mask, self.B, self.h
        per_row = B * h * _FUSED_ROW_BYTES  # the rows' statistics
        if isinstance(mask, torch.Tensor):  # (..., query, key): a mask per head is read per batch item and head
            per_row += (B * h if mask.dim() == 4 and mask.shape[1] > 1 else math.prod(mask.shape[:-2])) * self.Tk
        elif mask is not None:  # a mask function, evaluated per batch item and head at most
            per_row += B * h * self.Tk
        return max(rows_step, min(self.Tq, block_bytes // per_row))

    def rows(
        self, a: int, b: int, blocks: list[tuple[int, int]], counted: torch.Tensor, *, fused_only: bool = False
    ) -> bool:
        """The statistics of query rows ``a:b`` over the key blocks ``blocks`` (``(c, d)``: keys ``c:d``; none when
        the rows reach no key); ``counted`` ``(batch, query)``: the rows that count in ``key_weight``.
        ``fused_only``: the fused pass or nothing (False, nothing added: the caller splits the rows into the engine's
        own blocks, whose (rows x keys) buffers this block's rows would not fit)."""
        positions = self.call.row_positions(a, b)  # (query,)
        diag = None if self.diag_offset is None else positions + self.diag_offset  # (query,)
        block = _RowBlock(a=a, b=b, positions=positions, diag=diag, counted=counted)
        if self.lse is not None and self._with_lse(block, blocks, fused_only=fused_only):
            return True
        if fused_only:
            return False
        if len(blocks) == 1:
            self._one_block(block, *blocks[0])
        else:
            self._two_passes(block, blocks)
        return True

    def _normaliser(self, max_score: torch.Tensor, argmax: torch.Tensor, sum_e: torch.Tensor) -> _Normaliser:
        """The normaliser of rows whose ``e`` were taken less their largest logit ``max_score``."""
        shift = torch.where(torch.isfinite(max_score), max_score, 0.0)  # e = exp(z - shift); -inf rows stay 0
        total = sum_e if self.sinks is None else sum_e + torch.exp(self.sinks - shift)
        inv = torch.where(total > 0, 1.0 / total, 0.0)
        empty = torch.isneginf(max_score)
        return _Normaliser(
            max_score=max_score, argmax=argmax, shift=shift, sum_e=sum_e, total=total, inv=inv, empty=empty
        )

    # ----------------------------------------------------------------------------------------- one block of keys
    def _one_block(self, rows: _RowBlock, c: int, d: int) -> None:
        """Rows whose keys ``c:d`` fit one block: every statistic in one pass over the block, with as few
        full-size passes as the math allows. The logits get ``-inf`` where the row may not attend (a causal mask
        alone: only the tile of keys some row of the block may not see), then their max and its key (``_row_max``: a
        max with indices costs ten times an ``amax`` on CPUs), ``e = exp(logits - max)`` in a second buffer,
        reductions of ``e``, and the first and last key above the threshold (``_hits``). The logits and ``e`` live in
        two buffers reused by every block (``_scratch``)."""
        shape = (self.B, self.h, rows.b - rows.a, d - c)
        mask = self._forbidden(rows, c, d)
        if self.native and self._one_block_native(rows, c, d, mask):
            return
        s, max2, argmax = self._logits_less_max(rows, c, d, mask)  # (batch, head, query, key), base 2
        e = torch.exp2(s, out=self._scratch("weights", shape))  # (batch, head, query, key): exp(logit - max)
        # (batch, head, query) each: the natural logit's max and its key; e = exp(logits - shift) to float rounding
        norm = self._normaliser(max2 * _LN2, argmax + c, e.sum(-1))
        if mask.forbidden is not None:  # the entropy's sum of e * s must see 0 there, not 0 * -inf: the max with 0
            cut = mask.cut  # (batch, head, query, key - cut) below
            torch.maximum(s[..., cut:], _bound(mask.forbidden, 0.0, -math.inf, self.dtype), out=s[..., cut:])
        sums = _RowSums.start(shape[:3], self.Tk, None, device=self.device, dtype=self.dtype)
        sums.sum_e, sums.min_e = norm.sum_e, e.amin(-1)  # (batch, head, query): the block's sums are the rows'
        # (batch, head, query): sum e * (logits - max), forbidden keys 0: the entropy without adding the max and taking
        # it off again; in place: s is only a scratch buffer from here on
        sums.dot, sums.dot_shifted = s.mul_(e).sum(-1).mul_(_LN2), True
        self._fold_hits(sums, e, c, norm, scratch=s)  # s is not read again
        self._gather_masses(sums, e, rows, c, d)
        sums.set_e = self._set_e(e, c, d)
        self._count_allowed(sums, rows, c, d, mask.allowed)
        if d < self.Tk or c > 0:  # keys this block of rows cannot reach weigh 0
            sums.min_e.clamp_(max=0.0)
        self._add_weights(e, rows, c, norm)
        if self.observed is not None:
            sums.out, sums.scale = self.observed.products(e, c, d)
        self.parts.append(self._finish(rows, norm, sums))

    def _one_block_native(self, rows: _RowBlock, c: int, d: int, mask: _Forbidden) -> bool:
        """``_one_block`` with the per-element work in the native row pass (False, nothing added: a row with a NaN or
        +inf logit, which torch's ops take)."""
        real = rows.counted.view(self.B, 1, -1)  # (batch, 1, query): rows with no allowed key add 0 (sum e = 0)
        got, e = self._native_pass(rows, c, d, mask, None, every_key=True, row_weight=real)
        if got is None:
            return False
        norm = self._normaliser(got.max * _LN2, got.arg + c, got.sum)
        sums = _RowSums.start((self.B, self.h, rows.b - rows.a), self.Tk, None, device=self.device, dtype=self.dtype)
        sums.sum_e, sums.min_e = norm.sum_e, got.min
        dot = self._native_counts(sums, rows, c, d, mask, got)  # (batch, head, query), base 2
        sums.dot, sums.dot_shifted = dot.mul_(_LN2), True
        self._fold_found(sums, got.first, got.last, c)
        self._gather_masses(sums, e, rows, c, d)
        sums.set_e = self._set_e(e, c, d)
        if d < self.Tk or c > 0:  # keys this block of rows cannot reach weigh 0
            sums.min_e.clamp_(max=0.0)
        self._add_native_weights(got, e, rows, c, norm)
        if self.observed is not None:
            sums.out, sums.scale = self.observed.times_v(e, c, d), got.scale  # (batch, head, query, d_head)
        self.parts.append(self._finish(rows, norm, sums))
        return True

    def _add_native_weights(
        self, got: native_rows.RowPass, e: torch.Tensor, rows: _RowBlock, c: int, norm: _Normaliser
    ) -> None:
        """``_add_weights`` from the row pass's per-key sums."""
        assert got.col is not None
        self.key_weight[..., c : c + e.shape[-1]] += got.col
        if self.pool is not None:
            self.pool.add(e, rows.a, c, row_scale=norm.inv)

    def _native_pass(
        self,
        rows: _RowBlock,
        c: int,
        d: int,
        mask: _Forbidden,
        shift: torch.Tensor | None,
        *,
        every_key: bool,
        row_weight: torch.Tensor,
    ) -> tuple[native_rows.RowPass | None, torch.Tensor]:
        """The block's base-2 logits (``-inf`` where forbidden) through the native row pass: its row sums, the
        output's scale, the per-key sums of the weights times ``row_weight`` (``(batch, 1 or head, query)``), and
        ``e`` (``(batch, head, query, key)``, in the weights buffer); None where torch's ops must take the block."""
        shape, forbidden, cut = (self.B, self.h, rows.b - rows.a, d - c), mask.forbidden, mask.cut
        logits, weights = (self._scratch(n, shape, every_key=every_key) for n in ("logits", "weights"))
        s = self.call.logits(rows.a, rows.b, c, d, out=logits, times=_LOG2E)  # (batch, head, query, key)
        if forbidden is not None:
            torch.minimum(s[..., cut:], _bound(forbidden, -math.inf, math.inf, self.dtype), out=s[..., cut:])
        if not native_rows.usable(s, weights):  # a float mask or score_mod may hand back a tensor of its own layout
            return None, weights
        whole = shift is None or every_key  # the row's own sum normalises it (else the kernel's lse did)
        vmax = None if self.observed is None else self.observed.v_max[:, :, c:d].contiguous()  # (batch, head, key)
        got = native_rows.row_pass(s, weights, shift, WEIGHT_THRESHOLD, whole=whole, vmax=vmax, row_weight=row_weight)
        self.native_blocks += got is not None
        return got, weights

    def _native_counts(
        self, sums: _RowSums, rows: _RowBlock, c: int, d: int, mask: _Forbidden, got: native_rows.RowPass
    ) -> torch.Tensor:
        """``_count_allowed`` for the block, and the row pass's entropy sum, NaN in rows where an allowed key's logit
        is ``-inf`` (as torch's ops give it: ``-inf * 0``; such a row is not finite)."""
        before = sums.allowed_keys.clone()  # (batch, head, query)
        self._count_allowed(sums, rows, c, d, mask.allowed)
        hidden = (sums.allowed_keys - before) != got.finite  # (batch, head, query)
        return torch.where(hidden, math.nan, got.dot)

    def _forbidden(self, rows: _RowBlock, c: int, d: int) -> _Forbidden:
        """Where rows may not attend among keys ``c:d``: the call's mask, or the tile of keys later than some row's
        own position (a causal mask alone), or nowhere."""
        call = self.call
        allowed = call.allowed(rows.a, rows.b, c, d) if call.mask is not None else None
        if allowed is not None:  # (batch or 1, 1 or head, query, key), usually the same for every head
            return _Forbidden(allowed=allowed, forbidden=~allowed, cut=0)
        if call.causal:  # keys from `lo` on are later than some row's own position: mask that tile only
            limit = rows.positions + call.causal_offset + 1  # (query,): the first key each row may not attend
            # the block's first row has the smallest position (they ascend): known on the host for contiguous rows
            start = rows.a if call.positions is None else int(call.positions[rows.a])
            lo = min(max(start + call.causal_offset + 1 - c, 0), d - c)
            if lo < d - c:
                later = torch.arange(c + lo, d, device=self.device)[None, :] >= limit[:, None]  # (query, key)
                return _Forbidden(allowed=None, forbidden=later, cut=lo)
        return _Forbidden(allowed=None, forbidden=None, cut=0)

    def _logits_less_max(
        self, rows: _RowBlock, c: int, d: int, mask: _Forbidden
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(s, max, key)``: the block's logits in base 2 (times ``log2(e)``, so that ``e`` is one ``exp2``, see
        ``_exp``) with ``-inf`` where the row may not attend, less each row's largest (``s`` ``(batch, head, query,
        key)``, in the logits buffer); that largest, base 2 (``-inf``: no key allowed; NaN: a NaN logit), and its key
        in the block (``(batch, head, query)`` each). The weights buffer is scratch here."""
        shape, forbidden, cut = (self.B, self.h, rows.b - rows.a, d - c), mask.forbidden, mask.cut
        s = self.call.logits(rows.a, rows.b, c, d, out=self._scratch("logits", shape), times=_LOG2E)
        if forbidden is not None:
            # -inf where the row may not attend (never a finite sentinel), as the min with a bound that is -inf there
            # and +inf elsewhere: a masked fill costs ten times as much on CPUs (1 ms against 0.1 for 8 x 12 x 128
            # rows of 128 keys). A NaN logit at a forbidden key survives the min and makes its row's max NaN;
            # blocks with a NaN max are filled again exactly, so that such a logit does not count.
            torch.minimum(s[..., cut:], _bound(forbidden, -math.inf, math.inf, self.dtype), out=s[..., cut:])
        max2, argmax = _row_max(s, scratch=self._scratch("weights", shape))  # s less its max from here on
        if forbidden is not None and bool(torch.isnan(max2).any()):
            s = self.call.logits(rows.a, rows.b, c, d, out=self._scratch("logits", shape), times=_LOG2E)
            s[..., cut:].masked_fill_(forbidden, -math.inf)
            max2, argmax = _row_max(s, scratch=self._scratch("weights", shape))
        return s, max2, argmax

    # ------------------------------------------------------------------------------- keys in blocks: two passes
    def _two_passes(self, rows: _RowBlock, blocks: list[tuple[int, int]]) -> None:
        """Rows whose keys come in blocks: pass 1 the normaliser (``_running_max``), pass 2 every sum, block by
        block, from ``e = exp(z - shift)`` at the final shift."""
        norm = self._running_max(rows, blocks)
        shape = (self.B, self.h, rows.b - rows.a)
        d_v = None if self.observed is None else self.observed.v.shape[-1]
        sums = _RowSums.start(shape, self.Tk, d_v, device=self.device, dtype=self.dtype)
        for c, d in blocks:
            s, allowed, z = self._logits(rows, c, d)  # (batch, head, query, key) each, allowed broadcast
            # (batch, head, query, key) less (batch, head, query, 1); z is not needed again: in place, unless z is
            # the logits themselves (nothing masked)
            x = z - norm.shift[..., None] if z is s else z.sub_(norm.shift[..., None])
            e = _exp(x, out=x)  # (batch, head, query, key): exp(z - shift), 0 at forbidden keys
            sums.sum_e += e.sum(-1)  # (batch, head, query)
            sums.min_e = torch.minimum(sums.min_e, e.amin(-1))  # (batch, head, query)
            self._gather_masses(sums, e, rows, c, d)
            self._add_set_e(sums, e, c, d)
            self._count_allowed(sums, rows, c, d, allowed)
            if self.observed is not None and sums.scale is not None:
                out, scale = self.observed.products(e, c, d)  # (batch, head, query, d_head), (batch, head, query)
                sums.add_out(out)
                sums.scale += scale
            # (batch, head, query): the entropy needs sum e * z over the allowed keys: s (zero at forbidden keys)
            # times e, in place in s, which nothing reads again
            sums.dot += s.mul_(e).sum(-1)
            self._add_weights(e, rows, c, norm)
            self._fold_hits(sums, e, c, norm)
        if not blocks or blocks[-1][1] < self.Tk:  # keys this block of rows cannot reach weigh 0
            sums.min_e.clamp_(max=0.0)
        self.parts.append(self._finish(rows, norm, sums))

    # ------------------------------------------------------------------------- the kernel's normaliser: one sweep
    def _with_lse(self, rows: _RowBlock, blocks: list[tuple[int, int]], *, fused_only: bool = False) -> bool:
        """Rows whose log-normaliser the model's kernel returned (``call.lse``): one sweep over the key blocks, with no
        max to find first and nothing to rescale. Each block's ``e = exp(logit - lse)`` are the weights already; the
        sweep finds each row's largest logit and its key on the way (``_max_key``), and ``_finish`` divides the sums by
        ``sum e``, so the statistics stay normalised exactly whatever the kernel's rounding (its lse is within about
        1e-6 of the logits' in float32, 6e-5 in bfloat16 on CPUs). Only ``key_weight`` of rows longer than one block
        takes the kernel's normaliser as it is (the row's sum is known after its keys are summed into it).

        Rows the fused pass may take (``_fused_takes``) go there first, with no sweep (``_lse_block_fused``).

        False, with nothing added, where some row's ``sum e`` is off 1 by more than ``_LSE_FIT``: the kernel's lse
        does not describe these logits (the caller takes the other path); also, with ``fused_only``, where the fused
        pass does not take the block."""
        assert self.lse is not None and self.call.lse is not None
        if self._fused_takes(rows, blocks) and self._lse_block_fused(rows, blocks[0][1]):
            return True
        if fused_only:
            return False
        B, h, n, a, b = self.B, self.h, rows.b - rows.a, rows.a, rows.b
        d_v = None if self.observed is None else self.observed.v.shape[-1]
        best = torch.full((B, h, n), -math.inf, device=self.device, dtype=self.dtype)
        best_key = torch.zeros((B, h, n), dtype=torch.long, device=self.device)
        ones = torch.ones_like(best)  # (batch, head, query)
        # (batch, head, query): 1 where the kernel's lse is finite (finfo.min in base 2 is not), else 0
        trusted = torch.isfinite(self.call.lse[:, :, a:b].to(self.device, self.dtype) * _LOG2E).to(self.dtype)
        sweep = _Sweep(
            lse2=self.lse[:, :, a:b],  # (batch, head, query), base 2
            sums=_RowSums.start((B, h, n), self.Tk, d_v, device=self.device, dtype=self.dtype),
            best=best,
            best_key=best_key,
            whole=len(blocks) == 1,
            # until the rows' sums are known their weights are e, and rows without a finite kernel lse add nothing
            norm=_Normaliser(best, best_key, ones, ones, ones, trusted, torch.zeros_like(best, dtype=torch.bool)),
        )
        key_weight, self.key_weight = self.key_weight, torch.zeros_like(self.key_weight)  # kept apart until it fits
        try:
            for c, d in blocks:
                self._lse_block(rows, c, d, sweep)
        finally:
            added, self.key_weight = self.key_weight, key_weight
        sums, total = sweep.sums, sweep.sums.sum_e  # (batch, head, query)
        if bool(
            ((total - 1.0).abs() > _LSE_FIT).logical_and_(sums.allowed_keys > 0).logical_and_(total.isfinite()).any()
        ):
            return False
        self.key_weight += added
        if not blocks or blocks[-1][1] < self.Tk or blocks[0][0] > 0:  # keys these rows cannot reach weigh 0
            sums.min_e.clamp_(max=0.0)
        # sum e * (logit - lse), natural units: the entropy is log(sum e) less it over sum e
        sums.dot, sums.dot_shifted = sums.dot.mul_(_LN2), True
        max_score = sweep.best * _LN2  # (batch, head, query)
        lse = sweep.lse2 * _LN2  # (batch, head, query)
        norm = _Normaliser(max_score, sweep.best_key, lse, total, total, _inverse(total), torch.isneginf(max_score))
        self.parts.append(self._finish(rows, norm, sums))
        return True

    def _fused_takes(self, rows: _RowBlock, blocks: list[tuple[int, int]]) -> bool:
        """Whether the fused pass may take the rows: every key they reach in one block, a call it takes
        (``_fusable``), and ``_FUSED_ROWS`` rows at least (it computes four at a time) or few keys (a decoding step)."""
        if not (self.native and len(blocks) == 1 and blocks[0][0] == 0 and self._fusable()):
            return False
        return rows.b - rows.a >= _FUSED_ROWS or blocks[0][1] * self.call.q.shape[-1] <= _FUSED_FEW_KEYS

    def _lse_block(self, rows: _RowBlock, c: int, d: int, sweep: _Sweep) -> None:
        """Keys ``c:d`` of the rows into ``sweep``: ``e = exp(logit - lse)`` and every sum of ``_RowSums``."""
        shape, sums = (self.B, self.h, rows.b - rows.a, d - c), sweep.sums
        mask = self._forbidden(rows, c, d)
        if self.native and self._lse_block_native(rows, c, d, sweep, mask):
            return
        s, block_max, block_key = self._logits_and_max(rows, c, d, mask, every_key=sweep.whole)  # base 2
        sweep.best_key = torch.where(block_max > sweep.best, block_key + c, sweep.best_key)  # strict: first key on ties
        sweep.best = torch.maximum(sweep.best, block_max)  # NaN propagates
        x = s.sub_(sweep.lse2.unsqueeze(-1))  # (batch, head, query, key): log2 of the weights, -inf where forbidden
        e = torch.exp2(x, out=self._scratch("weights", shape, every_key=sweep.whole))  # the weights
        block_sum = e.sum(-1)  # (batch, head, query)
        sums.sum_e = sums.sum_e + block_sum
        sums.min_e = torch.minimum(sums.min_e, e.amin(-1))
        norm = sweep.norm
        if sweep.whole:  # the row's sum is known before its weights are summed per key: exact key_weight
            norm = _Normaliser(
                norm.max_score, norm.argmax, norm.shift, block_sum, block_sum, _inverse(block_sum), norm.empty
            )
        if mask.forbidden is not None:  # e * x must be 0 there, not 0 * -inf
            cut = mask.cut  # (batch, head, query, key - cut) below
            torch.maximum(x[..., cut:], _bound(mask.forbidden, 0.0, -math.inf, self.dtype), out=x[..., cut:])
        sums.dot = sums.dot + x.mul_(e).sum(-1)  # (batch, head, query): sum e * log2(e); x is scratch from here
        self._fold_hits(sums, e, c, norm, scratch=x)
        self._gather_masses(sums, e, rows, c, d)
        self._add_set_e(sums, e, c, d)
        self._count_allowed(sums, rows, c, d, mask.allowed)
        self._add_weights(e, rows, c, norm)
        if self.observed is not None and sums.scale is not None:
            out, scale = self.observed.products(e, c, d)  # (batch, head, query, d_head), (batch, head, query)
            sums.add_out(out)
            sums.scale += scale

    def _lse_block_native(self, rows: _RowBlock, c: int, d: int, sweep: _Sweep, mask: _Forbidden) -> bool:
        """``_lse_block`` with the per-element work in the native row pass (False, nothing added: a row with a NaN
        or +inf logit, which torch's ops take)."""
        real = rows.counted.view(self.B, 1, -1)  # (batch, 1, query): the rows that count in key_weight
        real = real if sweep.whole else real * sweep.norm.inv  # rows without a finite kernel lse add nothing
        got, e = self._native_pass(rows, c, d, mask, sweep.lse2, every_key=sweep.whole, row_weight=real)
        if got is None:
            return False
        sums = sweep.sums
        sweep.best_key = torch.where(got.max > sweep.best, got.arg + c, sweep.best_key)  # strict: first key on ties
        sweep.best = torch.maximum(sweep.best, got.max)
        sums.sum_e = sums.sum_e + got.sum
        sums.min_e = torch.minimum(sums.min_e, got.min)
        norm = sweep.norm
        if sweep.whole:  # the row's sum is known before its weights are summed per key: exact key_weight
            norm = _Normaliser(norm.max_score, norm.argmax, norm.shift, got.sum, got.sum, _inverse(got.sum), norm.empty)
        sums.dot = sums.dot + self._native_counts(sums, rows, c, d, mask, got)
        self._fold_found(sums, got.first, got.last, c)
        self._gather_masses(sums, e, rows, c, d)
        self._add_set_e(sums, e, c, d)
        self._add_native_weights(got, e, rows, c, norm)
        if self.observed is not None and sums.scale is not None:
            sums.add_out(self.observed.times_v(e, c, d))  # (batch, head, query, d_head)
            sums.scale += got.scale
        return True

    def _fusable(self) -> bool:
        """Whether the fused pass may take this call's blocks: plain logits (no bias, softcapping or score_mod; no
        mask but a causal one, a boolean one or a mask function such as flex's BlockMask, whose form each block checks:
        ``_fused_mask``), no overview, no key set."""
        call, mask = self.call, self.call.mask
        boolean = mask is None or callable(mask) or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool)
        plain = boolean and call.bias is None and call.softcap is None and call.score_mod is None
        return plain and self.pool is None and self.key_set is None

    def _fused_mask(self, rows: _RowBlock, d: int) -> _FusedMask | None:
        """The block's mask as the fused pass takes it (``_FusedMask``): an interval of keys for each row of each
        batch item (causal, a sliding window, packed documents) and keys no row of the item may attend (padding).
        A mask per head is read per batch item and head. None where the call's boolean mask is not of that form (a
        hole inside one row's interval that other rows of its item attend): every row is compared whole with the
        form before the pass takes it (``native_rows.intervals``: two passes of one C loop a row over the mask, the
        counts of ``_count_allowed`` on the way)."""
        call = self.call
        if call.mask is None:
            return _FusedMask(None, rows.positions + call.causal_offset + 1 if call.causal else None, None, None)
        allowed = call.allowed(rows.a, rows.b, 0, d)  # (batch or 1, 1 or head, query, key)
        if allowed is None:
            return None
        n, per_head = rows.b - rows.a, allowed.shape[1] > 1
        if per_head:  # (batch x head, query, key): a mask per head is one per batch item and head (a copy if need be)
            a = allowed.expand(self.B, self.h, n, d).reshape(self.B * self.h, n, d)
        else:  # (batch or 1, query, key): a row for each
            a = allowed[:, 0].expand(allowed.shape[0], n, d)
        got = native_rows.intervals(a)
        if got is None or not got.fits:
            return None
        # the intervals alone where no key inside one is cut (padding at either end is one)
        inner = bool((got.counts == got.limit - got.start).all())
        return _FusedMask(got.start, got.limit, None if inner else got.keep, got, self.h if per_head else 1)

    def _fused_keys_of(self) -> native_rows.FusedKeys:
        if self._fused_keys is None:
            G, obs = self.B * self.h, self.observed
            self._fused_keys = native_rows.FusedKeys.of(
                self.call.k,  # (batch, head / group, key, d): read through its strides
                v=None if obs is None else obs.v,  # (batch, head / group, key, d_v)
                group=self.call.kv_group,
                first_key=self.first_key.expand(self.B, self.h, 1).reshape(G).contiguous(),  # (heads,)
            )
        return self._fused_keys

    def _lse_block_fused(self, rows: _RowBlock, d: int) -> bool:
        """Every statistic of rows whose keys ``0:d`` are one block, in the fused pass (``native_rows.fused``: ``q @
        k``, the row pass and ``e @ v`` in tiles of keys that stay in the cache), its last step too: the pass writes
        each row's statistics as ``_finish`` gives them (``native_rows.FinalStats``), so that a call of short rows
        costs a few torch ops, not a hundred (8 x 128 tokens of MiniLM: about 2 ms a layer went to ``(batch, head,
        query)`` ops of 10-30 us each). False, nothing added: a row with a NaN or +inf logit (torch's ops take it), or
        a row whose ``sum e`` is off 1 by more than ``_LSE_FIT`` (the sweep finds it again and refuses the lse)."""
        assert self.lse is not None
        masked = self._fused_mask(rows, d)
        if masked is None:
            return False
        call, B, h, n = self.call, self.B, self.h, rows.b - rows.a
        final = native_rows.FinalStats.empty(B * h, n)
        got = native_rows.fused(
            call.q[:, :, rows.a : rows.b],  # (batch, head, query, d): read through its strides
            self._fused_keys_of(),
            self.lse[:, :, rows.a : rows.b].reshape(B * h, n).contiguous(),  # (heads, query), base 2
            q_scale=call.scaling * _LOG2E,
            start=masked.start,
            limit=masked.limit,
            counts=None if masked.read is None else masked.read.counts,
            diag=None if rows.diag is None else rows.diag.to(torch.int64).contiguous(),
            # (heads, query): the rows that count in key_weight
            row_weight=rows.counted.view(B, 1, n).expand(B, h, n).reshape(B * h, n),
            K=d,
            threshold=WEIGHT_THRESHOLD,
            keep=masked.keep,
            output=None if self.observed is None else self.observed.output[:, :, rows.a : rows.b],
            final=final,
            fit=_LSE_FIT,
        )
        if got is None:
            return False
        self.native_blocks += 1
        assert got[0].col is not None
        self.key_weight[..., :d] += got[0].col.view(B, h, d)
        if masked.read is not None:  # keys some row of the item may attend
            self.key_allowed[..., :d] |= masked.read.keep.view(-1, masked.heads, d)
        else:  # every key, or those a causal mask lets some row see
            self.key_allowed[..., : min(d, call.key_limit(rows.b)) if call.causal else d] = True
        self.parts.append(final.named(B, h, n))
        return True

    def _logits_and_max(
        self, rows: _RowBlock, c: int, d: int, mask: _Forbidden, *, every_key: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(s, max, key)``: the block's logits in base 2 with ``-inf`` where the row may not attend (``(batch,
        head, query, key)``, in the logits buffer), each row's largest and its key in the block (``(batch, head,
        query)`` each, ``_max_key``); the weights buffer is scratch here. A NaN logit at a forbidden key does not
        count (see ``_logits_less_max``)."""
        shape, forbidden, cut = (self.B, self.h, rows.b - rows.a, d - c), mask.forbidden, mask.cut
        logits, weights = (self._scratch(n, shape, every_key=every_key) for n in ("logits", "weights"))
        s = self.call.logits(rows.a, rows.b, c, d, out=logits, times=_LOG2E)
        if forbidden is not None:
            torch.minimum(s[..., cut:], _bound(forbidden, -math.inf, math.inf, self.dtype), out=s[..., cut:])
        block_max, key = _max_key(s, scratch=weights)
        if forbidden is not None and bool(torch.isnan(block_max).any()):
            s = self.call.logits(rows.a, rows.b, c, d, out=logits, times=_LOG2E)
            s[..., cut:].masked_fill_(forbidden, -math.inf)
            block_max, key = _max_key(s, scratch=weights)
        return s, block_max, key

    def _running_max(self, rows: _RowBlock, blocks: list[tuple[int, int]]) -> _Normaliser:
        """Pass 1: each row's largest logit ``m``, its key and ``l = sum exp(z - m)``, block by block: the sum so far
        is rescaled by ``exp(m_old - m_new)`` whenever a block raises the max."""
        shape = (self.B, self.h, rows.b - rows.a)
        m = torch.full(shape, -math.inf, device=self.device, dtype=self.dtype)  # (batch, head, query)
        argmax = torch.zeros(shape, dtype=torch.long, device=self.device)  # (batch, head, query)
        sum_e = torch.zeros_like(m)  # (batch, head, query)
        for c, d in blocks:
            z = self._logits(rows, c, d).z  # (batch, head, query, key)
            block_max, block_arg = z.max(-1)  # (batch, head, query) each
            new_max = torch.maximum(m, block_max)  # (batch, head, query)
            argmax = torch.where(block_max > m, block_arg + c, argmax)  # strict: the first key keeps a tie
            safe = torch.where(torch.isfinite(new_max), new_max, 0.0)  # (batch, head, query)
            # (batch, head, query): exp(m_old - m_new), 0 where there was no finite max yet
            rescale = torch.exp(torch.where(torch.isfinite(m), m - safe, -math.inf))
            # (batch, head, query) + (batch, head, query, key) summed over the keys
            sum_e = sum_e * rescale + torch.exp(z - safe[..., None]).sum(-1)
            m = new_max
        return self._normaliser(m, argmax, sum_e)

    def _logits(self, rows: _RowBlock, c: int, d: int) -> _Logits:
        """Keys ``c:d`` of the rows: their logits (0 where forbidden), the mask, and the softmax input (-inf where
        forbidden)."""
        call = self.call
        s = call.logits(rows.a, rows.b, c, d)  # (batch, head, query, key)
        allowed = call.allowed(rows.a, rows.b, c, d) if call.mask is not None else None
        # a causal mask alone (or nothing): built as "later than the query", no negation
        forbidden = ~allowed if allowed is not None else call.forbidden(rows.a, rows.b, c, d)
        if forbidden is None:
            return _Logits(scores=s, allowed=allowed, z=s)
        z = s.masked_fill(forbidden, -math.inf)
        # the logits at forbidden keys no longer matter (their weight is 0): zero them, so that a NaN/inf there
        # cannot reach the entropy's sum of e * s, where a NaN/inf at an allowed key must show
        return _Logits(scores=s.masked_fill_(forbidden, 0.0), allowed=allowed, z=z)

    # ----------------------------------------------------------------------------------- sums over a key block
    def _gather_masses(self, sums: _RowSums, e: torch.Tensor, rows: _RowBlock, c: int, d: int) -> None:
        """``e`` at the first attendable key, the row's own key and the one before it, where they lie in ``c:d``."""
        _gather(e, self.first_key.expand(*e.shape[:3]), c, d, sums.first_e)
        if rows.diag is not None:
            _gather(e, rows.diag, c, d, sums.diag_e)
            _gather(e, rows.diag - 1, c, d, sums.prev_e)

    def _set_e(self, e: torch.Tensor, c: int, d: int) -> torch.Tensor | None:
        """``sum e`` over the keys of ``c:d`` in the key set, per ``(batch, head, query)``; None without a key set."""
        if self.key_set is None:
            return None
        # (batch, head, query, key) x (batch, 1, key, 1) -> (batch, head, query, 1)
        return e.matmul(self.key_set[:, :, c:d]).squeeze(-1)

    def _add_set_e(self, sums: _RowSums, e: torch.Tensor, c: int, d: int) -> None:
        """Keys ``c:d``'s ``sum e`` over the key set into ``sums.set_e`` (every sweep that runs over blocks of keys)."""
        block_set = self._set_e(e, c, d)
        if block_set is not None:
            sums.set_e = block_set if sums.set_e is None else sums.set_e + block_set

    def _count_allowed(self, sums: _RowSums, rows: _RowBlock, c: int, d: int, allowed: torch.Tensor | None) -> None:
        """The keys ``c:d`` the rows may attend: ``allowed_keys`` and ``diag_allowed`` per row, ``key_allowed`` per
        key. ``allowed``: the call's mask over the block; None: every key, or a causal mask alone, counted from the
        rows' positions."""
        call, (B, h, n) = self.call, sums.allowed_keys.shape
        if allowed is None:
            # (query,): the first key each row may not attend
            limit = rows.positions + call.causal_offset + 1 if call.causal else torch.full_like(rows.positions, d)
            sums.allowed_keys += (limit.clamp(c, d) - c).view(1, 1, -1)
            some = (limit > c).view(1, 1, -1)  # (1, 1, query): the row may attend keys from c on
            sums.first_allowed = torch.where(some, torch.clamp(sums.first_allowed, max=c), sums.first_allowed)
            last = (limit.clamp(max=d) - 1).view(1, 1, -1)  # (1, 1, query)
            sums.last_allowed = torch.where(some, torch.maximum(sums.last_allowed, last), sums.last_allowed)
            reach = min(d, call.key_limit(rows.b)) if call.causal else d
            self.key_allowed[..., c : max(c, reach)] = True
            if rows.diag is not None:
                sums.diag_allowed |= ((rows.diag >= c) & (rows.diag < d) & (rows.diag < limit)).view(1, 1, -1)
            return
        sums.allowed_keys += allowed.sum(-1, dtype=torch.long).expand(B, h, n)
        some = allowed.any(-1)  # (batch or 1, 1 or head, query)
        first = torch.where(some, _first_true(allowed) + c, self.Tk).expand(B, h, n)
        last = torch.where(some, _last_true(allowed) + c, -1).expand(B, h, n)
        sums.first_allowed = torch.minimum(sums.first_allowed, first)
        sums.last_allowed = torch.maximum(sums.last_allowed, last)
        self.key_allowed[..., c:d] |= allowed.any(-2).expand(B, h, d - c)
        if rows.diag is not None:
            # (batch or 1, 1 or head, query, key): a mask the same for every query, as a view
            per_row = allowed.expand(*allowed.shape[:2], n, d - c)
            got = torch.zeros(per_row.shape[:3], dtype=torch.bool, device=self.device)  # (batch or 1, 1 or head, query)
            _gather(per_row, rows.diag, c, d, got)
            sums.diag_allowed |= got

    def _fold_hits(
        self, sums: _RowSums, e: torch.Tensor, c: int, norm: _Normaliser, *, scratch: torch.Tensor | None = None
    ) -> None:
        """The first and last key of ``c:`` whose weight exceeds ``WEIGHT_THRESHOLD`` (``e`` undivided, the
        threshold times the normaliser), folded into ``first`` and ``last``."""
        first, last = _hits(e, WEIGHT_THRESHOLD * norm.total, scratch=scratch)  # (batch, head, query), -1: none
        self._fold_found(sums, first, last, c)

    @staticmethod
    def _fold_found(sums: _RowSums, first: torch.Tensor, last: torch.Tensor, c: int) -> None:
        """The first and last hit of a block of keys from ``c`` on (``(batch, head, query)``, -1: none) into
        ``sums``."""
        sums.first = torch.where(first >= 0, torch.minimum(sums.first, first + c), sums.first)
        sums.last = torch.where(last >= 0, torch.maximum(sums.last, last + c), sums.last)

    def _add_weights(self, e: torch.Tensor, rows: _RowBlock, c: int, norm: _Normaliser) -> None:
        """The block's weights ``e / total`` summed into ``key_weight`` over the rows that count, and pooled into
        the overview."""
        real = rows.counted.view(self.B, 1, -1) * ~norm.empty  # (batch, head, query): rows that count
        # (batch, head, 1, query) x (batch, head, query, key) -> (batch, head, key)
        self.key_weight[..., c : c + e.shape[-1]] += (real * norm.inv).unsqueeze(-2).matmul(e).squeeze(-2)
        if self.pool is not None:
            self.pool.add(e, rows.a, c, row_scale=norm.inv)

    # -------------------------------------------------------------------------------------------- the statistics
    def _finish(self, rows: _RowBlock, norm: _Normaliser, sums: _RowSums) -> dict[str, torch.Tensor]:
        """The row statistics (``ROW_STATS``, each ``(batch, head, query)``): the sums divided by the normaliser."""
        m, shift, inv, empty = norm.max_score, norm.shift, norm.inv, norm.empty
        # (batch, head, query): each row's weight sum, 1 less the sink's share
        expected = 1.0 if self.sinks is None else 1.0 - torch.exp(self.sinks - shift) / norm.total
        # (batch, head, query): entropy = log(total) + shift - sum(e * z) / total, with the shift taken out of both
        # where it was
        lse = torch.log(norm.total) + (0.0 if sums.dot_shifted else shift)
        stats = {  # each (batch, head, query)
            "entropy": torch.where(norm.sum_e > 0, lse * (norm.sum_e * inv) - sums.dot * inv, 0.0),
            "max_weight": torch.where(empty, 0.0, torch.exp(m - shift) * inv),
            "min_weight": sums.min_e * inv,
            "argmax_key": torch.where(empty, 0, norm.argmax),
            "first_key_mass": sums.first_e * inv,
            "diagonal_mass": sums.diag_e * inv,
            "previous_mass": sums.prev_e * inv,
            "masked_mass": torch.zeros_like(m),
            "masked_max": torch.zeros_like(m),
            "row_sum_error": (sums.sum_e * inv - expected).abs(),
            "max_score": m,
            "first_key": torch.where(sums.first >= self.Tk, -1, sums.first),
            "last_key": sums.last,
            "allowed_keys": sums.allowed_keys,
            "diagonal_allowed": sums.diag_allowed,
            "first_allowed": torch.where(sums.first_allowed >= self.Tk, -1, sums.first_allowed),
            "last_allowed": sums.last_allowed,
        }
        if self.key_set is not None:  # (batch, head, query): no key of the set in reach sums to 0
            stats[KEY_SET_STAT] = (torch.zeros_like(m) if sums.set_e is None else sums.set_e) * inv
        finite = torch.isfinite(sums.dot) & torch.isfinite(norm.total) & ~torch.isnan(m)  # (batch, head, query)
        finite = finite | (empty & (sums.dot == 0))
        error = None
        if self.observed is not None and sums.scale is not None:
            obs = self.observed.output[:, :, rows.a : rows.b].to(self.dtype)  # (batch, head, query, d_head)
            out = torch.zeros_like(obs) if sums.out is None else sums.out  # ours (no block: nothing added)
            error = out.mul_(inv[..., None]).sub_(obs).abs_().amax(-1)
        if error is not None and sums.scale is not None:
            stats["output_error"] = error
            stats["output_scale"] = sums.scale * inv
            finite &= torch.isfinite(stats["output_error"])  # NaN/inf in the observed row (or in v) reaches it
        else:
            stats["output_error"] = torch.full_like(m, math.nan)
            stats["output_scale"] = torch.full_like(m, math.nan)
        if self.call.additive and self.sinks is None:  # an empty row of an additive mask is uniform over every key
            stats = self._uniform_rows(stats, rows, empty)
            if self.pool is not None:
                self.pool.add_uniform(empty, rows.a, 1.0 / self.Tk)
        stats["finite"] = finite
        return stats

    def _uniform_rows(self, stats: dict, rows: _RowBlock, empty: torch.Tensor) -> dict[str, torch.Tensor]:
        """``stats`` with the rows ``empty`` (``(batch, head, query)``) uniform over every key."""
        Tk, u, diag = self.Tk, 1.0 / self.Tk, rows.diag
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
        if self.key_set is not None:  # (batch, 1, 1): the share of every key that is in the set
            share = self.key_set.sum(2) / Tk
            out[KEY_SET_STAT] = torch.where(empty, share, stats[KEY_SET_STAT])
        if diag is not None:
            out["diagonal_mass"] = torch.where(empty & (diag < Tk), u, stats["diagonal_mass"])
            out["previous_mass"] = torch.where(empty & (diag >= 1) & (diag - 1 < Tk), u, stats["previous_mass"])
        if self.observed is not None:
            mean = self.observed.per_head(self.observed.v.mean(-2, keepdim=True))  # (batch, head, 1, d_head)
            obs = self.observed.output[:, :, rows.a : rows.b].to(self.dtype)  # (batch, head, query, d_head)
            err = (mean - obs).abs().amax(-1)  # (batch, head, query)
            out["output_error"] = torch.where(empty, err, stats["output_error"])
            scale = self.observed.v_max.mean(-1, keepdim=True)  # (batch, head, 1)
            out["output_scale"] = torch.where(empty, scale, stats["output_scale"])
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
        x = torch.sub(e, threshold.unsqueeze(-1), out=scratch).sign_()  # (..., K): 1 above, 0 at, -1 below, NaN
        up = torch.arange(1, K + 1, device=e.device, dtype=e.dtype)  # (K,): 1..K
        last = x.mul_(up).amax(-1)  # (...): last hit + 1, <= 0 when there is none
        first = x.sign_().mul_(up.flip(0)).amax(-1)  # (...): K - first hit (the signs back, times K..1)
        some = last > 0  # (...)
        return torch.where(some, K - first, -1).long(), torch.where(some, last - 1, -1).long()
    threshold = threshold.unsqueeze(-1)  # (..., 1)
    in_chunk = _chunk_max(e) > threshold  # (..., chunks)
    some = in_chunk.any(-1)  # (...)
    values, keys = _inside(e, _first_true(in_chunk))  # (..., _CHUNK) each: the first chunk with a hit
    first = keys.gather(-1, _first_true((values > threshold) & (keys < K)).unsqueeze(-1)).squeeze(-1)  # (...)
    values, keys = _inside(e, _last_true(in_chunk))  # (..., _CHUNK) each: the last chunk with a hit
    last = keys.gather(-1, _last_true((values > threshold) & (keys < K)).unsqueeze(-1)).squeeze(-1)  # (...)
    return torch.where(some, first, -1), torch.where(some, last, -1)


def _inverse(total: torch.Tensor) -> torch.Tensor:
    """``1 / total``, 0 where ``total`` is 0 (a row with no allowed key)."""
    return torch.where(total > 0, 1.0 / total, 0.0)


def _long_row_max(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, key)`` ``(...)`` of each row of ``s`` ``(..., K)``, ``K >= _LONG_ROW``, by chunk maxima: the first chunk
    that holds the max, then inside it (NaN and +inf rows: see ``_row_max``)."""
    K = s.shape[-1]
    chunks = _chunk_max(s)  # (..., chunks)
    m = chunks.amax(-1)  # (...)
    values, keys = _inside(s, _first_true(chunks == m.unsqueeze(-1)))  # (..., _CHUNK) each
    arg = keys.gather(-1, _first_true((values == m.unsqueeze(-1)) & (keys < K)).unsqueeze(-1)).squeeze(-1)
    return m, arg


def _max_key(s: torch.Tensor, *, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, key)`` ``(...)`` of each row of ``s`` ``(..., K)`` as ``_row_max`` finds them, leaving ``s`` as it is
    (short rows work in ``scratch``, a buffer of ``s``'s shape)."""
    K = s.shape[-1]
    if K >= _LONG_ROW:
        m, arg = _long_row_max(s)
    else:
        m = s.amax(-1)  # (...)
        down = K - torch.arange(K, device=s.device, dtype=s.dtype)  # (K,): K..1
        shifted = torch.sub(s, torch.where(torch.isfinite(m), m, 0.0).unsqueeze(-1), out=scratch)  # (..., K)
        arg = K - shifted.sign_().add_(1.0).mul_(down).amax(-1).nan_to_num_(0.0, 0.0, 0.0).long()
    odd = torch.isnan(m) | torch.isposinf(m)  # (...): rare, a NaN or +inf logit
    if bool(odd.any()):
        arg = torch.where(odd, s.max(-1)[1], arg)
    return m, arg.clamp_(0, K - 1)


def _row_max(s: torch.Tensor, *, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, key)`` ``(...)`` of each row of ``s`` ``(..., K)``, the key of the first max as a max with indices gives
    it (costs ten times an ``amax`` on CPUs); and ``s`` minus its row's max, in place (rows whose max is not finite
    keep their values). Long rows by chunk maxima (the first chunk that holds the max, then inside it), which also
    give the max; short rows by float arithmetic over the shifted block (see ``_hits``; ``scratch``: a buffer of
    ``s``'s shape to work in). Rows whose max is NaN or +inf take the max with indices (that NaN's or inf's key);
    rows with no allowed key (max ``-inf``) get some key, which callers replace."""
    K = s.shape[-1]
    if K >= _LONG_ROW:
        m, arg = _long_row_max(s)
    else:
        m, arg = s.amax(-1), None  # (...)
    odd = torch.isnan(m) | torch.isposinf(m)  # (...)
    # rare: a NaN or +inf logit; those rows keep their values through the shift, but other rows do not
    odd_arg = s.max(-1)[1] if bool(odd.any()) else None  # (...)
    s.sub_(torch.where(torch.isfinite(m), m, 0.0).unsqueeze(-1))  # (..., K) less (..., 1)
    if arg is None:
        down = K - torch.arange(K, device=s.device, dtype=s.dtype)  # (K,): K..1
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


def _gather(t: torch.Tensor, key: int | torch.Tensor, c: int, d: int, out: torch.Tensor) -> None:
    """``out[..., i] = t[..., i, key_i - c]`` for the rows whose key lies in ``c:d``: ``t`` ``(batch, head, query,
    key)`` (keys ``c:d``), ``key`` an int, ``(query,)`` or ``(batch, head, query)``, ``out`` ``(batch, head,
    query)``."""
    if isinstance(key, int):
        if c <= key < d:
            out.copy_(t[..., key - c])
        return
    inside = (key >= c) & (key < d)  # like key
    index = (key - c).clamp(0, d - c - 1)
    index = index.view(1, 1, -1, 1).expand(*t.shape[:3], 1) if index.dim() == 1 else index.unsqueeze(-1)
    got = t.gather(-1, index)[..., 0]  # (batch, head, query)
    out.copy_(torch.where(inside, got.to(out.dtype), out))


# --------------------------------------------------------------------------------- from full weights (reference)
class _Rows:
    """Statistics of query rows ``a:b`` from their full weights, accumulated over key blocks as the definitions read
    (the reference the engine is tested against; ``stats_from_weights``). Every field is ``(batch, head, query)``
    unless it says otherwise."""

    def __init__(
        self,
        B: int,
        h: int,
        a: int,
        b: int,
        Tk: int,
        *,
        diag_offset: int | None,
        device: torch.device,
        dtype: torch.dtype,
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
        self.first_allowed = torch.full((B, h, n), Tk, dtype=torch.long, device=device)
        self.last_allowed = torch.full((B, h, n), -1, dtype=torch.long, device=device)
        nan = torch.full_like(z, math.nan)
        self.first_mass, self.diag_mass, self.prev_mass = nan.clone(), nan.clone(), nan.clone()
        self.diag_allowed = torch.zeros(B, h, n, dtype=torch.bool, device=device)
        self.max_score = torch.full_like(z, -math.inf)
        self.min_score = torch.full_like(z, math.inf)
        # (query,) key index of each row's own key (self-attention), else None
        rows = torch.arange(a, b, device=device) if positions is None else positions[a:b].to(device)
        self.diag = None if diag_offset is None else rows + diag_offset
        # (batch, head, query, d_head): weights @ v, and |weights| @ max|v| (None without an observed output)
        self.out = None if dv is None else torch.zeros(B, h, n, dv, device=device, dtype=dtype)
        self.scale = None if dv is None else torch.zeros(B, h, n, device=device, dtype=dtype)
        self.first_key: torch.Tensor | None = None  # (batch, head, 1) the first key any query may attend; None = 0

    def add(
        self,
        w: torch.Tensor,
        c: int,
        *,
        scores: torch.Tensor | None,
        allowed: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> None:
        """Fold in keys ``c:c + w.shape[-1]``: weights ``w`` ``(batch, head, query, key)``, the logits ``scores``
        (None: unknown), ``allowed`` (None: every key allowed), ``v`` ``(batch, head, key, d_head)``."""
        d = c + w.shape[-1]
        keys = torch.arange(c, d, device=w.device)  # (key,)
        self.sum += w.sum(-1)
        self.entropy -= torch.special.xlogy(w, w).sum(-1)
        bmax, barg = w.max(-1)
        better = bmax > self.max  # strict: the first key keeps a tie
        self.argmax = torch.where(better, barg + c, self.argmax)
        self.max = torch.maximum(self.max, bmax)  # NaN propagates
        self.min = torch.minimum(self.min, w.amin(-1))
        hit = w > WEIGHT_THRESHOLD  # (batch, head, query, key)
        self.first = torch.minimum(self.first, torch.where(hit, keys, self.Tk).amin(-1))
        self.last = torch.maximum(self.last, torch.where(hit, keys, -1).amax(-1))
        _gather(w, 0 if self.first_key is None else self.first_key.expand(*w.shape[:3]), c, d, self.first_mass)
        if self.diag is not None:
            _gather(w, self.diag, c, d, self.diag_mass)
            _gather(w, self.diag - 1, c, d, self.prev_mass)
        if allowed is None:
            self.allowed_keys += d - c
            self.first_allowed.clamp_(max=c)
            self.last_allowed.clamp_(min=d - 1)
            if self.diag is not None:
                self.diag_allowed |= ((self.diag >= c) & (self.diag < d)).view(1, 1, -1)
        else:
            allowed = allowed.expand(*w.shape[:2], *allowed.shape[2:]) if allowed.shape[1] != w.shape[1] else allowed
            self.allowed_keys += allowed.sum(-1).expand_as(self.allowed_keys)
            index = torch.where(allowed, keys, self.Tk).amin(-1).expand_as(self.first_allowed)  # (batch, head, query)
            self.first_allowed = torch.minimum(self.first_allowed, index)
            index = torch.where(allowed, keys, -1).amax(-1).expand_as(self.last_allowed)  # (batch, head, query)
            self.last_allowed = torch.maximum(self.last_allowed, index)
            if self.diag is not None:
                got = torch.zeros_like(self.diag_allowed)
                _gather(allowed.expand(*w.shape), self.diag, c, d, got)
                self.diag_allowed |= got
            outside = torch.where(allowed, 0.0, w)  # (batch, head, query, key): the weights at forbidden keys
            self.masked_mass += outside.sum(-1)
            self.masked_max = torch.maximum(self.masked_max, outside.amax(-1))
        if scores is not None:
            if allowed is None:
                self.max_score = torch.maximum(self.max_score, scores.amax(-1))
                self.min_score = torch.minimum(self.min_score, scores.amin(-1))
            else:
                self.max_score = torch.maximum(self.max_score, torch.where(allowed, scores, -math.inf).amax(-1))
                self.min_score = torch.minimum(self.min_score, torch.where(allowed, scores, math.inf).amin(-1))
        if v is not None and self.out is not None and self.scale is not None:
            vb = v[:, :, c:d].to(w.dtype)  # (batch, head, key, d_head)
            self.out += w @ vb
            self.scale += (w.abs() @ vb.abs().amax(-1, keepdim=True)).squeeze(-1)

    def finish(
        self,
        *,
        expected: torch.Tensor | float,
        output: torch.Tensor | None,
        scores_known: bool,
    ) -> dict[str, torch.Tensor]:
        """The row statistics (``ROW_STATS``); ``expected``: each row's weight sum, ``output`` the observed one."""
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
            "first_allowed": torch.where(self.first_allowed >= self.Tk, -1, self.first_allowed),
            "last_allowed": self.last_allowed,
        }
        if output is not None and self.out is not None and self.scale is not None:
            obs = output[:, :, self.a : self.b].to(self.out.dtype)  # (batch, head, query, d_head)
            out["output_error"] = (self.out - obs).abs().amax(-1)
            out["output_scale"] = self.scale
            finite &= torch.isfinite(obs).all(-1)
        else:
            nan = torch.full_like(self.max, math.nan)
            out["output_error"], out["output_scale"] = nan, nan.clone()
        out["finite"] = finite
        return out


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
    key_set: torch.Tensor | None = None,
) -> Mapping[str, torch.Tensor]:
    """The same statistics as ``attention_stats``, from full tensors: ``weights`` ``(batch, head, query, key)``,
    ``scores`` (the logits; None: ``max_score`` NaN, finiteness from the weights alone), ``allowed`` ``(batch,
    1 or head, query or 1, key)`` (None: every key allowed), ``v`` ``(batch, head, key, d)`` (each query head's kv
    head) with the observed ``output``, ``sinks`` ``(head,)``. ``rows``: only these query rows, as in
    ``attention_stats`` (the diagonal read at each row's own position); ``key_set`` as there."""
    if rows is not None:
        index = rows = rows.to(weights.device, torch.long)

        def cut(t: torch.Tensor, axis: int = 2) -> torch.Tensor:
            return t if t.shape[axis] == 1 else t.index_select(axis, index.to(t.device))

        weights = cut(weights)
        scores, allowed, output = (None if t is None else cut(t) for t in (scores, allowed, output))
        query_padding = None if query_padding is None else cut(query_padding, 1)
    B, h, Tq, Tk = weights.shape
    dtype = torch.promote_types(weights.dtype, torch.float32)
    device = weights.device
    counted = _counted_rows(query_padding, B, Tq, device).to(dtype)  # (batch, query)
    key_weight = torch.zeros(B, h, Tk, device=device, dtype=dtype)  # (batch, head, key)
    key_allowed = (  # (batch, head, key)
        torch.ones(B, h, Tk, dtype=torch.bool, device=device)
        if allowed is None
        else allowed.any(-2).expand(B, h, Tk).clone()
    )
    first_key = key_allowed.to(torch.uint8).argmax(-1, keepdim=True)  # (batch, head, 1)
    sink_logits = None if sinks is None else sinks.to(device, dtype)  # (head,)
    dv = None if v is None or output is None else v.shape[-1]
    step = _rows_per_block(B, h, Tk, torch.finfo(dtype).bits // 8, block_bytes)
    parts = []
    with torch.no_grad():
        for a in range(0, Tq, step):
            b = min(a + step, Tq)
            w = weights[:, :, a:b].to(dtype)  # (batch, head, query, key)
            s = None if scores is None else scores[:, :, a:b].to(dtype)  # (batch, head, query, key)
            # (batch, 1 or head, query or 1, key)
            al = None if allowed is None else (allowed if allowed.shape[2] == 1 else allowed[:, :, a:b]).to(torch.bool)
            acc = _Rows(B, h, a, b, Tk, diag_offset=diag_offset, device=device, dtype=dtype, dv=dv, positions=rows)
            acc.first_key = first_key
            acc.add(w, 0, scores=s, allowed=al, v=v)
            real = counted[:, a:b].view(B, 1, -1) * (
                1.0 if al is None else al.any(-1).to(dtype)
            )  # (batch, head, query)
            key_weight += torch.einsum("bhq,bhqk->bhk", real.expand(B, h, -1), w.nan_to_num(0.0))
            expected: torch.Tensor | float = 1.0  # (batch, head, query): 1 less the sink's weight
            if sink_logits is not None and s is not None:
                z = s if al is None else s.masked_fill(~al, -math.inf)
                lse = sink_logsumexp(torch.logsumexp(z, -1), sink_logits)
                expected = 1.0 - torch.exp(sink_logits.view(1, -1, 1) - lse)
            part = acc.finish(expected=expected, output=output, scores_known=s is not None)
            if key_set is not None:  # (batch, head, query, key) x (batch, 1, key, 1) -> (batch, head, query)
                column = key_set.to(device, dtype).view(B, 1, Tk, 1)
                part[KEY_SET_STAT] = w.nan_to_num(0.0).matmul(column).squeeze(-1)
            parts.append(part)
    return _collect(parts, key_weight, key_allowed)


def record_stats(record: object) -> Mapping[str, torch.Tensor] | None:
    """The statistics of a full record (``stats_from_weights`` over its weights, scores, mask, v and output);
    None when it has no weights."""
    from ..record import AttentionRecord

    if not isinstance(record, AttentionRecord):
        raise TypeError(f"record_stats takes an AttentionRecord, got {type(record).__name__}")
    if record.weights is None:
        return None
    q_len, k_len = record.weights.shape[2:]
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
        if all(hd // group in record.kv_heads for hd in record.heads):  # each stored head's kv head was stored
            index = [record.kv_heads.index(hd // group) for hd in record.heads]
            v, output = record.v[:, index], record.output  # v: (batch, head, key, d_head), each head's kv head
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
