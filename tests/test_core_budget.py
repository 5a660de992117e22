"""Storage and budget of the core: exact planned sizes (masks and sinks included), one copy per tensor."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnprobe
from attnprobe import CaptureBudgetError, MultiHeadAttention
from attnprobe.hooks.base import Adapter, Site
from attnprobe.probe.capture import CaptureSession, Lazy
from attnprobe.probe.selection import Selection, Store


def per_head_mask(B=2, H=4, T=6) -> torch.Tensor:
    """A bool attn_mask with a different pattern per head, so ``allowed`` is stored per head."""
    mask = torch.rand(B, H, T, T) > 0.4
    return mask | torch.eye(T, dtype=torch.bool)


def test_budget_counts_the_stored_per_head_mask_exactly():
    attn = MultiHeadAttention(16, num_heads=4).eval()
    x, mask = torch.randn(2, 6, 16), per_head_mask()
    with attnprobe.capture(attn, heads=[0, 3], keep="weights") as free:
        attn(x, attn_mask=mask)
    (rec,) = free
    assert rec.allowed.shape == (2, 2, 6, 6)  # only the two selected heads of the mask are stored
    assert rec.nbytes == 2 * 2 * 6 * 6 * 4 + 2 * 2 * 6 * 6
    # exactly the record's size fits; one byte less fails before anything is stored
    with attnprobe.capture(attn, heads=[0, 3], keep="weights", max_bytes=rec.nbytes) as cap:
        attn(x, attn_mask=mask)
    assert cap.nbytes == rec.nbytes
    with pytest.raises(CaptureBudgetError, match="weights, allowed"):
        with attnprobe.capture(attn, heads=[0, 3], keep="weights", max_bytes=rec.nbytes - 1) as cap:
            attn(x, attn_mask=mask)
    assert len(cap) == 0


def test_budget_counts_query_padding_and_storage_dtype():
    attn = MultiHeadAttention(8, num_heads=2, causal=True).eval()
    x, pad = torch.randn(3, 5, 8), torch.tensor([[0, 1, 1, 1, 1]] * 3)
    with attnprobe.capture(attn, dtype=torch.float16) as cap:
        attn(x, attention_mask=pad)
    (rec,) = cap
    assert rec.query_padding is not None and rec.weights.dtype == torch.float16
    with attnprobe.capture(attn, dtype=torch.float16, max_bytes=rec.nbytes) as again:
        attn(x, attention_mask=pad)
    assert again.nbytes == rec.nbytes
    with pytest.raises(CaptureBudgetError):
        with attnprobe.capture(attn, dtype=torch.float16, max_bytes=rec.nbytes - 1):
            attn(x, attention_mask=pad)


class _Fake(Adapter):
    """An adapter with one site and no hooks: the test calls ``session.emit`` itself."""

    name = "fake"

    def __init__(self, module):
        self.module = module

    def find(self, model, claimed):
        return [Site("attn", self.module, self, num_heads=4, num_kv_heads=2)]

    def attach(self, session, model, sites, stack: ExitStack) -> None:
        self.session, self.site = session, sites[0]


def fake_session(**selection) -> tuple[CaptureSession, _Fake]:
    module = torch.nn.Identity()
    adapter = _Fake(module)
    return CaptureSession(module, Selection.build(**selection), [adapter]), adapter


def sink_values(B=2, H=4, Hkv=2, T=5):
    return dict(
        q=torch.randn(B, H, T, 8),
        k=torch.randn(B, Hkv, T, 8),
        weights=torch.rand(B, H, T, T),
        allowed=torch.ones(B, 1, T, T, dtype=torch.bool),
        sinks=torch.randn(H, dtype=torch.float64),
    )


def test_budget_counts_sinks():
    values = sink_values()
    session, adapter = fake_session(heads=[1, 3], dtype=torch.float16)
    with session as cap:
        adapter.session.emit(adapter.site, kind="self", **values)
    (rec,) = cap
    assert rec.sinks.shape == (2,) and rec.sinks.dtype == torch.float16
    torch.testing.assert_close(rec.sinks, values["sinks"][[1, 3]].half())
    assert rec.kv_heads == (0, 1) and rec.k.shape[1] == 2  # heads 1 and 3 read kv heads 0 and 1
    for budget, fits in ((rec.nbytes, True), (rec.nbytes - 1, False)):
        session, adapter = fake_session(heads=[1, 3], dtype=torch.float16, max_bytes=budget)
        if fits:
            with session as cap:
                adapter.session.emit(adapter.site, kind="self", **values)
            assert cap.nbytes == rec.nbytes
        else:
            with pytest.raises(CaptureBudgetError, match="sinks"):
                with session as cap:
                    adapter.session.emit(adapter.site, kind="self", **values)
            assert len(cap) == 0


def test_lazy_larger_than_declared_is_charged_and_stored_as_planned():
    session, adapter = fake_session(keep=["scores"], max_bytes=4 * 5 * 5 * 4 + 10)
    wrong = Lazy((1, 4, 5, 5), torch.float32, lambda: torch.randn(2, 4, 5, 5))  # twice what it declared
    with pytest.raises(CaptureBudgetError, match="scores"):
        with session:
            adapter.session.emit(adapter.site, kind="self", scores=wrong)
    session, adapter = fake_session(keep=["scores"])
    half = Lazy((1, 4, 5, 5), torch.float16, lambda: torch.randn(1, 4, 5, 5))  # computed in float32
    with session as cap:
        adapter.session.emit(adapter.site, kind="self", scores=half)
    assert cap[0].scores.dtype == torch.float16 and session.store.used == cap.nbytes


def test_lazy_view_is_copied_so_the_record_shares_no_memory():
    base = torch.randn(1, 4, 5, 5)
    session, adapter = fake_session(keep=["weights"])
    with session as cap:
        adapter.session.emit(
            adapter.site, kind="self", weights=Lazy((1, 4, 5, 5), torch.float32, lambda: base.view(1, 4, 5, 5))
        )
    assert cap[0].weights.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    torch.testing.assert_close(cap[0].weights, base)


class _Allocations(TorchDispatchMode):
    """Counts aten calls that allocate a new tensor."""

    ALLOCATING = ("index_select", "_to_copy", "clone", "empty", "contiguous", "cat", "index")

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith(self.ALLOCATING):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [None, torch.float16])
@pytest.mark.parametrize("heads", [(0, 5, 9), (1, 2, 3), (7, 0), (4, 5, 8, 9, 11)])
def test_selected_heads_are_copied_once(heads, dtype):
    t = torch.randn(2, 12, 3, 4).transpose(2, 3)  # a non-contiguous live tensor, as attention code makes them
    store = Store(Selection.build(dtype=dtype))
    with _Allocations() as seen:
        out = store.put(t, heads)
    assert len(seen.calls) == 1, seen.calls
    expected = t[:, list(heads)].to(dtype or t.dtype)
    assert torch.equal(out, expected) and out.dtype == (dtype or torch.float32)
    assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_planned_bytes_equal_stored_bytes():
    store = Store(Selection.build(dtype=torch.bfloat16))
    for t, index, axis in (
        (torch.randn(2, 6, 4, 4), (0, 2, 5), 1),
        (torch.ones(2, 1, 4, 4, dtype=torch.bool), None, 1),
        (torch.randn(6, dtype=torch.float64), (1, 4), 0),
        (torch.zeros(2, 4, dtype=torch.bool), None, 1),
    ):
        out = store.put(t, index, axis)
        assert store.planned_bytes(t.shape, t.dtype, index, axis) == out.numel() * out.element_size()


def test_budget_message_suggests_only_what_would_help():
    attn = MultiHeadAttention(8, num_heads=2)
    for dtype, suggests_dtype in ((None, True), (torch.float16, False)):
        with pytest.raises(CaptureBudgetError) as err:
            attnprobe.run(attn, torch.randn(1, 4, 8), dtype=dtype, max_bytes=10)
        message = str(err.value)
        assert "layers=[...]" in message and "raise max_bytes" in message
        assert ("dtype=torch.float16" in message) == suggests_dtype


class _Ops(TorchDispatchMode):
    """Counts the aten ops run while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _SdpaBlock(torch.nn.Module):
    """A direct ``F.scaled_dot_product_attention`` call (causal), read by the functional adapter."""

    def __init__(self, d=16, h=4):
        super().__init__()
        self.h, self.proj = h, torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.proj(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _recomputing_models():
    """Models whose scores and weights attnprobe recomputes (the model's own kernel exposes neither)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    return {
        "sdpa": (_SdpaBlock().eval(), lambda m, x: m(x)),
        "mha": (mha, lambda m, x: m(x, x, x, need_weights=False, key_padding_mask=pad)),
        "encoder layer": (layer, lambda m, x: m(x, src_key_padding_mask=pad)),
    }


@pytest.mark.parametrize("kind", ["sdpa", "mha", "encoder layer"])
def test_recomputed_fields_are_computed_only_when_kept(kind):
    model, call = _recomputing_models()[kind]
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        with attnprobe.capture(model) as full:
            call(model, x)
        with _Ops() as plain:
            call(model, x)
        extra = {}  # ops run beyond the plain forward's, per kept tensor
        for keep in ("q", "scores", "weights"):
            with _Ops() as ops, attnprobe.capture(model, keep=[keep], heads=[1, 3]) as cap:
                call(model, x)
            extra[keep] = {op: n - plain.counts.get(op, 0) for op, n in ops.counts.items()}
            (rec,) = cap
            torch.testing.assert_close(getattr(rec, keep), getattr(full[0], keep)[:, [1, 3]], rtol=0, atol=0)
    # softmax passes: `_softmax` into a new tensor, `softmax` (its out= form) into one the recompute owns
    softmaxes = {keep: c.get("_softmax", 0) + c.get("softmax", 0) for keep, c in extra.items()}
    assert softmaxes["q"] == 0 and softmaxes["scores"] == 0, softmaxes  # no unasked weights
    assert softmaxes["weights"] == 1, softmaxes
    # the weights' products: q @ k only (no weights @ v for an output that is not kept)
    products = {keep: sum(c.get(op, 0) for op in ("bmm", "mm", "matmul")) for keep, c in extra.items()}
    assert products["weights"] == products["scores"], products


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_budget_message_leaves_out_what_the_capture_already_does(model_dtype):
    """One kept tensor of one head, stored in 2 bytes: only fewer layers or a larger budget can help."""
    model = torch.nn.Sequential(MultiHeadAttention(8, num_heads=2), MultiHeadAttention(8, num_heads=2)).to(model_dtype)
    x = torch.randn(1, 4, 8, dtype=model_dtype)
    dtype = None if model_dtype == torch.bfloat16 else torch.float16  # stored in 2 bytes either way
    with pytest.raises(CaptureBudgetError) as err:
        attnprobe.run(model, x, keep="weights", heads=[1], dtype=dtype, max_bytes=10)
    message = str(err.value)
    assert "layers=[...]" in message and "raise max_bytes" in message
    assert "keep=" not in message and "heads=" not in message and "dtype=" not in message
    # with more to leave out, each is suggested (the weights kept among others, heads, a float32 model's dtype)
    with pytest.raises(CaptureBudgetError) as err:
        attnprobe.run(model.float(), x.float(), keep=("q", "weights"), layers=[0], max_bytes=10)
    message = str(err.value)
    assert "keep=('weights',)" in message and "heads=[...]" in message and "dtype=torch.float16" in message
    assert "layers=[...]" not in message  # one layer is selected already


class _BigFloats(TorchDispatchMode):
    """Counts op results that are new floating tensors (not views) of at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.dtype.is_floating_point
                and t.numel() >= self.numel
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.count += 1
        return out


class _BiasedSdpa(torch.nn.Module):
    """A direct sdpa call with a per-head float mask."""

    def __init__(self, mask, h=4):
        super().__init__()
        self.h, self.mask, self.proj = h, mask, torch.nn.Linear(16, 48)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.proj(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


@pytest.mark.parametrize("kind", ["mha", "sdpa"])
def test_per_head_float_mask_is_not_copied_for_every_head(kind):
    """An ALiBi-like per-head float mask: a capture of one head's q makes no float tensor of every head's
    (query, key) entries (the bias is split off only when scores are wanted, for the selected heads)."""
    torch.manual_seed(0)
    B, H, T = 2, 4, 32  # (query, key) entries of every head outnumber those of q, k, v
    slopes = -torch.arange(1.0, H + 1).view(H, 1, 1) / 4
    distance = (torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)).abs()
    alibi = (slopes * distance).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    x = torch.randn(B, T, 16)
    if kind == "mha":
        model = torch.nn.MultiheadAttention(16, H, batch_first=True).eval()
        mask = alibi.repeat(B, 1, 1)  # (B * H, T, T)
        call = lambda: model(x, x, x, attn_mask=mask, need_weights=False)  # noqa: E731
    else:
        model = _BiasedSdpa(alibi.expand(B, H, T, T).contiguous()).eval()
        call = lambda: model(x)  # noqa: E731
    with torch.no_grad():
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)  # as under a capture: the same (slow) path's own tensors
        try:
            with _BigFloats(B * H * T * T) as plain:
                call()
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)
        for keep in (["q"], ["q", "weights"]):
            with _BigFloats(B * H * T * T) as seen, attnprobe.capture(model, heads=[1], keep=keep) as cap:
                call()
            assert seen.count == plain.count, keep
        with attnprobe.capture(model) as full:
            call()
    torch.testing.assert_close(cap[0].weights, full[0].weights[:, [1]], rtol=0, atol=0)
    assert full[0].causal is True
    # the mask's bias is in the scores (on the entries it does not mask)
    rec = full[0]
    expected = (rec.q * rec.scaling) @ rec.k.transpose(-1, -2) + alibi.view(1, H, T, T)
    torch.testing.assert_close(rec.scores[rec.allowed_for_heads()], expected[rec.allowed_for_heads()])


def test_hf_weights_only_capture_adds_the_mask_to_the_logits_in_place():
    """Weights recomputed for a Hugging Face call, scores not kept: the logits of the selected heads are the only
    (query, key) tensor made (the mask is added and the softmax written in place: they become the record's
    weights); with scores kept, the masked logits are the one more (the weights), and the weights are right."""
    from hf_helpers import build

    model = build("llama", "sdpa")
    B, T = 2, 96  # (query, key) entries of two heads outnumber any hidden state of the tiny model
    ids = torch.randint(3, 100, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with _BigFloats(B * 2 * T * T) as plain:
            model(ids)
        with (
            _BigFloats(B * 2 * T * T) as seen,
            attnprobe.capture(model, layers=[0], heads=[0, 1], keep="weights") as cap,
        ):
            model(ids)
        with (
            _BigFloats(B * 2 * T * T) as seen_both,
            attnprobe.capture(model, layers=[0], heads=[0, 1], keep=["scores", "weights"]) as both,
        ):
            model(ids)
    # the logits, the softmax written into them (issue 22: once two, the softmax a tensor of its own)
    assert seen.count - plain.count == 1
    # the logits (kept as the scores), the masked logits the softmax is written into (issue 22: once three)
    assert seen_both.count - plain.count == 2
    torch.testing.assert_close(cap[0].weights, both[0].weights, rtol=0, atol=0)
    assert both[0].scores is not None and not torch.equal(both[0].scores, both[0].weights)


class _Copies(TorchDispatchMode):
    """Counts copies (clone, _to_copy, contiguous) whose result has ``shape``."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("clone", "_to_copy", "contiguous") and tuple(out.shape) == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_kept_q_is_the_copy_the_product_reads(name):
    """A Hugging Face capture that keeps q and recomputes the scores copies q once: the record keeps the very
    contiguous copy the batched q @ k reads (issue 22: once two copies, the record's and the product's)."""
    from hf_helpers import build

    model = build(name, "sdpa")
    B, T = 2, 9
    ids = torch.randint(3, 100, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attnprobe.capture(model, layers=[0]) as full:
        model(ids)
    q_shape = full[0].q.shape  # (batch, head, query, d_head)
    counts = {}
    for keep in (["scores"], ["q", "scores"]):
        with torch.no_grad(), _Copies(q_shape) as seen, attnprobe.capture(model, layers=[0], keep=keep) as cap:
            model(ids)
        counts[tuple(keep)] = seen.count
    assert counts["q", "scores"] == counts["scores",], counts  # keeping q adds no copy of it
    torch.testing.assert_close(cap[0].q, full[0].q, rtol=0, atol=0)
    torch.testing.assert_close(cap[0].scores, full[0].scores, rtol=0, atol=0)
    assert cap[0].q.is_contiguous()
