"""Direct F.scaled_dot_product_attention calls, under any import alias, found while the model runs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_helpers import SdpaBlock, leftovers, reference_weights

import attnprobe
from attnprobe.hooks.base import Adapter, Site
from attnprobe.hooks.functional import FunctionalAdapter
from attnprobe.probe.capture import CaptureSession
from attnprobe.probe.selection import Selection

X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
PAD = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]  # sdpa's bool: True = attend


def projections(block: SdpaBlock, x: torch.Tensor):
    """q (B, H, T, D), k/v (B, KVH, T, D) exactly as the block computes them."""
    B, T, _ = x.shape
    q = block.q(x).view(B, T, block.h, block.d).transpose(1, 2)
    k, v = block.kv(x).view(B, T, 2, block.kvh, block.d).permute(2, 0, 3, 1, 4)
    return q, k, v


@pytest.mark.parametrize(
    "options, mask",
    [
        ({}, None),
        ({}, PAD),
        ({}, torch.where(PAD, 0.0, float("-inf"))),  # float mask, added
        ({"causal": True}, None),
        ({"scale": 0.3}, PAD),
        ({"kv_heads": 2}, PAD),  # grouped-query attention (enable_gqa)
    ],
)
def test_aliased_sdpa_call_is_recorded(options, mask):
    block = SdpaBlock(**options).eval()
    plain = block(X, mask)
    with attnprobe.capture(block) as cap:
        got = block(X, mask)
    assert torch.equal(plain, got)  # the mode hands back the real function's result
    (rec,) = cap
    q, k, v = projections(block, X)
    assert torch.equal(rec.q, q) and torch.equal(rec.k, k) and torch.equal(rec.v, v)
    assert rec.backend == "sdpa" and rec.weights_source == "recomputed" and rec.kind == "self"
    assert rec.num_heads == 4 and rec.num_kv_heads == options.get("kv_heads", 4)
    assert rec.scaling == pytest.approx(options.get("scale", 1 / math.sqrt(4)))
    assert rec.meta["scale"] == ("explicit" if "scale" in options else "default")
    assert rec.causal is options.get("causal", False)
    expected = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    if mask is not None:
        expected = expected & PAD
    if options.get("causal"):
        expected = expected & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(rec.allowed, expected)
    group = rec.num_heads // rec.num_kv_heads
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    torch.testing.assert_close(rec.weights, reference_weights(q, k_full, rec.scaling, expected), rtol=0, atol=1e-6)
    # the output is sdpa's own, per head; weights @ V reproduces it
    torch.testing.assert_close(rec.weights @ v_full, rec.output, rtol=0, atol=1e-6)
    assert rec.identified == {"q", "k", "v", "scores", "weights", "output", "allowed"}
    assert leftovers(block) == []


def test_three_dimensional_inputs_and_cross_lengths():
    class Flat(nn.Module):
        def forward(self, q, kv):
            return F.scaled_dot_product_attention(q, kv, kv * 2)

    m = Flat()
    q, kv = torch.randn(3, 4, 8), torch.randn(3, 7, 8)
    with attnprobe.capture(m) as cap:
        m(q, kv)
    (rec,) = cap
    assert rec.kind == "cross" and rec.q.shape == (3, 1, 4, 8) and rec.weights.shape == (3, 1, 4, 7)
    assert rec.meta["kind_from"] == "lengths"


def test_sites_numbered_by_first_call_and_calls_counted():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = SdpaBlock(), SdpaBlock()

        def forward(self, x):
            x = self.b(x)  # b is called first: it gets the first layer number
            for _ in range(2):
                x = self.a(x)
            return x

    m = Loop().eval()
    with attnprobe.capture(m) as cap:
        m(X)
        m(X)
    assert [(r.name, r.layer, r.call) for r in cap] == [
        ("b", 0, 0),
        ("a", 1, 0),
        ("a", 1, 1),
        ("b", 0, 1),
        ("a", 1, 2),
        ("a", 1, 3),
    ]
    assert cap.info["attention_modules"] == ("b", "a")
    assert cap[0].meta["sdpa_at"].startswith("torch_helpers.py:")


def test_two_call_sites_in_one_module_are_two_layers():
    class SelfThenCross(nn.Module):
        def forward(self, x, ctx):
            x = F.scaled_dot_product_attention(x, x.flip(-1), x.tanh(), is_causal=True)
            return F.scaled_dot_product_attention(x, ctx, ctx.flip(-1))

    m = SelfThenCross()
    with attnprobe.capture(m) as cap:
        m(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4))
    assert [(r.layer, r.kind, r.causal) for r in cap] == [(0, "self", True), (1, "cross", False)]
    assert [r.name for r in cap] == ["", ""] and cap[0].meta["sdpa_at"] != cap[1].meta["sdpa_at"]


def test_selection_heads_and_budget_apply_to_found_layers():
    m = nn.Sequential(SdpaBlock(kv_heads=2), SdpaBlock()).eval()
    with attnprobe.capture(m, layers=[1], heads=[1, 3], keep=["weights", "k"]) as cap:
        m(X)
    (rec,) = cap
    assert rec.name == "1" and rec.heads == (1, 3) and rec.weights.shape == (2, 2, 6, 6) and rec.q is None
    with attnprobe.capture(m, layers=[0], heads=[1, 3]) as gqa:
        m(X)
    assert gqa[0].kv_heads == (0, 1) and gqa[0].k.shape == (2, 2, 6, 4)  # heads 1 and 3 read kv heads 0 and 1
    with attnprobe.capture(m) as full:
        m(X)
    torch.testing.assert_close(rec.weights, full[1].weights[:, [1, 3]])
    with pytest.raises(attnprobe.SelectionError, match=r"head\(s\) \[7\] out of range for layer 0"):
        with attnprobe.capture(m, heads=[7]):
            m(X)
    with attnprobe.capture(m, layers=[0], keep="weights") as one:
        m(X)
    with pytest.raises(attnprobe.CaptureBudgetError, match=r"layer 1 \('1'"):
        with attnprobe.capture(m, keep="weights", max_bytes=one.nbytes + 1) as cap:
            m(X)
    assert [r.layer for r in cap] == [0]
    assert leftovers(m) == []


def test_layer_past_the_end_is_an_error_at_exit():
    m = SdpaBlock()
    with pytest.raises(
        attnprobe.SelectionError, match=r"layer 3 is out of range.*0 found before the run, 1 while it ran"
    ):
        with attnprobe.capture(m, layers=[3]):
            m(X)
    assert leftovers(m) == []


class ClaimingAdapter(Adapter):
    """Stands in for an adapter that reads a module which calls sdpa internally (as Hugging Face ones do)."""

    name = "claims"

    def __init__(self, cls):
        self.cls = cls

    def find(self, model, claimed):
        return [Site(n, m, self, 4, 4) for n, m in model.named_modules() if isinstance(m, self.cls)]

    def attach(self, session, model, sites, stack):
        pass


def test_calls_inside_modules_other_adapters_read_are_not_recorded_twice():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.claimed, self.free = SdpaBlock(), nn.Sequential(SdpaBlock())

        def forward(self, x):
            return self.free(self.claimed(x))

    class Claimed(SdpaBlock):
        pass

    m = Outer().eval()
    m.claimed = Claimed()
    session = CaptureSession(m, Selection.build(), adapters=[ClaimingAdapter(Claimed), FunctionalAdapter()])
    with session as cap:
        m(X)
    assert [(r.name, r.layer) for r in cap] == [("free.0", 1)]  # layer 0 is the claimed module
    # nn.MultiheadAttention calls sdpa internally (need_weights=False): one record, from its own adapter
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with attnprobe.capture(mha) as cap:
        mha(X, X, X, need_weights=False)
    assert [r.backend for r in cap] == ["torch_mha"]
    assert leftovers(m) == [] and leftovers(mha) == []


def test_same_tensor_as_key_and_value_is_linted():
    class KeysAsValues(nn.Module):
        def forward(self, q, k):
            return F.scaled_dot_product_attention(q, k, k)

    m = KeysAsValues()
    with pytest.warns(attnprobe.AttnprobeWarning, match="lint_same_kv in layer 0"):
        with attnprobe.capture(m) as cap:
            m(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert [v.check for v in cap[0].meta["lint"]] == ["lint_same_kv"]
    block = SdpaBlock()
    with attnprobe.capture(block) as quiet:
        block(X)
    assert len(quiet) == 1 and quiet[0].meta["lint"] == ()


def test_query_heads_that_do_not_divide_the_key_heads_are_warned_not_dropped_silently():
    class OneQueryHead(nn.Module):
        def forward(self, q, kv):
            return F.scaled_dot_product_attention(q, kv, kv * 2)  # sdpa broadcasts the one query head over three

    m = OneQueryHead()
    q, kv = torch.randn(2, 1, 5, 8), torch.randn(2, 3, 5, 8)
    plain = m(q, kv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with attnprobe.capture(m) as cap:
            got = m(q, kv)
    assert torch.equal(plain, got)  # the model ran unchanged
    assert len(cap) == 0 and leftovers(m) == []
    said = [str(w.message) for w in caught if issubclass(w.category, attnprobe.AttnprobeWarning)]
    assert any("1 query head(s) and 3 key/value heads" in s and "do not divide" in s for s in said), said
    assert any(s.startswith("no attention found in OneQueryHead") for s in said)  # the capture's own summary


def test_a_call_outside_the_model_is_ignored():
    m = SdpaBlock()
    with pytest.warns(attnprobe.AttnprobeWarning, match="no attention found in SdpaBlock while the capture was open"):
        with attnprobe.capture(m) as cap:
            F.scaled_dot_product_attention(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    assert len(cap) == 0


def test_idle_and_static_only_captures_install_no_mode():
    m = nn.Sequential(attnprobe.MultiHeadAttention(16, 4), SdpaBlock())
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(len(torch.overrides._get_current_function_mode_stack()))
            return func(*args, **(kwargs or {}))

    for options in ({"layers": []}, {"layers": [0]}):
        with attnprobe.capture(m, **options):
            assert torch.overrides._get_current_function_mode_stack() == []
            m(X)
    with attnprobe.capture(m) as cap:
        assert len(torch.overrides._get_current_function_mode_stack()) == 1
        m(X)
    assert [r.layer for r in cap] == [0, 1]
    assert leftovers(m) == []


def _attend_helper(q, k, v):  # a module-level helper: the module's own code never names sdpa
    return F.scaled_dot_product_attention(q, k, v)


class ThroughHelper(nn.Module):
    def forward(self, x):
        q = x.view(2, 6, 4, 4).transpose(1, 2)
        return _attend_helper(q, q * 2, q + 1).transpose(1, 2).reshape(2, 6, 16)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.inner(x))


def test_sdpa_reached_through_a_helper_function_is_found():
    m = ThroughHelper()
    with attnprobe.capture(m) as cap:
        m(X)
    assert len(cap) == 1 and cap[0].backend == "sdpa"


def test_code_that_never_reaches_sdpa_runs_without_the_function_mode():
    # the mode costs every torch call, so it is left out when no module's code can reach sdpa
    m = nn.Sequential(attnprobe.MultiHeadAttention(16, 4), NoAttention())
    with attnprobe.capture(m) as cap:
        assert torch.overrides._get_current_function_mode_stack() == []
        m(X)
    assert [r.layer for r in cap] == [0]
    assert leftovers(m) == []
