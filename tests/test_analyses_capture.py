"""The analyses inside a capture: capture(rows=) for full and statistics captures, eviction fractions and span masses
computed during the forward (equal to the same computed afterwards from full weights), across generate steps."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import build, inputs

import attnprobe
from attnprobe import SelectionError


def test_full_capture_keeps_only_the_selected_rows_placed_by_query_offset(assert_no_hooks):
    model = build("llama")
    batch = inputs("llama", "none", length=12)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as full:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights", "q"), rows="last:3") as cap:
        model(**batch)
    assert_no_hooks(model)
    for rec, ref in zip(cap, full):
        assert rec.weights.shape[2] == 3 and rec.q.shape[2] == 3 and rec.query_offset == 9
        # recomputed for those rows alone: the full recompute's weights to float rounding
        assert torch.allclose(rec.weights, ref.weights[:, :, 9:], atol=1e-6) and rec.key_len == 12
    assert all(r.allowed is None or r.allowed.shape[2] in (1, 3) for r in cap)  # rows x keys, not keys x keys
    assert attnprobe.check(cap, causal=True).ok
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",), rows=[1, 2, 7]) as runs:
        model(**batch)
    layer0 = runs.select(layers=[0])
    assert [(r.query_offset, r.query_len, r.call) for r in layer0] == [(1, 2, 0), (7, 1, 0)]
    assert torch.allclose(layer0[1].weights, full[0].weights[:, :, 7:8], atol=1e-6)
    frame = layer0.to_frame()
    assert sorted(frame.query_pos.unique()) == [1, 2, 7]


def test_statistics_capture_computes_the_selected_rows_only():
    model = build("llama")
    batch = inputs("llama", "none", length=12)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as every:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), rows=slice(2, 12, 3)) as some:
        model(**batch)
    rec, ref = some[0], every[0]
    assert rec.stats_positions.tolist() == [2, 5, 8, 11] and rec.stats["entropy"].shape[2] == 4
    assert torch.allclose(rec.stats["entropy"], ref.stats["entropy"][:, :, [2, 5, 8, 11]], atol=1e-6)
    with pytest.raises(SelectionError, match="stats_rows= or rows="):
        attnprobe.capture(model, keep=("stats",), rows="last", stats_rows=4)


def test_generated_rows_of_a_generation():
    model = build("llama")
    batch = inputs("llama", "none", length=6)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",), rows="generated") as cap:
        model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert sorted({r.step for r in cap}) == [1, 2, 3] and all(r.query_len == 1 for r in cap)


def test_eviction_during_the_forward_equals_the_profile_from_full_weights():
    model = build("llama")
    batch = inputs("llama", "left", length=40)
    plan = attnprobe.EvictionPlan(budgets=(2, 8, 16), window=4, observe=6)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), rows="last:6", eviction=plan) as stats:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as full:
        model(**batch)
    got = attnprobe.eviction_profile(stats, per_row=True)
    want = attnprobe.eviction_profile(full, plan=plan, per_row=True)
    assert len(got) == len(want) == 2 * 4 * 2 * 6 * 4 * 3
    assert (got["kept"] - want["kept"]).abs().max() < 1e-5
    assert stats[0].meta["eviction"]["split"] == 34


def test_eviction_across_generate_steps():
    model = build("llama")
    batch = inputs("llama", "none", length=30)
    plan = attnprobe.EvictionPlan(budgets=(4, 12), window=4)
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), rows="generated", eviction=plan) as stats:
        model.generate(**batch, **options)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as full:
        model.generate(**batch, **options)
    got = attnprobe.eviction_profile(stats)
    want = attnprobe.eviction_profile(full, plan=plan)
    assert (got["rows"] == 2 * 3).all()  # 2 batch rows x 3 generated tokens fed back
    assert (got["kept"] - want["kept"]).abs().max() < 1e-5


def test_span_masses_during_the_forward_equal_those_from_weights():
    model = build("llama")
    batch = inputs("llama", "right", length=10)
    declared = attnprobe.spans.ranges({"a": (0, 4), "b": (4, 10)})
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), spans=declared) as stats:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as full:
        model(**batch)
    got, want = attnprobe.spans.attention(stats, declared), attnprobe.spans.attention(full, declared)
    assert len(got) == len(want) and (got["mass"] - want["mass"]).abs().max() < 1e-5
