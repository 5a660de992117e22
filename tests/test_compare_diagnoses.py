"""Each diagnosis of attnprobe.compare, from records changed by hand: named when its model reproduces the difference,
and not named when the difference is something else (noise stays ``unknown``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnprobe
from attnprobe.probe.analyses.compare import compare_captures

IDS = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 23]])


@pytest.fixture(scope="module")
def records():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    return list(attnprobe.run(model, IDS)[1])


def _changed(records, **fields):
    return [dataclasses.replace(records[0], **fields)]


def _noise(t, size, seed=0):
    return t + size * t.abs().max() * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))


def test_noise_is_unknown_and_q_differing_at_position_zero_says_the_inputs_differ(records):
    rec = records[0]
    result = compare_captures(records, _changed(records, q=_noise(rec.q, 0.05)))
    assert (result.first.tensor, result.diagnosis) == ("q", "unknown")
    assert "first position too" in result.evidence and "scale" in result.evidence
    noisy = compare_captures(records, _changed(records, scores=_noise(rec.scores * 0.7, 0.05)))
    assert (noisy.first.tensor, noisy.diagnosis) == ("scores", "unknown")


def test_a_constant_factor_is_scale_wherever_it_is(records):
    rec = records[0]
    result = compare_captures(records, _changed(records, v=rec.v * 2))
    assert (result.first.tensor, result.diagnosis) == ("v", "scale") and abs(result.details["factor"] - 2) < 1e-6


def test_a_softcap_on_either_side_is_found_with_its_cap(records):
    rec = records[0]
    capped = 0.02 * torch.tanh(rec.scores / 0.02)  # the candidate caps, the reference does not (cap fitted)
    result = compare_captures(records, _changed(records, scores=capped))
    assert result.diagnosis == "softcap" and result.details["lacking"] == "reference"
    assert abs(result.details["cap"] - 0.02) < 1e-4
    clipped = compare_captures(records, _changed(records, scores=rec.scores.clamp(-0.01, 0.01)))
    assert clipped.diagnosis != "softcap"  # a hard clip is not tanh: not named softcap


def test_weights_rounded_to_half_precision_are_softmax_dtype(records):
    rec = records[0]
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        rounded = rec.weights.to(dtype).to(torch.float32)
        result = compare_captures(records, _changed(records, weights=rounded))
        assert (result.first.tensor, result.diagnosis, result.details["dtype"]) == ("weights", "softmax_dtype", name)
    wrong = compare_captures(records, _changed(records, weights=_noise(rec.weights, 0.01)))
    assert wrong.diagnosis == "unknown"


def test_key_heads_repeated_in_the_other_order_on_both_sides(records):
    rec = records[0]
    four = {"num_kv_heads": 4, "kv_heads": (0, 1, 2, 3)}
    interleaved = _changed(records, k=rec.k.repeat_interleave(2, 1), v=rec.v.repeat_interleave(2, 1), **four)
    tiled = _changed(records, k=rec.k.repeat(1, 2, 1, 1), v=rec.v.repeat(1, 2, 1, 1), **four)
    result = compare_captures(interleaved, tiled)
    assert (result.first.tensor, result.diagnosis) == ("k", "kv_repeat")
    assert result.details["repeated_by"] == "repeat"


def test_a_mask_that_lets_one_more_key_in_is_mask(records):
    rec = records[0]
    allowed = torch.ones(8, 8, dtype=torch.bool).tril(1)[None, None].expand_as(rec.allowed)
    weights = torch.softmax(rec.scores.masked_fill(~allowed, float("-inf")), -1)
    result = compare_captures(records, _changed(records, allowed=allowed, weights=weights))
    assert (result.first.tensor, result.diagnosis) == ("weights", "mask")
    assert (result.details["reference_offset"], result.details["candidate_offset"]) == (0, 1)
    assert (result.first.query, result.first.key) == (0, 0)  # the earliest differing cell


def test_the_tolerance_follows_the_inputs_dtype(records):
    rec = records[0]
    low = _changed(records, q=rec.q.to(torch.bfloat16), k=rec.k.to(torch.bfloat16), v=rec.v.to(torch.bfloat16))
    frame = compare_captures(records, low).to_frame()
    assert set(frame["dtype"]) == {"bfloat16"}
    strict = compare_captures(records, low, atol=0.0, rtol=0.0)
    assert not strict.ok and strict.first.tensor == "q"
