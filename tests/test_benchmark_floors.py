"""``benchmarks/floors.py``, which four benchmarks print their floors with (bench_long, bench_peers,
bench_hf_capture, bench_native_floor): its copies of a model with a registered attention function run, keep the
model's outputs bit for bit, and compute what they say (a floor that stopped running once broke every benchmark
that prints one, silently, until a benchmark was run)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

FLOORS = Path(__file__).resolve().parents[1] / "benchmarks" / "floors.py"


def _floors():
    spec = importlib.util.spec_from_file_location("bench_floors", FLOORS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bert():
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    return transformers.BertModel._from_config(config, attn_implementation="sdpa").eval()


def test_the_floors_keep_the_outputs_and_give_the_weights_and_the_entropy():
    floors, model = _floors(), _bert()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
        weights_fn, stats_fn = floors.weights_floor(), floors.stats_floor()
        with_weights = floors.with_attention(model, "test_floor_weights", weights_fn)
        with_stats = floors.with_attention(model, "test_floor_stats", stats_fn)
        assert torch.equal(with_weights(input_ids=ids, attention_mask=mask).last_hidden_state, plain)
        kept = floors.run(with_weights, weights_fn, input_ids=ids, attention_mask=mask)
        stats = floors.run(with_stats, stats_fn, input_ids=ids, attention_mask=mask)
    assert len(kept) == len(eager) == len(stats) == 2
    for got, want, (_, _, entropy, _) in zip(kept, eager, stats):
        assert torch.allclose(got, want, atol=1e-6)
        h = -(want * want.clamp_min(1e-30).log()).sum(-1, keepdim=True)  # (batch, head, query, 1), natural log
        assert torch.allclose(entropy, h, atol=1e-4), (entropy - h).abs().max()
    assert not math.isnan(float(stats[0][3].max()))
