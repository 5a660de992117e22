"""Lint warnings for hand-written attention: each fires on its broken variant and stays quiet on the correct one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch_helpers import ChunkedQKV, EinsumHeads, FusedSplit, Head, HeadList, leftovers

import attnprobe
from attnprobe.probe.checks.lint import LINT_CHECKS, head_merge_problem, lints, reshape_groups

X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))


def capture_lints(model, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with attnprobe.capture(model, modules=[model]) as cap:
            out = model(*args)
    assert torch.equal(out, model(*args)) and leftovers(model) == []
    found = [w for w in caught if issubclass(w.category, attnprobe.AttnprobeWarning)]
    return cap, found


@pytest.mark.parametrize(
    "check, broken",
    [
        ("lint_unused_mask", lambda: Head(bug="unused_mask")),
        ("lint_same_kv", lambda: Head(bug="same_kv")),
        ("lint_softmax_axis", lambda: Head(bug="softmax_axis")),
        ("lint_head_merge", lambda: FusedSplit(bug="head_merge")),
        ("lint_head_merge", lambda: EinsumHeads(merge="reshape")),
        ("lint_head_merge", lambda: EinsumHeads(merge="bqdh")),
    ],
)
def test_lint_fires_on_the_broken_variant(check, broken):
    model = broken().eval()
    cap, warned = capture_lints(model, X)
    (rec,) = cap
    (violation,) = rec.meta["lint"]
    assert violation.check == check and violation.severity == "warning"
    assert violation.layer == 0 and violation.call == 0 and violation.name == ""
    assert lints(cap) == (violation,)
    assert [str(w.message).split(":")[0] for w in warned] == [f"{check} in layer 0 ('')"]
    assert warned[0].filename == __file__  # the warning points at the user's code, not at attnprobe


@pytest.mark.parametrize(
    "correct",
    [
        Head,
        HeadList,
        FusedSplit,
        ChunkedQKV,
        EinsumHeads,
        lambda: EinsumHeads(merge="project"),
        lambda: EinsumHeads(merge="bqhd"),
    ],
)
def test_lints_stay_quiet_on_correct_code(correct):
    cap, warned = capture_lints(correct().eval(), X)
    assert lints(cap) == () and warned == []


def test_messages_say_where_and_what_to_do():
    cap, _ = capture_lints(Head(bug="unused_mask").eval(), X)
    message = cap[0].meta["lint"][0].message
    assert "masked_fill(...) at torch_helpers.py:" in message and "masked_fill_" in message
    # with the mask unused the code really attends the future, and the record says so
    assert cap[0].allowed.all() and cap[0].causal is False
    cap, _ = capture_lints(FusedSplit(bug="head_merge").eval(), X)
    message = cap[0].meta["lint"][0].message
    assert "(2, 4, 6, 4) -> (2, 6, 16)" in message and "transpose(1, 2)" in message
    cap, _ = capture_lints(Head(bug="softmax_axis").eval(), X)
    assert "dim=1 (the query axis)" in cap[0].meta["lint"][0].message


def test_grouped_heads_report_the_head_and_warn_once():
    model = HeadList(bug="same_kv").eval()
    cap, warned = capture_lints(model, X)
    assert [(v.check, v.head) for v in lints(cap)] == [("lint_same_kv", h) for h in range(4)]
    assert len(warned) == 1  # once per layer and lint
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        with attnprobe.capture(model, modules=[model]) as cap:
            model(X)
            model(X)
    assert len(lints(cap)) == 8 and len(again) == 1


def test_lint_results_can_be_filtered_like_any_violation():
    cap, _ = capture_lints(Head(bug="same_kv").eval(), X)
    result = attnprobe.CheckResult(violations=lints(cap), checks=LINT_CHECKS, records=len(cap))
    assert result.ok  # warnings do not fail a result
    assert "lint_same_kv" in result.table()


def test_reshape_groups_and_head_merge_rule():
    assert reshape_groups((2, 4, 5, 8), (2, 5, 32)) == [([0], [0]), ([1, 2, 3], [1, 2])]
    assert reshape_groups((2, 5, 4, 8), (2, 5, 32)) == [([0], [0]), ([1], [1]), ([2, 3], [2])]
    assert reshape_groups((1, 6), (6,)) == [([0, 1], [0])]
    bhqd = [("b", 2), ("h", 4), ("q", 5), ("d", 8)]
    bqhd = [("b", 2), ("q", 5), ("h", 4), ("d", 8)]
    assert head_merge_problem(bhqd, (2, 5, 32)) is True  # no transpose before the merge
    assert head_merge_problem(bqhd, (2, 5, 32)) is False
    assert head_merge_problem(bhqd, (8, 5, 8)) is None  # folding heads into the batch is not a merge
    assert head_merge_problem([("b", 2), ("q", 5), ("d", 8), ("h", 4)], (2, 5, 32)) is True


def test_same_kv_stays_quiet_when_distinct_keys_and_values_are_all_equal_values():
    """A zero input makes a correct head's keys and values both zero (MobileViT's 1x1 stages in a tiny model): equal
    values from two projections say nothing about a shared tensor. The bug itself is still found on that input."""
    zeros = torch.zeros(2, 6, 16)
    cap, found = capture_lints(Head().eval(), zeros)
    assert lints(cap) == () and found == []
    cap, _ = capture_lints(Head(bug="same_kv").eval(), zeros)
    assert [v.check for v in lints(cap)] == ["lint_same_kv"]
