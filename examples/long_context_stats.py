"""Statistics of a long context without storing a (query x key) matrix: ``capture(keep=("stats",))``.

The statistics engine computes per-row statistics (entropy, max weight, first-key mass, ...) blockwise from the
queries and keys the forward made; memory grows with the sequence, not with its square. A tiny Llama built from a
config at a few thousand tokens, on the CPU:

    python examples/long_context_stats.py --tokens 4096
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnprobe

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tokens", type=int, default=4096)
args = parser.parse_args()

torch.manual_seed(0)
config = LlamaConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    max_position_embeddings=args.tokens,
)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 100, (1, args.tokens))

with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as cap:
    model(input_ids=ids)
record = cap[0]
assert record.weights is None and record.scores is None  # nothing of size (query x key) was kept
print(cap)
print("per-row statistics:", ", ".join(sorted(record.stats)))
print(f"entropy of layer 0: shape {tuple(record.stats['entropy'].shape)} (batch, head, query)")
summary = cap.summary()
print(summary[["layer", "head", "entropy", "max_weight", "first_key_mass"]].to_string(index=False))
print("checks on the statistics:", "ok" if attnprobe.check(cap, causal=True).ok else "FAILED")
