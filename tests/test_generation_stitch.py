"""stitch(): per-step generation records back into one (query, key) matrix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnprobe
from attnprobe import AttnprobeError, MultiHeadAttention


def as_steps(rec, prefill: int):
    """Cut a full causal record into a prefill step and one-query decode steps, as a KV cache sees them."""
    T = rec.query_len
    cuts = [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]
    steps = []
    for step, (a, b) in enumerate(cuts):
        steps.append(
            replace(
                rec,
                step=step,
                call=step,
                query_offset=a,
                q=rec.q[:, :, a:b],
                k=rec.k[:, :, :b],
                v=rec.v[:, :, :b],
                scores=rec.scores[:, :, a:b, :b],
                weights=rec.weights[:, :, a:b, :b],
                output=rec.output[:, :, a:b],
                allowed=rec.allowed[:, :, a:b, :b],
                query_padding=rec.query_padding[:, a:b],
            )
        )
    return steps


def test_stitched_steps_equal_the_full_forward():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(2, 7, 8), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1] * 7]))
    full = cap[0]
    steps = attnprobe.Capture(as_steps(full, prefill=4) * 2)  # two generate() runs in one capture
    stitched = attnprobe.stitch(steps)
    assert len(stitched) == 2 and [r.call for r in stitched] == [0, 1]
    rec = stitched[0]
    assert rec.step is None and rec.meta["stitched_steps"] == 4
    for field in ("q", "k", "v", "weights", "output", "allowed", "query_padding"):
        assert torch.equal(getattr(rec, field), getattr(full, field)), field
    # scores of keys generated after a step were never computed: NaN there, equal elsewhere
    unseen = rec.scores.isnan()
    assert torch.equal(rec.scores[~unseen], full.scores[~unseen])
    assert not (unseen & rec.allowed).any() and unseen.any()


def test_stitch_refuses_gaps_and_compressed_keys():
    attn = MultiHeadAttention(8, num_heads=1, causal=True)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(1, 6, 8), attention_mask=torch.ones(1, 6))
    steps = as_steps(cap[0], prefill=3)
    with pytest.raises(AttnprobeError, match="expected step 1, found step 2"):
        attnprobe.stitch(attnprobe.Capture([steps[0], steps[2]]))
    window = replace(
        steps[2],
        k=steps[2].k[:, :, 1:],
        weights=steps[2].weights[..., 1:],
        scores=None,
        allowed=steps[2].allowed[..., 1:],
    )
    with pytest.raises(AttnprobeError, match="sliding-window"):
        attnprobe.stitch(attnprobe.Capture([steps[0], steps[1], window]))
    with pytest.raises(AttnprobeError, match="no generation steps"):
        attnprobe.stitch(cap)
