"""Models dispatched by Hugging Face accelerate: layers on the CPU, offloaded to CPU memory or to disk.

accelerate keeps an offloaded layer's weights on the meta device and loads them in a hook around the layer's
``forward``; attnprobe's hooks must compose with those (in whichever order they were attached), leave the
outputs bitwise unchanged, record the same tensors as for the model in memory, and go away cleanly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnprobe

accelerate = pytest.importorskip("accelerate")
from accelerate import cpu_offload, disk_offload, dispatch_model  # noqa: E402
from accelerate.hooks import remove_hook_from_submodules  # noqa: E402

FIELDS = ("q", "k", "v", "weights", "output")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return LlamaForCausalLM(config).eval()


#: layers 0-1 stay in memory, layers 2-3 are offloaded to disk (weights on meta until accelerate loads them)
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


def state(model: nn.Module) -> dict[str, tuple]:
    """Every module's hooks and its instance ``forward`` (accelerate replaces it): what a capture must restore."""
    attrs = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_backward_hooks",
        "_backward_pre_hooks",
    )
    return {
        name: tuple(tuple(getattr(m, a, {}) or {}) for a in attrs)
        + (m.__dict__.get("forward"), m.__dict__.get("_hf_hook"))
        for name, m in model.named_modules()
    }


def assert_same_records(cap, reference):
    assert [r.name for r in cap] == [r.name for r in reference] and len(cap) > 0
    for rec, ref in zip(cap, reference):
        for field in FIELDS:
            got, want = getattr(rec, field), getattr(ref, field)
            assert (got is None) == (want is None), (rec.name, field)
            if got is not None:
                assert got.device == torch.device("cpu"), (rec.name, field, got.device)
                assert torch.equal(got, want), (rec.name, field)


@pytest.fixture
def saved_llama(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


@pytest.mark.parametrize("grad", [False, True])
def test_device_map_with_layers_on_disk(saved_llama, tmp_path, grad):
    from transformers import AutoModelForCausalLM

    model, folder = saved_llama
    dispatched = AutoModelForCausalLM.from_pretrained(
        folder, device_map=DEVICE_MAP, offload_folder=tmp_path / "offload"
    ).eval()
    assert dispatched.model.layers[3].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    ids = torch.randint(0, 100, (2, 9))
    with torch.set_grad_enabled(grad):
        with attnprobe.capture(model) as reference:
            expected = model(ids).logits
        before = state(dispatched)
        plain = dispatched(ids).logits
        with attnprobe.capture(dispatched) as cap:
            captured = dispatched(ids).logits
        after = dispatched(ids).logits
    assert torch.equal(plain, expected) and torch.equal(captured, plain) and torch.equal(after, plain)
    assert state(dispatched) == before  # attnprobe's hooks gone, accelerate's kept
    assert_same_records(cap, reference)
    assert attnprobe.check(cap, causal=True).ok


def test_statistics_of_a_dispatched_model_equal_those_in_memory(saved_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    model, folder = saved_llama
    dispatched = AutoModelForCausalLM.from_pretrained(
        folder, device_map=DEVICE_MAP, offload_folder=tmp_path / "offload"
    ).eval()
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        with attnprobe.capture(model, keep=("stats",)) as reference:
            expected = model(ids).logits
        before = state(dispatched)
        with attnprobe.capture(dispatched, keep=("stats",)) as cap:
            captured = dispatched(ids).logits
    assert torch.equal(captured, expected) and state(dispatched) == before
    assert [r.name for r in cap] == [r.name for r in reference] and len(cap) == 4
    for rec, ref in zip(cap, reference):
        assert rec.weights is None and set(rec.stats) == set(ref.stats)
        for name, value in ref.stats.items():
            torch.testing.assert_close(
                rec.stats[name], value, rtol=0, atol=0, equal_nan=True, msg=f"{rec.name} {name}"
            )  # bitwise; NaN where a key does not exist
    assert attnprobe.check(cap, causal=True).ok


def test_dispatched_while_a_capture_is_open(saved_llama, tmp_path):
    """accelerate's hooks attached after the capture started, and removed before it ends."""
    model, _ = saved_llama
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
        with attnprobe.capture(model) as reference:
            model(ids)
        plain_state = state(model)
        with attnprobe.capture(model) as cap:
            dispatch_model(model, device_map=DEVICE_MAP, offload_dir=str(tmp_path / "offload"))
            assert model.model.layers[2].self_attn.q_proj.weight.device.type == "meta"
            captured = model(ids).logits
            remove_hook_from_submodules(model)
        assert torch.equal(captured, expected)
        assert_same_records(cap, reference)
        # the capture removed only its own hooks: what is left is what the model had before it
        assert {k: v[:-2] for k, v in state(model).items()} == {k: v[:-2] for k, v in plain_state.items()}


def test_capture_opened_on_an_already_dispatched_model_exits_cleanly_when_forward_raises(saved_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    _, folder = saved_llama
    dispatched = AutoModelForCausalLM.from_pretrained(
        folder, device_map=DEVICE_MAP, offload_folder=tmp_path / "offload"
    ).eval()
    before = state(dispatched)
    with pytest.raises(IndexError), torch.no_grad(), attnprobe.capture(dispatched):
        dispatched(torch.tensor([[5, 500]]))  # 500 is outside the vocabulary: the embedding raises
    assert state(dispatched) == before
    with torch.no_grad():
        assert dispatched(torch.tensor([[5, 6]])).logits.isfinite().all()


class Handwritten(nn.Module):
    """Attention code attnprobe has never seen, read by the tracer (modules='auto')."""

    def __init__(self, dim=32):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        return self.proj(w @ v)


def own_modules():
    return nn.Sequential(attnprobe.MultiHeadAttention(32, 4), attnprobe.MultiHeadAttention(32, 4, causal=True))


def handwritten():
    return nn.Sequential(Handwritten(), Handwritten())


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize(
    "make,options", [(own_modules, {}), (handwritten, {"modules": "auto"})], ids=["own-modules", "handwritten"]
)
def test_offloaded_torch_modules(make, options, offload, tmp_path):
    model = make().eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = model(x)
        with attnprobe.capture(model, **options) as reference:
            model(x)
    if offload == "cpu":
        cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device("cpu"))
    assert all(p.device.type == "meta" for p in model.parameters())
    before = state(model)
    with torch.no_grad():
        with attnprobe.capture(model, **options) as cap:
            captured = model(x)
        after = model(x)
    assert torch.equal(captured, expected) and torch.equal(after, expected)
    assert state(model) == before
    assert_same_records(cap, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: layers split between cuda:0 and the CPU")
def test_layers_split_between_gpu_and_cpu_land_on_the_storage_device(saved_llama):
    from transformers import AutoModelForCausalLM

    _, folder = saved_llama
    device_map = {**DEVICE_MAP, "model.layers.2": 0, "model.layers.3": 0}
    dispatched = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map).eval()
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        plain = dispatched(ids).logits
        with attnprobe.capture(dispatched) as cap:
            captured = dispatched(ids).logits
        with attnprobe.capture(dispatched, device="cuda:0") as on_gpu:
            dispatched(ids)
    assert torch.equal(plain, captured)
    assert {r.weights.device.type for r in cap} == {"cpu"}
    assert {r.weights.device.type for r in on_gpu} == {"cuda"}
