"""What ``image_mass`` costs the statistics engine: ``attention_stats`` with and without a key set.

A VLM's long prefill in statistics mode (``capture(model, keep=("stats",), image_grid=...)``) adds one row
statistic, each row's weight on the image patches, summed block by block from the exact weights the engine already
makes (one matrix-vector product per block). Figures (printed, ratios measured in one run, rounds interleaved,
medians):

1. engine time with ``key_set`` / without, for q and k of 8 heads x 64 dims at T = 1024 and 4096 tokens, 576 of
   them image tokens (LLaVA-1.5's picture), one block of keys (the default ``block_bytes``) and keys in blocks
   (``block_bytes`` = 4 MiB): target <= 1.10x;
2. the largest difference between the engine's ``key_set_mass`` and the mass summed from the full softmax
   (float64 reference): target <= 1e-5.

The key set adds a ``(batch, key)`` column and a ``(batch, head, query)`` sum to the engine, nothing that grows as
``(query x key)``: each block's weights are multiplied by the column's slice (``_Engine._set_e``).

Usage: ``python benchmarks/bench_image_mass.py [--lengths 1024 4096] [--rounds 5] [--threads 1]``. Timings are noisy
on a shared machine: compare only the ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnprobe.probe.engine.attention_math import AttentionCall
from attnprobe.probe.engine.stats import attention_stats


def case(T: int, heads: int = 8, d: int = 64, images: int = 576):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, T, d, generator=g)
    k = torch.randn(1, heads, T, d, generator=g)
    keys = torch.zeros(1, T, dtype=torch.bool)
    keys[0, 8 : 8 + min(images, T - 8)] = True  # a picture after a short prefix, as LLaVA's prompt puts it
    return AttentionCall(q, k, scaling=d**-0.5, causal=True), keys


def timed(call, keys, block_bytes, workspace) -> float:
    start = time.perf_counter()
    options = {} if block_bytes is None else {"block_bytes": block_bytes}
    attention_stats(call, diag_offset=0, key_set=keys, workspace=workspace, **options)
    return time.perf_counter() - start


def accuracy(call, keys) -> float:
    got = attention_stats(call, diag_offset=0, key_set=keys)["key_set_mass"].double()  # (batch, head, query)
    s = (call.q.double() @ call.k.double().transpose(-1, -2)) * call.scaling  # (batch, head, query, key)
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    expected = (s.softmax(-1) * keys[:, None, None, :]).sum(-1)  # (batch, head, query)
    return float((got - expected).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds, medians")
    for T in args.lengths:
        call, keys = case(T)
        print(f"T = {T}: largest |engine - full softmax| of the image mass: {accuracy(call, keys):.2e}")
        for block_bytes, label in ((None, "one key block"), (4 << 20, "keys in 4 MiB blocks")):
            workspace: dict = {}
            plain, with_set = [], []
            timed(call, None, block_bytes, workspace)  # warm the buffers
            for _ in range(args.rounds):
                plain.append(timed(call, None, block_bytes, workspace))
                with_set.append(timed(call, keys, block_bytes, workspace))
            a, b = statistics.median(plain), statistics.median(with_set)
            print(f"  {label}: {a * 1e3:8.1f} ms without, {b * 1e3:8.1f} ms with the key set: {b / a:.3f}x")


if __name__ == "__main__":
    main()
