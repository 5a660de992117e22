"""Flash attention (``flash_attention_2``, ``flash_attention_3``, hub flash kernels) captured on its kernel (issue 32).

The records are recomputed from q and k with the call's own semantics: documents from the padding mask, the varlen
``cu_seq_lens`` or packed ``position_ids``, causal aligned to the lower right, sliding window, softcap, grouped-query
heads. The real kernels need CUDA: on a CPU the test installs ``flash_standin`` (a faithful pure-torch flash-attn)
where transformers loads flash-attn from; every test id says which ran (``stand-in-cpu`` or ``flash-attn-cuda``).
"""

from __future__ import annotations

import importlib.util

import flash_standin
import pytest
import torch
from hf_helpers import build, max_error_on_real_rows, twin

import attnprobe


def _real_kernel() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


RUNS = [
    pytest.param("stand-in", id="stand-in-cpu"),
    pytest.param(
        "cuda",
        id="flash-attn-cuda",
        marks=pytest.mark.skipif(not _real_kernel(), reason="the real kernel needs CUDA and flash-attn (none here)"),
    ),
]


@pytest.fixture(params=RUNS)
def run(request, monkeypatch):
    """Which kernel runs: ``"stand-in"`` (installed for this test) or ``"cuda"`` (flash-attn itself)."""
    if request.param == "stand-in":
        flash_standin.install(monkeypatch, "flash_attention_2")
    return request.param


def _on(model, run: str, implementation: str = "flash_attention_2"):
    """``model`` running ``implementation``: on the GPU in bfloat16 for the real kernel, as loaded."""
    if run == "cuda":
        model = model.to("cuda", torch.bfloat16)
    model.config._attn_implementation_internal = implementation  # what from_pretrained(attn_implementation=) sets
    return model


def _to(batch: dict, model) -> dict:
    device = next(model.parameters()).device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _tolerance(run: str) -> float:
    return 1e-5 if run == "stand-in" else 2e-2  # bfloat16 on the GPU


def _capture(model, batch: dict, **options):
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model, **options) as cap:
            out = model(**batch).logits
    return plain, out, cap


def _padded(length: int = 9) -> dict:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, :3] = 0  # left padding: flash unpads, the padded rows attend nothing
    return {"input_ids": torch.randint(3, 100, (2, length), generator=g), "attention_mask": mask}


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_padded_batch_gives_the_eager_weights(family, run, assert_no_hooks):
    """Llama (grouped-query heads) and Gemma2 (softcap, a sliding window of 3 in every other layer) on flash: outputs
    bitwise those of an uncaptured run, weights those of the eager model on every real query row."""
    model = _on(build(family), run)
    batch = _to(_padded(), model)
    plain, out, cap = _capture(model, batch)
    assert torch.equal(plain, out) and model.config._attn_implementation == "flash_attention_2"
    assert len(cap) == 2 and {r.backend for r in cap} == {"flash_attention_2"}
    if run == "stand-in":
        assert flash_standin.CALLS and set(flash_standin.CALLS) == {"flash_attn_varlen_func"}  # unpadded: varlen
    with torch.no_grad():
        eager = twin(model, "eager")(**batch, output_attentions=True).attentions
    for r, w in zip(cap, eager, strict=True):
        assert max_error_on_real_rows(r, w) <= _tolerance(run)
        assert not r.allowed[0, :, :3].any()  # padded query rows: the kernel never sees them
    if family == "gemma2":
        assert cap[0].sliding_window == 3 and cap[0].softcap == 0.5
        assert cap[0].allowed[1, 0, 8].tolist() == [False] * 6 + [True] * 3  # the window, the query included
    assert attnprobe.check(cap, causal=True, attention_mask=batch["attention_mask"]).ok
    assert_no_hooks(model)


def _packed() -> dict:
    """Three documents of 4, 3 and 5 tokens in one row, positions restarting (a padding-free collator's batch)."""
    g = torch.Generator().manual_seed(2)
    return {
        "input_ids": torch.randint(3, 100, (1, 12), generator=g),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]),
        "use_cache": False,
    }


DOCUMENTS = [(0, 4), (4, 7), (7, 12)]


def _alone(model, batch: dict, start: int, end: int) -> list[torch.Tensor]:
    """The weights of each layer for one document run alone, on the same kernel."""
    one = {"input_ids": batch["input_ids"][:, start:end], "use_cache": False}
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        model(**one)
    return [r.weights for r in cap]


@pytest.mark.parametrize("varlen", ["position_ids", "cu_seq_lens"])
def test_a_packed_batch_gives_each_document_its_own_weights(varlen, run, assert_no_hooks):
    """Packed sequences (TRL's padding-free collator, axolotl's packing): the kernel runs varlen, so the records'
    ``allowed`` is block diagonal, and each document gets the weights it gets when run alone."""
    model = _on(build("llama"), run)
    batch = _packed()
    if varlen == "cu_seq_lens":  # the collator hands the lengths over itself (return_flash_attn_kwargs=True)
        cu = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    batch = _to(batch, model)
    plain, out, cap = _capture(model, batch)
    assert torch.equal(plain, out)
    if run == "stand-in":
        assert set(flash_standin.CALLS) == {"flash_attn_varlen_func"}
    blocks = torch.zeros(12, 12, dtype=torch.bool)
    for a, b in DOCUMENTS:
        blocks[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    for r in cap:
        assert torch.equal(r.allowed[0, 0].cpu(), blocks)
    for a, b in DOCUMENTS:
        for r, alone in zip(cap, _alone(model, batch, a, b), strict=True):
            torch.testing.assert_close(r.weights[..., a:b, a:b], alone, atol=_tolerance(run), rtol=0)
    assert attnprobe.check(cap).ok
    assert_no_hooks(model)


def test_a_batch_of_several_rows_is_not_packed_by_the_kernel(run):
    """transformers runs flash varlen from packed position ids only for a batch of one row: with two rows the kernel
    attends across the documents of a row, and the records say so (a check declaring the documents would catch it)."""
    model = _on(build("llama"), run)
    batch = _packed()
    batch = _to(
        {**batch, "input_ids": batch["input_ids"].expand(2, -1), "position_ids": batch["position_ids"].expand(2, -1)},
        model,
    )
    _, _, cap = _capture(model, batch)
    if run == "stand-in":
        assert set(flash_standin.CALLS) == {"flash_attn_func"}
    assert torch.equal(cap[0].allowed[0, 0].cpu(), torch.ones(12, 12, dtype=torch.bool).tril())


def test_queries_after_cached_keys_are_aligned_to_the_lower_right(run, assert_no_hooks):
    """Three new queries over ten keys (a prefill continued with a cache): flash's causal mask is aligned to the
    lower right, so query i sees keys up to 7 + i, as the eager model computes it."""
    import transformers

    model = _on(build("llama"), run)
    g = torch.Generator().manual_seed(3)
    ids = _to({"input_ids": torch.randint(3, 100, (1, 10), generator=g)}, model)["input_ids"]
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :7], cache=cache)
        with attnprobe.capture(model) as cap:
            model(input_ids=ids[:, 7:], cache=cache)
    allowed = cap[0].allowed[0, 0].cpu()
    assert allowed.shape == (3, 10) and [int(row.sum()) for row in allowed] == [8, 9, 10]
    with torch.no_grad():
        eager = twin(model, "eager")(input_ids=ids, output_attentions=True).attentions
    for r, w in zip(cap, eager, strict=True):
        torch.testing.assert_close(r.weights, w[:, :, 7:], atol=_tolerance(run), rtol=0)
    assert attnprobe.check(cap, causal=True).ok
    assert_no_hooks(model)


@pytest.mark.parametrize("implementation", ["flash_attention_3", "kernels-community/flash-attn2"])
def test_flash_attention_3_and_hub_kernels(implementation, monkeypatch, assert_no_hooks):
    """Every name transformers runs its flash function under is read the same way (stand-in only: the real kernels
    of these names are not installed anywhere this suite runs)."""
    flash_standin.install(monkeypatch, implementation)
    model = _on(build("llama"), "stand-in", implementation)
    batch = _padded()
    plain, out, cap = _capture(model, batch)
    assert torch.equal(plain, out) and flash_standin.CALLS
    assert [r.backend for r in cap] == [implementation] * 2
    with torch.no_grad():
        eager = twin(model, "eager")(**batch, output_attentions=True).attentions
    assert all(max_error_on_real_rows(r, w) <= 1e-5 for r, w in zip(cap, eager, strict=True))
    assert_no_hooks(model)


def test_statistics_are_read_block_by_block(run, monkeypatch):
    """``keep=("stats",)`` over flash: the documents are read a block of rows at a time, never as a (query x key)
    tensor, and the statistics are those of the weights."""
    from attnprobe.hooks.hf import kernels

    model = _on(build("llama"), run)
    batch = _to(_packed(), model)
    asked: list[tuple[int, int]] = []
    documents = kernels.FlashDocuments.__call__

    def counted(self, rows, c, d):
        asked.append((len(rows), d - c))
        return documents(self, rows, c, d)

    def whole(*args, **kwargs):
        raise AssertionError("a statistics capture built a whole (query x key) permission")

    monkeypatch.setattr(kernels.FlashDocuments, "__call__", counted)
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(kernels, "dense", whole)
            with attnprobe.capture(model, keep=("stats",), block_bytes=512) as stats:
                model(**batch)
        with attnprobe.capture(model, keep=("weights",)) as full:
            model(**batch)
    assert any(k < 12 for _, k in asked)  # blocks of keys (the engine's block_bytes), not whole rows
    for s, f in zip(stats, full, strict=True):
        assert s.weights is None and s.allowed is None
        w = f.weights.float()
        entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)  # (batch, head, query)
        torch.testing.assert_close(s.stats["entropy"].float(), entropy, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.stats["max_weight"].float(), w.amax(-1), atol=1e-5, rtol=1e-5)
