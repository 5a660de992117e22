"""Comparing two captures of the same model and input: the per-head table and the diff report."""

from __future__ import annotations

import math

import pytest
import torch
from reports_helpers import Stack, stack_capture, words

from attnprobe import AttnprobeError
from attnprobe.reports import compare, diff_html
from attnprobe.reports.diff import COMPARE_SCHEMA


def pair(assert_no_hooks, change=None, **options):
    torch.manual_seed(0)
    model = Stack(2, heads=3).eval()
    before = stack_capture(assert_no_hooks, model=model, length=6, batch=2, **options)
    if change is not None:
        with torch.no_grad():
            change(model)
    after = stack_capture(assert_no_hooks, model=model, length=6, batch=2, **options)
    return before, after


def test_identical_captures_do_not_differ(assert_no_hooks):
    before, after = pair(assert_no_hooks)
    frame = compare(before, after)
    assert list(frame.columns) == list(COMPARE_SCHEMA)
    assert {c: str(t) for c, t in frame.dtypes.items()} == COMPARE_SCHEMA
    assert len(frame) == 6 and not frame["changed"].any()
    assert (frame["max_abs_weight_diff"] == 0).all() and (frame["max_abs_score_diff"] == 0).all()
    assert (frame["argmax_agreement"] == 1).all() and (frame["mask_changed"] == 0).all()


def test_the_changed_head_is_found_and_measured(assert_no_hooks):
    def scale_head_1_of_layer_1(model):
        model.layers[1].q_proj.weight[4:8] *= 3  # d_head 4: rows 4..7 are head 1

    before, after = pair(assert_no_hooks, scale_head_1_of_layer_1)
    frame = compare(before, after)
    changed = frame[frame["changed"]]
    assert list(zip(changed["layer"], changed["head"])) == [(1, 1)]
    row = changed.iloc[0]
    w0, w1 = before[1].weights[:, 1].double(), after[1].weights[:, 1].double()
    real = before[1].allowed.any(-1)[:, 0] & ~before[1].query_padding
    assert before[1].query_padding.any()  # padded rows exist and are left out
    assert row["max_abs_weight_diff"] == pytest.approx((w1 - w0).abs()[real].max().item())
    tvd = 0.5 * (w1 - w0).abs().sum(-1)
    assert row["mean_tvd"] == pytest.approx(tvd[real].mean().item())
    assert row["max_tvd"] == pytest.approx(tvd[real].max().item())
    assert 0 < row["mean_tvd"] <= row["max_tvd"] <= 1


def test_a_mask_change_counts_as_a_change(assert_no_hooks):
    torch.manual_seed(0)
    model = Stack(1, heads=2).eval()
    before = stack_capture(assert_no_hooks, model=model, length=6, batch=2, padded=False)
    after = stack_capture(assert_no_hooks, model=model, length=6, batch=2, padded=True)
    frame = compare(before, after)
    assert frame["changed"].all() and (frame["mask_changed"] > 0).all()


def test_storage_dtype_sets_the_default_tolerance(assert_no_hooks):
    before, _ = pair(assert_no_hooks)
    _, low = pair(assert_no_hooks, dtype=torch.bfloat16)
    frame = compare(before, low)
    assert (frame["max_abs_weight_diff"] > 0).all()
    assert not frame["changed"].any()  # within bfloat16's tolerance
    assert compare(before, low, atol=1e-7)["changed"].all()


def test_captures_of_different_things_are_refused(assert_no_hooks):
    before, _ = pair(assert_no_hooks)
    other = stack_capture(assert_no_hooks, layers=2, heads=3, length=5)
    with pytest.raises(AttnprobeError, match=r"the captures differ: layer 0 .* 2x6x6.* 2x5x5"):
        compare(before, other)
    with pytest.raises(AttnprobeError, match="hold 2 and 1 drawable records"):
        compare(before, before.select(layers=[0]))
    with pytest.raises(AttnprobeError, match="labels must be two strings"):
        diff_html(before, before, labels=("only one",))


def test_diff_report_ranks_heads_and_holds_both_captures(tmp_path, assert_no_hooks):
    def scale(model):  # head 0 of the last layer: nothing downstream changes
        model.layers[1].q_proj.weight[0:4] *= 2

    before, after = pair(assert_no_hooks, scale)
    document = diff_html(before, after, labels=("sdpa", "eager"), tokens=words(6))
    assert "sdpa" in document and "eager" in document and "1 of 6 heads changed" in document
    from test_reports_html import report_meta

    meta, _ = report_meta(document)
    assert meta["mode"] == "diff" and meta["labels"] == ["sdpa", "eager"]
    assert all(len(r["sources"]) == 2 for r in meta["records"])
    assert meta["changes"]["1-0"]["changed"] and not meta["changes"]["1-2"]["changed"]
    assert meta["thumbMax"] > 0
    path = diff_html(before, after, tmp_path / "d.html")
    with pytest.raises(FileExistsError):
        diff_html(before, after, path)
    assert not math.isnan(compare(before, after)["mean_tvd"].iloc[0])


def test_padded_query_rows_are_dont_care(assert_no_hooks):
    from dataclasses import replace

    import attnprobe

    before, _ = pair(assert_no_hooks)
    rec = before[0]
    assert rec.query_padding[0, :2].all()  # batch row 0 is left-padded by two positions
    weights = rec.weights.clone()
    weights[0, :, :2] = 1.0 / rec.key_len  # eager would give padded rows uniform weights, sdpa something else
    after = attnprobe.Capture([replace(rec, weights=weights)] + list(before)[1:], before.info)
    frame = compare(before, after)
    assert not frame["changed"].any() and (frame["max_abs_weight_diff"] == 0).all()
    weights[0, 1, 3, 4] += 0.5  # a real row: counted
    frame = compare(before, attnprobe.Capture([replace(rec, weights=weights)] + list(before)[1:], before.info))
    assert list(frame[frame["changed"]]["head"]) == [1] and frame["max_abs_weight_diff"].max() == pytest.approx(0.5)


def test_compare_works_one_matrix_at_a_time(assert_no_hooks, monkeypatch):
    from attnprobe.reports import diff

    seen = []
    original = diff._slice64

    def spy(t, batch, head):
        out = original(t, batch, head)
        seen.append(None if out is None else tuple(out.shape))
        return out

    monkeypatch.setattr(diff, "_slice64", spy)
    before, after = pair(assert_no_hooks)
    compare(before, after)
    assert seen and set(seen) == {(6, 6)}  # (query, key) of one head of one batch row, never a whole record


def test_nan_and_mismatched_quantities(assert_no_hooks):
    from dataclasses import replace

    from test_reports_html import report_meta

    import attnprobe

    before, _ = pair(assert_no_hooks, padded=False)
    rec = before[1]
    weights = rec.weights.clone()
    weights[1, 2, 4, 0] = float("nan")
    after = attnprobe.Capture([before[0], replace(rec, weights=weights)], before.info)
    frame = compare(before, after)
    row = frame[(frame["layer"] == 1) & (frame["head"] == 2)].iloc[0]
    assert row["changed"] and row["max_abs_weight_diff"] == math.inf
    assert frame["changed"].sum() == 1
    document = diff_html(before, after)  # strict JSON even with an infinite change
    meta, _ = report_meta(document)
    assert meta["changes"]["1-2"]["max_abs_weight_diff"] == math.inf and math.isfinite(meta["thumbMax"])
    assert document.index('href="#head-1-2"') < document.index('href="#head-0-0"')  # the changed head ranks first
    scores_only = attnprobe.Capture([replace(r, weights=None) for r in before], before.info)
    weights_only = attnprobe.Capture([replace(r, scores=None) for r in before], before.info)
    with pytest.raises(
        AttnprobeError, match=r"share neither weights nor scores .*before has weights, after has scores"
    ):
        compare(weights_only, scores_only)
    assert compare(scores_only, scores_only)["max_abs_score_diff"].eq(0).all()


def test_diff_of_different_shapes_is_refused_clearly(assert_no_hooks):
    before, _ = pair(assert_no_hooks)
    shorter = stack_capture(assert_no_hooks, layers=2, heads=3, length=5)
    with pytest.raises(AttnprobeError, match=r"the captures differ: layer 0 .* 2x6x6.* vs .* 2x5x5"):
        diff_html(before, shorter)
    fewer_heads = before.select(heads=[0, 1])
    with pytest.raises(AttnprobeError, match=r"heads \[0, 1, 2\].* heads \[0, 1\]"):
        compare(before, fewer_heads)
