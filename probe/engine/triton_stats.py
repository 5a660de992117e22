"""Every statistic of ``keep=("stats",)`` in one Triton kernel launch per attention call: ``triton_attention_stats``.

The eager engine (``probe/engine/stats.py``) computes a block of the logits with torch's ops and then makes a dozen
passes over it. This kernel computes each ``(block_m x block_n)`` tile of the logits in registers and takes every
statistic from it before it goes: one program per block of query rows and head, sweeping the keys twice (pass 1: each
row's log-normaliser ``lse`` by the online softmax; pass 2: the weights ``p = exp(s - lse)`` and every sum), or once
when the model's kernel gave the lse (``AttentionCall.lse``). Row statistics stay in registers; the per-key sums
(``key_weight``) go to memory by fp32 atomics, or, deterministic (``deterministic=True``, or when
``torch.use_deterministic_algorithms`` is on), by a second launch whose programs own a block of keys each and sum
every row block in a fixed order (one more sweep of ``q @ k``). Nothing of size (query x key) is ever made.

Masks as the engine reads them: the call's dense mask (bool, or float added to the logits: padding, sliding windows,
documents, any 4-D mask, broadcast along the batch, heads or rows as it comes), ``is_causal`` with its offset, a
position bias and softcapping; sampled rows (``rows=``) through their positions. Where the engine's answer is not
this kernel's to give it returns None and the caller runs the eager engine (``unsupported`` says why): attention sinks,
a flex ``score_mod``, a mask given as a function of blocks (flex's ``mask_mod``, varlen documents), a key set
(``key_set_mass``: a capture's ``image_mass``), overviews, float64, rows
that are not finite (a NaN or inf logit: the eager engine says what such a row's statistics are) and rows of an
additive mask that attend no key (uniform over every key). Correctness is tested on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``) against the eager engine and a float64 reference (``tests/test_triton_stats.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .attention_math import AttentionCall, per_query_head
from .stats import KEY_STATS, ROW_STATS, WEIGHT_THRESHOLD, attendable_keys

#: The row statistics in the order the kernel writes them (one float32 plane each; integers are exact below 2^24).
_PLANES = (
    "entropy",
    "max_weight",
    "min_weight",
    "argmax_key",
    "first_key_mass",
    "diagonal_mass",
    "previous_mass",
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
    "logits_finite",  # not a statistic: no NaN or inf logit at an allowed key (else the eager engine answers)
)
_INTEGERS = ("argmax_key", "first_key", "last_key", "allowed_keys", "first_allowed", "last_allowed")
_FLAGS = ("finite", "diagonal_allowed")
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _query(Q, base, rows, row_ok, sqm, sqd, D, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """The block's q rows ``(block_m, block_d)`` (zeros past the head size and the last row)."""
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + base + rows[:, None] * sqm + dims[None, :] * sqd, mask=row_ok[:, None] & (dims < D)[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _tile(
    q, K, MASK, BIAS, k_base, m_base, b_base, rows, pos, row_ok, start_n, Tk, D, scale, softcap, masked_at,
    causal_offset, skn, skd, smm, smn, sbm, sbn,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FLOAT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One tile of logits ``(block_m, block_n)`` in base 2, ``-inf`` where the row may not attend, and that mask."""
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ok = cols < Tk
    dims = tl.arange(0, BLOCK_D)
    k_mask = col_ok[:, None] & (dims < D)[None, :]
    k = tl.load(K + k_base + cols[:, None] * skn + dims[None, :] * skd, mask=k_mask, other=0.0)
    if UPCAST:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    inside = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:
        s += tl.load(BIAS + b_base + rows[:, None] * sbm + cols[None, :] * sbn, mask=inside, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s / softcap)
    allowed = inside
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= pos[:, None] + causal_offset)
    if HAS_MASK:
        m = tl.load(MASK + m_base + rows[:, None] * smm + cols[None, :] * smn, mask=inside, other=0)
        if MASK_FLOAT:
            m = m.to(tl.float32)
            keep = m > masked_at
            s = tl.where(keep, s + m, s)
            allowed = allowed & keep
        else:
            allowed = allowed & (m != 0)
    return tl.where(allowed, s * 1.4426950408889634, float("-inf")), allowed, cols, col_ok


@triton.jit
def _online_lse(
    q, K, MASK, BIAS, k_base, m_base, b_base, rows, pos, row_ok, n_end, Tk, D, scale, softcap, masked_at,
    causal_offset, skn, skd, smm, smn, sbm, sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_FLOAT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Pass 1: each row's logsumexp in base 2 (``-inf``: no allowed key), by the online softmax over key tiles."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    for start_n in range(0, n_end, BLOCK_N):
        s2, _, _, _ = _tile(
            q, K, MASK, BIAS, k_base, m_base, b_base, rows, pos, row_ok, start_n, Tk, D, scale, softcap, masked_at,
            causal_offset, skn, skd, smm, smn, sbm, sbn,
            BLOCK_N, BLOCK_D, HAS_MASK, MASK_FLOAT, HAS_BIAS, HAS_SOFTCAP, CAUSAL, UPCAST,
        )  # fmt: skip
        new = tl.maximum(m, tl.max(s2, axis=1))
        safe = tl.where(new > float("-inf"), new, 0.0)
        total = total * tl.exp2(m - safe) + tl.sum(tl.exp2(s2 - safe[:, None]), axis=1)
        m = new
    return tl.where(m > float("-inf"), m, 0.0) + tl.log2(total)


@triton.jit
def _sweep(
    q, K, V, MASK, BIAS, VMAX, KW, k_base, m_base, b_base, v_base, bh, rows, pos, row_ok, lse2, weight,
    first_key, diag, n_end, Tk, D, DV, scale, softcap, masked_at, causal_offset, threshold,
    skn, skd, smm, smn, sbm, sbn, svn, svd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_FLOAT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_OUT: tl.constexpr, ATOMIC_COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Pass 2 over the key tiles: ``p = exp2(s - lse)`` and every sum a row statistic needs (in registers), the
    product with ``v`` for the output check, and (``ATOMIC_COLS``) each key's weight summed over the rows by atomics."""
    total = tl.zeros((BLOCK_M,), tl.float32)
    dot = tl.zeros((BLOCK_M,), tl.float32)
    smallest = tl.full((BLOCK_M,), float("inf"), tl.float32)
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    best_key = tl.zeros((BLOCK_M,), tl.int32)
    first = tl.full((BLOCK_M,), Tk, tl.int32)
    last = tl.full((BLOCK_M,), -1, tl.int32)
    count = tl.zeros((BLOCK_M,), tl.int32)
    first_ok = tl.full((BLOCK_M,), Tk, tl.int32)  # the first and last key the mask lets the row attend
    last_ok = tl.full((BLOCK_M,), -1, tl.int32)
    first_p = tl.zeros((BLOCK_M,), tl.float32)
    diag_p = tl.zeros((BLOCK_M,), tl.float32)
    prev_p = tl.zeros((BLOCK_M,), tl.float32)
    diag_ok = tl.zeros((BLOCK_M,), tl.int32)
    out = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    out_scale = tl.zeros((BLOCK_M,), tl.float32)
    dv = tl.arange(0, BLOCK_DV)
    for start_n in range(0, n_end, BLOCK_N):
        s2, allowed, cols, col_ok = _tile(
            q, K, MASK, BIAS, k_base, m_base, b_base, rows, pos, row_ok, start_n, Tk, D, scale, softcap, masked_at,
            causal_offset, skn, skd, smm, smn, sbm, sbn,
            BLOCK_N, BLOCK_D, HAS_MASK, MASK_FLOAT, HAS_BIAS, HAS_SOFTCAP, CAUSAL, UPCAST,
        )  # fmt: skip
        tile_max = tl.max(s2, axis=1)
        tile_key = tl.min(tl.where(s2 == tile_max[:, None], cols[None, :], Tk), axis=1)
        best_key = tl.where(tile_max > best, tile_key, best_key)  # strict: the first key keeps a tie
        best = tl.maximum(best, tile_max)
        x = s2 - lse2[:, None]  # log2 of the weights, -inf where forbidden
        p = tl.where(allowed, tl.exp2(x), 0.0)
        total += tl.sum(p, axis=1)
        dot += tl.sum(tl.where(allowed, p * x, 0.0), axis=1)
        smallest = tl.minimum(smallest, tl.min(tl.where(allowed, p, float("inf")), axis=1))
        count += tl.sum(allowed.to(tl.int32), axis=1)
        first_ok = tl.minimum(first_ok, tl.min(tl.where(allowed, cols[None, :], Tk), axis=1))
        last_ok = tl.maximum(last_ok, tl.max(tl.where(allowed, cols[None, :], -1), axis=1))
        hit = p > threshold
        first = tl.minimum(first, tl.min(tl.where(hit, cols[None, :], Tk), axis=1))
        last = tl.maximum(last, tl.max(tl.where(hit, cols[None, :], -1), axis=1))
        first_p += tl.sum(tl.where(cols[None, :] == first_key, p, 0.0), axis=1)
        if HAS_DIAG:
            diag_p += tl.sum(tl.where(cols[None, :] == diag[:, None], p, 0.0), axis=1)
            prev_p += tl.sum(tl.where(cols[None, :] == diag[:, None] - 1, p, 0.0), axis=1)
            diag_ok += tl.sum((allowed & (cols[None, :] == diag[:, None])).to(tl.int32), axis=1)
        if HAS_OUT:
            v_at = V + v_base + cols[:, None] * svn + dv[None, :] * svd
            v = tl.load(v_at, mask=col_ok[:, None] & (dv < DV)[None, :], other=0.0)
            if UPCAST:
                out += tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                out += tl.dot(p.to(v.dtype), v)
            out_scale += tl.sum(p * tl.load(VMAX + bh * Tk + cols, mask=col_ok, other=0.0)[None, :], axis=1)
        if ATOMIC_COLS:
            kept = tl.where(weight[:, None] > 0, p, 0.0) * weight[:, None]  # (a row not finite: not even NaN * 0)
            tl.atomic_add(KW + bh * Tk + cols, tl.sum(kept, axis=0), mask=col_ok)
    return (
        total, dot, smallest, best, best_key, first, last, count, first_ok, last_ok, first_p, diag_p, prev_p, diag_ok,
        out, out_scale,
    )  # fmt: skip


@triton.jit
def _store_rows(
    at, plane, row_ok, Tk, inv, total, dot, smallest, best, best_key, first, last, count, first_ok, last_ok, first_p,
    diag_p, prev_p, diag_ok, diag, lse2,
):  # fmt: skip
    """The row statistics but the output check's, each into its plane (``_PLANES``), from the sweep's sums."""
    empty = best == float("-inf")
    nan = float("nan")
    tl.store(at, tl.where(total > 0, tl.log(total) * (total * inv) - dot * 0.6931471805599453 * inv, 0.0), mask=row_ok)
    tl.store(at + plane, tl.where(empty, 0.0, tl.exp2(best - lse2) * inv), mask=row_ok)
    tl.store(at + 2 * plane, tl.where(count < Tk, 0.0, smallest * inv), mask=row_ok)
    tl.store(at + 3 * plane, tl.where(empty, 0, best_key).to(tl.float32), mask=row_ok)
    tl.store(at + 4 * plane, first_p * inv, mask=row_ok)
    diag_in, prev_in = (diag >= 0) & (diag < Tk), (diag >= 1) & (diag - 1 < Tk)  # (cross-attention: diag < 0)
    tl.store(at + 5 * plane, tl.where(diag_in, diag_p * inv, nan), mask=row_ok)
    tl.store(at + 6 * plane, tl.where(prev_in, prev_p * inv, nan), mask=row_ok)
    tl.store(at + 7 * plane, tl.abs(total * inv - 1.0), mask=row_ok)
    tl.store(at + 8 * plane, best * 0.6931471805599453, mask=row_ok)
    tl.store(at + 12 * plane, tl.where(first >= Tk, -1, first).to(tl.float32), mask=row_ok)
    tl.store(at + 13 * plane, last.to(tl.float32), mask=row_ok)
    tl.store(at + 14 * plane, count.to(tl.float32), mask=row_ok)
    tl.store(at + 15 * plane, (diag_ok > 0).to(tl.float32), mask=row_ok)
    tl.store(at + 16 * plane, tl.where(first_ok >= Tk, -1, first_ok).to(tl.float32), mask=row_ok)
    tl.store(at + 17 * plane, last_ok.to(tl.float32), mask=row_ok)


@triton.jit
def _rows_kernel(
    Q, K, V, OUT, MASK, BIAS, LSE, POS, FIRST, COUNTED, VMAX, STATS, KW, LSE_OUT, W_OUT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    H, GROUP, Tq, Tk, D, DV, plane, scale, softcap, masked_at, causal_offset, diag_offset, threshold,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_FLOAT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_LSE: tl.constexpr, HAS_OUT: tl.constexpr,
    ATOMIC_COLS: tl.constexpr, STORE_LSE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One block of query rows of one (batch, head): every row statistic, and its weights summed per key (atomics;
    else the base-2 lse and each row's weight in ``key_weight`` go to ``LSE_OUT``/``W_OUT`` for ``_keys_kernel``)."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Tq
    pos = tl.load(POS + rows, mask=row_ok, other=0)
    q = _query(Q, b * sqb + h * sqh, rows, row_ok, sqm, sqd, D, BLOCK_D, UPCAST)
    k_base, m_base, b_base = b * skb + h // GROUP * skh, b * smb + h * smh, b * sbb + h * sbh  # GROUP: heads a kv head
    n_end = Tk
    if CAUSAL:
        n_end = tl.minimum(Tk, tl.max(tl.where(row_ok, pos, -1)) + causal_offset + 1)
    if HAS_LSE:
        lse2 = tl.load(LSE + bh * Tq + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    else:
        lse2 = _online_lse(
            q, K, MASK, BIAS, k_base, m_base, b_base, rows, pos, row_ok, n_end, Tk, D, scale, softcap, masked_at,
            causal_offset, skn, skd, smm, smn, sbm, sbn,
            BLOCK_M, BLOCK_N, BLOCK_D, HAS_MASK, MASK_FLOAT, HAS_BIAS, HAS_SOFTCAP, CAUSAL, UPCAST,
        )  # fmt: skip
    valid = row_ok & (tl.abs(lse2) < float("inf"))  # rows with a finite lse: the others add nothing per key
    lse2 = tl.where(valid, lse2, 0.0)
    weight = tl.where(valid, tl.load(COUNTED + b * Tq + rows, mask=row_ok, other=0.0), 0.0)
    if STORE_LSE:
        tl.store(LSE_OUT + bh * Tq + rows, lse2, mask=row_ok)
        tl.store(W_OUT + bh * Tq + rows, weight, mask=row_ok)
    first_key = tl.load(FIRST + bh)
    diag = pos + diag_offset
    (
        total, dot, smallest, best, best_key, first, last, count, first_ok, last_ok, first_p, diag_p, prev_p, diag_ok,
        out, out_scale,
    ) = _sweep(
        q, K, V, MASK, BIAS, VMAX, KW, k_base, m_base, b_base, b * svb + h // GROUP * svh, bh, rows, pos, row_ok,
        lse2, weight,
        first_key, diag, n_end, Tk, D, DV, scale, softcap, masked_at, causal_offset, threshold,
        skn, skd, smm, smn, sbm, sbn, svn, svd,
        BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_FLOAT, HAS_BIAS, HAS_SOFTCAP, CAUSAL, HAS_DIAG, HAS_OUT,
        ATOMIC_COLS, UPCAST,
    )  # fmt: skip
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    at = STATS + bh * Tq + rows
    _store_rows(
        at, plane, row_ok, Tk, inv, total, dot, smallest, best, best_key, first, last, count, first_ok, last_ok,
        first_p, diag_p, prev_p, diag_ok, diag, lse2,
    )  # fmt: skip
    empty = best == float("-inf")
    nan = float("nan")
    dv = tl.arange(0, BLOCK_DV)
    finite = ((tl.abs(dot) < float("inf")) & (tl.abs(total) < float("inf")) & (best == best)) | (empty & (dot == 0))
    logits_finite = finite
    if HAS_OUT:
        o_at = OUT + b * sob + h * soh + rows[:, None] * som + dv[None, :] * sod
        seen = tl.load(o_at, mask=row_ok[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
        error = tl.max(tl.where((dv < DV)[None, :], tl.abs(out * inv[:, None] - seen), 0.0), axis=1)
        odd = (tl.abs(seen) == float("inf")) | (seen != seen)  # a NaN or inf in the observed output
        bad = tl.max(tl.where((dv < DV)[None, :] & odd, 1, 0), axis=1) > 0
        error = tl.where(bad, nan, error)
        finite = finite & (bad == 0) & (tl.abs(error) < float("inf"))
        tl.store(at + 10 * plane, error, mask=row_ok)
        tl.store(at + 11 * plane, out_scale * inv, mask=row_ok)
    else:
        tl.store(at + 10 * plane, tl.full((BLOCK_M,), nan, tl.float32), mask=row_ok)
        tl.store(at + 11 * plane, tl.full((BLOCK_M,), nan, tl.float32), mask=row_ok)
    tl.store(at + 9 * plane, finite.to(tl.float32), mask=row_ok)
    tl.store(at + 18 * plane, logits_finite.to(tl.float32), mask=row_ok)


@triton.jit
def _keys_kernel(
    Q, K, MASK, BIAS, LSE2, POS, WEIGHT, KW,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    H, GROUP, Tq, Tk, D, scale, softcap, masked_at, causal_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_FLOAT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One block of keys of one (batch, head): the weights of every counted row summed per key, row block after row
    block in a fixed order (deterministic, no atomics); reads the base-2 lse ``_rows_kernel`` wrote."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    start_n = tl.program_id(0) * BLOCK_N
    k_base, m_base, b_base = b * skb + h // GROUP * skh, b * smb + h * smh, b * sbb + h * sbh  # GROUP: heads a kv head
    sums = tl.zeros((BLOCK_N,), tl.float32)
    for start_m in range(0, Tq, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < Tq
        pos = tl.load(POS + rows, mask=row_ok, other=0)
        q = _query(Q, b * sqb + h * sqh, rows, row_ok, sqm, sqd, D, BLOCK_D, UPCAST)
        s2, allowed, cols, _ = _tile(
            q, K, MASK, BIAS, k_base, m_base, b_base, rows, pos, row_ok, start_n, Tk, D, scale, softcap, masked_at,
            causal_offset, skn, skd, smm, smn, sbm, sbn,
            BLOCK_N, BLOCK_D, HAS_MASK, MASK_FLOAT, HAS_BIAS, HAS_SOFTCAP, CAUSAL, UPCAST,
        )  # fmt: skip
        lse2 = tl.load(LSE2 + bh * Tq + rows, mask=row_ok, other=0.0)
        weight = tl.load(WEIGHT + bh * Tq + rows, mask=row_ok, other=0.0)
        p = tl.where(allowed & (weight[:, None] > 0), tl.exp2(s2 - lse2[:, None]), 0.0)
        sums += tl.sum(p * weight[:, None], axis=0)
    cols = start_n + tl.arange(0, BLOCK_N)
    tl.store(KW + bh * Tk + cols, sums, mask=cols < Tk)


# ------------------------------------------------------------------------------------------------- the launcher
def unsupported(call: AttentionCall, key_set: torch.Tensor | None = None) -> str | None:
    """Why the kernel does not take ``call`` (the eager engine does), or None. ``key_set``: the statistics asked for
    include ``key_set_mass`` (``attention_stats(key_set=)``, a capture's ``image_mass``), which the kernel does not
    compute."""
    if key_set is not None:
        return "a key set (image_mass: the weight on a picture's patches)"
    if call.score_mod is not None:
        return "a score_mod (flex attention)"
    if call.mask is not None and not isinstance(call.mask, torch.Tensor):
        return "a mask given as a function of blocks (flex attention's mask_mod, a varlen kernel's documents)"
    if call.sinks is not None:
        return "attention sinks"
    if call.q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{call.q.dtype} (the kernel computes in float32 from float32, bfloat16 or float16 inputs)"
    if call.q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"a tensor on {call.q.device.type} (the kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dense(t: torch.Tensor | None, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """A mask or bias broadcastable to ``(batch, head, query, key)``, as a view of that shape (broadcast axes have
    stride 0), and its four strides (zeros when there is none)."""
    if t is None:
        return None, (0, 0, 0, 0)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    t = t[..., : shape[3]] if t.shape[3] > shape[3] else t
    t = t.expand(shape)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t, tuple(t.stride())


def _blocks(call: AttentionCall, block: tuple[int, int] | None) -> tuple[int, int]:
    """``(block_m, block_n)``: as given, else 64 x 64 (16 x 16 under the interpreter, which runs them in numpy)."""
    if block is not None:
        return block
    return (16, 16) if _interpreting() else (64, 64)


def triton_attention_stats(
    call: AttentionCall,
    *,
    diag_offset: int | None = None,
    query_padding: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    deterministic: bool | None = None,
    block: tuple[int, int] | None = None,
    key_sums: bool = True,
    key_set: torch.Tensor | None = None,
) -> Mapping[str, torch.Tensor] | None:
    """The statistics ``attention_stats(call, ...)`` computes (``ROW_STATS`` ``(batch, head, query)``, ``KEY_STATS``
    ``(batch, head, key)``, float32), from the kernel; None where the answer is the eager engine's to give (see the
    module's docstring: the caller then runs it). ``deterministic``: per-key sums without atomics (None: as
    ``torch.are_deterministic_algorithms_enabled()``). ``block``: ``(block_m, block_n)``, powers of two, >= 16.
    ``key_sums=False``: the row statistics alone (``key_weight`` NaN), what ``benchmarks/gpu.py`` times as "per-row
    statistics". ``key_set``: as ``attention_stats``'s; the kernel does not compute ``key_set_mass``, so None with
    one."""
    if unsupported(call, key_set) is not None:
        return None
    if rows is not None:
        call = call.take_rows(rows)
        if query_padding is not None:
            query_padding = query_padding.index_select(1, rows.to(query_padding.device, torch.long))
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    sums = ("deterministic" if deterministic else "atomic") if key_sums else "none"
    stats, logits_finite = _launch(call, diag_offset, query_padding, sums, _blocks(call, block))
    if not bool(logits_finite.all()) or (call.additive and bool((stats["allowed_keys"] == 0).any())):
        return None  # rows the eager engine describes: a NaN or inf logit, or made uniform by an additive mask
    return stats


def _launch(call: AttentionCall, diag_offset, query_padding, sums: str, block: tuple[int, int]):
    """The kernels run on ``call``: the statistics, unpacked, and which rows had finite logits. ``sums``: how the
    weights are summed per key, ``"atomic"``, ``"deterministic"`` or ``"none"`` (``key_weight`` NaN)."""
    B, H, Tq, Tk = call.shape
    q, k, device = call.q, call.k, call.q.device
    block_m, block_n = block
    shape = (B, H, Tq, Tk)
    assert not callable(call.mask), "a mask of blocks is the eager engine's (unsupported)"
    mask, mask_strides = _dense(call.mask, shape)
    bias, bias_strides = _dense(call.bias, shape)
    float_mask = mask is not None and mask.dtype.is_floating_point
    masked_at = call.masked_at
    if masked_at is None:
        masked_at = torch.finfo(mask.dtype).min / 2 if float_mask and mask is not None else 0.0
    key_allowed, first = attendable_keys(call)  # (batch, head, key), (batch, head, 1)
    positions = call.row_positions(0, Tq).to(device, torch.int32).contiguous()  # (query,)
    counted = (
        torch.ones(B, Tq, device=device) if query_padding is None else (~query_padding.to(device, torch.bool)).float()
    )
    observed = call.output is not None and call.v is not None
    v = call.v if observed and call.v is not None else k
    out = call.output if observed and call.output is not None else q
    v_max = counted
    if observed:  # (batch, head, key): each key's largest |v|, taken per kv head, repeated for the heads reading it
        v_max = per_query_head(torch.maximum(v.amax(-1), v.amin(-1).neg()).float(), call.kv_group).contiguous()
    lse = call.lse.to(device, torch.float32).contiguous() if call.lse is not None else counted
    planes = torch.empty(len(_PLANES), B * H * Tq, device=device, dtype=torch.float32)
    key_weight = torch.full((B * H * Tk,), 0.0 if sums != "none" else math.nan, device=device, dtype=torch.float32)
    deterministic = sums == "deterministic"
    lse_out = torch.empty(B * H * Tq if deterministic else 1, device=device, dtype=torch.float32)
    w_out = torch.empty_like(lse_out)
    flags = dict(
        HAS_MASK=mask is not None,
        MASK_FLOAT=float_mask,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=call.softcap is not None,
        CAUSAL=bool(call.causal),
        UPCAST=q.dtype == torch.float32 or _interpreting(),
    )
    numbers = dict(
        scale=float(call.scaling), softcap=float(call.softcap or 1.0), masked_at=float(masked_at),
        causal_offset=int(call.causal_offset),
    )  # fmt: skip
    block_d, block_dv = (max(16, triton.next_power_of_2(n)) for n in (q.shape[-1], v.shape[-1]))
    no_diag = diag_offset is None
    _rows_kernel[(triton.cdiv(Tq, block_m), B * H)](
        q, k, v, out, q if mask is None else mask, q if bias is None else bias, lse, positions,
        first.to(torch.int32).contiguous(), counted.contiguous(), v_max, planes, key_weight, lse_out, w_out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mask_strides, *bias_strides,
        H, call.kv_group, Tq, Tk, q.shape[-1], v.shape[-1], B * H * Tq,
        diag_offset=-(1 << 30) if no_diag else int(diag_offset),
        threshold=WEIGHT_THRESHOLD, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_DIAG=not no_diag, HAS_LSE=call.lse is not None, HAS_OUT=observed, ATOMIC_COLS=sums == "atomic",
        STORE_LSE=deterministic, **flags, **numbers,
    )  # fmt: skip
    if deterministic:
        _keys_kernel[(triton.cdiv(Tk, block_n), B * H)](
            q, k, q if mask is None else mask, q if bias is None else bias, lse_out, positions, w_out, key_weight,
            *q.stride(), *k.stride(), *mask_strides, *bias_strides, H, call.kv_group, Tq, Tk, q.shape[-1],
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, **flags, **numbers,
        )  # fmt: skip
    planes = planes.view(len(_PLANES), B, H, Tq)
    return _unpack(planes, key_weight.view(B, H, Tk), key_allowed), planes[-1] > 0.5


def _unpack(planes: torch.Tensor, key_weight: torch.Tensor, key_allowed: torch.Tensor) -> Mapping[str, torch.Tensor]:
    """The kernel's float32 planes as the eager engine returns its statistics: integers as long, flags as bool."""
    got = dict(zip(_PLANES, planes.unbind(0)))
    stats: dict[str, torch.Tensor] = {}
    for name in ROW_STATS:
        if name in ("masked_mass", "masked_max"):  # weight on keys the call's own mask forbids: 0 by construction
            stats[name] = torch.zeros_like(got["entropy"])
        elif name in _INTEGERS:
            stats[name] = got[name].long()
        elif name in _FLAGS:
            stats[name] = got[name] > 0.5
        else:
            stats[name] = got[name]
    stats[KEY_STATS[0]], stats[KEY_STATS[1]] = key_weight, key_allowed
    return MappingProxyType(stats)
