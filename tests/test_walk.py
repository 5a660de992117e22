"""Opening a capture walks the model's module tree once; what the readers derive from the walk matches the tree."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import build, inputs
from torch import nn

import attnprobe
from attnprobe.probe.walk import ModuleWalk


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5"])
def test_a_capture_walks_the_model_once(name, monkeypatch):
    """Every reader of the tree (sites, parents, configs, encoder/decoder split, compiled and scripted modules, the
    search for code calling sdpa) shares one walk: ``named_modules`` runs once on the model per capture."""
    model = build(name)
    batch = inputs(name)
    walks = []
    original = nn.Module.named_modules

    def counted(self, *args, **kwargs):
        if self is model:
            walks.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    with torch.no_grad(), attnprobe.capture(model, keep=["weights"]) as cap:
        model(**batch)
    assert len(cap) > 0
    assert len(walks) == 1


def test_the_walks_parents_and_configs():
    class WithProperty(nn.Module):
        @property
        def config(self):
            return "from a property"

    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared, WithProperty()), nn.Sequential(shared))
    model.config = "on the instance"
    walk = ModuleWalk(model)
    assert walk == list(model.named_modules())
    old = {}  # the parent map as it was computed before the walk: first parent in module order, through children()
    for parent in model.modules():
        for child in parent.children():
            old.setdefault(id(child), parent)
    assert walk.parents == old and walk.parents[id(shared)] is model[0]
    assert walk.configs == [(model, "on the instance"), (model[0][1], "from a property")]
    assert walk.classes == {nn.Sequential, nn.Linear, WithProperty}
