"""Invariant checks on ``generate`` captures of tiny Hugging Face models: KV-cache steps (query positions
offset), sliding-window caches (keys are cache slots holding the most recent positions) and right-padded
causal batches give no false positive with declarations, and a padding bug is still caught at the step
where it happens."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnprobe

pytest.importorskip("transformers")
from hf_helpers import build, hook_counts

PROMPT = 6
NEW = 4


def prompt(padding: str):
    """Two prompts of 6 tokens, row 0 padded by two on ``padding``'s side. No token is the pad id (0), so
    ``generate`` cannot infer the mask when it is not passed: the padded tokens are then attended."""
    ids = torch.randint(3, 100, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[0, :2] = 0 if padding == "left" else 1
    mask[0, -2:] = 0 if padding == "right" else 1
    return ids, mask


def generate(model, ids, mask=None, records: int = 2 * NEW):
    """Greedy ``generate`` under capture (``records``: how many it must give: 2 layers, the prompt and 3 decode
    steps); returns (the mask of the whole sequence, the capture)."""
    before = hook_counts(model)
    kwargs = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad(), attnprobe.capture(model) as cap:
        out = model.generate(
            input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs
        )
    assert hook_counts(model) == before
    assert out.shape[1] == PROMPT + NEW and len(cap) == records
    base = torch.ones_like(ids) if mask is None else mask
    return torch.cat([base, torch.ones(2, NEW, dtype=torch.long)], dim=1), cap


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize(
    "family, attn", [("mistral", "sdpa"), ("mistral", "eager"), ("gemma2", "eager"), ("gpt_oss", "eager")]
)
def test_sliding_window_generation_with_declarations_has_no_false_positive(family, attn, padding):
    """sliding_window=3: decode steps of sliding layers keep the 2 latest keys plus the new one (Gemma2 and
    GPT-OSS alternate them with full-cache layers; GPT-OSS adds sinks)."""
    model = build(family, attn)
    ids, mask = prompt(padding)
    full, cap = generate(model, ids, mask)
    steps = [r for r in cap if r.step]
    assert all(r.query_offset == PROMPT + r.step - 1 for r in steps)
    # the cache dropped old keys: keys are slots, not positions (query 8 sees keys 6, 7, 8 in slots 0, 1, 2)
    sliding = [r for r in steps if r.sliding_window]
    assert sliding and all(r.key_len == 3 for r in sliding)
    assert all(r.key_len == r.query_offset + 1 for r in steps if not r.sliding_window)
    result = attnprobe.check(cap, causal=True, attention_mask=full)
    assert result.violations == (), result.table()
    assert result.skipped == () and result.coverage["padding"] == result.coverage["causal"] == len(cap)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_right_and_left_padded_gpt2_generation_has_no_false_positive(attn, padding):
    model = build("gpt2", attn)
    ids, mask = prompt(padding)
    full, cap = generate(model, ids, mask)
    for declared in ({}, {"causal": True}, {"causal": True, "attention_mask": full}):
        result = attnprobe.check(cap, **declared)
        assert result.ok and result.verified, (declared, result.table())
    assert attnprobe.check(cap, causal=True, attention_mask=full).coverage["padding"] == len(cap)
    stitched = attnprobe.stitch(cap)
    assert attnprobe.check(stitched, causal=True, attention_mask=full).violations == ()


@pytest.mark.parametrize("family", ["mistral", "gpt2"])
def test_generation_without_the_padding_mask_is_caught_at_the_decode_steps(family):
    """Right padding, ``generate`` called without ``attention_mask``: the prompt's padded queries only
    look back, but every new token attends the two padded keys (positions 4 and 5)."""
    model = build(family, "sdpa")
    ids, mask = prompt("right")
    _, cap = generate(model, ids)  # the bug: attention_mask not passed
    full = torch.cat([mask, torch.ones(2, NEW, dtype=torch.long)], dim=1)
    assert attnprobe.check(cap, causal=True).ok  # self-consistent: only the declaration knows the padding
    result = attnprobe.check(cap, causal=True, attention_mask=full)
    errors = result.errors
    assert errors and {v.check for v in errors} == {"padding"}, result.table()
    assert {v.batch for v in errors} == {0}
    # key positions, not cache slots: under the window of 3, query 6 holds keys 4, 5, 6 in slots 0, 1, 2
    keys_by_query = {v.queries: v.keys for v in errors}
    if family == "mistral":
        assert keys_by_query == {(6,): (4, 5), (7,): (5,)} and {v.step for v in errors} == {1, 2}, result.table()
    else:
        assert keys_by_query == {(6,): (4, 5), (7,): (4, 5), (8,): (4, 5)}, result.table()


def test_prompt_mask_declared_for_a_generation_says_what_to_declare():
    model = build("gpt2", "sdpa")
    ids, mask = prompt("left")
    _, cap = generate(model, ids, mask)
    result = attnprobe.check(cap, causal=True, attention_mask=mask)  # the prompt's mask only
    assert result.ok and result.coverage["padding"] == 2  # the prefill records
    (reason,) = {s for s in result.skipped if s.startswith("padding")}
    assert reason.startswith("padding: the declared attention_mask has 6 positions, fewer than the keys")
    assert reason.endswith("(6 record(s), layers 0, 1)")
    assert "the prompt's mask followed by ones for the generated tokens" in reason


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_mask_declared_for_an_encoder_decoder_generation_is_not_read_as_decoder_padding(family):
    """One mask for every layer is the encoder input's: the encoder and cross-attention read it; the decoder
    self-attention's keys are decoder tokens, so its left padding (encoder positions 0, 1) is no reason to
    flag decoder keys 0, 1 (it was, at every step whose keys the prompt's mask covered)."""
    model = build(family, "eager")
    ids, mask = prompt("left")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    decoder_self = [r for r in cap if r.meta.get("stack") == "decoder" and r.kind == "self"]
    assert decoder_self and max(r.key_len for r in decoder_self) <= PROMPT  # all within the prompt's length
    result = attnprobe.check(cap, attention_mask=mask)
    assert result.violations == (), result.table()
    assert result.coverage["padding"] == len(cap) - len(decoder_self)
    (reason,) = [s for s in result.skipped if s.startswith("padding")]
    assert "decoder self-attention" in reason and "attention_mask={layer: mask}" in reason
    # declared per layer, the decoder gets its own mask (no padding in the generated tokens) and is checked too
    layers = {r.layer for r in decoder_self}
    per_layer = {r.layer: (torch.ones(2, NEW, dtype=torch.long) if r.layer in layers else mask) for r in cap}
    result = attnprobe.check(cap, attention_mask=per_layer)
    assert result.violations == () and result.coverage["padding"] == len(cap), result.table()
    # the encoder's padding is still enforced where it applies: declaring row 1's first tokens padded is caught
    wrong = mask.clone()
    wrong[1, :2] = 0
    flagged = attnprobe.check(cap, attention_mask=wrong).errors
    assert flagged and {v.batch for v in flagged} == {1}
    assert {v.layer for v in flagged} and not {v.layer for v in flagged} & layers


def test_frames_and_labels_of_sliding_window_steps_use_key_positions():
    """A sliding-window cache keeps the latest keys: slot i of a decode step holds position key_start + i (query 8
    sees 6, 7, 8). Frames, token labels and the summary's diagonal read positions, as the checks do (they read
    slots: key_pos 0, 1, 2 for query 8, the tokens of positions 0-2, and no diagonal at all)."""
    from attnprobe.reports._common import record_labels

    model = build("mistral", "eager")
    ids, mask = prompt("right")
    _, cap = generate(model, ids, mask)
    steps = cap.select(steps=[1, 2, 3])
    frame = steps.to_frame()
    assert frame.key_pos.min() == 4 and frame.key_pos.max() == PROMPT + NEW - 2
    assert ((frame.query_pos - frame.key_pos).between(0, 2)).all()  # the window: the query and the 2 before it
    assert frame[frame.query_pos == frame.key_pos].allowed.all()
    words = [[f"w{b}.{p}" for p in range(PROMPT + NEW)] for b in range(2)]
    tokens = steps.to_frame(tokens=words)
    assert (tokens.key_token.astype(str) == "w" + tokens.batch.astype(str) + "." + tokens.key_pos.astype(str)).all()
    last = steps.select(steps=[3], layers=[0])[0]
    assert record_labels(last, 1, words, None).key == ["w1.6", "w1.7", "w1.8"]
    summary = steps.summary().set_index(["layer", "head"])
    expected = torch.stack([r.weights[..., -1] for r in steps.select(layers=[0])]).mean(dim=(0, 1, 3))  # own slot
    assert torch.allclose(
        torch.tensor(summary.loc[0].diagonal_mass.to_numpy(), dtype=torch.float32), expected, atol=1e-6
    )
    assert [r.key_start for r in steps.select(layers=[0])] == [4, 5, 6] and cap[0].key_start == 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chunked_attention_generation_counts_chunks_from_each_rows_first_token(attn):
    """Llama 4's chunked layers start a left-padded row's chunks at its first token (transformers'
    ``chunked_overlay``), and their decode-step caches keep only the chunk's keys, dropping the padding: the model's
    own ``chunk_size`` declaration reads where each row starts from the stack's mask (``left_padding``), so the
    decode steps hold with nothing declared (it had reported weight outside the chunk on the padded row)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        max_position_embeddings=64,
        attention_chunk_size=4,
        layer_types=["full_attention", "chunked_attention"],
        no_rope_layers=[0, 1],
        pad_token_id=0,
    )
    model = transformers.Llama4ForCausalLM._from_config(config, attn_implementation=attn).eval()
    ids, mask = prompt("left")
    full, cap = generate(model, ids, mask)
    dropped = [r for r in cap if r.step and r.key_len < r.query_offset + 1]  # chunk caches past the padding
    assert dropped and all(r.meta["left_padding"] == [2, 0] for r in dropped)
    for declared in ({}, {"causal": True}, {"causal": True, "attention_mask": full}):
        result = attnprobe.check(cap, **declared)
        assert result.violations == (), result.table()


def test_minimax_decode_steps_sit_at_their_positions_and_a_dropped_row_is_caught():
    """MiniMax's cache says 0 tokens on its lightning (linear) attention layers: the decode steps' positions are read
    from a layer that holds keys (they had been read as 0, and check() reported future keys). transformers 5.24's
    MiniMax then builds each decode step's mask over one key, so a left-padded row attends no key at all (its
    logits move); check() reports that row as an error with nothing declared, and passes the unpadded batch."""
    import transformers
    from test_hf_sweep import FAMILIES

    torch.manual_seed(0)
    config = transformers.MiniMaxConfig(**FAMILIES["minimax"][1])  # a lightning layer, then a softmax one
    model = transformers.MiniMaxForCausalLM(config).eval()
    ids, _ = prompt("left")
    for mask in (None, prompt("left")[1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)  # its lightning layer is left out
            _, cap = generate(model, ids, mask, records=NEW)  # one attention layer
        steps = [r for r in cap if r.step is not None]
        assert [r.query_offset for r in steps] == [PROMPT + s for s in range(len(steps))]
        found = list(attnprobe.check(cap).errors)
        if mask is None:
            assert found == [], found
        else:
            assert found and all(v.check == "empty_rows" and v.batch == 0 and v.step is not None for v in found)
            assert "may attend no key, not even their own position" in found[0].message
