"""Core figures: frame-building time and capture overhead on attnprobe's own modules.

Run: python benchmarks/bench_core.py
Everything is measured in this one run, repetitions interleaved; ratios are what to compare
(this machine is noisy, absolute times are not).
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from torch import nn

import attnprobe

LAYERS, HEADS, D_MODEL, BATCH, TOKENS = 6, 12, 384, 8, 128


def stack() -> nn.Module:
    return nn.Sequential(
        *[attnprobe.MultiHeadAttention(D_MODEL, num_heads=HEADS, causal=True) for _ in range(LAYERS)]
    ).eval()


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def capture_overhead(reps: int = 15) -> None:
    model, x = stack(), torch.randn(BATCH, TOKENS, D_MODEL)
    variants = {
        "plain forward": lambda: model(x),
        "idle capture (layers=[])": lambda: attnprobe.run(model, x, layers=[]),
        "weights-only capture": lambda: attnprobe.run(model, x, keep="weights"),
        "full capture": lambda: attnprobe.run(model, x),
        "one layer, full": lambda: attnprobe.run(model, x, layers=[3]),
    }
    ratios = {k: [] for k in variants}
    rng = random.Random(0)
    with torch.no_grad():
        for fn in variants.values():
            fn()  # warm up
        for _ in range(reps):
            # every variant once per round, in a shuffled order (a fixed order lets one variant always pay for
            # the memory the previous one freed); a ratio is the median over rounds of that round's ratio
            order = list(variants)
            rng.shuffle(order)
            round_times = {name: timed(variants[name], 1)[0] for name in order}
            for name, t in round_times.items():
                ratios[name].append(t / round_times["plain forward"])
    print(
        f"capture overhead, {LAYERS} x MultiHeadAttention({D_MODEL}, {HEADS} heads), batch {BATCH} x {TOKENS}, "
        f"median of {reps} shuffled rounds:"
    )
    for name, rs in ratios.items():
        print(f"  {name:28s} {statistics.median(rs):5.2f}x plain forward")


def frame_time(reps: int = 5) -> None:
    model, x = stack(), torch.randn(1, TOKENS, D_MODEL)
    _, cap = attnprobe.run(model, x, keep=["scores", "weights"])
    tokens = [f"tok{i}" for i in range(TOKENS)]
    rows = len(cap.to_frame())
    plain = statistics.median(timed(cap.to_frame, reps))
    with_tokens = statistics.median(timed(lambda: cap.to_frame(tokens=tokens), reps))
    summary = statistics.median(timed(cap.summary, reps))
    print(f"frames, {LAYERS} layers x {HEADS} heads x {TOKENS} x {TOKENS} = {rows:,} rows, median of {reps}:")
    print(f"  to_frame()              {plain:.3f} s")
    print(f"  to_frame(tokens=...)    {with_tokens:.3f} s")
    print(f"  summary()               {summary:.3f} s")


if __name__ == "__main__":
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    frame_time()
    capture_overhead()
