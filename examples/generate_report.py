"""A report from ``generate``: every step is recorded, and the report stitches them into one matrix per layer.

A tiny Llama or GPT-2 built from a config (random weights, no download); the report is one self-contained HTML
file (open it in a browser; the token view shows where each token attends).

    python examples/generate_report.py                 # Llama, writes generate.html
    python examples/generate_report.py --model gpt2 --out gpt2.html
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import attnprobe

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", choices=["llama", "gpt2"], default="llama")
parser.add_argument("--out", default="generate.html")
parser.add_argument("--new-tokens", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
if args.model == "llama":
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
        )
    )
else:
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=100))
model = model.eval()
prompt = torch.tensor([[5, 6, 7, 8]])
with torch.no_grad(), attnprobe.capture(model) as steps:
    ids = model.generate(input_ids=prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
stitched = attnprobe.stitch(steps)
print(f"{len(steps)} records (layers x steps); stitched: {len(stitched)} records of {tuple(stitched[0].weights.shape)}")
tokens = [str(t) for t in ids[0, :-1].tolist()]  # the last token was generated, never attended from
path = attnprobe.reports.to_html(steps, args.out, tokens=tokens, overwrite=True)
print("wrote", path)
