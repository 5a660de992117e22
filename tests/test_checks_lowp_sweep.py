"""Invariant checks in low precision: no false positive on correct models, real bugs still caught.

Hugging Face families are built from the tiny configs of ``test_hf_sweep`` and run in bfloat16, in float16
(``model.to(dtype)``) and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` on a float32 model, with left
and right padding, checked with the declarations a user of the family would make. The tiny configs'
default initialisation (std 0.02) gives scores near 0, where no tolerance is stressed, so every linear
layer is re-drawn at a large scale (``GAIN``): scores then reach hundreds and low-precision rounding moves
the weights by factors, as in real models with large logits.

A representative subset of families keeps this module fast (the full ~235-family sweep in three
precisions and two paddings takes about a minute more): encoders, decoders with grouped-query heads,
sliding windows (mistral, cohere2), softcapping (gemma2), attention sinks (gpt-oss), seq2seq with
cross-attention (bart, t5), audio (whisper, wav2vec2), vision (vit, deit, swin's bias in the mask),
a vision-language model (llava), object queries (conditional-detr) and old-style families checked through
their output_attentions (bloom, gpt-neo), and two families whose float16 activations overflow at this scale
(mobilebert, switch-transformers). A family whose tiny model cannot run in a precision on CPU (an op
not implemented) is skipped with the reason.

A check may fail on a correct model only when the model itself overflowed: float16 models whose activations
pass 65504 (and eager attention's finfo.min mask plus a negative score gives -inf, a padded row of only
-inf gives NaN). Then the model's own outputs are non-finite and ``finite`` is the only check that fires.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import replace

import pytest
import torch
from checks_helpers import LEFT_PADDED, RIGHT_PADDED, TinyTransformer, capture_one
from test_checks import CTX_MASK, EXPECTED, errors_by_check
from test_checks import declarations as tiny_declarations

import attnprobe

transformers = pytest.importorskip("transformers")
from test_checks_hf import custom_backends  # noqa: E402, F401 - the fixture registering the broken backends
from test_hf_sweep import (  # noqa: E402
    FAMILIES,
    _one_thread,  # noqa: F401 - autouse: tiny models run faster on one thread
    build,
    declarations,
    make_inputs,
    padding_mask,
    tensors_of,
)

GAIN = 6.0
SUBSET = (
    "bert",
    "electra",
    "llama",
    "mistral",
    "cohere2",
    "gemma2",
    "gpt-oss",
    "granite",
    "bart",
    "t5",
    "whisper",
    "vit",
    "deit",
    "swin",
    "wav2vec2",
    "llava",
    "conditional-detr",
    "bloom",
    "gpt-neo",
    "mobilebert",
    "switch-transformers",
)
MODES = ("bf16", "fp16", "autocast")


def large_scale(model, gain: float = GAIN, seed: int = 7):
    """Re-draw every linear layer with std ``gain / sqrt(fan_in)`` and embeddings with std 1 (scores in the
    hundreds instead of near 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * gain / m.in_features**0.5)
            elif isinstance(m, torch.nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g))
    return model


def drops_softcap(model) -> bool:
    """Gemma2 on sdpa: transformers up to 5.23 let Gemma2 run on sdpa, whose kernel ignores the logit softcapping
    its eager code applies (5.24: ``_supports_sdpa = False``). At these scores the output then differs from the
    softcapped weights @ v, and ``output_match`` must say so."""
    config = model.config
    return bool(getattr(config, "attn_logit_softcapping", None)) and config._attn_implementation == "sdpa"


def padded_on(side: str, batch: dict, masks: dict) -> tuple[dict, dict]:
    """The inputs with every padding mask padded on ``side`` instead (the same new tensor in both dicts)."""
    moved = {id(m): padding_mask(m.shape[-1], side) for m in masks.values()}
    return ({k: moved.get(id(v), v) for k, v in batch.items()}, {k: moved[id(m)] for k, m in masks.items()})


def in_precision(model, batch: dict, mode: str):
    """(model, inputs, context manager to run them in) for ``mode``."""
    if mode == "autocast":
        return model, batch, torch.autocast("cpu", dtype=torch.bfloat16)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    batch = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}
    return model.to(dtype), batch, contextlib.nullcontext()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SUBSET)
def test_no_false_positive_in_low_precision(name, mode, side):
    model = large_scale(build(name))
    _, _, kind, *extras = FAMILIES[name]
    extras = extras[0] if extras else {}
    batch, masks = make_inputs(kind, model.config, extras.get("image_tokens", 16))
    batch.update(extras.get("inputs", {}))
    batch, masks = padded_on(side, batch, masks)
    model, batch, context = in_precision(model, batch, mode)
    try:
        with torch.no_grad(), context:
            plain = tensors_of(model(**batch))
    except (RuntimeError, NotImplementedError) as e:  # an op without a kernel for this dtype on CPU
        pytest.skip(f"{name} does not run in {mode} on CPU: {type(e).__name__}: {str(e)[:160]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)  # old-style families warn of their fallback
        with torch.no_grad(), context, attnprobe.capture(model) as cap:
            captured = tensors_of(model(**batch))
    assert len(plain) == len(captured)
    for a, b in zip(plain, captured):  # bitwise unchanged, NaN where the model overflowed included
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    causal, mask = declarations(cap, name, masks)
    result = attnprobe.check(cap, causal=causal, attention_mask=mask or None)
    assert result.verified, result.table()
    model_overflowed = not all(bool(torch.isfinite(t).all()) for t in plain if t.is_floating_point())
    if drops_softcap(model):  # the model's own bug in this release: its kernel computes something else
        assert not result.ok and {v.check for v in result.errors} == {"output_match"}, result.table()
    elif model_overflowed:  # the model's own NaN/inf: reported by `finite`, and by nothing else
        assert mode == "fp16" and not result.ok and {v.check for v in result.errors} == {"finite"}, result.table()
    else:
        assert result.ok, result.table()


def test_the_sweep_stresses_the_tolerances():
    """Without the re-drawn weights the tiny models' scores stay near 0 and nothing above would be tested."""
    model = large_scale(build("deit"))
    model, batch, context = in_precision(model, make_inputs("image", model.config)[0], "bf16")
    with torch.no_grad(), context, attnprobe.capture(model) as cap:
        model(**batch)
    assert max(float(r.scores.float().abs().amax()) for r in cap) > 100


# --------------------------------------------------------------------------- the tolerance of large scores
def _large_score_record(dtype: torch.dtype, scale: float) -> attnprobe.AttentionRecord:
    """A correct record as the Hugging Face adapter makes one for sdpa: weights recomputed in float32 from
    q and k, scores and weights stored in the model's dtype."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g) for _ in range(3))
    logits = q @ k.transpose(-1, -2) * scale
    weights = logits.softmax(-1)
    return attnprobe.AttentionRecord(
        name="attn",
        layer=0,
        call=0,
        kind="self",
        causal=False,
        heads=(0, 1),
        num_heads=2,
        kv_heads=(0, 1),
        num_kv_heads=2,
        dtype=dtype,
        scaling=scale,
        q=q.to(dtype),
        k=k.to(dtype),
        v=v.to(dtype),
        scores=logits.to(dtype),
        weights=weights.to(dtype),
        output=(weights @ v).to(dtype),
        allowed=torch.ones(2, 1, 9, 9, dtype=torch.bool),
        weights_source="recomputed",
    )


@pytest.mark.parametrize("dtype, base", [(torch.bfloat16, 384.0), (torch.float16, 3072.0)], ids=["bf16", "fp16"])
def test_large_scores_rounded_to_low_precision_are_no_softmax_mismatch(dtype, base):
    """Two logits 2.02 apart where the dtype's spacing is 2 are stored 4 apart (each rounded by ~1 the other
    way): the small weight is 6.5 times softmax(stored scores), beyond the linear bound 1 + 2 * eps * max|score|
    (4.0) and within the exponential one exp(2 * eps * max|score|) (20.7)."""
    logits = torch.tensor([base + 0.99, base + 3.01])
    scores = logits.to(dtype)
    assert scores.float().tolist() == [base, base + 4]  # rounded apart
    weights = logits.softmax(-1)  # what a kernel computing in float32 gives
    rec = _record(scores.reshape(1, 1, 1, 2), weights.to(dtype).reshape(1, 1, 1, 2), dtype)
    ratio = float(weights[0] / scores.float().softmax(-1)[0])
    eps_s = torch.finfo(dtype).eps / 2 * (base + 4)
    assert 1 + 2 * eps_s < ratio < math.exp(2 * eps_s)
    result = attnprobe.check(rec, checks=["softmax_match"])
    assert result.ok and result.coverage["softmax_match"] == 1, result.table()
    wrong = _record(scores.reshape(1, 1, 1, 2), weights.flip(-1).to(dtype).reshape(1, 1, 1, 2), dtype)
    assert not attnprobe.check(wrong, checks=["softmax_match"]).ok  # swapped weights: still caught


def _record(scores: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> attnprobe.AttentionRecord:
    B, H, Tq, Tk = scores.shape
    return attnprobe.AttentionRecord(
        name="attn",
        layer=0,
        call=0,
        kind="self",
        causal=False,
        heads=tuple(range(H)),
        num_heads=H,
        kv_heads=tuple(range(H)),
        num_kv_heads=H,
        dtype=dtype,
        scores=scores,
        weights=weights,
        allowed=torch.ones(B, 1, Tq, Tk, dtype=torch.bool),
        weights_source="recomputed",
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_weights_of_other_scores_are_still_a_softmax_mismatch_in_low_precision(dtype):
    rec = _large_score_record(dtype, scale=4.0)
    halved = replace(rec, weights=(rec.scores.float() / 2).softmax(-1).to(dtype))  # the scale applied twice
    assert attnprobe.check(rec).ok
    assert "softmax_match" in errors_by_check(attnprobe.check(halved, checks=["softmax_match"]))


# --------------------------------------------------------------------------- scores beyond float16's range
def test_scores_beyond_float16_range_with_finite_weights_are_not_a_finite_error():
    """The adapter stores the float32 scores an sdpa kernel kept finite in the model's float16: 7e4 becomes
    inf. The weights show the attention never saw inf: an info finding, not an error."""
    rec = _large_score_record(torch.float16, scale=1.0)
    scores = rec.scores.clone()
    scores[0, 1, 4, 2], scores[1, 0, 3, 5] = math.inf, -math.inf
    weights = rec.weights.clone()
    weights[0, 1, 4] = 0.0
    weights[0, 1, 4, 2] = 1.0  # a +inf score takes the whole row
    weights[1, 0, 3, 5] = 0.0  # a -inf one nothing
    overflowed = replace(rec, scores=scores, weights=weights, output=(weights.float() @ rec.v.float()).half())
    result = attnprobe.check(overflowed, checks=["finite"])
    assert result.ok, result.table()
    infos = [v for v in result.violations if v.check == "finite"]
    assert {(v.batch, v.head, v.queries, v.keys) for v in infos} == {(0, 1, (4,), (2,)), (1, 0, (3,), (5,))}
    assert all(v.severity == "info" and "stored as inf" in v.message for v in infos)
    # a row whose allowed scores are all below -65504: the largest true score still takes the whole row
    sunk = scores.clone()
    sunk[1, 1, 6] = -math.inf
    sunk_weights = weights.clone()
    sunk_weights[1, 1, 6] = 0.0
    sunk_weights[1, 1, 6, 4] = 1.0
    result = attnprobe.check(replace(overflowed, scores=sunk, weights=sunk_weights, output=None), checks=["finite"])
    assert result.ok and any(v.batch == 1 and v.head == 1 and v.queries == (6,) for v in result.violations)
    # weights that contradict the inf (a +inf key that is not the row's largest) stay an error
    contradicted = replace(overflowed, weights=rec.weights)
    assert {(v.batch, v.head) for v in attnprobe.check(contradicted, checks=["finite"]).errors} == {(0, 1), (1, 0)}


def test_fp16_sdpa_family_with_scores_beyond_range_passes():
    """ELECTRA at a large scale in float16: sdpa keeps its scores finite (the model's outputs are finite),
    the scores stored in float16 overflow."""
    model = large_scale(build("electra"), gain=12.0).half()
    batch, masks = make_inputs("encoder", model.config)
    with torch.no_grad(), attnprobe.capture(model) as cap:
        out = tensors_of(model(**batch))
    assert all(bool(torch.isfinite(t).all()) for t in out if t.is_floating_point())
    assert any(bool(torch.isinf(r.scores).any()) for r in cap)
    result = attnprobe.check(cap, causal=False, attention_mask=masks["encoder"])
    assert result.ok, result.table()
    assert any("stored as inf" in v.message for v in result.violations)


# --------------------------------------------------------------------------- NaN rows and causal=False
def test_nan_weights_are_not_reported_as_a_causal_mask_under_causal_false():
    """A bidirectional layer whose weights all overflowed to NaN: ``finite`` says so; NaN > threshold being
    False must not read as "no query attends a later key"."""
    rec = _large_score_record(torch.float16, scale=1.0)
    nan = replace(rec, weights=torch.full_like(rec.weights, math.nan))
    fired = errors_by_check(attnprobe.check(nan, causal=False))
    assert "finite" in fired and "causal" not in fired, fired
    causal_mask = replace(rec, weights=rec.weights.float().tril().div(rec.weights.float().tril().sum(-1, True)).half())
    assert "causal" in errors_by_check(attnprobe.check(causal_mask, causal=False))  # still caught


# --------------------------------------------------------------------------- real bugs in low precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_broken_own_attention_is_caught_in_low_precision(bug, dtype):
    torch.manual_seed(0)
    model = TinyTransformer(bug=bug).to(dtype)
    x, ctx = torch.randn(2, 7, 16, dtype=dtype) * 2, torch.randn(2, 6, 12, dtype=dtype) * 2  # scores of ~10
    cap = capture_one(model, x, ctx, LEFT_PADDED, CTX_MASK)
    assert max(float(r.scores.float().nan_to_num(0, 0, 0).abs().amax()) for r in cap) > 5
    result = attnprobe.check(cap, **tiny_declarations(LEFT_PADDED, CTX_MASK))
    must, quiet = EXPECTED[bug]
    fired = errors_by_check(result)
    assert must <= set(fired), (bug, result.table())
    assert not quiet & set(fired), (bug, result.table())
    assert any(v.name == "dec0" for check in must for v in fired[check])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", [LEFT_PADDED, RIGHT_PADDED], ids=["left", "right"])
def test_correct_own_modules_pass_in_low_precision_at_a_large_scale(mask, dtype):
    torch.manual_seed(0)
    model = TinyTransformer().to(dtype)
    x, ctx = torch.randn(2, 7, 16, dtype=dtype) * 8, torch.randn(2, 6, 12, dtype=dtype) * 8
    cap = capture_one(model, x, ctx, mask, CTX_MASK)
    assert max(float(r.scores.float().abs().amax()) for r in cap) > 50
    for declared in ({}, tiny_declarations(mask, CTX_MASK)):
        result = attnprobe.check(cap, **declared)
        assert result.ok and not result.skipped, result.table()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["attnprobe_test_ignores_mask", "attnprobe_test_wrong_gqa"])
def test_broken_hugging_face_backends_are_caught_in_low_precision(backend, dtype, custom_backends):
    from test_checks_hf import LEFT, captured_forward, llama_inputs, tiny_llama

    model = tiny_llama(backend).to(dtype)
    _, cap = captured_forward(model, llama_inputs())
    result = attnprobe.check(cap, causal=True, attention_mask=LEFT)
    assert {v.check for v in result.errors} == {"output_match"}, result.table()
    correct = tiny_llama("attnprobe_test_correct").to(dtype)
    assert attnprobe.check(captured_forward(correct, llama_inputs())[1], causal=True, attention_mask=LEFT).ok
