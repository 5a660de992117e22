"""Tidy frames and per-head summaries: schema, row counts, tokens, known answers, writers."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pandas as pd
import pytest
import torch

import attnprobe
from attnprobe import AttentionRecord, Capture, MultiHeadAttention
from attnprobe.probe.outputs.frames import FRAME_SCHEMA, SUMMARY_SCHEMA, TOKEN_SCHEMA


@pytest.fixture
def cap():
    model = torch.nn.Sequential(MultiHeadAttention(8, num_heads=2, causal=True), MultiHeadAttention(8, num_heads=2))
    with attnprobe.capture(model, heads=[1]) as cap:
        model(torch.randn(3, 5, 8))
    return cap


def test_frame_schema_and_row_count(cap):
    df = cap.to_frame()
    assert dict(df.dtypes.astype(str)) == FRAME_SCHEMA
    assert len(df) == 2 * 3 * 1 * 5 * 5  # layers x batch x heads x query x key
    assert set(df["head"]) == {1} and list(df["name"].cat.categories) == ["0", "1"]
    first = df[(df.layer == 0) & (df.batch == 2) & (df.query_pos == 1) & (df.key_pos == 0)]
    rec = cap[0]
    assert first.weight.item() == pytest.approx(rec.weights[2, 0, 1, 0].item())
    assert first.score.item() == pytest.approx(rec.scores[2, 0, 1, 0].item())
    # causal layer: key after query not allowed, weight exactly 0
    future = df[(df.layer == 0) & (df.key_pos > df.query_pos)]
    assert not future.allowed.any() and (future.weight == 0).all()


def test_frame_with_tokens(cap):
    toks = ["<s>", "the", "cat", "sat", "."]
    df = cap.to_frame(tokens=toks)
    assert dict(df.dtypes.astype(str)) == {**FRAME_SCHEMA, **TOKEN_SCHEMA}
    row = df[(df.query_pos == 2) & (df.key_pos == 4)].iloc[0]
    assert (row.query_token, row.key_token) == ("cat", ".")
    per_row = [[f"t{b}{i}" for i in range(5)] for b in range(3)]
    df = cap.to_frame(tokens=per_row)
    assert df[(df.batch == 2) & (df.query_pos == 3)].query_token.unique().tolist() == ["t23"]
    with pytest.raises(attnprobe.AttnprobeError, match="tokens has 4 entries but layer 0"):
        cap.to_frame(tokens=toks[:4])


def test_frame_missing_tensors_are_nan_not_zero():
    attn = MultiHeadAttention(8, num_heads=2)
    with attnprobe.capture(attn, keep=["weights"]) as cap:
        attn(torch.randn(1, 3, 8))
    df = cap.to_frame()
    assert df.score.isna().all() and df.weight.notna().all()


def test_cross_attention_frame_uses_key_tokens():
    attn = attnprobe.CrossAttention(8, 6, num_heads=1)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(1, 3, 8), torch.randn(1, 4, 6))
    df = cap.to_frame(tokens=["a", "b", "c"], key_tokens=["w", "x", "y", "z"])
    assert len(df) == 12
    assert df[(df.query_pos == 1) & (df.key_pos == 3)][["query_token", "key_token"]].values.tolist() == [["b", "z"]]
    df = cap.to_frame(tokens=["a", "b", "c"])  # keys without tokens: missing, not invented
    assert df.key_token.isna().all()


def known_record() -> AttentionRecord:
    """Two heads, batch 2, 3 positions, causal; batch 1 has a left-padded first position."""
    w = torch.zeros(2, 2, 3, 3)
    w[:, 0] = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]])
    w[:, 1] = torch.tensor([[0.9, 0.1, 0], [0.0, 1.0, 0], [0.0, 0.0, 0.98]])  # leak + a short row
    allowed = torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 1, 3, 3).clone()
    allowed[1, :, :, 0] = False  # batch 1: key 0 is padding
    padding = torch.tensor([[False, False, False], [True, False, False]])
    w[1, :, 0] = 0.0  # padded query row: nothing allowed
    w[1, 0, 1:] = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.5, 0.5]])
    w[1, 1, 1:] = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    return AttentionRecord(
        name="attn",
        layer=0,
        call=0,
        kind="self",
        num_heads=2,
        num_kv_heads=2,
        heads=(0, 1),
        kv_heads=(0, 1),
        weights=w,
        allowed=allowed,
        query_padding=padding,
        causal=True,
    )


def test_summary_known_answers():
    s = Capture([known_record()]).summary()
    assert dict(s.dtypes.astype(str)) == SUMMARY_SCHEMA and len(s) == 2
    h0, h1 = s.iloc[0], s.iloc[1]
    assert h0.rows == 5 and h1.rows == 5  # 3 rows of batch 0, 2 real rows of batch 1
    ln2 = math.log(2)
    row2_entropy = 2 * 0.25 * math.log(4) + 0.5 * ln2
    assert h0.entropy == pytest.approx((0 + ln2 + row2_entropy + 0 + ln2) / 5, rel=1e-6)
    assert h0.max_weight == pytest.approx((1 + 0.5 + 0.5 + 1 + 0.5) / 5)
    # first non-padding key: key 0 in batch 0, key 1 in batch 1
    assert h0.first_key_mass == pytest.approx((1 + 0.5 + 0.25 + 1 + 0.5) / 5)
    assert h0.diagonal_mass == pytest.approx((1 + 0.5 + 0.5 + 1 + 0.5) / 5)
    assert h0.previous_mass == pytest.approx((0.5 + 0.25 + 0 + 0.5) / 4)  # rows with a previous key
    assert h0.masked_mass == 0 and h0.row_sum_error == pytest.approx(0, abs=1e-7)
    assert h1.masked_mass == pytest.approx(0.1 / 5)  # row 0 of batch 0 puts 0.1 on a future key
    assert h1.row_sum_error == pytest.approx(0.02, abs=1e-6)


def test_summary_of_a_real_capture_is_sane(cap):
    s = cap.summary()
    assert list(s.layer) == [0, 1] and list(s["head"]) == [1, 1]
    assert (s.masked_mass == 0).all() and (s.row_sum_error < 1e-6).all()
    assert (s.entropy <= math.log(5) + 1e-6).all() and s.rows.tolist() == [15, 15]


def test_parquet_and_csv_writers(cap, tmp_path):
    path = cap.to_parquet(tmp_path / "frame.parquet")
    back = pd.read_parquet(path)
    assert len(back) == 150 and dict(back.dtypes.astype(str)) == FRAME_SCHEMA
    with pytest.raises(FileExistsError, match="overwrite=True"):
        cap.to_parquet(tmp_path / "frame.parquet")
    cap.to_parquet(tmp_path / "frame.parquet", overwrite=True)
    text = cap.to_csv()
    assert text.splitlines()[0] == ",".join(FRAME_SCHEMA) and len(text.splitlines()) == 151
    cap.to_csv(tmp_path / "frame.csv")
    assert (tmp_path / "frame.csv").read_text() == text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cap.to_csv(tmp_path / "missing" / "frame.csv")


def test_encoder_decoder_frame_labels_each_stack_with_its_own_tokens():
    from hf_helpers import build, inputs

    model = build("bart")
    batch = inputs("bart", "right", length=5)  # encoder and decoder inputs of the same length
    with torch.no_grad(), attnprobe.capture(model, keep=["weights"]) as cap:
        model(**batch)
    enc_tokens = [f"e{i}" for i in range(5)]
    dec_tokens = [f"d{i}" for i in range(5)]
    df = cap.to_frame(tokens=dec_tokens, key_tokens=enc_tokens)
    stack = {r.layer: (r.meta["stack"], r.kind) for r in cap}
    for layer, (part, kind) in stack.items():
        rows = df[df.layer == layer]
        expect_q = "e" if part == "encoder" else "d"
        expect_k = "e" if part == "encoder" or kind == "cross" else "d"
        assert set(rows.query_token.str[0]) == {expect_q}, (layer, part, kind)
        assert set(rows.key_token.str[0]) == {expect_k}, (layer, part, kind)
    assert set(stack.values()) == {("encoder", "self"), ("decoder", "self"), ("decoder", "cross")}


def sink_record(with_scores: bool = True) -> AttentionRecord:
    """Weights computed with one sink logit per head: rows sum to 1 - sink mass, not 1."""
    torch.manual_seed(1)
    scores = torch.randn(2, 2, 4, 4)
    allowed = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 1, 4, 4)
    sinks = torch.tensor([0.5, -1.0])
    logits = torch.cat([scores.masked_fill(~allowed, float("-inf")), sinks.view(1, 2, 1, 1).expand(2, 2, 4, 1)], -1)
    weights = torch.softmax(logits, -1)[..., :-1]
    return AttentionRecord(
        name="attn",
        layer=0,
        call=0,
        kind="self",
        num_heads=2,
        num_kv_heads=2,
        heads=(0, 1),
        kv_heads=(0, 1),
        scores=scores if with_scores else None,
        weights=weights,
        allowed=allowed.clone(),
        sinks=sinks,
    )


def test_summary_row_sum_error_accounts_for_sink_mass():
    rec = sink_record()
    assert (rec.weights.sum(-1) < 0.99).any()  # the sinks take visible mass
    s = Capture([rec]).summary()
    assert (s.row_sum_error < 1e-6).all()
    leaky = dataclasses.replace(rec, weights=rec.weights * 1.01)  # now the rows are wrong by 1% of their sum
    worst = float((rec.weights.sum(-1) * 0.01).amax())
    assert Capture([leaky]).summary().row_sum_error.max() == pytest.approx(worst, rel=1e-4)
    # without the scores the sink mass is unknown: NaN, not a false alarm
    blind = Capture([sink_record(with_scores=False)]).summary()
    assert blind.row_sum_error.isna().all() and (blind.rows == 8).all()


def test_frames_name_the_records_they_leave_out():
    model = torch.nn.Sequential(MultiHeadAttention(8, num_heads=2), MultiHeadAttention(8, num_heads=2))
    with attnprobe.capture(model, keep=["q"]) as only_q:
        model(torch.randn(1, 3, 8))
    with pytest.warns(
        attnprobe.AttnprobeWarning, match=r"to_frame\(\) left out 2 record.*layer 0 call 0 \('0'\), layer 1"
    ):
        df = only_q.to_frame()
    assert len(df) == 0
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"summary\(\) left out 2 record.*keep= including 'weights'"):
        assert len(only_q.summary()) == 0
    with attnprobe.capture(model, keep=["scores"]) as scores_only:
        model(torch.randn(1, 3, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(scores_only.to_frame()) == 2 * 2 * 3 * 3  # scores are enough for the frame: no warning
    with pytest.warns(attnprobe.AttnprobeWarning, match="summary"):
        scores_only.summary()


def test_summary_of_a_model_with_attention_sinks():
    from hf_helpers import build, inputs

    model = build("gpt_oss", "eager")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**inputs("gpt_oss", "left"))
    assert all(r.sinks is not None for r in cap)
    real = [r.weights.sum(-1)[r.allowed_for_heads().any(-1)] for r in cap]
    assert max(float((1 - s).abs().max()) for s in real) > 1e-3  # the sinks take visible mass
    s = cap.summary()
    assert len(s) == 2 * 4 and (s.row_sum_error < 1e-5).all()
