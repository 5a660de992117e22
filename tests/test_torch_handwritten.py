"""Hand-written softmax attention, read by tracing the module's own torch calls (capture(..., modules=...))."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_helpers import ChunkedQKV, FusedSplit, Head, HeadList, RawCrossAttention, leftovers, reference_weights

import attnprobe

ALL = {"q", "k", "v", "scores", "weights", "output", "allowed"}
X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
CAUSAL = torch.ones(6, 6, dtype=torch.bool).tril()


def run(model, *args, **options):
    plain = model(*args)
    with attnprobe.capture(model, **options) as cap:
        got = model(*args)
    assert torch.equal(plain, got), "capture changed the model's output"
    assert leftovers(model) == []
    return cap


def check_math(rec, atol=1e-6):
    """The record's fields agree with each other the way attention defines them (on rows with an allowed key:
    what code does with a row whose every key is masked is its own business, and is recorded as it ran)."""
    torch.testing.assert_close(rec.scores, rec.q @ rec.k.transpose(-2, -1) * rec.scaling, rtol=0, atol=atol)
    allowed = rec.allowed_for_heads()
    rows = allowed.any(-1)
    expected = reference_weights(rec.q, rec.k, rec.scaling, allowed)
    torch.testing.assert_close(rec.weights[rows], expected[rows], rtol=0, atol=atol)
    torch.testing.assert_close(rec.output, rec.weights @ rec.v, rtol=0, atol=atol)


def test_single_head_modules_in_a_list_are_one_layer_with_heads():
    model = HeadList().eval()
    cap = run(model, X, modules=[model])
    (rec,) = cap
    assert rec.name == "" and rec.layer == 0 and rec.num_heads == 4 and rec.heads == (0, 1, 2, 3)
    assert rec.meta["head_modules"] == ("heads.0", "heads.1", "heads.2", "heads.3")
    assert rec.identified == ALL and rec.backend == "hand-written" and rec.weights_source == "observed"
    assert rec.kind == "self" and rec.causal is True and rec.scaling == pytest.approx(0.5)
    for h, head in enumerate(model.heads):  # head h of the record is module heads[h]
        assert torch.equal(rec.q[:, h], head.query(X)) and torch.equal(rec.k[:, h], head.key(X))
        assert torch.equal(rec.v[:, h], head.value(X))
    assert rec.allowed.shape == (2, 1, 6, 6) and torch.equal(rec.allowed[0, 0], CAUSAL)
    check_math(rec)
    assert torch.equal(rec.output.transpose(1, 2).reshape(2, 6, 16), torch.cat([h(X) for h in model.heads], -1))


def test_the_list_itself_or_a_name_stands_for_its_holder():
    model = nn.Sequential(HeadList()).eval()
    by_list = run(model, X, modules=[model[0].heads])
    by_name = run(model, X, modules=["0"])
    assert [r.name for r in by_list] == [r.name for r in by_name] == ["0"]
    assert by_list[0].num_heads == 4
    torch.testing.assert_close(by_list[0].weights, by_name[0].weights)


def test_fused_projection_split_with_view_and_transpose():
    model = FusedSplit().eval()
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])  # left padding, 1 = real token
    cap = run(model, X, padding, modules=[model])
    (rec,) = cap
    q, _, v = model.c_attn(X).split(16, dim=2)
    assert torch.equal(rec.q, q.view(2, 6, 4, 4).transpose(1, 2)) and torch.equal(
        rec.v, v.view(2, 6, 4, 4).transpose(1, 2)
    )
    assert rec.identified == ALL and rec.num_heads == 4 and rec.kind == "self" and rec.causal is True
    # causal (masked_fill) and padding (an added -1e9 mask) combined; -1e9 is not a score
    assert torch.equal(rec.allowed[0, 0], CAUSAL & padding[0].bool()) and torch.equal(rec.allowed[1, 0], CAUSAL)
    assert rec.scores.abs().max() < 100
    check_math(rec)
    # left padding + causal: query rows 0-1 of batch 0 have no allowed key; this code (an added -1e9, not -inf)
    # spreads their weight over the padded keys, and the record shows exactly that
    assert not rec.allowed[0, 0, :2].any()
    torch.testing.assert_close(rec.weights[0, :, :2, :2].sum(-1), torch.ones(4, 2))


def test_fused_qkv_chunked_per_head_with_einsum():
    model = ChunkedQKV().eval()
    (rec,) = run(model, X, modules=[model])
    qkv = model.qkv(X).view(2, 6, 4, 12)
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.chunk(3, dim=-1))
    assert torch.equal(rec.q, q) and torch.equal(rec.k, k) and torch.equal(rec.v, v)
    assert rec.identified == ALL and rec.causal is False and rec.allowed.all()
    assert rec.scaling == pytest.approx(1 / math.sqrt(4))
    check_math(rec)


def test_cross_attention_from_raw_parameters_with_bmm():
    model = RawCrossAttention().eval()
    ctx = torch.randn(2, 5, 12)
    ctx_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    (rec,) = run(model, X, ctx, ctx_mask, modules=[model])
    # the (B*H, T, D) batch of the bmm is unfolded into (B, H, T, D)
    assert rec.kind == "cross" and rec.meta["kind_from"] == "sources" and rec.num_heads == 4
    assert rec.q.shape == (2, 4, 6, 4) and rec.k.shape == rec.v.shape == (2, 4, 5, 4)
    assert torch.equal(rec.q, (X @ model.W_q).view(2, 6, 4, 4).transpose(1, 2))
    assert torch.equal(rec.k, (ctx @ model.W_k).view(2, 5, 4, 4).transpose(1, 2))
    assert rec.allowed.shape == (2, 1, 6, 5)
    assert rec.allowed[0].all() and not rec.allowed[1, :, :, 3:].any() and rec.allowed[1, :, :, :3].all()
    assert torch.all(rec.weights[1, :, :, 3:] == 0)
    check_math(rec)


def test_auto_finds_every_kind_and_numbers_by_first_call():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fused, self.heads, self.chunked = FusedSplit(), HeadList(), ChunkedQKV()

        def forward(self, x):
            return self.chunked(self.heads(self.fused(x)))

    model = Model().eval()
    cap = run(model, X, modules="auto")
    assert [(r.name, r.layer, r.num_heads) for r in cap] == [("fused", 0, 4), ("heads", 1, 4), ("chunked", 2, 4)]
    assert cap.info["attention_modules"] == ("fused", "heads", "chunked")
    assert all(r.identified == ALL for r in cap)
    # without modules= hand-written attention is not traced, and nothing else can be found: said up front
    with pytest.raises(attnprobe.UnsupportedModelError, match=r"no attention found in Model.*modules='auto'"):
        with attnprobe.capture(model):
            model(X)


def test_named_modules_are_layers_in_module_order_with_selection():
    model = nn.Sequential(FusedSplit(), HeadList(), ChunkedQKV()).eval()
    cap = run(model, X, modules=["2", "1"])
    assert [(r.name, r.layer) for r in cap] == [("1", 0), ("2", 1)]
    sel = run(model, X, modules=["1", "2"], layers=[0], heads=[1, 3], keep=["weights", "q"])
    (rec,) = sel
    assert rec.heads == (1, 3) and rec.k is None and rec.scores is None
    torch.testing.assert_close(rec.weights, cap[0].weights[:, [1, 3]])
    torch.testing.assert_close(rec.q, cap[0].q[:, [1, 3]])
    with pytest.raises(attnprobe.CaptureBudgetError, match=r"layer 1 \('2'"):
        with attnprobe.capture(model, modules=["1", "2"], keep="weights", max_bytes=cap[0].weights.nbytes + 100):
            model(X)
    assert leftovers(model) == []


def test_in_place_mask_keeps_the_scores_before_the_mask():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            s = torch.matmul(q, k.mT)
            s.div_(math.sqrt(8))
            s.masked_fill_(~CAUSAL, -1e4)
            return s.softmax(-1) @ v

    model = InPlace().eval()
    (rec,) = run(model, X, modules=[model])
    assert torch.equal(rec.allowed[0, 0], CAUSAL) and rec.scores.min() > -1e3  # pre-mask values kept
    check_math(rec)


def test_training_dropout_is_recorded():
    model = Head().train()
    with attnprobe.capture(model, modules=[model]) as cap:
        model(X)
    (rec,) = cap
    assert rec.dropout == pytest.approx(0.1) and rec.num_heads == 1
    torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 1, 6))  # weights are before dropout


def test_named_module_without_softmax_attention_warns():
    model = nn.Sequential(nn.Linear(16, 16), HeadList()).eval()
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"'0' \(Linear\) ran but attnprobe found no softmax attention"):
        with attnprobe.capture(model, modules=["0", "1"]) as cap:
            model(X)
    assert [r.name for r in cap] == ["1"]


def test_partial_record_when_the_scores_cannot_be_followed():
    class Odd(nn.Module):
        def forward(self, x):
            scores = torch.cdist(x, x).neg()  # not a q @ k product attnprobe can follow
            return F.softmax(scores, dim=-1) @ x

    model = Odd()
    with pytest.warns(
        attnprobe.AttnprobeWarning,
        match=r"the record has no q, k, v, output, allowed: the scores come "
        r"from neg\(\.\.\.\) at test_torch_handwritten.py:\d+, a call attnprobe does not follow",
    ):
        (rec,) = run(model, X, modules=[model])
    assert rec.identified == {"scores", "weights"} and rec.q is None and rec.allowed is None and rec.scaling is None
    assert set(rec.meta["missing"]) == {"q", "k", "v", "output", "allowed"}
    torch.testing.assert_close(rec.weights, F.softmax(rec.scores, dim=-1))


@pytest.mark.parametrize(
    "modules, match",
    [
        (["nope"], "'nope' is not a module of Sequential"),
        ([nn.Linear(2, 2)], "not a submodule of Sequential"),
        (3, "modules= takes 'auto' or a list"),
    ],
)
def test_bad_modules_option_is_a_clear_error(modules, match):
    model = nn.Sequential(HeadList())
    with pytest.raises(attnprobe.SelectionError, match=match):
        with attnprobe.capture(model, modules=modules):
            pass
    assert leftovers(model) == []


class SeqFirstBmm(nn.Module):
    """fairseq style: sequence-first, heads folded into the batch, scores viewed (B, H, T, S) for the padding mask."""

    def __init__(self, d=16, h=4):
        super().__init__()
        self.h, self.d = h, d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, key_padding):  # x (T, B, C); key_padding (B, T), True = padding
        T, B, C = x.shape
        q = (self.q(x) * self.d**-0.5).contiguous().view(T, B * self.h, self.d).transpose(0, 1)
        k = self.k(x).contiguous().view(T, B * self.h, self.d).transpose(0, 1)
        v = self.v(x).contiguous().view(T, B * self.h, self.d).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2))  # (B*H, T, T)
        w = w.view(B, self.h, T, T).masked_fill(key_padding[:, None, None, :], float("-inf")).view(B * self.h, T, T)
        out = torch.bmm(F.softmax(w.float(), dim=-1).type_as(w), v)  # (B*H, T, D)
        return self.o(out.transpose(0, 1).contiguous().view(T, B, C))


class BaddbmmWhere(nn.Module):
    """Scores and additive mask fused by baddbmm, causality by torch.where, one head folded per batch row."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, additive):  # additive (B, 1, T): 0 or -1e4
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = torch.baddbmm(additive, q, k.transpose(1, 2), alpha=x.shape[-1] ** -0.5)
        T = x.shape[1]
        s = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, torch.finfo(s.dtype).min)
        return s.softmax(-1) @ v


def test_sequence_first_bmm_with_a_relayout_for_the_mask():
    model = SeqFirstBmm().eval()
    x = torch.randn(6, 2, 16)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    (rec,) = run(model, x, pad, modules=[model])
    assert rec.identified == ALL and rec.num_heads == 4 and rec.kind == "self"
    assert rec.q.shape == (2, 4, 6, 4) and rec.scaling == pytest.approx(1.0)  # q was scaled before the product
    assert torch.equal(rec.q[1, 2], (model.q(x) * 0.5)[:, 1, 8:12])  # batch 1, head 2
    assert not rec.allowed[1, 0, :, 4:].any() and rec.allowed[0].all()
    check_math(rec)
    assert rec.meta["lint"] == ()  # (T, B*H, D) -> (T, B, C) merges heads correctly


def test_baddbmm_additive_mask_and_where():
    model = BaddbmmWhere().eval()
    additive = torch.zeros(2, 1, 6)
    additive[1, 0, 4:] = -1e4
    (rec,) = run(model, X, additive, modules=[model])
    assert rec.identified == ALL and rec.num_heads == 1 and rec.scaling == pytest.approx(0.25)
    expected = CAUSAL & (additive[:, :, None, :] == 0)
    assert torch.equal(rec.allowed, expected) and rec.causal is True
    check_math(rec)


class WindowedAttention(nn.Module):
    """Attention inside windows with scores laid out (batch, head, window, query, key), as Hiera's
    mask-unit attention: the windows are more batch, the heads stay heads."""

    def __init__(self, d: int = 8, heads: int = 2, windows: int = 3):
        super().__init__()
        self.heads, self.windows = heads, windows
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):  # x (B, windows * T, d)
        b, n, d = x.shape
        t = n // self.windows
        qkv = self.qkv(x).view(b, self.windows, t, 3, self.heads, d // self.heads).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.unbind(0)  # (B, H, W, T, dh)
        w = (q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)).softmax(dim=-1)
        self.seen = w.detach().clone()
        return (w @ v).permute(0, 2, 3, 1, 4).reshape(b, n, d)


def test_window_axes_after_the_heads_fold_into_the_batch_not_the_heads():
    torch.manual_seed(0)
    m = WindowedAttention().eval()
    x = torch.randn(2, 12, 8)
    with torch.no_grad():
        plain = m(x)
        with attnprobe.capture(m, modules=[m]) as cap:
            out = m(x)
    assert torch.equal(out, plain)
    (r,) = cap
    w = m.seen  # (2, 2 heads, 3 windows, 4, 4)
    assert r.num_heads == 2 and r.weights.shape == (6, 2, 4, 4)  # was (4, 3, 4, 4): windows read as heads
    assert torch.equal(r.weights, w.permute(0, 2, 1, 3, 4).reshape(6, 2, 4, 4))
    assert r.q.shape == (6, 2, 4, 4) and r.output.shape == (6, 2, 4, 4)
    assert "axis 1 read as the heads" in r.meta["folded"] and "(3,)" in r.meta["folded"]
    assert attnprobe.check(cap)
