"""A compiled training step with and without a capture: tiny Llama (hidden 256, 4 layers, 8 heads), batch 4 x 256.

One step is forward + backward + AdamW of ``torch.compile(model)`` (default inductor backend, or ``--backend``).
Variants, interleaved in one run (each round runs every variant once, in a shuffled order; a ratio is the median
over rounds of that round's ratio, so load from other processes hits both sides alike):

    plain           the compiled model
    weights         the compiled model inside ``attnprobe.capture(model, keep=("weights",))``, a new capture every
                    step (the graph compiled for the first capture is reused by every later one)

The weights of every layer and head are recomputed from q and k after the graph's forward (sdpa never returns
them) and copied to the CPU: that is what the ratio measures. Also printed: graphs compiled over the run (the
plain graph and the captured one, each once) and the bytes one capture keeps.

Run:  python benchmarks/bench_compile.py [--rounds 10] [--backend inductor] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

import attnprobe


def build(device: str):
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1000,
        max_position_embeddings=512,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device).train()
    ids = torch.randint(0, 1000, (4, 256), device=device)
    return model, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = parser.parse_args()

    model, ids = build(opts.device)
    compiled = torch.compile(model, backend=opts.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiles = []
    torch._dynamo.utils.counters.clear()

    def train_step():
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    kept = []

    def captured_step():
        with attnprobe.capture(compiled, keep=("weights",)) as cap:
            train_step()
        kept.append(cap.nbytes)

    variants = {"plain": train_step, "weights": captured_step}

    def timed(fn) -> float:
        if opts.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if opts.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for fn in variants.values():  # compile both graphs, warm the allocator
        fn()
        fn()
    compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    rng = random.Random(0)
    times = {name: [] for name in variants}
    for _ in range(opts.rounds):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            times[name].append(timed(variants[name]))
    compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    ratios = [w / p for w, p in zip(times["weights"], times["plain"])]
    print(
        f"torch {torch.__version__}, backend {opts.backend}, device {opts.device}, {opts.rounds} rounds "
        f"(threads: {torch.get_num_threads()})"
    )
    print(f"plain compiled step      median {statistics.median(times['plain']) * 1e3:8.1f} ms")
    print(f"capture(keep=weights)    median {statistics.median(times['weights']) * 1e3:8.1f} ms")
    print(f"ratio (median of rounds) {statistics.median(ratios):.3f}x   (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(f"graphs compiled during the timed rounds: {compiles[1] - compiles[0]} (after warm-up: {compiles[0]})")
    print(f"bytes kept per capture: {kept[-1]:,}")


if __name__ == "__main__":
    main()
