"""Statistics mode (capture(keep=("stats",))): per-row statistics computed blockwise, equal to the ones a full
capture's weights give; checks, frames and summary on them; no (query x key) tensor of the full size."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
from checks_helpers import BUGS, LEFT_PADDED, RIGHT_PADDED, TinyTransformer, capture_one, declarations
from test_checks import CTX_MASK, run_model

import attnprobe
from attnprobe.probe.engine.attention_math import AttentionCall, attention_logits, softmax_with_sinks
from attnprobe.probe.engine.stats import KEY_STATS, ROW_STATS, attention_stats, record_stats, stats_from_weights
from attnprobe.probe.errors import SelectionError

ALL_STATS = ROW_STATS + KEY_STATS


def assert_stats_equal(got, want, atol=1e-5, where=""):
    for name in ALL_STATS:
        a, b = got[name], want[name]
        assert a.shape == b.shape, (where, name, a.shape, b.shape)
        if a.dtype.is_floating_point:
            assert torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-5, equal_nan=True), (
                where,
                name,
                (a.float() - b.float()).abs().nan_to_num(99).max(),
            )
        else:
            assert torch.equal(a, b), (where, name)


# --------------------------------------------------------------------------- the engine itself
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize(
    "block_bytes", [1 << 20, 30000, 2000, 300], ids=["all-rows", "row-blocks", "few-rows", "key-blocks"]
)
def test_engine_equals_the_statistics_of_the_full_weights(additive, sinks, block_bytes):
    """Blocks of rows, and keys in blocks with a running max: the same numbers as the full softmax (padded and
    empty rows, softcapping, sinks, both mask semantics)."""
    torch.manual_seed(0)
    B, h, T, D = 2, 3, 37, 8
    q, k, v = torch.randn(B, h, T, D) * 2, torch.randn(B, h, T, D) * 2, torch.randn(B, h, T, D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :5] = True  # left padding: rows 0..4 of batch 0 have no allowed key under the causal mask
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & ~pad[:, None, None, :]
    mask = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min) if additive else allowed
    sink = torch.randn(h) if sinks else None
    s = attention_logits(q, k, scaling=0.3, softcap=5.0)
    w = softmax_with_sinks(s + mask if additive else s.masked_fill(~allowed, -math.inf), sink)
    if not additive:
        w = w.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    output = w @ v + 1e-3 * torch.randn(B, h, T, D)
    call = AttentionCall(q, k, scaling=0.3, v=v, mask=mask, additive=additive, sinks=sink, softcap=5.0, output=output)
    got = attention_stats(call, diag_offset=0, query_padding=pad, block_bytes=block_bytes)
    want = stats_from_weights(
        w,
        scores=s,
        allowed=allowed.expand(B, 1, T, T),
        v=v,
        output=output,
        sinks=sink,
        diag_offset=0,
        query_padding=pad,
    )
    assert_stats_equal(got, want)
    assert got["allowed_keys"][0, 0, :5].eq(0).all() and got["finite"].all()
    # the span of allowed keys: none (-1) for the rows the padding empties, then from the first real key to the query
    assert got["first_allowed"][0, 0].tolist() == [-1] * 5 + [5] * (T - 5)
    assert got["last_allowed"][0, 0].tolist() == [-1] * 5 + list(range(5, T))
    assert (got["output_error"] > 5e-4).all()  # the 1e-3 noise added to the output is seen


@pytest.mark.parametrize("block_bytes", [1 << 20, 20000, 300], ids=["all-rows", "row-blocks", "key-blocks"])
def test_engine_with_an_implicit_causal_mask_reads_only_the_keys_rows_reach(block_bytes):
    """sdpa's is_causal: blocks of rows stop at the last key they may attend; the statistics still cover every key."""
    torch.manual_seed(1)
    B, h, T, D = 1, 2, 41, 4
    q, k, v = torch.randn(B, h, T, D), torch.randn(B, h, T, D), torch.randn(B, h, T, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = attention_stats(
        AttentionCall(q, k, scaling=0.5, v=v, causal=True, output=out), diag_offset=0, block_bytes=block_bytes
    )
    s = attention_logits(q, k, scaling=0.5)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    assert_stats_equal(got, stats_from_weights(w, scores=s, allowed=allowed, v=v, output=out, diag_offset=0))


@pytest.mark.parametrize("case", ["causal", "causal-offset", "padding-mask", "cross"])
@pytest.mark.parametrize("block_bytes", [1 << 20, 300], ids=["all-rows", "key-blocks"])
def test_sampled_rows_get_the_statistics_of_those_rows(case, block_bytes):
    """rows=: a sample of query rows (what the training monitor asks for) gets exactly the row statistics those rows
    have in the full call: causal limits, the diagonal and the mask are counted from the rows' positions."""
    torch.manual_seed(2)
    B, h, Tq, D = 2, 2, 29, 4
    Tk = Tq + (3 if case == "causal-offset" else 0)
    q, k, v = torch.randn(B, h, Tq, D), torch.randn(B, h, Tk, D), torch.randn(B, h, Tk, D)
    pad = torch.zeros(B, Tk, dtype=torch.bool)
    pad[1, :4] = True
    mask = ~pad[:, None, None, :].expand(B, 1, Tq, Tk) if case == "padding-mask" else None
    call = AttentionCall(
        q,
        k,
        scaling=0.4,
        v=v,
        mask=mask,
        causal=case.startswith("causal"),
        causal_offset=3 if case == "causal-offset" else 0,
    )
    full_call = replace(call, output=torch.randn(B, h, Tq, D))
    diag = None if case == "cross" else Tk - Tq
    rows = torch.tensor([0, 3, 4, 11, 28])
    full = attention_stats(full_call, diag_offset=diag, block_bytes=block_bytes)
    got = attention_stats(full_call, diag_offset=diag, block_bytes=block_bytes, rows=rows)
    for name in ROW_STATS:
        a, b = got[name], full[name][:, :, rows]
        assert a.shape == (B, h, len(rows)), name
        assert (
            torch.allclose(a.double(), b.double(), atol=1e-6, equal_nan=True)
            if a.dtype.is_floating_point
            else torch.equal(a, b)
        ), name
    assert got["key_weight"].shape == (B, h, Tk) and torch.allclose(got["key_weight"].sum(-1), torch.full((B, h), 5.0))
    with pytest.raises(ValueError, match="ascending"):
        attention_stats(call, rows=torch.tensor([3, 1]))


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_long_rows_find_argmax_and_first_and_last_keys_by_chunks(mask):
    """Rows of 1,000+ keys take the chunked search for the first and last key above the threshold: the same keys
    as the full weights give, also when the hit sits in the last, partial chunk or there is none (empty rows)."""
    torch.manual_seed(3)
    B, h, T, D = 2, 2, 1100, 8
    q, k = torch.randn(B, h, T, D) * 3, torch.randn(B, h, T, D) * 3
    k[:, :, -1] = q[:, :, -1]  # the last query attends its own key, in the last (partial) chunk of 256 keys
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :70] = True  # left padding
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if mask == "causal":
        allowed, call = causal.expand(B, 1, T, T), AttentionCall(q, k, scaling=1.0, causal=True)
    else:
        allowed = causal[None, None] & ~pad[:, None, None, :]
        call = AttentionCall(q, k, scaling=1.0, mask=allowed)
    s = attention_logits(q, k, scaling=1.0)
    w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    got = attention_stats(call, diag_offset=0, block_bytes=8 << 20)
    want = stats_from_weights(w, scores=s, allowed=allowed, diag_offset=0)
    for name in ("first_key", "last_key", "argmax_key", "allowed_keys"):
        assert torch.equal(got[name], want[name]), name
    assert (got["last_key"][:, :, -1] == T - 1).sum() >= 3  # hits in the last, partial chunk (keys 1024+) were found
    if mask == "padding":
        assert (got["first_key"][1, :, :70] == -1).all() and (got["first_key"][1, :, 70:] >= 70).all()
    assert_stats_equal(got, want, atol=2e-5)


@pytest.mark.parametrize("allowed_rows", ["every-row", "broadcast"])
def test_statistics_of_full_weights_for_sampled_rows(allowed_rows):
    """stats_from_weights(rows=): the rows cut before anything is computed, the diagonal read at each row's own
    position; a mask the same for every query (shape (batch, 1, 1, key)) works in blocks of rows too."""
    torch.manual_seed(4)
    B, h, T = 2, 3, 23
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :3] = True
    allowed = (~pad)[:, None, None, :]
    if allowed_rows == "every-row":
        allowed = allowed.expand(B, 1, T, T).clone()
    w = torch.softmax(torch.randn(B, h, T, T).masked_fill(~allowed, -math.inf), -1)
    rows = torch.tensor([0, 5, 6, 22])
    full = stats_from_weights(w, allowed=allowed, diag_offset=0, block_bytes=2000)
    got = stats_from_weights(w, allowed=allowed, diag_offset=0, rows=rows, block_bytes=2000)
    for name in ROW_STATS:
        a, b = got[name], full[name][:, :, rows]
        assert (
            torch.allclose(a.double(), b.double(), atol=1e-7, equal_nan=True)
            if a.dtype.is_floating_point
            else torch.equal(a, b)
        ), name
    assert torch.equal(got["key_allowed"], full["key_allowed"])


def test_engine_causal_counts_and_positions():
    q = k = torch.zeros(1, 1, 4, 2)
    s = attention_stats(AttentionCall(q, k, scaling=1.0, causal=True), diag_offset=0)
    assert s["first_key"][0, 0].tolist() == [0, 0, 0, 0] and s["last_key"][0, 0].tolist() == [0, 1, 2, 3]
    assert s["allowed_keys"][0, 0].tolist() == [1, 2, 3, 4] and s["diagonal_allowed"].all()
    assert s["first_allowed"][0, 0].tolist() == [0, 0, 0, 0] and s["last_allowed"][0, 0].tolist() == [0, 1, 2, 3]
    assert torch.allclose(s["entropy"][0, 0], torch.log(torch.arange(1.0, 5.0)))
    assert torch.allclose(
        s["key_weight"][0, 0], torch.tensor([1 + 1 / 2 + 1 / 3 + 1 / 4, 1 / 2 + 1 / 3 + 1 / 4, 1 / 3 + 1 / 4, 1 / 4])
    )
    assert torch.isnan(s["previous_mass"][0, 0, 0]) and torch.isnan(s["output_error"]).all()


def test_a_nan_or_minus_inf_at_an_allowed_key_is_not_finite():
    q = torch.zeros(1, 1, 3, 2)
    k = torch.zeros(1, 1, 3, 2)
    q[0, 0, 1, 0] = math.nan
    k[0, 0, 2, 0] = math.inf  # query 2 meets an inf logit only at its allowed key 2 (0 * inf = NaN there)
    s = attention_stats(AttentionCall(q, k, scaling=1.0, causal=True), diag_offset=0)
    assert s["finite"][0, 0].tolist() == [True, False, False]


@pytest.mark.parametrize("K", [5, 200, 1100], ids=["short", "short-200", "long"])
def test_the_largest_logit_and_the_keys_above_the_threshold_are_found_as_torch_finds_them(K):
    """The engine's searches (float arithmetic for short rows, chunk maxima for long ones) give what a max with
    indices and a comparison give: the first key on ties, a NaN or +inf row's own index, no key for an empty row."""
    from attnprobe.probe.engine.stats import _hits, _row_max

    torch.manual_seed(5)
    s = torch.randn(3, 2, 6, K).round(decimals=1)  # many ties
    s[0, 0, 1] = -math.inf  # no allowed key
    s[0, 0, 2, K // 2] = math.nan
    s[0, 1, 0, K - 1] = math.inf
    s[1, 0, 3, :] = 7.0  # every key ties
    s[1, 1, 4, K - 1] = 50.0  # the max in the last (partial) chunk
    want_max, want = s.max(-1)
    x = s.clone()
    m, got = _row_max(x, scratch=torch.empty_like(s))
    empty = torch.isneginf(m)
    assert torch.equal(m, want_max) or torch.allclose(m, want_max, equal_nan=True)
    assert torch.equal(got[~empty], want[~empty]) and (got[empty] >= 0).all()
    shift = torch.where(torch.isfinite(m), m, 0.0)[..., None]
    assert torch.equal(x.nan_to_num(), (s - shift).nan_to_num())  # shifted in place

    e = torch.exp(x)
    threshold = torch.rand(3, 2, 6) * 0.5
    threshold[2, 1, 5] = 2.0  # nothing above it
    first, last = _hits(e, threshold, scratch=torch.empty_like(e))
    hit = e > threshold[..., None]
    keys = torch.arange(K)
    some = hit.any(-1)
    assert torch.equal(first, torch.where(some, torch.where(hit, keys, K).amin(-1), -1))
    assert torch.equal(last, torch.where(some, torch.where(hit, keys, -1).amax(-1), -1))
    assert first[2, 1, 5] == -1 and last[1, 1, 4] == K - 1


def test_output_scale_bounds_the_weighted_absolute_values():
    """output_scale is |w| @ max|v| over each key's values: at least max(|w| @ |v|) (what an output's rounding
    error scales with), exactly it when every weight sits on one key."""
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    w = torch.softmax(attention_logits(q, k, scaling=0.5), -1)
    st = attention_stats(AttentionCall(q, k, scaling=0.5, v=v, output=w @ v), diag_offset=0)
    exact = (w @ v.abs()).amax(-1)
    assert (st["output_scale"] >= exact - 1e-6).all()
    assert torch.allclose(st["output_scale"], (w @ v.abs().amax(-1, keepdim=True))[..., 0], atol=1e-6)
    one = attention_stats(
        AttentionCall(q * 0, k, scaling=0.5, v=v, output=w @ v, mask=torch.eye(9, dtype=torch.bool)[None, None]),
        diag_offset=0,
    )
    assert torch.allclose(one["output_scale"], v.abs().amax(-1), atol=1e-6)


def test_a_workspace_keeps_the_block_buffers_for_the_next_call():
    """attention_stats(workspace=): the next call reuses the buffers (a capture passes one per capture), with the
    same results; another dtype gets its own."""
    torch.manual_seed(7)
    q, k, v = torch.randn(1, 2, 30, 4), torch.randn(1, 2, 30, 4), torch.randn(1, 2, 30, 4)
    call = AttentionCall(q, k, scaling=0.5, v=v, causal=True, output=torch.randn(1, 2, 30, 4))
    ws: dict = {}
    first = attention_stats(call, diag_offset=0, workspace=ws)
    pointers = {key: buf.data_ptr() for key, buf in ws.items()}
    assert len(pointers) == 2 and all(key[1] == torch.float32 for key in pointers)
    again = attention_stats(call, diag_offset=0, workspace=ws)
    assert {key: buf.data_ptr() for key, buf in ws.items()} == pointers
    assert_stats_equal(again, first, atol=0)
    assert_stats_equal(attention_stats(call, diag_offset=0), first, atol=0)
    attention_stats(replace(call, q=q.double(), k=k.double(), v=v.double()), diag_offset=0, workspace=ws)
    assert len(ws) == 4


@pytest.mark.parametrize("mask", ["padding", "causal"])
def test_a_nan_logit_at_a_key_the_row_may_not_attend_does_not_count(mask):
    """A NaN key (a padded position whose hidden state went NaN in an earlier layer) makes NaN logits only at keys
    the rows may not attend: their statistics are those of the masked softmax, finite (the engine fills forbidden
    keys by a min with a bound, then exactly for a block where that left a NaN max)."""
    torch.manual_seed(8)
    B, h, T, D = 1, 2, 40, 4
    q, k, v = torch.randn(B, h, T, D), torch.randn(B, h, T, D), torch.randn(B, h, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if mask == "padding":
        k[:, :, 3] = math.nan
        allowed = causal & (torch.arange(T) != 3)
        call = AttentionCall(q, k, scaling=0.5, v=v, mask=allowed[None, None])
    else:  # the last key: forbidden to every row but the last, which sees NaN
        k[:, :, T - 1] = math.nan
        allowed = causal
        call = AttentionCall(q, k, scaling=0.5, v=v, causal=True)
    s = attention_logits(q, k, scaling=0.5)
    w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    output = torch.nan_to_num(w, 0.0) @ v
    got = attention_stats(replace(call, output=output), diag_offset=0, block_bytes=20000)
    finite = got["finite"][0, 0]
    if mask == "padding":
        assert finite.all()
    else:
        assert finite[:-1].all() and not finite[-1]
    rows = slice(None) if mask == "padding" else slice(0, T - 1)
    want = stats_from_weights(w, scores=s, allowed=allowed.expand(B, 1, T, T), diag_offset=0)
    for name in ("entropy", "max_weight", "argmax_key", "first_key", "last_key", "max_score"):
        assert torch.allclose(got[name][..., rows].double(), want[name][..., rows].double(), atol=1e-5), name


# --------------------------------------------------------------------------- captures
def _hf(name, attn):
    hf_helpers = pytest.importorskip("hf_helpers")
    try:
        return hf_helpers, hf_helpers.build(name, attn)
    except ValueError:
        pytest.skip(f"{name} has no {attn}")


@pytest.mark.parametrize(
    "name,attn",
    [
        ("llama", "sdpa"),
        ("llama", "eager"),
        ("mistral", "sdpa"),
        ("gemma2", "eager"),
        ("gpt_oss", "eager"),
        ("t5", "sdpa"),
        ("bert", "sdpa"),
        ("gpt2", "eager"),
    ],
)
@pytest.mark.parametrize("padding", ["left", "right"])
def test_hugging_face_statistics_equal_the_full_capture(name, attn, padding, assert_no_hooks):
    """Blockwise from q, k and the call's own mask, position bias (T5), softcapping (Gemma 2), sinks (GPT-OSS),
    sliding window (Mistral): equal to the statistics of the weights a full capture recomputes or observes."""
    hf_helpers, model = _hf(name, attn)
    batch = hf_helpers.inputs(name, padding)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as stats_cap:
        stats_out = model(**batch)
    assert_no_hooks(model)
    with torch.no_grad(), attnprobe.capture(model) as full_cap:
        full_out = model(**batch)
    for a, b in zip(stats_out.values(), full_out.values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)  # the model is not perturbed
    assert len(stats_cap) == len(full_cap) > 0
    for rs, rf in zip(stats_cap, full_cap):
        assert rs.weights is None and rs.scores is None and rs.allowed is None
        assert rs.meta["stats_source"] == "blockwise"
        assert_stats_equal(rs.stats, record_stats(rf), where=(name, rf.layer, rf.kind))


def test_stats_are_read_only_and_sized_by_the_sequence():
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn, keep=("stats",)) as cap:
        attn(torch.randn(3, 5, 8))
    rec = cap[0]
    assert rec.batch_size == 3 and rec.query_len == 5 and rec.key_len == 5
    assert rec.stats["entropy"].shape == (3, 2, 5) and rec.stats["key_weight"].shape == (3, 2, 5)
    with pytest.raises(TypeError):
        rec.stats["entropy"] = None
    assert "stats=(3, 2, 5)" in repr(rec) and cap.info["selection"]["keep"] == ("stats",)
    with pytest.raises(SelectionError, match="stats"):
        attnprobe.capture(attn, keep=("statistics",))
    with pytest.raises(SelectionError, match="block_bytes"):
        attnprobe.capture(attn, keep=("stats",), block_bytes=0)


def _torch_models():
    th = pytest.importorskip("torch_helpers")
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()

    class MhaCall(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    return {
        "own": attnprobe.MultiHeadAttention(16, num_heads=4, causal=True),
        "torch_mha": MhaCall(),
        "sdpa": th.SdpaBlock(causal=True, kv_heads=2),
        "handwritten": th.HeadList(),  # found with modules="auto"
    }


@pytest.mark.parametrize("kind", ["own", "torch_mha", "sdpa", "handwritten"])
def test_every_adapter_gives_statistics(kind):
    model = _torch_models()[kind].eval()
    options = {"modules": "auto"} if kind == "handwritten" else {}
    x = torch.randn(2, 6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), attnprobe.capture(model, keep=("stats",), **options) as stats_cap:
            model(x)
        with torch.no_grad(), attnprobe.capture(model, **options) as full_cap:
            model(x)
    assert len(stats_cap) == len(full_cap) > 0
    for rs, rf in zip(stats_cap, full_cap):
        assert rs.stats is not None and rs.weights is None, (kind, rs.meta.get("stats_source"))
        assert_stats_equal(rs.stats, record_stats(rf), where=kind)
    assert attnprobe.check(stats_cap).ok


# --------------------------------------------------------------------------- checks on statistics
def _stats_only(cap):
    return [replace(r, weights=None, scores=None, allowed=None, stats=record_stats(r)) for r in cap]


def _verdicts(result):
    out = {}
    for v in result.violations:
        if v.check != "softmax_match":
            out.setdefault((v.check, v.severity, v.layer, v.head, v.batch), set()).update(v.queries)
    return out


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "own-mask"])
@pytest.mark.parametrize("mask", [LEFT_PADDED, RIGHT_PADDED], ids=["left", "right"])
@pytest.mark.parametrize("bug", (None,) + BUGS)
def test_broken_attention_gets_the_same_verdicts_from_statistics(bug, mask, declared):
    """Every broken-attention case of the check tests, checked on full records and on their statistics: the same
    checks fire in the same (layer, head, batch) with the same query positions; softmax_match says why it cannot
    run on statistics."""
    torch.manual_seed(0)
    cap = run_model(TinyTransformer(bug=bug), mask)
    kw = declarations(mask, CTX_MASK) if declared else {}
    full, stats = attnprobe.check(cap, **kw), attnprobe.check(_stats_only(cap), **kw)
    assert _verdicts(stats) == _verdicts(full), (bug, full.table(), stats.table())
    assert any(s.startswith("softmax_match: statistics only") for s in stats.skipped)
    assert {c for c, n in stats.coverage.items() if n} == {c for c, n in full.coverage.items() if n} - {"softmax_match"}


@pytest.mark.parametrize("bug", [None, "causal_plus_one", "padding_not_masked", "nan_rows", "doubled_scale"])
def test_a_statistics_capture_checks_like_a_full_one(bug):
    torch.manual_seed(0)
    model = TinyTransformer(bug=bug)
    x, ctx = torch.randn(2, 7, 16), torch.randn(2, 6, 12)
    full = capture_one(model, x, ctx, LEFT_PADDED, CTX_MASK)
    stats = capture_one(model, x, ctx, LEFT_PADDED, CTX_MASK, options={"keep": ("stats",)})
    kw = declarations(LEFT_PADDED, CTX_MASK)
    assert _verdicts(attnprobe.check(stats, **kw)) == _verdicts(attnprobe.check(full, **kw))


# --------------------------------------------------------------------------- frames
def test_to_frame_and_summary_from_statistics():
    hf_helpers, model = _hf("llama", "sdpa")
    batch = hf_helpers.inputs("llama", "left")
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as stats_cap:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model) as full_cap:
        model(**batch)
    frame = stats_cap.to_frame()
    B, H, T = stats_cap[0].stats["entropy"].shape
    assert len(frame) == len(stats_cap) * B * H * T
    assert list(frame.columns[:6]) == ["layer", "name", "call", "head", "batch", "query_pos"]
    assert not frame.duplicated(["layer", "call", "head", "batch", "query_pos"]).any()
    a, b = stats_cap.summary(), full_cap.summary()
    assert a[["layer", "head", "rows"]].equals(b[["layer", "head", "rows"]])
    for col in (
        "entropy",
        "max_weight",
        "first_key_mass",
        "diagonal_mass",
        "previous_mass",
        "masked_mass",
        "row_sum_error",
    ):
        assert ((a[col] - b[col]).abs() <= 1e-5).all(), (col, a[col].tolist(), b[col].tolist())


# --------------------------------------------------------------------------- memory
def _largest_allocation(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("keep", [("stats",), ("stats", "q", "k", "v", "output")])
def test_statistics_never_allocate_a_full_query_by_key_tensor(keep):
    """The profiler's largest single allocation is no larger than the plain forward's own (CPU sdpa allocates a
    (query x key) bool buffer) and below one head's (query x key) float32 matrix, while a full capture of the same
    call allocates that (the bound can fail)."""
    th = pytest.importorskip("torch_helpers")
    torch.manual_seed(0)
    T = 512
    model = th.SdpaBlock(causal=True, kv_heads=2).eval()
    x = torch.randn(1, T, 16)
    one_head = T * T * 4

    def run(**options):
        with torch.no_grad(), attnprobe.capture(model, **options) as cap:
            model(x)
        return cap

    cap = run(keep=keep, block_bytes=256 << 10)
    assert cap[0].stats is not None and attnprobe.check(cap, causal=True).ok
    plain = _largest_allocation(lambda: model(x))  # torch >= 2.7's CPU sdpa: a bool (query x key); 2.6: float weights
    # the engine itself, whatever torch's sdpa allocates: below a quarter of one head's (query x key) matrix
    q, k, v = (torch.randn(1, 4, T, 4) for _ in range(3))
    engine = _largest_allocation(
        lambda: attention_stats(
            AttentionCall(q, k, scaling=0.5, v=v, causal=True), diag_offset=0, block_bytes=256 << 10
        )
    )
    assert engine < one_head // 4, engine
    assert _largest_allocation(lambda: run(keep=keep, block_bytes=256 << 10)) <= max(plain, one_head // 4)
    assert _largest_allocation(lambda: run(keep=("weights",))) >= one_head


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention_statistics_never_allocate_a_full_query_by_key_tensor(causal):
    """nn.MultiheadAttention's fast path (need_weights=False) runs sdpa: its statistics come from q and k blockwise,
    with its own masks (a causal mask, key padding), the same as the full capture's, without a (query x key) tensor
    (the full capture, which keeps the weights, allocates one: the bound can fail)."""
    torch.manual_seed(0)
    T, E = 512, 16
    mha = torch.nn.MultiheadAttention(E, 4, batch_first=True).eval()
    x = torch.randn(2, T, E)
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, -40:] = True
    kwargs = {"need_weights": False, "key_padding_mask": pad}
    if causal:
        kwargs.update(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(T), is_causal=True)
        kwargs.pop("key_padding_mask")

    def run(**options):
        with torch.no_grad(), attnprobe.capture(mha, **options) as cap:
            mha(x, x, x, **kwargs)
        return cap

    stats_cap, full_cap = run(keep=("stats",), block_bytes=256 << 10), run()
    rec = stats_cap[0]
    assert rec.meta["stats_source"] == "blockwise" and rec.allowed is None
    assert_stats_equal(rec.stats, record_stats(full_cap[0]))
    assert (rec.stats["output_error"] < 1e-5).all()  # weights @ v against the output the module computed
    one_head = T * T * 4
    # torch's own kernel allocates a (query x key) bool buffer (a quarter of one head's float matrix), and, with a
    # key padding mask, a (batch, head, query, key) float mask: the capture adds nothing of that size
    assert _largest_allocation(lambda: run(keep=("stats",), block_bytes=256 << 10)) < one_head // 2
    assert _largest_allocation(lambda: run(keep=("weights",))) >= one_head


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_statistics_on_cuda_equal_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    cpu = attention_stats(AttentionCall(q, k, scaling=8**-0.5, v=v, causal=True, output=out), diag_offset=0)
    gpu = attention_stats(
        AttentionCall(q.cuda(), k.cuda(), scaling=8**-0.5, v=v.cuda(), causal=True, output=out.cuda()), diag_offset=0
    )
    assert_stats_equal({n: t.cpu() for n, t in gpu.items()}, cpu, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_generation_steps_get_the_statistics_of_the_full_capture(name):
    """KV-cache steps (one query, query_offset > 0; Mistral's sliding window): the same statistics and verdicts."""
    hf_helpers, model = _hf(name, "sdpa")
    batch = hf_helpers.inputs(name, "left")
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as stats_cap:
        model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad(), attnprobe.capture(model) as full_cap:
        model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(stats_cap) == len(full_cap) and {r.step for r in stats_cap} == {0, 1, 2}
    for rs, rf in zip(stats_cap, full_cap):
        assert_stats_equal(rs.stats, record_stats(rf), where=(rf.layer, rf.step))
    mask = torch.cat([batch["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1)
    kw = {"causal": True, "attention_mask": mask}
    assert _verdicts(attnprobe.check(stats_cap, **kw)) == _verdicts(attnprobe.check(full_cap, **kw))
    assert attnprobe.check(stats_cap, **kw).ok


def test_statistics_are_saved_and_loaded_with_the_capture(tmp_path):
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn, keep=("stats",)) as cap:
        attn(torch.randn(2, 5, 8), attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
    cap.save(tmp_path / "cap")
    back = attnprobe.load(tmp_path / "cap")
    assert back[0].weights is None
    assert_stats_equal(back[0].stats, cap[0].stats, atol=0)
    assert _verdicts(attnprobe.check(back, causal=True)) == _verdicts(attnprobe.check(cap, causal=True))


@pytest.mark.parametrize("block_bytes", [1 << 30, 256])
def test_a_mask_of_one_key_column_counts_as_the_kernel_broadcasts_it(block_bytes):
    """A mask whose key axis has size 1 (transformers 5.24's MiniMax decode steps hand eager one) is broadcast over
    every key by the kernel: the statistics count every key as the mask's column says (they counted key 0 alone,
    and the entropy of a row was NaN), in one key block or many."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=g) for _ in range(3))  # (batch, head, query, d)
    column = torch.tensor([0.0, torch.finfo(torch.float32).min]).view(2, 1, 1, 1)  # sequence 1 masks every key
    stats = {}
    for name, mask in (("column", column), ("full", column.expand(2, 1, 3, 3).clone())):
        call = AttentionCall(q, k, v=v, scaling=0.5, mask=mask, masked_at=torch.finfo(torch.float32).min / 2)
        stats[name] = attention_stats(call, diag_offset=0, block_bytes=block_bytes)
    for key in ("allowed_keys", "first_allowed", "last_allowed", "entropy", "max_weight", "key_allowed"):
        torch.testing.assert_close(stats["column"][key], stats["full"][key], equal_nan=True, msg=key)
    assert stats["column"]["allowed_keys"][0].eq(3).all() and stats["column"]["allowed_keys"][1].eq(0).all()
