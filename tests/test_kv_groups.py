"""Grouped-query attention without copies: ``AttentionCall.for_heads`` keeps k and v as the model holds them where the
selected heads read their key/value heads in groups (``kv_group``), and every engine gives the statistics of the same
call with k and v repeated for every head (``AttentionCall.ungrouped``): torch's ops, the native row pass and fused
pass here, the Triton kernel under its interpreter in tests/test_triton_stats.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_native_rows import _count_fused
from test_stats_lse import assert_close_to, exact_lse
from test_stats_oracle import MASKS, _case

import attnprobe
from attnprobe.probe.engine.attention_math import AttentionCall, grouped_matmul
from attnprobe.probe.engine.stats import KEY_STATS, ROW_STATS, attention_stats


@pytest.mark.parametrize(
    ("heads", "group", "kv"),
    [
        ((0, 1, 2, 3, 4, 5, 6, 7), 4, (0, 1)),  # every head of 2 groups of 4
        ((2, 3), 2, (0,)),  # two heads of the first group
        ((0, 5), 1, (0, 1)),  # one head of each group: one kv head each, nothing repeated
        ((0, 1, 4), 1, (0, 0, 1)),  # groups of unequal sizes: k and v repeated per head, as before
    ],
)
def test_for_heads_keeps_grouped_keys_and_values_as_the_model_holds_them(heads, group, kv):
    q, k, v = torch.randn(2, 8, 5, 4), torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 4)
    kv_heads = tuple(h // 4 for h in heads)
    call = AttentionCall.for_heads(q, k, v, heads=heads, kv_heads=kv_heads, scaling=0.5)
    assert call.kv_group == group and call.k.shape[1] == len(kv)
    assert torch.equal(call.k, k[:, list(kv)]) and call.v is not None and torch.equal(call.v, v[:, list(kv)])
    if group > 1:  # views of the model's tensors: no copy
        assert call.k.data_ptr() - k.data_ptr() == kv[0] * k.stride(1) * k.element_size()
        assert call.v.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    full = call.ungrouped()
    assert full.kv_group == 1 and torch.equal(full.k, k[:, list(kv_heads)])
    assert full.v is not None and torch.equal(full.v, v[:, list(kv_heads)])


def test_the_grouped_product_is_each_heads_own():
    """``grouped_matmul``: head i of x times head i // group of y, into a new tensor or a buffer, with x's rows cut
    from each head (a view that cannot fold its heads into rows)."""
    x, y = torch.randn(2, 6, 9, 5), torch.randn(2, 3, 5, 4)
    want = x @ y.repeat_interleave(2, 1)  # (batch, head, rows, 4)
    torch.testing.assert_close(grouped_matmul(x, y, 2), want)
    out = torch.empty(2, 6, 3, 4)
    assert grouped_matmul(x[:, :, 2:5], y, 2, out=out) is out
    torch.testing.assert_close(out, want[:, :, 2:5])


@pytest.mark.parametrize("mask", [m for m in MASKS if m != "nan"])
@pytest.mark.parametrize("path", ["torch", "row pass", "fused pass"])
def test_grouped_calls_give_the_statistics_of_keys_for_every_head(mask, path):
    """Every statistic of a call whose 4 heads read 2 kv heads in groups, against the same call with k and v repeated
    per head, on torch's ops, the native row pass and the fused pass (with the kernel's lse)."""
    call, diag, padding = _case(mask, "plain", torch.float32, grouped=True)
    assert call.kv_group == 2 and call.k.shape[1] == 2
    if path == "fused pass":
        call = replace(call, lse=exact_lse(call))
    kw = dict(diag_offset=diag, query_padding=padding, native=path != "torch")
    report: dict = {}
    got = attention_stats(call, report=report, **kw)
    assert_close_to(got, attention_stats(call.ungrouped(), **kw), atol=1e-5)
    assert (report["native_blocks"] > 0) == (path != "torch")


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_grouped_calls_with_sampled_rows_an_overview_and_a_key_set(native):
    """The engine's other inputs on a grouped call: a sample of rows, an overview (pooled weights and exact windows)
    and a key set (``key_set_mass``) give what they give on the call with k and v repeated per head."""
    from attnprobe.probe.engine.pooling import Overview

    call, diag, padding = _case("padding", "plain", torch.float32, grouped=True)
    full = call.ungrouped()
    kw: dict = dict(diag_offset=diag, query_padding=padding, native=native)
    rows = torch.tensor([0, 3, 4, 11, 12])
    assert_close_to(attention_stats(call, rows=rows, **kw), attention_stats(full, rows=rows, **kw), atol=1e-5)
    overview = Overview(cells=4, windows=((0, 2, 0, 7), (1, 3, 2, 11)))
    got, want = (attention_stats(c, overview=overview, **kw) for c in (call, full))
    assert_close_to(got, want, atol=1e-5)
    pooled = set(got) - {*ROW_STATS, *KEY_STATS}  # the overview's pooled weights and windows
    assert pooled == set(want) - {*ROW_STATS, *KEY_STATS} and len(pooled) == 4
    for name in pooled:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0)
    key_set = torch.zeros(2, 13, dtype=torch.bool)
    key_set[:, 5:9] = True
    got, want = (attention_stats(c, key_set=key_set, **kw) for c in (call, full))
    torch.testing.assert_close(got["key_set_mass"], want["key_set_mass"], atol=1e-5, rtol=0, equal_nan=True)


def test_the_fused_pass_reads_each_kv_head_for_its_group(monkeypatch):
    """The fused pass takes a grouped call (q's heads read k and v through ``kv_group``) and gives the statistics of
    the call with k and v repeated per head."""
    call, diag, padding = _case("causal", "plain", torch.float32, grouped=True)
    call = replace(call, lse=exact_lse(call))
    calls = _count_fused(monkeypatch)
    got = attention_stats(call, diag_offset=diag, query_padding=padding, native=True)
    assert calls == [(13, False)]
    assert_close_to(got, attention_stats(call.ungrouped(), diag_offset=diag, query_padding=padding), atol=1e-5)


def test_a_capture_of_a_grouped_model_copies_no_keys_for_its_statistics():
    """A statistics capture of a Llama whose 4 heads read 2 kv heads: the engine's call holds k and v per kv head, and
    the records' statistics are those of the same calls with k and v repeated per head."""
    import transformers

    from attnprobe.probe.engine import engines

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()
    seen: list = []
    statistics = engines.statistics

    def both(call, **kw):
        seen.append(call.kv_group)
        got = statistics(call, **kw)
        want = statistics(call.ungrouped(), **kw)
        assert_close_to(got[0], want[0], atol=1e-5)
        return got

    ids = torch.randint(0, 50, (2, 11))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engines, "statistics", both)
        with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as cap:
            model(input_ids=ids)
    assert seen == [2, 2] and len(cap) == 2


@pytest.mark.parametrize(
    ("kv_heads", "threads"),
    [((0, 0, 1, 1), 1), ((0, 0, 1, 1), 2), ((0, 0, 0, 0), 1), ((0, 0, 0, 0), 2)],
    ids=["pairs-1-thread", "pairs-2-threads", "four-1-thread", "four-2-threads"],
)
def test_the_fused_pass_lays_out_a_kv_head_once_or_per_head_with_the_same_numbers(kv_heads, threads, monkeypatch):
    """One batch item of 4 heads: where there are as many groups of heads reading one kv head as threads, each group
    shares its kv head's layout (pairs at one or two threads, one group of four at one thread); else each head lays
    out its own (one group of four at two threads). Either way, the statistics of k and v repeated per head."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, n, 8, generator=g) for h, n in ((4, 9), (2, 30), (2, 30)))
    call = AttentionCall.for_heads(
        q, k, v, heads=(0, 1, 2, 3), kv_heads=kv_heads, scaling=0.4, causal=True, causal_offset=21
    )
    full = call.ungrouped()
    assert call.kv_group == 4 // len(set(kv_heads)) and full.v is not None
    allowed = full.allowed(0, 9, 0, 30)  # (1, 1, query, key)
    assert allowed is not None
    weights = torch.softmax(full.logits(0, 9, 0, 30).masked_fill(~allowed, -torch.inf), -1)
    call = replace(call, output=weights @ full.v, lse=exact_lse(call))
    calls = _count_fused(monkeypatch)
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention_stats(call, diag_offset=21, native=True)
    finally:
        torch.set_num_threads(was)
    assert calls == [(9, False)]
    assert_close_to(got, attention_stats(call.ungrouped(), diag_offset=21), atol=1e-5)
