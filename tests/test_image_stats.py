"""Statistics mode for long multimodal inputs: each text row's weight on the image patches, without the weights.

A statistics capture with ``image_grid=`` computes ``record.stats["image_mass"]`` block by block (query rows in
blocks, and keys in blocks too when ``block_bytes`` is small); it must equal the mass summed from a full capture's
weights, and ``attnprobe.image_mass`` must give the same table from either.
"""

from __future__ import annotations

import pytest
import torch
from image_helpers import located

import attnprobe


@pytest.mark.parametrize("family, block_bytes", [("llava", None), ("qwen2-vl", 2048)])
def test_image_mass_from_statistics_equals_the_weights(family, block_bytes):
    built, tokens, full = located(family)
    options = {} if block_bytes is None else {"block_bytes": block_bytes}
    _, stats = attnprobe.run(built.model, dict(built.inputs), keep=("stats",), image_grid=tokens, **options)
    assert all(r.weights is None and r.scores is None for r in stats)
    checked = 0
    for rec_full, rec_stats in zip(full, stats):
        keys = tokens.key_set(rec_full)
        if keys is None:
            assert "image_mass" not in rec_stats.stats
            continue
        expected = (rec_full.weights.double() * keys[:, None, None, :]).sum(-1)  # (batch, head, query)
        torch.testing.assert_close(rec_stats.stats["image_mass"].double(), expected, atol=1e-5, rtol=1e-4)
        checked += 1
    assert checked == len([r for r in full if tokens.for_record(r)])
    table_full = attnprobe.image_mass(full, image_grid=tokens)
    table_stats = attnprobe.image_mass(stats)
    assert set(table_stats["source"]) == {"stats"} and set(table_full["source"]) == {"weights"}
    assert len(table_full) == len(table_stats) > 0
    torch.testing.assert_close(
        torch.tensor(table_stats["image_mass"].to_numpy()), torch.tensor(table_full["image_mass"].to_numpy())
    )
    # text rows only: the language model's rows, image tokens and padding left out
    text_rows = int((built.inputs["input_ids"][0] != built.model.config.image_token_id).sum())
    assert set(table_stats["rows"]) == {text_rows}
