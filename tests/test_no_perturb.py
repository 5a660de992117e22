"""A capture never perturbs the model: autograd, the RNG stream, global torch / transformers state, the
user's objects, with every adapter (own modules, Hugging Face eager and sdpa, nn.MultiheadAttention and
TransformerEncoder, direct sdpa calls, hand-written attention traced by name and with ``modules="auto"``)."""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from hf_helpers import build
from hf_helpers import inputs as hf_inputs
from torch import nn
from torch_helpers import FusedSplit, HeadList

import attnprobe
from attnprobe import CaptureBudgetError

D, H = 16, 4


# ------------------------------------------------------------------------------------------ models
class MHACall(nn.Module):
    """One nn.MultiheadAttention called with the given flags and a key padding mask."""

    def __init__(self, batch_first: bool, need_weights: bool):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, dropout=0.2, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x, padding):
        out, w = self.mha(x, x, x, key_padding_mask=padding, need_weights=self.need_weights)
        return out if w is None else out + w.sum()


class Encoder(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.2, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, padding):
        return self.enc(x, src_key_padding_mask=padding)


class SdpaDropout(nn.Module):
    """Direct sdpa call with dropout in training, causal."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2 if self.training else 0.0)
        return self.o(o.transpose(1, 2).reshape(B, T, D))


class OwnStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = attnprobe.MultiHeadAttention(D, num_heads=H, causal=True, dropout=0.2)
        self.b = attnprobe.MultiHeadAttention(D, num_heads=H, dropout=0.2)

    def forward(self, x, padding):
        return self.b(self.a(x, attention_mask=padding), attention_mask=padding)


def _x(time_first=False):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, D, generator=g)
    return x.transpose(0, 1).contiguous() if time_first else x


def _padding_bool():
    p = torch.zeros(2, 6, dtype=torch.bool)
    p[0, -2:] = True  # True = padded (torch's convention)
    return p


TORCH_CASES = {
    "own": (OwnStack, lambda: (_x(), torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])), {}),
    "mha-bf-weights": (lambda: MHACall(True, True), lambda: (_x(), _padding_bool()), {}),
    "mha-tf-noweights": (lambda: MHACall(False, False), lambda: (_x(True), _padding_bool()), {}),
    "encoder-bf": (lambda: Encoder(True), lambda: (_x(), _padding_bool()), {}),
    "encoder-tf": (lambda: Encoder(False), lambda: (_x(True), _padding_bool()), {}),
    "sdpa": (SdpaDropout, lambda: (_x(),), {}),
    "hand-named": (HeadList, lambda: (_x(),), {"modules": ["heads"]}),
    "hand-auto": (FusedSplit, lambda: (_x(), torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])), {"modules": "auto"}),
}
HF_CASES = [(name, attn) for name in ("bert", "gpt2", "llama", "t5") for attn in ("eager", "sdpa")]
ALL = [*TORCH_CASES, *(f"hf-{n}-{a}" for n, a in HF_CASES)]


def make(case: str, seed: int = 0):
    """(model, positional args, keyword args, capture options) for ``case``, the model in train mode."""
    if case.startswith("hf-"):
        _, name, attn = case.split("-")
        model = build(name, attn, seed=seed)
        if name == "llama":
            model.config.attention_dropout = 0.2
            for layer in model.model.layers:
                layer.self_attn.attention_dropout = 0.2
        return model.train(), (), hf_inputs(name, "right"), {}
    factory, args, options = TORCH_CASES[case]
    torch.manual_seed(seed)
    return factory().train(), args(), {}, options


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        t = out
    else:
        t = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return (t.float() ** 2).mean()


def run_train(model, args, kwargs, seed: int = 7):
    """Seeded train-mode forward + backward: (loss, {param: grad} and the input's grad, rng state after the
    forward). A floating input gets a gradient too."""
    model.zero_grad(set_to_none=True)
    if args and args[0].is_floating_point():
        args = (args[0].detach().clone().requires_grad_(), *args[1:])
    torch.manual_seed(seed)
    loss = loss_of(model(*args, **kwargs))
    rng = torch.get_rng_state()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if args and args[0].requires_grad:
        grads["<input>"] = args[0].grad
    return loss.detach(), grads, rng


# ------------------------------------------------------------------------------------------ state
def _configs(model):
    seen = {}
    for m in model.modules():
        c = getattr(m, "config", None)
        todo = [c] if c is not None and hasattr(c, "_attn_implementation") else []
        while todo:
            c = todo.pop()
            if id(c) in seen:
                continue
            seen[id(c)] = c
            todo.extend(
                getattr(c, k)
                for k in (getattr(c, "sub_configs", None) or {})
                if hasattr(getattr(c, k, None), "_attn_implementation")
            )
    return list(seen.values())


def global_state(model=None) -> dict:
    """Everything a capture could switch: torch's global and thread-local settings, the model's hooks,
    flags and attention implementations, and the transformers registries."""
    from torch.nn.modules import module as module_mod

    state = {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "fastpath": torch.backends.mha.get_fastpath_enabled(),
        "function_modes": torch._C._len_torch_function_stack(),
        "function_enabled": torch._C._is_torch_function_enabled(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "autocast_dtype": torch.get_autocast_dtype("cpu"),
        "anomaly": torch.is_anomaly_enabled(),
        "sdp_backends": (
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
        ),
        "global_hooks": tuple(
            len(getattr(module_mod, a))
            for a in (
                "_global_forward_hooks",
                "_global_forward_pre_hooks",
                "_global_backward_hooks",
                "_global_backward_pre_hooks",
                "_global_forward_hooks_always_called",
                "_global_forward_hooks_with_kwargs",
            )
        ),
    }
    import sys

    if "transformers" in sys.modules:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        state["attention_functions"] = tuple(sorted(ALL_ATTENTION_FUNCTIONS.valid_keys()))
        state["mask_functions"] = tuple(sorted(ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()))
    if model is not None:
        state["training"] = tuple(m.training for m in model.modules())
        state["requires_grad"] = tuple(p.requires_grad for p in model.parameters())
        state["hooks"] = tuple(
            (
                name,
                tuple(
                    tuple(getattr(m, a))
                    for a in (
                        "_forward_hooks",
                        "_forward_pre_hooks",
                        "_backward_hooks",
                        "_backward_pre_hooks",
                        "_forward_hooks_with_kwargs",
                        "_forward_pre_hooks_with_kwargs",
                        "_forward_hooks_always_called",
                    )
                ),
            )
            for name, m in model.named_modules()
        )
        state["implementations"] = tuple(c._attn_implementation for c in _configs(model))
    return state


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different names"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what} differ with capture on: {differ[:5]}"


# ------------------------------------------------------------------------------------------ 1, 2: autograd and RNG
@pytest.mark.parametrize("case", ALL)
def test_train_forward_backward_is_bitwise_unchanged(case):
    """Train mode, dropout on: loss, every gradient, the RNG stream and the parameters are those of a run
    without capture; records hold no graph; the state around is what it was."""
    model, args, kwargs, options = make(case)
    params = snapshot(model)
    loss_off, grads_off, rng_off = run_train(model, args, kwargs)
    before = global_state(model)
    kept = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    kept_args = [a.clone() for a in args]
    versions = [t._version for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    with attnprobe.capture(model, **options) as cap:
        loss_on, grads_on, rng_on = run_train(model, args, kwargs)
        with torch.no_grad():
            model(*args, **kwargs)  # the user's own tensors go in as they are
    assert global_state(model) == before
    assert len(cap) > 0
    assert torch.equal(loss_on, loss_off), f"loss {loss_on.item()} != {loss_off.item()}"
    assert torch.equal(rng_on, rng_off), "the capture consumed random numbers"
    assert_same_tensors(grads_on, grads_off, "gradients")
    for r in cap:
        for f in ("q", "k", "v", "scores", "weights", "output", "allowed"):
            t = getattr(r, f)
            assert t is None or (not t.requires_grad and t.grad_fn is None), f"{r.name}.{f} holds the graph"
    for k, v in kept.items():
        assert torch.equal(kwargs[k], v), f"input {k!r} was changed"
    assert all(torch.equal(a, b) for a, b in zip(args, kept_args)), "an input tensor was changed"
    assert versions == [t._version for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)], (
        "in-place op on an input"
    )
    model.zero_grad(set_to_none=True)
    for name, p in params.items():  # the backward above did not step: parameters and buffers as they were
        assert torch.equal(model.state_dict()[name], p), name


@pytest.mark.parametrize(
    "case", ["own", "mha-bf-weights", "encoder-tf", "sdpa", "hand-auto", "hf-llama-sdpa", "hf-bert-eager"]
)
def test_backward_inside_the_capture(case):
    model, args, kwargs, options = make(case)
    loss_off, grads_off, _ = run_train(model, args, kwargs)
    with attnprobe.capture(model, **options) as cap:
        torch.manual_seed(7)
        model.zero_grad(set_to_none=True)
        loss = loss_of(model(*args, **kwargs))
        loss.backward()  # while every hook is still attached
        n = len(cap)
        loss.detach_()
    assert n > 0 and len(cap) == n  # the backward recorded nothing more
    assert torch.equal(loss, loss_off)
    grads_off.pop("<input>", None)
    assert_same_tensors({k: p.grad for k, p in model.named_parameters() if p.grad is not None}, grads_off, "gradients")


@pytest.mark.parametrize(
    "case", ["own", "mha-tf-noweights", "encoder-bf", "sdpa", "hand-named", "hand-auto", "hf-gpt2-eager", "hf-t5-sdpa"]
)
def test_records_do_not_keep_the_model_activations_alive(case):
    """After exit the records are copies: every module's output (and with it the graph) is freed with the
    model's output, and the Capture does not keep the model alive."""
    model, args, kwargs, options = make(case)
    activations = []

    held = []  # strong references while the forward runs: no output's memory is reused by a record meanwhile

    def keep_ref(_m, _a, out):
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                activations.append(weakref.ref(t))
                held.append(t)

    handles = [m.register_forward_hook(keep_ref) for m in model.modules()]
    with attnprobe.capture(model, **options) as cap:
        out = model(*args, **kwargs)
        loss = loss_of(out)
    for h in handles:
        h.remove()
    storages = {t.untyped_storage().data_ptr() for t in held}
    held.clear()
    assert len(cap) > 0 and len(activations) >= 2
    del out, loss
    gc.collect()
    alive = sum(r() is not None for r in activations)
    assert alive == 0, f"{alive} of {len(activations)} module outputs are still alive after the capture"
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None, "the Capture keeps the model alive"
    assert all(r.weights is None or r.weights._base is None for r in cap)
    for r in cap:  # allocated while the module outputs were alive: a copy has an address of its own
        for f in ("q", "k", "v", "scores", "weights", "output"):
            t = getattr(r, f)
            assert t is None or t.untyped_storage().data_ptr() not in storages, f"{r.name}.{f} shares a module output"


# ------------------------------------------------------------------------------------------ 3: state on exceptions
#: a module inside (or right after) the attention of each case, where a failure is injected mid-forward
INSIDE = {
    "own": "a",
    "mha-bf-weights": "mha",
    "mha-tf-noweights": "mha",
    "encoder-bf": "enc.layers.0.self_attn",
    "encoder-tf": "enc.layers.0.self_attn",
    "sdpa": "o",
    "hand-named": "heads.1",
    "hand-auto": "c_proj",
}


def _inside(case: str, model) -> nn.Module:
    if case.startswith("hf-"):
        return dict(model.named_modules())[attnprobe.attention_modules(model)[0].name]
    return dict(model.named_modules())[INSIDE[case]]


def _plain_eval(model, args, kwargs, *, slow_path=False):
    """Eval-mode loss; ``slow_path``: on torch's non-fused MHA path, the kernels a capture keeps
    (the fused fast path computes the same math with other kernels)."""
    from attnprobe.hooks.torch_mha import fastpath_disabled

    with torch.no_grad(), fastpath_disabled() if slow_path else contextlib.nullcontext():
        return loss_of(model.eval()(*args, **kwargs))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("case", ALL)
def test_state_restored_when_the_forward_raises_mid_attention(case, error):
    """A failure inside the attention module, after the capture's own pre-hooks ran (also a BaseException such as
    Ctrl-C, for which torch runs no always-called hook): everything is restored, the next capture works."""
    model, args, kwargs, options = make(case)
    reference = _plain_eval(model, args, kwargs, slow_path=True)
    model.train()
    before = global_state(model)

    def fail(*_):
        raise error("injected")

    with warnings.catch_warnings():
        warnings.simplefilter("error", attnprobe.AttnprobeWarning)  # a failed forward is not "found nothing"
        with pytest.raises(error, match="injected"):
            # the hook, registered after the capture's pre-hooks, runs after them; removed before the capture exits
            with attnprobe.capture(model, **options), _inside(case, model).register_forward_pre_hook(fail):
                model(*args, **kwargs)
    assert global_state(model) == before
    with attnprobe.capture(model, **options) as cap:
        again = _plain_eval(model, args, kwargs)
    assert len(cap) > 0 and torch.equal(again, reference)


@pytest.mark.parametrize("case", ALL)
def test_state_restored_when_the_budget_runs_out_mid_forward(case):
    model, args, kwargs, options = make(case)
    model.eval()
    with torch.no_grad(), attnprobe.capture(model, **options) as cap:
        model(*args, **kwargs)
    budget = cap[0].nbytes + 1 if len(cap) > 1 else 1  # the second record (or the only one) does not fit
    model.train()
    before = global_state(model)
    with pytest.raises(CaptureBudgetError):
        with attnprobe.capture(model, max_bytes=budget, **options):
            loss_of(model(*args, **kwargs)).backward()
    assert global_state(model) == before


@pytest.mark.parametrize(
    "case", ["own", "encoder-bf", "mha-bf-weights", "sdpa", "hand-auto", "hf-llama-sdpa", "hf-t5-eager"]
)
def test_nested_captures_and_generators_leave_state_as_found(case):
    """Nested captures, and captures closed out of order (generators suspended inside their `with`)."""
    model, args, kwargs, options = make(case)
    other, o_args, o_kwargs, o_options = make(case, seed=1)
    model.eval(), other.eval()
    expected = _plain_eval(model, args, kwargs, slow_path=True)
    expected_other = _plain_eval(other, o_args, o_kwargs, slow_path=True)
    before, before_other = global_state(model), global_state(other)

    with attnprobe.capture(model, **options) as outer, attnprobe.capture(model, **options) as inner:
        assert torch.equal(_plain_eval(model, args, kwargs), expected)
    assert len(outer) == len(inner) > 0
    assert global_state(model) == before

    def session(m, opts):
        with attnprobe.capture(m, **opts) as cap:
            yield cap

    first, second = session(model, options), session(other, o_options)
    cap_first, cap_second = next(first), next(second)
    first.close()  # the first capture closes while the second is still open
    assert torch.equal(_plain_eval(other, o_args, o_kwargs), expected_other)
    second.close()
    assert torch.equal(_plain_eval(model, args, kwargs, slow_path=True), expected)
    assert len(cap_first) == 0 and len(cap_second) > 0  # the second capture still saw its model
    assert global_state(model) == before and global_state(other) == before_other

    first, second = session(model, options), session(model, options)  # the same model, closed out of order
    cap_first, cap_second = next(first), next(second)
    first.close()
    assert torch.equal(_plain_eval(model, args, kwargs), expected)
    second.close()
    assert len(cap_first) == 0 and len(cap_second) > 0, "the capture still open stopped recording"
    assert global_state(model) == before


@pytest.mark.parametrize("case", ["encoder-bf", "own", "hf-bert-sdpa"])
def test_captures_in_two_threads_leave_state_as_found(case):
    """Two threads, each capturing its own model; the captures open and close interleaved."""
    models = [make(case, seed=s) for s in (0, 1)]
    for m in models:
        m[0].eval()
    expected = [_plain_eval(m, a, k, slow_path=True) for m, a, k, _ in models]
    before = global_state()
    entered, first_closed = threading.Barrier(2), threading.Event()
    results, errors = {}, []

    def work(i):
        model, args, kwargs, options = models[i]
        try:
            with attnprobe.capture(model, **options) as cap:
                entered.wait(timeout=30)
                if i == 1:
                    first_closed.wait(timeout=30)  # closes after thread 0 has closed
                results[i] = (_plain_eval(model, args, kwargs), cap)
            if i == 0:
                first_closed.set()
        except BaseException as exc:
            errors.append(exc)
            first_closed.set()

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i in (0, 1):
        out, cap = results[i]
        assert torch.equal(out, expected[i]) and len(cap) > 0
    assert global_state() == before


# ------------------------------------------------------------------------------------------ 4: other modes
def _eval_out(model, args, kwargs, options=None, *, grad=False):
    """(eval-mode loss, Capture or None), under the modes the caller entered."""
    with contextlib.nullcontext() if grad else torch.no_grad():
        if options is None:
            return loss_of(model(*args, **kwargs)), None
        with attnprobe.capture(model, **options) as cap:
            out = loss_of(model(*args, **kwargs))
        return out, cap


def _check_records(cap, dtype=None):
    assert len(cap) > 0
    for r in cap:
        for f in ("q", "weights"):
            t = getattr(r, f)
            if t is not None:
                assert not t.is_inference() and not t.requires_grad
                assert dtype is None or t.dtype == dtype, (r.name, f, t.dtype)


@pytest.mark.parametrize("case", ALL)
def test_autocast_bf16_outputs_and_gradients_unchanged(case):
    model, args, kwargs, options = make(case)
    before = global_state(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inner = global_state(model)
        loss_off, grads_off, rng_off = run_train(model, args, kwargs)
        _, grads_again, _ = run_train(model, args, kwargs)
        with attnprobe.capture(model, **options) as cap:
            loss_on, grads_on, rng_on = run_train(model, args, kwargs)
        assert global_state(model) == inner
    assert global_state(model) == before
    assert torch.equal(loss_on, loss_off) and torch.equal(rng_on, rng_off)
    # T5's tied embedding gets a bf16 gradient that differs from run to run without any capture (the CPU
    # embedding backward accumulates in parallel): compare the gradients that are reproducible at all
    noisy = {k for k in grads_off if not torch.equal(grads_off[k], grads_again[k])}
    assert noisy <= {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}, noisy
    assert_same_tensors(
        {k: v for k, v in grads_on.items() if k not in noisy},
        {k: v for k, v in grads_off.items() if k not in noisy},
        "gradients under autocast",
    )
    _check_records(cap)


@pytest.mark.parametrize("case", ALL)
def test_inference_mode_outputs_unchanged(case):
    from attnprobe.hooks.torch_mha import fastpath_disabled

    model, args, kwargs, options = make(case)
    model.eval()
    with torch.inference_mode():
        with fastpath_disabled():  # the kernels a capture keeps (see _plain_eval)
            plain, _ = _eval_out(model, args, kwargs)
        captured, cap = _eval_out(model, args, kwargs, options)
        assert torch.is_inference_mode_enabled()
    assert torch.equal(plain, captured)
    _check_records(cap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", ALL)
def test_bf16_and_float64_models_unchanged(case, dtype):
    model, args, kwargs, options = make(case)
    model.to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    if case == "hand-auto" and dtype == torch.bfloat16:
        args = args[:1]  # FusedSplit's float32 padding mask promotes its bf16 scores: it cannot run padded in bf16
    loss_off, grads_off, _ = run_train(model, args, kwargs)
    with attnprobe.capture(model, **options) as cap:
        loss_on, grads_on, _ = run_train(model, args, kwargs)
    assert torch.equal(loss_on, loss_off)
    assert_same_tensors(grads_on, grads_off, f"gradients in {dtype}")
    assert len(cap) > 0 and all(r.weights is None or r.weights.dtype in (dtype, torch.float32) for r in cap)


def test_inference_mode_records_are_copies_of_what_the_caller_got():
    """Inference tensors keep no view information: a record must still not share memory with the per-head weights
    the module returned to the caller (which the caller may change in place)."""
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    x = _x()
    with torch.inference_mode():
        with attnprobe.capture(mha) as cap:
            _, w = mha(x, x, x, average_attn_weights=False)
        kept = w.clone()
        w.zero_()  # the caller's tensor, changed after the capture
    rec = cap[0]
    assert not rec.weights.is_inference()
    assert torch.equal(rec.weights, kept) and rec.weights.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


@pytest.mark.parametrize("case", ["own", "sdpa", "hand-auto", "mha-bf-weights"])
def test_compiled_models_keep_their_outputs_and_say_when_nothing_was_recorded(case):
    """torch.compile (the eager backend, to stay fast): outputs unchanged, and either records or a warning that
    names torch.compile, never an empty capture blamed on something else."""
    model, args, kwargs, options = make(case)
    model.eval()
    expected = _plain_eval(model, args, kwargs, slow_path=True)
    compiled = torch.compile(model, backend="eager")
    try:
        _plain_eval(compiled, args, kwargs)  # compiled before the capture, as a user's model would be
        before = global_state(compiled)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", attnprobe.AttnprobeWarning)
            with torch.no_grad(), attnprobe.capture(compiled, **options) as cap:
                out = loss_of(compiled(*args, **kwargs))
        assert torch.equal(out, expected)
        assert global_state(compiled) == before
        ours = [str(w.message) for w in seen if issubclass(w.category, attnprobe.AttnprobeWarning)]
        if len(cap) == 0:
            assert ours and all("torch.compile" in m and "_orig_mod" in m for m in ours[-1:]), ours
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize(
    "make_module",
    [
        lambda: nn.MultiheadAttention(D, H, batch_first=True),
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(D, H, 32, batch_first=True), 1, enable_nested_tensor=False
        ),
    ],
    ids=["mha", "encoder"],
)
def test_torchscript_modules_are_refused_by_name(make_module):
    scripted = torch.jit.script(make_module().eval())
    before = global_state(scripted)
    with pytest.raises(attnprobe.UnsupportedModelError, match=r"TorchScript.*before scripting"):
        with attnprobe.capture(scripted):
            pass
    holder = nn.Sequential(attnprobe.MultiHeadAttention(D, num_heads=H), scripted)  # one part scripted: warned
    # why PT031 is off here: the capture warns on entering; the calls inside make the records checked below
    with pytest.warns(attnprobe.AttnprobeWarning, match=r"'1'.*TorchScript"), attnprobe.capture(holder) as cap:  # noqa: PT031
        y = holder[0](_x())
        scripted(y, y, y) if isinstance(make_module(), nn.MultiheadAttention) else scripted(y)
    assert len(cap) == 1 and global_state(scripted) == before


# ----------------------------------------------------------------------------------- 4, 5: the user's hooks and objects
def _scale_first(factor):
    def pre(_m, args):
        return (args[0] * factor, *args[1:])

    return pre


def _shift_output(_m, _args, out):
    return (out[0] + 1.0, *out[1:]) if isinstance(out, tuple) else out + 1.0


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_user_hooks_that_change_inputs_and_outputs_are_kept_and_seen(case):
    """The user's pre-hook halves the model's input, their forward hook shifts its output: with capture on the
    caller gets the same, and the records are those of the model run on the halved input."""
    model, args, kwargs, options = make(case)
    model.eval()
    handles = [model.register_forward_pre_hook(_scale_first(0.5)), model.register_forward_hook(_shift_output)]
    try:
        expected = _plain_eval(model, args, kwargs, slow_path=True)
        with torch.no_grad(), attnprobe.capture(model, **options) as hooked:
            out = loss_of(model(*args, **kwargs))
        assert torch.equal(out, expected)
        assert list(model._forward_pre_hooks) == [handles[0].id]  # the capture's hooks are gone, the user's stay
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad(), attnprobe.capture(model, **options) as direct:
        model(args[0] * 0.5, *args[1:], **kwargs)
    assert len(hooked) == len(direct) > 0
    for a, b in zip(hooked, direct):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("q", "weights") if getattr(a, f) is not None)


def test_mha_user_hooks_see_what_the_caller_asked_for():
    """README: attnprobe's post-hook runs first, so the user's hooks on nn.MultiheadAttention see (and may change)
    the head-averaged weights the caller asked for, also when the capture needed per-head weights."""
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    x = _x()
    seen = []

    def user_hook(_m, _args, out):
        seen.append(out[1].shape)
        return out[0] * 2.0, out[1] + 1.0

    handle = mha.register_forward_hook(user_hook)
    try:
        with torch.no_grad():
            plain = mha(x, x, x)
            with attnprobe.capture(mha) as cap:
                captured = mha(x, x, x)
    finally:
        handle.remove()
    assert seen == [torch.Size([2, 6, 6])] * 2
    assert torch.equal(plain[0], captured[0]) and torch.equal(plain[1], captured[1])
    assert cap[0].weights.shape == (2, H, 6, 6)  # the module's own per-head weights, before the user's change
    assert torch.allclose(cap[0].weights.mean(1), plain[1] - 1.0, atol=1e-6)


def test_own_module_hook_point_changes_are_recorded_as_they_ran():
    """A user's hook on a hook point (head ablation) changes the module's output; the record holds what ran."""
    attn = attnprobe.MultiHeadAttention(D, num_heads=H).eval()
    x = _x()

    def ablate(_m, _args, w):
        w = w.clone()
        w[:, 0] = 0.0
        return w

    handle = attn.hook_weights.register_forward_hook(ablate)
    try:
        with torch.no_grad():
            plain = attn(x)
            with attnprobe.capture(attn) as cap:
                captured = attn(x)
    finally:
        handle.remove()
    assert torch.equal(plain, captured)
    assert bool((cap[0].weights[:, 0] == 0).all()) and bool((cap[0].weights[:, 1:] > 0).any())
    assert torch.allclose(cap[0].output, cap[0].weights @ cap[0].v, atol=1e-6)


@pytest.mark.parametrize("case", ["hf-bert-sdpa", "hf-t5-eager", "hf-llama-eager", "hf-gpt2-sdpa"])
def test_hf_inputs_dict_and_model_unchanged(case):
    model, _, batch, options = make(case)
    model.eval()
    batch_before = {k: v.clone() for k, v in batch.items()}
    ids_before = {k: id(v) for k, v in batch.items()}
    params = snapshot(model)
    config_before = model.config.to_dict()
    with torch.no_grad(), attnprobe.capture(model, **options) as cap:
        model(**batch)
    assert len(cap) > 0
    assert {k: id(v) for k, v in batch.items()} == ids_before
    assert_same_tensors(batch, batch_before, "inputs")
    assert_same_tensors(snapshot(model), params, "parameters and buffers")
    assert model.config.to_dict() == config_before


@pytest.mark.parametrize("case", ["own", "encoder-tf", "sdpa", "hand-named", "hf-llama-sdpa", "hf-bert-eager"])
def test_deterministic_algorithms_and_gradient_checkpointing(case):
    """With torch.use_deterministic_algorithms(True) the capture runs no op that refuses it; under gradient
    checkpointing (attention re-run in backward) the loss and gradients are unchanged, and the calls the backward
    re-runs are not recorded a second time (the records are those of the same capture without checkpointing)."""
    from torch.utils.checkpoint import checkpoint

    model, args, kwargs, options = make(case)
    torch.use_deterministic_algorithms(True)
    try:
        loss_off, grads_off, _ = run_train(model, args, kwargs)
        with attnprobe.capture(model, **options) as plain:
            loss_on, grads_on, _ = run_train(model, args, kwargs)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(plain) > 0 and torch.equal(loss_on, loss_off)
    assert_same_tensors(grads_on, grads_off, "gradients (deterministic)")

    if case.startswith("hf-"):
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        wrapped = model
    else:
        inner = model

        class Checkpointed(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *a, **k):
                return checkpoint(self.inner, *a, use_reentrant=False, **k)

        wrapped = Checkpointed().train()
        if isinstance(options.get("modules"), list):
            options = {**options, "modules": [f"inner.{n}" for n in options["modules"]]}
    loss_off, grads_off, _ = run_train(wrapped, args, kwargs)
    with attnprobe.capture(wrapped, **options) as cap:
        loss_on, grads_on, _ = run_train(wrapped, args, kwargs)
    assert torch.equal(loss_on, loss_off)
    assert_same_tensors(grads_on, grads_off, "gradients (checkpointing)")
    assert [(r.layer, r.call, r.kind) for r in cap] == [(r.layer, r.call, r.kind) for r in plain]


def test_sampling_generate_unchanged():
    """generate(do_sample=True) draws from the RNG at every step: the capture must not move the stream."""
    model, _, batch, _ = make("hf-gpt2-sdpa")
    model.eval()
    batch = {k: v[1:] for k, v in batch.items()}  # one unpadded row
    kwargs = dict(max_new_tokens=4, do_sample=True, top_k=0, pad_token_id=0)
    torch.manual_seed(5)
    plain = model.generate(**batch, **kwargs)
    rng = torch.get_rng_state()
    torch.manual_seed(5)
    with attnprobe.capture(model) as cap:
        captured = model.generate(**batch, **kwargs)
    assert torch.equal(plain, captured) and torch.equal(torch.get_rng_state(), rng)
    assert len(cap) == 2 * 4  # two layers, four steps


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_mha_nested_tensor_call_interrupted_restores_torch_function_and_fast_path(error):
    """A call on nested tensors runs on torch's fast path with torch functions disabled for its length; a failure
    inside it (Ctrl-C included) must not leave either switched."""
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    nested = torch.nested.nested_tensor([torch.randn(3, D), torch.randn(5, D)])
    before = global_state(mha)

    def fail(*_):
        raise error("injected")

    with (
        torch.no_grad(),
        pytest.raises(error, match="injected"),
        pytest.warns(attnprobe.AttnprobeWarning, match="nested"),
    ):
        with attnprobe.capture(mha), mha.register_forward_pre_hook(fail):  # the hook goes before the capture exits
            mha(nested, nested, nested, need_weights=False)
    assert global_state(mha) == before
