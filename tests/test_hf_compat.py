"""What attnprobe relies on in transformers (hooks/hf/compat.py): found without depending on names, and a
warning naming the release when a release changes it."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from hf_helpers import CACHE_ARG, build, inputs, transformers
from transformers import DynamicCache

import attnprobe
from attnprobe.hooks.hf import compat as hf_compat

NEW = 3


def _generate(model, batch):
    return model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("where", ["keyword", "other keyword", "positional"])
def test_the_cache_is_found_by_its_type_whatever_its_keyword(where):
    cache = DynamicCache()
    args, kwargs = {
        "keyword": ((), {CACHE_ARG: cache}),
        "other keyword": ((), {"kv_memory": cache}),
        "positional": ((torch.ones(1), None, cache), {}),
    }[where]
    assert hf_compat.find_cache(args, {"use_cache": True, **kwargs}, hf_compat.cache_class()) is cache
    assert hf_compat.find_cache((torch.ones(1),), {"past": None}, hf_compat.cache_class()) is None


def test_the_cache_keyword_of_the_installed_release():
    model = build("llama")
    assert CACHE_ARG in inspect.signature(transformers.LlamaModel.forward).parameters
    assert hf_compat.cache_argument_name() == CACHE_ARG
    # a cache passed positionally (as a wrapper might) still numbers the steps
    batch = inputs("llama", "right", length=4)
    with torch.no_grad():
        out = model.model(batch["input_ids"], batch["attention_mask"], None, DynamicCache(), use_cache=True)
        cache = getattr(out, CACHE_ARG)
        with attnprobe.capture(model) as cap:
            model.model(torch.tensor([[5], [6]]), torch.ones(2, 5, dtype=torch.long), None, cache)
    assert [(r.step, r.query_offset, r.key_len) for r in cap] == [(0, 4, 5), (0, 4, 5)]


def test_generation_steps_are_recorded_on_the_installed_release():
    model = build("llama")
    batch = inputs("llama", "left", length=5)
    with torch.no_grad():
        plain = _generate(model, batch)
        with attnprobe.capture(model) as cap:
            seq = _generate(model, batch)
    assert torch.equal(plain, seq)
    assert sorted({r.step for r in cap}) == list(range(NEW))
    assert attnprobe.stitch(cap)[0].weights.shape[-1] == 5 + NEW - 1


def test_a_cache_attnprobe_does_not_recognise_is_said_with_the_release(monkeypatch):
    """Simulates a release that moves the cache's base class: attnprobe no longer recognises the argument.
    It warns once, naming the transformers release and the argument's type, instead of writing records that
    look complete; the query positions then come from the lengths, so the checks stay right."""

    class MovedCache:  # what attnprobe would look for if transformers moved its Cache class
        pass

    monkeypatch.setattr(hf_compat, "cache_class", lambda: MovedCache)
    monkeypatch.setattr(hf_compat, "_WARNED", set())
    model = build("llama")
    batch = inputs("llama", "left", length=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), attnprobe.capture(model) as cap:
            seq = _generate(model, batch)
    said = [str(w.message) for w in caught if issubclass(w.category, attnprobe.AttnprobeWarning)]
    assert len(said) == 1, said
    assert f"transformers {transformers.__version__}" in said[0] and "DynamicCache" in said[0]
    assert "generation steps are not recorded" in said[0]
    assert all(r.step is None for r in cap)
    decode = [r for r in cap if r.query_len == 1]
    assert decode and all(r.query_offset == r.key_len - 1 for r in decode)
    assert attnprobe.check(cap, causal=True).ok
    assert seq.shape[1] == 5 + NEW


def test_registries_that_are_gone_are_refused_by_release(monkeypatch):
    from transformers.modeling_utils import AttentionInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping", None)
    with pytest.raises(
        attnprobe.UnsupportedModelError, match=rf"transformers {transformers.__version__}: .*_global_mapping"
    ):
        hf_compat.attention_registry()
