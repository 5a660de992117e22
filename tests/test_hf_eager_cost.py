"""Capture from eager attention: each kept tensor made once, and the function's math judged once per module.

An eager function returns its weights, so a capture keeps them (no recompute); its scores are recomputed, and
whether attnprobe's formula is the function's is judged by comparing the two weights, once per module, function,
set of arguments and plain module attributes, for the whole process.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hf_helpers import build, inputs
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

import attnprobe
from attnprobe.hooks.hf import adapter as hf
from attnprobe.hooks.hf import recompute as hf_math

_names = itertools.count()


def _scaled_eager(module, query, key, value, attention_mask, scaling, **kwargs):
    """Llama's eager function with its scaling times ``module.attnprobe_test_factor`` (a plain attribute)."""
    factor = getattr(module, "attnprobe_test_factor", 1.0)
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling * factor, **kwargs)


def _register(fn) -> str:
    name = f"eager_cost_{next(_names)}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, eager_mask)
    return name


@pytest.fixture
def judged(monkeypatch):
    """How many times a capture recomputed weights (the judging of a function's math needs them)."""
    calls = []
    weights = hf_math.Recompute.weights

    def counted(self):
        calls.append(self)
        return weights(self)

    monkeypatch.setattr(hf_math.Recompute, "weights", counted)
    return calls


def _capture(model, batch, **options):
    with torch.no_grad(), attnprobe.capture(model, **options) as cap:
        model(**batch)
    return cap


def test_an_eager_modules_math_is_judged_once_not_once_per_capture(judged):
    model, batch = build("llama", "eager"), inputs("llama", "right")
    first = _capture(model, batch)
    assert len(judged) == 2  # one judging per layer
    second = _capture(model, batch)
    assert len(judged) == 2  # the verdicts were kept
    for a, b in zip(first, second):
        assert a.scores is not None and torch.equal(a.scores, b.scores) and torch.equal(a.weights, b.weights)
        assert b.weights_source == "observed"
    assert attnprobe.check(second).ok


def test_a_function_attnprobe_does_not_reproduce_keeps_its_weights_and_gets_no_scores(recwarn, monkeypatch):
    monkeypatch.setattr(hf, "_WARNED", set())  # the warning is given once per module class and process
    name = _register(_scaled_eager)
    model, batch = build("llama", name), inputs("llama", "right")
    for module in model.modules():
        module.attnprobe_test_factor = 3.0
    with pytest.warns(attnprobe.AttnprobeWarning, match="does not reproduce"):
        cap = _capture(model, batch)
    again = _capture(model, batch)  # the kept verdict: still no scores, and no second warning
    for cap_ in (cap, again):
        for r in cap_:
            assert r.scores is None and "scores" not in r.identified and r.weights_source == "observed"


def test_a_changed_plain_attribute_gets_the_function_judged_again(recwarn):
    name = _register(_scaled_eager)
    model, batch = build("llama", name), inputs("llama", "right")
    trusted = _capture(model, batch)
    assert all(r.scores is not None for r in trusted)
    for module in model.modules():
        module.attnprobe_test_factor = 0.5  # the function's math changes with it
    changed = _capture(model, batch)  # (the warning is given once per module class and process)
    assert all(r.scores is None for r in changed)


def test_the_scores_of_a_mask_that_only_masks_are_the_logits():
    """A float mask that is 0 or finfo.min adds nothing to the scores: they are scaled q @ k, not a sum made per
    layer; the weights still see the mask."""
    model, batch = build("gpt2", "eager"), inputs("gpt2", "right")
    cap = _capture(model, batch, keep=("q", "k", "scores", "weights"))
    for r in cap:
        logits = r.q.float() @ r.k.float().transpose(-1, -2) * r.scaling
        assert torch.equal(r.scores, logits)
        assert (r.weights.triu(1) == 0).all()  # causal, from the mask
    # the mask's non-masking part: none for 0 / finfo.min, the bias itself where a mask carries one (Swin)
    low = torch.finfo(torch.float32).min
    masking = torch.tensor([[0.0, low], [0.0, 0.0]]).view(1, 1, 2, 2)
    info = hf_math.MaskInfo(
        masking, hf_math.allowed_from(masking, batch=1, q_len=2, k_len=2, implicit_causal=False, device="cpu")
    )
    assert info.float_bias((0,), torch.float32, 2) is None
    biased = masking + torch.tensor([[0.5, 0.0], [0.0, -0.25]])
    info = hf_math.MaskInfo(
        biased, hf_math.allowed_from(biased, batch=1, q_len=2, k_len=2, implicit_causal=False, device="cpu")
    )
    assert torch.equal(info.float_bias((0,), torch.float32, 2), torch.tensor([[[[0.5, 0.0], [0.0, -0.25]]]]))


def test_eager_weights_are_kept_as_the_function_returned_them_when_nothing_else_writes_them():
    """Without grad, every head selected: the record holds the tensor output_attentions returns (one tensor, not a
    copy of it). With grad (autograd holds it), a subset of heads, or in inference mode: a copy of its own."""
    model, batch = build("gpt2", "eager"), inputs("gpt2", "right")
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        returned = model(**batch, output_attentions=True).attentions
    for r, w in zip(cap, returned):
        assert r.weights.data_ptr() == w.data_ptr() and not r.weights.requires_grad

    with attnprobe.capture(model, keep=("weights",)) as grad_cap:
        returned = model(**batch, output_attentions=True).attentions
    for r, w in zip(grad_cap, returned):
        assert w.requires_grad and not r.weights.requires_grad
        assert r.weights.data_ptr() != w.data_ptr() and torch.equal(r.weights, w.detach())

    with torch.no_grad(), attnprobe.capture(model, keep=("weights",), heads=[1, 2]) as some:
        returned = model(**batch, output_attentions=True).attentions
    for r, w in zip(some, returned):
        assert torch.equal(r.weights, w[:, 1:3]) and r.weights.untyped_storage().data_ptr() != w.data_ptr()

    with torch.inference_mode(), attnprobe.capture(model, keep=("weights",)) as inference:
        returned = model(**batch, output_attentions=True).attentions
    for r, w in zip(inference, returned):
        assert not r.weights.is_inference() and torch.equal(r.weights, w)
    r = inference[0]
    r.weights.mul_(1.0)  # an ordinary tensor: usable after the block
