"""Hand-written attention in the styles people really write (``wild_models.py``), captured with
``modules=[...]``, ``modules="auto"`` and (for the sdpa branches) the default, and compared with q/k/v
recomputed here from the module's own weights, independently of attnprobe and of the module's forward."""

from __future__ import annotations

import pytest
import torch
from torch_helpers import leftovers
from wild_models import (
    AlibiAttention,
    BloomStyleAlibi,
    CachedCausalSelfAttention,
    CausalSelfAttention,
    DecoderBlock,
    EinsumAttention,
    FoldedHeadsAttention,
    GroupedQueryAttention,
    LlamaReferenceAttention,
    MultiHeadedAttention,
    RelativeBiasAttention,
    T5StyleAttention,
    VitAttention,
    alibi_slopes,
    llama_mask,
    subsequent_mask,
)

import attnprobe

B, T, S, D, H, HD = 2, 6, 5, 16, 4, 4
ALL = frozenset({"q", "k", "v", "scores", "weights", "output", "allowed"})
X = torch.randn(B, T, D, generator=torch.Generator().manual_seed(11))
MEMORY = torch.randn(B, S, D, generator=torch.Generator().manual_seed(12))
MEMORY_MASK = torch.tensor([[1] * S, [1, 1, 1, 0, 0]])
PADDING = torch.tensor([[1] * T, [1, 1, 1, 1, 0, 0]])
TRIL = torch.ones(T, T, dtype=torch.bool).tril()
MODES = {"list": lambda m: {"modules": [m]}, "auto": lambda m: {"modules": "auto"}}


def build(cls, **kw):
    torch.manual_seed(0)
    return cls(**kw).eval()


def run(model, *args, **options):
    plain = model(*args)
    with attnprobe.capture(model, **options) as cap:
        got = model(*args)
    # bitwise, NaN included (a buggy mask can leave rows with no key)
    torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True, msg="capture changed the model's output")
    assert leftovers(model) == []
    return cap


def heads_of(t, n=H):
    """(B, T, n * HD) -> (B, n, T, HD)."""
    return t.view(t.shape[0], t.shape[1], n, -1).transpose(1, 2)


def expect(rec, q, k, v, scale, allowed, *, bias=None, causal, kind="self", atol=1e-6):
    """Every identified field of ``rec`` against attention computed here from q, k (kv heads), v."""
    assert rec.identified == ALL, sorted(ALL - rec.identified)
    kv = k.shape[1]
    assert (rec.num_heads, rec.num_kv_heads, rec.kind, rec.causal) == (q.shape[1], kv, kind, causal)
    assert rec.scaling == pytest.approx(scale)
    k_full, v_full = (t.repeat_interleave(q.shape[1] // kv, dim=1) for t in (k, v))
    scores = q @ k_full.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    for name, want in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("scores", scores),
        ("weights", weights),
        ("output", weights @ v_full),
    ):
        torch.testing.assert_close(
            getattr(rec, name),
            want.expand_as(getattr(rec, name)),
            rtol=0,
            atol=atol,
            msg=lambda m, name=name: f"{name}: {m}",
        )
        assert getattr(rec, name).shape == want.shape, name
    assert torch.equal(rec.allowed_for_heads(), allowed.expand(B, q.shape[1], *allowed.shape[-2:]))


def errors(cap, **declared):
    return sorted({v.check for v in attnprobe.check(cap, **declared).errors})


def lints(cap):
    return sorted({v.check for r in cap for v in r.meta.get("lint", ())})


# ------------------------------------------------------------------------------------------------ 1 nanoGPT
@pytest.mark.parametrize("masking", ["fill", "assign"])
@pytest.mark.parametrize("mode", MODES)
def test_nanogpt_causal_self_attention(mode, masking):
    # "assign": att[:, :, future] = -inf, an in-place mask by index assignment
    model = build(CausalSelfAttention, masking=masking)
    (rec,) = run(model, X, **MODES[mode](model))
    q, k, v = (heads_of(t) for t in model.c_attn(X).split(D, dim=2))
    expect(rec, q, k, v, HD**-0.5, TRIL, causal=True)
    assert errors(run(model, X, **MODES[mode](model)), causal=True) == []


def test_nanogpt_mask_compared_with_one_is_caught():
    model = build(CausalSelfAttention, bug="mask_eq_1")
    cap = run(model, X, modules=[model])
    assert not cap[0].causal and not cap[0].allowed[0, 0, 0, 0] and cap[0].allowed[0, 0, 0, 1]
    assert "causal" in errors(cap, causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_nanogpt_with_a_kv_cache_is_self_attention_at_an_offset(mode):
    model = build(CachedCausalSelfAttention)
    prompt, new = X[:, :4], X[:, 4:]
    _, past = model(prompt)
    cap = run(model, new, past, **MODES[mode](model))
    (rec,) = cap
    q, k, v = (heads_of(t) for t in model.c_attn(X).split(D, dim=2))
    # the two new queries at positions 4 and 5 against all six keys: the last two rows of the causal mask
    expect(rec, q[:, :, 4:], k, v, HD**-0.5, TRIL[4:], causal=True)
    assert rec.meta["kind_from"] == "sources" and rec.query_offset == 4
    assert errors(cap, causal=True, attention_mask=torch.ones(B, T)) == []


def test_nanogpt_kv_cache_mask_rows_from_zero_is_not_causal_at_the_offset():
    model = build(CachedCausalSelfAttention, bug="mask_rows_from_zero")
    _, past = model(X[:, :4])
    (rec,) = run(model, X[:, 4:], past, modules=[model])
    # rows 0-1 of the tril: the new queries see only keys 0 and 0-1, still causal but not their own position
    assert rec.causal is True and rec.query_offset == 4 and not rec.allowed[0, 0, :, 4:].any()


@pytest.mark.parametrize("mode", ["list", "auto", "default"])
def test_nanogpt_flash_branch(mode):
    model = build(CausalSelfAttention, flash=True)
    (rec,) = run(model, X, **({} if mode == "default" else MODES[mode](model)))
    assert rec.backend == "sdpa"
    q, k, v = (heads_of(t) for t in model.c_attn(X).split(D, dim=2))
    expect(rec, q, k, v, HD**-0.5, TRIL, causal=True)
    slow = build(CausalSelfAttention)  # the same weights, the softmax branch: the same attention
    (twin,) = run(slow, X, modules=[slow])
    torch.testing.assert_close(rec.weights, twin.weights, rtol=0, atol=1e-6)
    assert errors(run(model, X), causal=True) == []


# ------------------------------------------------------------------------------------------------ 2 timm ViT
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("mode", MODES)
def test_timm_vit_attention(mode, qk_norm):
    model = build(VitAttention, qk_norm=qk_norm)
    cap = run(model, X, **MODES[mode](model))
    q, k, v = (heads_of(t) for t in model.qkv(X).split(D, dim=-1))
    q, k = model.q_norm(q), model.k_norm(k)  # qk-norm is part of q and k: the record's q is what meets k
    expect(cap[0], q, k, v, HD**-0.5, torch.ones(T, T, dtype=torch.bool), causal=False)
    assert cap[0].meta["kind_from"] == "sources"
    assert errors(cap, causal=False) == [] and lints(cap) == []


def test_timm_vit_head_merge_without_transpose_is_linted():
    model = build(VitAttention, bug="merge_without_transpose")
    with pytest.warns(attnprobe.AttnprobeWarning, match="heads merged"):
        cap = run(model, X, modules=[model])
    assert lints(cap) == ["lint_head_merge"]


@pytest.mark.parametrize("mode", ["list", "auto", "default"])
def test_timm_vit_fused_attn(mode):
    model = build(VitAttention, fused_attn=True)
    (rec,) = run(model, X, **({} if mode == "default" else MODES[mode](model)))
    q, k, v = (heads_of(t) for t in model.qkv(X).split(D, dim=-1))
    expect(rec, q, k, v, HD**-0.5, torch.ones(T, T, dtype=torch.bool), causal=False)


# ---------------------------------------------------------------------------------------------- 3 Annotated Transformer
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masking", ["padding", "subsequent"])
def test_annotated_transformer_attention_function(mode, masking):
    model = build(MultiHeadedAttention)
    pad = PADDING[:, None, :].bool()  # (B, 1, T), as the Batch class builds src_mask
    mask = pad if masking == "padding" else pad & subsequent_mask(T)  # tgt_mask (B, T, T)
    cap = run(model, X, X, X, mask, **MODES[mode](model))
    q, k, v = (heads_of(lin(X)) for lin in model.linears[:3])
    allowed = mask[:, None].expand(B, 1, T, T)
    expect(cap[0], q, k, v, HD**-0.5, allowed, causal=masking == "subsequent")
    torch.testing.assert_close(cap[0].weights, model.attn, rtol=0, atol=0)  # the module keeps its own p_attn
    assert errors(cap, causal=masking == "subsequent", attention_mask=PADDING) == []


def test_annotated_transformer_mask_compared_with_one_is_caught():
    model = build(MultiHeadedAttention, bug="mask_eq_1")
    cap = run(model, X, X, X, PADDING[:, None, :], modules=[model])
    assert "padding" in errors(cap, causal=False, attention_mask=PADDING)


# ------------------------------------------------------------------------------------------------ 4 einsum
@pytest.mark.parametrize("mode", MODES)
def test_einsum_attention(mode):
    model = build(EinsumAttention)
    cap = run(model, X, **MODES[mode](model))
    q, k, v = (heads_of(f(X)) for f in (model.to_q, model.to_k, model.to_v))
    expect(cap[0], q, k, v, HD**-0.5, torch.ones(T, T, dtype=torch.bool), causal=False)
    assert errors(cap, causal=False) == [] and lints(cap) == []


def test_einsum_softmax_over_queries_is_caught():
    model = build(EinsumAttention, bug="softmax_dim")
    with pytest.warns(attnprobe.AttnprobeWarning, match="normalizes over dim=2"):
        cap = run(model, X, modules=[model])
    assert "row_sum" in errors(cap, causal=False) and lints(cap) == ["lint_softmax_axis"]


# ------------------------------------------------------------------------------------------------ 5 MQA / GQA
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "repeat, kv_heads", [("interleave", 2), ("expand", 2), ("expand", 1), ("expand_one", 1), ("grouped", 2)]
)
def test_grouped_query_attention_keeps_the_kv_heads(mode, repeat, kv_heads):
    model = build(GroupedQueryAttention, kv_heads=kv_heads, repeat=repeat)
    cap = run(model, X, **MODES[mode](model))
    q, k, v = heads_of(model.wq(X)), heads_of(model.wk(X), kv_heads), heads_of(model.wv(X), kv_heads)
    expect(cap[0], q, k, v, HD**-0.5, TRIL, causal=True)
    assert errors(cap, causal=True) == []


# ------------------------------------------------------------------------------------------------ 6 additive biases
@pytest.mark.parametrize("mode", MODES)
def test_alibi_bias_is_part_of_the_scores_and_the_inf_mask_is_the_mask(mode):
    model = build(AlibiAttention)
    cap = run(model, X, **MODES[mode](model))
    q, k, v = (heads_of(t) for t in model.qkv(X).split(D, dim=-1))
    pos = torch.arange(T, dtype=torch.float)
    bias = alibi_slopes(H)[:, None, None] * (pos[None, :] - pos[:, None])
    expect(cap[0], q, k, v, HD**-0.5, TRIL, bias=bias, causal=True)
    assert errors(cap, causal=True) == []


def test_alibi_without_the_causal_mask_is_caught():
    model = build(AlibiAttention, bug="causal_mask_forgotten")
    cap = run(model, X, modules=[model])
    assert cap[0].causal is False and cap[0].allowed.all()  # the ALiBi bias alone is no mask
    assert errors(cap, causal=True) == ["causal"]


@pytest.mark.parametrize("mode", MODES)
def test_relative_position_bias_table(mode):
    model = build(RelativeBiasAttention)
    cap = run(model, X, **MODES[mode](model))
    q, k, v = (heads_of(t) for t in model.qkv(X).split(D, dim=-1))
    i = torch.arange(T)
    bias = model.relative_position_bias_table[(i[:, None] - i[None, :]) + 7].permute(2, 0, 1)  # (H, T, T)
    expect(cap[0], q, k, v, HD**-0.5, torch.ones(T, T, dtype=torch.bool), bias=bias.detach(), causal=False)
    assert errors(cap, causal=False) == []


# ------------------------------------------------------------------------------------------------ 7 decoder block
@pytest.mark.parametrize("mode", MODES)
def test_decoder_block_self_and_cross_attention(mode):
    model = build(DecoderBlock)
    cap = run(model, X, MEMORY, MEMORY_MASK, **MODES[mode](model))
    # two submodules of one class (one softmax line) are two layers, also when only the block is named
    assert [(r.layer, r.call, r.kind) for r in cap] == [(0, 0, "self"), (1, 0, "cross")]
    sa, ca = model.self_attn, model.cross_attn
    h = model.ln1(X)
    expect(cap[0], heads_of(sa.q_proj(h)), heads_of(sa.k_proj(h)), heads_of(sa.v_proj(h)), HD**-0.5, TRIL, causal=True)
    x1 = model.ln2(X + sa(h, h, TRIL))
    allowed = MEMORY_MASK.bool()[:, None, None, :].expand(B, 1, T, S)
    expect(
        cap[1],
        heads_of(ca.q_proj(x1)),
        heads_of(ca.k_proj(MEMORY)),
        heads_of(ca.v_proj(MEMORY)),
        HD**-0.5,
        allowed,
        causal=False,
        kind="cross",
    )
    assert errors(cap, causal={0: True}, attention_mask={1: MEMORY_MASK}) == []


def test_decoder_block_memory_mask_ignored_is_caught():
    model = build(DecoderBlock, bug="memory_mask_ignored")
    cap = run(model, X, MEMORY, MEMORY_MASK, modules="auto")
    assert cap[1].kind == "cross" and cap[1].allowed.all()
    assert errors(cap, causal={0: True}, attention_mask={1: MEMORY_MASK}) == ["padding"]


# ------------------------------------------------------------------------------------------------ 8 folded heads
@pytest.mark.parametrize("scratch", [None, float("nan"), float("-inf")], ids=["empty", "nan", "-inf"])
@pytest.mark.parametrize("mode", MODES)
def test_folded_heads_baddbmm_and_bmm(mode, scratch):
    # baddbmm(beta=0) ignores its input: whatever the uninitialised buffer holds is neither mask nor score
    model = build(FoldedHeadsAttention, scratch=scratch)
    cap = run(model, X, **MODES[mode](model))
    q, k, v = (heads_of(t) for t in model.c_attn(X).split(D, dim=-1))
    expect(cap[0], q, k, v, HD**-0.5, TRIL, causal=True)
    assert errors(cap, causal=True) == []


def test_folded_heads_mask_sliced_wrong_is_caught():
    model = build(FoldedHeadsAttention, bug="mask_sliced_wrong")
    cap = run(model, X, modules=[model])
    assert cap[0].causal is False and "causal" in errors(cap, causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_bloom_style_alibi_as_baddbmm_input_with_keyword_batches(mode):
    model = build(BloomStyleAlibi)
    cap = run(model, X, **MODES[mode](model))
    fused = model.query_key_value(X).view(B, T, H, 3, HD)
    q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
    bias = (alibi_slopes(H)[:, None] * torch.arange(T)[None, :])[:, None, :]  # (H, 1, T)
    expect(cap[0], q, k, v, HD**-0.5, TRIL, bias=bias, causal=True)
    assert errors(cap, causal=True) == []


# ------------------------------------------------------------------------------------------------ 9 Llama reference
def rotary(t, positions):
    """Rotate consecutive pairs (x0, x1) of the last axis of (B, H, T, D) by position * theta_i."""
    d = t.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    angle = positions[:, None].float() * theta[None, :]  # (T, D/2)
    x0, x1 = t[..., 0::2], t[..., 1::2]
    out = torch.stack([x0 * angle.cos() - x1 * angle.sin(), x0 * angle.sin() + x1 * angle.cos()], dim=-1)
    return out.flatten(-2)


@pytest.mark.parametrize("mode", MODES)
def test_llama_reference_rotary_repeat_kv_and_additive_mask(mode):
    model = build(LlamaReferenceAttention)
    cap = run(model, X, llama_mask(T), **MODES[mode](model))
    pos = torch.arange(T)
    q = rotary(heads_of(model.wq(X)), pos)
    k = rotary(heads_of(model.wk(X), 2), pos)
    expect(cap[0], q, k, heads_of(model.wv(X), 2), HD**-0.5, TRIL, causal=True, atol=1e-5)
    assert cap[0].meta["kind_from"] == "sources"  # followed through the complex rotary embedding
    assert errors(cap, causal=True) == []


@pytest.mark.parametrize("mode", MODES)
def test_t5_style_bias_and_mask_added_in_place(mode):
    # scores += position_bias overwrites the scores: the record keeps them as they were before the add
    model = build(T5StyleAttention)
    cap = run(model, X, PADDING.float(), **MODES[mode](model))
    q, k, v = (heads_of(f(X)) for f in (model.q, model.k, model.v))
    allowed = PADDING.bool()[:, None, None, :].expand(B, 1, T, T)
    # where the padding's finfo.min swallowed the position bias, no bias is left to know
    bias = model.position_bias(T).detach().masked_fill(~allowed, 0.0)
    expect(cap[0], q, k, v, 1.0, allowed, bias=bias, causal=False)
    assert cap[0].scores.abs().max() < 100
    assert errors(cap, causal=False, attention_mask=PADDING) == []


def test_t5_style_padding_folded_on_the_query_axis_is_caught():
    model = build(T5StyleAttention, bug="mask_on_queries")
    cap = run(model, X, PADDING.float(), modules=[model])
    assert "padding" in errors(cap, causal=False, attention_mask=PADDING)


@pytest.mark.parametrize("mode", MODES)
def test_llama_reference_kv_cache_written_in_place(mode):
    model = build(LlamaReferenceAttention)
    model(X[:, :4], llama_mask(4), 0)  # prefill the cache
    cap = run(model, X[:, 4:5], None, 4, **MODES[mode](model))  # one decode step at position 4
    pos = torch.arange(T)
    q = rotary(heads_of(model.wq(X)), pos)[:, :, 4:5]
    k = rotary(heads_of(model.wk(X), 2), pos)[:, :, :5]
    allowed = torch.ones(1, 5, dtype=torch.bool)
    expect(cap[0], q, k, heads_of(model.wv(X), 2)[:, :, :5], HD**-0.5, allowed, causal=True, atol=1e-5)
    assert cap[0].meta["kind_from"] == "sources" and cap[0].query_offset == 4
    assert errors(cap, causal=True, attention_mask=torch.ones(B, 5)) == []


def test_llama_reference_mask_transposed_is_caught():
    model = build(LlamaReferenceAttention)
    cap = run(model, X, llama_mask(T).T, modules=[model])  # -inf below the diagonal: the past is masked
    assert cap[0].causal is False and "causal" in errors(cap, causal=True)
