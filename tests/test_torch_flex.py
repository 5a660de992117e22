"""Direct ``flex_attention`` calls in a model's own code (issue 32): the BlockMask read as the kernel applies it, the
``score_mod`` applied by calling it on the recomputed scores, the output untouched. Flex runs uncompiled here
(``flex_helpers``: torch's reference path of the same operator; compiling it costs a minute per mask on this CPU)."""

from __future__ import annotations

import flex_helpers
import pytest
import torch
from test_stats_lse import assert_close_to
from torch import nn

import attnprobe
from attnprobe.probe.engine import native_rows

pytestmark = flex_helpers.FLEX_SKIP

flex_attention_module = pytest.importorskip("torch.nn.attention.flex_attention")
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention  # noqa: E402

B, H, KV, T, D = 2, 4, 2, 10, 8
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q_idx, kv_idx):
    """An ALiBi-style bias: each head's slope times the distance to the key."""
    return score + SLOPES[h] * (kv_idx - q_idx)


def per_head(b, h, q_idx, kv_idx):
    """Causal for even heads, a window of 3 (the query included) for odd ones: a mask that reads the head."""
    causal = q_idx >= kv_idx
    return causal & ((h % 2 == 0) | (q_idx - kv_idx < 3))


class Direct(nn.Module):
    """Attention written as one flex_attention call with grouped-query heads, a BlockMask and a score_mod."""

    def __init__(self, score_mod=alibi) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(16, H * D), nn.Linear(16, 2 * KV * D)
        self.score_mod = score_mod

    def forward(self, x, block_mask=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, D).transpose(1, 2)  # (batch, head, query, d)
        k, v = self.kv(x).view(b, t, 2, KV, D).permute(2, 0, 3, 1, 4)  # (batch, kv_head, key, d) each
        out = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, H * D)


class ThroughTheModule(nn.Module):
    """The same call read off the module: ``flex_attention_module.flex_attention(...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 3 * H * D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex_attention_module.flex_attention(q, k, v).transpose(1, 2).reshape(b, t, H * D)


@pytest.fixture(autouse=True)
def uncompiled():
    with flex_helpers.uncompiled(hf=False):
        yield


def _mask():
    return create_block_mask(per_head, B, H, T, T, device="cpu", BLOCK_SIZE=4, _compile=False)


def _expected(model: Direct, x: torch.Tensor) -> torch.Tensor:
    """The weights flex computes, written out: scaled q @ k, the score_mod, the mask, the softmax."""
    q = model.q(x).view(B, T, H, D).transpose(1, 2)
    k = model.kv(x).view(B, T, 2, KV, D).permute(2, 0, 3, 1, 4)[0].repeat_interleave(H // KV, dim=1)
    s = q @ k.transpose(-1, -2) * D**-0.5  # (batch, head, query, key)
    h, qi, ki = torch.arange(H)[:, None, None], torch.arange(T)[:, None], torch.arange(T)[None, :]
    s = s + SLOPES[h] * (ki - qi)
    allowed = create_mask(per_head, B, H, T, T, device="cpu")
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)


def test_mask_mod_and_score_mod_are_read(assert_no_hooks):
    torch.manual_seed(0)
    model, x = Direct().eval(), torch.randn(B, T, 16)
    block_mask = _mask()
    with torch.no_grad():
        plain = model(x, block_mask)
        with attnprobe.capture(model) as cap:
            out = model(x, block_mask)
        expected = _expected(model, x)
    assert torch.equal(plain, out) and len(cap) == 1
    r = cap[0]
    assert r.backend == "flex_attention" and r.num_heads == H and r.num_kv_heads == KV and r.causal
    assert torch.equal(r.allowed, create_mask(per_head, B, H, T, T, device="cpu"))  # one mask per head
    torch.testing.assert_close(r.weights, expected, atol=1e-6, rtol=0)
    assert attnprobe.check(cap).ok  # output_match: the recomputed weights times v give flex's output
    assert flex_attention_module.flex_attention is flex_attention and globals()["flex_attention"] is flex_attention
    assert_no_hooks(model)


def test_selected_heads_and_statistics(assert_no_hooks):
    torch.manual_seed(0)
    model, x = Direct().eval(), torch.randn(B, T, 16)
    block_mask = _mask()
    with torch.no_grad():
        with attnprobe.capture(model, heads=[1, 2], keep=("weights", "stats")) as cap:
            model(x, block_mask)
        expected = _expected(model, x)[:, [1, 2]]
    r = cap[0]
    assert r.heads == (1, 2) and r.kv_heads == (0, 1)
    torch.testing.assert_close(r.weights, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(r.stats["max_weight"], expected.amax(-1), atol=1e-6, rtol=0)
    entropy = -(expected * expected.clamp_min(1e-30).log()).sum(-1)
    torch.testing.assert_close(r.stats["entropy"], entropy, atol=1e-5, rtol=0)
    assert_no_hooks(model)


def test_a_call_through_the_module_and_a_call_outside_any_module():
    torch.manual_seed(0)
    model, x = ThroughTheModule().eval(), torch.randn(B, T, 16)
    with torch.no_grad():
        plain = model(x)
        with attnprobe.capture(model) as cap:
            out = model(x)
            flex_attention(*(torch.randn(1, H, T, D) for _ in range(3)))  # no module of the model runs it
    assert torch.equal(plain, out) and len(cap) == 1 and not cap[0].causal
    assert cap[0].allowed.all()  # no BlockMask: every key
    assert attnprobe.check(cap).ok


def test_a_score_mod_attnprobe_cannot_call_leaves_no_scores_and_says_why(monkeypatch):
    from attnprobe.hooks.hf import kernels

    def refuse(self, s, rows, c, d):
        raise RuntimeError("reads a tensor's value on the host")

    monkeypatch.setattr(kernels.CalledScores, "__call__", refuse)
    torch.manual_seed(0)
    model, x = Direct().eval(), torch.randn(B, T, 16)
    with torch.no_grad():
        plain = model(x, _mask())
        with pytest.warns(attnprobe.AttnprobeWarning, match=r"score_mod 'alibi' cannot be called.*no scores"):
            with attnprobe.capture(model) as cap:
                out = model(x, _mask())
    r = cap[0]
    assert torch.equal(plain, out) and r.weights is None and r.scores is None and r.weights_source == "none"
    assert "host" in r.meta["scores_unavailable"] and r.allowed is not None and r.output is not None


class AsksForTheLse(nn.Module):
    """One flex call that asks for each row's logsumexp (``return_lse=True``, or ``return_aux=AuxRequest(lse=True)``
    on torches that have it) and uses it, as a model that adds attention sinks would; ``ask=None``: asks nothing."""

    def __init__(self, ask: str | None) -> None:
        super().__init__()
        self.qkv, self.ask = nn.Linear(16, 3 * H * D), ask

    def forward(self, x, block_mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D).permute(2, 0, 3, 1, 4)  # (batch, head, query, d) each
        if self.ask is None:
            return flex_attention(q, k, v, block_mask=block_mask), None
        if self.ask == "return_lse":
            out, lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        else:
            out, aux = flex_attention(
                q, k, v, block_mask=block_mask, return_aux=flex_attention_module.AuxRequest(lse=True)
            )
            lse = aux.lse
        return out, lse


@pytest.mark.filterwarnings("ignore:return_lse is deprecated:FutureWarning")
@pytest.mark.parametrize("ask", ["return_lse", "return_aux"])
def test_the_lse_a_model_asks_flex_for_serves_the_statistics(ask, monkeypatch, assert_no_hooks):
    """A model that asks flex for the lse: the statistics take it (one sweep, no pass for each row's normaliser; the
    fused pass, where it is built, reading the BlockMask's rows as intervals) and equal those of the same call
    without it; the outputs and the lse the model gets are the uncaptured run's. A
    model that does not ask gets no lse from attnprobe: its call runs as written."""
    if ask == "return_aux" and not hasattr(flex_attention_module, "AuxRequest"):
        pytest.skip("this torch's flex_attention has no return_aux")
    from attnprobe.probe.engine import stats as engine

    swept, fused = [], []
    real, real_fused = engine._Engine._with_lse, engine._Engine._lse_block_fused
    monkeypatch.setattr(engine._Engine, "_with_lse", lambda self, *a, **k: swept.append(1) or real(self, *a, **k))

    def counted(self, *args):
        fused.append(real_fused(self, *args))
        return fused[-1]

    monkeypatch.setattr(engine._Engine, "_lse_block_fused", counted)
    torch.manual_seed(0)
    model, x = AsksForTheLse(ask).eval(), torch.randn(B, T, 16)
    causal = create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device="cpu", BLOCK_SIZE=4, _compile=False)
    with torch.no_grad():
        plain = model(x, causal)
        with attnprobe.capture(model, keep=("stats",)) as cap:
            got = model(x, causal)
        assert len(swept) == 1 and all(torch.equal(a, b) for a, b in zip(plain, got))
        assert fused == ([True] if native_rows.available() else [])  # the BlockMask read as intervals: the fused pass
        model.ask = None
        with attnprobe.capture(model, keep=("stats",)) as without:
            model(x, causal)
    assert len(swept) == 1  # no lse asked for: none taken
    assert_close_to(cap[0].stats, without[0].stats, atol=1e-5)
    assert float(cap[0].stats["row_sum_error"].max()) < 1e-5
    assert_no_hooks(model)
