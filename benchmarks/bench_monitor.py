"""The cost of leaving attnprobe.monitor on while a model trains, measured in one run.

    steps    training step (forward + backward + AdamW) of a GPT-2-shaped model (6 layers x 12 heads x 384,
             batch 8 x 256, random init): blocks of `every` steps with the monitor (one sampled step per block)
             against the same number of steps without it, blocks interleaved in shuffled order; the ratio is the
             median over rounds of (monitored block / plain block).      targets: every=10 <= 1.02, every=100 <= 1.005
    sampled  one sampled step on its own / one plain step (what a sampled step costs)
    memory   a tiny model trained for --long steps with every=1: resident memory after 10% and after all steps
             (flat: no growth beyond the history frame), hooks left after close() and after a loop that raises

Run:  python benchmarks/bench_monitor.py [--rounds 5] [--long 10000] [--only steps|memory]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch
from torch import nn

import attnprobe


def gpt2(layers=6, heads=12, width=384, vocab=1000, positions=256):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=positions)
    return GPT2LMHeadModel(config).train()


def step_fn(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def block(step, n):
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return time.perf_counter() - t0


def steps_figures(args):
    torch.manual_seed(0)
    model = gpt2()
    ids = torch.randint(0, 1000, (8, 256))
    step = step_fn(model, ids)
    step()  # warm up
    for every in (10, 100):
        ratios = []
        for _ in range(args.rounds):
            order = ["plain", "monitor"]
            random.shuffle(order)
            times = {}
            for name in order:
                if name == "plain":
                    times[name] = block(step, every)
                else:
                    with attnprobe.monitor(model, every=every):
                        times[name] = block(step, every)
            ratios.append(times["monitor"] / times["plain"])
        target = 1.02 if every == 10 else 1.005
        print(f"every={every:<4} monitored / plain over blocks of {every} steps: median {statistics.median(ratios):.3f}x "
              f"(target <= {target}; rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    sampled, plain = [], []
    for _ in range(args.rounds):
        plain.append(block(step, 1))
        with attnprobe.monitor(model, every=1000):  # its first call is sampled
            sampled.append(block(step, 1))
    print(f"one sampled step / one plain step: {statistics.median(s / p for s, p in zip(sampled, plain)):.2f}x "
          f"(plain step {statistics.median(plain) * 1e3:.0f} ms)")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_figures(args):
    torch.manual_seed(0)
    model = nn.Sequential(attnprobe.MultiHeadAttention(16, num_heads=2, causal=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 8, 16)
    marks = {}
    with attnprobe.monitor(model, every=1) as mon:
        for i in range(1, args.long + 1):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i in (args.long // 10, args.long):
                marks[i] = rss_mb()
    rows = len(mon.history)
    history_mb = mon.history.memory_usage(deep=True).sum() / 2**20
    first, last = marks[args.long // 10], marks[args.long]
    print(f"memory: every=1 for {args.long} steps: RSS {first:.0f} MB after {args.long // 10} steps, {last:.0f} MB after "
          f"{args.long} ({last - first:+.0f} MB; the history holds {rows} rows, {history_mb:.1f} MB as a frame)")
    left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    try:
        with attnprobe.monitor(model, every=1):
            model(x)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    left_raise = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    print(f"hooks left after close(): {left}; after a loop that raised: {left_raise}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--long", type=int, default=10000)
    parser.add_argument("--only", choices=["steps", "memory"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only != "memory":
        steps_figures(args)
    if args.only != "steps":
        memory_figures(args)


if __name__ == "__main__":
    main()
