"""The implementation switch is undone everywhere, also after errors; shared configs do not leak."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_helpers import build, inputs, twin

import attnprobe
from attnprobe import UnsupportedModelError


def _clip():
    text = transformers.CLIPTextConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=50,
        max_position_embeddings=16,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=8)
    torch.manual_seed(0)
    return transformers.CLIPModel(config).eval()


def _all_implementations(config):
    found = {"": config._attn_implementation}
    for key in config.sub_configs:
        found[key] = getattr(config, key)._attn_implementation
    return found


def _registries():
    import transformers.masking_utils as mu
    import transformers.modeling_utils as mo

    return dict(mo.AttentionInterface._global_mapping), dict(mu.AttentionMaskInterface._global_mapping)


def test_no_config_changes_and_every_function_is_put_back(assert_no_hooks):
    """The capture wraps the function in place: every (sub)config keeps its implementation inside the capture, the
    registries keep their keys (only the captured function's entry holds a wrapper of it), and all is as before
    after."""
    from attnprobe.hooks.slots import held_slots

    model = _clip()
    before, registries = _all_implementations(model.config), _registries()
    batch = {"input_ids": torch.randint(0, 50, (2, 5)), "pixel_values": torch.randn(2, 3, 8, 8)}
    with torch.no_grad():
        plain = model(**batch)
        with attnprobe.capture(model) as cap:
            inside, functions = _all_implementations(model.config), _registries()[0]
            captured = model(**batch)
    assert inside == before and set(before.values()) == {"sdpa"}
    assert functions.keys() == registries[0].keys()
    assert functions["sdpa"] is not registries[0]["sdpa"] and functions["sdpa"].__wrapped__ is registries[0]["sdpa"]
    assert all(functions[k] is f for k, f in registries[0].items() if k != "sdpa")
    assert _all_implementations(model.config) == before and _registries() == registries and held_slots() == 0
    assert torch.equal(plain.logits_per_image, captured.logits_per_image)
    assert len(cap) == 2 and {r.name.split(".")[0] for r in cap} == {"text_model", "vision_model"}
    causal = {r.name.split(".")[0]: r.causal for r in cap}
    assert causal == {"text_model": True, "vision_model": False}  # CLIP text is causal, vision is not
    assert_no_hooks(model)


def test_restored_after_the_forward_raises(assert_no_hooks):
    model = build("llama")

    def fail(*_):
        raise RuntimeError("boom in layer 1")

    handle = model.model.layers[1].register_forward_hook(fail)  # after layer 0 was recorded
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with torch.no_grad(), attnprobe.capture(model) as cap:
                model(**inputs("llama", "left"))
    finally:
        handle.remove()
    assert len(cap) == 2  # both attention calls ran before the failure
    assert model.config._attn_implementation == "sdpa"
    assert_no_hooks(model)
    from attnprobe.hooks.deliver import active_tokens
    from attnprobe.hooks.slots import held_slots

    assert not active_tokens() and held_slots() == 0


def test_a_second_model_on_the_same_config_is_unaffected(assert_no_hooks):
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
    )
    torch.manual_seed(0)
    first = transformers.AutoModelForCausalLM.from_config(config).eval()
    second = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert first.config is second.config  # transformers keeps the very object
    batch = inputs("llama", "left")
    with torch.no_grad():
        plain = second(**batch).logits
        with attnprobe.capture(first) as cap:
            during = second(**batch).logits  # goes through the wrapper, which passes its calls straight to sdpa
            first(**batch)
    assert torch.equal(plain, during)
    assert len(cap) == 2 and all(r.name.startswith("model.layers") for r in cap)
    assert second.config._attn_implementation == "sdpa"
    assert_no_hooks(first)
    assert_no_hooks(second)


def test_nested_captures_record_independently(assert_no_hooks):
    model = build("bert")
    batch = inputs("bert", "right")
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with attnprobe.capture(model, layers=[0]) as outer:
            with attnprobe.capture(model, heads=[1], keep=["weights"]) as inner:
                out = model(**batch).last_hidden_state
            assert model.config._attn_implementation == "sdpa"
            model(**batch)
    assert torch.equal(plain, out)
    assert [r.layer for r in outer] == [0, 0] and [r.layer for r in inner] == [0, 1]
    assert torch.equal(inner[0].weights, outer[0].weights[:, 1:2])
    assert model.config._attn_implementation == "sdpa"
    assert_no_hooks(model)


def test_eager_is_wrapped_in_the_model_file_and_put_back(assert_no_hooks):
    """ "eager" is in no registry: the model file's own eager function is wrapped where its forward looks it up."""
    import transformers.models.llama.modeling_llama as llama

    from attnprobe.hooks.slots import held_slots

    eager = llama.eager_attention_forward
    model = twin(build("llama"), "eager")
    registries = _registries()
    batch = inputs("llama", "left")
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            assert llama.eager_attention_forward is not eager and llama.eager_attention_forward.__wrapped__ is eager
            captured = model(**batch).logits
    assert llama.eager_attention_forward is eager and _registries() == registries and held_slots() == 0
    assert "eager" not in registries[0]
    assert torch.equal(plain, captured) and [r.weights_source for r in cap] == ["observed"] * 2
    assert model.config._attn_implementation == "eager"
    assert_no_hooks(model)


def test_paged_attention_is_a_clear_error(assert_no_hooks):
    model = build("llama")
    model.config._attn_implementation_internal = "paged|eager"  # as if loaded for continuous batching
    with pytest.raises(UnsupportedModelError, match=r"'model.layers.0.self_attn'.*paged\|eager.*sdpa"):
        with attnprobe.capture(model):
            pass
    assert model.config._attn_implementation == "paged|eager"
    # a layer that is not selected does not matter
    with attnprobe.capture(model, layers=[]) as cap:
        pass
    assert len(cap) == 0
    assert_no_hooks(model)


def test_model_files_that_branch_on_the_implementation_name_are_found():
    """What the old-style fallback reads (Falcon computes another way when asked for weights under sdpa); interface
    models that branch on the name are captured on their own path (tests/test_hf_name_branches.py)."""
    import importlib

    from attnprobe.hooks.hf.source import name_branches

    importlib.import_module("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    flagged = name_branches("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    assert flagged and "sdpa" in flagged[0]
    assert name_branches("transformers.models.gpt2.modeling_gpt2") == ()  # its eager branch is handled
    assert name_branches("transformers.models.llama.modeling_llama") == ()


def test_gpt2_reordered_upcast_path_is_kept():
    config = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=4, vocab_size=100, n_positions=32, reorder_and_upcast_attn=True
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager").eval()
    batch = inputs("gpt2", "left")
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            out = model(**batch).logits
    assert torch.equal(plain, out) and cap[0].weights_source == "observed"
