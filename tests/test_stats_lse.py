"""Statistics with the model kernel's own logsumexp (``AttentionCall.lse``, ``probe/engine/kernel_lse.py``): the
kernel's output stays sdpa's bit for bit on every CPU case sdpa sends to its flash kernel, its lse is the logits',
and the engine's one sweep with it gives the statistics of the eager engine's two passes (every mask of the oracle's
cases, three dtypes, one block and keys in blocks), falling back to them where the lse does not fit the logits."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_stats_oracle import BLOCK_BYTES, DTYPES, MASKS, _case

import attnprobe
from attnprobe.probe.engine import kernel_lse
from attnprobe.probe.engine import stats as engine
from attnprobe.probe.engine.kernel_lse import sdpa_with_lse
from attnprobe.probe.engine.stats import KEY_STATS, ROW_STATS, attention_stats


def exact_lse(call) -> torch.Tensor:
    """``(batch, head, query)``: the logsumexp of the call's logits over each row's allowed keys, in float64."""
    _, _, Tq, Tk = call.shape
    s = call.logits(0, Tq, 0, Tk).double()
    allowed = call.allowed(0, Tq, 0, Tk)
    return torch.logsumexp(s if allowed is None else s.masked_fill(~allowed, -math.inf), -1).float()


def assert_close_to(got, want, *, atol: float):
    """Every statistic of ``want``: integers and flags equal, floats within ``atol`` (rows not finite: ``finite``
    alone, as the two paths reach their NaNs by different roads)."""
    finite = want["finite"]
    assert torch.equal(got["finite"], finite)
    for name in ROW_STATS + KEY_STATS:
        a, b = got[name], want[name]
        if name in ROW_STATS:
            a, b = a[finite], b[finite]
        if a.dtype.is_floating_point:
            assert torch.equal(a.isnan(), b.isnan()), name
            assert torch.allclose(a.double(), b.double(), atol=atol, rtol=0, equal_nan=True), (
                name,
                (a.double() - b.double()).abs().nan_to_num(0).max(),
            )
        else:
            assert torch.equal(a, b), name


@contextlib.contextmanager
def only_the_lse_sweep():
    """The engine's max-finding paths fail if taken: the statistics come from the lse sweep alone."""

    def taken(*args, **kwargs):
        raise AssertionError("the engine did not take the kernel's lse")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine._Engine, "_one_block", taken)
        patch.setattr(engine._Engine, "_two_passes", taken)
        yield


@pytest.mark.parametrize(
    "mask,dtype",
    [(m, "fp32") for m in MASKS] + [(m, d) for d in ("bf16", "fp64") for m in ("causal", "padding", "additive")],
)
def test_one_sweep_with_the_lse_gives_the_statistics_of_two_passes(mask, dtype):
    call, diag, padding = _case(mask, "plain", DTYPES[dtype])
    with_lse = replace(call, lse=exact_lse(call))
    for block_bytes in BLOCK_BYTES.values():
        want = attention_stats(call, diag_offset=diag, query_padding=padding, block_bytes=block_bytes)
        # a row whose allowed logits are all -inf (the "nan" case's inf query) has no finite lse: the engine's own
        # paths take its block
        with only_the_lse_sweep() if mask != "nan" else contextlib.nullcontext():
            got = attention_stats(with_lse, diag_offset=diag, query_padding=padding, block_bytes=block_bytes)
        assert_close_to(got, want, atol=1e-5)


@pytest.mark.parametrize("mask", ["causal", "padding", "additive"])
def test_the_lse_sweep_gives_the_key_set_mass_of_two_passes(mask):
    """``key_set=`` (a capture's ``image_mass``) with the kernel's lse: the one sweep sums the weight on the set as the
    two passes do, one block or keys in blocks (a rebase once left the sweep without it: every row's mass 0)."""
    call, diag, padding = _case(mask, "plain", torch.float32)
    keys = torch.zeros(call.shape[0], call.shape[3], dtype=torch.bool)  # (batch, key)
    keys[:, 3:9] = True
    keys[1, 0] = True
    with_lse = replace(call, lse=exact_lse(call))
    for block_bytes in BLOCK_BYTES.values():
        want = attention_stats(call, diag_offset=diag, query_padding=padding, block_bytes=block_bytes, key_set=keys)
        with only_the_lse_sweep():
            got = attention_stats(
                with_lse, diag_offset=diag, query_padding=padding, block_bytes=block_bytes, key_set=keys
            )
        assert bool((want["key_set_mass"] > 0.1).any())
        torch.testing.assert_close(got["key_set_mass"], want["key_set_mass"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_bytes", BLOCK_BYTES.values(), ids=BLOCK_BYTES)
def test_an_lse_that_is_not_the_logits_is_not_used(block_bytes):
    """A kernel lse off by 0.01 (the logits of another call): the engine's own paths, bit for bit."""
    call, diag, padding = _case("padding", "plain", torch.float32)
    want = attention_stats(call, diag_offset=diag, query_padding=padding, block_bytes=block_bytes)
    wrong = replace(call, lse=exact_lse(call) + 0.01)
    got = attention_stats(wrong, diag_offset=diag, query_padding=padding, block_bytes=block_bytes)
    for name in ROW_STATS + KEY_STATS:
        assert torch.equal(got[name].nan_to_num(7.0), want[name].nan_to_num(7.0)), name


def test_sinks_and_overviews_take_the_engines_own_paths():
    """The kernel's lse leaves the sink logit out, and an overview cannot be taken back: both ignore it."""
    call, diag, padding = _case("causal", "bias-softcap-sinks", torch.float32)
    want = attention_stats(call, diag_offset=diag, query_padding=padding)
    got = attention_stats(replace(call, lse=exact_lse(call) + 5.0), diag_offset=diag, query_padding=padding)
    assert all(torch.equal(got[n].nan_to_num(7.0), want[n].nan_to_num(7.0)) for n in ROW_STATS + KEY_STATS)


# ------------------------------------------------------------------------------------------- the kernel's own lse
def _sdpa_cases():
    """``(name, args, kwargs)`` of sdpa calls CPU sdpa sends to its flash kernel."""
    torch.manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 21, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    allowed[0, :, :, :3] = False  # left padding: rows 0..2 of batch 0 attend no key
    additive = torch.randn(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    grouped = (q, k[:, :KV].contiguous(), v[:, :KV].contiguous())
    return [
        ("none", (q, k, v), {}),
        ("causal", (q, k, v), {"is_causal": True}),
        ("bool-mask", (q, k, v), {"attn_mask": allowed}),
        ("float-mask", (q, k, v), {"attn_mask": additive}),
        ("broadcast-mask", (q, k, v), {"attn_mask": allowed[:, :, -1:]}),
        ("scale", (q, k, v), {"is_causal": True, "scale": 0.3}),
        ("grouped", grouped, {"is_causal": True, "enable_gqa": True}),
        ("decode", (q[:, :, -1:], k, v), {"attn_mask": allowed[:, :, -1:]}),
        ("bf16", tuple(t.bfloat16() for t in (q, k, v)), {"is_causal": True}),
        ("fp16", tuple(t.half() for t in (q, k, v)), {"attn_mask": allowed}),
    ]


@pytest.mark.parametrize("name,args,kwargs", _sdpa_cases(), ids=[c[0] for c in _sdpa_cases()])
def test_the_kernel_gives_sdpas_output_bit_for_bit_and_the_logits_lse(name, args, kwargs):
    if name == "grouped" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 7):
        pytest.skip("torch 2.6's CPU flash kernel gives no lse for grouped heads (sdpa_with_lse falls back to sdpa)")
    out, lse = sdpa_with_lse(*args, **kwargs)
    want = F.scaled_dot_product_attention(*args, **kwargs)
    assert out.dtype == want.dtype and torch.equal(kernel_lse._bits(out), kernel_lse._bits(want))
    q, k, _ = args
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scale = kwargs.get("scale") or q.shape[-1] ** -0.5
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    mask = kwargs.get("attn_mask")
    if kwargs.get("is_causal"):
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    want_lse = torch.logsumexp(s, -1)
    some = want_lse.isfinite() & (want_lse > -1e30)  # rows with an allowed key
    assert lse is not None and lse.shape == want_lse.shape
    tol = 1e-5 if q.dtype == torch.float32 else 1e-3
    assert torch.allclose(lse.double()[some], want_lse[some], atol=tol, rtol=0)


def test_the_kernel_keeps_the_gradient_of_sdpa():
    """Under autograd (the monitor on a training step) the kernel's output carries sdpa's gradient."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    out, lse = sdpa_with_lse(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum(), (q, k, v))
    assert lse is not None and all(torch.equal(a, b) for a, b in zip(grads, want))


def test_calls_sdpa_does_not_send_to_a_kernel_with_an_lse_get_none():
    q = k = v = torch.randn(1, 2, 5, 8)
    assert sdpa_with_lse(q, k, v, dropout_p=0.5)[1] is None  # dropout: the math kernel (and its random numbers)
    assert sdpa_with_lse(q.double(), k.double(), v.double())[1] is not None  # fp64 runs flash on CPU too
    assert sdpa_with_lse(q[0], k[0], v[0])[1] is None  # 3-D: not read


def test_a_kernel_whose_output_differs_from_sdpas_is_never_read_again(monkeypatch):
    """The first call of each kind is compared with sdpa: a difference (a torch that changed sdpa's steps) is warned
    about, sdpa's own output is returned, and later calls of that kind run sdpa."""
    monkeypatch.setattr(kernel_lse, "_VERDICTS", {})
    real = kernel_lse._run
    monkeypatch.setattr(kernel_lse, "_run", lambda *a: (real(*a)[0] + 1e-7, real(*a)[1]))
    q = k = v = torch.randn(1, 2, 5, 8)
    with pytest.warns(UserWarning, match="differs from scaled_dot_product_attention"):
        out, lse = sdpa_with_lse(q, k, v)
    assert lse is None and torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert sdpa_with_lse(q, k, v)[1] is None


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_long_calls_kind_is_checked_on_its_first_rows(monkeypatch, mask, causal):
    """A call of more than 64 query rows is compared with sdpa on its first 64 (the kernel and sdpa both, every key,
    the mask's rows cut too): the check costs a sliver of the call. It passes on sdpa's own kernel, and a kernel that
    differs is still caught there."""
    monkeypatch.setattr(kernel_lse, "_VERDICTS", {})
    q, k, v = torch.randn(1, 2, 200, 8), torch.randn(1, 2, 230, 8), torch.randn(1, 2, 230, 8)
    attn = None if mask is None else torch.rand(1, 1, 200, 230) > 0.3
    attn = attn if mask != "float" else torch.zeros(1, 1, 200, 230).masked_fill(~attn, -1e4)
    seen = []
    real_sdpa = kernel_lse._sdpa
    monkeypatch.setattr(kernel_lse, "_sdpa", lambda *a: seen.append(a[0].shape[-2]) or real_sdpa(*a))
    out, lse = sdpa_with_lse(q, k, v, attn, is_causal=causal and mask is None)
    assert seen == [64] and lse is not None
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn, is_causal=causal and mask is None))

    monkeypatch.setattr(kernel_lse, "_VERDICTS", {})
    real = kernel_lse._run
    monkeypatch.setattr(kernel_lse, "_run", lambda *a: (real(*a)[0] + 1e-7, real(*a)[1]))
    with pytest.warns(UserWarning, match="differs from scaled_dot_product_attention"):
        out, lse = sdpa_with_lse(q, k, v, attn, is_causal=causal and mask is None)
    assert lse is None


# ------------------------------------------------------------------------------------------------------ captures
@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the sdpa calls answered with an lse (the adapters' ``sdpa_with_lse``)."""
    calls = {"lse": 0}
    real = kernel_lse.sdpa_with_lse

    def counting(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        calls["lse"] += lse is not None
        return out, lse

    from attnprobe.hooks import functional, sdpa_lse

    monkeypatch.setattr(sdpa_lse, "sdpa_with_lse", counting)
    monkeypatch.setattr(functional, "sdpa_with_lse", counting)
    return calls


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_hugging_face_statistics_capture_reads_the_kernels_lse(padding, kernel_calls, monkeypatch):
    """Llama on sdpa (grouped heads, a padding mask): every layer's sdpa call answered with its lse, the model's
    outputs bitwise the uncaptured ones, the statistics those of the capture that does not read the lse."""
    hf_helpers = pytest.importorskip("hf_helpers")
    model, batch = hf_helpers.build("llama", "sdpa"), hf_helpers.inputs("llama", padding)
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model, keep=("stats",)) as cap:
            captured = model(**batch).logits
    assert torch.equal(plain, captured) and kernel_calls["lse"] == len(cap) > 0
    from attnprobe.hooks.hf import dispatch

    monkeypatch.setattr(dispatch, "wants_lse", lambda module: False)  # the wrapper's check (hooks/hf/dispatch.py)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as without:
        model(**batch)
    assert kernel_calls["lse"] == len(cap)  # no more
    for a, b in zip(cap, without):
        assert_close_to(a.stats, b.stats, atol=1e-5)


def test_weights_only_captures_leave_the_lse_alone(kernel_calls):
    """A weights-only capture of Llama on sdpa: sdpa runs as it would (no call for the lse: torch's softmax of eager's
    own logits is as fast on CPU and exact), the weights eager's to the bit on the first layer, within 1e-6 after."""
    hf_helpers = pytest.importorskip("hf_helpers")
    model, batch = hf_helpers.build("llama", "sdpa"), hf_helpers.inputs("llama", "right", length=24)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        model(**batch)
    assert kernel_calls["lse"] == 0 and len(cap) > 1
    eager = hf_helpers.eager_attentions(model, batch)[(None, "self")]
    for layer, (record, want) in enumerate(zip(cap, eager, strict=True)):
        assert hf_helpers.max_error_on_real_rows(record, want) <= (0.0 if layer == 0 else 1e-6)


def test_direct_sdpa_calls_hand_the_kernels_lse_to_the_engine(kernel_calls):
    """A module calling sdpa itself: its statistics capture reads the lse, the output unchanged."""

    class Attention(torch.nn.Module):
        def forward(self, x):
            q, k, v = x.view(2, 9, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (batch, head, query, d_head) each
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model, x = Attention(), torch.randn(2, 9, 48)
    with torch.no_grad():
        plain = model(x)
        with attnprobe.capture(model, keep=("stats",)) as cap:
            captured = model(x)
    assert torch.equal(plain, captured) and kernel_calls["lse"] == len(cap) == 1
    assert float(cap[0].stats["row_sum_error"].max()) < 1e-5
