"""attnprobe's own attention modules: the textbook numbers, masks, cross-attention, hook points."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnprobe
from attnprobe import CrossAttention, MultiHeadAttention

TEXTBOOK_X = torch.tensor([[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]])


def textbook_module(causal: bool) -> MultiHeadAttention:
    torch.manual_seed(42)
    return MultiHeadAttention(2, num_heads=1, bias=False, out_proj=False, causal=causal)


def test_textbook_self_attention_numbers():
    out = textbook_module(causal=False)(TEXTBOOK_X)
    expected = torch.tensor([[1.0100, 1.0641], [0.2040, 0.7057], [3.4989, 2.2427]])
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=0)


def test_textbook_causal_self_attention_numbers():
    out = textbook_module(causal=True)(TEXTBOOK_X)
    expected = torch.tensor([[0.6038, 0.7434], [-0.0062, 0.6072], [3.4989, 2.2427]])
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=0)


def test_matches_torch_sdpa_with_padding_and_causal_mask():
    attn = MultiHeadAttention(16, num_heads=4, causal=True, out_proj=False).eval()
    x = torch.randn(3, 7, 16)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 6 + [0]])
    out = attn(x, attention_mask=mask)
    q = attn.q_proj(x).view(3, 7, 4, 4).transpose(1, 2)
    k = attn.k_proj(x).view(3, 7, 4, 4).transpose(1, 2)
    v = attn.v_proj(x).view(3, 7, 4, 4).transpose(1, 2)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(3, 7, 16)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_cross_attention_different_lengths_and_widths():
    attn = CrossAttention(16, 12, num_heads=2)
    x, ctx = torch.randn(4, 9, 16), torch.randn(4, 8, 12)
    assert attn(x, ctx).shape == (4, 9, 16)
    assert attn(x[0], ctx[0]).shape == (9, 16)  # unbatched, as torch accepts
    with pytest.raises(ValueError, match="needs a context"):
        attn(x, None)
    with pytest.raises(ValueError, match="d_context=12"):
        attn(x, torch.randn(4, 8, 16))


def test_unbatched_equals_batched_row():
    attn = MultiHeadAttention(8, num_heads=2, causal=True).eval()
    x = torch.randn(5, 8)
    torch.testing.assert_close(attn(x), attn(x[None])[0])


def test_padded_query_under_causal_mask_is_finite():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    left_padded = torch.tensor([[0, 0, 1, 1, 1]])
    out = attn(torch.randn(1, 5, 8), attention_mask=left_padded)
    assert torch.isfinite(out).all()


def test_explicit_masks_bool_and_float_agree():
    attn = MultiHeadAttention(8, num_heads=2).eval()
    x = torch.randn(2, 5, 8)
    allowed = torch.rand(5, 5) > 0.3
    allowed |= torch.eye(5, dtype=torch.bool)
    additive = torch.zeros(5, 5).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(attn(x, attn_mask=allowed), attn(x, attn_mask=additive))


def test_options_for_biases_and_output_projection():
    plain = MultiHeadAttention(8, num_heads=2, bias=False, out_proj=False)
    assert plain.out_proj is None and plain.q_proj.bias is None
    full = MultiHeadAttention(8, num_heads=2)
    assert full.out_proj is not None and full.q_proj.bias is not None


def test_dropout_only_in_training():
    attn = MultiHeadAttention(8, num_heads=2, dropout=0.5)
    x = torch.randn(1, 6, 8)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    attn.train()
    assert not torch.equal(attn(x), attn(x))


def test_hook_points_observable_with_plain_forward_hooks():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    seen = {}
    handles = [
        getattr(attn, f"hook_{n}").register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.shape))
        for n in ("q", "k", "v", "scores", "allowed", "weights", "output")
    ]
    attn(torch.randn(3, 5, 8))
    for h in handles:
        h.remove()
    assert seen == {
        "q": (3, 2, 5, 4),
        "k": (3, 2, 5, 4),
        "v": (3, 2, 5, 4),
        "scores": (3, 2, 5, 5),
        "allowed": (3, 1, 5, 5),
        "weights": (3, 2, 5, 5),
        "output": (3, 5, 8),
    }


@pytest.mark.parametrize(
    "kwargs, call, match",
    [
        ({}, lambda a: a(torch.randn(2, 5, 7)), "d_model=8"),
        ({}, lambda a: a(torch.randn(5)), r"\(batch, query, d_model\)"),
        ({}, lambda a: a(torch.randn(2, 5, 8), attention_mask=torch.ones(2, 4)), "attention_mask must be"),
        ({"causal": True}, lambda a: a(torch.randn(2, 5, 8), torch.randn(2, 4, 8)), "as many keys as queries"),
    ],
)
def test_bad_input_errors(kwargs, call, match):
    with pytest.raises(ValueError, match=match):
        call(MultiHeadAttention(8, num_heads=2, **kwargs))


def test_constructor_errors():
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(10, num_heads=3)
    with pytest.raises(ValueError, match="cannot be causal"):
        CrossAttention(8, 4, causal=True)
    assert MultiHeadAttention(10, num_heads=3, d_head=4).q_proj.out_features == 12


def test_public_names():
    for name in attnprobe.__all__:
        assert getattr(attnprobe, name) is not None


def _projections(attn, x):
    B, T, _ = x.shape
    split = lambda t: t.view(B, T, attn.num_heads, attn.d_head).transpose(1, 2)  # noqa: E731
    return split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))


@pytest.mark.parametrize("shape", [(5, 5), (2, 1, 5, 5), (1, 2, 5, 5), (2, 2, 5, 5), (2, 1, 1, 5)])
def test_attn_mask_follows_sdpa_semantics(shape):
    """bool: True = may attend; float: added to the scores (a finite bias changes weights, -inf masks)."""
    attn = MultiHeadAttention(8, num_heads=2, out_proj=False).eval()
    x = torch.randn(2, 5, 8)
    q, k, v = _projections(attn, x)
    allowed = (torch.rand(shape) > 0.4) | (torch.eye(5, dtype=torch.bool) if shape[-2] == 5 else True)
    bias = torch.randn(shape)
    additive = bias.masked_fill(~allowed, float("-inf"))
    for mask in (allowed, bias, additive):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(2, 5, 8)
        torch.testing.assert_close(attn(x, attn_mask=mask), ref, atol=1e-6, rtol=1e-5)
    with attnprobe.capture(attn) as cap:
        attn(x, attn_mask=additive)
    rec = cap[0]
    expected_allowed = allowed.expand(2, 2 if shape[1:2] == (2,) and len(shape) == 4 else 1, 5, 5)
    assert rec.allowed.shape == expected_allowed.shape and torch.equal(rec.allowed, expected_allowed)
    assert torch.all(rec.weights[~rec.allowed_for_heads()] == 0)
    # scores carry the finite part of the float mask (it is a bias), not the -inf
    finite = torch.where(allowed, bias, 0.0)
    torch.testing.assert_close(rec.scores, (q @ k.transpose(-2, -1)) * attn.scaling + finite)


@pytest.mark.parametrize(
    "mask, error, match",
    [
        (
            torch.ones(4, 5),
            ValueError,
            r"attn_mask of shape \(4, 5\) does not broadcast to \(batch, head, query, key\)",
        ),
        (torch.ones(3, 1, 5, 5), ValueError, r"does not broadcast.*\(2, 2, 5, 5\)"),
        (torch.ones(1, 2, 2, 5, 5), ValueError, r"shape \(1, 2, 2, 5, 5\) does not broadcast"),
        (torch.ones(5, 5, dtype=torch.long), TypeError, "bool .* or floating point.*use attention_mask= instead"),
        ([[True] * 5] * 5, TypeError, "attn_mask must be a tensor"),
        (torch.full((5, 5), float("nan")), ValueError, "NaN or \\+inf"),
        (torch.full((5, 5), float("inf")), ValueError, "NaN or \\+inf"),
    ],
)
def test_attn_mask_errors(mask, error, match, assert_no_hooks):
    attn = MultiHeadAttention(8, num_heads=2)
    with pytest.raises(error, match=match):
        attn(torch.randn(2, 5, 8), attn_mask=mask)
    with pytest.raises(error, match=match):  # the same error under capture, and no hook left behind
        with attnprobe.capture(attn):
            attn(torch.randn(2, 5, 8), attn_mask=mask)
    assert_no_hooks(attn)


def test_unbatched_attn_mask_per_head():
    attn = MultiHeadAttention(8, num_heads=2).eval()
    x = torch.randn(5, 8)
    mask = (torch.rand(2, 5, 5) > 0.5) | torch.eye(5, dtype=torch.bool)
    torch.testing.assert_close(attn(x, attn_mask=mask), attn(x[None], attn_mask=mask[None])[0])
    with pytest.raises(ValueError, match=r"\(head, query, key\) for unbatched input"):
        attn(x, attn_mask=torch.ones(2, 2, 5, 5, dtype=torch.bool))


def test_non_tensor_arguments_are_clear_errors():
    attn = MultiHeadAttention(8, num_heads=2)
    with pytest.raises(TypeError, match="context must be a tensor"):
        attn(torch.randn(2, 5, 8), [[0.0] * 8] * 4)
    with pytest.raises(TypeError, match="attention_mask must be a tensor"):
        attn(torch.randn(2, 5, 8), attention_mask=[[1] * 5] * 2)
