"""Invariant checks on Hugging Face models: broken custom attention backends are caught by
``output_match``, and no family gives a false positive (left/right padding, fp32/bf16, sdpa/eager).

The tests also verify that the broken backends really change the model's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnprobe

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AutoModel  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

VOCAB = 64
LEFT = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
RIGHT = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])


def captured_forward(model, inputs):
    """One forward under capture: (the model's output, the Capture), after asserting that attention was
    recorded and that no hook is left on the model."""
    with torch.no_grad(), attnprobe.capture(model) as cap:
        out = model(**inputs)
    assert len(cap) > 0, f"no attention record from {type(model).__name__}"
    from conftest import hooks_on

    assert not hooks_on(model), hooks_on(model)
    return out, cap


# --------------------------------------------------------------------------- broken custom backends
def _sdpa_with(module, query, key, value, attention_mask, *, scaling=None, kv_index=None, use_mask=True, **_):
    """Attention as HF's sdpa computes it, with the kv head of each query head chosen by ``kv_index``."""
    groups = query.shape[1] // key.shape[1]
    if kv_index is None:
        kv_index = torch.arange(query.shape[1]) // groups  # the right mapping (repeat_kv)
    key, value = key[:, kv_index], value[:, kv_index]
    mask = attention_mask if use_mask else None
    is_causal = mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def correct_backend(module, query, key, value, attention_mask, **kwargs):
    return _sdpa_with(module, query, key, value, attention_mask, **kwargs)


def ignores_mask(module, query, key, value, attention_mask, **kwargs):
    """A fused kernel that drops the padding mask (keeps causality through is_causal)."""
    return _sdpa_with(module, query, key, value, attention_mask, use_mask=False, **kwargs)


def wrong_gqa(module, query, key, value, attention_mask, **kwargs):
    """Grouped-query heads tiled (h % kv_heads) instead of grouped (h // group)."""
    return _sdpa_with(
        module, query, key, value, attention_mask, kv_index=torch.arange(query.shape[1]) % key.shape[1], **kwargs
    )


BACKENDS = {
    "attnprobe_test_correct": correct_backend,
    "attnprobe_test_ignores_mask": ignores_mask,
    "attnprobe_test_wrong_gqa": wrong_gqa,
}


@pytest.fixture
def custom_backends():
    """Register the test backends (and sdpa's mask function for them, without which every layer gets no mask)."""
    for name, fn in BACKENDS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)
    yield list(BACKENDS)
    for name in BACKENDS:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def tiny_llama(implementation: str = "sdpa"):
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    model = AutoModel.from_config(config).eval()
    model.set_attn_implementation(implementation)
    return model


def llama_inputs():
    torch.manual_seed(1)
    return {"input_ids": torch.randint(3, VOCAB, (2, 7)), "attention_mask": LEFT}


def test_broken_backends_really_change_the_output(custom_backends):
    inputs = llama_inputs()
    with torch.no_grad():
        reference = tiny_llama("sdpa")(**inputs).last_hidden_state
        outputs = {name: tiny_llama(name)(**inputs).last_hidden_state for name in custom_backends}
    real = LEFT.bool()
    torch.testing.assert_close(outputs["attnprobe_test_correct"][real], reference[real], atol=1e-5, rtol=1e-5)
    # dropping the padding mask changes the real tokens of the padded row only
    drop = (outputs["attnprobe_test_ignores_mask"] - reference).abs().amax(-1)
    assert drop[0][real[0]].min() > 1e-3 and drop[1].max() < 1e-5
    assert (outputs["attnprobe_test_wrong_gqa"] - reference).abs()[real].amax() > 1e-2


def test_correct_custom_backend_passes(custom_backends):
    _, cap = captured_forward(tiny_llama("attnprobe_test_correct"), llama_inputs())
    result = attnprobe.check(cap, causal=True, attention_mask=LEFT)
    assert result.ok and result.coverage["output_match"] == len(cap), result.table()


def test_backend_that_ignores_the_mask_is_caught_by_output_match(custom_backends):
    _, cap = captured_forward(tiny_llama("attnprobe_test_ignores_mask"), llama_inputs())
    result = attnprobe.check(cap, causal=True, attention_mask=LEFT)
    assert {v.check for v in result.errors} == {"output_match"}, result.table()
    assert {v.batch for v in result.errors} == {0}  # only the padded batch row
    assert {v.layer for v in result.errors} == set(cap.layers)


def test_backend_with_a_wrong_gqa_mapping_is_caught_by_output_match(custom_backends):
    _, cap = captured_forward(tiny_llama("attnprobe_test_wrong_gqa"), llama_inputs())
    result = attnprobe.check(cap, causal=True, attention_mask=LEFT)
    assert {v.check for v in result.errors} == {"output_match"}, result.table()
    # 4 query heads over 2 kv heads: heads 1 and 2 read the wrong kv head
    assert {v.head for v in result.errors} == {1, 2}


# --------------------------------------------------------------------------- no false positives
def family_configs():
    from transformers import (
        BartConfig,
        BertConfig,
        Gemma2Config,
        GPT2Config,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        T5Config,
        ViTConfig,
        WhisperConfig,
    )

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    tokens = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    seq2seq = {
        "d_model": 32,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "decoder_start_token_id": 1,
    }
    return {
        # family: (config, kind of inputs, declared causal)
        "gpt2": (GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, **tokens), "text", True),
        "bert": (BertConfig(**small, max_position_embeddings=32, **tokens), "text", False),
        "llama": (LlamaConfig(**small, num_key_value_heads=2, **tokens), "text", True),
        "mistral": (MistralConfig(**small, num_key_value_heads=2, sliding_window=3, **tokens), "text", True),
        "gemma2": (
            Gemma2Config(
                **small,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=3,
                attn_logit_softcapping=5.0,
                query_pre_attn_scalar=8,
                **tokens,
            ),
            "text",
            True,
        ),
        "gpt_oss": (
            GptOssConfig(
                **{**small, "intermediate_size": 32},
                num_key_value_heads=2,
                head_dim=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                sliding_window=3,
                **tokens,
            ),
            "text",
            True,
        ),
        "t5": (
            T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, **tokens, decoder_start_token_id=1),
            "seq2seq",
            None,
        ),
        "bart": (BartConfig(**seq2seq, max_position_embeddings=32, **tokens), "seq2seq", None),
        "vit": (ViTConfig(**small, image_size=16, patch_size=4), "image", False),
        "whisper": (
            WhisperConfig(**seq2seq, num_mel_bins=8, max_source_positions=8, max_target_positions=16, **tokens),
            "audio",
            None,
        ),
    }


def family_inputs(kind: str, padding: torch.Tensor | None) -> dict:
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 7))
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 16, 16)}
    if kind == "audio":
        return {"input_features": torch.randn(2, 8, 16), "decoder_input_ids": ids}
    if kind == "seq2seq":
        return {"input_ids": ids, "attention_mask": padding, "decoder_input_ids": ids}
    return {"input_ids": ids, "attention_mask": padding}


EAGER_ONLY = ("gemma2", "gpt_oss")  # these families do not run on sdpa (transformers refuses it)


def family_cases():
    for family, (_, kind, _) in family_configs().items():
        paddings = ("left", "right") if kind in ("text", "seq2seq") else ("none",)
        bases = ("eager",) if family in EAGER_ONLY else ("sdpa", "eager")
        for padding in paddings:
            for dtype in ("fp32", "bf16"):
                for base in bases:
                    yield pytest.param(family, padding, dtype, base, id=f"{family}-{padding}-{dtype}-{base}")


@pytest.mark.parametrize("family, padding, dtype, base", list(family_cases()))
def test_no_false_positives_on_hugging_face_families(family, padding, dtype, base):
    config, kind, causal = family_configs()[family]
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    if base == "sdpa":
        assert model.config._attn_implementation == "sdpa", f"{family} should run on sdpa (else list it in EAGER_ONLY)"
    model.set_attn_implementation(base)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    mask = {"left": LEFT, "right": RIGHT, "none": None}[padding]
    inputs = family_inputs(kind, mask)
    if "input_features" in inputs or "pixel_values" in inputs:
        key = "input_features" if "input_features" in inputs else "pixel_values"
        inputs[key] = inputs[key].to(model.dtype)
    with torch.no_grad():
        plain = model(**inputs)
    out, cap = captured_forward(model, inputs)
    first = plain[0] if isinstance(plain, tuple) else plain.last_hidden_state
    assert torch.equal(first, out[0] if isinstance(out, tuple) else out.last_hidden_state)  # capture perturbs nothing
    result = attnprobe.check(cap)
    assert result.ok and result.verified, result.table()
    assert result.coverage["output_match"] > 0, result.table()
    if kind in ("text", "image"):  # one sequence: declarations apply to every layer
        declared = attnprobe.check(cap, causal=causal, attention_mask=mask)
        assert declared.ok, declared.table()
