"""Every kind of attention in one model; what a capture leaves behind (nothing); a model with no attention."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_helpers import HeadList, Mixed, SdpaBlock, leftovers

import attnprobe
from attnprobe.hooks.torch_mha import fastpath_disabled

X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))


def test_all_kinds_in_one_capture():
    model = Mixed().eval()
    with torch.no_grad():
        with fastpath_disabled():
            plain = model(X)
        with attnprobe.capture(model, modules=[model.hand]) as cap:
            got = model(X)
    assert torch.equal(plain, got)
    # modules found before the run are numbered in module order, layers found while it runs come after
    assert [(r.name, r.layer, r.backend) for r in cap] == [
        ("own", 0, "attnprobe"),
        ("mha", 1, "torch_mha"),
        ("sdpa", 3, "sdpa"),
        ("hand", 2, "hand-written"),
    ]
    assert cap.info["attention_modules"] == ("own", "mha", "hand", "sdpa")
    assert cap.layers == (0, 1, 2, 3)
    for rec in cap:
        assert rec.weights.shape == (2, 4, 6, 6) and rec.q.shape == (2, 4, 6, 4), rec.name
        assert {"q", "k", "v", "scores", "weights", "output", "allowed"} <= rec.identified, rec.name
        torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 4, 6))
    assert cap.record(0).causal and cap.record(2).causal and not cap.record(3).causal
    assert leftovers(model) == []


def test_same_selection_and_budget_rules_for_every_kind():
    model = Mixed().eval()
    with attnprobe.capture(model, modules=[model.hand], heads=[2], keep=["weights"]) as cap:
        model(X)
    assert [(r.layer, r.heads, tuple(r.weights.shape)) for r in cap] == [
        (0, (2,), (2, 1, 6, 6)),
        (1, (2,), (2, 1, 6, 6)),
        (3, (2,), (2, 1, 6, 6)),
        (2, (2,), (2, 1, 6, 6)),
    ]
    assert all(r.q is None and r.k is None for r in cap)
    with attnprobe.capture(model, modules=[model.hand], layers=[-1, 3]) as picked:
        model(X)
    assert [r.layer for r in picked] == [3, 2]  # -1 is the last layer found before the run
    first_two = cap[0].nbytes + cap[1].nbytes
    with pytest.raises(attnprobe.CaptureBudgetError, match=r"layer 3 \('sdpa'"):
        with attnprobe.capture(
            model, modules=[model.hand], heads=[2], keep=["weights"], max_bytes=first_two + 10
        ) as cut:
            model(X)
    assert [r.layer for r in cut] == [0, 1] and cut.nbytes <= first_two + 10
    assert leftovers(model) == []


class Boom(nn.Module):
    """Runs every kind of attention, then fails."""

    def __init__(self):
        super().__init__()
        self.inner = Mixed()

    def forward(self, x):
        self.inner(x)
        raise RuntimeError("boom")


@pytest.mark.parametrize("modules", [None, "auto"])
def test_nothing_left_behind_after_an_exception(modules):
    model = Boom().eval()
    with pytest.raises(RuntimeError, match="boom"):
        with attnprobe.capture(model, modules=modules) as cap:
            model(X)
    assert leftovers(model) == []
    assert len(cap) == (4 if modules else 3)  # what ran before the error is kept
    # and after an error raised inside a hand-written head, mid-trace
    heads = HeadList().eval()
    with pytest.raises(RuntimeError):
        with attnprobe.capture(heads, modules=[heads]):
            heads(torch.randn(2, 6, 5))  # wrong width: the first head's projection fails
    assert leftovers(heads) == []


def test_nothing_left_behind_after_exit():
    model = Mixed().eval()
    with attnprobe.capture(model, modules="auto") as cap:
        model(X)
    # "auto" traces everything, yet what other adapters read (own module's softmax, MHA internals) is not doubled
    assert [r.backend for r in cap] == ["attnprobe", "torch_mha", "sdpa", "hand-written"] and leftovers(model) == []
    assert torch.backends.mha.get_fastpath_enabled()


def test_nested_captures_each_record_every_kind():
    model = Mixed().eval()
    with attnprobe.capture(model, modules=[model.hand]) as outer:
        with attnprobe.capture(model, modules=[model.hand], keep="weights") as inner:
            model(X)
        assert len(torch.overrides._get_current_function_mode_stack()) == 1
        model(X)
    assert [r.layer for r in inner] == [0, 1, 3, 2]
    assert [(r.layer, r.call) for r in outer] == [(0, 0), (1, 0), (3, 0), (2, 0), (0, 1), (1, 1), (3, 1), (2, 1)]
    for a, b in zip(inner, outer):
        torch.testing.assert_close(a.weights, b.weights)
    assert leftovers(model) == []


def test_a_model_with_no_attention_is_refused_up_front_or_warned_at_exit():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    # no module's code can reach attention that attnprobe reads without being asked: a clear error
    with pytest.raises(attnprobe.UnsupportedModelError, match=r"no attention found in Sequential.*modules='auto'"):
        with attnprobe.capture(model):
            model(X)
    # code that might call sdpa but does not: only the run can tell, so a warning at exit
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"no attention found in SdpaBlock.*modules='auto'") as caught:
        with attnprobe.capture(SdpaBlock()) as cap:
            pass
    assert len(cap) == 0 and len(caught) == 1 and caught[0].filename == __file__
    with pytest.warns(attnprobe.AttnprobeWarning, match="no attention found in Sequential"):
        with attnprobe.capture(model, modules="auto"):
            model(X)
    assert leftovers(model) == []


def test_capture_info_lists_layers_found_while_running():
    model = nn.Sequential(SdpaBlock(), SdpaBlock())
    with attnprobe.capture(model) as cap:
        assert cap.info["attention_modules"] == ()
        model(X)
    assert cap.info["attention_modules"] == ("0", "1") and cap.info["num_heads"] == (4, 4)
    assert cap.info["adapters"] == ("functional",)
