"""Declarations (documents=, prefix_length=, bidirectional=, sliding_window=, chunk_size=, mask_fn=, scale=):
refused when malformed, checked both ways (``declared``: weight where they forbid; ``reach``: masking where they
allow), with the same verdicts on a full capture and on per-row statistics at 2,048 tokens (issue 33)."""

from __future__ import annotations

import math

import pytest
import torch

import attnprobe
from attnprobe.probe.checks.predicate import spans_to_ids
from attnprobe.probe.engine.attention_math import AttentionCall
from attnprobe.probe.engine.stats import attention_stats

T, PAD, D = 2048, 32, 8  # tokens, left padding, head size: one batch row, one head
CHECKS = ["causal", "padding", "declared", "reach", "scale"]


def _pad(n: int = T) -> torch.Tensor:
    pad = torch.zeros(1, n, dtype=torch.bool)  # (batch, key) True = padding
    pad[0, :PAD] = True
    return pad


def _causal() -> torch.Tensor:
    q = torch.arange(T)[:, None]
    return torch.arange(T)[None, :] <= q  # (query, key)


def _qk(n: int = T):
    return torch.arange(n)[:, None], torch.arange(n)[None, :]  # (query, 1), (1, key)


DOCS = torch.tensor([[0] * 700 + [1] * 900 + [2] * 448])
BLOCKS = ((100, 164), (1000, 1300))  # an image of 64 tokens, one of 300 (longer than the window below)
BLOCK_IDS = spans_to_ids(BLOCKS, 1, T)
PREFIX, WINDOW, CHUNK = 300, 256, 512


def _same(ids: torch.Tensor) -> torch.Tensor:
    return ids[:, :, None] == ids[:, None, :]  # (batch, query, key)


def _in_block(ids: torch.Tensor) -> torch.Tensor:
    return _same(ids) & (ids[:, :, None] != 0)  # (batch, query, key)


def _chunks(size: int) -> torch.Tensor:
    origin = PAD  # chunks count from the row's first real token
    q, k = _qk()
    return torch.div(q - origin, size, rounding_mode="floor") == torch.div(k - origin, size, rounding_mode="floor")


def _mask_fn_pattern(b, h, q_idx, kv_idx):
    """A mask_fn whose rows are one span each: the causal keys of the query's own quarter."""
    return (kv_idx <= q_idx) & (q_idx // (T // 4) == kv_idx // (T // 4))


def _mask_fn_cells() -> torch.Tensor:
    q, k = _qk()
    return (k <= q) & (q // (T // 4) == k // (T // 4))


#: scenario -> (declaration, the correct model's mask, a planted bug's mask), each mask (batch, query, key) before
#: padding; the bug named after what it breaks
SCENARIOS = {
    "documents": ({"documents": DOCS}, lambda: _causal() & _same(DOCS), _causal),
    "prefix_made_causal": (
        {"prefix_length": PREFIX},
        lambda: _causal() | ((_qk()[0] < PREFIX) & (_qk()[1] < PREFIX)),
        _causal,
    ),
    "images_see_next_image": (  # transformers #38053
        {"bidirectional": list(BLOCKS)},
        lambda: _causal() | _in_block(BLOCK_IDS),
        lambda: _causal() | ((BLOCK_IDS[:, :, None] != 0) & (BLOCK_IDS[:, None, :] != 0)),
    ),
    "blocks_never_reaching": (  # transformers #39389
        {"bidirectional": BLOCK_IDS},
        lambda: _causal() | _in_block(BLOCK_IDS),
        _causal,
    ),
    "block_ignores_window": (  # transformers #46711 / #46850
        {"bidirectional": list(BLOCKS), "sliding_window": WINDOW},
        lambda: (_causal() | _in_block(BLOCK_IDS)) & (_qk()[0] - _qk()[1] < WINDOW),
        lambda: (_causal() & (_qk()[0] - _qk()[1] < WINDOW)) | _in_block(BLOCK_IDS),
    ),
    "chunks": ({"chunk_size": CHUNK}, lambda: _causal() & _chunks(CHUNK), lambda: _causal() & _chunks(CHUNK // 2)),
    "mask_fn": ({"mask_fn": _mask_fn_pattern}, _mask_fn_cells, _causal),
}


def _records(allowed: torch.Tensor, seed: int):
    """(full record, statistics record) of one call whose mask is ``allowed`` (batch, query, key), padding added."""
    n = allowed.shape[-1]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, D, generator=g) for _ in range(3))  # (batch, head, tokens, d)
    pad = _pad(n)
    mask = (allowed.expand(1, n, n) & ~pad[:, None, :])[:, None]  # (batch, 1, query, key)
    mask[0, :, :PAD] = False  # padded query rows attend nothing (sdpa's zero rows)
    call = AttentionCall(q, k, scaling=D**-0.5, v=v, mask=mask)
    stats = attention_stats(call, diag_offset=0, query_padding=pad)
    scores = (q @ k.transpose(-1, -2)) * D**-0.5  # (batch, head, query, key)
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
    common = dict(name="attn", layer=0, call=0, kind="self", num_heads=1, num_kv_heads=1, heads=(0,), kv_heads=(0,))
    common.update(query_padding=pad, causal=True, scaling=D**-0.5)
    full = attnprobe.AttentionRecord(**common, weights=weights, allowed=mask)
    return full, attnprobe.AttentionRecord(**common, stats=stats)


def _verdicts(result) -> set:
    return {(v.check, v.severity, v.batch, v.queries, v.query_count) for v in result.violations}


@pytest.fixture(scope="module")
def records() -> dict:
    out = {}
    for i, (name, (_, good, bad)) in enumerate(SCENARIOS.items()):
        out[name] = (_records(good(), seed=i), _records(bad(), seed=i))
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_declaration_catches_its_bug_with_the_same_verdicts_from_statistics(records, name):
    declared = {**SCENARIOS[name][0], "attention_mask": ~_pad()}
    (good_full, good_stats), (bad_full, bad_stats) = records[name]
    for full, stats, broken in ((good_full, good_stats, False), (bad_full, bad_stats, True)):
        on_full = attnprobe.check(full, checks=CHECKS, **declared)
        on_stats = attnprobe.check(stats, checks=CHECKS, **declared)
        assert on_full.ok != broken and on_full.verified, on_full.table()
        assert _verdicts(on_stats) == _verdicts(on_full), (on_full.table(), on_stats.table())
        # what statistics cannot tell (rows of a broken mask with holes) is said, never passed
        undecided = [s for s in on_stats.skipped if "statistics cannot decide" not in s]
        assert on_full.skipped == () and undecided == [] and (broken or on_stats.skipped == ()), on_stats.skipped
        assert on_full.coverage["reach"] == on_stats.coverage["reach"] == 1


def test_findings_name_the_declaration_they_break(records):
    (_, _), (bad, _) = records["block_ignores_window"]
    result = attnprobe.check(bad, checks=CHECKS, bidirectional=list(BLOCKS), sliding_window=WINDOW)
    found = [v for v in result.errors if v.check == "declared"]
    assert found and all("sliding window (declared sliding_window=)" in v.message for v in found)
    assert min(found[0].queries) >= 1256 and max(found[0].keys) < 1300 - WINDOW  # only the long image's old keys
    (_, _), (never, _) = records["blocks_never_reaching"]
    reach = [v for v in attnprobe.check(never, checks=CHECKS, bidirectional=BLOCK_IDS).errors if v.check == "reach"]
    assert reach and "bidirectional (declared bidirectional=)" in reach[0].message


def test_a_mask_fn_with_holes_is_exact_on_weights_and_says_what_statistics_cannot_decide():
    """A row whose allowed keys are not one span (less padding) cannot be told from per-row statistics: where a
    verdict needs the holes, the rows are counted in ``skipped``, never passed."""

    def every_other(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % 2 == 0)

    q, k = _qk(256)
    full, stats = _records((k <= q) & ((q - k) % 2 == 0), seed=9)
    on_full = attnprobe.check(full, checks=CHECKS, mask_fn=every_other, attention_mask=~_pad(256))
    assert on_full.ok and on_full.verified and not on_full.skipped
    on_stats = attnprobe.check(stats, checks=CHECKS, mask_fn=every_other, attention_mask=~_pad(256))
    assert on_stats.ok and any("statistics cannot decide" in s for s in on_stats.skipped), on_stats.skipped


def test_scale_is_compared_on_full_and_statistics_records(records):
    (full, stats), _ = records["documents"]
    for record in (full, stats):
        assert attnprobe.check(record, checks=["scale"], scale=D**-0.5).coverage["scale"] == 1
        found = attnprobe.check(record, checks=["scale"], scale=D**-1).errors
        assert len(found) == 1 and "the kernel's scaling 0.3536 (the projections were not observed)" in found[0].message


# --------------------------------------------------------------------------------------------- bad declarations
def _one_record():
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(2, 6, 8))
    return cap


def _raising(b, h, q_idx, kv_idx):
    raise KeyError("no such document")


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        ({"documents": torch.zeros(3, 6, dtype=torch.long)}, "documents has batch 3 but the records it concerns have"),
        ({"documents": torch.zeros(2, 6)}, "documents must be per-token document ids (batch, seq) of integers"),
        ({"documents": "positions"}, "documents must be per-token document ids"),
        ({"documents": "position_ids"}, "documents='position_ids' reads the position ids the model received"),
        ({"sliding_window": 0}, "sliding_window must be a whole number >= 1"),
        ({"sliding_window": 2.5}, "sliding_window must be a whole number >= 1"),
        ({"chunk_size": -4}, "chunk_size must be a whole number >= 1"),
        ({"prefix_length": -1}, "prefix_length must be a whole number >= 0"),
        ({"bidirectional": [(4, 2)]}, "bidirectional must be per-token block ids"),
        ({"bidirectional": [(0, 3), (2, 5)]}, "overlapping"),
        ({"bidirectional": torch.tensor([[0, -1, 1, 1, 0, 0]] * 2)}, "negative ids"),
        ({"mask_fn": _raising}, "mask_fn must be a callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor"),
        ({"mask_fn": lambda b, h, q, kv: (q - kv).float()}, "returned a torch.float32 tensor"),
        ({"mask_fn": "causal"}, "mask_fn must be a callable"),
        ({"scale": 0.0}, "scale must be a positive finite number"),
        ({"sliding_window": {"layer0": 4}}, "sliding_window={layer: value} needs integer layer numbers"),
    ],
)
def test_a_malformed_declaration_is_refused_in_one_line_before_any_check(declared, said):
    cap = _one_record()
    with pytest.raises(attnprobe.DeclarationError) as caught:
        attnprobe.check(cap, **declared)
    message = str(caught.value)
    assert said in message and "\n" not in message, message
    assert caught.value.declaration == next(iter(declared))
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)


def test_declarations_hold_per_layer_and_say_where_they_come_from():
    cap = _one_record()
    result = attnprobe.check(cap, documents={0: torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)})
    found = [v for v in result.errors if v.check == "declared"]
    assert found and set(found[0].queries) == {3, 4, 5} and set(found[0].keys) == {0, 1, 2}
    assert "the query's own document (declared documents=)" in found[0].message
    assert attnprobe.check(cap, documents={5: torch.zeros(2, 6, dtype=torch.long)}).ok  # another layer: unused
    assert attnprobe.check(cap, sliding_window=6, chunk_size=6, prefix_length=0).ok
    assert attnprobe.assert_invariants(cap, bidirectional=[(0, 1)], sliding_window=8).ok
