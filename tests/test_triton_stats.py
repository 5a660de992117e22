"""The Triton statistics kernel (``probe/engine/triton_stats.py``) under Triton's interpreter on CPU: every statistic
the eager engine gives, on the oracle's cases and on random shapes, masks (causal, padding, sliding window, documents,
a dense bias), dtypes, block sizes and both ways of summing per key; a float64 reference; the calls it hands back to
the eager engine; ``capture(stats_engine=...)``.

The interpreter runs each program in numpy (about a second per call here): shapes stay tiny. ``TRITON_INTERPRET=1`` is
set for the session unless it is set already (Triton reads it when a kernel is defined). Skipped without triton
(``pip install "attnprobe[triton]"``).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import replace

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined (@triton.jit): before attnprobe's kernel module is imported
os.environ.setdefault("TRITON_INTERPRET", "1")
from attnprobe.probe.engine.triton_release import TRITON_MIN

pytest.importorskip(
    "triton",
    minversion=TRITON_MIN,
    reason=f"the Triton kernel's tests need triton>={TRITON_MIN} (pip install 'attnprobe[triton]'); older releases' "
    "interpreter stops on the kernel",
)
pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")

from test_stats_lse import assert_close_to, exact_lse
from test_stats_oracle import _case

import attnprobe
from attnprobe.probe.engine.attention_math import AttentionCall
from attnprobe.probe.engine.stats import attention_stats, stats_from_weights


def _kernel(call, diag, padding, **kw):
    from attnprobe.probe.engine.triton_stats import triton_attention_stats

    return triton_attention_stats(call, diag_offset=diag, query_padding=padding, **kw)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's notes on -inf arithmetic inside the interpreter
@pytest.mark.parametrize("mask", ["none", "causal", "decode", "shifted", "padding", "broadcast", "cross"])
def test_the_kernel_gives_the_eager_engines_statistics(mask):
    call, diag, padding = _case(mask, "plain", torch.float32, heads=(0, 3))
    got = _kernel(call, diag, padding)
    assert got is not None
    assert_close_to(got, attention_stats(call, diag_offset=diag, query_padding=padding), atol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_the_kernel_reads_each_kv_head_for_its_group(deterministic):
    """A call whose 4 heads read 2 kv heads in groups (``kv_group`` 2: k and v as the model holds them, no copy per
    head): the statistics of the same call with k and v repeated per head, with per-key sums by atomics and in a
    fixed order (the second kernel reads the keys too)."""
    call, diag, padding = _case("padding", "plain", torch.float32, grouped=True)
    assert call.kv_group == 2 and call.k.shape[1] == 2
    got = _kernel(call, diag, padding, deterministic=deterministic)
    assert got is not None
    assert_close_to(got, attention_stats(call.ungrouped(), diag_offset=diag, query_padding=padding), atol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("way", ["kernel-lse", "deterministic", "sampled-rows", "bias-softcap"])
def test_the_kernels_other_ways_give_the_same_statistics(way):
    """The model kernel's lse (one sweep), per-key sums without atomics, a sample of rows, a position bias with
    softcapping."""
    extras = "bias-softcap-sinks" if way == "bias-softcap" else "plain"
    call, diag, padding = _case("padding" if way == "bias-softcap" else "causal", extras, torch.float32, heads=(1, 2))
    call = replace(call, sinks=None)
    kw: dict = {}
    if way == "kernel-lse":
        call = replace(call, lse=exact_lse(call))
    elif way == "deterministic":
        kw["deterministic"] = True
    elif way == "sampled-rows":
        kw["rows"] = torch.tensor([0, 3, 7, 12])
    got = _kernel(call, diag, padding, **kw)
    want = attention_stats(call, diag_offset=diag, query_padding=padding, rows=kw.get("rows"))
    assert got is not None
    assert_close_to(got, want, atol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_row_statistics_alone_and_a_nan_in_the_observed_output():
    """``key_sums=False`` (what benchmarks/gpu.py times as per-row statistics): the row statistics as with the sums,
    ``key_weight`` NaN; a NaN in the observed output makes its row not finite, as in the eager engine."""
    call, diag, padding = _case("causal", "plain", torch.float32, heads=(0, 2))  # a NaN at output[1, 0, 2]
    want = attention_stats(call, diag_offset=diag, query_padding=padding)
    assert not bool(want["finite"][1, 0, 2])
    assert_close_to(_kernel(call, diag, padding), want, atol=1e-5)
    rows_only = _kernel(call, diag, padding, key_sums=False)
    assert rows_only is not None and bool(rows_only["key_weight"].isnan().all())
    assert_close_to({**rows_only, "key_weight": want["key_weight"]}, want, atol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_kernel_against_a_float64_reference():
    """The statistics of the exact weights, computed in float64 from a full softmax: within float32 rounding."""
    call, diag, padding = _case("padding", "plain", torch.float32, heads=(0, 3))
    _, _, Tq, Tk = call.shape
    s = call.logits(0, Tq, 0, Tk).double()  # (batch, head, query, key)
    allowed = call.allowed(0, Tq, 0, Tk)  # (batch, 1, query, key)
    assert allowed is not None
    weights = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    assert call.v is not None and call.output is not None
    want = stats_from_weights(
        weights,
        scores=s,
        allowed=allowed,
        v=call.v.double(),
        output=call.output.double(),
        diag_offset=diag,
        query_padding=padding,
    )
    got = _kernel(call, diag, padding, deterministic=True)
    assert got is not None
    assert_close_to(got, want, atol=2e-6)


def _random_call(rng: random.Random, dtype: torch.dtype):
    """A random call: 1-2 batch rows, 1-2 heads, 1-24 queries and keys, head size 8-32, and one of the masks the
    engine reads (none, causal, key padding, a sliding window, documents, a dense float mask carrying a bias)."""
    B, H, D = rng.randint(1, 2), rng.randint(1, 2), rng.choice((8, 16, 32))
    Tk = rng.randint(1, 24)
    Tq = Tk if rng.random() < 0.7 else rng.randint(1, Tk)  # self-attention, or the last rows of a cache
    g = torch.Generator().manual_seed(rng.randint(0, 10**6))
    q, k, v = (torch.randn(B, H, T, D, generator=g) * 2 for T in (Tq, Tk, Tk))
    offset = Tk - Tq
    rows, keys = torch.arange(Tq)[:, None] + offset, torch.arange(Tk)[None, :]
    kind = rng.choice(("none", "causal", "padding", "window", "documents", "bias"))
    kw: dict = {"causal": kind == "causal", "causal_offset": offset}
    if kind == "padding":
        keep = torch.ones(B, Tk, dtype=torch.bool)
        keep[0, : rng.randint(0, Tk - 1)] = False  # left padding of the first batch row
        kw["mask"] = keep[:, None, None, :] & (keys <= rows)
    elif kind == "window":
        kw["mask"] = ((keys <= rows) & (keys > rows - rng.randint(1, 8)))[None, None]
    elif kind == "documents":
        doc = torch.tensor(sorted(rng.randint(0, 3) for _ in range(Tk)))
        kw["mask"] = ((doc[None, :] == doc[-Tq:, None]) & (keys <= rows))[None, None]
    elif kind == "bias":
        bias = torch.randn(B, 1, Tq, Tk, generator=g)
        kw["mask"] = bias.masked_fill(keys > rows, torch.finfo(torch.float32).min)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    call = AttentionCall(q, k, scaling=D**-0.5, v=v, output=out, **kw)
    return call, (offset if rng.random() < 0.8 else None), kind


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("seed", range(6))
def test_random_calls_give_the_eager_engines_statistics(seed):
    """Property-style: random shapes, masks, dtypes, block sizes and per-key summing, against the eager engine."""
    rng = random.Random(seed)
    dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
    call, diag, kind = _random_call(rng, dtype)
    block = rng.choice(((16, 16), (16, 32), (32, 16)))
    got = _kernel(call, diag, None, block=block, deterministic=rng.random() < 0.5)
    want = attention_stats(call, diag_offset=diag)
    assert got is not None, kind
    assert_close_to(got, want, atol=1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_calls_the_eager_engine_describes_are_handed_back():
    """NaN logits, additive-mask rows that attend no key (uniform over every key), sinks, float64: None."""
    for mask, extras, dtype in (
        ("nan", "plain", torch.float32),
        ("additive", "plain", torch.float32),
        ("causal", "bias-softcap-sinks", torch.float32),
        ("causal", "plain", torch.float64),
    ):
        call, diag, padding = _case(mask, extras, dtype, heads=(0, 3))
        assert _kernel(call, diag, padding) is None, (mask, extras, dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_capture_with_the_triton_engine(hf_llama):
    """``capture(stats_engine="triton")``: the kernel's statistics (said in the record), the eager engine's within
    float32 rounding, the model's output unchanged; ``"torch"`` never runs the kernel; a wrong name is refused."""
    model, batch = hf_llama
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), stats_engine="torch") as eager:
        want = model(**batch).logits
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), stats_engine="triton", layers=[0]) as kernel:
        got = model(**batch).logits
    assert torch.equal(got, want)
    assert [r.meta.get("stats_engine") for r in kernel] == ["triton"]
    assert all("stats_engine" not in r.meta for r in eager)
    assert_close_to(kernel[0].stats, eager[0].stats, atol=1e-5)
    with pytest.raises(attnprobe.SelectionError, match="stats_engine must be one of"):
        attnprobe.capture(model, stats_engine="cuda")


@pytest.fixture
def hf_llama():
    hf_helpers = pytest.importorskip("hf_helpers")
    return hf_helpers.build("llama", "sdpa"), hf_helpers.inputs("llama", "right")


def test_auto_runs_the_eager_engine_on_cpu(monkeypatch):
    """``"auto"`` picks the kernel for CUDA tensors only: on CPU, even with the interpreter on, the eager engine (with
    its native row pass where that is built)."""
    from attnprobe.probe.engine import engines, native_rows

    call, diag, padding = _case("causal", "plain", torch.float32, heads=(0,))
    _, engine = engines.statistics(call, engine="auto", diag_offset=diag, query_padding=padding)
    assert engine == ("native" if native_rows.available() else "torch")
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_calls_the_kernel_does_not_compute_go_to_the_eager_engine(monkeypatch):
    """A flex ``score_mod``, a mask given as a function of blocks and a key set (``key_set_mass``, a capture's
    ``image_mass``) are the eager engine's: ``unsupported`` names each, the kernel hands them back, and
    ``stats_engine="triton"`` gets the eager engine's statistics, ``key_set_mass`` included."""
    from attnprobe.probe.engine import engines
    from attnprobe.probe.engine.triton_stats import unsupported

    call, diag, padding = _case("causal", "plain", torch.float32, heads=(0, 3))
    assert unsupported(call) is None
    doubled = replace(call, score_mod=lambda s, rows, c, d: s * 2)
    assert "score_mod" in unsupported(doubled)
    everything = replace(call, mask=lambda rows, c, d: torch.ones(1, 1, len(rows), d - c, dtype=torch.bool))
    assert "function of blocks" in unsupported(everything)
    keys = torch.zeros(2, call.k.shape[2], dtype=torch.bool)
    keys[:, 2:6] = True
    assert "key set" in unsupported(call, keys)
    assert _kernel(doubled, diag, padding) is None and _kernel(call, diag, padding, key_set=keys) is None
    monkeypatch.setattr(engines, "_WARNED", set())  # each reason is warned once a process
    with pytest.warns(UserWarning, match="key set"):
        got, engine = engines.statistics(call, engine="triton", diag_offset=diag, query_padding=padding, key_set=keys)
    assert engine == "torch"
    want = attention_stats(call, diag_offset=diag, query_padding=padding, key_set=keys)
    assert "key_set_mass" in got
    assert_close_to(got, want, atol=0)
    with pytest.warns(UserWarning, match="score_mod"):
        got, engine = engines.statistics(doubled, engine="triton", diag_offset=diag, query_padding=padding)
    assert engine == "torch"
    assert_close_to(got, attention_stats(doubled, diag_offset=diag, query_padding=padding), atol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_triton_capture_with_image_grid_keeps_image_mass(monkeypatch):
    from attnprobe.probe.engine import engines

    """``capture(image_grid=, stats_engine="triton")``: every record whose keys include image patches (here all of
    them: the vision tower's keys are all patches, the language model's include them) still has ``image_mass``, from
    the eager engine (no ``meta["stats_engine"]``), equal to a ``stats_engine="torch"`` capture's; the hand-back is
    warned about. (Without image_grid= the kernel computes such records: ``test_a_capture_with_the_triton_engine``.)"""
    image_helpers = pytest.importorskip("image_helpers")
    built, tokens, _ = image_helpers.located("llava")
    monkeypatch.setattr(engines, "_WARNED", set())
    with pytest.warns(UserWarning, match="key set"):
        _, kernel = attnprobe.run(built.model, dict(built.inputs), keep=("stats",), image_grid=tokens,
                                  stats_engine="triton")  # fmt: skip
    _, eager = attnprobe.run(built.model, dict(built.inputs), keep=("stats",), image_grid=tokens, stats_engine="torch")
    with_images = [i for i, r in enumerate(eager) if "image_mass" in r.stats]
    assert with_images and len(kernel) == len(eager)
    for i in with_images:
        assert "image_mass" in kernel[i].stats and kernel[i].meta.get("stats_engine") != "triton"
        torch.testing.assert_close(kernel[i].stats["image_mass"], eager[i].stats["image_mass"], atol=0, rtol=0)
    assert len(with_images) == len(eager)


def test_the_kernels_planes_are_the_engines_row_statistics():
    """The kernel writes one plane per row statistic in an order of its own (``_PLANES``): every statistic of
    ``ROW_STATS`` but the two it knows are 0 (mass on keys the call's own mask forbids), and nothing else but its
    NaN/inf flag. A statistic added to the engine and not to the kernel fails here, not in a user's capture."""
    from attnprobe.probe.engine import stats, triton_stats

    planes = set(triton_stats._PLANES) - {"logits_finite"}
    assert len(planes) == len(triton_stats._PLANES) - 1
    assert planes == set(stats.ROW_STATS) - {"masked_mass", "masked_max"}
    assert set(triton_stats._INTEGERS) | set(triton_stats._FLAGS) <= planes
