"""Speech models: the input mask covers audio samples, not the frames attention runs over."""

from __future__ import annotations

import torch
import transformers

import attnprobe


def _wav2vec2():
    config = transformers.Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2Model(config).eval()


def test_a_sample_mask_is_not_read_as_query_padding(assert_no_hooks):
    model = _wav2vec2()
    audio = torch.randn(2, 400)
    mask = torch.ones(2, 400, dtype=torch.long)
    mask[0, 300:] = 0  # the last quarter of the first clip is padding
    with torch.no_grad():
        plain = model(audio, attention_mask=mask).last_hidden_state
        with attnprobe.capture(model) as cap:
            captured = model(audio, attention_mask=mask).last_hidden_state
    assert torch.equal(plain, captured)
    assert_no_hooks(model)
    frames = plain.shape[1]
    assert frames == 39 and len(cap) == 2
    for r in cap:
        assert r.weights.shape == (2, 2, frames, frames)
        # the last 300 samples of the mask, read as 39 frames, marked the whole first clip as padding
        assert r.query_padding is None and "query_padding" not in r.identified
        # the model's own frame-level mask still reaches the record: padded frames are not attended
        padded_keys = ~r.allowed[0, 0].any(dim=0)
        assert 0 < int(padded_keys.sum()) < frames and not r.allowed[1].logical_not().any()
    assert attnprobe.check(cap).ok


def test_a_matching_mask_still_marks_query_padding():
    model = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50
        )
    ).eval()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(input_ids=torch.randint(1, 50, (2, 5)), attention_mask=mask)
    assert cap[0].query_padding.tolist() == (mask == 0).tolist()
