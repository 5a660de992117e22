"""Invariant checks on records built the way adapters build them (grouped-query attention, sinks,
KV-cache steps, sliding windows, eager's uniform rows, position bias, softcap), the lint contract,
what is skipped and warned, and the result object."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import pytest
import torch
from checks_helpers import BuggyAttention, capture_one, causal_allowed, reference_record

import attnprobe
from attnprobe import AttentionRecord, CheckResult, InvariantError, MultiHeadAttention, Violation
from attnprobe.probe.checks import CHECK_DESCRIPTIONS, MAX_GROUPS, tolerance
from attnprobe.probe.checks.violations import FRAME_COLUMNS, MAX_POSITIONS

B, H, KV, T, D = 2, 4, 2, 6, 8
PAD = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # left padding in batch row 0


def qkv(heads=H, kv=KV, tokens=T, dtype=torch.float32):
    return (
        torch.randn(B, heads, tokens, D, dtype=dtype),
        torch.randn(B, kv, tokens, D, dtype=dtype),
        torch.randn(B, kv, tokens, D, dtype=dtype),
    )


def causal_record(**kw) -> AttentionRecord:
    q, k, v = qkv()
    return reference_record(
        q, k, v, allowed=causal_allowed(B, T, T, padding=PAD), causal=True, query_padding=PAD == 0, **kw
    )


def error_checks(result) -> set[str]:
    return {v.check for v in result.errors}


# --------------------------------------------------------------------------- grouped-query attention
def test_grouped_query_output_uses_the_right_kv_head():
    result = attnprobe.check(causal_record())
    assert result.violations == () and result.coverage["output_match"] == 1


def test_wrong_grouped_query_head_mapping_is_caught_by_output_match():
    result = attnprobe.check(causal_record(wrong_kv_mapping=True))
    assert error_checks(result) == {"output_match"}
    # heads 0..3 should read kv heads 0,0,1,1; the bug reads 0,1,0,1: heads 1 and 2 are wrong
    assert {v.head for v in result.errors} == {1, 2} and {v.batch for v in result.errors} == {0, 1}
    assert all("wrong kv head" in v.message for v in result.errors)


def test_grouped_query_head_selection_maps_model_head_numbers():
    cap = attnprobe.Capture([causal_record(wrong_kv_mapping=True)])
    sub = cap.select(heads=[2, 3])  # kv head 1 only
    assert sub[0].kv_heads == (1,) and sub[0].v.shape[1] == 1
    assert {v.head for v in attnprobe.check(sub).errors} == {2}
    missing = replace(sub[0], kv_heads=(0,))  # claims another kv head than the one stored
    assert any(s.startswith("output_match: the kv heads") for s in attnprobe.check(missing).skipped)


# --------------------------------------------------------------------------- Hugging Face-style records
def test_sinks_lower_the_row_sum_and_are_accounted_for():
    rec = causal_record(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    sums = rec.weights.sum(-1)[1]
    assert (sums < 1 - 1e-3).all()  # the sink takes mass from every row
    assert attnprobe.check(rec).violations == ()
    ignored = replace(rec, weights=causal_record().weights)  # weights computed as if there were no sink
    assert {"row_sum", "softmax_match"} <= error_checks(attnprobe.check(ignored))
    no_scores = replace(rec, scores=None)
    result = attnprobe.check(no_scores)
    assert any(s.startswith("row_sum: the record has attention sinks") for s in result.skipped)


def test_expected_row_sums_is_what_rows_with_sinks_sum_to():
    """The one rule for sink row sums (shared by row_sum and anything reporting row-sum errors)."""
    from attnprobe.probe.engine.sinks import expected_row_sums

    rec = causal_record(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    expected = expected_row_sums(rec)
    assert expected.shape == (B, H, T)
    real = ~rec.query_padding[:, None, :].expand(B, H, T)
    torch.testing.assert_close(rec.weights.sum(-1)[real], expected[real])
    assert bool((expected[real] < 1 - 1e-3).all())  # the sinks take a visible share
    assert expected_row_sums(causal_record()) == 1.0
    assert expected_row_sums(replace(rec, scores=None)) is None


def test_position_bias_and_softcap_live_in_the_scores():
    bias = torch.randn(1, H, T, T)  # T5-style: added to the scores before the mask
    assert attnprobe.check(causal_record(bias=bias)).violations == ()
    assert attnprobe.check(causal_record(softcap=2.0)).violations == ()


def test_eager_uniform_rows_without_query_padding_are_left_out():
    """Eager's finfo.min mask gives padded rows with no allowed key uniform weights over forbidden keys."""
    q, k, v = qkv()
    rec = reference_record(q, k, v, allowed=causal_allowed(B, T, T, padding=PAD), causal=True, uniform_empty_rows=True)
    assert torch.allclose(rec.weights[0, :, 0], torch.full((H, T), 1 / T))
    result = attnprobe.check(rec)
    assert result.ok
    (empty,) = result.violations
    assert empty.check == "empty_rows" and empty.severity == "info"
    assert empty.batch == 0 and empty.head is None and empty.queries == (0, 1)
    # declaring the input mask marks those rows as padding: nothing left to report
    assert attnprobe.check(rec, attention_mask=PAD).violations == ()


def test_kv_cache_decode_step_uses_the_query_offset():
    q, k, v = qkv()
    step = reference_record(
        q[:, :, 5:], k, v, allowed=causal_allowed(B, 1, T, offset=5, padding=PAD), causal=True, query_offset=5, step=3
    )
    result = attnprobe.check(step, causal=True, attention_mask=PAD)
    assert result.violations == () and result.coverage["causal"] == result.coverage["padding"] == 1
    # a two-query step (speculative decoding) whose mask lets query 4 see key 5
    leaky = reference_record(
        q[:, :, 4:], k, v, allowed=causal_allowed(B, 2, T, offset=5, padding=PAD), causal=True, query_offset=4, step=2
    )
    causal = [v for v in attnprobe.check(leaky).errors if v.check == "causal"]
    assert causal and all(v.queries == (4,) and v.keys == (5,) and v.step == 2 for v in causal)
    assert "step 2" in causal[0].where()


def test_right_padding_without_query_padding_is_not_a_shifted_mask():
    """A right-padded causal record that does not mark its padded queries (a direct sdpa call): the padded
    queries may not attend their own (padded) key, which is padding, not a mask shifted by one."""
    q, k, v = qkv()
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    rec = reference_record(q, k, v, allowed=causal_allowed(B, T, T, padding=right), causal=True)
    assert rec.query_padding is None
    assert attnprobe.check(rec).violations == () and attnprobe.check(rec, causal=True).violations == ()
    # a mask shifted by one (tril(-1)) still fails on every row, the last one included
    shifted = causal_allowed(B, T, T, offset=-1)
    bad = reference_record(q, k, v, allowed=shifted, causal=True)
    causal = [v for v in attnprobe.check(bad).errors if v.check == "causal"]
    assert causal and all(v.queries == (1, 2, 3, 4, 5) and "own position" in v.message for v in causal)
    # ... and so does a right-padded one: the rows that miss a real own key give the shift away
    bad_right = reference_record(q, k, v, allowed=causal_allowed(B, T, T, offset=-1, padding=right), causal=True)
    causal = {v.batch: v.queries for v in attnprobe.check(bad_right).errors if v.check == "causal"}
    assert causal == {0: (1, 2, 3, 4, 5), 1: (1, 2, 3, 4, 5)}


def test_a_sparse_causal_mask_that_drops_a_rows_own_key_is_not_a_shifted_mask():
    """A causal mask that keeps each row's top keys (Doge's dynamic mask, top-k sparse attention) may drop a row's
    own key along with older ones: a hole inside the row's range says it selects keys, not that the causal mask is
    shifted by one. A future key is still caught, and a shifted mask whose rows have no hole still fails."""
    q, k, v = qkv()
    sparse = causal_allowed(B, T, T).clone()
    sparse[:, :, 4, [1, 4]] = False  # row 4 keeps keys 0, 2, 3: its own key and key 1 dropped
    sparse[:, :, 5, [0, 2]] = False
    rec = reference_record(q, k, v, allowed=sparse, causal=True)
    for declared in ({}, {"causal": True}):
        found = attnprobe.check(rec, **declared).violations
        assert found and all(v.severity == "info" and v.queries == (4,) for v in found), found  # row 4's own key
    ahead = sparse.clone()
    ahead[:, :, 2, 3] = True  # one future key: caught whatever the holes
    causal = list(attnprobe.check(reference_record(q, k, v, allowed=ahead, causal=True)).errors)
    assert causal and all(v.check == "causal" and v.queries == (2,) for v in causal), causal
    shifted = causal_allowed(B, T, T, offset=-1).clone()
    shifted[:, :, 5, 4] = False  # a row's range ending early leaves no hole inside it: still read as the shift
    causal = list(attnprobe.check(reference_record(q, k, v, allowed=shifted, causal=True)).errors)
    assert causal and all("own position" in v.message and v.queries == (1, 2, 3, 4, 5) for v in causal), causal


def test_declared_mask_longer_than_a_cache_step_is_sliced():
    q, k, v = qkv()
    prefix = reference_record(
        q[:, :, :4], k[:, :, :4], v[:, :, :4], allowed=causal_allowed(B, 4, 4, padding=PAD[:, :4]), causal=True
    )
    assert attnprobe.check(prefix, causal=True, attention_mask=PAD).coverage["padding"] == 1


def test_sliding_window_is_checked_with_causality():
    q, k, v = qkv()
    good = reference_record(
        q,
        k,
        v,
        allowed=causal_allowed(B, T, T, window=3, padding=PAD),
        causal=True,
        sliding_window=3,
        query_padding=PAD == 0,
    )
    assert attnprobe.check(good, causal=True, attention_mask=PAD).violations == ()
    leak = replace(good, weights=causal_record().weights, output=None, scores=None)
    windows = [v for v in attnprobe.check(leak, causal=True).errors if "sliding window of 3" in v.message]
    assert windows and {v.keys for v in windows if v.batch == 1} == {(0, 1, 2)}
    # a decode step against a sliding-window cache that dropped old keys: the queries are the last keys
    compressed = reference_record(
        q[:, :, 5:],
        k[:, :, 3:],
        v[:, :, 3:],
        allowed=torch.ones(B, 1, 1, 3, dtype=torch.bool),
        causal=True,
        query_offset=5,
        sliding_window=3,
    )
    assert attnprobe.check(compressed, causal=True).ok


def test_cpu_sdpa_zero_rows_and_stitched_generation_records_pass():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    cap = capture_one(attn, torch.randn(2, 6, 8), attention_mask=PAD)
    full = cap[0]
    steps = [
        replace(
            full,
            step=0,
            query_offset=0,
            q=full.q[:, :, :3],
            k=full.k[:, :, :3],
            v=full.v[:, :, :3],
            scores=full.scores[:, :, :3, :3],
            weights=full.weights[:, :, :3, :3],
            output=full.output[:, :, :3],
            allowed=full.allowed[:, :, :3, :3],
            query_padding=full.query_padding[:, :3],
        )
    ]
    for t in range(3, 6):
        steps.append(
            replace(
                full,
                step=t - 2,
                call=t - 2,
                query_offset=t,
                q=full.q[:, :, t : t + 1],
                k=full.k[:, :, : t + 1],
                v=full.v[:, :, : t + 1],
                scores=full.scores[:, :, t : t + 1, : t + 1],
                weights=full.weights[:, :, t : t + 1, : t + 1],
                output=full.output[:, :, t : t + 1],
                allowed=full.allowed[:, :, t : t + 1, : t + 1],
                query_padding=full.query_padding[:, t : t + 1],
            )
        )
    assert attnprobe.check(attnprobe.Capture(steps), causal=True, attention_mask=PAD).violations == ()
    stitched = attnprobe.stitch(attnprobe.Capture(steps))
    assert stitched[0].scores.isnan().any()  # keys not computed yet at a step
    assert attnprobe.check(stitched, causal=True, attention_mask=PAD).violations == ()


def test_bf16_eager_with_weights_recomputed_in_fp32_is_not_a_false_positive():
    """The adapter recomputes weights in fp32 from bf16 q and k; eager rounded its scores to bf16 first."""
    torch.manual_seed(1)
    q, k, v = (t * 3 for t in qkv(dtype=torch.bfloat16))
    allowed = causal_allowed(B, T, T, padding=PAD)
    k_h, v_h = k[:, torch.arange(H) // 2], v[:, torch.arange(H) // 2]
    eager_scores = (q @ k_h.transpose(-2, -1)) * D**-0.5  # bf16 matmul
    mask = torch.zeros(B, 1, T, T, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
    eager_weights = torch.softmax((eager_scores + mask).float(), -1).to(torch.bfloat16)
    eager_output = eager_weights @ v_h
    scores = (q.float() @ k_h.float().transpose(-2, -1)) * D**-0.5
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    rec = AttentionRecord(
        name="attn",
        layer=0,
        call=0,
        kind="self",
        num_heads=H,
        num_kv_heads=KV,
        heads=tuple(range(H)),
        kv_heads=(0, 1),
        q=q,
        k=k,
        v=v,
        scores=scores.bfloat16(),
        weights=weights.bfloat16(),
        output=eager_output,
        allowed=allowed,
        query_padding=PAD == 0,
        causal=True,
        dtype=torch.bfloat16,
        backend="eager",
        weights_source="recomputed",
    )
    result = attnprobe.check(rec, causal=True, attention_mask=PAD)
    assert result.violations == (), result.table()
    assert tolerance(torch.bfloat16, torch.float32).rtol > tolerance(torch.float32).rtol


# --------------------------------------------------------------------------- lint contract
def lint(check: str, layer: int = 0) -> Violation:
    return Violation(check=check, severity="warning", name="attn", layer=layer, message=f"{check} found")


def test_lint_findings_from_capture_time_are_part_of_the_result():
    rec = replace(causal_record(), meta={"lint": (lint("lint_unused_mask"), lint("lint_same_kv"))})
    result = attnprobe.check(rec)
    assert result.ok  # lint findings are warnings
    assert [v.check for v in result.violations] == ["lint_unused_mask", "lint_same_kv"]
    assert result.checks[-2:] == ("lint_unused_mask", "lint_same_kv") and result.coverage["lint_same_kv"] == 1
    assert [v.check for v in attnprobe.check(rec, checks=["lint"]).violations] == ["lint_unused_mask", "lint_same_kv"]
    only = attnprobe.check(rec, checks=["lint_same_kv"])
    assert [v.check for v in only.violations] == ["lint_same_kv"] and only.checks == ("lint_same_kv",)
    assert attnprobe.check(rec, checks=["causal"]).violations == ()
    assert result.filter(checks="lint").violations == result.violations


# --------------------------------------------------------------------------- skipped, warned, refused
def test_missing_fields_are_skipped_and_said():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    cap = capture_one(attn, torch.randn(1, 5, 8), options={"keep": ["weights"]})
    result = attnprobe.check(cap)
    assert result.ok and result.verified
    assert result.coverage["softmax_match"] == 0 and result.coverage["output_match"] == 0
    assert "softmax_match: no scores captured (1 record(s), layer 0)" in result.skipped
    assert "output_match: no v or output captured (1 record(s), layer 0)" in result.skipped
    assert "skipped (not verified):" in result.table()
    unknown = replace(cap[0], causal=None)
    assert any(s.startswith("causal: the record does not say") for s in attnprobe.check(unknown).skipped)


def test_weights_requested_from_a_backend_that_returns_none_warns():
    rec = replace(causal_record(), weights=None, weights_source="none", backend="sdpa")
    cap = attnprobe.Capture([rec], {"selection": {"keep": ("q", "k", "v", "scores", "weights", "output")}})
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"weights were asked for.*backend: sdpa.*eager"):
        result = attnprobe.check(cap)
    assert result.coverage["row_sum"] == 0 and result.coverage["causal"] == 1  # the mask still says something
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not asked for: skipped quietly, but said in `skipped`
        quiet = attnprobe.check(attnprobe.Capture([rec], {"selection": {"keep": ("q",)}}))
    assert "row_sum: no weights captured (1 record(s), layer 0)" in quiet.skipped


def test_empty_capture_warns_and_verifies_nothing():
    with pytest.warns(attnprobe.AttnprobeWarning, match="nothing to check"):
        result = attnprobe.check(attnprobe.Capture([]))
    assert result.ok and not result.verified and "NOTHING WAS VERIFIED" in result.table()
    assert not result  # `assert attnprobe.check(cap)` must not pass on a capture that verified nothing
    with pytest.raises(InvariantError, match="NOTHING WAS VERIFIED"):
        result.raise_if_failed()
    with pytest.warns(attnprobe.AttnprobeWarning), pytest.raises(InvariantError, match="NOTHING WAS VERIFIED"):
        attnprobe.assert_invariants(attnprobe.Capture([]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"checks": ["causal", "casual"]}, ValueError, r"unknown check name\(s\) \['casual'\]"),
        ({"causal": "yes"}, TypeError, "causal must be True, False or None"),
        ({"causal": {1: 1}}, TypeError, "causal for layer 1"),
        ({"attention_mask": torch.ones(2, 1, 6, 6)}, ValueError, r"\(batch, key\).*got shape \(2, 1, 6, 6\)"),
        ({"attention_mask": torch.full((2, 6), 0.5)}, ValueError, "1 for real tokens and 0 for padding"),
        ({"attention_mask": torch.ones(3, 6)}, ValueError, r"attention_mask has batch 3 but the records have batch 2"),
        ({"attention_mask": torch.ones(2, 4)}, ValueError, r"shape \(2, 4\) fits none of the 1 record.*\(2, 6\)"),
        ({"attention_mask": torch.randint(3, 50, (2, 6))}, ValueError, r"got values .*not input_ids"),
        (
            {"attention_mask": torch.zeros(2, 6).masked_fill(PAD == 0, float("-inf"))},
            ValueError,
            "got values -inf, 0.*additive mask",
        ),
        ({"attention_mask": "1 1 0"}, TypeError, r"attention_mask must be the input padding mask.*got a str"),
        (
            {"attention_mask": {"input_ids": torch.ones(2, 6), "attention_mask": torch.ones(2, 6)}},
            TypeError,
            r"tokenizer's output: pass inputs\['attention_mask'\]",
        ),
        ({"attention_mask": torch.ones(2, 6, dtype=torch.complex64)}, TypeError, "got dtype torch.complex64"),
        ({"attention_mask": {"dec": torch.ones(2, 6)}}, TypeError, "integer layer numbers"),
        ({"attention_mask": {0: torch.full((2, 6), 2)}}, ValueError, r"attention_mask\[0\] must hold 1"),
        ({"causal": {"dec": True}}, TypeError, r"causal=\{layer: bool\} needs integer layer numbers"),
        ({"checks": []}, ValueError, r"checks=\[\] selects nothing"),
        ({"checks": 3}, TypeError, "checks must be a check name or a list"),
        ({"checks": ["causal", 3]}, ValueError, r"unknown check name\(s\) \[3\]"),
        ({"atol": -1}, ValueError, "atol must be a non-negative finite number"),
        ({"atol": float("nan")}, ValueError, "atol must be a non-negative finite number"),
        ({"rtol": float("inf")}, ValueError, "rtol must be a non-negative finite number"),
        ({"atol": True}, ValueError, "atol must be a non-negative finite number"),
        ({"atol": "1e-3"}, ValueError, "atol must be a non-negative finite number"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        attnprobe.check(causal_record(), **kwargs)


def test_well_formed_masks_of_every_kind_are_accepted():
    rec = causal_record()
    for mask in (PAD, PAD.bool(), PAD.float(), PAD.tolist(), PAD.numpy(), {0: PAD}):
        result = attnprobe.check(rec, attention_mask=mask)
        assert result.violations == () and result.coverage["padding"] == 1


def test_declarations_for_layers_no_record_has_warn():
    with pytest.warns(
        attnprobe.AttnprobeWarning, match=r"attention_mask was declared for layer\(s\) \[3\].*layers \[0\]"
    ):
        attnprobe.check(causal_record(), attention_mask={0: PAD, 3: PAD})
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"causal was declared for layer\(s\) \[1, 2\]"):
        attnprobe.check(causal_record(), causal={1: True, 2: True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnprobe.check(causal_record(), causal={0: True}, attention_mask={0: PAD})


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda r: {"weights": r.weights[:, :, :5]},
            r"the query sizes disagree \(6 in q, scores, output, allowed, "
            r"query_padding; 5 in weights\)",
        ),
        (
            lambda r: {"scores": r.scores[..., :4]},
            r"the key sizes disagree \(6 in k, v, weights, allowed; 4 in scores\)",
        ),
        (
            lambda r: {"weights": r.weights[:, :2], "output": r.output[:, :2]},
            r"the heads sizes disagree \(4 in heads, q, scores; 2 in weights, output\)",
        ),
        (
            lambda r: {"v": r.v[:1]},
            r"the batch sizes disagree \(2 in q, k, scores, weights, output, allowed, "
            r"query_padding; 1 in v\)",
        ),
        (lambda r: {"weights": r.weights[0]}, r"weights has shape \(4, 6, 6\), expected \(batch, heads, query, key\)"),
        (lambda r: {"k": r.k[..., :4]}, r"the d_qk sizes disagree \(8 in q; 4 in k\)"),
        (
            lambda r: {"sinks": torch.zeros(3)},
            r"the heads sizes disagree \(4 in heads, q, scores, weights, output; 3 in sinks\)",
        ),
        (lambda r: {"query_padding": [[False] * 6] * 2}, r"query_padding is a list, not a tensor"),
    ],
)
def test_a_record_with_inconsistent_shapes_is_a_clear_error(change, match):
    good = causal_record()
    bad = replace(good, **change(good))
    with pytest.raises(ValueError, match=match) as err:
        attnprobe.check([good, bad])
    message = str(err.value)
    assert message.startswith("record 1 ('attn', layer 0, call 0) has inconsistent tensors: ")
    assert "dataclasses.replace must change every field together" in message


def test_not_a_capture_is_a_clear_error():
    with pytest.raises(TypeError, match="takes a Capture, an AttentionRecord or a list of records"):
        attnprobe.check(torch.randn(2, 2))
    with pytest.raises(TypeError, match="capture first"):
        attnprobe.check([causal_record(), "not a record"])


def test_declared_mask_per_layer_and_mismatches_are_skipped_not_guessed():
    rec = causal_record()
    cross = replace(causal_record(), layer=1, kind="cross", causal=False, query_padding=None)
    result = attnprobe.check([rec, cross], attention_mask={0: PAD, 1: PAD[:, :5]})
    assert any("cross-attention has 6 keys" in s and "layer 1" in s for s in result.skipped)
    assert result.coverage["padding"] == 1  # a declaration that does not fit is not replaced by a guess


# --------------------------------------------------------------------------- tolerances
def test_atol_loosens_the_forbidden_weight_threshold():
    rec = causal_record()
    leak = rec.weights.clone()
    leak[1, 0, 0, 1] = 1e-4  # a tiny weight on a future key
    leaky = replace(rec, weights=leak, output=None, scores=None)
    assert "causal" in error_checks(attnprobe.check(leaky))
    assert "causal" not in error_checks(attnprobe.check(leaky, atol=1e-3))


def test_tolerance_follows_the_coarsest_dtype():
    assert tolerance(torch.float32).atol < tolerance(torch.float16).atol < tolerance(torch.bfloat16).atol
    assert tolerance(torch.float32, torch.bfloat16) == tolerance(torch.bfloat16)
    assert tolerance(torch.float32, atol=0.5).forbidden == 0.5 and tolerance(torch.float32).forbidden == 1e-6
    assert tolerance(torch.bfloat16).row_sum == pytest.approx(4e-3 + 2**-7)  # atol + 2 * unit roundoff


# --------------------------------------------------------------------------- result object
def test_positions_are_capped_and_counted():
    attn = BuggyAttention(8, num_heads=1, bug="mask_not_applied")
    cap = capture_one(attn, torch.randn(1, 20, 8), attention_mask=torch.tensor([[1] * 10 + [0] * 10]))
    (v,) = [v for v in attnprobe.check(cap).errors if v.check == "padding"]
    assert len(v.queries) == len(v.keys) == MAX_POSITIONS and v.count == 10 * 10
    assert v.queries == tuple(range(MAX_POSITIONS)) and v.keys == tuple(range(10, 10 + MAX_POSITIONS))
    assert v.query_count == v.key_count == 10
    table = attnprobe.check(cap).table()
    assert "0,1,2,3,4,5,6,7,... of 10" in table and "10,11,12,13,14,15,16,17,... of 10" in table


def test_a_complete_position_list_is_not_marked_as_capped():
    """Exactly MAX_POSITIONS offending queries, more offending cells than that: the list is whole."""
    attn = BuggyAttention(8, num_heads=1, bug="mask_not_applied")
    mask = torch.tensor([[1] * MAX_POSITIONS + [0] * 3])
    cap = capture_one(attn, torch.randn(1, MAX_POSITIONS + 3, 8), attention_mask=mask)
    (v,) = [v for v in attnprobe.check(cap).errors if v.check == "padding"]
    assert v.count == MAX_POSITIONS * 3 and v.query_count == MAX_POSITIONS and v.key_count == 3
    line = next(line for line in attnprobe.check(cap).table().splitlines() if line.startswith("padding "))
    assert re.search(r" 0,1,2,3,4,5,6,7 +8,9,10 ", line) and "..." not in line, line
    frame = attnprobe.check(cap).to_frame()
    assert frame.loc[frame["check"] == "padding", "query_count"].tolist() == [MAX_POSITIONS]


def test_table_names_the_module_of_each_layer():
    leaky = causal_record()
    w = leaky.weights.clone()
    w[1, :, 0, 1] = 0.5  # query 0 puts weight on key 1
    records = [replace(leaky, weights=w, output=None, scores=None, layer=i, name=f"blocks.{i}.attn") for i in range(8)]
    table = attnprobe.check(records, checks=["causal"]).table()
    assert (
        "  causal: 32 errors in layer(s) 0 (blocks.0.attn), 1 (blocks.1.attn), 2 (blocks.2.attn), "
        "3 (blocks.3.attn), 4 (blocks.4.attn), 5 (blocks.5.attn), ... (8 layers)"
    ) in table.splitlines()


def test_many_broken_batch_rows_are_summed_per_head():
    attn = BuggyAttention(8, num_heads=2, causal=True, bug="causal_plus_one")
    cap = capture_one(attn, torch.randn(MAX_GROUPS, 4, 8))
    causal = [v for v in attnprobe.check(cap).errors if v.check == "causal"]
    assert [(v.head, v.batch) for v in causal] == [(0, None), (1, None)]
    assert causal[0].count == MAX_GROUPS * 3 and causal[0].queries == (0, 1, 2) and causal[0].keys == (1, 2, 3)


def test_result_table_frame_filter_and_raise():
    torch.manual_seed(0)
    attn = BuggyAttention(8, num_heads=2, causal=True, bug="causal_plus_one")
    cap = capture_one(attn, torch.randn(2, 5, 8))
    result = attnprobe.check(cap, causal=True)
    assert not result and len(result) == 4 and result.counts()["causal"] == 4
    table = result.table()
    assert table.startswith("4 error(s), 0 other finding(s) in 1 record(s)")
    assert "  causal: 4 errors in layer(s) 0" in table
    assert "layer 0 head 1 batch 1" in table and "0,1,2,3" in table
    frame = result.to_frame()
    assert list(frame.columns) == list(FRAME_COLUMNS) and len(frame) == 4
    assert str(frame["layer"].dtype) == "Int64" and str(frame["worst"].dtype) == "float64"
    assert sorted(frame["head"].tolist()) == [0, 0, 1, 1] and set(frame["check"]) == {"causal"}
    assert len(result.filter(heads=[1])) == 2 and len(result.filter(severity="info")) == 0
    assert result.filter(layers=[3]).ok
    with pytest.raises(ValueError, match="severity"):
        result.filter(severity="fatal")
    with pytest.raises(InvariantError) as err:
        result.raise_if_failed()
    assert str(err.value) == table and err.value.result is result
    assert repr(result).startswith("<CheckResult 4 error(s)")
    assert CheckResult().ok and not CheckResult().verified
    assert set(CHECK_DESCRIPTIONS) == set(attnprobe.CHECKS)


@pytest.mark.parametrize("bug", ["mask_not_applied", "causal_minus_one", "nan_rows", "doubled_scale", None])
def test_checking_in_row_chunks_gives_the_same_result(bug, monkeypatch):
    """Long captures are checked a few query rows at a time; the result does not depend on the chunking."""
    from attnprobe.probe import checks

    torch.manual_seed(0)
    attn = BuggyAttention(8, num_heads=2, causal=True, bug=bug)
    cap = capture_one(
        attn, torch.randn(3, 9, 8), attention_mask=torch.tensor([[0, 0] + [1] * 7, [1] * 9, [1] * 7 + [0] * 2])
    )
    whole = [attnprobe.check(cap), attnprobe.check(cap, causal=False)]
    monkeypatch.setattr(checks, "CHUNK_ELEMENTS", 3 * 2 * 9 * 2)  # two query rows per chunk
    chunked = [attnprobe.check(cap), attnprobe.check(cap, causal=False)]
    assert chunked == whole
    assert bug is None or not whole[0].ok


def test_result_and_error_pickle():
    import pickle

    attn = BuggyAttention(8, num_heads=1, causal=True, bug="causal_plus_one")
    result = attnprobe.check(capture_one(attn, torch.randn(1, 4, 8)))
    copy = pickle.loads(pickle.dumps(result))
    assert copy == result and copy.coverage == result.coverage and copy.table() == result.table()
    error = pickle.loads(pickle.dumps(InvariantError(result)))
    assert isinstance(error, AssertionError) and str(error) == result.table() and error.result == result


def test_violation_rejects_unknown_severity():
    with pytest.raises(ValueError, match="severity"):
        Violation(check="x", severity="fatal", name="", layer=0)
