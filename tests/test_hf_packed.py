"""Packed sequences on sdpa and eager (issue 32): a batch whose ``position_ids`` restart (documents packed into one
row, ``use_cache=False``, as in training) gives records whose ``allowed`` is the block-diagonal mask transformers
built for the kernel, and each document the weights it gets when run alone. Flex and flash are tested the same way
in ``test_hf_flex.py`` and ``test_hf_flash.py``."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import build, twin

import attnprobe

POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
DOCUMENTS = [[(0, 4), (4, 7), (7, 12)], [(0, 6), (6, 12)]]


def _batch() -> dict:
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "position_ids": POSITIONS, "use_cache": False}


def _block_diagonal(row: int) -> torch.Tensor:
    """``(query, key)``: causal inside each document of ``row``, nothing across documents."""
    inside = torch.zeros(12, 12, dtype=torch.bool)
    for a, b in DOCUMENTS[row]:
        inside[a:b, a:b] = True
    return inside & torch.ones(12, 12, dtype=torch.bool).tril()


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_packed_batch_gives_each_document_its_own_weights(llama, implementation, assert_no_hooks):
    model = twin(llama, implementation)
    batch = _batch()
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            out = model(**batch).logits
    assert torch.equal(plain, out) and len(cap) == 2
    for row in range(2):
        for r in cap:
            assert torch.equal(r.allowed[row, 0], _block_diagonal(row))
        for a, b in DOCUMENTS[row]:
            with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as alone:
                model(input_ids=batch["input_ids"][row : row + 1, a:b], use_cache=False)
            for r, one in zip(cap, alone, strict=True):
                torch.testing.assert_close(r.weights[row : row + 1, :, a:b, a:b], one.weights, atol=1e-6, rtol=0)
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


def test_statistics_of_a_packed_batch(llama):
    """``keep=("stats",)`` on the packed batch: the statistics of the block-diagonal weights."""
    model = twin(llama, "sdpa")
    batch = _batch()
    with torch.no_grad():
        with attnprobe.capture(model, keep=("stats",)) as stats:
            model(**batch)
        with attnprobe.capture(model, keep=("weights",)) as full:
            model(**batch)
    for s, f in zip(stats, full, strict=True):
        w = f.weights.float()  # (batch, head, query, key)
        torch.testing.assert_close(s.stats["max_weight"], w.amax(-1))
        entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)  # (batch, head, query)
        torch.testing.assert_close(s.stats["entropy"], entropy, atol=1e-5, rtol=1e-5)
