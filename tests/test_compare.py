"""attnprobe.compare: two implementations of one model, head by head; the first divergence and its likely cause.

The ports are written by hand (tests/port_models.py: karpathy's nanoGPT, a Llama / Gemma 2) and given Hugging Face's
weights; each planted bug is the kind ports ship (a wrong softmax scale, interleaved vs half-rotated RoPE, another
RoPE base, grouped key/value heads repeated in the wrong order, a dropped Gemma 2 softcap, a causal mask off by
one) and must be reported at the layer and tensor where it is, with the right diagnosis.
"""

from __future__ import annotations

import copy
import logging

import flex_helpers
import pytest
import torch
import torch.nn.functional as F
from port_models import GPT, Bug, Llama, tiny_llama
from torch import nn

import attnprobe
from attnprobe.probe.analyses.alignment import AlignmentError
from attnprobe.probe.analyses.compare import ComparisonError, compare_captures
from attnprobe.probe.analyses.diagnoses import DIAGNOSES

compare = attnprobe.compare

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

IDS = torch.tensor([[5, 17, 3, 88, 41, 9, 60], [12, 7, 7, 30, 99, 2, 45]])  # (batch, T)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=3, n_head=4, vocab_size=100, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    return model, attnprobe.run(model, IDS)[1]


@pytest.fixture(scope="module")
def gemma2():
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        sliding_window=16,
        attn_logit_softcapping=0.5,
        query_pre_attn_scalar=8,
    )
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # scores large enough for the cap to bend them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    return model, attnprobe.run(model, IDS)[1]


# --------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("flash", [True, False], ids=["nanogpt-sdpa", "nanogpt-manual"])
def test_nanogpt_with_gpt2_weights_agrees_with_hf_gpt2_at_every_layer(gpt2, implementation, flash):
    hf = copy.deepcopy(gpt2)
    hf.set_attn_implementation(implementation)
    nano = GPT.from_hf(hf, flash=flash)
    options = {} if flash else {"modules": "auto"}  # the manual branch is softmax attention written by hand
    result = compare(hf, nano, IDS, candidate_options=options)
    frame = result.to_frame()
    assert result.ok and result.first is None and result.diagnosis is None
    assert sorted(frame["layer"].unique()) == [0, 1, 2]
    assert set(frame["tensor"]) == {"q", "k", "v", "scores", "weights", "output"}
    assert (frame["max_abs_diff"] <= 1e-5).all(), frame.sort_values("max_abs_diff").tail()


def test_hand_written_llama_with_hf_weights_agrees(llama):
    model, ref = llama
    port = Llama.from_hf(model)
    with torch.no_grad():
        assert torch.allclose(port(IDS), model.model(IDS).last_hidden_state, atol=1e-5)
    result = compare(ref, attnprobe.run(port, IDS, modules="auto")[1])
    assert result.ok, result.summary()
    frame = result.to_frame()
    # grouped key/value heads on both sides: compared per key/value head
    assert set(frame[frame["tensor"] == "k"]["axis"]) == {"kv_head"} and len(frame[frame["tensor"] == "k"]) == 4


def test_hf_eager_and_sdpa_of_one_model_agree(llama):
    model, _ = llama
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    result = compare(model, eager, IDS)
    assert result.ok, result.summary()
    assert result.to_frame()["max_abs_diff"].max() <= 1e-5


@flex_helpers.FLEX_SKIP
def test_sdpa_and_flex_attention_agree(llama):
    # issue 35 asks eager vs sdpa vs flex; flex attention is captured since issue 32 (flex runs its reference path
    # here, flex_helpers.uncompiled: compiling its kernel costs a minute on a CPU)
    import flex_helpers

    pytest.importorskip("torch.nn.attention.flex_attention")
    model, _ = llama
    flex = copy.deepcopy(model)
    flex.set_attn_implementation("flex_attention")
    with flex_helpers.uncompiled():
        result = compare(model, flex, IDS)
    assert result.ok, result.summary()
    frame = result.to_frame()
    assert len(frame) and frame["max_abs_diff"].max() <= 1e-5


def test_float32_and_bfloat16_differ_within_the_bfloat16_tolerance(llama):
    model, ref = llama
    low = copy.deepcopy(model).to(torch.bfloat16)
    result = compare(ref, attnprobe.run(low, IDS)[1])
    frame = result.to_frame()
    assert result.ok, result.summary()
    assert set(frame["dtype"]) == {"bfloat16"} and frame["max_abs_diff"].max() > 1e-4  # a real, tolerated difference
    strict = compare(ref, attnprobe.run(low, IDS)[1], atol=1e-5, rtol=1e-4)  # float32's tolerance: not the same
    assert not strict.ok and strict.first.layer == 0


# --------------------------------------------------------------------------- the planted port bugs

BUGS = {
    "scale": (Bug(scale=1 / 8), "scores"),  # 1/d_head instead of 1/sqrt(d_head)
    "rope_layout": (Bug(rope="interleaved"), "q"),
    "rope_base": (Bug(rope_base=500_000.0), "q"),
    "kv_repeat": (Bug(kv_repeat="tile"), "k"),
    "mask": (Bug(causal_offset=1), "weights"),
    "positions": (Bug(position_offset=3), "q"),
    "softmax_dtype": (Bug(softmax_dtype=torch.bfloat16), "weights"),
}


@pytest.fixture(scope="module")
def planted(llama):
    """``diagnosis -> Comparison`` of HF Llama and the port with that bug planted in layer 1 (each run once)."""
    model, ref = llama
    return {
        name: compare(ref, attnprobe.run(Llama.from_hf(model, {1: bug}), IDS, modules="auto")[1])
        for name, (bug, _) in BUGS.items()
    }


@pytest.mark.parametrize("diagnosis", sorted(BUGS))
def test_a_planted_llama_port_bug_is_found_at_its_layer_and_tensor_with_its_diagnosis(planted, diagnosis):
    result = planted[diagnosis]
    assert not result.ok
    first = result.first
    assert (first.layer, first.tensor, result.diagnosis) == (1, BUGS[diagnosis][1], diagnosis), result.summary()
    assert first.name == "model.layers.1.self_attn" and first.candidate_name == "layers.1.self_attn"
    assert abs(first.reference - first.candidate) > first.tolerance
    frame = result.to_frame()
    assert not frame[frame["layer"] == 0]["exceeds"].any()  # layer 0 is clean
    assert diagnosis in DIAGNOSES and result.evidence


def test_the_evidence_carries_the_fitted_numbers(planted):
    details = {name: result.details for name, result in planted.items()}
    assert abs(details["scale"]["factor"] - 8**-0.5) < 1e-6
    assert (details["rope_layout"]["reference"], details["rope_layout"]["candidate"]) == ("half", "interleaved")
    assert abs(details["rope_layout"]["base"] / 10_000 - 1) < 0.01
    assert abs(details["rope_base"]["reference_base"] / 10_000 - 1) < 0.01
    assert abs(details["rope_base"]["candidate_base"] / 500_000 - 1) < 0.01
    assert set(details["positions"]["shifts"]) == {3}
    assert (details["mask"]["reference_offset"], details["mask"]["candidate_offset"]) == (0, 1)
    assert details["kv_repeat"]["repeated_by"] == "repeat" and details["softmax_dtype"]["dtype"] == "bfloat16"


@pytest.mark.filterwarnings("ignore:.*the record has no q, k, v, output")
def test_a_missing_gemma2_softcap_is_found_and_nothing_in_the_clean_port(gemma2):
    model, ref = gemma2
    clean = compare(ref, attnprobe.run(Llama.from_hf(model), IDS, modules="auto")[1])
    assert clean.ok, clean.summary()
    result = compare(ref, attnprobe.run(Llama.from_hf(model, {1: Bug(softcap=False)}), IDS, modules="auto")[1])
    assert (result.first.layer, result.first.tensor, result.diagnosis) == (1, "scores", "softcap")
    assert result.details["cap"] == 0.5 and result.details["lacking"] == "candidate"


def test_a_bug_before_the_attention_is_unknown_and_says_the_inputs_differ(llama):
    model, ref = llama
    port = Llama.from_hf(model)
    with torch.no_grad():
        port.layers[0].down_proj.weight.mul_(1.5)  # the MLP of layer 0, not attention
    result = compare(ref, attnprobe.run(port, IDS, modules="auto")[1])
    assert (result.first.layer, result.first.tensor, result.diagnosis) == (1, "q", "unknown")
    assert "first position too" in result.evidence


def test_the_same_attention_in_meta_layout_differs_only_in_q_and_k(llama):
    """HF's Llama conversion permutes q/k weights so that rotate_half equals Meta's interleaved RoPE: a port with
    Meta's weights and interleaved RoPE computes the same scores from q/k in another dim order."""
    model, ref = llama
    port = Llama.from_hf(model, {i: Bug(rope="interleaved") for i in range(2)})
    with torch.no_grad():
        for layer in port.layers:
            for proj, heads in ((layer.self_attn.q_proj, 4), (layer.self_attn.k_proj, 2)):
                w = proj.weight  # HF layout (heads * d_head, hidden) -> Meta's: inverse of HF's permute
                proj.weight.copy_(w.view(heads, 2, 4, 32).transpose(1, 2).reshape(heads * 8, 32))
    cand = attnprobe.run(port, IDS, modules="auto")[1]
    result = compare(ref, cand)
    assert (result.first.tensor, result.diagnosis) == ("q", "rope_layout") and result.details["permuted"]
    assert compare(ref, cand, tensors=("v", "scores", "weights", "output")).ok


# --------------------------------------------------------------------------- layouts: folded, grouped, permuted


class SdpaAttention(nn.Module):
    """Calls scaled_dot_product_attention directly, on (B, H, T, D) or with heads folded into the batch."""

    def __init__(self, d=16, h=4, fold=False):
        super().__init__()
        self.h, self.fold = h, fold
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)  # (B, h, T, hd) each
        if self.fold:
            q, k, v = (t.reshape(B * self.h, T, C // self.h) for t in (q, k, v))  # (B*h, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.reshape(B, self.h, T, C // self.h).transpose(1, 2).reshape(B, T, C))


def _sdpa_model(fold=False):
    torch.manual_seed(1)
    return nn.Sequential(SdpaAttention(fold=fold), SdpaAttention(fold=fold)).eval()


def _permute_heads(model, perm, d=16, h=4):
    """The same model with its heads stored in another order: the output is unchanged."""
    model = copy.deepcopy(model)
    hd = d // h
    rows = torch.cat([torch.arange(p * hd, (p + 1) * hd) for p in perm])
    with torch.no_grad():
        for attn in model:
            w, b = attn.qkv.weight.view(3, d, d), attn.qkv.bias.view(3, d)
            attn.qkv.weight.copy_(w[:, rows].reshape(3 * d, d))
            attn.qkv.bias.copy_(b[:, rows].reshape(3 * d))
            attn.out.weight.copy_(attn.out.weight[:, rows])
    return model


X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))


def test_heads_folded_into_the_batch_line_up_with_unfolded_ones():
    ref, cand = _sdpa_model(), _sdpa_model(fold=True)
    cand.load_state_dict(ref.state_dict())
    _, folded = attnprobe.run(cand, X)
    assert folded[0].batch_size == 8 and folded[0].num_heads == 1
    result = compare(ref, cand, X)
    assert result.ok, result.summary()
    assert sorted(result.to_frame()["head"].unique()) == [0, 1, 2, 3]


def test_heads_in_another_order_are_a_permutation():
    ref = _sdpa_model()
    cand = _permute_heads(ref, [2, 0, 3, 1])
    with torch.no_grad():
        assert torch.allclose(ref(X), cand(X), atol=1e-6)
    result = compare(ref, cand, X)
    assert (result.first.layer, result.first.tensor, result.diagnosis) == (0, "q", "head_order")
    assert result.details["permutation"] == [1, 3, 0, 2]  # the candidate's head holding reference head 0, 1, ...
    folded = _sdpa_model(fold=True)
    result = compare(folded, _permute_heads(folded, [2, 0, 3, 1]), X)  # both fold: unfolded by the input's batch
    assert result.diagnosis == "head_order" and result.details["permutation"] == [1, 3, 0, 2]
    matched = compare(ref, cand, X, allow_permuted_heads=True)
    assert matched.ok and dict(matched.permutations) == {0: (1, 3, 0, 2), 1: (1, 3, 0, 2)}
    frame = matched.to_frame()
    assert (frame[frame["head"] == 0]["candidate_head"] == 1).all()


def test_grouped_and_expanded_key_value_heads_line_up(llama):
    model, ref = llama
    _, cand = attnprobe.run(Llama.from_hf(model), IDS, modules="auto")
    rec = cand[0]  # its key/value heads repeated up to the query heads, as an implementation may record them
    repeated = type(rec)(
        **{
            **_fields(rec),
            "k": rec.k.repeat_interleave(2, 1),
            "v": rec.v.repeat_interleave(2, 1),
            "num_kv_heads": 4,
            "kv_heads": (0, 1, 2, 3),
        }
    )
    result = compare_captures([ref[0]], [repeated])
    assert result.ok, result.summary()
    assert set(result.to_frame().query("tensor == 'k'")["axis"]) == {"head"}


def _fields(rec):
    from dataclasses import fields

    return {f.name: getattr(rec, f.name) for f in fields(rec)}


# --------------------------------------------------------------------------- statistics captures


def test_statistics_captures_compare_per_row_statistics(llama):
    model, _ = llama
    _, ref = attnprobe.run(model, IDS, keep=("stats",))
    clean = compare(ref, attnprobe.run(Llama.from_hf(model), IDS, keep=("stats",), modules="auto")[1])
    assert clean.ok, clean.summary()
    assert {"entropy", "max_score", "allowed_keys", "max_weight"} <= set(clean.to_frame()["tensor"])
    masked = Llama.from_hf(model, {1: Bug(causal_offset=1)})
    result = compare(model, masked, IDS, keep=("stats",), candidate_options={"modules": "auto"})
    assert (result.first.layer, result.first.tensor, result.diagnosis) == (1, "allowed_keys", "mask")
    scaled = Llama.from_hf(model, {1: Bug(scale=1 / 8)})
    result = compare(model, scaled, IDS, keep=("stats",), candidate_options={"modules": "auto"})
    assert (result.first.layer, result.first.tensor, result.diagnosis) == (1, "max_score", "scale")


# --------------------------------------------------------------------------- alignment and errors


def test_calls_line_up_in_forward_order_or_by_a_mapping():
    ref, cand = _sdpa_model(), _sdpa_model()
    _, a = attnprobe.run(ref, X)
    _, b = attnprobe.run(cand, X, layers=[1])
    with pytest.raises(AlignmentError, match="the reference made 2 attention calls and the candidate 1") as err:
        compare(a, b)
    assert (err.value.reference, err.value.candidate) == (2, 1)
    result = compare(a, b, mapping={1: 1})
    assert result.ok and set(result.to_frame()["layer"]) == {1}
    assert compare(a, b, mapping={"1": "1"}).ok  # module names
    with pytest.raises(AlignmentError, match="mapping names 5, which is no attention call of the reference"):
        compare(a, b, mapping={5: 1})


def test_bad_arguments_are_one_line_errors():
    model = _sdpa_model()
    with pytest.raises(ComparisonError, match="got a model without inputs"):
        compare(model, model)
    with pytest.raises(ComparisonError, match="the reference must be a model"):
        compare(attnprobe.run(model, X)[1], model, X)
    with pytest.raises(ComparisonError, match="tensors= names \\['attention'\\]"):
        compare(model, model, X, tensors=["attention"])
    with pytest.raises(AlignmentError, match="cannot be the same attention call"):
        compare(attnprobe.run(model, X)[1], attnprobe.run(model, X[:, :5])[1])


def test_captures_that_share_nothing_are_refused():
    model = _sdpa_model()
    _, full = attnprobe.run(model, X, keep=["q"])
    _, stats = attnprobe.run(model, X, keep=("stats",))
    with pytest.raises(ComparisonError, match="share no tensor to compare"):
        compare(full, stats)


def test_keys_no_real_row_attends_do_not_count():
    """Two implementations that differ only in what they make of padded tokens (a fully masked row: eager's uniform
    row, sdpa's zeros, or what a kernel leaves there) feed different hidden states to the next layer at the padded
    positions, so its keys and values differ there. No real row attends those keys: k and v count only at keys a real
    row of either side may attend, and the two compare the same; a difference at a key a real row attends still
    diverges."""
    from hf_helpers import twin
    from test_hf_sweep import build, make_inputs

    reference = build("llama")
    candidate = twin(reference, "sdpa")
    batch, _ = make_inputs("causal", reference.config)  # row 0 padded by two on the left

    def padded_rows_differ(module, args, output):  # what a kernel makes of row 0's padded tokens
        out = output[0].clone()
        out[0, :2] += 3.0
        return (out, *output[1:])

    hook = candidate.layers[0].self_attn.register_forward_hook(padded_rows_differ)
    try:
        with torch.no_grad():
            real = batch["attention_mask"].bool()
            same = reference(**batch).last_hidden_state[real], candidate(**batch).last_hidden_state[real]
        assert torch.allclose(*same, atol=1e-5)  # the real tokens' outputs agree
        comparison = attnprobe.compare(reference, candidate, batch)
        assert comparison.ok, comparison.summary()
    finally:
        hook.remove()
    hook = candidate.layers[0].self_attn.register_forward_hook(
        lambda module, args, output: (output[0] + 3.0 * (torch.arange(7) == 4).view(1, 7, 1), *output[1:])
    )
    try:
        assert not attnprobe.compare(reference, candidate, batch).ok  # a real token's key: the divergence
    finally:
        hook.remove()
