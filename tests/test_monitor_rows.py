"""Sampled query rows: ``capture(stats_rows=)`` and ``attnprobe.monitor(rows=)`` compute the statistics of a few
query rows per head, at their real positions, and everything downstream says so or refuses."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import attnprobe
from attnprobe.probe.analyses.monitor import MEANS, MonitorError
from attnprobe.probe.engine import stats as engine
from attnprobe.probe.engine.stats import ROW_STATS
from attnprobe.probe.errors import AttnprobeError, SelectionError
from attnprobe.probe.selection import sampled_rows


class Own(nn.Module):
    """attnprobe's own causal attention (statistics from the weights it hands over), with a key padding mask."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.layers = nn.ModuleList(attnprobe.MultiHeadAttention(d, num_heads=heads, causal=True) for _ in range(2))

    def forward(self, x, attention_mask=None):
        for layer in self.layers:
            x = x + layer(x, attention_mask=attention_mask)
        return x


class Sdpa(nn.Module):
    """Causal ``F.scaled_dot_product_attention`` called directly (statistics blockwise from q and k)."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(2))

    def forward(self, x, attention_mask=None):
        B, T, d = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (B, nh, T, hs)
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        return x


def inputs(T, batch=2, padded=True):
    x = torch.randn(batch, T, 16)
    mask = torch.ones(batch, T, dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # left padding: the first sampled rows of batch row 0 are padding
    return x, mask


@pytest.mark.parametrize("kind", [Own, Sdpa], ids=["from-weights", "blockwise"])
def test_sampled_rows_get_exactly_the_statistics_of_those_rows(kind, assert_no_hooks):
    torch.manual_seed(0)
    model = kind().eval()
    x, mask = inputs(37, padded=kind is Own)
    args = (x, mask) if kind is Own else (x,)
    _, full = attnprobe.run(model, args, keep=("stats",))
    _, cap = attnprobe.run(model, args, keep=("stats",), stats_rows=7)
    assert_no_hooks(model)
    positions = sampled_rows(37, 7)
    assert positions.tolist() == [0, 6, 12, 18, 24, 30, 36]
    for a, b in zip(cap, full):
        assert a.meta["stats_rows"] == positions.tolist() and a.meta["stats_query_len"] == 37
        assert a.query_len == 37 and torch.equal(a.stats_positions, positions)
        for name in ROW_STATS:
            got, want = a.stats[name], b.stats[name][:, :, positions]
            assert got.shape == want.shape, name
            same = (
                torch.allclose(got.double(), want.double(), atol=1e-6, equal_nan=True)
                if got.dtype.is_floating_point
                else torch.equal(got, want)
            )
            assert same, name


def test_monitor_means_with_rows_equal_the_full_statistics_at_those_positions():
    torch.manual_seed(0)
    model = Own().eval()
    x, mask = inputs(50)
    with attnprobe.monitor(model, every=1, rows=9) as mon:
        model(x, mask)
    _, full = attnprobe.run(model, (x, mask), keep=("stats",))
    positions = sampled_rows(50, 9)
    history = mon.history
    for rec in full:
        real = ~rec.query_padding[:, positions]  # (B, 9)
        for h, head in enumerate(rec.heads):
            row = history[(history["layer"] == rec.layer) & (history["head"] == head)].iloc[0]
            assert row["rows"] == int(real.sum()) == 2 * 9 - 1  # position 0 of batch row 0 is padding
            for name in MEANS:
                want = rec.stats[name][:, h][:, positions][real].double()
                if name == "max_score":
                    want = want[want.isfinite()]
                want = float(want.nanmean())
                assert (math.isnan(want) and math.isnan(row[name])) or row[name] == pytest.approx(want, abs=1e-6), name
            ent = rec.stats["entropy"][:, h][:, positions][real & (rec.stats["allowed_keys"][:, h][:, positions] > 1)]
            assert row["entropy_min"] == pytest.approx(float(ent.min()), abs=1e-6)


def test_default_rows_is_64_and_a_shorter_sequence_uses_every_row():
    torch.manual_seed(0)
    model = Sdpa().eval()
    with attnprobe.monitor(model, every=1) as mon:  # rows=64 by default
        model(torch.randn(1, 200, 16))
        model(torch.randn(1, 20, 16))
    first, second = mon.history[mon.history["step"] == 0], mon.history[mon.history["step"] == 1]
    assert (first["rows"] == 64).all() and len(first) == 8
    assert (second["rows"] == 20).all()
    with attnprobe.capture(model, keep=("stats",), stats_rows=64) as cap:
        model(torch.randn(1, 200, 16))
        model(torch.randn(1, 20, 16))
    rows = cap[0].meta["stats_rows"]
    assert len(rows) == 64 and rows[0] == 0 and rows[-1] == 199 and rows == sorted(set(rows))
    assert "stats_rows" not in cap[-1].meta and cap[-1].stats["entropy"].shape == (1, 4, 20)  # not a sample
    # the same positions every step for the same length
    assert sampled_rows(200, 64).tolist() == rows


@pytest.mark.parametrize("kind", [Own, Sdpa], ids=["from-weights", "blockwise"])
def test_a_sampled_step_at_1024_tokens_hands_64_query_rows_to_the_engine(kind, monkeypatch):
    """What a sampled step computes is bounded by rows=, not by the sequence: the engine sees 64 query rows."""
    seen = []
    attention_stats, stats_from_weights = engine.attention_stats, engine.stats_from_weights

    def counted_blockwise(call, **kw):
        rows = kw.get("rows")
        seen.append(call.shape[2] if rows is None else rows.numel())
        return attention_stats(call, **kw)

    def counted_weights(weights, **kw):
        rows = kw.get("rows")  # the rows are cut inside, before any statistic is computed
        seen.append(weights.shape[2] if rows is None else rows.numel())
        return stats_from_weights(weights, **kw)

    # every module that holds the engine's functions by name (probe/engine/engines.py does): patching only the
    # defining module would count nothing once another test has imported those modules
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("attnprobe.") and m is not None]:
        for name, original, counted in (
            ("attention_stats", attention_stats, counted_blockwise),
            ("stats_from_weights", stats_from_weights, counted_weights),
        ):
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    model = kind(d=8, heads=2).eval()
    with attnprobe.monitor(model, every=1, rows=64) as mon:
        model(torch.randn(1, 1024, 8))
    assert seen == [64, 64]  # two layers, 64 query rows each
    assert (mon.history["rows"] == 64).all()
    seen.clear()
    with attnprobe.monitor(model, every=1, rows=None):
        model(torch.randn(1, 1024, 8))
    assert seen == [1024, 1024]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stats_rows": 0}, "positive whole number"),
        ({"stats_rows": -3}, "positive whole number"),
        ({"stats_rows": True}, "positive whole number"),
        ({"stats_rows": 2.5}, "positive whole number"),
        ({"stats_rows": "64"}, "positive whole number"),
        ({"stats_rows": 8, "keep": ("weights",)}, 'add "stats" to keep='),
        ({"stats_rows": 8, "keep": ("stats",), "overview": 16}, "cannot be combined with overview="),
    ],
)
def test_bad_stats_rows_are_refused_before_the_run(options, message):
    options.setdefault("keep", ("stats",))
    with pytest.raises(SelectionError, match=message):
        attnprobe.capture(Own(), **options)


@pytest.mark.parametrize("rows", [0, -1, True, 2.0, "all"])
def test_bad_monitor_rows_are_refused(rows, assert_no_hooks):
    model = Own()
    with pytest.raises(MonitorError, match="rows must be a positive whole number"):
        attnprobe.monitor(model, rows=rows)
    assert_no_hooks(model)


def test_downstream_of_a_sampled_capture_uses_the_real_positions_or_refuses(tmp_path):
    torch.manual_seed(0)
    model = Own().eval()
    x, mask = inputs(30)
    _, full = attnprobe.run(model, (x, mask), keep=("stats",))
    _, cap = attnprobe.run(model, (x, mask), keep=("stats",), stats_rows=4)
    positions = sampled_rows(30, 4).tolist()
    # to_frame: one row per sampled query, at its real position, with the full capture's values there
    frame, whole = cap.to_frame(), full.to_frame()
    assert sorted(frame["query_pos"].unique()) == positions
    key = ["layer", "head", "batch", "query_pos"]
    merged = frame.merge(whole, on=key, suffixes=("", "_full"))
    assert len(merged) == len(frame) == 2 * 4 * 2 * 4
    assert (merged["query_padding"] == merged["query_padding_full"]).all()
    assert merged["entropy"].to_numpy() == pytest.approx(merged["entropy_full"].to_numpy(), abs=1e-6)
    assert frame["query_padding"].sum() == 2 * 4  # batch row 0's position 0, in each layer and head
    # summary: the means over the sampled real rows (its rows column counts them)
    summary = cap.summary()
    assert (summary["rows"] == 2 * 4 - 1).all()
    real = frame[~frame["query_padding"].astype(bool)]
    want = real.groupby(["layer", "head"])["entropy"].mean().to_numpy()
    assert summary["entropy"].to_numpy() == pytest.approx(want, abs=1e-6)
    # check() and the long-input report need every row: a clear refusal
    with pytest.raises(SelectionError, match=r"sampled query rows of 30.*Capture without stats_rows="):
        attnprobe.check(cap)
    with pytest.raises(AttnprobeError, match=r"sampled query rows.*monitor_html"):
        attnprobe.reports.to_html(cap)
    # saved and loaded: the positions travel with the record
    loaded = attnprobe.load(cap.save(tmp_path / "cap"))
    assert loaded[0].meta["stats_rows"] == positions and loaded[0].query_len == 30


def test_selecting_heads_of_a_statistics_capture_selects_their_statistics():
    """Capture.select(heads=) cuts record.stats to those heads too (it kept every head, so summary() labelled head
    0's figures as head 1's)."""
    torch.manual_seed(0)
    model = Own().eval()
    _, cap = attnprobe.run(model, inputs(12), keep=("stats",), stats_rows=5)
    picked = cap.select(heads=[3, 1])
    for full, rec in zip(cap, picked):
        assert rec.heads == (3, 1)
        for name, t in rec.stats.items():
            want = full.stats[name][:, [3, 1]]
            assert torch.equal(t, want) or torch.allclose(t, want, rtol=0, atol=0, equal_nan=True), name
    whole = cap.summary().set_index(["layer", "head"])
    part = picked.summary().set_index(["layer", "head"])
    assert part["entropy"].to_numpy() == pytest.approx(whole.loc[part.index, "entropy"].to_numpy())
