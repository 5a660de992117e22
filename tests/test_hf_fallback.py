"""Old-style models (no attention interface): weights-only records through output_attentions."""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
import transformers
from hf_helpers import hook_counts, inputs

import attnprobe
from attnprobe import AttnprobeWarning, UnsupportedModelError


def _gpt_neo():
    config = transformers.GPTNeoConfig(
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        vocab_size=100,
        attention_types=[[["global", "local"], 1]],
        window_size=3,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.GPTNeoForCausalLM(config).eval()


def _falcon(attn):
    config = transformers.FalconConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    torch.manual_seed(0)
    return transformers.FalconForCausalLM._from_config(config, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def gpt_neo():
    return _gpt_neo()


@pytest.mark.parametrize("return_dict", [True, False])
def test_weights_only_records_and_unchanged_output(gpt_neo, return_dict, assert_no_hooks):
    batch = inputs("llama", "left")
    with torch.no_grad():
        plain = gpt_neo(**batch, return_dict=return_dict)
        with pytest.warns(AttnprobeWarning, match=r"GPTNeoForCausalLM.*output_attentions.*q, k, v, scores"):
            with attnprobe.capture(gpt_neo, heads=[0, 2]) as cap:
                out = gpt_neo(**batch, return_dict=return_dict)
    assert type(out) is type(plain)
    if return_dict:
        assert list(out.keys()) == list(plain.keys()) and "attentions" not in out
    assert len(out) == len(plain) and torch.equal(out[0], plain[0])
    assert len(cap) == 2 and cap[0].name == "transformer.h.0.attn.attention"
    for r in cap:
        assert r.weights_source == "output_attentions" and r.weights.shape == (2, 2, 7, 7)
        assert r.q is r.k is r.scores is r.output is r.allowed is None
        assert r.identified == {"weights", "query_padding"} and r.meta["base"] == "output_attentions"
        assert r.query_padding.tolist() == (batch["attention_mask"] == 0).tolist()
    with torch.no_grad():
        reference = gpt_neo(**batch, output_attentions=True).attentions  # the model's own weights
    for r, w in zip(cap, reference):
        assert torch.equal(r.weights, w[:, [0, 2]])
    assert_no_hooks(gpt_neo)


def test_caller_who_asked_for_attentions_keeps_them(gpt_neo, recwarn):
    batch = inputs("llama", "right")
    with torch.no_grad():
        plain = gpt_neo(**batch, output_attentions=True)
        with attnprobe.capture(gpt_neo) as cap:
            out = gpt_neo(**batch, output_attentions=True)
    assert len(out.attentions) == 2 and all(torch.equal(a, b) for a, b in zip(out.attentions, plain.attentions))
    assert torch.equal(cap[1].weights, plain.attentions[1])


def test_generation_steps_in_the_fallback(gpt_neo, recwarn):
    batch = inputs("llama", "left", length=5)
    with torch.no_grad(), attnprobe.capture(gpt_neo, layers=[0]) as cap:
        gpt_neo.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert [(r.step, r.query_offset, r.key_len) for r in cap] == [(0, 0, 5), (1, 5, 6), (2, 6, 7)]
    assert attnprobe.stitch(cap)[0].weights.shape == (2, 4, 7, 7)


def test_falcon_under_sdpa_is_refused_and_works_over_eager(assert_no_hooks, recwarn):
    batch = inputs("llama", "right")
    model = _falcon("sdpa")
    with pytest.raises(UnsupportedModelError, match=r"another way when asked for weights.*attn_implementation='eager'"):
        with attnprobe.capture(model):
            pass
    assert_no_hooks(model)
    model = _falcon("eager")
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            out = model(**batch).logits
    assert torch.equal(plain, out) and len(cap) == 2 and cap[0].num_kv_heads == 1  # multi-query attention


def test_a_module_that_returns_no_weights_is_a_clear_error(assert_no_hooks, recwarn):
    model = _gpt_neo()
    inner = model.transformer.h[1].attn.attention
    original = inner.forward
    inner.forward = lambda *a, **k: (original(*a, **k)[0], None)  # an attention that hides its weights
    with pytest.raises(UnsupportedModelError, match=r"'transformer.h.1.attn.attention'.*GPTNeoSelfAttention.*layer 1"):
        with torch.no_grad(), attnprobe.capture(model):
            model(**inputs("llama", "right"))
    assert_no_hooks(model)
    with torch.no_grad(), attnprobe.capture(model, layers=[0]) as cap:  # the advice in the message works
        model(**inputs("llama", "right"))
    assert len(cap) == 1


@pytest.mark.parametrize("family", ["bloom", "deberta_v2"])
def test_other_old_style_families(family, recwarn):
    if family == "bloom":
        model = transformers.BloomModel(transformers.BloomConfig(hidden_size=16, n_layer=2, n_head=4, vocab_size=100))
    else:
        model = transformers.DebertaV2Model(
            transformers.DebertaV2Config(
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=32,
                vocab_size=100,
                max_position_embeddings=32,
            )
        )
    model.eval()
    batch = inputs("llama", "right")
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with attnprobe.capture(model) as cap:
            out = model(**batch).last_hidden_state
    assert torch.equal(plain, out)
    assert len(cap) == 2 and all(r.weights_source == "output_attentions" for r in cap)
    rows = ~cap[0].query_padding
    assert torch.allclose(cap[0].weights.sum(-1)[rows[:, None].expand(-1, 4, -1)], torch.tensor(1.0))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("base", [True, False])
def test_funnel_keeps_its_head_count_in_the_config_and_is_recorded(base, side, assert_no_hooks):
    # FunnelRelMultiheadAttention has no num_heads attribute; it was not found at all ("no attention found")
    config = transformers.FunnelConfig(
        vocab_size=100, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8, d_inner=32, num_decoder_layers=1
    )
    torch.manual_seed(0)
    model = (transformers.FunnelBaseModel if base else transformers.FunnelModel)(config).eval()
    batch = inputs("llama", side)
    with torch.no_grad():
        plain = model(**batch)
        reference = model(**batch, output_attentions=True).attentions
        with pytest.warns(AttnprobeWarning, match=r"no attention interface in FunnelRelMultiheadAttention"):
            with attnprobe.capture(model) as cap:
                out = model(**batch)
    assert torch.equal(out.last_hidden_state, plain.last_hidden_state) and "attentions" not in out
    assert_no_hooks(model)
    length = batch["input_ids"].shape[1]
    # the second block pools its queries (pool_q_only): half as many queries as keys
    shapes = [(2, 2, length, length), (2, 2, (length + 1) // 2, length)] + ([] if base else [(2, 2, length, length)])
    assert [tuple(r.weights.shape) for r in cap] == shapes
    assert [r.kind for r in cap][:2] == ["self", "cross"]  # the pooled queries are another tensor than the keys
    assert len(reference) == len(cap) and all(torch.equal(r.weights, w) for r, w in zip(cap, reference))
    assert all(r.weights_source == "output_attentions" for r in cap)
    assert attnprobe.check(cap, attention_mask=batch["attention_mask"], causal=False).ok


def test_encoder_decoder_fallback_tells_cross_attention(recwarn):
    config = transformers.FSMTConfig(
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        src_vocab_size=50,
        tgt_vocab_size=50,
        langs=["en", "de"],
    )
    model = transformers.FSMTModel(config).eval()
    ids = torch.randint(3, 50, (2, 6))
    with torch.no_grad():
        plain = model(input_ids=ids, decoder_input_ids=ids[:, :4]).last_hidden_state
        with attnprobe.capture(model) as cap:
            out = model(input_ids=ids, decoder_input_ids=ids[:, :4]).last_hidden_state
    assert torch.equal(plain, out)
    # fsmt's attention returns time-first outputs and takes query= and key= separately; the decoder's length is
    # what the model ran (transformers 5.16 and 5.17 decode only the last of the decoder_input_ids)
    t = plain.shape[1]
    assert [(r.kind, tuple(r.weights.shape)) for r in cap] == [
        ("self", (2, 2, 6, 6)),
        ("self", (2, 2, t, t)),
        ("cross", (2, 2, t, 6)),
    ]


def test_modules_that_always_return_weights_need_no_forcing(recwarn):
    config = transformers.XGLMConfig(
        d_model=16, num_layers=2, attention_heads=4, ffn_dim=32, vocab_size=100, max_position_embeddings=32
    )
    model = transformers.XGLMModel(config).eval()
    batch = inputs("llama", "left")
    with torch.no_grad():
        plain = model(**batch)
        with attnprobe.capture(model) as cap:
            out = model(**batch)
    assert torch.equal(plain.last_hidden_state, out.last_hidden_state) and list(out.keys()) == list(plain.keys())
    assert len(cap) == 2 and cap[0].weights_source == "output_attentions"


def test_a_cache_that_cannot_say_its_length():
    from attnprobe.hooks.hf.compat import cached_length as _cached_length

    class Hybrid:  # like a Mamba + attention cache: layer 0 holds no attention
        layers = (object(), object())

        def get_seq_length(self, layer=0):
            if layer == 0:
                raise ValueError("`get_seq_length` can only be called on Attention layers")
            return 5

    class Empty:
        layers = ()

        def get_seq_length(self, layer=0):
            raise ValueError("no attention layer")

    assert _cached_length(Hybrid()) == 5 and _cached_length(Empty()) is None


def _xlnet(cls=None):
    config = transformers.XLNetConfig(d_model=16, n_layer=2, n_head=2, d_inner=32, vocab_size=50)
    torch.manual_seed(0)
    return (cls or transformers.XLNetModel)(config).eval()


def test_xlnet_time_first_weights_are_laid_out_as_batch_head_query_key(recwarn, assert_no_hooks):
    model = _xlnet()
    ids = torch.randint(1, 50, (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
        with attnprobe.capture(model) as cap:
            captured = model(ids, attention_mask=mask)
        reference = model(ids, attention_mask=mask, output_attentions=True).attentions  # the model permutes them
    assert torch.equal(plain.last_hidden_state, captured.last_hidden_state)
    assert len(cap) == 2
    for r, weights in zip(cap, reference):
        # XLNet's module returns (query, key, batch, head) = (5, 5, 2, 2); read as batch 5, head 5 before
        assert r.num_heads == 2 and r.weights.shape == (2, 2, 5, 5)
        assert torch.equal(r.weights, weights)
        assert r.query_padding.tolist() == (mask == 0).tolist() and r.query_offset == 0
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


def test_xlnet_memory_keys_come_before_the_queries(recwarn):
    model = _xlnet()
    with torch.no_grad():
        first = model(torch.randint(1, 50, (1, 4)), use_mems=True)
        with attnprobe.capture(model) as cap:
            model(torch.randint(1, 50, (1, 3)), mems=first.mems)
    r = cap[0]
    assert r.weights.shape == (1, 2, 3, 7) and r.query_offset == 4
    assert attnprobe.check(cap).ok


def test_xlnet_two_stream_attention_is_a_clear_error(recwarn, assert_no_hooks):
    model = _xlnet(transformers.XLNetLMHeadModel)
    ids = torch.randint(1, 50, (1, 5))
    perm_mask = torch.zeros(1, 5, 5)
    perm_mask[:, :, -1] = 1.0
    target_mapping = torch.zeros(1, 1, 5)
    target_mapping[0, 0, -1] = 1.0
    with pytest.raises(UnsupportedModelError, match=r"2 weight matrices.*two-stream.*target_mapping"):
        with torch.no_grad(), attnprobe.capture(model):
            model(ids, perm_mask=perm_mask, target_mapping=target_mapping)
    assert_no_hooks(model)


def test_weights_in_another_layout_are_refused_not_misread(monkeypatch, recwarn):
    from attnprobe.hooks.hf import fallback as hf_fallback

    monkeypatch.setattr(hf_fallback, "_TIME_FIRST", frozenset())  # as if attnprobe did not know XLNet's layout
    model = _xlnet()
    with pytest.raises(UnsupportedModelError, match=r"has 2 heads but returned weights of shape \(5, 5, 2, 2\)"):
        with torch.no_grad(), attnprobe.capture(model):
            model(torch.randint(1, 50, (2, 5)))


def test_weights_nested_in_the_first_item_are_found(recwarn, assert_no_hooks):
    """I-BERT's attention returns ((context, weights), scaling factor)."""
    model = transformers.IBertModel(
        transformers.IBertConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50
        )
    ).eval()
    ids = torch.randint(1, 50, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
        with attnprobe.capture(model) as cap:
            captured = model(ids, attention_mask=mask)
        reference = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert torch.equal(plain.last_hidden_state, captured.last_hidden_state)
    assert len(cap) == 1 and torch.equal(cap[0].weights, reference[0])
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


def test_pre_softmax_scores_returned_as_attentions_become_the_weights_the_module_used(recwarn, assert_no_hooks):
    """SqueezeBERT's output_attentions are its masked scores, in a dict: the record holds the softmax the
    module applies next, equal to what its own nn.Softmax returned."""
    model = transformers.SqueezeBertModel(
        transformers.SqueezeBertConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            embedding_size=16,
            vocab_size=50,
        )
    ).eval()
    ids, mask = torch.randint(1, 50, (2, 6)), torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    probs = []
    softmax = model.encoder.layers[0].attention.softmax  # the module's own nn.Softmax(dim=-1)
    handle = softmax.register_forward_hook(lambda m, a, out: probs.append(out))
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
        with attnprobe.capture(model) as cap:
            captured = model(ids, attention_mask=mask)
    handle.remove()
    assert torch.equal(plain.last_hidden_state, captured.last_hidden_state)
    assert len(cap) == 1 and cap[0].weights_source == "output_attentions"
    assert cap[0].weights.shape == (2, 2, 6, 6) and torch.equal(cap[0].weights, probs[1])
    assert attnprobe.check(cap, attention_mask=mask).ok
    assert_no_hooks(model)


def test_returned_attentions_that_are_not_probabilities_are_refused(recwarn, monkeypatch):
    """Logits returned as output_attentions by a module attnprobe does not know are refused by name, not
    recorded as weights (ProphetNet's and SqueezeBERT's were, before they were known)."""
    from attnprobe.hooks.hf import fallback as hf_fallback

    monkeypatch.setattr(hf_fallback, "_PRE_SOFTMAX", frozenset())
    model = transformers.SqueezeBertModel(
        transformers.SqueezeBertConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            embedding_size=16,
            vocab_size=50,
        )
    ).eval()
    with pytest.raises(UnsupportedModelError, match=r"SqueezeBertSelfAttention.*not post-softmax weights"):
        with torch.no_grad(), attnprobe.capture(model):
            model(torch.randint(1, 50, (1, 6)))


def test_nan_rows_of_an_old_style_model_are_recorded_as_it_returns_them(recwarn):
    """Bloom in float64 returns NaN weights for left-padded (fully masked) query rows: they are its own
    weights, recorded as they are, not mistaken for values outside [0, 1]."""
    config = transformers.BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.BloomModel(config).eval().double()
    ids, mask = torch.randint(1, 50, (2, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, output_attentions=True).attentions[0]
        with attnprobe.capture(model) as cap:
            model(ids, attention_mask=mask)
    assert reference.isnan().any(), "Bloom no longer returns NaN rows here: the test checks nothing"
    assert len(cap) == 1 and torch.equal(cap[0].weights.isnan(), reference.isnan())
    assert torch.equal(cap[0].weights.nan_to_num(), reference.nan_to_num())


def test_unreadable_old_style_modules_inside_an_interface_model_are_left_out_with_a_warning(assert_no_hooks):
    """MiniMax mixes lightning (linear) attention, which has no softmax weights, with interface attention:
    the interface layers are captured, the lightning layer is named in a warning, the output is unchanged."""
    config = transformers.MiniMaxConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        num_local_experts=2,
        num_experts_per_tok=1,
        block_size=4,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.MiniMaxModel(config).eval()
    ids, mask = torch.randint(1, 100, (2, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).last_hidden_state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AttnprobeWarning)
            with attnprobe.capture(model) as cap:
                captured = model(ids, attention_mask=mask).last_hidden_state
    said = [str(w.message) for w in caught if issubclass(w.category, AttnprobeWarning)]
    assert any(re.search(r"MiniMaxLightningAttention.*not post-softmax.*not recorded", m) for m in said), said
    assert torch.equal(plain, captured)
    assert [r.name for r in cap] == ["layers.1.self_attn"] and cap[0].weights_source == "recomputed"
    assert attnprobe.check(cap, causal=True, attention_mask=mask).ok
    assert_no_hooks(model)


def test_pegasus_x_local_weights_are_named_and_its_modules_can_be_traced(assert_no_hooks):
    """PEGASUS-X's encoder returns its weights as a dict, global ``(batch, head, global, key)`` and local per block
    ``(batch, head, block, block size, keys)``: the warning says it returned weights of that shape (it had said "no
    attention weights") and names ``modules=[...]``, which traces the module's softmax calls; outputs unchanged."""
    config = transformers.PegasusXConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=99,
        max_position_embeddings=64,
        pad_token_id=0,
        decoder_start_token_id=1,
        num_global_tokens=2,
        block_size=4,
    )
    torch.manual_seed(0)
    model = transformers.PegasusXModel(config).eval()
    ids = torch.randint(3, 99, (2, 8))
    batch = dict(input_ids=ids, decoder_input_ids=ids[:, :5])
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AttnprobeWarning)
            with attnprobe.capture(model) as cap:
                captured = model(**batch).last_hidden_state
        said = [str(w.message) for w in caught if issubclass(w.category, AttnprobeWarning)]
        local = r"'encoder.layers.0.self_attn'.*returned its weights with shape \(2, 4, 2, 4, 6\).*modules=\[\.\.\.\]"
        assert any(re.search(local, m) for m in said), said
        assert torch.equal(plain, captured) and not [r for r in cap if r.name.startswith("encoder.")]
        with (
            warnings.catch_warnings(record=True),
            attnprobe.capture(model, modules=["encoder.layers.0.self_attn"]) as traced,
        ):
            assert torch.equal(plain, model(**batch).last_hidden_state)  # (it warns: the traced records have no q, k)
    shapes = [tuple(r.weights.shape) for r in traced if r.name == "encoder.layers.0.self_attn"]
    assert shapes == [(2, 4, 2, 10), (4, 4, 4, 6)], shapes  # global tokens over every key; local blocks, folded
    assert_no_hooks(model)


def test_old_style_text_layers_of_an_interface_model_are_recorded(recwarn):
    """GIT's vision tower uses the attention interface, its text layers (GitSelfAttention) do not: both are
    recorded, the text layers with the model's own output_attentions weights."""
    vision = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4
    )
    config = transformers.GitConfig(
        vision_config=vision,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.GitModel(config).eval()
    ids, mask = torch.randint(3, 100, (2, 7)), torch.tensor([[1] * 5 + [0, 0], [1] * 7])
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(2, 3, 16, 16)}
    with torch.no_grad():
        reference = model(**batch, output_attentions=True).attentions  # installs transformers' own hooks
        hooks = hook_counts(model)
        plain = model(**batch).last_hidden_state
        with attnprobe.capture(model) as cap:
            captured = model(**batch).last_hidden_state
    assert torch.equal(plain, captured) and hook_counts(model) == hooks
    text = [r for r in cap if r.name.startswith("encoder.")]
    assert [r.meta["module_class"] for r in text] == ["GitSelfAttention"] * 2 and len(cap) == 3
    assert all(torch.equal(r.weights, w) for r, w in zip(text, reference, strict=True))
    assert attnprobe.check(cap).ok


def test_a_head_calling_sdpa_itself_is_read_by_the_functional_adapter_not_the_fallback(recwarn):
    """AIMv2's attention-pooling head calls F.scaled_dot_product_attention in its own forward and takes no
    output_attentions: the fallback used to claim it, warn 'old-style', and record nothing. Its sdpa call
    is read whole instead, with the weights its learned query gives over the patches."""
    config = transformers.Aimv2VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        use_head=True,
    )
    torch.manual_seed(0)
    model = transformers.Aimv2VisionModel(config).eval()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(pixel_values=pixels).pooler_output
        with attnprobe.capture(model) as cap:
            captured = model(pixel_values=pixels).pooler_output
    assert torch.equal(plain, captured)
    assert not [w for w in recwarn if issubclass(w.category, AttnprobeWarning)]
    head = [r for r in cap if r.name == "head"]
    assert len(cap) == 2 and len(head) == 1 and head[0].kind == "cross"
    # the head's own computation: its cls token attends over the patches' keys
    with torch.no_grad():
        hidden = model(pixel_values=pixels).last_hidden_state
        k = model.head.k_proj(hidden).reshape(2, 16, 4, 8).transpose(1, 2)
        q = model.head.cls_token.reshape(1, 4, 1, 8)
        expected = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1)
    torch.testing.assert_close(head[0].weights, expected, atol=1e-6, rtol=0)


def _mobilevit():
    config = transformers.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], num_attention_heads=4
    )
    torch.manual_seed(0)
    return transformers.MobileViTModel(config).eval()


def test_old_style_modules_named_in_modules_are_traced_not_read_through_output_attentions(assert_no_hooks):
    """MobileViT's attention is hand-written softmax that takes no output_attentions. A default capture refuses it
    and says to name it in modules=; named, the fallback leaves it to the tracer, which observes its softmax."""
    model = _mobilevit()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with (
        pytest.warns(AttnprobeWarning, match="no attention interface"),
        pytest.raises(UnsupportedModelError, match=r"MobileViTSelfAttention.*modules=\[\.\.\.\]"),
    ):
        with torch.no_grad(), attnprobe.capture(model):
            model(pixel_values=pixels)
    names = [m.name for m in attnprobe.attention_modules(model)]
    first = model.get_submodule(names[0])
    seen = []
    handle = first.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AttnprobeWarning)
        with torch.no_grad():
            plain = model(pixel_values=pixels).last_hidden_state
            with attnprobe.capture(model, modules=names) as cap:
                captured = model(pixel_values=pixels).last_hidden_state
    handle.remove()
    assert not [str(w.message) for w in caught if issubclass(w.category, AttnprobeWarning)]
    assert torch.equal(plain, captured)
    assert [r.name for r in cap] == names and {r.weights_source for r in cap} == {"observed"}
    # the first layer's own softmax, recomputed from its projections
    with torch.no_grad():
        x = seen[-1]
        split = lambda t: t.view(*t.shape[:2], 4, -1).transpose(1, 2)  # noqa: E731
        scores = split(first.query(x)) @ split(first.key(x)).transpose(-1, -2) / first.attention_head_size**0.5
    torch.testing.assert_close(cap[0].weights, torch.softmax(scores, dim=-1), atol=1e-6, rtol=0)
    assert_no_hooks(model)


def test_a_wrapper_around_torch_multihead_attention_is_not_claimed_as_old_style(recwarn):
    """SigLIP2's pooling head keeps a head count and holds an nn.MultiheadAttention: the torch adapter reads that;
    the fallback used to claim the head too, warn 'old-style' and leave it out for returning no weights."""
    config = transformers.Siglip2VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, num_patches=16, patch_size=4
    )
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(config).eval()
    g = torch.Generator().manual_seed(1)
    batch = {
        "pixel_values": torch.randn(2, 16, 48, generator=g),
        "spatial_shapes": torch.tensor([[4, 4], [4, 4]]),
        "pixel_attention_mask": torch.ones(2, 16, dtype=torch.long),
    }
    with torch.no_grad():
        plain = model(**batch).pooler_output
        with attnprobe.capture(model) as cap:
            captured = model(**batch).pooler_output
    assert torch.equal(plain, captured)
    assert not [w for w in recwarn if issubclass(w.category, AttnprobeWarning)]
    assert [r.name for r in cap] == ["encoder.layers.0.self_attn", "head.attention"]
    assert cap[1].weights.shape == (2, 4, 1, 16)


def test_a_traced_old_style_module_records_the_softmax_its_output_attentions_leave_out():
    """LiLT computes two softmax attentions per layer and returns one: the layout stream's (first) and the text's,
    over the same summed scores but each over its own values (the layout's shrunk by channel_shrink_ratio). The
    fallback records the returned one; a trace of the named modules records both calls."""
    config = transformers.LiltConfig(
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
        channel_shrink_ratio=2,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LiltModel(config).eval()
    g = torch.Generator().manual_seed(1)
    corner = torch.randint(0, 500, (2, 7, 2), generator=g)
    batch = {
        "input_ids": torch.randint(3, 100, (2, 7), generator=g),
        "attention_mask": torch.ones(2, 7, dtype=torch.long),
        "bbox": torch.cat([corner, corner + 10], dim=-1),
    }
    names = [m.name for m in attnprobe.attention_modules(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttnprobeWarning)
        with torch.no_grad():
            plain = model(**batch).last_hidden_state
            with attnprobe.capture(model) as weights_only:
                model(**batch)
            with attnprobe.capture(model, modules=names) as traced:
                captured = model(**batch).last_hidden_state
            reference = model(**batch, output_attentions=True).attentions
    assert torch.equal(plain, captured)
    assert len(weights_only) == 2 and len(traced) == 4 and {r.weights_source for r in traced} == {"observed"}
    for name, own in zip(names, reference, strict=True):
        layout, text = [r for r in traced if r.name == name]
        assert torch.equal(text.weights, own) and torch.equal(layout.weights, own)
        assert (layout.v.shape[-1], text.v.shape[-1]) == (6, 12)


def test_a_capture_keeping_no_weights_does_not_ask_for_attentions(gpt_neo, assert_no_hooks):
    """The fallback can only record weights: keep=['q'] leaves the old-style modules alone (no output_attentions
    forced, so no layer's weights are kept alive until the model returns) and says so."""
    batch = inputs("llama", "left")
    asked = []
    # what the inner model is asked for (GPTNeoForCausalLM passes output_attentions on to it)
    probe = gpt_neo.transformer.register_forward_pre_hook(
        lambda m, a, kw: asked.append(bool(kw.get("output_attentions"))), with_kwargs=True
    )
    try:
        with torch.no_grad():
            plain = gpt_neo(**batch)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with attnprobe.capture(gpt_neo, keep=["q"]) as cap:
                    out = gpt_neo(**batch)
            with pytest.warns(AttnprobeWarning, match="output_attentions"):
                with attnprobe.capture(gpt_neo, keep=["weights"]) as weights:
                    gpt_neo(**batch)
    finally:
        probe.remove()
    assert asked == [False, False, True]  # only the capture that keeps weights asks the model for them
    assert len(cap) == 0 and len(weights) == 2
    (said,) = [str(w.message) for w in caught if issubclass(w.category, AttnprobeWarning)]  # one warning, not "no call"
    assert "keep=['q']" in said and "not recorded" in said
    assert torch.equal(out.logits, plain.logits) and out.attentions is None


def test_an_old_style_module_that_says_it_is_causal_is_held_to_it(gpt_neo, recwarn, monkeypatch):
    """GPT-Neo's attention sets ``is_causal = True``: its weights-only records say causal, so check() holds them to
    it with nothing declared. With its causal masks gone (the model's 4-D mask and the module's triangular ``bias``
    buffer: every key allowed) it is caught; the model as built passes. Modules that set nothing say nothing."""
    from transformers.models.gpt_neo import modeling_gpt_neo

    ids = torch.arange(3, 11).unsqueeze(0)

    def checked():
        with torch.no_grad(), attnprobe.capture(gpt_neo) as cap:
            gpt_neo(input_ids=ids)
        return cap, attnprobe.check(cap)

    cap, result = checked()
    assert {r.causal for r in cap} == {True} and result.ok, result.table()
    monkeypatch.setattr(modeling_gpt_neo, "create_causal_mask", lambda **kwargs: None)
    buffers = {m: m.bias for m in gpt_neo.modules() if type(m).__name__ == "GPTNeoSelfAttention"}
    try:  # (monkeypatch's undo would delete a module's buffer, not restore it)
        for m, triangle in buffers.items():
            m.bias = torch.ones_like(triangle)
        _, result = checked()
    finally:
        for m, triangle in buffers.items():
            m.bias = triangle
    assert {v.layer for v in result.errors if v.check == "causal"} == {0, 1}, result.table()
    bloom = transformers.BloomModel(transformers.BloomConfig(hidden_size=16, n_layer=1, n_head=4, vocab_size=100))
    with torch.no_grad(), attnprobe.capture(bloom.eval()) as cap:
        bloom(input_ids=ids)
    assert {r.causal for r in cap} == {None}  # BloomAttention sets no is_causal


def test_a_statistics_capture_of_old_style_modules_computes_them_from_their_weights(gpt_neo, assert_no_hooks):
    """keep=("stats",) on an old-style model asks it for output_attentions and keeps the statistics of those weights,
    not the weights (it recorded nothing): each call's entropy and largest weight those of the full capture's
    weights, the same check() verdicts, a warning that says what memory this takes, the output unchanged, and the
    training monitor on GPT-Neo has a history."""
    batch = inputs("llama", "left")
    with torch.no_grad():
        plain = gpt_neo(**batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with attnprobe.capture(gpt_neo, keep=("stats",)) as stats:
                out = gpt_neo(**batch)
        with attnprobe.capture(gpt_neo) as full:
            gpt_neo(**batch)
    assert torch.equal(out.logits, plain.logits) and out.attentions is None
    said = " ".join(str(w.message) for w in caught if issubclass(w.category, AttnprobeWarning))
    assert "computed from those weights" in said and "layers x (query x key)" in said
    assert len(stats) == len(full) == 2
    for s, f in zip(stats, full, strict=True):
        assert s.weights is None and s.meta["stats_source"] == "weights"
        real = ~f.query_padding[:, None, :].expand(f.weights.shape[:3])  # (batch, head, query): real rows
        torch.testing.assert_close(s.stats["max_weight"][real], f.weights.amax(-1)[real])
    verdicts = [{(v.check, v.severity, v.layer) for v in attnprobe.check(c).violations} for c in (stats, full)]
    assert verdicts[0] == verdicts[1]
    model = _gpt_neo().train()
    with attnprobe.monitor(model, every=1) as mon:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    assert len(mon.history) == 2 * 4  # two layers of four heads, one sampled step


def _training_batch(name: str):
    """(model in training with only its attention modules' dropouts on, at 0.1, its batch) for sweep family
    ``name``: layer 0 then sees what it sees in eval mode."""
    from test_hf_sweep import _causal_lm, attention_dropouts_only, build, family_inputs, old_style_attention

    model = _causal_lm(name) if name == "openai-gpt" else build(name)
    batch, _ = family_inputs(name, model.config)
    if name == "openai-gpt":
        batch.pop("attention_mask")  # OpenAI GPT's forward takes no padding
    attention_dropouts_only(model, set(old_style_attention(model)))
    return model.train(), batch


@pytest.mark.parametrize("name", ["openai-gpt", "xlnet", "nystromformer", "xlm"])
def test_old_style_weights_in_training_are_the_softmax_before_dropout(name, recwarn):
    """Old-style modules return their weights after their dropout while training (kept weights scaled by 1 / (1 - p)).
    The record holds the weights before it, read at the module's nn.Dropout, as every other adapter records them:
    layer 0 equals its weights in eval mode (XLNet hands its dropout (batch, head, query, key) and returns them
    time-first; Nystromformer keeps a dropout it never applies). Before, a full capture recorded the dropped-out
    weights and a statistics capture (the training monitor) recorded nothing."""
    model, batch = _training_batch(name)
    with torch.no_grad(), attnprobe.capture(model.eval()) as plain:
        model(**batch)
    model.train()
    with attnprobe.capture(model) as full:
        model(**batch)
    assert len(full) == len(plain) == 2 and all(r.dropout == 0.1 for r in full)
    assert not any(r.meta.get("weights_after_dropout") for r in full)
    assert torch.equal(full[0].weights, plain[0].weights)
    torch.testing.assert_close(full[1].weights.sum(-1), torch.ones(full[1].weights.shape[:3]))
    assert not attnprobe.check(full).errors
    with attnprobe.capture(model, keep=("stats",)) as stats:
        model(**batch)
    assert len(stats) == 2 and not [w for w in recwarn if "after its dropout" in str(w.message)]


def test_old_style_training_keeps_outputs_and_gradients_and_the_monitor_has_history(recwarn):
    """OpenAI GPT in training, under the monitor: the gradients it gives without it, a history (its weights before
    dropout), and the weights the caller asks for are still the dropped-out ones (0 or the recorded / (1 - p))."""
    grads = []
    for monitored in (False, True):
        net, batch = _training_batch("openai-gpt")
        torch.manual_seed(1)
        with attnprobe.monitor(net, every=1) if monitored else contextlib.nullcontext() as mon:
            net(**batch, labels=batch["input_ids"]).loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert len(mon.history) == 2 * 4  # two layers of four heads
    torch.manual_seed(2)
    with attnprobe.capture(net) as cap:
        asked = net(**batch, output_attentions=True).attentions
    for rec, dropped in zip(cap, asked, strict=True):
        kept = dropped != 0  # (batch, head, query, key): zero where dropped out or masked
        assert bool((rec.weights[~kept] > 0).any())  # some weight was dropped out
        torch.testing.assert_close(dropped[kept].detach(), rec.weights[kept] / 0.9)


def test_prophetnet_in_training_its_functional_dropout_is_read_at_its_call(recwarn):
    """ProphetNet's decoder drops out the weights it returns with nn.functional.dropout (its probability kept in
    ``attention_dropout``). That call's input is read while the module trains (a torch function mode on for the
    module's call, eager code only): the decoder's records hold its weights before dropout, and the monitor has every
    layer. Before, the decoder's weights were recorded after dropout, and the monitor had no history of them."""
    from test_hf_sweep import build, family_inputs

    model = build("prophetnet").train()
    batch, _ = family_inputs("prophetnet", model.config)
    with attnprobe.monitor(model, every=1) as mon:
        model(**batch).last_hidden_state.sum().backward()
    assert set(mon.history["layer"]) == set(range(6))  # the decoder's self-attention's too
    assert not [w for w in recwarn if "after its dropout" in str(w.message)]
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    decoder = [r for r in cap if r.meta.get("stack") == "decoder" and r.kind == "self"]
    assert decoder and all(r.dropout == 0.1 and "weights_after_dropout" not in r.meta for r in decoder)
    for r in decoder:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(r.weights.shape[:3]))


def test_the_functional_dropout_mode_is_gone_when_the_forward_raises(recwarn, assert_no_hooks):
    """The torch function mode that reads XLM's nn.functional.dropout is on for one training call of the module: a
    forward that raises inside that call leaves it on until the capture closes, and closing the capture takes it off
    (no mode is left on this thread's stack, where it would see every later torch call)."""
    from torch.overrides import _get_current_function_mode_stack

    model, batch = _training_batch("xlm")
    attention = model.attentions[0]

    def fail(module, args):
        raise RuntimeError("planted")

    def captured() -> None:
        with attnprobe.capture(model):
            handle = attention.register_forward_pre_hook(fail)  # after the capture's own pre-hook
            try:
                model(**batch)
            finally:
                handle.remove()

    with pytest.raises(RuntimeError, match="planted"):
        captured()
    assert _get_current_function_mode_stack() == []
    assert_no_hooks(model)


def test_a_module_that_averages_its_heads_is_read_per_head():
    """WavLM hands back F.multi_head_attention_forward's mean over heads as every head's weights (pytorch#32590). In
    eager code the capture has that call compute its per-head weights (``average_attn_weights=False``) and hands the
    module their mean, as torch computes it: the outputs stay bitwise the same, the records hold each head's own
    weights, and their mean is bitwise what the model returns. Compiled, where that cannot be read, the records
    hold the mean, say so (``meta["heads_averaged"]``) and the capture warns."""
    from test_hf_sweep import build, family_inputs, tensors_of

    model = build("wavlm").eval()
    batch, _ = family_inputs("wavlm", model.config)
    with torch.no_grad():
        plain = model(**batch, output_attentions=True)
        with attnprobe.capture(model, keep=("weights",)) as cap:
            out = model(**batch, output_attentions=True)
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(plain), tensors_of(out), strict=True))
    assert len(cap) == 2
    for record, returned in zip(cap, plain.attentions, strict=True):
        weights = record.weights  # (batch, head, query, key)
        assert "heads_averaged" not in record.meta and not torch.equal(weights[:, 0], weights[:, 1])
        assert torch.equal(weights.mean(dim=1), returned[:, 0]) and torch.equal(returned[:, 0], returned[:, 1])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    try:
        compiled(**batch)
    except Exception as exc:  # torch 2.6 cannot compile it at all
        pytest.skip(f"torch {torch.__version__} cannot compile WavLM ({type(exc).__name__})")
    with pytest.warns(AttnprobeWarning, match=r"mean of its heads' weights.*pytorch#32590.*uncompiled"):
        with torch.no_grad(), attnprobe.capture(compiled, keep=("weights",)) as averaged:
            compiled(**batch)
    torch._dynamo.reset()
    assert len(averaged) == 2 and all(r.meta["heads_averaged"] for r in averaged)
    assert torch.equal(averaged[0].weights[:, 0], cap[0].weights.mean(dim=1))


def test_weights_after_a_dropout_no_hook_reads_are_recorded_as_such(recwarn):
    """WavLM's attention calls F.multi_head_attention_forward, which returns its weights after its dropout: in
    training, a full capture records them as after dropout (their rows do not sum to one), and a statistics capture
    records nothing of them and says why, instead of statistics that are not the softmax's."""
    from test_hf_sweep import attention_dropouts_only, build, family_inputs, old_style_attention

    model = build("wavlm")
    attention_dropouts_only(model, set(old_style_attention(model)))
    batch, _ = family_inputs("wavlm", model.config)
    model.train()
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    assert len(cap) == 2 and all(r.dropout == 0.1 and r.meta["weights_after_dropout"] for r in cap)
    with pytest.warns(AttnprobeWarning, match=r"after its dropout.*rows do not sum to one.*nn.functional.dropout"):
        with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as stats:
            model(**batch)
    assert len(stats) == 0
