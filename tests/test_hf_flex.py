"""Hugging Face models on flex attention (``attn_implementation="flex_attention"``) captured on their kernel (issue 32).

The record reads the call's ``BlockMask`` as the kernel applies it (padding, causality, sliding windows, packed
documents are all in its ``mask_mod``), and the scores as transformers' ``score_mod`` changes them (Gemma2's
softcap). Most tests run flex uncompiled (``flex_helpers.uncompiled``: torch's reference path of the same operator,
which costs no compilation); ``test_the_compiled_kernel`` runs the kernel ``torch.compile`` generates, as transformers
does by default (its first call compiles for a minute or more on a busy CPU).
"""

from __future__ import annotations

import flex_helpers
import pytest
import torch
from hf_helpers import build, max_error_on_real_rows, transformers, twin

import attnprobe

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def uncompiled():
    """Flex's reference path (the tests using it skip on a torch without one, torch 2.6: ``flex_helpers``)."""
    if not flex_helpers.FLEX_PROVEN:
        pytest.skip(flex_helpers.FLEX_SKIP.kwargs["reason"])
    with flex_helpers.uncompiled():
        yield


def _flex(family: str):
    model = build(family)
    model.set_attn_implementation("flex_attention")
    return model


def _padded() -> dict:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    return {"input_ids": torch.randint(3, 100, (2, 12), generator=g), "attention_mask": mask}


def _capture(model, batch: dict, **options):
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model, **options) as cap:
            inside = model.config._attn_implementation
            out = model(**batch).logits
    assert inside == model.config._attn_implementation == "flex_attention"
    return plain, out, cap


def _same_as_eager(model, batch: dict, cap) -> None:
    with torch.no_grad():
        eager = twin(model, "eager")(**batch, output_attentions=True).attentions
    assert len(cap) == len(eager) == 2
    for r, w in zip(cap, eager, strict=True):
        assert r.backend == "flex_attention" and r.weights_source == "recomputed"
        assert max_error_on_real_rows(r, w) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_llama_and_gemma2_give_the_eager_weights(family, uncompiled, assert_no_hooks):
    """Llama (grouped-query heads) and Gemma2 (softcap in its score_mod, a sliding window of 3 in every other
    layer's mask_mod), left padded: outputs bitwise those of an uncaptured run, weights the eager model's."""
    model = _flex(family)
    batch = _padded()
    plain, out, cap = _capture(model, batch)
    assert torch.equal(plain, out)
    _same_as_eager(model, batch, cap)
    if family == "gemma2":
        assert [r.softcap for r in cap] == [0.5, 0.5]
        assert cap[0].allowed[1, 0, 11].tolist() == [False] * 9 + [True] * 3  # the window read from the mask_mod
    assert attnprobe.check(cap, causal=True, attention_mask=batch["attention_mask"]).ok  # output_match: the kernel's
    assert_no_hooks(model)


def _packed() -> dict:
    """Two rows of packed documents, positions restarting (4 + 3 + 5 and 6 + 6 tokens), no cache: as in training."""
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    return {"input_ids": torch.randint(3, 100, (2, 12), generator=g), "position_ids": positions, "use_cache": False}


DOCUMENTS = [[(0, 4), (4, 7), (7, 12)], [(0, 6), (6, 12)]]


def test_a_packed_batch_gives_each_document_its_own_weights(uncompiled, assert_no_hooks):
    """Gemma2 (softcap, sliding window) on packed rows: ``allowed`` is block diagonal (within the window), and each
    document gets the weights it gets when run alone."""
    model = _flex("gemma2")
    batch = _packed()
    plain, out, cap = _capture(model, batch)
    assert torch.equal(plain, out)
    for row, documents in enumerate(DOCUMENTS):
        inside = torch.zeros(12, 12, dtype=torch.bool)
        for a, b in documents:
            inside[a:b, a:b] = True
        for r in cap:
            allowed = r.allowed[row, 0]
            assert not (allowed & ~inside).any() and allowed.diagonal().all()
        for a, b in documents:
            with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as alone:
                model(input_ids=batch["input_ids"][row : row + 1, a:b], use_cache=False)
            for r, one in zip(cap, alone, strict=True):
                torch.testing.assert_close(r.weights[row : row + 1, :, a:b, a:b], one.weights, atol=1e-5, rtol=0)
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


def test_statistics_are_read_block_by_block(uncompiled, monkeypatch):
    """``keep=("stats",)``: the BlockMask's mask_mod is evaluated a block at a time, never as a whole (query x key)
    permission, and the statistics are those of the weights."""
    from attnprobe.hooks.hf import kernels

    def whole(*args, **kwargs):
        raise AssertionError("a statistics capture built a whole (query x key) permission")

    model = _flex("llama")
    batch = _padded()
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(kernels, "dense", whole)
            with attnprobe.capture(model, keep=("stats",), block_bytes=1024) as stats:
                model(**batch)
        with attnprobe.capture(model, keep=("weights",)) as full:
            model(**batch)
    for s, f in zip(stats, full, strict=True):
        real = ~f.query_padding[:, None, :]  # (batch, 1, query)
        w = f.weights.float()
        rows = real.expand_as(s.stats["max_weight"])
        torch.testing.assert_close(s.stats["max_weight"][rows], w.amax(-1)[rows])
        entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)  # (batch, head, query)
        torch.testing.assert_close(s.stats["entropy"][rows], entropy[rows], atol=1e-4, rtol=1e-4)


def test_the_compiled_kernel(assert_no_hooks):
    """The kernel transformers runs by default (``torch.compile(flex_attention)``): captured without changing it, its
    output bitwise that of an uncaptured call, the recomputed weights the eager model's (and ``output_match`` holds
    them to the kernel's output). It runs on every torch declared: on torch 2.6 attnprobe's reading of transformers'
    padding ``mask_mod`` under vmap failed (".item() under vmap") until it indexed as flex does."""
    model = _flex("llama")
    batch = _padded()
    with flex_helpers.uncompiled(kernel=False):  # the BlockMask built without compiling create_block_mask: the same
        plain, out, cap = _capture(model, batch)
    assert torch.equal(plain, out)
    _same_as_eager(model, batch, cap)
    assert attnprobe.check(cap, causal=True, attention_mask=batch["attention_mask"]).ok
    assert_no_hooks(model)


def test_transformers_mask_functions_are_read_as_flex_reads_them():
    """transformers' mask functions index tensors by their index arguments (``padding_mask[batch_idx, kv_idx]``):
    the permission attnprobe reads from a BlockMask is flex's own ``create_mask``, tile by tile (full, partial and
    empty tiles of 4). On torch 2.6, vmap alone refused the padding mask; flex indexes under
    ``TransformGetItemToIndex``, and so does attnprobe."""
    import torch.nn.attention.flex_attention as flex
    from transformers.masking_utils import and_masks, causal_mask_function, padding_mask_function

    from attnprobe.hooks.hf import kernels

    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[0, :3] = False  # left padding: item 0's first 3 keys
    padding[1, 10:] = False  # right padding: item 1's last 2 keys
    mod = and_masks(causal_mask_function, padding_mask_function(padding))
    block_mask = flex.create_block_mask(mod, 2, 1, 12, 12, device="cpu", BLOCK_SIZE=4, _compile=False)
    want = flex.create_mask(mod, 2, 1, 12, 12, device="cpu")  # (batch, 1, query, key)
    read = kernels.FlexMask(block_mask, batch=2, heads=(0, 1), q_len=12, k_len=12)
    got = kernels.dense(read, 12, 12, "cpu")  # (batch, head, query, key)
    assert got.shape == (2, 2, 12, 12) and torch.equal(got, want.expand(2, 2, 12, 12))
    assert not got[0, :, :, :3].any() and got[1, 0, 11].tolist() == [True] * 10 + [False] * 2


def test_an_inner_stack_given_a_block_mask_knows_the_padded_queries(uncompiled):
    """CLIP's text model builds its mask above its encoder: under sdpa a 4-D tensor, under flex a BlockMask. The
    encoder's records take the padded query rows from the model's 2-D mask either way (under flex they had none, so
    the padded rows counted as real ones: ``empty_rows`` findings, and weights compared on them)."""
    torch.manual_seed(0)
    config = transformers.CLIPTextConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99
    )
    model = transformers.CLIPTextModel._from_config(config, attn_implementation="flex_attention").eval()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0  # right padding
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(input_ids=ids, attention_mask=mask)
    assert len(cap) == 2 and all(torch.equal(r.query_padding, mask == 0) for r in cap)
    result = attnprobe.check(cap)
    assert result.ok and not result.violations, result.table()
