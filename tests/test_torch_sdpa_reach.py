"""Which code may call sdpa (read without running it), layer numbers with modules=, and dropout_p as sdpa applies it."""

from __future__ import annotations

import functools
import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
import torch_helpers
from torch import nn
from torch_helpers import FusedSplit, leftovers

import attnprobe
from attnprobe.hooks.functional import code_reaches_sdpa

X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))


def heads(x):  # (B, T, 16) -> (B, 4, T, 4)
    return x.view(x.shape[0], x.shape[1], 4, 4).transpose(1, 2)


def qkv(x):  # three different tensors (the same one as key and value would be linted)
    return heads(x), heads(x * 0.5), heads(x.tanh())


def merge(o):
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], 16)


def _traced(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _eager(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


ATTENTION = {"eager": _eager, "sdpa": F.scaled_dot_product_attention}  # a table of attention functions
CAUSAL_SDPA = functools.partial(F.scaled_dot_product_attention, is_causal=True)


class ViaModuleAttribute(nn.Module):
    def forward(self, x):
        return merge(torch_helpers.attend_heads(*qkv(x)))


class Kernels:
    @staticmethod
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class ViaHelperClass(nn.Module):
    def forward(self, x):
        return merge(Kernels.attend(*qkv(x)))


class ViaDecorator(nn.Module):
    @_traced
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, x):
        return merge(self.attend(*qkv(x)))


class ViaClassAttribute(nn.Module):
    attn_fn = F.scaled_dot_product_attention  # a builtin: self.attn_fn(q, k, v) is not bound

    def forward(self, x):
        return merge(self.attn_fn(*qkv(x)))


class ViaDict(nn.Module):
    impl = "sdpa"

    def forward(self, x):
        return merge(ATTENTION[self.impl](*qkv(x)))


class ViaPartial(nn.Module):
    def forward(self, x):
        return merge(CAUSAL_SDPA(*qkv(x)))


class ViaGetattr(nn.Module):
    def forward(self, x):
        return merge(F.scaled_dot_product_attention(*qkv(x)))


class NoSdpa(nn.Module):
    table: ClassVar[dict] = {"relu": torch.relu}
    act = functools.partial(torch.clamp, min=0)

    @_traced
    def forward(self, x):
        return self.act(self.table["relu"](x))


@pytest.mark.parametrize(
    "cls", [ViaModuleAttribute, ViaHelperClass, ViaDecorator, ViaClassAttribute, ViaDict, ViaPartial, ViaGetattr]
)
def test_code_reading_follows_helpers_decorators_attributes_tables_partials_and_getattr(cls):
    assert code_reaches_sdpa(cls)
    m = nn.Sequential(attnprobe.MultiHeadAttention(16, 4), cls())  # the own module alone needs no function mode
    with torch.no_grad():
        plain = m(X)
        with attnprobe.capture(m) as cap:
            assert len(torch.overrides._get_current_function_mode_stack()) == 1
            got = m(X)
    assert torch.equal(got, plain)
    assert [(r.layer, r.backend) for r in cap] == [(0, "attnprobe"), (1, "sdpa")]
    assert cap[1].causal is (cls is ViaPartial)
    assert leftovers(m) == []


def test_code_that_only_looks_alike_is_not_taken_for_sdpa():
    assert not code_reaches_sdpa(NoSdpa)
    m = nn.Sequential(attnprobe.MultiHeadAttention(16, 4), NoSdpa())
    with attnprobe.capture(m) as cap:
        assert torch.overrides._get_current_function_mode_stack() == []
        m(X)
    assert [r.backend for r in cap] == ["attnprobe"]


class PassedIn(nn.Module):
    """The attention function arrives at run time: no code reading can see it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return merge(self.fn(*qkv(x)))


class HandAndPassedIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.hand = FusedSplit()
        self.other = PassedIn(F.scaled_dot_product_attention)

    def forward(self, x):
        return self.other(self.hand(x))


def test_sdpa_calls_are_recorded_whenever_the_mode_is_in():
    m = HandAndPassedIn().eval()
    assert not code_reaches_sdpa(PassedIn)
    with attnprobe.capture(m, modules=[m.hand]) as cap:  # the mode is in for the hand-written module
        m(X)
    assert [(r.name, r.layer, r.backend) for r in cap] == [("hand", 0, "hand-written"), ("other", 1, "sdpa")]
    assert leftovers(m) == []


class TwoSoftmaxes(nn.Module):
    """One module, two hand-written attentions (self, then cross): two layers, known only when it runs."""

    def forward(self, x, ctx):
        w = torch.softmax(x @ (x * 2).transpose(-2, -1), dim=-1)
        x = w @ x.tanh()
        c = torch.softmax(x @ ctx.transpose(-2, -1), dim=-1)
        return c @ ctx.flip(-1)


def test_layers_of_named_modules_are_checked_when_they_are_known():
    m = TwoSoftmaxes()
    x, ctx = torch.randn(1, 5, 8), torch.randn(1, 3, 8)
    with attnprobe.capture(m, modules=[m], layers=[1]) as cap:  # layer 1 exists only once the module ran
        m(x, ctx)
    assert [(r.layer, r.kind) for r in cap] == [(1, "cross")]
    with pytest.raises(
        attnprobe.SelectionError, match=r"layer 2 is out of range.*1 found before the run, 1 while it ran"
    ):
        with attnprobe.capture(m, modules=[m], layers=[2]):
            m(x, ctx)
    assert leftovers(m) == []


def test_a_named_module_that_calls_sdpa_is_its_layer():
    m = nn.Sequential(attnprobe.MultiHeadAttention(16, 4), ViaGetattr(), PassedIn(F.scaled_dot_product_attention))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ran but no softmax attention found" warning
        with attnprobe.capture(m, modules=["2"], layers=[1]) as cap:
            m(X)
    assert [(r.name, r.layer, r.backend, r.num_heads) for r in cap] == [("2", 1, "sdpa", 4)]
    assert leftovers(m) == []


class DropoutAlways(nn.Module):
    """Passes dropout_p whatever its mode: a bug in eval, since sdpa applies dropout_p regardless."""

    def __init__(self, follow_mode: bool):
        super().__init__()
        self.p, self.follow_mode = 0.5, follow_mode

    def forward(self, x):
        p = self.p if (self.training or not self.follow_mode) else 0.0
        return merge(F.scaled_dot_product_attention(*qkv(x), dropout_p=p))


def test_sdpa_dropout_is_recorded_as_applied_and_flagged_in_eval():
    buggy = DropoutAlways(follow_mode=False).eval()
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"dropout_p=0.5 while DropoutAlways is in eval mode"):
        with attnprobe.capture(buggy) as cap:
            buggy(X)
    (rec,) = cap
    assert rec.dropout == 0.5 and rec.meta["dropout_in_eval"] is True
    # torch did drop: the output is not weights @ v
    assert not torch.allclose(rec.output, rec.weights @ rec.v, atol=1e-3)
    good = DropoutAlways(follow_mode=True)
    for training, p in ((False, 0.0), (True, 0.5)):
        good.train(training)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with attnprobe.capture(good) as cap:
                good(X)
        assert cap[0].dropout == p and cap[0].meta["dropout_in_eval"] is False


class HandDropout(nn.Module):
    def forward(self, x):
        q = heads(x)
        w = F.dropout(torch.softmax(q @ q.transpose(-2, -1), dim=-1), 0.5)  # training defaults to True
        return merge(w @ q.flip(-1))


def test_hand_written_functional_dropout_in_eval_is_flagged():
    m = HandDropout().eval()
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"F.dropout\(p=0.5\).*eval mode"):
        with attnprobe.capture(m, modules=[m]) as cap:
            m(X)
    assert cap[0].dropout == 0.5 and cap[0].meta["dropout_in_eval"] is True


class HandTorchDropout(nn.Module):
    def forward(self, x):
        q = heads(x)
        w = torch.dropout(torch.softmax(q @ q.transpose(-2, -1), dim=-1), 0.3, self.training)
        return merge(w @ q.flip(-1))


@pytest.mark.parametrize("training, p", [(True, 0.3), (False, 0.0)])
def test_hand_written_torch_dropout_follows_its_train_argument(training, p):
    m = HandTorchDropout().train(training)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with attnprobe.capture(m, modules=[m]) as cap:
            m(X)
    (rec,) = cap
    assert rec.dropout == p and rec.meta["dropout_in_eval"] is False and rec.output is not None


class _LazyTable(dict):
    """A mapping that does work when asked for its values (transformers' lazy CONFIG_MAPPING imports modules)."""

    asked = 0

    def values(self):
        type(self).asked += 1
        return super().values()


_LAZY = _LazyTable(attend=F.scaled_dot_product_attention)
_LAZY_EMPTY = _LazyTable()


class _ReadsLazyTable(nn.Module):
    def forward(self, q, k, v):
        return _LAZY["attend"](q, k, v)


class _MentionsLazyEmptyTable(nn.Module):
    def forward(self, x):
        return x if _LAZY_EMPTY else -x


def test_code_reading_reads_the_entries_a_mapping_stores_without_calling_its_values():
    """Reading code must not run it: a dict subclass's own values() may import or compute. Its stored entries
    are still read (an sdpa kept in one is found)."""
    code_reaches_sdpa.cache_clear()
    assert code_reaches_sdpa(_ReadsLazyTable)
    assert not code_reaches_sdpa(_MentionsLazyEmptyTable)
    assert _LazyTable.asked == 0
