"""KV-cache eviction profiles (probe/engine/kept_mass.py, probe/analyses/eviction.py) against a brute-force reference
written from the definitions (tests/eviction_reference.py)."""

from __future__ import annotations

import math

import pytest
import torch
from eviction_reference import dense_weights
from eviction_reference import profile as reference

import attnprobe
from attnprobe.probe.analyses.eviction import EvictionError, eviction_profile
from attnprobe.probe.engine.attention_math import AttentionCall
from attnprobe.probe.engine.kept_mass import CallRows, EvictionPlan, EvictionPlanError, TensorRows, evaluate_call


def _qk(B, H, T, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, d, generator=g)
    k = torch.randn(B, H, T, d, generator=g)
    # head 0 looks back at a few heavy keys (large logits), head 1 spreads: different profiles
    k[:, 0, ::97] *= 4.0
    q[:, 1] *= 0.1
    return q, k


def _max_difference(got: dict, want: dict) -> float:
    return max(float((got[p] - want[p]).abs().max()) for p in want)


def test_blockwise_fractions_equal_brute_force_at_2k_tokens():
    T, plan = 2048, EvictionPlan(budgets=(16, 128, 512, 1024), window=32, observe=48)
    q, k = _qk(1, 2, T)
    call = AttentionCall(q, k, scaling=0.25, causal=True)
    fractions, meta, _ = evaluate_call(CallRows(call), plan, step=None, query_offset=0, block_bytes=1 << 20)
    assert meta["split"] == T - 48 and meta["rows"] == list(range(T - 48, T))
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    w = dense_weights(q, k, scaling=0.25, allowed=tril)
    want = reference(w, T - 48, list(range(T - 48, T)), plan)
    assert _max_difference(fractions, want) < 1e-5
    # the policies differ (a test of one would pass the others), the oracle bounds them all, every row keeps more
    # with a larger budget
    means = {p: float(f.mean()) for p, f in fractions.items()}
    assert len({round(m, 4) for m in means.values()}) == 4, means
    for p in ("streaming", "h2o", "snapkv"):
        assert bool((fractions[p] <= fractions["oracle"] + 1e-9).all())
    assert bool((fractions["oracle"].diff(dim=-1) >= -1e-12).all())


def test_left_padding_counts_real_rows_and_sinks_start_at_the_first_real_key():
    B, H, T, pad = 2, 2, 96, 7
    plan = EvictionPlan(budgets=(6, 20, 50), sinks=2, window=8, kernel=3, observe=16)
    q, k = _qk(B, H, T, seed=1)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :pad] = False  # the second row is left-padded
    mask = real[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()  # (B, 1, T, T)
    call = AttentionCall(q, k, scaling=0.25, mask=mask)
    fractions, _, _ = evaluate_call(CallRows(call), plan, step=None, query_offset=0, counted=real.double())
    w = dense_weights(q, k, scaling=0.25, allowed=mask)
    want = reference(w, T - 16, list(range(T - 16, T)), plan, start=[0, pad], counted=real.double())
    assert _max_difference(fractions, want) < 1e-6
    # the same from full weights (a full capture's path)
    from_weights, _, _ = evaluate_call(
        TensorRows(w.float(), mask), plan, step=None, query_offset=0, counted=real.double()
    )
    assert _max_difference(from_weights, want) < 1e-6


def test_generation_steps_are_evaluated_against_the_prompts_key_sets():
    prompt, new, plan = 200, 5, EvictionPlan(budgets=(8, 32, 64), window=16)
    q, k = _qk(1, 2, prompt + new, seed=2)
    T = prompt + new
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    _, meta, state = evaluate_call(
        CallRows(AttentionCall(q[:, :, :prompt], k[:, :, :prompt], scaling=0.25, causal=True)),
        plan,
        step=0,
        query_offset=0,
    )
    assert meta["split"] == prompt and meta["rows"] == [] and state is not None
    steps = []
    for s in range(1, new + 1):  # one query against the keys so far, as a KV-cache step
        t = prompt + s - 1
        call = AttentionCall(q[:, :, t : t + 1], k[:, :, : t + 1], scaling=0.25)
        fractions, meta, state = evaluate_call(CallRows(call), plan, step=s, query_offset=t, state=state)
        assert meta["rows"] == [0]
        steps.append(fractions)
    got = {p: torch.cat([f[p] for f in steps], dim=2) for p in plan.policies}
    w = dense_weights(q, k, scaling=0.25, allowed=tril)
    want = reference(w, prompt, list(range(prompt, T)), plan)
    assert _max_difference(got, want) < 1e-6
    # a step whose cache dropped keys cannot be evaluated, and says so
    call = AttentionCall(q[:, :, -1:], k[:, :, -50:], scaling=0.25)
    fractions, meta, _ = evaluate_call(CallRows(call), plan, step=9, query_offset=T - 1, state=state)
    assert fractions is None and "drops keys" in meta["skipped"]


def test_profile_of_a_full_capture_is_the_reference_and_a_statistics_capture_without_plan_is_refused():
    torch.manual_seed(0)
    attn = attnprobe.MultiHeadAttention(16, num_heads=2, causal=True)
    with torch.no_grad(), attnprobe.capture(attn, keep=("weights",)) as cap:
        attn(torch.randn(1, 120, 16))
    plan = EvictionPlan(budgets=(4, 16, 64), observe=10)
    profile = eviction_profile(cap, plan=plan)
    assert list(profile.columns) == ["layer", "name", "head", "policy", "budget", "kept", "kept_min", "rows"]
    want = reference(cap[0].weights.double(), 110, list(range(110, 120)), plan)
    for row in profile.itertuples():
        values = want[row.policy][0, row.head, :, plan.budgets.index(row.budget)]
        assert row.kept == pytest.approx(float(values.mean()), abs=1e-6)
        assert row.kept_min == pytest.approx(float(values.min()), abs=1e-6)
        assert row.rows == 10
    per_row = eviction_profile(cap, plan=plan, per_row=True)
    assert len(per_row) == 2 * 4 * 3 * 10 and per_row["query_pos"].min() == 110
    with attnprobe.capture(attn, keep=("stats",)) as stats:
        attn(torch.randn(1, 12, 16))
    with pytest.raises(EvictionError, match=r"eviction=attnprobe\.EvictionPlan"):
        eviction_profile(stats)


def test_bad_plans_say_what_to_change():
    with pytest.raises(EvictionPlanError, match="policies must be some of"):
        EvictionPlan(policies=("lru",))
    with pytest.raises(EvictionPlanError, match="positive numbers of keys"):
        EvictionPlan(budgets=(0, 4))
    with pytest.raises(EvictionPlanError, match="odd kernel"):
        EvictionPlan(kernel=4)
    assert EvictionPlan(budgets=(64, 8, 8)).budgets == (8, 64)
    assert not math.isnan(EvictionPlan().recent)
