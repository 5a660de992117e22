"""Attention functions a user registered with ``AttentionInterface`` (their own backend)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import transformers
from hf_helpers import build, inputs, twin
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, flash_attention_mask, sdpa_mask

import attnprobe
from attnprobe import UnsupportedModelError

_names = itertools.count()


def _register(fn, mask_fn=sdpa_mask) -> str:
    """Register ``fn`` under a name no other test used (registration is global and permanent)."""
    name = f"user_attention_{next(_names)}"
    AttentionInterface.register(name, fn)
    if mask_fn is not None:
        AttentionMaskInterface.register(name, mask_fn)
    return name


def _counting(tag: str, calls: list):
    def attention(module, query, key, value, attention_mask, **kwargs):
        calls.append(tag)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    attention.__qualname__ = f"attention_{tag}"
    return attention


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


def _implementations(config) -> dict:
    return {"": config._attn_implementation, **{k: getattr(config, k)._attn_implementation for k in config.sub_configs}}


def test_the_function_registered_now_is_the_one_called(assert_no_hooks):
    calls: list = []
    name = _register(_counting("first", calls))
    model = build("llama", name)
    batch = inputs("llama", "left")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    assert calls == ["first", "first"] and cap[0].meta["base_function"] == "attention_first"

    # the user replaces their function under the same name: the next capture must call the new one
    AttentionInterface.register(name, _counting("second", calls))
    calls.clear()
    with torch.no_grad():
        plain = model(**batch).logits
        assert calls == ["second", "second"]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", attnprobe.AttnprobeWarning)
            with attnprobe.capture(model) as cap:
                captured = model(**batch).logits
                # a function registered while the capture is open replaces attnprobe's wrapper: it runs, unrecorded,
                # and the capture says so when it closes
                third = _counting("third", calls)
                AttentionInterface.register(name, third)
                again = model(**batch).logits
    said = [str(w.message) for w in seen if issubclass(w.category, attnprobe.AttnprobeWarning)]
    assert len(said) == 1 and f"under {name!r} was replaced" in said[0] and "attention_third" in said[0]
    assert calls == ["second"] * 4 + ["third"] * 2
    assert torch.equal(plain, captured) and torch.equal(plain, again)
    assert [r.meta["base_function"] for r in cap] == ["attention_second"] * 2
    assert cap[0].backend == name
    assert model.config._attn_implementation == name
    assert AttentionInterface._global_mapping[name] is third  # the user's registration stays
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


def test_a_sub_config_on_a_custom_function_keeps_working_when_only_others_are_selected(assert_no_hooks):
    """A tower on the user's function runs it untouched (and unrecorded) while only the other tower is captured."""
    calls: list = []
    name = _register(_counting("text", calls))  # a fresh name: no earlier capture registered its private twin
    model = _clip()
    model.set_attn_implementation({"text_config": name, "vision_config": "sdpa"})
    before = _implementations(model.config)
    assert before["text_config"] == name and before["vision_config"] == "sdpa"
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, -2:] = 0  # padding: lost if the private name had no mask function
    batch = {"input_ids": torch.randint(0, 50, (2, 5)), "attention_mask": mask, "pixel_values": torch.randn(2, 3, 8, 8)}
    vision = [m.layer for m in attnprobe.attention_modules(model) if m.name.startswith("vision_model")]
    with torch.no_grad():
        plain = model(**batch)
        calls.clear()
        with attnprobe.capture(model, layers=vision) as cap:
            captured = model(**batch)
    assert calls == ["text"]  # the text tower ran its own function
    assert torch.equal(plain.text_embeds, captured.text_embeds)
    assert torch.equal(plain.logits_per_image, captured.logits_per_image)
    assert [r.name.split(".")[0] for r in cap] == ["vision_model"] and cap[0].backend == "sdpa"
    assert _implementations(model.config) == before
    assert_no_hooks(model)


def test_sub_configs_on_a_custom_function_are_restored_after_an_error(assert_no_hooks):
    name = _register(_counting("text", []))
    model = _clip()
    model.set_attn_implementation({"text_config": name, "vision_config": "sdpa"})
    before = _implementations(model.config)

    def fail(*_):
        raise RuntimeError("boom in the vision tower")

    handle = model.vision_model.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with torch.no_grad(), attnprobe.capture(model):
                model(input_ids=torch.randint(0, 50, (1, 5)), pixel_values=torch.randn(1, 3, 8, 8))
    finally:
        handle.remove()
    assert _implementations(model.config) == before
    assert_no_hooks(model)


def _gpt_oss_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    return eager_attention_forward


@pytest.mark.parametrize("returns_weights", [True, False])
def test_sinks_reach_the_weights_of_a_custom_function(returns_weights, recwarn):
    """GPT-OSS passes ``s_aux`` to whatever function runs; only sdpa ignores it."""
    eager = _gpt_oss_eager()

    def attention(module, query, key, value, attention_mask, **kwargs):
        out, weights = eager(module, query, key, value, attention_mask, **kwargs)
        return out, (weights if returns_weights else None)

    name = _register(attention, eager_mask)
    model = build("gpt_oss", name)
    batch = inputs("gpt_oss", "right")
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            captured = model(**batch).logits
        reference = twin(model, "eager")(**batch, output_attentions=True).attentions
    assert torch.equal(plain, captured)
    assert not [w for w in recwarn if "does not reproduce" in str(w.message)]
    for r, weights in zip(cap, reference):
        assert r.weights_source == ("observed" if returns_weights else "recomputed")
        assert r.sinks is not None and r.scores is not None
        rows = ~r.query_padding[:, None, :, None]
        assert torch.allclose(r.weights.where(rows, 0), weights.where(rows, 0), atol=1e-6)
        assert (r.weights.sum(-1) < 1).all()  # the sink takes mass from every row
    assert attnprobe.check(cap).ok


def test_a_mask_function_attnprobe_cannot_read_is_refused_before_anything_changes(assert_no_hooks):
    name = _register(_counting("flash-masked", []), flash_attention_mask)  # masks become 2-D padding masks
    model = build("llama", name)
    with pytest.raises(UnsupportedModelError, match=r"flash_attention_mask.*AttentionMaskInterface.register"):
        with attnprobe.capture(model):
            pass
    assert model.config._attn_implementation == name
    assert_no_hooks(model)


def test_a_users_own_mask_function_is_read_when_it_gives_a_query_key_mask(assert_no_hooks):
    def block_diagonal(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, **kwargs):
        """A user's own mask function: causal within blocks of 4 positions (True = attend)."""
        q = (torch.arange(q_length) + q_offset).view(-1, 1)
        k = (torch.arange(kv_length) + kv_offset).view(1, -1)
        return ((q // 4 == k // 4) & (k <= q)).expand(batch_size, 1, q_length, kv_length)

    name = _register(_counting("block", []), block_diagonal)
    model = build("llama", name)
    with torch.no_grad():
        plain = model(**inputs("llama", "right")).logits
        with attnprobe.capture(model) as cap:
            captured = model(**inputs("llama", "right")).logits
    assert torch.equal(plain, captured)
    allowed = cap[0].allowed[0, 0]
    assert allowed[3].tolist() == [True] * 4 + [False] * 3 and allowed[5].tolist() == [False] * 4 + [True] * 2 + [False]
    assert attnprobe.check(cap).ok


def test_a_users_own_mask_function_that_gives_something_else_is_a_clear_error(assert_no_hooks):
    def padding_only(batch_size, q_length, kv_length, **kwargs):
        return torch.ones(batch_size, kv_length, dtype=torch.bool)  # 2-D: not a (query, key) mask

    def key_padding_attention(module, query, key, value, attention_mask, **kwargs):
        """The user's function reads its own 2-D mask; attnprobe cannot tell queries from keys in it."""
        return sdpa_attention_forward(module, query, key, value, attention_mask[:, None, None, :], **kwargs)

    name = _register(key_padding_attention, padding_only)
    model = build("llama", name)
    with pytest.raises(UnsupportedModelError, match=r"padding_only.*Tensor of shape \(2, 7\).*4-D"):
        with torch.no_grad(), attnprobe.capture(model):
            model(**inputs("llama", "right"))
    assert model.config._attn_implementation == name
    assert_no_hooks(model)


def test_a_custom_function_without_a_mask_function_gets_no_mask_and_the_record_says_so(assert_no_hooks):
    """transformers hands a function with no registered mask function no mask at all: padding is attended."""
    name = _register(_counting("unmasked", []), mask_fn=None)
    model = build("bert", name)
    batch = inputs("bert", "right")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = model(**batch).last_hidden_state
        with attnprobe.capture(model) as cap:
            captured = model(**batch).last_hidden_state
    assert torch.equal(plain, captured)
    r = cap[0]
    assert r.allowed.all()  # what the function received: nothing masked
    assert r.query_padding.tolist() == (batch["attention_mask"] == 0).tolist()
    # a user who declares the padding learns that the model attended it
    result = attnprobe.check(cap, attention_mask=batch["attention_mask"])
    assert not result.ok and "padding" in {v.check for v in result.violations}
