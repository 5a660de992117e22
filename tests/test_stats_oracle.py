"""The statistics engine against its pre-refactor self (tests/stats_engine_v0.py, a frozen copy): every statistic
bitwise equal, on the cases of test_stats.py and more (no mask, causal with and without an offset, padding masks
per row and broadcast, additive masks, a float mask carrying a bias, cross-attention, NaN/inf logits; a position
bias, softcapping, sinks; grouped-query heads; fp32, fp64, bf16; block sizes from one block to a key per block, so
that keys come in blocks; sampled rows, overviews, a reused workspace; statistics of full weights and records)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import stats_engine_v0 as v0
import torch

from attnprobe.probe.engine import stats as v1
from attnprobe.probe.engine.attention_math import AttentionCall, softmax_with_sinks
from attnprobe.probe.engine.pooling import Overview

#: one block of rows; blocks of rows (keys in blocks in fp64); a few rows against blocks of one or two keys
BLOCK_BYTES = {"one-block": 1 << 20, "row-blocks": 4000, "key-blocks": 1000}
MASKS = ("none", "causal", "decode", "shifted", "padding", "broadcast", "additive", "float-bias", "cross", "nan")
EXTRAS = ("plain", "bias-softcap-sinks")
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
#: every mask in fp32, the main ones in fp64 and bf16 as well
CASES = (
    [(mask, "fp32") for mask in MASKS]
    + [(mask, dtype) for dtype in ("fp64", "bf16") for mask in ("causal", "padding", "additive", "nan")]
    + [("shifted", "fp64")]
)  # blocks of 2 rows: the first reaches no key at all
#: statistics the engine has and the frozen copy has not
ADDED = ("first_allowed", "last_allowed")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitwise(got, want):
    """Every statistic the same: names, dtypes, shapes and bits (NaN positions equal, their payloads not read)."""
    # statistics added since the frozen copy (first_allowed, last_allowed: tests/test_stats.py checks them)
    assert [n for n in got if n not in ADDED] == list(want)
    for name, b in want.items():
        a = got[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        if a.dtype.is_floating_point:
            assert torch.equal(a.isnan(), b.isnan()), name
            a, b = (torch.where(t.isnan(), 0.0, t).view(_BITS[t.element_size()]) for t in (a, b))
        assert torch.equal(a, b), (name, a, b)


def _case(mask: str, extras: str, dtype: torch.dtype, *, heads=(0, 1, 2, 3), seed: int = 0, grouped: bool = False):
    """``(call, diag_offset, query_padding)``: 2 batch rows, 4 query heads reading 2 kv heads, 13 queries (3 for
    ``decode``: the last queries of 40 keys, causal with an offset; ``shifted``: 13 queries, 10 keys, causal with
    offset -3, so that the first 3 rows may attend no key). k and v for every head (``AttentionCall.ungrouped``);
    ``grouped``: as ``AttentionCall.for_heads`` keeps them, one per kv head where the heads read them in groups."""
    torch.manual_seed(seed)
    B, H, KV, D = 2, 4, 2, 8
    Tq, Tk = {"decode": (3, 40), "shifted": (13, 10), "cross": (13, 11)}.get(mask, (13, 13))
    q, k, v = torch.randn(B, H, Tq, D) * 2, torch.randn(B, KV, Tk, D) * 2, torch.randn(B, KV, Tk, D)
    pad = torch.zeros(B, Tk, dtype=torch.bool)
    pad[0, :4] = True  # left padding: rows 0..3 of batch 0 have no allowed key under a causal mask
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)[None, None] & ~pad[:, None, None, :]
    lowest = torch.finfo(dtype).min
    kw: dict = {"causal": mask in ("causal", "decode", "shifted", "nan"), "causal_offset": Tk - Tq}
    if mask == "padding":
        kw["mask"] = allowed
    elif mask in ("broadcast", "cross"):
        kw["mask"] = ~pad[:, None, None, :]
    elif mask == "additive":
        kw.update(mask=torch.zeros(B, 1, Tq, Tk, dtype=dtype).masked_fill(~allowed, lowest), additive=True)
    elif mask == "float-bias":  # a relative bias folded into the mask (Swin)
        kw.update(mask=torch.randn(B, 1, Tq, Tk, dtype=dtype).masked_fill(~allowed, lowest), additive=True)
    elif mask == "nan":  # NaN logits at keys the rows may not attend (they must not count), and where they may
        k[:, 0, 3] = math.nan  # a padded key whose hidden state went NaN: forbidden to every row
        kw["mask"] = allowed & (torch.arange(Tk) != 3)
        k[1, 1, Tk - 1] = math.nan  # the last key: forbidden to every row but the last, which sees NaN
        q[0, 2, 7, 0] = math.inf  # an inf query: NaN and inf logits at allowed keys
    if extras == "bias-softcap-sinks":
        kw.update(bias=torch.randn(1, H, Tq, Tk, dtype=dtype), softcap=5.0, sinks=torch.randn(H, dtype=dtype))
    output = torch.randn(B, H, Tq, D, dtype=dtype)
    output[1, 0, 2, 1] = math.nan  # a NaN in the observed output: its row is not finite
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kv_heads = tuple(h * KV // H for h in heads)
    call = AttentionCall.for_heads(q, k, v, heads=heads, kv_heads=kv_heads, output=output, scaling=0.3, **kw)
    diag = None if mask in ("cross", "shifted") else Tk - Tq
    # k and v for every head, as the frozen engine reads them (today's engine takes grouped k and v as they are,
    # one product per kv head: the same numbers but for the products' rounding, tests/test_kv_groups.py)
    return call if grouped else call.ungrouped(), diag, (pad[:, -Tq:] if Tk >= Tq else None)


@pytest.mark.parametrize("block_bytes", BLOCK_BYTES.values(), ids=BLOCK_BYTES.keys())
@pytest.mark.parametrize(("mask", "dtype"), CASES, ids=[f"{mask}-{dtype}" for mask, dtype in CASES])
def test_the_engine_gives_the_frozen_engine_s_numbers(mask, dtype, block_bytes):
    for extras in EXTRAS:
        call, diag, pad = _case(mask, extras, DTYPES[dtype])
        kw = dict(diag_offset=diag, query_padding=None if extras == "plain" else pad, block_bytes=block_bytes)
        assert_bitwise(v1.attention_stats(call, **kw), v0.attention_stats(call, **kw))


@pytest.mark.parametrize("block_bytes", BLOCK_BYTES.values(), ids=BLOCK_BYTES.keys())
@pytest.mark.parametrize("mask", ["decode", "padding", "additive"])
def test_sampled_rows_selected_heads_overviews_and_workspaces(mask, block_bytes):
    call, diag, pad = _case(mask, "bias-softcap-sinks", torch.float32, heads=(1, 3), seed=1)
    rows = torch.tensor([0, 2]) if mask == "decode" else torch.tensor([0, 3, 4, 11, 12])
    kw = dict(diag_offset=diag, query_padding=pad, block_bytes=block_bytes)
    assert_bitwise(v1.attention_stats(call, rows=rows, **kw), v0.attention_stats(call, rows=rows, **kw))
    overview = Overview(cells=4, windows=((0, 2, 0, 7), (1, 3, 2, 11)))
    assert_bitwise(v1.attention_stats(call, overview=overview, **kw), v0.attention_stats(call, overview=overview, **kw))
    ws1: dict = {}
    ws0: dict = {}
    for _ in range(2):  # the second call reuses the first one's buffers
        for c in (call, replace(call, q=call.q[:, :, :2].contiguous(), output=call.output[:, :, :2])):
            assert_bitwise(v1.attention_stats(c, workspace=ws1, **kw), v0.attention_stats(c, workspace=ws0, **kw))


@pytest.mark.parametrize("block_bytes", [8 << 20, 90000], ids=["one-block", "key-blocks"])
@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_long_rows(mask, block_bytes):
    """Rows of 1,000+ keys: the engine's chunked searches, in one block and in key blocks of 1,024+ keys."""
    torch.manual_seed(3)
    B, h, D = 1, 2, 8
    Tq, Tk = (1100, 1100) if block_bytes > 1 << 20 else (2, 3000)
    q, k, v = torch.randn(B, h, Tq, D) * 3, torch.randn(B, h, Tk, D) * 3, torch.randn(B, h, Tk, D)
    k[:, :, -1] = q[:, :, -1]  # the last query attends its own key, in the last (partial) chunk of 256 keys
    offset = Tk - Tq
    if mask == "causal":
        call = AttentionCall(q, k, scaling=1.0, v=v, causal=True, causal_offset=offset)
    else:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(offset)[None, None] & (torch.arange(Tk) >= 70)
        call = AttentionCall(q, k, scaling=1.0, v=v, mask=allowed)
    call = replace(call, output=torch.randn(B, h, Tq, D))
    kw = dict(diag_offset=offset, block_bytes=block_bytes)
    assert_bitwise(v1.attention_stats(call, **kw), v0.attention_stats(call, **kw))


@pytest.mark.parametrize("mask", ["none", "padding", "broadcast", "cross", "nan"])
@pytest.mark.parametrize("extras", EXTRAS)
def test_statistics_of_full_weights(mask, extras):
    call, diag, pad = _case(mask, extras, torch.float32, seed=2)
    B, _, Tq, Tk = call.shape
    s = call.logits(0, Tq, 0, Tk)
    allowed = call.allowed(0, Tq, 0, Tk)
    z = s if allowed is None else s.masked_fill(~allowed, -math.inf)
    w = softmax_with_sinks(z, call.sinks)
    allowed = None if allowed is None else allowed.expand(B, 1, Tq, Tk)
    rows = torch.tensor([0, 5, 6, 12])
    for kw in (
        dict(scores=s, allowed=allowed, v=call.v, output=call.output, sinks=call.sinks),
        dict(allowed=allowed, block_bytes=2000),
        dict(scores=s, rows=rows, block_bytes=2000),
    ):
        kw.update(diag_offset=diag, query_padding=pad)
        assert_bitwise(v1.stats_from_weights(w, **kw), v0.stats_from_weights(w, **kw))


def test_record_statistics():
    import attnprobe

    torch.manual_seed(4)
    mha = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True)
    with attnprobe.capture(mha, heads=[0, 3]) as cap:
        mha(torch.randn(2, 9, 16))
    assert cap[0].weights is not None
    assert_bitwise(v1.record_stats(cap[0]), v0.record_stats(cap[0]))


def test_the_oracle_is_not_the_engine():
    """The frozen copy is a module of its own (a refactor that re-exported the engine there would prove nothing),
    and the comparison catches a changed bit."""
    assert v0.attention_stats is not v1.attention_stats and v0._Engine is not getattr(v1, "_Engine", None)
    q = k = torch.randn(1, 1, 4, 2)
    want = v0.attention_stats(AttentionCall(q, k, scaling=1.0, causal=True), diag_offset=0)
    got = dict(want, entropy=want["entropy"].nextafter(torch.tensor(math.inf)))
    with pytest.raises(AssertionError, match="entropy"):
        assert_bitwise(got, want)
