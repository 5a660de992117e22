"""Shipped attention bugs, reproduced with tiny models, and the declarations that catch them (issue 33).

Each bug is planted by re-introducing its fix's reverse in the installed transformers: the function's own source,
edited back (``reverse_fix``), or the one attribute a fix changed. The declaration a user would naturally write catches
it and the fixed model passes under the same declaration; the model's own declarations (config, inputs) catch it
with nothing declared where the issue asks so (packed documents, image blocks).
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import flex_helpers
import pytest
import torch
from hf_helpers import transformers

import attnprobe

TEXT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=120,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=16,
    patch_size=4,
    num_channels=3,
    model_type="siglip_vision_model",
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reverse_fix(monkeypatch, owner, name: str, fixed: str, broken: str) -> None:
    """Replace ``owner.name`` (a function of a module, or a method) with its own source where the fix's text
    ``fixed`` reads ``broken`` again: the bug as it shipped, everything else as installed."""
    fn = inspect.unwrap(getattr(owner, name))
    source = textwrap.dedent(inspect.getsource(fn))
    # @auto_docstring only writes documentation, and it cannot read a method outside its class
    source = "\n".join(line for line in source.splitlines() if line.strip() != "@auto_docstring")
    assert fixed in source, f"the installed {fn.__qualname__} no longer reads {fixed!r}: update the test"
    module = sys.modules[fn.__module__]
    namespace = dict(vars(module))
    exec(compile(source.replace(fixed, broken), module.__file__ or "<reverse>", "exec"), namespace)
    monkeypatch.setattr(owner, name, namespace[name])


def errors_of(result, check: str) -> list:
    return [v for v in result.errors if v.check == check]


# ------------------------------------------------------------------------------------------------ Gemma 3 images
def gemma3():
    torch.manual_seed(0)
    text = dict(TEXT, num_key_value_heads=2, head_dim=8, model_type="gemma3_text", sliding_window=3)
    config = transformers.Gemma3Config(
        text_config=dict(text, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"]),
        vision_config=VISION,
        image_token_index=110,
        mm_tokens_per_image=4,
        boi_token_index=111,
        eoi_token_index=112,
    )
    return transformers.Gemma3ForConditionalGeneration(config).eval()


#: two images of 4 tokens each, between text: token_type_ids 1 on the image tokens
GEMMA_IDS = torch.tensor([[5, 6, 111, 110, 110, 110, 110, 112, 7, 111, 110, 110, 110, 110, 112, 8]])
TOKEN_TYPES = (GEMMA_IDS == 110).long()


def text_layers(cap) -> list[int]:
    """The language model's layers (the vision tower's come first)."""
    return sorted(r.layer for r in cap if "language_model" in r.name)


def gemma3_capture(model, *, keep=None):
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    options = {} if keep is None else {"keep": keep}
    with torch.no_grad(), attnprobe.capture(model, **options) as cap:
        model(input_ids=GEMMA_IDS, pixel_values=pixels, token_type_ids=TOKEN_TYPES)
    return cap


def test_a_correct_gemma3_with_images_passes_with_nothing_declared():
    """Its image blocks are bidirectional: causal=True read alone failed it with 8 errors; the inputs' token_type_ids
    declare the blocks, the config the sliding window of layer 0."""
    cap = gemma3_capture(gemma3())
    result = attnprobe.check(cap)
    assert result.ok and result.verified, result.table()
    said = "\n".join(result.declarations)
    assert "token_type_ids passed to Gemma3" in said and "sliding_window=3" in said, said
    assert result.coverage["reach"] == 2 and result.coverage["declared"] == 1, dict(result.coverage)
    declared = attnprobe.check(cap, bidirectional=TOKEN_TYPES)  # what a user would write: the same verdict
    assert declared.ok and declared.coverage["reach"] == 2


def test_images_attending_the_next_image_are_caught(monkeypatch):
    """transformers #38053, fixed by #38080: every image token in one block, so an image sees the next one."""
    from transformers.models.gemma3 import modeling_gemma3 as g

    model = gemma3()
    reverse_fix(
        monkeypatch,
        g,
        "get_block_sequence_ids_for_mask",
        "block_sequence_ids = torch.where(is_image, group_ids, -1)",
        "block_sequence_ids = torch.where(is_image, 0, -1)",
    )
    cap = gemma3_capture(model)
    for result in (attnprobe.check(cap), attnprobe.check(cap, bidirectional=TOKEN_TYPES)):
        found = errors_of(result, "causal")
        assert found and {v.layer for v in found} == set(text_layers(cap)), result.table()
        assert all(set(v.queries) <= {3, 4, 5, 6} and set(v.keys) <= {10, 11, 12, 13} for v in found), result.table()
        assert "bidirectional" in found[0].message


def test_an_image_block_ignoring_the_sliding_window_is_caught(monkeypatch):
    """transformers #46711, fixed by #46850: on sliding layers the block was OR-ed after the window, so the last
    token of a 4-token image saw its first one, 3 positions back, through a window of 3."""
    from transformers.models.gemma3 import modeling_gemma3 as g

    model = gemma3()
    # before the fix (as #46711 describes it): sliding_attention = sliding_causal OR blockwise
    reverse_fix(
        monkeypatch,
        g,
        "create_masks_for_vision_model",
        "    sliding_mask = create_causal_mask(\n"
        "        **mask_kwargs,\n"
        "        or_mask_function=blockwise_overlay(padded_block_sequence_ids),\n"
        "        and_mask_function=sliding_window_overlay(config.sliding_window),\n",
        "    sliding_mask = create_sliding_window_causal_mask(\n"
        "        **mask_kwargs,\n"
        "        block_sequence_ids=block_sequence_ids,\n",
    )
    cap = gemma3_capture(model)
    sliding = {text_layers(cap)[0]: 3}
    for result in (attnprobe.check(cap), attnprobe.check(cap, bidirectional=TOKEN_TYPES, sliding_window=sliding)):
        found = errors_of(result, "declared")
        assert found and {v.layer for v in found} == {text_layers(cap)[0]}, result.table()
        # the last token of each image (6, 13) saw the first (3, 10), 3 positions back
        assert all(set(v.queries) == {6, 13} and set(v.keys) == {3, 10} for v in found), result.table()
        assert "sliding window" in found[0].message


def test_a_bidirectional_mask_that_never_reaches_attention_is_caught(monkeypatch):
    """transformers #39389: the mask reaching attention was purely causal; ``reach`` reports the image keys ahead
    that the blocks open and the record masked."""
    from transformers.models.gemma3 import modeling_gemma3 as g

    model = gemma3()
    monkeypatch.setattr(
        g, "create_masks_for_vision_model", lambda block_sequence_ids, **kwargs: g.create_masks_for_generate(**kwargs)
    )
    cap = gemma3_capture(model)
    for result in (attnprobe.check(cap), attnprobe.check(cap, bidirectional=TOKEN_TYPES)):
        found = errors_of(result, "reach")
        assert found and {v.layer for v in found} == set(text_layers(cap)), result.table()
        assert set(found[0].keys) <= {4, 5, 6, 11, 12, 13} and "masked" in found[0].message


# ------------------------------------------------------------------------------------------------ packed documents
def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dict(TEXT, num_key_value_heads=2, head_dim=8))
    return transformers.LlamaForCausalLM(config).eval()


PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])  # three documents in one row
PACKED_DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]])


def packed_capture(model, **inputs):
    ids = torch.arange(3, 15).unsqueeze(0)
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(input_ids=ids, position_ids=PACKED, use_cache=False, **inputs)
    return cap


def test_packed_documents_attending_across_are_caught(monkeypatch):
    """axolotl PR #3796, transformers PR #46634: with a 2-D all-ones mask, transformers' packed-sequence detection is
    off and every document attends the ones packed before it. The fix (the detection gate without
    ``attention_mask is None``) is applied to the installed transformers for the fixed run."""
    from transformers import masking_utils

    model = llama()
    broken = packed_capture(model, attention_mask=torch.ones(1, 12, dtype=torch.long))
    for result in (
        attnprobe.check(broken),
        attnprobe.check(broken, documents=PACKED_DOCS),
        attnprobe.check(broken, documents="position_ids"),
    ):
        found = errors_of(result, "declared")
        assert found and {v.layer for v in found} == {0, 1}, result.table()
        assert "document" in found[0].message and set(found[0].queries) >= {4, 7}, result.table()
    assert any("position_ids passed to LlamaModel restart" in d for d in attnprobe.check(broken).declarations)
    reverse_fix(
        monkeypatch,
        masking_utils,
        "_preprocess_mask_arguments",
        "if position_ids is not None and attention_mask is None and cache is None:",
        "if position_ids is not None and cache is None:",
    )
    fixed = packed_capture(model, attention_mask=torch.ones(1, 12, dtype=torch.long))
    for declared in ({}, {"documents": PACKED_DOCS}, {"documents": "position_ids"}):
        result = attnprobe.check(fixed, **declared)
        assert result.ok and result.coverage["declared"] == 2, result.table()


# ------------------------------------------------------------------------------------------------------ the scale
def test_a_prescaled_query_scaled_again_is_caught(monkeypatch):
    """OPT applied its attention scaling twice (transformers #38277, fixed by #38290): q = q_proj(x) * scaling and
    the kernel scaled again. The record's scaling reads a plausible 1/sqrt(d); the projections' outputs show the
    factor q got before the kernel."""
    from transformers.models.opt import modeling_opt as opt

    torch.manual_seed(0)
    config = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, vocab_size=120, word_embed_proj_dim=32
    )
    model = transformers.OPTForCausalLM(config).eval()
    ids = torch.arange(3, 11).unsqueeze(0)
    with torch.no_grad(), attnprobe.capture(model) as fixed:
        model(input_ids=ids)
    reverse_fix(monkeypatch, opt.OPTAttention, "forward", "scaling=1.0,", "scaling=self.scaling,")
    with torch.no_grad(), attnprobe.capture(model) as broken:
        model(input_ids=ids)
    assert broken[0].scaling == pytest.approx(8**-0.5)  # self-consistent: the kernel's scaling looks right
    user = attnprobe.check(broken, scale=8**-0.5)
    found = errors_of(user, "scale")
    assert len(found) == 2 and "q was multiplied by 0.3536" in found[0].message, user.table()
    unasked = attnprobe.check(broken)  # the model's own scaling, a warning: a correct model may mean another
    assert unasked.ok and [v.severity for v in unasked.violations if v.check == "scale"] == ["warning"] * 2
    for result in (attnprobe.check(fixed, scale=8**-0.5), attnprobe.check(fixed)):
        assert result.ok and not result.violations and result.coverage["scale"] == 2, result.table()


def test_the_projection_factor_is_read_on_a_sample_of_rows():
    """``expects._factors``: the one factor between a projection's output and the kernel's rows, read on every head
    at up to 16 tokens of the first sequence (this call's rows after a cache); a per-row norm is no factor, and rows
    of zeros in the projection are left out; several pairs at once (q's and k's) each get their own."""
    from attnprobe.hooks.hf.expects import _factors

    def _factor(projected, kernel):
        return _factors([(projected, kernel)])[0]

    torch.manual_seed(0)
    projected = torch.randn(3, 40, 4 * 8)  # (batch, tokens, heads * d)
    kernel = (projected * 0.25).view(3, 40, 4, 8).transpose(1, 2)  # (batch, head, tokens, d)
    assert _factor(projected, kernel) == pytest.approx(0.25)
    cached = torch.cat([torch.randn(3, 4, 5, 8), kernel], dim=2)  # 5 cached rows before this call's
    assert _factor(projected, cached) == pytest.approx(0.25)
    assert _factor(projected, torch.nn.functional.normalize(kernel, dim=-1)) is None  # a norm: no one factor
    projected[0, 0].zero_()  # a row of zeros (its kernel row is 0 too) says nothing and is left out
    assert _factor(projected, (projected * 0.25).view(3, 40, 4, 8).transpose(1, 2)) == pytest.approx(0.25)
    assert _factor(projected, kernel[:, :, :, :4]) is None  # another layout
    halved = (projected * 0.5).view(3, 40, 4, 8).transpose(1, 2)
    pairs = [(projected, kernel[:, :, :, :4]), (projected, halved), (projected, torch.randn(3, 4, 40, 8))]
    assert _factors(pairs) == [None, pytest.approx(0.5), None]
    # the projection's other layouts, read through their strides: (batch, tokens, head, d), (batch, head, tokens, d)
    # (normed after the heads' transpose), q's columns of a fused qkv projection, and bfloat16
    assert _factor(projected.view(3, 40, 4, 8), halved) == pytest.approx(0.5)
    assert _factor(projected.view(3, 40, 4, 8).transpose(1, 2), halved) == pytest.approx(0.5)
    qkv = torch.randn(3, 40, 3 * 32)  # (batch, tokens, 3 x heads x d)
    q = qkv[..., 32:64]  # rows 96 floats apart
    assert _factor(q, (q * 2.0).reshape(3, 40, 4, 8).transpose(1, 2)) == pytest.approx(2.0)
    low = q.to(torch.bfloat16)
    assert _factor(low, (low * 2).reshape(3, 40, 4, 8).transpose(1, 2)) == pytest.approx(2.0, rel=1e-2)


# ----------------------------------------------------------------------------------------- causal and bidirectional
def test_a_decoder_given_a_bidirectional_mask_is_caught(monkeypatch):
    """transformers #48745 (fixed by #48760): RoFormerForCausalLM (is_decoder=True) built a bidirectional mask; the
    config's is_decoder declares causality unasked, and causal=True, the natural declaration, catches it too."""
    from transformers.models.roformer import modeling_roformer as roformer

    torch.manual_seed(0)
    config = transformers.RoFormerConfig(**dict(TEXT, embedding_size=32), is_decoder=True)
    model = transformers.RoFormerForCausalLM(config).eval()
    ids = torch.arange(3, 11).unsqueeze(0)
    with torch.no_grad(), attnprobe.capture(model) as fixed:
        model(input_ids=ids)
    reverse_fix(
        monkeypatch,
        roformer.RoFormerModel,
        "forward",
        "mask_function = create_causal_mask if self.config.is_decoder else create_bidirectional_mask",
        "mask_function = create_bidirectional_mask",
    )
    with torch.no_grad(), attnprobe.capture(model) as broken:
        model(input_ids=ids)
    for declared in ({}, {"causal": True}):
        found = errors_of(attnprobe.check(broken, **declared), "causal")
        assert {v.layer for v in found} == {0, 1}, found
        assert attnprobe.check(fixed, **declared).ok
    assert any("is_decoder=True" in d for d in attnprobe.check(broken).declarations)


def test_a_causal_encoder_is_flagged_on_its_own_layers(monkeypatch):
    """transformers PR #42820: T5Gemma2's encoder attention had is_causal=True, so sdpa's causal shortcut made the
    encoder causal. The encoder is bidirectional by what the model is: its layers, and only those, are reported."""
    torch.manual_seed(0)
    text = dict(TEXT, num_key_value_heads=2, head_dim=8, model_type="t5gemma2_text", sliding_window=4)
    full = dict(text, layer_types=["full_attention", "full_attention"])  # no mask built: sdpa's is_causal decides
    config = transformers.T5Gemma2Config(
        encoder=dict(text_config=full, vision_config=VISION, model_type="t5gemma2_encoder"),
        decoder=dict(text, model_type="t5gemma2_decoder"),
    )
    model = transformers.T5Gemma2ForConditionalGeneration(config).eval()
    inputs = {"input_ids": torch.arange(3, 11).unsqueeze(0), "decoder_input_ids": torch.arange(3, 9).unsqueeze(0)}
    with torch.no_grad(), attnprobe.capture(model) as fixed:
        model(**inputs)
    encoder = [m for n, m in model.named_modules() if n.startswith("model.encoder.text_model") and n.endswith("attn")]
    assert encoder
    for module in encoder:
        monkeypatch.setattr(module, "is_causal", True)  # the flag the fix turned off
    with torch.no_grad(), attnprobe.capture(model) as broken:
        model(**inputs)
    layers = {r.layer for r in broken if r.meta.get("stack") == "encoder" and r.kind == "self"}
    found = errors_of(attnprobe.check(broken), "causal")
    assert found and {v.layer for v in found} == layers, attnprobe.check(broken).table()
    assert "no query attends any later key" in found[0].message
    assert attnprobe.check(fixed).ok


# ------------------------------------------------------------------------------------------------------ a prefix
def test_a_prefix_made_causal_is_caught(monkeypatch):
    """PaliGemma's prefix (the image and the prompt, token_type_ids 0) is bidirectional, the suffix causal. Planted:
    the prefix made causal (the line that opens it removed). ``reach`` reports the prefix keys the record masked,
    under prefix_length=, the natural declaration, and unasked from the token_type_ids."""
    from transformers.models.paligemma import modeling_paligemma as pg

    torch.manual_seed(0)
    config = transformers.PaliGemmaConfig(
        text_config=dict(TEXT, num_key_value_heads=2, head_dim=8, model_type="gemma"),
        vision_config=VISION,
        image_token_index=110,
        projection_dim=32,
    )
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    ids = torch.tensor([[110] * 16 + [5, 6, 7, 8, 9, 10, 11]])
    types = torch.tensor([[0] * 19 + [1] * 4])  # prefix: 16 image tokens and 3 prompt tokens
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad(), attnprobe.capture(model) as cap:
            model(input_ids=ids, pixel_values=pixels, token_type_ids=types)
        return cap

    fixed = run()
    reverse_fix(
        monkeypatch,
        pg.PaliGemmaModel,
        "forward",
        'mask_kwargs["block_sequence_ids"] = torch.where(token_type_ids == 0, 0, -1)',
        'mask_kwargs["block_sequence_ids"] = torch.where(token_type_ids == 0, -1, -1)',  # no block: all causal
    )
    broken = run()
    text = sorted(r.layer for r in broken if "language_model" in r.name)
    for declared in ({}, {"prefix_length": dict.fromkeys(text, 19)}):
        found = errors_of(attnprobe.check(broken, **declared), "reach")
        assert {v.layer for v in found} == set(text), attnprobe.check(broken, **declared).table()
        assert max(found[0].keys) <= 18 and "masked" in found[0].message
        result = attnprobe.check(fixed, **declared)
        assert result.ok and result.coverage["reach"] == len(text), result.table()


# ------------------------------------------------------------------------------------------------ Doge's dynamic mask
def doge(attn: str = "sdpa"):
    torch.manual_seed(0)
    config = transformers.DogeConfig(**dict(TEXT, num_key_value_heads=2, keep_window_size=4))
    return transformers.DogeModel._from_config(config, attn_implementation=attn).eval()


def test_doge_sdpa_without_its_causal_mask_is_caught(monkeypatch):
    """transformers #48748 (fixed by #48821): Doge adds its dynamic mask onto the causal mask, but under sdpa
    ``create_causal_mask`` returned None for an unpadded input, so the dynamic mask reached sdpa alone: no causal term,
    and ``is_causal`` off because a mask was given. The module says it is causal: caught with nothing declared, and
    with ``causal=True``; the fixed model passes both."""
    from transformers.models.doge import modeling_doge

    model, ids = doge(), torch.arange(3, 15).unsqueeze(0)  # 12 tokens: the dynamic mask keeps 4 keys a row

    def both(model) -> list:  # a full capture and a statistics capture
        caps = []
        for options in ({}, {"keep": ("stats",)}):
            with torch.no_grad(), attnprobe.capture(model, **options) as cap:
                model(input_ids=ids)
            caps.append(cap)
        return caps

    fixed = both(model)
    reverse_fix(monkeypatch, modeling_doge.DogeModel, "forward", "allow_is_causal_skip=False,", "")
    broken = both(model)
    for declared in ({}, {"causal": True}):
        for good, bad in zip(fixed, broken, strict=True):
            found = errors_of(attnprobe.check(bad, **declared), "causal")
            assert {v.layer for v in found} == {0, 1}, found
            # the rows whose own key the dynamic mask dropped are no causal mask shifted by one
            assert attnprobe.check(good, **declared).ok, attnprobe.check(good, **declared).table()


@flex_helpers.FLEX_SKIP
def test_doge_on_flex_attention_is_checked_against_what_its_kernel_computes():
    """Doge under flex attention (transformers 5.24): ``create_causal_mask`` gives a BlockMask, which
    ``prepare_dynamic_mask`` does not fold into its dense mask, and the dense mask goes to flex alone: the causal and
    padding masks are lost and the outputs are not eager's. Found by running the sweep's families on flex; not
    reported upstream from here. The check says so with nothing declared (and passes where the outputs are eager's,
    as in a transformers release that fixes it); the weights it reads are the kernel's (``output_match`` holds)."""
    ids = torch.arange(3, 15).unsqueeze(0)
    eager, flex = doge("eager"), doge("flex_attention")
    flex.load_state_dict(eager.state_dict())
    with torch.no_grad(), flex_helpers.uncompiled():
        want = eager(input_ids=ids).last_hidden_state
        with attnprobe.capture(flex) as cap:
            got = flex(input_ids=ids).last_hidden_state
    result = attnprobe.check(cap)
    lost = not torch.allclose(got, want, atol=1e-4)
    assert lost == bool(errors_of(result, "causal")), result.table()
    assert not errors_of(result, "output_match"), result.table()
    if lost:  # transformers 5.24: every layer attends later keys, and the message names the missing causal mask
        assert {v.layer for v in errors_of(result, "causal")} == {0, 1}
        assert "causal mask is missing or shifted" in errors_of(result, "causal")[0].message


def test_sparse_attention_dropping_a_rows_own_key_is_no_shifted_causal_mask():
    """GLM-MoE-DSA's indexer (DeepSeek sparse attention) keeps each query's top ``index_topk`` keys, its own key not
    always among them: check() reports no error, prefill or generation, and names those rows as information (it
    had called them "the causal mask is shifted by one"). A mask shifted by one is still an error
    (test_checks_paths.py)."""
    from test_hf_sweep import FAMILIES, make_inputs

    _, shapes, _ = FAMILIES["glm-moe-dsa"]
    torch.manual_seed(0)
    config = transformers.GlmMoeDsaConfig(**dict(shapes, index_topk=4))  # fewer than the 7 tokens' keys
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    batch, _ = make_inputs("causal", config)
    with torch.no_grad(), attnprobe.capture(model) as prefill:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model) as generation:
        model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=0)
    for cap in (prefill, generation):
        result = attnprobe.check(cap, causal=True)
        assert result.ok, result.table()
        dropped = [v for v in result.violations if v.check == "causal"]
        assert dropped and all(v.severity == "info" and "selects keys" in v.message for v in dropped)


def test_mllama_cross_attention_run_causally_under_sdpa_is_caught(monkeypatch):
    """transformers #48172 (fix proposed in #48218, still in 5.24): MllamaTextCrossAttention sets no ``is_causal``,
    which transformers' sdpa takes as True when no ``cross_attention_mask`` is given, so each text query sees only as
    many image tokens as its own index. check() reports the cross-attention layer with nothing declared; with the
    fix (``is_causal = False`` on the module) it reports no cross-attention."""
    from test_hf_sweep import build, make_inputs

    model = build("mllama")
    batch, _ = make_inputs("vlm", model.config, 1)
    batch.update(
        pixel_values=torch.randn(2, 1, 1, 3, 16, 16, generator=torch.Generator().manual_seed(5)),
        aspect_ratio_ids=torch.tensor([[1], [1]]),
        aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
    )

    def cross_errors() -> set:
        with torch.no_grad(), attnprobe.capture(model) as cap:
            model(**batch)
        found = [v for v in errors_of(attnprobe.check(cap), "causal") if "cross-attention" in v.message]
        return {v.name for v in found}

    assert cross_errors() == {"language_model.layers.1.cross_attn"}
    for module in model.modules():
        if type(module).__name__ == "MllamaTextCrossAttention":
            monkeypatch.setattr(module, "is_causal", False, raising=False)  # the fix
    assert cross_errors() == set()


def test_a_module_without_is_causal_is_causal_only_where_sdpa_or_its_cache_makes_it_so():
    """A module that sets no ``is_causal`` is causal to transformers' sdpa only when no mask is given. LayoutLM's
    encoder gets its padding mask (and its config says ``use_cache=True``, which its model never reads): its records
    say nothing, and ``check(cap)`` reports no "after the query's position" on its bidirectional weights (it did,
    quoting "the module says it is causal"). Doge's stack runs with a cache: its records say causal, and why. Mllama's
    vision layers say nothing; its cross-attention, which sdpa ran causally (#48172), says causal."""
    from test_hf_sweep import build, make_inputs

    def captured(name: str, kind: str, **extra):
        model = build(name)
        batch, _ = make_inputs(kind, model.config, *extra.pop("image_tokens", ()))
        batch.update(extra)
        with torch.no_grad(), attnprobe.capture(model) as cap:
            model(**batch)
        return cap

    layoutlm = captured("layoutlm", "encoder")
    assert {r.causal for r in layoutlm} == {None}
    assert not errors_of(attnprobe.check(layoutlm), "causal")
    assert errors_of(attnprobe.check(layoutlm, causal=True), "causal")  # a declaration still holds it
    sources = {r.meta.get("causal_source") for r in captured("doge", "causal")}
    default = "DogeAttention sets no is_causal (transformers' default: causal) and its stack runs with a cache"
    assert sources == {default}
    mllama = captured(
        "mllama",
        "vlm",
        image_tokens=(1,),
        pixel_values=torch.randn(2, 1, 1, 3, 16, 16, generator=torch.Generator().manual_seed(5)),
        aspect_ratio_ids=torch.tensor([[1], [1]]),
        aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
    )
    vision = {r.causal for r in mllama if r.name.startswith("vision_model.")}
    cross = {r.causal for r in mllama if r.kind == "cross"}
    assert (vision, cross) == ({None}, {True})
    assert {v.name.split(".")[0] for v in errors_of(attnprobe.check(mllama), "causal")} == {"language_model"}


def test_blip_text_runs_as_its_call_says_not_as_its_config_says(monkeypatch):
    """BLIP's text model takes ``is_decoder`` per call (False by default; its LM head passes True), while its config
    says ``is_decoder=True``: BlipModel's text encoder is bidirectional, the captioning decoder causal. check() reads
    the call's argument: BlipModel passes with nothing declared (it reported every text layer as attending later
    keys, quoting the config), and a captioning decoder given the encoder's mask is caught."""
    from test_hf_sweep import build, make_inputs
    from transformers.models.blip import modeling_blip_text

    model = build("blip")
    batch, _ = make_inputs("text-image", model.config)
    captioner = transformers.BlipForConditionalGeneration(model.config).eval()

    def checked(model, **inputs):
        with torch.no_grad(), attnprobe.capture(model) as cap:
            model(**inputs)
        sources = {r.meta["expects"]["causal"]["source"] for r in cap if r.kind == "self" and "text" in r.name}
        return attnprobe.check(cap), sources

    result, sources = checked(model, **batch)
    assert result.ok and sources == {"BlipTextModel.forward(is_decoder=False)"}, result.table()
    inputs = {n: batch[n] for n in ("pixel_values", "input_ids", "attention_mask")}
    result, sources = checked(captioner, **inputs)
    assert result.ok and sources == {"BlipTextModel.forward(is_decoder=True)"}, result.table()

    def bidirectional(config, inputs_embeds, attention_mask, **_):  # the decoder given the encoder's mask
        return modeling_blip_text.create_bidirectional_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )

    monkeypatch.setattr(modeling_blip_text, "create_causal_mask", bidirectional)
    result, _ = checked(captioner, **inputs)
    assert {v.name.split(".")[0] for v in errors_of(result, "causal")} == {"text_decoder"}, result.table()


def test_an_encoder_decoders_text_decoder_is_held_causal_with_nothing_declared(recwarn):
    """FSMT's attention sets no ``is_causal`` (old-style, read through ``output_attentions``), and its model builds no
    causal mask in a full forward while ``use_cache`` is on (its default): the decoder attends later tokens. The
    text decoder of an encoder-decoder (its stack takes ``input_ids``) is causal unasked, so check() reports it with
    nothing declared, on the decoder's self-attention only; with ``use_cache=False`` (the causal mask built) it
    passes. DETR-style decoders (object queries) get no such expectation."""
    from test_hf_sweep import build, make_inputs

    model = build("fsmt")
    batch, _ = make_inputs("seq2seq", model.config)

    def checked(use_cache: bool):
        with torch.no_grad(), attnprobe.capture(model) as cap:
            model(**batch, use_cache=use_cache)
        return cap, attnprobe.check(cap)

    cap, result = checked(True)
    decoder_self = {r.name for r in cap if r.meta.get("stack") == "decoder" and r.kind == "self"}
    assert {v.name for v in errors_of(result, "causal")} == decoder_self, result.table()
    assert "the text decoder of an encoder-decoder (FSMTDecoder takes input_ids)" in str(result.declarations)
    assert checked(False)[1].ok
    detr = build("table-transformer")
    inputs, _ = make_inputs("detection", detr.config)
    with torch.no_grad(), attnprobe.capture(detr) as cap:
        detr(**inputs)
    assert all("causal" not in r.meta.get("expects", {}) for r in cap if r.meta.get("stack") == "decoder")


# ------------------------------------------------------------------------------------------------ statistics mode
def _verdicts(result) -> set:
    return {(v.check, v.severity, v.layer, v.batch, v.queries, v.query_count) for v in result.violations}


def test_statistics_captures_get_the_same_verdicts_from_what_the_model_declares(monkeypatch):
    """The unasked declarations (image blocks from token_type_ids, the config's sliding window, packed position_ids)
    on statistics captures: the verdicts of the full capture, for the correct Gemma 3, #39389 planted, and packed
    documents attending across (#46634)."""
    from transformers.models.gemma3 import modeling_gemma3 as g

    def same(full, stats, ok: bool) -> None:
        on_full, on_stats = attnprobe.check(full), attnprobe.check(stats)
        assert on_full.ok == ok and on_full.verified, on_full.table()
        assert _verdicts(on_stats) == _verdicts(on_full), (on_full.table(), on_stats.table())
        assert on_stats.declarations == on_full.declarations

    model = gemma3()
    same(gemma3_capture(model), gemma3_capture(model, keep=("stats",)), ok=True)
    monkeypatch.setattr(
        g, "create_masks_for_vision_model", lambda block_sequence_ids, **kwargs: g.create_masks_for_generate(**kwargs)
    )
    same(gemma3_capture(model), gemma3_capture(model, keep=("stats",)), ok=False)
    llama_model, ids, ones = llama(), torch.arange(3, 15).unsqueeze(0), torch.ones(1, 12, dtype=torch.long)
    caps = []
    for keep in (None, ("stats",)):
        with torch.no_grad(), attnprobe.capture(llama_model, **({} if keep is None else {"keep": keep})) as cap:
            llama_model(input_ids=ids, position_ids=PACKED, use_cache=False, attention_mask=ones)
        caps.append(cap)
    same(*caps, ok=False)
