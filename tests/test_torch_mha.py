"""torch.nn.MultiheadAttention, alone and inside nn.TransformerEncoder / nn.TransformerDecoder."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch_helpers import leftovers, reference_weights

import attnprobe
from attnprobe.hooks.torch_mha import fastpath_disabled

KPM = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # torch convention: True = padding


def torch_per_head(mha, *args, **kwargs):
    """torch's own per-head weights for the same call (slow path, need_weights=True)."""
    with fastpath_disabled(), torch.no_grad():
        return mha(*args, need_weights=True, average_attn_weights=False, **kwargs)[1]


def merged_output(mha: nn.MultiheadAttention, rec) -> torch.Tensor:
    """out_proj(merge(weights @ V)) in the module's own layout: what the record says the module returned."""
    B, H, L, d = rec.output.shape
    merged = rec.output.transpose(1, 2).reshape(B, L, H * d)
    out = mha.out_proj(merged)
    return out if mha.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights, average", [(True, True), (True, False), (False, True)])
def test_caller_gets_exactly_what_it_asked_for(batch_first, need_weights, average):
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    x = torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)
    call = dict(key_padding_mask=KPM, need_weights=need_weights, average_attn_weights=average)
    with fastpath_disabled(), torch.no_grad():
        plain = mha(x, x, x, **call)
    with torch.no_grad(), attnprobe.capture(mha) as cap:
        got = mha(x, x, x, **call)
    assert torch.equal(plain[0], got[0])
    if need_weights:
        assert torch.equal(plain[1], got[1])  # head-averaged or per head, as asked
    else:
        assert got[1] is None
    (rec,) = cap
    assert rec.weights.shape == (2, 4, 5, 5) and rec.q.shape == rec.k.shape == rec.v.shape == (2, 4, 5, 4)
    assert rec.weights_source == ("observed" if need_weights else "recomputed") and rec.backend == "torch_mha"
    torch.testing.assert_close(rec.weights, torch_per_head(mha, x, x, x, key_padding_mask=KPM), rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_output(mha, rec), got[0], rtol=0, atol=1e-5)  # weights @ V reproduces it
    assert rec.meta["output_error"] < 1e-5
    assert rec.kind == "self" and rec.causal is False and rec.scaling == pytest.approx(0.5)
    assert not rec.allowed[1, 0, :, 3:].any() and rec.allowed[1, 0, :, :3].all()
    assert rec.query_padding.tolist() == KPM.tolist()
    assert rec.identified >= {"q", "k", "v", "scores", "weights", "output", "allowed", "query_padding"}
    assert leftovers(mha) == []


@pytest.mark.parametrize(
    "options",
    [
        dict(kdim=12, vdim=10),  # separate q/k/v projection weights
        dict(add_bias_kv=True),
        dict(add_zero_attn=True),
        dict(add_bias_kv=True, add_zero_attn=True, bias=False),
    ],
)
def test_projection_variants_reproduce_the_output(options):
    mha = nn.MultiheadAttention(16, 4, batch_first=True, **options).eval()
    x = torch.randn(2, 5, 16)
    ctx = torch.randn(2, 7, options.get("kdim", 16))
    val = torch.randn(2, 7, options.get("vdim", 16))
    ctx_pad = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    with torch.no_grad(), attnprobe.capture(mha) as cap:
        out, _ = mha(x, ctx, val, key_padding_mask=ctx_pad, need_weights=False)
    (rec,) = cap
    extra = int(bool(options.get("add_bias_kv"))) + int(bool(options.get("add_zero_attn")))
    assert rec.kind == "cross" and rec.meta["extra_keys"] == extra
    assert rec.k.shape == (2, 4, 7 + extra, 4) and rec.weights.shape == (2, 4, 5, 7 + extra)
    torch.testing.assert_close(merged_output(mha, rec), out, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        rec.weights, torch_per_head(mha, x, ctx, val, key_padding_mask=ctx_pad), rtol=0, atol=1e-6
    )
    # padded context keys get no weight; the appended bias/zero keys stay allowed
    assert not rec.allowed[1, 0, :, 5:7].any() and rec.allowed[:, 0, :, 7:].all()
    torch.testing.assert_close(
        rec.weights, reference_weights(rec.q, rec.k, rec.scaling, rec.allowed), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_attn_mask_and_is_causal(mask_kind):
    mha = nn.MultiheadAttention(16, 2).eval()  # sequence-first
    x = torch.randn(6, 3, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(6)  # float, -inf above the diagonal
    mask = causal if mask_kind == "float" else torch.isinf(causal)  # bool: True = masked (torch's convention)
    with torch.no_grad(), attnprobe.capture(mha) as cap:
        out, _ = mha(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)
        _, w = mha(x, x, x, attn_mask=mask)  # no hint: the mask alone makes it causal
    first, second = cap
    for rec in (first, second):
        assert rec.causal is True and rec.allowed.shape == (3, 1, 6, 6)
        assert torch.equal(rec.allowed[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
        assert torch.all(rec.weights.triu(1) == 0)
    torch.testing.assert_close(merged_output(mha, first), out, rtol=0, atol=1e-5)
    assert torch.equal(second.weights.mean(1), w) and second.weights_source == "observed"


def test_unbatched_call():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(5, 16)
    with fastpath_disabled(), torch.no_grad():
        plain = mha(x, x, x, key_padding_mask=KPM[1])
    with torch.no_grad(), attnprobe.capture(mha) as cap:
        got = mha(x, x, x, key_padding_mask=KPM[1])
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1])
    assert cap[0].weights.shape == (1, 4, 5, 5) and cap[0].query_padding.tolist() == [KPM[1].tolist()]


def test_fast_path_off_only_during_capture():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        fast = mha(x, x, x, need_weights=False)[0]  # torch._native_multi_head_attention
        with attnprobe.capture(mha) as cap:
            assert torch.backends.mha.get_fastpath_enabled() is False
            slow = mha(x, x, x, need_weights=False)[0]
    assert torch.backends.mha.get_fastpath_enabled() is True
    torch.testing.assert_close(slow, fast, rtol=0, atol=1e-5)  # same math, another kernel
    assert len(cap) == 1
    # a user's own setting survives the capture
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with attnprobe.capture(mha):
            mha(x, x, x)
        assert torch.backends.mha.get_fastpath_enabled() is False
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    # an idle capture touches nothing
    with attnprobe.capture(mha, layers=[]):
        assert torch.backends.mha.get_fastpath_enabled() is True


def test_training_dropout_records_pre_dropout_weights():
    mha = nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 5, 16)
    with attnprobe.capture(mha) as cap:
        out, _ = mha(x, x, x, average_attn_weights=False)
    (rec,) = cap
    assert rec.dropout == 0.5 and rec.weights_source == "recomputed"
    torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 4, 5))  # before dropout: rows sum to 1
    # the output is the module's own, after dropout: it reproduces what the caller got, not weights @ v
    assert rec.meta["output_source"] == "observed" and "output" in rec.identified
    torch.testing.assert_close(merged_output(mha, rec), out.detach(), rtol=0, atol=1e-6)
    assert not torch.allclose(rec.output, rec.weights @ rec.v, atol=1e-3)
    with pytest.warns(attnprobe.AttnprobeWarning, match="dropout"):
        assert "output_match" not in {v.check for v in attnprobe.check(cap).errors}  # dropout: skipped, not failed


@pytest.mark.parametrize("need_weights", [True, False])
def test_output_is_what_the_module_computed_per_head(need_weights):
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), attnprobe.capture(mha, heads=[1, 3]) as cap:
        out, _ = mha(x, x, x, key_padding_mask=KPM, need_weights=need_weights)
    (rec,) = cap
    assert rec.meta["output_source"] == "observed" and rec.output.shape == (2, 2, 5, 4)
    with torch.no_grad(), attnprobe.capture(mha) as full:
        mha(x, x, x, key_padding_mask=KPM, need_weights=need_weights)
    torch.testing.assert_close(merged_output(mha, full[0]), out, rtol=0, atol=1e-6)
    assert torch.equal(rec.output, full[0].output[:, [1, 3]])
    assert attnprobe.check(cap).ok


def test_inference_mode_and_autocast_run_untouched_with_a_recomputed_output():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.inference_mode(), fastpath_disabled():
        plain = mha(x, x, x, need_weights=False)[0]
    with torch.inference_mode(), attnprobe.capture(mha) as cap:
        got = mha(x, x, x, need_weights=False)[0]
    assert torch.equal(got, plain) and cap[0].meta["output_source"] == "recomputed"
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        with fastpath_disabled():
            plain = mha(x, x, x, need_weights=False)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # bfloat16 rounding is not taken for a patched module
            with attnprobe.capture(mha) as cap:
                got = mha(x, x, x, need_weights=False)[0]
    assert torch.equal(got, plain) and cap[0].dtype == torch.bfloat16 == cap[0].q.dtype
    assert attnprobe.check(cap).ok


def test_no_dispatch_mode_when_the_output_is_not_kept(monkeypatch):
    from attnprobe.hooks import torch_mha

    started = []
    real_start = torch_mha._OutProjInput.start
    monkeypatch.setattr(torch_mha._OutProjInput, "start", lambda self: started.append(1) or real_start(self))
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), attnprobe.capture(mha, keep=["weights"]) as cap:
        mha(x, x, x)
    assert started == [] and cap[0].output is None and cap[0].weights is not None
    with torch.no_grad(), attnprobe.capture(mha) as cap:
        mha(x, x, x)
    assert started == [1] and cap[0].meta["output_source"] == "observed"


def test_a_broken_kernel_is_caught_by_output_match(monkeypatch):
    """The record's output is the module's own, so output_match can fail: here sdpa inside torch's
    multi_head_attention_forward is replaced by one with a doubled scale."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def doubled_scale(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        return real(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=2 / q.shape[-1] ** 0.5
        )

    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), attnprobe.capture(mha) as good:
        mha(x, x, x, need_weights=False)
    assert attnprobe.check(good).ok
    monkeypatch.setattr(F, "scaled_dot_product_attention", doubled_scale)
    with torch.no_grad(), pytest.warns(attnprobe.AttnprobeWarning, match="does not reproduce"):
        with attnprobe.capture(mha) as bad:
            mha(x, x, x, need_weights=False)
    assert bad[0].meta["output_source"] == "observed"
    assert "output_match" in {v.check for v in attnprobe.check(bad).errors}


def test_forward_hooks_of_the_caller_see_what_the_caller_asked_for():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    seen = []
    first = mha.register_forward_hook(lambda m, a, o: seen.append(o[1].shape) or None)
    only_output = mha.register_forward_hook(lambda m, a, o: o[0])  # the caller's hook changes the return value
    try:
        with torch.no_grad():
            with fastpath_disabled():
                plain = mha(x, x, x)
            with attnprobe.capture(mha) as cap:
                got = mha(x, x, x)
    finally:
        first.remove()
        only_output.remove()
    assert torch.equal(got, plain) and seen == [(2, 5, 5), (2, 5, 5)]  # head-averaged, as asked, both times
    (rec,) = cap
    assert rec.weights.shape == (2, 4, 5, 5) and rec.meta["output_source"] == "observed"
    assert leftovers(mha) == []


class _Wrapper(nn.Module):
    """nn.MultiheadAttention inside modules that are themselves captured or traced."""

    def __init__(self):
        super().__init__()
        self.own = attnprobe.MultiHeadAttention(16, 4)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        y = self.mha(self.own(x), x, x)[0]
        q = self.q(y)
        return torch.softmax(q @ q.transpose(-2, -1) / 4, dim=-1) @ y  # hand-written, around the MHA


@pytest.mark.parametrize("modules", [None, "auto", "self"])
def test_nested_in_captured_and_traced_modules(modules):
    model = _Wrapper().eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        with fastpath_disabled():
            plain = model(x)
        with attnprobe.capture(model, modules=[model] if modules == "self" else modules) as cap:
            got = model(x)
    assert torch.equal(got, plain)
    backends = sorted(r.backend for r in cap)
    assert backends == (["attnprobe", "torch_mha"] if modules is None else ["attnprobe", "hand-written", "torch_mha"])
    assert attnprobe.check(cap).ok
    assert leftovers(model) == []


class _OwnForward(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        return super().forward(query * 2, key, value, **kwargs)


def test_subclass_overriding_forward_is_not_read_and_says_so():
    model = nn.Sequential(_OwnForward(16, 4, batch_first=True))
    model.add_module("plain", nn.MultiheadAttention(16, 4, batch_first=True))
    x = torch.randn(2, 5, 16)
    # why PT031 is off here: the capture warns on entering; the calls inside make the records checked below
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"overriding forward are not read: '0' \(_OwnForward\)"):  # noqa: PT031
        with torch.no_grad(), attnprobe.capture(model) as cap:
            model[0](x, x, x)
            model.plain(x, x, x)
    assert [r.name for r in cap] == ["plain"]


@pytest.mark.filterwarnings("ignore:the capture of MultiheadAttention saw no attention call")
def test_a_reading_problem_never_breaks_the_forward(monkeypatch):
    from attnprobe.hooks import torch_mha

    def broken(*args, **kwargs):
        raise RuntimeError("cannot take this call apart")

    monkeypatch.setattr(torch_mha, "mha_parts", broken)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        with fastpath_disabled():
            plain = mha(x, x, x)
        with pytest.warns(attnprobe.AttnprobeWarning, match="could not read.*cannot take this call apart"):
            with attnprobe.capture(mha) as cap:
                got = mha(x, x, x)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])  # still the head average asked for
    assert len(cap) == 0 and leftovers(mha) == []


def test_forward_that_raises_leaves_no_dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with pytest.raises(AssertionError), attnprobe.capture(mha):
        mha(
            torch.randn(2, 5, 16),
            torch.randn(2, 5, 16),
            torch.randn(2, 5, 16),
            key_padding_mask=torch.zeros(2, 3, dtype=torch.bool),
        )
    assert _get_current_dispatch_mode_stack() == [] and leftovers(mha) == []


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_input_runs_untouched_and_unrecorded():
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    nested = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)])
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        plain = mha(nested, nested, nested, need_weights=False)[0]
        with attnprobe.capture(mha) as cap:
            with pytest.warns(attnprobe.AttnprobeWarning, match="nested tensors.*not captured"):
                got = mha(nested, nested, nested, need_weights=False)[0]
            mha(x, x, x)  # a padded call in the same capture is recorded
    assert all(torch.equal(a, b) for a, b in zip(plain.unbind(), got.unbind()))
    assert [r.weights.shape for r in cap] == [(2, 4, 5, 5)]
    assert leftovers(mha) == [] and torch._C._is_torch_function_enabled()


def test_exception_in_forward_leaves_nothing_behind():
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with pytest.raises(AssertionError):  # torch's own shape check
        with attnprobe.capture(mha) as cap:
            mha(
                torch.randn(2, 5, 16),
                torch.randn(2, 5, 16),
                torch.randn(2, 5, 16),
                key_padding_mask=torch.zeros(2, 3, dtype=torch.bool),
            )
    assert len(cap) == 0 and leftovers(mha) == []


# ------------------------------------------------------------------------------ nn.Transformer stacks
def encoder(batch_first: bool) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=batch_first).eval()  # nested tensors where torch allows


def decoder(batch_first: bool) -> nn.TransformerDecoder:
    return nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 4, 32, dropout=0.1, batch_first=batch_first), 2).eval()


SRC_PAD = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
TGT_PAD = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_with_padding(batch_first):
    enc = encoder(batch_first)
    src = torch.randn(2, 7, 16) if batch_first else torch.randn(7, 2, 16)
    with torch.no_grad():
        fast = enc(src, src_key_padding_mask=SRC_PAD)  # batch_first: nested tensors + fused kernel
        with fastpath_disabled():
            slow = enc(src, src_key_padding_mask=SRC_PAD)
        with attnprobe.capture(enc) as cap:
            # torch's own layers reach sdpa only through nn.MultiheadAttention: no function mode is needed
            assert torch.overrides._get_current_function_mode_stack() == []
            got = enc(src, src_key_padding_mask=SRC_PAD)
    assert torch.equal(got, slow)  # bitwise: the same (non-fused) kernels ran
    real = ~SRC_PAD if batch_first else ~SRC_PAD.T
    torch.testing.assert_close(got[real], fast[real], rtol=0, atol=1e-5)  # padded rows are "don't care"
    assert [r.name for r in cap] == ["layers.0.self_attn", "layers.1.self_attn"] and cap.layers == (0, 1)
    for rec in cap:
        assert rec.kind == "self" and rec.causal is False and rec.weights.shape == (2, 4, 7, 7)
        assert rec.query_padding.tolist() == SRC_PAD.tolist()
        assert not rec.allowed[1, 0, :, 4:].any() and rec.allowed[0].all()
        assert torch.all(rec.weights[1, :, :, 4:] == 0)
        torch.testing.assert_close(
            rec.weights, reference_weights(rec.q, rec.k, rec.scaling, rec.allowed), rtol=0, atol=1e-6
        )
        assert rec.meta["output_error"] < 1e-5
    assert leftovers(enc) == []


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_decoder_with_causal_mask_and_padding(batch_first):
    dec = decoder(batch_first)
    tgt, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    if not batch_first:
        tgt, mem = tgt.transpose(0, 1), mem.transpose(0, 1)
    call = dict(
        tgt_mask=torch.ones(5, 5, dtype=torch.bool).triu(1),  # True = masked, like the padding masks
        tgt_key_padding_mask=TGT_PAD,
        memory_key_padding_mask=SRC_PAD,
        tgt_is_causal=True,
    )
    with torch.no_grad():
        with fastpath_disabled():
            plain = dec(tgt, mem, **call)
        with attnprobe.capture(dec) as cap:
            got = dec(tgt, mem, **call)
    assert torch.equal(got, plain)
    assert [(r.name, r.kind) for r in cap] == [
        ("layers.0.self_attn", "self"),
        ("layers.0.multihead_attn", "cross"),
        ("layers.1.self_attn", "self"),
        ("layers.1.multihead_attn", "cross"),
    ]
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    for rec in cap.select(kind="self"):
        assert rec.causal is True
        assert torch.equal(rec.allowed[0, 0], tril)
        assert torch.equal(rec.allowed[1, 0], tril & ~TGT_PAD[1])  # causal and padding together
        assert rec.query_padding.tolist() == TGT_PAD.tolist()
    for rec in cap.select(kind="cross"):
        assert rec.causal is False and rec.query_padding is None and rec.weights.shape == (2, 4, 5, 7)
        assert not rec.allowed[1, 0, :, 4:].any()
    for rec in cap:
        torch.testing.assert_close(
            rec.weights, reference_weights(rec.q, rec.k, rec.scaling, rec.allowed), rtol=0, atol=1e-6
        )
        assert rec.meta["output_error"] < 1e-5
    assert leftovers(dec) == []


def test_selection_and_budget_on_a_transformer():
    enc = encoder(True)
    src = torch.randn(2, 7, 16)
    with torch.no_grad(), attnprobe.capture(enc, layers=[-1], heads=[0, 2], keep=["weights", "q"]) as cap:
        enc(src, src_key_padding_mask=SRC_PAD)
    (rec,) = cap
    assert rec.layer == 1 and rec.heads == (0, 2) and rec.weights.shape == (2, 2, 7, 7) and rec.k is None
    with torch.no_grad(), attnprobe.capture(enc, layers=[1]) as full:
        enc(src, src_key_padding_mask=SRC_PAD)
    torch.testing.assert_close(rec.weights, full[0].weights[:, [0, 2]])
    with pytest.raises(attnprobe.CaptureBudgetError, match="layer 0"):
        with torch.no_grad(), attnprobe.capture(enc, keep="weights", max_bytes=100):
            enc(src)
    assert leftovers(enc) == []
