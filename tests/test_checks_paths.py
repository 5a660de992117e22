"""Every code path of the ``range``, ``finite`` and ``causal`` checks, on records built the way adapters
build them: each path fires on a broken record and stays quiet on the correct one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from checks_helpers import causal_allowed, reference_record

import attnprobe

B, H, T, D = 2, 2, 6, 4
PAD = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])  # left padding in batch row 0


def record(*, tq=T, tk=T, offset=0, window=None, padding=None, causal=True, **fields):
    """A correct self-attention record of ``tq`` queries at key index ``offset`` of ``tk`` keys."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(B, H, tq, D, generator=g),
        torch.randn(B, H, tk, D, generator=g),
        torch.randn(B, H, tk, D, generator=g),
    )
    allowed = causal_allowed(B, tq, tk, offset=offset, window=window, padding=padding)
    return reference_record(q, k, v, allowed=allowed, causal=causal, sliding_window=window, **fields)


def errors(result, check: str) -> list:
    return [v for v in result.errors if v.check == check]


def edited(rec, field: str, index: tuple, value: float):
    t = getattr(rec, field).clone()
    t[index] = value
    return replace(rec, **{field: t})


# --------------------------------------------------------------------------- range
def test_range_is_quiet_on_correct_weights():
    result = attnprobe.check(record(padding=PAD, query_padding=PAD == 0))
    assert result.coverage["range"] == 1 and not errors(result, "range")


@pytest.mark.parametrize("value, worst", [(1.25, 0.25), (-0.5, 0.5)])
def test_range_fires_on_a_weight_outside_zero_one(value, worst):
    bad = edited(record(), "weights", (1, 0, 3, 2), value)
    (v,) = errors(attnprobe.check(bad, checks=["range"]), "range")
    assert (v.layer, v.head, v.batch, v.queries, v.count) == (0, 0, 1, (3,), 1)
    assert v.worst == pytest.approx(worst) and "outside [0, 1]" in v.message


def test_range_leaves_padded_rows_and_nan_to_other_checks():
    rec = record(padding=PAD, query_padding=PAD == 0)
    padded_row = edited(rec, "weights", (0, 1, 0, 0), 3.0)  # query 0 of batch 0 is padding
    assert not errors(attnprobe.check(padded_row, checks=["range"]), "range")
    nan = edited(rec, "weights", (1, 1, 2, 0), math.nan)
    result = attnprobe.check(nan, checks=["range", "finite"])
    assert not errors(result, "range") and errors(result, "finite")


# --------------------------------------------------------------------------- finite
def test_finite_is_quiet_on_correct_records_with_minus_inf_masked_scores():
    rec = record(padding=PAD, query_padding=PAD == 0)
    masked = replace(rec, scores=rec.scores.masked_fill(~rec.allowed, -math.inf))  # scores as masked_fill leaves them
    for r in (rec, masked, replace(masked, allowed=None)):
        result = attnprobe.check(r, checks=["finite"])
        assert result.coverage["finite"] == 1 and result.violations == ()


@pytest.mark.parametrize(
    "field, index, value, message",
    [
        ("weights", (1, 0, 2, 1), math.nan, "NaN/inf weight(s) in real query rows"),
        ("weights", (0, 1, 0, 0), math.nan, "NaN/inf weight(s) in padded or fully masked query rows"),
        ("output", (1, 1, 4, 0), math.inf, "NaN/inf output row(s) in real query rows"),
        ("output", (0, 0, 1, 2), math.nan, "NaN/inf output row(s) in padded or fully masked query rows"),
        ("scores", (1, 0, 3, 1), math.nan, "NaN/inf score(s) at allowed positions"),
        ("scores", (1, 0, 3, 2), -math.inf, "NaN/inf score(s) at allowed positions"),
    ],
)
def test_finite_fires_on_nan_and_inf(field, index, value, message):
    bad = edited(record(padding=PAD, query_padding=PAD == 0), field, index, value)
    (v,) = errors(attnprobe.check(bad, checks=["finite"]), "finite")
    assert v.batch == index[0] and v.head == index[1] and v.queries == (index[2],)
    assert message in v.message


def test_finite_without_a_mask_counts_nan_and_plus_inf_scores_only():
    rec = replace(record(), allowed=None)
    minus = edited(rec, "scores", (0, 0, 1, 3), -math.inf)  # may be how the scores were masked
    assert attnprobe.check(minus, checks=["finite"]).violations == ()
    plus = edited(rec, "scores", (0, 0, 1, 3), math.inf)
    assert [v.keys for v in errors(attnprobe.check(plus, checks=["finite"]), "finite")] == [(3,)]
    # declared causal: query 1 may not attend key 3, so -inf there is fine; at an allowed key it is not
    assert attnprobe.check(minus, checks=["finite"], causal=True).violations == ()
    allowed_minus = edited(rec, "scores", (0, 0, 3, 1), -math.inf)
    assert errors(attnprobe.check(allowed_minus, checks=["finite"], causal=True), "finite")


# --------------------------------------------------------------------------- causal: prefill
def leak(rec, batch=1, head=0, query=2, key=4, weight=0.3):
    """Move ``weight`` of a row onto a key the mask forbids (the row still sums to one)."""
    w = rec.weights.clone()
    w[batch, head, query] *= 1 - weight
    w[batch, head, query, key] += weight
    return replace(rec, weights=w, scores=None, output=None)


def test_causal_quiet_on_correct_prefill_with_padding():
    rec = record(padding=PAD, query_padding=PAD == 0)
    for declared in ({}, {"causal": True}, {"causal": True, "attention_mask": PAD}):
        result = attnprobe.check(rec, **declared)
        assert result.coverage["causal"] == 1 and result.violations == (), result.table()


def test_causal_fires_on_weight_after_the_query():
    (v,) = errors(attnprobe.check(leak(record())), "causal")
    assert (v.batch, v.head, v.queries, v.keys, v.count) == (1, 0, (2,), (4,), 1)
    assert v.worst == pytest.approx(0.3) and "the module says it is causal" in v.message


def test_causal_without_weights_reads_the_mask():
    rec = replace(record(), weights=None, output=None)
    assert attnprobe.check(rec, checks=["causal"]).violations == ()
    allowed = rec.allowed.clone()
    allowed[0, 0, 1, 3] = True  # the mask lets query 1 see key 3
    (v,) = errors(attnprobe.check(replace(rec, allowed=allowed), checks=["causal"]), "causal")
    assert v.queries == (1,) and v.keys == (3,) and "no weights captured" in v.message and v.head is None


def test_causal_fires_when_a_query_may_not_attend_itself():
    """One row that may not attend its own key while the others may attend theirs is what a mask that selects keys
    does (top-k sparse attention): reported as information; every row at once is a causal mask shifted by one."""
    rec = record()
    allowed = rec.allowed.clone()
    allowed[1, 0, 3, 3] = False
    result = attnprobe.check(replace(rec, allowed=allowed), checks=["causal"])
    (v,) = result.violations
    assert v.severity == "info" and v.batch == 1 and v.queries == (3,) and "may not attend their own" in v.message
    shifted = rec.allowed & torch.ones(T, T, dtype=torch.bool).tril(-1)
    found = errors(attnprobe.check(replace(rec, allowed=shifted), checks=["causal"]), "causal")
    assert {v.batch for v in found} == {0, 1}
    assert all(v.queries == tuple(range(1, T)) and "shifted by one" in v.message for v in found), found


def test_declared_bidirectional_fires_only_when_every_later_key_is_masked():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    full = reference_record(q, k, v, allowed=torch.ones(B, 1, T, T, dtype=torch.bool), causal=False)
    assert attnprobe.check(full, causal=False).violations == ()
    assert attnprobe.check(full).coverage["causal"] == 0  # a bidirectional record: nothing to hold it to
    (v,) = errors(attnprobe.check(record(), causal=False), "causal")
    assert v.head is None and v.batch is None and "declared causal=False" in v.message


def test_declared_causal_fires_on_a_bidirectional_record():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    full = reference_record(q, k, v, allowed=torch.ones(B, 1, T, T, dtype=torch.bool), causal=False)
    found = errors(attnprobe.check(full, causal=True), "causal")
    assert found and all("declared causal=True" in v.message for v in found)
    assert {v.keys for v in found} == {(1, 2, 3, 4, 5)}


# --------------------------------------------------------------------------- causal: sliding window
def test_sliding_window_quiet_when_respected_and_fires_on_older_keys():
    good = record(window=3, padding=PAD, query_padding=PAD == 0)
    assert attnprobe.check(good, causal=True, attention_mask=PAD).violations == ()
    (v,) = errors(attnprobe.check(leak(good, query=5, key=1)), "causal")
    assert v.queries == (5,) and v.keys == (1,) and "older than the sliding window of 3" in v.message


def test_sliding_window_without_weights_reads_the_mask():
    rec = replace(record(window=2), weights=None, output=None)
    assert attnprobe.check(rec, checks=["causal"]).violations == ()
    allowed = rec.allowed.clone()
    allowed[0, 0, 4, 1] = True
    (v,) = errors(attnprobe.check(replace(rec, allowed=allowed), checks=["causal"]), "causal")
    assert v.queries == (4,) and v.keys == (1,) and "older than the sliding window of 2" in v.message


# --------------------------------------------------------------------------- causal: KV-cache steps
def test_decode_step_with_the_whole_cache():
    step = record(tq=1, tk=5, offset=4, query_offset=4, step=2)
    assert attnprobe.check(step, causal=True).violations == ()
    # a static cache padded past the query: keys after the query's position are the future
    static = record(tq=1, tk=8, offset=4, query_offset=4, step=2)
    assert attnprobe.check(static, causal=True).violations == ()
    (v,) = errors(attnprobe.check(leak(static, query=0, key=6), causal=True), "causal")
    assert v.queries == (4,) and v.keys == (6,) and v.step == 2


def test_sliding_window_cache_reports_key_positions_not_slots():
    """A cache of 4 slots at query 9 holds positions 6..9; with a window of 3, position 6 is too old."""
    step = record(tq=1, tk=4, offset=3, window=3, query_offset=9, step=4)
    assert attnprobe.check(step, causal=True).violations == ()
    (v,) = errors(attnprobe.check(leak(step, query=0, key=0), causal=True), "causal")
    assert v.queries == (9,) and v.keys == (6,) and "older than the sliding window of 3" in v.message
    padding = torch.tensor([[1] * 6 + [0] + [1] * 3, [1] * 10])  # position 6 is padding in batch row 0
    (p,) = errors(attnprobe.check(leak(step, batch=0, query=0, key=0), attention_mask=padding), "padding")
    assert p.batch == 0 and p.keys == (6,) and p.queries == (9,)


def test_more_queries_than_keys_is_skipped_and_said():
    rec = record(tq=4, tk=3, offset=-1)
    result = attnprobe.check(replace(rec, allowed=torch.ones(B, 1, 4, 3, dtype=torch.bool)))
    assert any(s.startswith("causal: query positions unknown") for s in result.skipped)


def test_cross_attention_is_not_held_to_causality():
    cross = replace(leak(record()), kind="cross", causal=False)
    result = attnprobe.check(cross, causal=True)
    assert result.coverage["causal"] == 0 and not errors(result, "causal")
