"""Overhead of capturing code attnprobe has never seen, as ratios to a plain forward measured in one run.

Models (eval, no_grad, CPU):
- ``encoder``: nn.TransformerEncoder (batch_first, key padding), read by the nn.MultiheadAttention adapter;
- ``sdpa``: blocks calling F.scaled_dot_product_attention directly, found at run time;
- ``hand-written``: blocks of single-head modules in an nn.ModuleList (read only with ``modules=``).

Rows per model: plain forward; an idle capture (``layers=[]``; for hand-written code with the blocks named in
``modules=``); a default capture storing everything (not for hand-written code: without ``modules=`` a capture of
it finds no attention and is refused); and, for hand-written code, tracing the named attention modules and
``modules="auto"``. Configurations run interleaved, round after
round, and each row is the median; timings on a shared machine are noisy, ratios are what to compare.

``--memory`` adds, per row, the peak of bytes torch allocated during one call (the forward's temporaries plus
what the capture stores and recomputes), read from torch.profiler's memory events (CPU allocator, so exact and
deterministic, unlike the process's resident size), and its ratio to the plain row's peak. One extra profiled
call per row; torch's profiler may log a line per call on stderr.

    python benchmarks/bench_torch_capture.py [--rounds 15] [--threads 1] [--memory]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import attnprobe
from attnprobe.hooks.torch_mha import fastpath_disabled


class SdpaBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.qkv, self.o = h, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.ff(x)


class Head(nn.Module):
    def __init__(self, d: int, dh: int, max_len: int):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(d, dh, bias=False) for _ in range(3))
        self.register_buffer("tril", torch.tril(torch.ones(max_len, max_len)))

    def forward(self, x):
        T = x.shape[1]
        k, q, v = self.key(x), self.query(x), self.value(x)
        wei = (q @ k.transpose(-2, -1)) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ v


class HandBlock(nn.Module):
    def __init__(self, d: int, h: int, max_len: int):
        super().__init__()
        self.heads = nn.ModuleList([Head(d, d // h, max_len) for _ in range(h)])
        self.proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.proj(torch.cat([h(x) for h in self.heads], dim=-1))
        return x + self.ff(x)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_configs(configs: dict, rounds: int) -> dict[str, float]:
    """Run every configuration once per round, interleaved; median seconds per configuration."""
    for fn in configs.values():  # warm up
        fn()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, fn in configs.items():
            times[name].append(timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_bytes(fn) -> int:
    """Peak of the bytes torch allocated (and had not freed) at any moment during ``fn()``, from the profiler."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage of earlier rows is not freed inside this one
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def captured(model, call, **options):
    def fn():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)
            with attnprobe.capture(model, **options):
                call()

    return fn


def bench(size: str, rounds: int, memory: bool = False) -> list[tuple]:
    d, h, layers, B, T = {"small": (32, 4, 2, 2, 16), "medium": (128, 4, 4, 8, 64)}[size]
    torch.manual_seed(0)
    x = torch.randn(B, T, d)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -T // 4 :] = True
    rows = []

    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, h, 2 * d, batch_first=True), layers).eval()
    enc_call = lambda: enc(x, src_key_padding_mask=pad)  # noqa: E731

    def enc_slow():
        with fastpath_disabled():
            enc_call()

    models = {
        "encoder": {
            "plain (fused fast path)": enc_call,
            "plain, fast path off": enc_slow,
            "idle capture": captured(enc, enc_call, layers=[]),
            "full capture": captured(enc, enc_call),
        },
    }
    sd = nn.Sequential(*[SdpaBlock(d, h) for _ in range(layers)]).eval()
    models["sdpa"] = {
        "plain": lambda: sd(x),
        "idle capture": captured(sd, lambda: sd(x), layers=[]),
        "full capture": captured(sd, lambda: sd(x)),
    }
    hand = nn.Sequential(*[HandBlock(d, h, T) for _ in range(layers)]).eval()
    models["hand-written"] = {
        "plain": lambda: hand(x),
        "idle capture (modules=[blocks], layers=[])": captured(hand, lambda: hand(x), modules=list(hand), layers=[]),
        "modules=[blocks], full": captured(hand, lambda: hand(x), modules=list(hand)),
        "modules='auto', full": captured(hand, lambda: hand(x), modules="auto"),
    }
    with torch.no_grad():
        for model, configs in models.items():
            result = run_configs(configs, rounds)
            base = next(iter(result.values()))
            peaks = {name: peak_bytes(fn) for name, fn in configs.items()} if memory else {}
            base_peak = next(iter(peaks.values()), 0)
            for name, seconds in result.items():
                row = (f"{model} ({size})", name, seconds * 1e3, seconds / base)
                if memory:
                    row += (peaks[name] / 2**20, peaks[name] / base_peak if base_peak else float("nan"))
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--memory", action="store_true", help="also print peak allocated memory and its ratio to plain")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.rounds} interleaved rounds")
    header = f"{'model':<22} {'configuration':<44} {'ms':>9} {'x plain':>8}"
    print(header + (f" {'peak MiB':>9} {'x plain':>8}" if args.memory else ""))
    for size in args.sizes.split(","):
        for model, name, ms, ratio, *mem in bench(size, args.rounds, args.memory):
            line = f"{model:<22} {name:<44} {ms:>9.2f} {ratio:>8.2f}"
            if mem:
                line += f" {mem[0]:>9.3f} {mem[1]:>8.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
