"""Hugging Face capture in float64 and bfloat16: recomputed weights keep the model's own precision."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import ENCODER_DECODER, build, group_records, inputs, max_error_on_real_rows, twin

import attnprobe


def _main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _eager_reference(model, batch) -> dict:
    reference = twin(model, "eager").to(model.dtype)
    with torch.no_grad():
        out = reference(**batch, output_attentions=True)
    if hasattr(out, "encoder_attentions"):
        return {
            ("encoder", "self"): out.encoder_attentions,
            ("decoder", "self"): out.decoder_attentions,
            ("decoder", "cross"): out.cross_attentions,
        }
    return {(None, "self"): out.attentions}


# t5: a position bias turns sdpa's bool mask into finfo.min, which did not fit a float32 buffer
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["bert", "t5", "bart", "llama"])
def test_float64_models_are_recomputed_in_float64(name, attn, assert_no_hooks):
    model = build(name, attn).double()
    batch = inputs(name, "right")
    with torch.no_grad():
        plain = model(**batch)
        with attnprobe.capture(model) as cap:
            captured = model(**batch)
    assert torch.equal(_main_output(plain), _main_output(captured))
    if name in ENCODER_DECODER:
        assert torch.equal(plain.encoder_last_hidden_state, captured.encoder_last_hidden_state)
    assert_no_hooks(model)
    assert all(r.weights.dtype == torch.float64 for r in cap)
    assert all(r.scores.dtype == torch.float64 for r in cap if r.scores is not None)

    # llama's eager function runs its softmax in float32: its reference is float32-accurate only
    float32_softmax = name == "llama" and attn == "eager"
    reference = _eager_reference(model, batch)
    for key, records in group_records(cap).items():
        assert len(records) == len(reference[key])
        for record, weights in zip(records, reference[key]):
            # float32 recomputation was off by ~1e-8, a row_sum error at float64's tolerance
            tol = 1e-7 if name == "llama" else 1e-12
            assert max_error_on_real_rows(record, weights) <= tol, (key, record.name)
            assert record.dtype == (torch.float32 if float32_softmax else torch.float64)
            assert record.meta.get("softmax_dtype") == ("float32" if float32_softmax else None)
    if name == "llama" and attn == "sdpa":  # sdpa computes in float64: so do we
        r = cap[0]
        k = r.k.repeat_interleave(2, dim=1)
        logits = (r.q @ k.transpose(-1, -2) * r.scaling).masked_fill(~r.allowed_for_heads(), float("-inf"))
        assert max_error_on_real_rows(r, logits.softmax(-1)) <= 1e-12
    result = attnprobe.check(cap)
    assert result.ok, result.violations


def test_float32_softmax_of_a_float64_model_is_said_and_checked_at_float32(assert_no_hooks):
    """Gemma2's eager function runs softmax in float32: its float64 weights sum to 1 within ~1e-7 only."""
    model = build("gemma2", "eager").double()
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**inputs("gemma2", "right"))
    assert all(r.dtype == torch.float32 and r.meta["softmax_dtype"] == "float32" for r in cap)
    assert all(r.weights.dtype == torch.float64 and r.weights_source == "observed" for r in cap)
    row_error = max(float((r.weights.sum(-1) - 1).abs().masked_fill(r.query_padding[:, None], 0).max()) for r in cap)
    assert 1e-12 < row_error < 1e-6  # genuinely float32-accurate, not float64-accurate
    result = attnprobe.check(cap)
    assert result.ok, result.violations
    assert_no_hooks(model)


def test_bfloat16_weights_are_computed_in_float32_and_stored_in_bfloat16():
    model = build("llama").to(torch.bfloat16)
    batch = inputs("llama", "right")
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            captured = model(**batch).logits
    assert torch.equal(plain, captured)
    r = cap[0]
    assert r.dtype == torch.bfloat16 and r.weights.dtype == torch.bfloat16
    k = r.k.float().repeat_interleave(2, dim=1)
    logits = r.q.float() @ k.transpose(-1, -2) * r.scaling
    expected = logits.masked_fill(~r.allowed_for_heads(), float("-inf")).softmax(-1).to(torch.bfloat16)
    assert torch.equal(r.weights, expected)
    assert attnprobe.check(cap).ok


@pytest.mark.parametrize("family", ["bloom", "mpt", "gpt_neo"])
def test_old_style_float64_models_say_when_their_softmax_ran_in_float32(family, recwarn):
    """Bloom (softmax dtype=float32) and MPT (softmax of x.float()) give float32-accurate weights; GPT-Neo does not."""
    import transformers

    torch.manual_seed(0)
    if family == "bloom":
        model = transformers.BloomModel(transformers.BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=100))
    elif family == "mpt":
        model = transformers.MptModel(
            transformers.MptConfig(d_model=16, n_layers=1, n_heads=2, vocab_size=100, max_seq_len=32)
        )
    else:
        model = transformers.GPTNeoModel(
            transformers.GPTNeoConfig(
                hidden_size=16, num_layers=1, num_heads=2, vocab_size=100, attention_types=[[["global"], 1]]
            )
        )
    model = model.double().eval()
    with torch.no_grad():
        plain = model(**inputs("llama", "right")).last_hidden_state
        with attnprobe.capture(model) as cap:
            captured = model(**inputs("llama", "right")).last_hidden_state
    assert torch.equal(plain, captured)
    r = cap[0]
    assert r.weights.dtype == torch.float64 and r.weights_source == "output_attentions"
    float32_softmax = family != "gpt_neo"
    assert r.dtype == (torch.float32 if float32_softmax else torch.float64)
    assert r.meta.get("softmax_dtype") == ("float32" if float32_softmax else None)
    result = attnprobe.check(cap)
    assert result.ok, result.violations
