"""Hugging Face capture on tiny random models: outputs unchanged, weights equal eager's, all restored."""

from __future__ import annotations

import math

import pytest
import torch
from hf_helpers import (
    ENCODER_DECODER,
    MODELS,
    build,
    eager_attentions,
    group_records,
    hook_counts,
    inputs,
    max_error_on_real_rows,
)

import attnprobe

PADDINGS = ("left", "right")


@pytest.fixture(scope="module")
def models():
    """One model per (name, backend); tests here never change them."""
    cache = {}

    def get(name, attn=None):
        if (name, attn) not in cache:
            cache[(name, attn)] = build(name, attn)
        return cache[(name, attn)]

    return get


def _main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _implementations(model):
    return {id(c): c._attn_implementation for c in (m.config for m in model.modules() if hasattr(m, "config"))}


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("name", MODELS)
def test_outputs_unchanged_and_weights_equal_eager(models, name, padding, assert_no_hooks):
    model = models(name)
    batch = inputs(name, padding)
    before = _implementations(model)
    with torch.no_grad():
        plain = model(**batch)
        with attnprobe.capture(model) as cap:
            captured = model(**batch)
    assert torch.equal(_main_output(plain), _main_output(captured))
    if name in ENCODER_DECODER:
        assert torch.equal(plain.encoder_last_hidden_state, captured.encoder_last_hidden_state)
    assert _implementations(model) == before
    assert_no_hooks(model)

    reference = eager_attentions(model, batch)
    groups = group_records(cap)
    assert {k: len(v) for k, v in groups.items()} == {k: len(v) for k, v in reference.items()}
    for key, records in groups.items():
        for record, weights in zip(records, reference[key]):
            assert record.weights.shape == weights.shape
            assert max_error_on_real_rows(record, weights) <= 1e-5, (key, record.name)
    assert [r.layer for r in cap] == sorted(r.layer for r in cap)  # one forward: module order
    assert cap.info["adapters"] == ("huggingface",)


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "bart"])
def test_weights_only_are_eagers_to_the_bit(models, name, padding, monkeypatch):
    """keep=("weights",) on sdpa: the weights are torch's softmax of eager's own logits, equal to eager's
    output_attentions bit for bit on every real row of the first layer (later layers read the sdpa model's hidden
    states, a last bit away from the eager model's: within 1e-6 there); sdpa runs as it would (the kernel's lse is
    read for statistics only: ``want_lse`` is not called)."""
    from attnprobe.hooks.hf import adapter

    asked = []
    monkeypatch.setattr(adapter, "want_lse", lambda *args: asked.append(args))
    model = models(name)
    batch = inputs(name, padding)
    with torch.no_grad():
        plain = model(**batch)
        with attnprobe.capture(model, keep=["weights"]) as cap:
            captured = model(**batch)
    assert torch.equal(_main_output(plain), _main_output(captured)) and not asked
    reference = eager_attentions(model, batch)
    for key, records in group_records(cap).items():
        for i, (record, weights) in enumerate(zip(records, reference[key], strict=True)):
            assert max_error_on_real_rows(record, weights) <= (0.0 if i == 0 else 1e-6), (key, record.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_masked_logits_in_one_op_have_the_bits_of_the_product_scaled_then_masked(dtype):
    """``masked_logits`` (weights-only captures on sdpa's bool and causal masks): ``mask + scaling * (q @ k)`` in one
    op equals eager's ``(q @ k) * scaling`` then ``+ mask`` to the bit, -0.0, inf and nan included; half dtypes,
    whose add rounds alpha, take the two ops."""
    from attnprobe.probe.engine.attention_math import masked_logits

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 40, 8, generator=g).mul(4).to(dtype) for _ in range(2))  # (batch, head, rows, d)
    q[0, 0, 0] = 0.0  # a row of -0.0 and 0.0 products
    k[0, 0, :3, 0] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    mask = torch.zeros(2, 1, 40, 40, dtype=dtype).masked_fill_(torch.rand(2, 1, 40, 40, generator=g) < 0.3, -math.inf)
    scaling = 8**-0.5
    want = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling).add_(mask)  # (batch, head, rows, keys)
    got = masked_logits(q, k, mask, scaling=scaling)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert torch.equal(got.view(bits), want.view(bits))
    assert bool(got.isneginf().any()) and bool(got.isnan().any())


def test_weights_only_captures_mask_the_logits_in_one_op(models, monkeypatch):
    """keep=("weights",) of BERT on sdpa with padding: every layer takes ``masked_logits`` (no separate scaling
    pass); a capture that also keeps the scores does not (they are the unmasked logits)."""
    from attnprobe.hooks.hf import recompute

    calls = []
    real = recompute.masked_logits
    monkeypatch.setattr(recompute, "masked_logits", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model, batch = models("bert"), inputs("bert", "right")
    with torch.no_grad(), attnprobe.capture(model, keep=["weights"]) as cap:
        model(**batch)
    assert len(calls) == len(cap) > 1
    calls.clear()
    with torch.no_grad(), attnprobe.capture(model, keep=["weights", "scores"]) as both:
        model(**batch)
    assert not calls and all(torch.equal(a.weights, b.weights) for a, b in zip(cap, both, strict=True))


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "whisper", "vit"])
def test_eager_models_keep_their_own_weights(models, name):
    """Over eager, the weights are the function's own (observed) and the recomputed scores agree."""
    model = models(name, "eager")
    batch = inputs(name, "left")
    with torch.no_grad():
        plain = model(**batch, output_attentions=True)
        hooks = hook_counts(model)  # transformers' own, installed by output_attentions
        with attnprobe.capture(model) as cap:
            captured = model(**batch, output_attentions=True)  # the caller's own request still works
    assert torch.equal(_main_output(plain), _main_output(captured))
    field = "decoder_attentions" if name in ENCODER_DECODER else "attentions"
    theirs, ours = getattr(plain, field), getattr(captured, field)
    assert len(theirs) == len(ours) > 0 and all(torch.equal(a, b) for a, b in zip(theirs, ours))
    for r in cap:
        assert r.backend == "eager" and r.weights_source == "observed"
        assert r.scores is not None and "scores" in r.identified
        masked = r.scores.masked_fill(~r.allowed_for_heads(), float("-inf")).softmax(-1)
        rows = r.allowed_for_heads().any(-1, keepdim=True)
        assert torch.allclose(masked.where(rows, 0), r.weights.where(rows, 0), atol=1e-6)
    assert hook_counts(model) == hooks


def test_sdpa_output_attentions_request_is_unchanged(models):
    """Under sdpa transformers returns no weights for output_attentions; a capture does not change that."""
    model = build("llama")  # output_attentions installs transformers' own hooks: not the shared model
    batch = inputs("llama", "right")
    with torch.no_grad(), attnprobe.capture(model, keep=["weights"]) as cap:
        out = model(**batch, output_attentions=True)
    assert out.attentions == () or out.attentions is None
    assert all(r.weights is not None for r in cap)


def test_records_hold_what_the_call_received(models):
    model = models("llama")
    batch = inputs("llama", "left")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    r = cap[0]
    # grouped-query attention: k/v keep the 2 kv heads, q has 4
    assert r.num_heads == 4 and r.num_kv_heads == 2 and r.kv_heads == (0, 1)
    assert r.q.shape == (2, 4, 7, 8) and r.k.shape == (2, 2, 7, 8) and r.v.shape == (2, 2, 7, 8)
    assert r.scores.shape == r.weights.shape == (2, 4, 7, 7) and r.output.shape == (2, 4, 7, 8)
    assert r.kind == "self" and r.causal is True and r.backend == "sdpa" and r.weights_source == "recomputed"
    assert r.scaling == pytest.approx(8**-0.5) and r.dropout == 0.0 and r.dtype == torch.float32
    assert r.step is None and r.query_offset == 0
    assert r.meta["layer_idx"] == 0 and r.meta["base"] == "sdpa" and r.meta["module_class"] == "LlamaAttention"
    assert r.query_padding.tolist() == (batch["attention_mask"] == 0).tolist()
    # scores are the scaled q @ k of the received (post-RoPE) q and k, repeated for GQA
    k = r.k.repeat_interleave(2, dim=1)
    assert torch.allclose(r.scores, r.q @ k.transpose(-1, -2) * r.scaling, atol=1e-6)
    # causal + left padding: padded keys and future keys are not allowed
    assert r.allowed.shape == (2, 1, 7, 7)
    assert not r.allowed[0, 0, :, :2].any() and not r.allowed[1, 0].triu(1).any()
    # output is the backend's own per-head output, equal to weights @ v on real rows
    v = r.v.repeat_interleave(2, dim=1)
    real = ~r.query_padding[:, None, :, None]
    assert torch.allclose((r.weights @ v).where(real, 0), r.output.where(real, 0), atol=1e-6)
    assert r.identified >= {"q", "k", "v", "scores", "weights", "output", "allowed", "query_padding"}


def test_cross_attention_and_stacks(models):
    model = models("bart")
    batch = inputs("bart", "right")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    cross = [r for r in cap if r.kind == "cross"]
    assert [r.meta["stack"] for r in cap if r.kind == "cross"] == ["decoder", "decoder"]
    assert {r.meta["stack"] for r in cap if r.name.startswith("model.encoder")} == {"encoder"}
    c = cross[0]
    assert c.q.shape[2] == 5 and c.k.shape[2] == 7 and c.weights.shape == (2, 4, 5, 7)
    assert c.causal is False
    # padded encoder keys are not allowed; decoder padding marks the query rows
    assert not c.allowed[0, 0, :, -2:].any()
    assert c.query_padding.tolist() == (batch["decoder_attention_mask"] == 0).tolist()
    enc = cap[0]
    assert enc.query_padding.tolist() == (batch["attention_mask"] == 0).tolist() and enc.causal is False


def test_t5_scores_include_the_position_bias(models):
    model = models("t5")
    with torch.no_grad(), attnprobe.capture(model, layers=[0]) as cap:
        model(**inputs("t5", "right"))
    r = cap[0]
    assert r.scaling == 1.0
    bias = model.encoder.block[0].layer[0].SelfAttention.compute_bias(7, 7)
    assert torch.allclose(r.scores, r.q @ r.k.transpose(-1, -2) + bias, atol=1e-5)


def test_whisper_prescaled_queries_are_said(models):
    model = models("whisper")
    with torch.no_grad(), attnprobe.capture(model, layers=[0]) as cap:
        model(**inputs("whisper", "right"))
    r = cap[0]
    assert r.scaling == 1.0 and r.meta["module_scaling"] == pytest.approx(8**-0.5)
    assert r.meta["stack"] == "encoder" and r.meta["layer_idx"] is None


def test_gemma2_softcap_and_sliding_window(models):
    model = models("gemma2")
    batch = inputs("gemma2", "right")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    sliding, full = cap
    assert sliding.softcap == 0.5 and sliding.sliding_window == 3 and full.sliding_window is None
    # scores are softcapped: bounded by the cap, equal to tanh(raw / cap) * cap
    k = sliding.k.repeat_interleave(2, dim=1)
    raw = sliding.q @ k.transpose(-1, -2) * sliding.scaling
    assert torch.allclose(sliding.scores, torch.tanh(raw / 0.5) * 0.5, atol=1e-6)
    assert sliding.scores.abs().max() <= 0.5
    # the window (query included) is folded into allowed: query 6 sees keys 4..6 only
    assert sliding.allowed[1, 0, 6].nonzero().flatten().tolist() == [4, 5, 6]
    assert full.allowed[1, 0, 6].all()


def test_gpt_oss_sinks(models):
    model = models("gpt_oss")
    with torch.no_grad(), attnprobe.capture(model, heads=[1, 3]) as cap:
        model(**inputs("gpt_oss", "right"))
    r = cap[0]
    attn = model.model.layers[0].self_attn
    assert torch.equal(r.sinks, attn.sinks.detach()[[1, 3]])
    sums = r.weights.sum(-1)
    assert (sums < 1).all()  # the sink takes some mass from every row


def test_selection_keep_and_heads(models, assert_no_hooks):
    model = models("llama")
    batch = inputs("llama", "right")
    with torch.no_grad(), attnprobe.capture(model, layers=[-1], heads=[3], keep=["weights", "k"]) as cap:
        model(**batch)
    (r,) = cap
    assert r.layer == 1 and r.heads == (3,) and r.kv_heads == (1,)
    assert r.q is None and r.scores is None and r.output is None
    assert r.weights.shape == (2, 1, 7, 7) and r.k.shape == (2, 1, 7, 8)
    with torch.no_grad(), attnprobe.capture(model, layers=[1]) as full:
        model(**batch)
    assert torch.equal(r.weights, full[0].weights[:, 3:4]) and torch.equal(r.k, full[0].k[:, 1:2])
    assert_no_hooks(model)


def test_unselected_layers_run_the_plain_backend(models, monkeypatch):
    from attnprobe.hooks.hf import recompute as hf_math

    built = []
    original = hf_math.Recompute.__init__

    def counting(self, *args, **kwargs):
        built.append(kwargs["heads"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(hf_math.Recompute, "__init__", counting)
    model = models("llama")
    with torch.no_grad(), attnprobe.capture(model, layers=[1]) as cap:
        model(**inputs("llama", "right"))
    assert [r.layer for r in cap] == [1] and len(built) == 1


def test_idle_capture_touches_nothing(models, monkeypatch):
    model = models("bert")
    seen = []
    with attnprobe.capture(model, layers=[]) as cap:
        seen.append(model.config._attn_implementation)
        with torch.no_grad():
            model(**inputs("bert", "right"))
    assert seen == ["sdpa"] and len(cap) == 0


def test_budget_fails_before_the_work(models, monkeypatch):
    from attnprobe.hooks.hf import recompute as hf_math

    def boom(self):
        raise AssertionError("weights were recomputed before the budget check")

    monkeypatch.setattr(hf_math.Recompute, "logits", boom)
    model = models("llama")
    with pytest.raises(attnprobe.CaptureBudgetError, match="layer 0"):
        with torch.no_grad(), attnprobe.capture(model, keep=["weights"], max_bytes=100):
            model(**inputs("llama", "right"))
    assert model.config._attn_implementation == "sdpa"


def test_dtype_and_device_of_storage(models):
    model = models("bert")
    with torch.no_grad(), attnprobe.capture(model, layers=[0], dtype=torch.float16) as cap:
        model(**inputs("bert", "right"))
    r = cap[0]
    assert r.weights.dtype == torch.float16 and r.dtype == torch.float32 and r.allowed.dtype == torch.bool


def test_the_effective_causal_flag_is_recorded(models):
    """``model(..., is_causal=False)`` reaches the attention call while the module still says causal."""
    model = models("llama")
    ids = torch.randint(3, 100, (2, 6))
    for kwargs, causal in (({}, True), ({"is_causal": False}, False)):
        with torch.no_grad(), attnprobe.capture(model, layers=[0]) as cap:
            model(input_ids=ids, **kwargs)
        r = cap[0]
        assert r.causal is causal and bool(r.allowed.all()) is (not causal)
        v = r.v.repeat_interleave(2, dim=1)
        assert torch.allclose(r.weights @ v, r.output, atol=1e-6)  # the weights are what sdpa used


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_model_compiled_before_the_capture_is_still_recorded(name):
    """README ("Compiled and scripted models"): Hugging Face layers of a model compiled with torch.compile before
    the capture are still recorded, with the compiled model's outputs unchanged."""
    model = build(name)
    batch = inputs(name, "left" if name == "llama" else "right")
    compiled = torch.compile(model, backend="eager")
    try:
        with torch.no_grad():
            try:
                expected = _main_output(compiled(**batch))  # compiled and run before the capture, as a user's would be
            except Exception as exc:
                pytest.skip(
                    f"torch {torch.__version__} cannot compile this transformers release's {name}, without "
                    f"any capture ({type(exc).__name__})"
                )
            with attnprobe.capture(compiled) as cap:
                out = _main_output(compiled(**batch))
        assert torch.equal(out, expected)
        layers = len(attnprobe.attention_modules(model))
        assert layers > 0 and sorted(r.layer for r in cap) == list(range(layers))
        assert all(r.weights is not None for r in cap)
    finally:
        torch._dynamo.reset()
