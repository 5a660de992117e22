"""The checks through every capture adapter: attnprobe's own modules, Hugging Face models,
torch.nn.MultiheadAttention, direct scaled_dot_product_attention calls and hand-written softmax attention.
Correct attention passes every check (left and right padding, causal or not, with and without
declarations), and each adapter's records still let a real bug through to a check that fires."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_helpers import FusedSplit, HeadList, RawCrossAttention, SdpaBlock, leftovers

import attnprobe

LEFT = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
RIGHT = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
PADDINGS = {"left": LEFT, "right": RIGHT}


def captured(model: nn.Module, *args, options: dict | None = None, **kwargs):
    model.eval()
    with torch.no_grad(), attnprobe.capture(model, **(options or {})) as cap:
        model(*args, **kwargs)
    assert leftovers(model) == [], leftovers(model)
    assert len(cap) > 0, f"no record from {type(model).__name__}"
    return cap


def assert_clean(cap, **declared):
    """No violation, something verified, and every record checked for the core invariants."""
    result = attnprobe.check(cap, **declared)
    assert result.violations == () and result.verified, (declared, result.table())
    for name in ("finite", "range", "row_sum"):
        assert result.coverage[name] == len(cap), (name, result.table())
    return result


def x(batch=2, tokens=6, d=16):
    return torch.randn(batch, tokens, d, generator=torch.Generator().manual_seed(5))


# --------------------------------------------------------------------------- own modules
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("causal", [True, False])
def test_own_module(padding, causal):
    mask = PADDINGS[padding]
    cap = captured(attnprobe.MultiHeadAttention(16, num_heads=4, causal=causal), x(), attention_mask=mask)
    assert_clean(cap)
    result = assert_clean(cap, causal=causal, attention_mask=mask)
    assert result.coverage["padding"] == result.coverage["causal"] == result.coverage["output_match"] == 1


def test_own_cross_attention():
    ctx_mask = torch.tensor([[1, 1, 1, 0], [1] * 4])
    attn = attnprobe.CrossAttention(16, 12, num_heads=4)
    cap = captured(attn, x(), torch.randn(2, 4, 12), attention_mask=ctx_mask)
    assert cap[0].kind == "cross"
    assert assert_clean(cap, attention_mask=ctx_mask).coverage["padding"] == 1


# --------------------------------------------------------------------------- torch.nn.MultiheadAttention
@pytest.mark.parametrize("padding", ["left", "right"])
def test_torch_mha_with_key_padding(padding):
    mask = PADDINGS[padding]
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    t = x()
    cap = captured(mha, t, t, t, key_padding_mask=mask == 0)
    assert cap[0].kind == "self"
    assert_clean(cap)
    assert assert_clean(cap, causal=False, attention_mask=mask).coverage["padding"] == 1


def test_torch_mha_causal_right_padded():
    """Left padding under a causal mask leaves rows with no key, which torch's MHA fills with NaN (a real
    hazard that ``finite`` reports); right padding keeps a key in every row."""
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # torch's convention: True = may not attend
    t = x()
    cap = captured(mha, t, t, t, attn_mask=causal, key_padding_mask=RIGHT == 0, is_causal=True)
    assert cap[0].causal is True and cap[0].kind == "self"
    assert_clean(cap)
    assert assert_clean(cap, causal=True, attention_mask=RIGHT).coverage["causal"] == 1


def test_torch_transformer_encoder_layer():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    cap = captured(layer, x(), src_key_padding_mask=LEFT == 0)
    assert_clean(cap, causal=False, attention_mask=LEFT)


# --------------------------------------------------------------------------- direct sdpa calls
def sdpa_mask(padding, causal: bool):
    allowed = padding.bool()[:, None, None, :].expand(2, 1, 6, 6)
    return allowed & torch.ones(6, 6, dtype=torch.bool).tril() if causal else allowed


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("causal", [True, False])
def test_direct_sdpa_with_a_bool_mask(padding, causal):
    """No query padding is known to this adapter: right-padded queries that may not attend their own padded
    key are padding, not a shifted causal mask; left-padded rows with no key are left out."""
    mask = PADDINGS[padding]
    cap = captured(SdpaBlock(), x(), sdpa_mask(mask, causal))
    assert cap[0].query_padding is None
    if causal and padding == "left":
        result = attnprobe.check(cap)  # rows with no allowed key: information only
        assert result.ok and {v.check for v in result.violations} == {"empty_rows"}, result.table()
    else:
        assert_clean(cap)
    assert_clean(cap, causal=causal, attention_mask=mask)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_direct_sdpa_is_causal_flag(kv_heads):
    cap = captured(SdpaBlock(causal=True, kv_heads=kv_heads), x())
    assert cap[0].causal is True and cap[0].num_kv_heads == kv_heads
    assert assert_clean(cap, causal=True).coverage["output_match"] == 1


# --------------------------------------------------------------------------- hand-written attention
def test_hand_written_heads_in_a_module_list():
    model = HeadList()
    cap = captured(model, x(), options={"modules": [model]})
    assert cap[0].heads == (0, 1, 2, 3) and cap[0].causal is True
    assert_clean(cap)
    assert_clean(cap, causal=True)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_hand_written_fused_attention_with_an_additive_padding_mask(padding):
    """nanoGPT style: causal masked_fill(-inf) plus an additive -1e9 padding mask."""
    mask = PADDINGS[padding]
    model = FusedSplit()
    cap = captured(model, x(), mask, options={"modules": [model]})
    if padding == "left":  # the padded queries have no allowed key: information only
        result = attnprobe.check(cap)
        assert result.ok and {v.check for v in result.violations} == {"empty_rows"}, result.table()
    else:
        assert_clean(cap)
    assert_clean(cap, causal=True, attention_mask=mask)


def test_hand_written_cross_attention():
    ctx_mask = torch.tensor([[1, 1, 1, 0], [1] * 4])
    model = RawCrossAttention()
    cap = captured(model, x(), torch.randn(2, 4, 12), ctx_mask, options={"modules": [model]})
    assert cap[0].kind == "cross"
    assert_clean(cap, attention_mask=ctx_mask)


# --------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family, causal", [("gpt2", True), ("llama", True), ("mistral", True), ("bert", False)])
def test_hugging_face_models(family, causal, padding):
    pytest.importorskip("transformers")
    from hf_helpers import build, inputs

    batch = inputs(family, padding)
    for attn in ("sdpa", "eager"):
        cap = captured(build(family, attn), **batch)
        assert_clean(cap)
        result = assert_clean(cap, causal=causal, attention_mask=batch["attention_mask"])
        assert result.coverage["padding"] == result.coverage["output_match"] == len(cap)


# --------------------------------------------------------------------------- and bugs still show
def test_every_adapter_still_reports_a_dropped_padding_mask():
    """The same bug (the padding mask never reaches attention) through four adapters: the records are
    self-consistent, and the declared mask catches it in each. (Left padding: under a causal mask,
    right-padded keys come after every real query, so dropping that mask changes nothing.)"""
    mask, t, hand = LEFT, x(), FusedSplit()
    cases = {
        "own": captured(attnprobe.MultiHeadAttention(16, num_heads=4), t),
        "mha": captured(nn.MultiheadAttention(16, 4, batch_first=True), t, t, t),
        "sdpa": captured(SdpaBlock(), t),
        "hand": captured(hand, t, options={"modules": [hand]}),
    }
    for name, cap in cases.items():
        assert attnprobe.check(cap).ok, name
        errors = attnprobe.check(cap, attention_mask=mask).errors
        assert errors and {v.check for v in errors} == {"padding"}, (name, attnprobe.check(cap, attention_mask=mask))
        assert {v.batch for v in errors} == {0} and {v.keys for v in errors} == {(0, 1)}, name
        assert all(min(v.queries) >= 2 for v in errors), name  # padded queries 0 and 1 are left out
