"""The cost of leaving attnprobe.monitor on while a model trains, measured in one run.

    steps    training step (forward + backward + AdamW) of a GPT-2-shaped model (6 layers x 12 heads x 384,
             batch 8 x 256, random init, sdpa attention), four kinds of step interleaved in shuffled order each
             round: plain; monitored but not sampled (the monitor attached, between its sampled calls); one sampled
             step with rows=64; one sampled step with rows=None (every query row). Medians over rounds, and per
             round the ratio to that round's plain step.
    every    the monitored training step at every=N, from the same run: per round
             ((N - 1) * between-step + sampled step) / (N * plain step), median over rounds.
             targets: every=10 <= 1.02, every=100 <= 1.005. (A block of 100 steps per round and kind would take
             over ten minutes per round on a shared 2-core machine; the steps of one block are the kinds measured.)
             --blocks K also measures every=10 directly: K rounds of 10 plain steps against 10 monitored steps.
    hook     what the monitor costs a forward call between sampled calls (its counter in a pre-hook and a hook),
             over 20,000 calls of a tiny module (microseconds, far below the noise of a training step)
    compiled the same training step compiled (torch.compile, inductor), the monitor driven by the loop as the Trainer
             callback drives it under TrainingArguments(torch_compile=True) (attnprobe.monitor(model, hook=False),
             begin_call / end_call around each step): plain compiled; between sampled calls; one sampled step
             (rows=64). Both graphs (with and without the capture's hooks) compile before the timed rounds.
    memory   a tiny model trained for --long steps with every=1: resident memory after 10% and after all steps
             (flat: no growth beyond the history frame), hooks left after close() and after a loop that raises

Run:  python benchmarks/bench_monitor.py [--rounds 6] [--blocks 0] [--long 10000] [--only steps|compiled|memory]
      [--threads N]
The load average (uptime) is printed before and after: on a shared machine the noise can exceed the margins.
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


def shuffled_rounds(names: list[str], rounds: int, measure) -> dict[str, list[float]]:
    """``measure(name)`` for each kind of step, in a shuffled order each round: {name: its times, round by round}."""
    kinds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        order = list(names)
        random.shuffle(order)
        for name in order:
            kinds[name].append(measure(name))
    return kinds


def print_kinds(title: str, kinds: dict[str, list[float]]) -> None:
    """Each kind of step: its median time, and its ratio to the plain step of the same round."""
    print(title)
    for name, times in kinds.items():
        ratio = statistics.median(t / p for t, p in zip(times, kinds["plain"]))
        print(
            f"  {name:<10} {statistics.median(times) * 1e3:8.0f} ms   / plain of the round: median {ratio:.3f}x "
            f"(rounds {', '.join(f'{t / p:.3f}' for t, p in zip(times, kinds['plain']))})"
        )


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def steps_figures(args):
    torch.manual_seed(0)
    model = gpt2()
    ids = torch.randint(0, 1000, (8, 256))
    step = step_fn(model, ids)
    step()  # warm up
    step()
    between = attnprobe.monitor(model, every=10**9)  # one sampled step untimed: lazy imports, first capture set-up
    block(step, 1)
    between.close()

    def measure(name: str) -> float:
        if name == "plain":
            return block(step, 1)
        if name == "between":
            with attnprobe.monitor(model, every=10**9) as mon:
                mon.calls = 1  # past its sampled call 0: this step is one between sampled steps
                took = block(step, 1)
            assert not mon.rows
            return took
        with attnprobe.monitor(model, every=10**9, rows=64 if name == "rows=64" else None) as mon:
            took = block(step, 1)  # its call 0 is sampled
        assert len(mon.rows) == 6 * 12
        return took

    kinds = shuffled_rounds(["plain", "between", "rows=64", "rows=None"], args.rounds, measure)
    title = f"training step, GPT-2 shape 6 x 12 x 384, batch 8 x 256 ({args.rounds} rounds, shuffled; medians):"
    print_kinds(title, kinds)
    for every, target in ((10, 1.02), (100, 1.005)):
        for sampled in ("rows=64", "rows=None"):
            ratios = [
                ((every - 1) * b + s) / (every * p) for p, b, s in zip(kinds["plain"], kinds["between"], kinds[sampled])
            ]
            paired = statistics.median(s / p for s, p in zip(kinds[sampled], kinds["plain"]))
            print(
                f"  every={every:<4} {sampled:<9}: ((N-1) between + sampled) / (N plain): median "
                f"{statistics.median(ratios):.4f}x (target <= {target}); with between = plain (the hook figure "
                f"below), 1 + (sampled / plain of the round - 1) / N: {1 + (paired - 1) / every:.4f}x"
            )
    if args.blocks:
        ratios = []
        for _ in range(args.blocks):
            order = ["plain", "monitor"]
            random.shuffle(order)
            times = {}
            for name in order:
                if name == "plain":
                    times[name] = block(step, 10)
                else:
                    with attnprobe.monitor(model, every=10):
                        times[name] = block(step, 10)
            ratios.append(times["monitor"] / times["plain"])
        print(
            f"  every=10 measured over blocks of 10 steps: median {statistics.median(ratios):.3f}x "
            f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})"
        )


def compiled_figures(args):
    torch.manual_seed(0)
    model = gpt2()
    ids = torch.randint(0, 1000, (8, 256))
    compiled = torch.compile(model)
    step = step_fn(compiled, ids)

    def driven(mon):
        def run():
            mon.begin_call()
            step()
            mon.end_call()

        return run

    t0 = time.perf_counter()
    for _ in range(2):
        step()
        with attnprobe.monitor(model, every=10**9, hook=False) as mon:
            driven(mon)()  # its call 0 is sampled: the graph with the capture's hooks
    print(f"compiled: both graphs compiled in {time.perf_counter() - t0:.0f} s")

    def measure(name: str) -> float:
        if name == "plain":
            return block(step, 1)
        with attnprobe.monitor(model, every=10**9, hook=False) as mon:
            if name == "between":
                mon.calls = 1  # past its sampled call 0
            took = block(driven(mon), 1)
        assert len(mon.rows) == (0 if name == "between" else 6 * 12)
        return took

    kinds = shuffled_rounds(["plain", "between", "rows=64"], args.rounds, measure)
    title = f"compiled training step (inductor), the monitor driven by the loop ({args.rounds} rounds, shuffled):"
    print_kinds(title, kinds)


def hook_figures(args):
    tiny = nn.Sequential(attnprobe.MultiHeadAttention(4, num_heads=1))
    x = torch.randn(1, 1, 4)
    calls = 20_000

    def run():
        t0 = time.perf_counter()
        for _ in range(calls):
            tiny(x)
        return (time.perf_counter() - t0) / calls

    plain, hooked = [], []
    with torch.no_grad():
        for _ in range(5):
            plain.append(run())
            mon = attnprobe.monitor(tiny, every=10**9)
            mon.calls = 1  # past its sampled call 0: every call below is one between sampled calls
            hooked.append(run())
            mon.close()
            assert not mon.rows
    p, h = statistics.median(plain), statistics.median(hooked)
    print(
        f"hook: a forward call between sampled calls costs {(h - p) * 1e6:+.1f} us ({p * 1e6:.1f} us -> "
        f"{h * 1e6:.1f} us per call of a tiny attention module, medians of 5 x {calls:,} calls)"
    )


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
    print(
        f"memory: every=1 for {args.long} steps: RSS {first:.0f} MB after {args.long // 10} steps, {last:.0f} MB after "
        f"{args.long} ({last - first:+.0f} MB; the history holds {rows} rows, {history_mb:.1f} MB as a frame)"
    )
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
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=0, help="also measure every=10 over K rounds of 10-step blocks")
    parser.add_argument("--long", type=int, default=10000)
    parser.add_argument("--only", choices=["steps", "compiled", "memory"])
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (on a shared machine 1 is steadier: no thread waits for a descheduled peer)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load_average()} (1, 5, 15 min)")
    if args.only in (None, "steps"):
        steps_figures(args)
        hook_figures(args)
    if args.only in (None, "compiled"):
        compiled_figures(args)
    if args.only in (None, "memory"):
        memory_figures(args)
    print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
