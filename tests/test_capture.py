"""Capture sessions on the own modules: records, masks, selection, budget, hooks, nesting."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe import CaptureBudgetError, CrossAttention, MultiHeadAttention, SelectionError


class TinyEncoderDecoder(nn.Module):
    """Two self-attention layers (the second causal) and one cross-attention layer."""

    def __init__(self, d=16, d_ctx=12, heads=4):
        super().__init__()
        self.enc = MultiHeadAttention(d_ctx, num_heads=2)
        self.dec_self = MultiHeadAttention(d, num_heads=heads, causal=True)
        self.dec_cross = CrossAttention(d, d_ctx, num_heads=heads)

    def forward(self, x, ctx, attention_mask=None, context_mask=None):
        ctx = self.enc(ctx, attention_mask=context_mask)
        x = self.dec_self(x, attention_mask=attention_mask)
        return self.dec_cross(x, ctx, attention_mask=context_mask)


@pytest.fixture
def model():
    return TinyEncoderDecoder().eval()


def inputs():
    x, ctx = torch.randn(2, 9, 16), torch.randn(2, 8, 12)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])  # left padding
    ctx_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])  # right padding
    return x, ctx, mask, ctx_mask


def test_records_have_documented_shapes(model, assert_no_hooks):
    x, ctx, mask, ctx_mask = inputs()
    with attnprobe.capture(model) as cap:
        model(x, ctx, mask, ctx_mask)
    assert [r.name for r in cap] == ["enc", "dec_self", "dec_cross"]
    assert [r.layer for r in cap] == [0, 1, 2]
    assert [r.kind for r in cap] == ["self", "self", "cross"]
    assert [r.causal for r in cap] == [False, True, False]
    enc, dec, cross = cap
    assert enc.q.shape == (2, 2, 8, 6) and enc.weights.shape == (2, 2, 8, 8)
    assert dec.q.shape == (2, 4, 9, 4) and dec.k.shape == (2, 4, 9, 4) and dec.scores.shape == (2, 4, 9, 9)
    # cross-attention: 9 queries of width 16 against 8 context tokens of width 12
    assert cross.q.shape == (2, 4, 9, 4) and cross.k.shape == (2, 4, 8, 4) and cross.v.shape == (2, 4, 8, 4)
    assert cross.scores.shape == cross.weights.shape == (2, 4, 9, 8)
    assert cross.output.shape == (2, 4, 9, 4)
    assert dec.allowed.dtype == torch.bool and dec.allowed.shape == (2, 1, 9, 9)
    assert dec.query_padding.tolist() == (mask == 0).tolist()
    assert cross.query_padding is None  # the context mask says nothing about the queries
    assert dec.scaling == pytest.approx(0.5) and dec.backend == "attnprobe" and dec.dtype == torch.float32
    assert dec.weights_source == "observed" and dec.num_heads == dec.num_kv_heads == 4
    assert dec.identified >= {"q", "k", "v", "scores", "weights", "output", "allowed", "query_padding"}
    assert_no_hooks(model)


def test_record_is_frozen_and_tensors_detached(model):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model) as cap:
        model(x.requires_grad_(), ctx)
    rec = cap[1]
    with pytest.raises(AttributeError):
        rec.weights = None
    assert not rec.weights.requires_grad and rec.weights.device.type == "cpu"


def test_record_values_are_the_math(model):
    x, ctx, mask, ctx_mask = inputs()
    with attnprobe.capture(model) as cap:
        out = model(x, ctx, mask, ctx_mask)
    for rec in cap:
        scores = rec.q @ rec.k.transpose(-2, -1) * rec.scaling
        torch.testing.assert_close(rec.scores, scores)
        torch.testing.assert_close(rec.output, rec.weights @ rec.v)
    cross = cap[2]
    merged = cross.output.transpose(1, 2).reshape(2, 9, 16)
    torch.testing.assert_close(model.dec_cross.out_proj(merged), out)


def test_weights_sum_to_one_on_real_rows_and_disallowed_exactly_zero(model):
    x, ctx, mask, ctx_mask = inputs()
    with attnprobe.capture(model) as cap:
        model(x, ctx, mask, ctx_mask)
    for rec in cap:
        allowed = rec.allowed_for_heads()
        assert torch.all(rec.weights[~allowed] == 0), rec.name
        has_key = allowed.any(-1)
        real = has_key if rec.query_padding is None else has_key & ~rec.query_padding[:, None, :]
        sums = rec.weights.sum(-1)
        torch.testing.assert_close(sums[real], torch.ones_like(sums[real]))
    dec = cap[1]
    # left padding + causal: padded query rows 0 and 1 of batch 0 have no allowed key -> zeros, not NaN
    assert not dec.allowed[0, 0, :2].any()
    assert torch.all(dec.weights[0, :, :2] == 0) and torch.isfinite(dec.output).all()
    # right-padded context: keys 5..7 of batch 1 disallowed for every query of the cross layer
    assert not cap[2].allowed[1, 0, :, 5:].any() and cap[2].allowed[1, 0, :, :5].all()


def test_outputs_bitwise_identical_with_capture(model):
    x, ctx, mask, ctx_mask = inputs()
    plain = model(x, ctx, mask, ctx_mask)
    with attnprobe.capture(model):
        captured = model(x, ctx, mask, ctx_mask)
    assert torch.equal(plain, captured)


def test_no_hook_left_after_exception(model, assert_no_hooks):
    x, ctx, _, _ = inputs()
    with pytest.raises(ValueError, match="d_model=16"):
        with attnprobe.capture(model) as cap:
            model(torch.randn(2, 9, 5), ctx)  # wrong width: the second layer raises mid-forward
    assert_no_hooks(model)
    assert [r.layer for r in cap] == [0]
    with pytest.raises(RuntimeError, match="boom"):  # noqa: PT012  (an error raised through the capture's exit)
        with attnprobe.capture(model) as cap:
            model(x, ctx)
            raise RuntimeError("boom")
    assert_no_hooks(model)
    assert len(cap) == 3  # what was captured before the error is kept


def test_selection_stores_only_what_was_asked(model):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model, layers=[1], heads=[0, 3], keep=["weights", "q"]) as cap:
        model(x, ctx)
    (rec,) = cap
    assert rec.layer == 1 and rec.heads == (0, 3)
    assert rec.k is None and rec.v is None and rec.scores is None and rec.output is None
    assert rec.weights.shape == (2, 2, 9, 9) and rec.q.shape == (2, 2, 9, 4)
    allowed_bytes = rec.allowed.numel()  # bool, 1 byte per entry
    assert rec.nbytes == (2 * 2 * 9 * 9 + 2 * 2 * 9 * 4) * 4 + allowed_bytes
    assert cap.nbytes == rec.nbytes
    # the heads kept are the model's heads 0 and 3
    with attnprobe.capture(model, layers=[1]) as full:
        model(x, ctx)
    torch.testing.assert_close(rec.weights, full[0].weights[:, [0, 3]])


def test_storage_dtype_and_per_layer_heads(model):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model, heads={1: [2], 2: None}, dtype=torch.float16) as cap:
        model(x, ctx)
    assert [r.layer for r in cap] == [1, 2]
    assert cap[0].heads == (2,) and cap[1].heads == (0, 1, 2, 3)
    assert cap[0].weights.dtype == torch.float16 and cap[0].allowed.dtype == torch.bool
    assert cap[0].dtype == torch.float32  # the dtype attention ran in


def test_idle_capture_stores_nothing(model, assert_no_hooks):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model, layers=[]) as cap:
        model(x, ctx)
    assert len(cap) == 0
    assert_no_hooks(model)


def test_budget_error_before_memory_is_spent(model, assert_no_hooks):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model, layers=[1], keep="weights") as one:
        model(x, ctx)
    per_call = one.nbytes
    with pytest.raises(CaptureBudgetError, match=r"max_bytes.*Select fewer layers") as err:
        with attnprobe.capture(model, keep="weights", max_bytes=per_call + 10) as cap:
            model(x, ctx)
    assert "layer 1" in str(err.value)
    assert cap.nbytes <= per_call + 10  # only layer 0 fitted
    assert [r.layer for r in cap] == [0]
    assert_no_hooks(model)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"layers": [3]}, "layer 3 is out of range: the model has 3 attention layer"),
        ({"layers": ["1"]}, "integers"),
        ({"heads": [7]}, r"head\(s\) \[7\] out of range for layer 0"),
        ({"keep": ["pattern"]}, "unknown tensor name"),
        ({"max_bytes": -1}, "max_bytes must be a positive whole number of bytes"),
        ({"dtype": torch.int8}, "floating torch dtype"),
    ],
)
def test_selection_errors_are_clear(model, options, match, assert_no_hooks):
    with pytest.raises(SelectionError, match=match):
        with attnprobe.capture(model, **options):
            pass
    assert_no_hooks(model)


def test_negative_layers_count_from_the_end(model):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model, layers=[-1]) as cap:
        model(x, ctx)
    assert [r.name for r in cap] == ["dec_cross"]


def test_not_a_module_is_a_clear_error():
    with pytest.raises(attnprobe.UnsupportedModelError, match=r"needs a torch\.nn\.Module"):  # also a TypeError
        attnprobe.capture(torch.randn(3))


def test_nested_captures_both_record(model, assert_no_hooks):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model, layers=[0]) as outer:
        with attnprobe.capture(model, layers=[0, 2], keep="weights") as inner:
            model(x, ctx)
        model(x, ctx)
    assert [(r.layer, r.call) for r in outer] == [(0, 0), (0, 1)]
    assert [r.layer for r in inner] == [0, 2] and inner[0].q is None
    torch.testing.assert_close(outer[0].weights, inner[0].weights)
    assert_no_hooks(model)


def test_calls_are_counted_per_module(model):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model) as cap:
        model(x, ctx)
        model(x, ctx)
    assert [(r.layer, r.call) for r in cap] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert cap.record(2, call=1) is cap[5]
    with pytest.raises(KeyError, match="no record for layer 5"):
        cap.record(5)


def test_capture_keeps_no_reference_to_the_model():
    model = TinyEncoderDecoder()
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model) as cap:
        model(x, ctx)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and len(cap) == 3


def test_the_capture_object_lets_go_of_the_model_on_exit():
    """Also the ``capture(...)`` object itself, kept by the caller past its block: its session and adapters drop the
    model and the walk of its modules."""
    model = TinyEncoderDecoder()
    x, ctx, _, _ = inputs()
    session = attnprobe.capture(model)
    with session as cap:
        model(x, ctx)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and len(cap) == 3


def test_capture_is_read_only_and_selects(model):
    x, ctx, _, _ = inputs()
    with attnprobe.capture(model) as cap:
        model(x, ctx)
    with pytest.raises(TypeError):
        cap[0] = cap[1]
    assert not hasattr(cap, "append")
    assert isinstance(cap[1:], attnprobe.Capture) and len(cap[1:]) == 2
    cross = cap.select(kind="cross", heads=[1, 2])
    assert len(cross) == 1 and cross[0].heads == (1, 2) and cross[0].weights.shape[1] == 2
    torch.testing.assert_close(cross[0].weights, cap[2].weights[:, 1:3])
    assert cap.select(layers=[0, 1]).layers == (0, 1)
    with pytest.raises(KeyError, match="head 3 of 'enc' was not captured"):
        cap.select(layers=[0], heads=[3])
    with pytest.raises(TypeError, match="select"):
        cap["enc"]
    assert cap.info["model_class"] == "TinyEncoderDecoder"
    assert cap.info["attention_modules"] == ("enc", "dec_self", "dec_cross")


def test_run_returns_output_and_capture(model):
    x, ctx, mask, _ = inputs()
    out, cap = attnprobe.run(model, (x, ctx), layers=[1])
    assert torch.equal(out, model(x, ctx)) and [r.layer for r in cap] == [1]
    out, cap = attnprobe.run(model, {"x": x, "ctx": ctx, "attention_mask": mask}, keep="weights")
    assert len(cap) == 3 and not out.requires_grad


def test_dropout_recorded_in_training_mode():
    attn = MultiHeadAttention(8, num_heads=2, dropout=0.25)
    with attnprobe.capture(attn) as cap:
        attn.train()(torch.randn(1, 4, 8))
        attn.eval()(torch.randn(1, 4, 8))
    assert [r.dropout for r in cap] == [0.25, 0.0]


def test_unbatched_input_records_batch_of_one():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(5, 8), attention_mask=torch.tensor([0, 1, 1, 1, 1]))
    assert cap[0].weights.shape == (1, 2, 5, 5) and cap[0].query_padding.tolist() == [
        [True, False, False, False, False]
    ]


def test_empty_capture_warns(model):
    with pytest.warns(attnprobe.AttnprobeWarning, match="saw no attention call"):
        with attnprobe.capture(model):
            pass


def test_import_is_quiet():
    code = (
        "import sys, torch\n"
        "from torch.nn.modules import module as m\n"
        "state = lambda: (len(m._global_forward_hooks), len(m._global_forward_pre_hooks),"
        " torch.overrides._get_current_function_mode_stack())\n"
        "before = state()\n"
        "import attnprobe\n"
        "public = [getattr(attnprobe, name) for name in attnprobe.__all__]\n"
        "after = state()\n"
        "assert before == after, (before, after)\n"
        "heavy = [n for n in ('pandas', 'matplotlib', 'transformers', 'jinja2') if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_pytest_plugin_costs_other_projects_nothing():
    # the plugin loads in every pytest run of an environment with attnprobe: it must not pull torch in
    code = "import sys, attnprobe.probe.pytest_plugin\nassert 'torch' not in sys.modules, 'torch imported'\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_causal_attn_mask_makes_the_record_causal():
    # the module is not causal; the caller passes a lower-triangular mask (True = may attend), as with sdpa
    attn = MultiHeadAttention(8, num_heads=2).eval()
    x = torch.randn(2, 5, 8)
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    with attnprobe.capture(attn) as cap:
        attn(x, attn_mask=tril)
        attn(x, attn_mask=tril.T)  # anti-causal: not causal
        attn(x)
        attn(x, is_causal=True)
    assert [r.causal for r in cap] == [True, False, False, True]
    assert attnprobe.check(cap[0], causal=True).ok and not attnprobe.check(cap[1], causal=True).ok
