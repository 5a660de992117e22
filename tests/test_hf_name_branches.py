"""Models whose code branches on ``config._attn_implementation``'s name are captured on their own path (issue 32).

Gemma 4 takes another path under "sdpa" (it keeps every query row through its KV-shared layers when a mask is
None, for ``logits_to_keep``) and glm_moe_dsa builds its sparse top-k mask only under "eager" and "sdpa". A capture
that renamed the implementation would have sent both down the other path: Gemma 4's shared layers would have seen
only the kept rows, glm_moe_dsa's attention would have been dense. The capture wraps the function in place, so the
name reads the same inside the capture, the outputs are bitwise those of an uncaptured run, and the records show the
path taken.
"""

from __future__ import annotations

import pytest
import torch
from hf_helpers import transformers, twin

import attnprobe

GEMMA4_TEXT = dict(
    vocab_size=120,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=8,
    sliding_window=3,
    vocab_size_per_layer_input=120,
    hidden_size_per_layer_input=8,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    num_kv_shared_layers=1,  # the last layer reuses the keys of the one before: the path logits_to_keep may cut
    max_position_embeddings=64,
)


def _captured(model, batch: dict, seen: list):
    with torch.no_grad():
        plain = model(**batch)
        with attnprobe.capture(model) as cap:
            seen.append(model.config._attn_implementation)
            out = model(**batch)
    return plain, out, cap


def test_gemma4_text_keeps_its_sdpa_path(assert_no_hooks):
    config = transformers.Gemma4TextConfig(**GEMMA4_TEXT)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).eval()
    ids = torch.randint(3, 100, (2, 7))
    batch = {"input_ids": ids, "logits_to_keep": 2}  # no padding: sdpa gets no mask, the branch keeps every row
    seen: list = []
    plain, out, cap = _captured(model, batch, seen)
    assert seen == ["sdpa"] and model.config._attn_implementation == "sdpa"
    assert torch.equal(plain.logits, out.logits)
    assert len(cap) == 3 and all(r.query_len == 7 for r in cap)  # the shared layer saw every query row
    with torch.no_grad():
        reference = twin(model, "eager")(input_ids=ids, output_attentions=True).attentions
    for r, w in zip(cap, reference, strict=True):
        torch.testing.assert_close(r.weights, w, atol=1e-5, rtol=0)
    assert attnprobe.check(cap, causal=True).ok
    assert_no_hooks(model)


def test_gemma4_multimodal_towers_are_captured(assert_no_hooks):
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=16,
    )
    tokens = dict(image_token_id=110, boi_token_id=111, eoi_token_id=112, boa_token_id=113, eoa_token_index=114)
    config = transformers.Gemma4Config(
        text_config=dict(
            GEMMA4_TEXT,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            num_kv_shared_layers=0,
        ),
        vision_config=vision,
        audio_token_id=115,
        video_token_id=116,
        **tokens,
    )
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(16, 2)
    ids = torch.randint(3, 100, (2, 10))
    ids[:, 2:6] = tokens["image_token_id"]  # 16 patches pooled 2 x 2: 4 image tokens
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, -2:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.rand(2, 16, 12),  # (batch, patches, 3 x 2 x 2 pixels)
        "image_position_ids": grid.expand(2, 16, 2).clone(),
    }
    seen: list = []
    plain, out, cap = _captured(model, batch, seen)
    assert seen == ["sdpa"] and model.config.text_config._attn_implementation == "sdpa"
    assert torch.equal(plain.logits, out.logits)
    towers = [r.name.split(".")[1] for r in cap]
    assert towers == ["vision_tower"] * 2 + ["language_model"] * 2
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_glm_moe_dsa_keeps_its_sparse_mask(attn, assert_no_hooks):
    config = transformers.GlmMoeDsaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        head_dim=4,
        index_topk=4,  # each query attends at most 4 keys the indexer picks: sparser than causal from query 4 on
        index_head_dim=8,
        index_n_heads=2,
        first_k_dense_replace=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM._from_config(config, attn_implementation=attn).eval()
    ids = torch.randint(3, 99, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    seen: list = []
    plain, out, cap = _captured(model, {"input_ids": ids, "attention_mask": mask}, seen)
    assert seen == [attn] and model.config._attn_implementation == attn
    assert torch.equal(plain.logits, out.logits)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    for r in cap:  # the top-k index mask is in the records: never more than causal, at most 4 keys per real row
        allowed = r.allowed[1, 0]
        assert (
            not (allowed & ~causal).any() and (allowed.sum(-1) <= 4).all() and (allowed.sum(-1) < causal.sum(-1)).any()
        )
        assert r.weights[1][:, ~allowed].abs().max() == 0
    with torch.no_grad():
        reference = twin(model, "eager")(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for r, w in zip(cap, reference, strict=True):
        torch.testing.assert_close(r.weights[1], w[1], atol=1e-5, rtol=0)  # the full row: no padding
    assert_no_hooks(model)
