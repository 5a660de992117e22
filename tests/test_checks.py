"""Invariant checks on captured modules: each check fires on a deliberately broken attention and
stays quiet on correct ones (left and right padding, fp32 and bf16)."""

from __future__ import annotations

import warnings

import pytest
import torch
from checks_helpers import (
    BUGS,
    LEFT_PADDED,
    RIGHT_PADDED,
    BuggyAttention,
    DropsMaskBlock,
    TinyTransformer,
    capture_one,
    declarations,
)

import attnprobe
from attnprobe import MultiHeadAttention

CTX_MASK = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])  # right-padded encoder


def inputs(dtype=torch.float32):
    return torch.randn(2, 7, 16, dtype=dtype), torch.randn(2, 6, 12, dtype=dtype)


def run_model(model, mask, dtype=torch.float32):
    """One forward of ``TinyTransformer`` under capture (``capture_one`` checks that no hook is left)."""
    x, ctx = inputs(dtype)
    return capture_one(model, x, ctx, mask, CTX_MASK)


def errors_by_check(result) -> dict[str, list]:
    out: dict[str, list] = {}
    for v in result.errors:
        out.setdefault(v.check, []).append(v)
    return out


# --------------------------------------------------------------------------- no false positives
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask", [LEFT_PADDED, RIGHT_PADDED], ids=["left", "right"])
def test_correct_modules_pass_every_check(dtype, mask):
    model = TinyTransformer().to(dtype)
    cap = run_model(model, mask, dtype)
    for declared in ({}, declarations(mask, CTX_MASK)):
        result = attnprobe.check(cap, **declared)
        assert result.violations == (), result.table()
        assert result.skipped == (), result.skipped
        assert result.records == 4 and result.checks == attnprobe.CHECKS
        # every check ran on every record it applies to: causality on the causal layers 1 and 2, and on
        # the encoder layer 0 once it is declared bidirectional; nothing for the checks of declarations
        # (documents=, sliding_window=, scale=, ...) that were not made
        causal_records = 3 if declared else 2
        unused = ("declared", "reach", "scale")
        assert dict(result.coverage) == {
            c: causal_records if c == "causal" else 0 if c in unused else 4 for c in attnprobe.CHECKS
        }
        assert attnprobe.assert_invariants(cap, **declared) == result


def test_head_and_layer_selections_check_what_was_kept():
    model = TinyTransformer()
    x, ctx = inputs()
    cap = capture_one(
        model,
        x,
        ctx,
        LEFT_PADDED,
        CTX_MASK,
        options={"layers": [1, 3], "heads": [1, 3], "keep": ["weights", "v", "output"]},
    )
    result = attnprobe.check(cap)
    assert result.violations == () and result.coverage["output_match"] == 2
    assert result.skipped == ("softmax_match: no scores captured (2 record(s), layers 1, 3)",)


def test_padded_query_rows_are_dont_care():
    """Left padding under a causal mask: the padded rows have no allowed key (zeros here, uniform in
    eager, zeros in CPU sdpa) and produce no violation, declared or not."""
    model = TinyTransformer()
    cap = run_model(model, LEFT_PADDED)
    dec = cap.record(1)
    assert not dec.allowed[0, 0, :2].any() and dec.query_padding[0, :2].all()
    assert attnprobe.check(cap).ok and attnprobe.check(cap, **declarations(LEFT_PADDED, CTX_MASK)).ok


def test_storage_in_half_precision_keeps_tolerances_honest():
    model = TinyTransformer()
    x, ctx = inputs()
    # larger scores: the rounding of fp16 scores matters
    cap = capture_one(model, x * 4, ctx * 4, LEFT_PADDED, CTX_MASK, options={"dtype": torch.float16})
    assert cap[1].weights.dtype == torch.float16 and cap[1].dtype == torch.float32
    result = attnprobe.check(cap)
    assert result.violations == (), result.table()


# --------------------------------------------------------------------------- each bug fires
#: bug -> (checks that must report an error with declarations, checks that must stay quiet)
EXPECTED = {
    "mask_not_applied": ({"mask", "causal", "padding", "softmax_match"}, {"row_sum", "output_match", "finite"}),
    "inverted_mask": ({"causal", "padding"}, {"mask", "row_sum", "softmax_match", "output_match"}),
    "inverted_fill": ({"mask", "causal", "padding", "softmax_match"}, {"output_match"}),
    "causal_plus_one": ({"causal"}, {"padding", "mask", "row_sum", "softmax_match", "output_match"}),
    "causal_minus_one": ({"causal"}, {"padding", "mask", "row_sum", "softmax_match", "output_match"}),
    "softmax_wrong_axis": ({"row_sum", "softmax_match"}, {"causal", "padding", "mask", "output_match"}),
    "padding_not_masked": ({"padding"}, {"causal", "mask", "row_sum", "softmax_match", "output_match"}),
    "nan_rows": ({"finite"}, {"causal", "padding", "mask", "row_sum", "softmax_match", "output_match"}),
    "dropout_in_eval": ({"output_match"}, {"causal", "padding", "mask", "row_sum", "softmax_match"}),
    "dropout_before_hook": ({"row_sum", "softmax_match"}, {"causal", "padding", "mask"}),
    "doubled_scale": ({"output_match"}, {"causal", "padding", "mask", "row_sum", "softmax_match", "finite"}),
}


def test_every_bug_has_an_expectation():
    assert set(EXPECTED) == set(BUGS)


@pytest.mark.parametrize("bug", BUGS)
def test_broken_attention_is_caught_in_its_layer(bug):
    torch.manual_seed(0)
    model = TinyTransformer(bug=bug)
    cap = run_model(model, LEFT_PADDED)
    result = attnprobe.check(cap, **declarations(LEFT_PADDED, CTX_MASK))
    fired = errors_by_check(result)
    must, quiet = EXPECTED[bug]
    assert must <= set(fired), (bug, result.table())
    assert not quiet & set(fired), (bug, result.table())
    for check in must:
        assert any(v.layer == 1 and v.name == "dec0" for v in fired[check]), result.table()
        assert any(v.head is not None or v.batch is not None for v in fired[check])
        assert all(v.queries and v.count > 0 for v in fired[check])
    if bug not in ("nan_rows", "inverted_fill"):  # their NaN rows reach later layers (see the test below)
        assert {v.layer for v in result.errors} == {1}, result.table()
    assert not result.ok
    with pytest.raises(attnprobe.InvariantError) as err:
        attnprobe.assert_invariants(cap, **declarations(LEFT_PADDED, CTX_MASK))
    assert isinstance(err.value, AssertionError) and sorted(must)[0] in str(err.value)


def test_mask_built_and_never_applied_names_the_cells():
    torch.manual_seed(0)
    attn = BuggyAttention(8, num_heads=2, causal=True, bug="mask_not_applied")
    cap = capture_one(attn, torch.randn(1, 5, 8), attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    result = attnprobe.check(cap)  # no declaration: the record's own mask is the reference
    masks = [v for v in result.errors if v.check == "mask"]
    assert [v.head for v in masks] == [0, 1] and all(v.batch == 0 for v in masks)
    # real queries 1..4 put weight on padded key 0 and on every later key
    assert masks[0].queries == (1, 2, 3, 4) and masks[0].keys == (0, 2, 3, 4)
    assert masks[0].count == 4 + 6 and 0 < masks[0].worst <= 1
    causal = [v for v in result.errors if v.check == "causal"]
    assert causal and "the module says it is causal" in causal[0].message
    padding = [v for v in result.errors if v.check == "padding"]
    assert padding[0].keys == (0,) and "query_padding" in padding[0].message


def test_causal_off_by_one_forward_names_the_next_token():
    torch.manual_seed(0)
    attn = BuggyAttention(8, num_heads=1, causal=True, bug="causal_plus_one")
    cap = capture_one(attn, torch.randn(1, 6, 8))
    (v,) = attnprobe.check(cap, causal=True).errors
    assert v.check == "causal" and v.head == 0 and v.batch == 0
    assert v.queries == (0, 1, 2, 3, 4) and v.keys == (1, 2, 3, 4, 5) and v.count == 5
    assert "declared causal=True" in v.message


def test_causal_off_by_one_backward_hides_the_query_from_itself():
    attn = BuggyAttention(8, num_heads=2, causal=True, bug="causal_minus_one")
    cap = capture_one(attn, torch.randn(1, 6, 8))
    result = attnprobe.check(cap)
    (causal,) = [v for v in result.violations if v.check == "causal"]
    assert causal.head is None and causal.queries == (1, 2, 3, 4, 5) and "own position" in causal.message
    (empty,) = [v for v in result.violations if v.check == "empty_rows"]
    assert empty.severity == "info" and empty.queries == (0,)


def test_wrapper_that_drops_the_mask_is_caught_only_by_a_declaration():
    block = DropsMaskBlock()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    cap = capture_one(block, torch.randn(2, 6, 16), attention_mask=mask)
    # the attention module never saw a mask, so its own record is self-consistent ...
    assert attnprobe.check(cap).ok
    # ... and the declared input mask shows what the model did with the padding
    result = attnprobe.check(cap, attention_mask=mask)
    padding = [v for v in result.errors if v.check == "padding"]
    assert padding and all(v.batch == 0 and v.keys == (4, 5) for v in padding)
    assert {v.head for v in padding} == {0, 1, 2, 3}
    assert all(v.queries == (0, 1, 2, 3) for v in padding)  # padded queries 4, 5 are left out
    assert "declared attention_mask" in padding[0].message


def test_inverted_mask_used_consistently_is_caught_by_the_module_flag_and_declarations():
    attn = BuggyAttention(8, num_heads=2, causal=True, bug="inverted_mask")
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    cap = capture_one(attn, torch.randn(1, 5, 8), attention_mask=mask)
    own = attnprobe.check(cap)
    assert {v.check for v in own.errors} == {"causal", "padding"}
    assert "mask" not in {v.check for v in own.errors}  # it did what its own mask says
    declared = attnprobe.check(cap, causal=True, attention_mask=mask)
    assert {v.check for v in declared.errors} == {"causal", "padding"}


def test_nan_in_padded_rows_is_reported_and_propagates_to_real_rows():
    model = TinyTransformer(bug="nan_rows")
    cap = run_model(model, LEFT_PADDED)
    result = attnprobe.check(cap)
    finite = [v for v in result.errors if v.check == "finite"]
    layer1 = [v for v in finite if v.layer == 1]
    assert layer1 and all(v.batch == 0 and v.queries == (0, 1) for v in layer1)
    assert all("padded or fully masked" in v.message for v in layer1)
    # 0 * NaN: the next layer's real query rows read the NaN values of the padded positions
    layer2 = [v for v in finite if v.layer == 2]
    assert layer2 and any("real query rows" in v.message and 6 in v.queries for v in layer2)


def test_declared_bidirectional_but_model_is_causal():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)  # e.g. an encoder left with is_causal on
    cap = capture_one(attn, torch.randn(2, 5, 8))
    (v,) = attnprobe.check(cap, causal=False).errors
    assert v.check == "causal" and v.head is None and v.batch is None and "declared causal=False" in v.message
    assert attnprobe.check(cap, causal=True).ok
    bidirectional = MultiHeadAttention(8, num_heads=2)
    assert attnprobe.check(capture_one(bidirectional, torch.randn(2, 5, 8)), causal=False).ok


def test_declared_causal_catches_a_bidirectional_decoder():
    attn = MultiHeadAttention(8, num_heads=2)  # forgot causal=True
    cap = capture_one(attn, torch.randn(1, 4, 8))
    assert attnprobe.check(cap).ok  # its record says non-causal, and it is
    result = attnprobe.check(cap, causal=True)
    assert [v.check for v in result.errors] == ["causal", "causal"]
    assert result.errors[0].keys == (1, 2, 3)


# --------------------------------------------------------------------------- dropout
def test_train_mode_dropout_is_recognised_not_reported():
    attn = MultiHeadAttention(8, num_heads=2, causal=True, dropout=0.3)
    cap = capture_one(attn, torch.randn(2, 6, 8), train=True)
    assert cap[0].dropout == 0.3
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"dropout \(p=0.3\).*model.eval\(\)"):
        result = attnprobe.check(cap)
    assert result.ok and result.violations == ()
    assert any(s.startswith("output_match: dropout p=0.3 is active") for s in result.skipped)
    # the weights hook sits before dropout: rows still sum to one, and that was verified
    assert result.coverage["row_sum"] == 1 and not any(s.startswith("row_sum") for s in result.skipped)


def test_dropped_weights_in_train_mode_are_not_a_row_sum_failure():
    attn = BuggyAttention(8, num_heads=2, dropout=0.5, bug="dropout_before_hook")
    cap = capture_one(attn, torch.randn(2, 6, 8), train=True)
    with pytest.warns(attnprobe.AttnprobeWarning, match="dropout"):
        result = attnprobe.check(cap)
    assert result.ok
    assert any(s.startswith("row_sum: dropout") for s in result.skipped)
    cap = capture_one(attn, torch.randn(2, 6, 8))  # the same module in eval: its dropout is a bug now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "row_sum" in {v.check for v in attnprobe.check(cap).errors}
