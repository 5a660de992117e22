"""attnprobe.token_strings: per-position token strings from a tokenizer and a batch."""

from __future__ import annotations

import pytest
import torch

import attnprobe
from attnprobe import AttnprobeError


@pytest.fixture(scope="module")
def byte_level():
    """A tiny byte-level BPE tokenizer (GPT-2 style 'Ġ' markers), trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cat sat on the mat", "the dog ate the cat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def test_batch_encoding_tensor_and_lists_give_the_same_rows(byte_level):
    batch = byte_level(["the cat sat", "the dog"], padding=True, return_tensors="pt")
    rows = attnprobe.token_strings(byte_level, batch)
    assert len(rows) == 2 and all(len(r) == batch["input_ids"].shape[1] for r in rows)
    assert rows[1][-1] == "<pad>" and any(t.startswith("Ġ") for t in rows[0])
    assert attnprobe.token_strings(byte_level, batch["input_ids"]) == rows
    assert attnprobe.token_strings(byte_level, batch["input_ids"].tolist()) == rows
    assert attnprobe.token_strings(byte_level, batch["input_ids"][0]) == rows[:1]
    assert attnprobe.token_strings(byte_level, dict(batch)) == rows


def test_text_style_reads_like_the_text(byte_level):
    ids = byte_level("the cat sat")["input_ids"]
    text = attnprobe.token_strings(byte_level, ids, style="text")[0]
    assert "".join(text) == "the cat sat" and "Ġ" not in "".join(text)


def test_bad_input_is_a_clear_error(byte_level):
    with pytest.raises(AttnprobeError, match="no 'input_ids'"):
        attnprobe.token_strings(byte_level, {"pixel_values": torch.zeros(1)})
    with pytest.raises(AttnprobeError, match="integer tensor"):
        attnprobe.token_strings(byte_level, torch.zeros(2, 3))
    with pytest.raises(AttnprobeError, match="style"):
        attnprobe.token_strings(byte_level, [1, 2], style="pretty")
    with pytest.raises(AttnprobeError, match="Hugging Face tokenizer"):
        attnprobe.token_strings("not a tokenizer", [1, 2])
    with pytest.raises(AttnprobeError, match="BatchEncoding"):
        attnprobe.token_strings(byte_level, "the cat")


def test_numpy_arrays_and_numpy_integers_are_ids_too(byte_level):
    import numpy as np

    pt = byte_level(["the cat sat", "the dog"], padding=True, return_tensors="pt")
    rows = attnprobe.token_strings(byte_level, pt)
    batch = byte_level(["the cat sat", "the dog"], padding=True, return_tensors="np")
    assert isinstance(batch["input_ids"], np.ndarray)
    assert attnprobe.token_strings(byte_level, batch) == rows
    assert attnprobe.token_strings(byte_level, batch["input_ids"]) == rows
    assert attnprobe.token_strings(byte_level, batch["input_ids"].astype(np.int32)) == rows
    assert attnprobe.token_strings(byte_level, batch["input_ids"][1]) == rows[1:]
    assert attnprobe.token_strings(byte_level, list(batch["input_ids"])) == rows  # a list of array rows
    assert attnprobe.token_strings(byte_level, [list(r) for r in batch["input_ids"]]) == rows  # numpy ints
    assert attnprobe.token_strings(byte_level, list(pt["input_ids"])) == rows  # a list of tensor rows
    assert attnprobe.token_strings(byte_level, batch, style="text") == attnprobe.token_strings(
        byte_level, pt, style="text"
    )
    with pytest.raises(AttnprobeError, match="integer array"):
        attnprobe.token_strings(byte_level, np.zeros((2, 3)))
    with pytest.raises(AttnprobeError, match="integer tensor"):
        attnprobe.token_strings(byte_level, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(AttnprobeError, match="must be integers"):
        attnprobe.token_strings(byte_level, [[1.0, 2.0]])
