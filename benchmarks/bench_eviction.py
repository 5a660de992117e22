"""KV-cache eviction profiles from a statistics capture: memory and time at long contexts, exactness at 2k.

Figures (printed; each measurement in its own subprocess, so a peak RSS is that run's own):

1. tiny Llama (hidden 256, 4 layers, 8 heads, 2 kv heads, random init, batch 1) at T = 8192 and 32768 tokens:
   peak RSS and time of the plain sdpa forward, and of the same forward under
   ``capture(keep=("stats",), rows="last:64", eviction=EvictionPlan(budgets=(64, 256, 1024, 4096)))`` followed by
   ``eviction_profile`` (target: peak RSS <= 1.5x the plain forward's at 32k);
2. the same model at T = 2048: the kept fractions of the statistics capture against those computed afterwards from
   a full capture of the weights (every row kept) by a dense computation written in this file (max abs difference
   over every layer, head, evaluated row, policy and budget).

Usage: ``python benchmarks/bench_eviction.py [--lengths 8192 32768] [--threads 1]``. Timings on a shared machine are
noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BUDGETS = (64, 256, 1024, 4096)


def _llama(T: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=max(T, 2048),
    )
    model = transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (1, T), generator=torch.Generator().manual_seed(1))
    return model, ids


def one(mode: str, T: int, threads: int | None) -> dict:
    """One measurement in this process."""
    import resource

    import torch

    import attnprobe

    if threads:
        torch.set_num_threads(threads)
    model, ids = _llama(T)
    start = time.perf_counter()
    extra = {}
    with torch.no_grad():
        if mode == "plain":
            model(input_ids=ids)
        else:
            plan = attnprobe.EvictionPlan(budgets=BUDGETS)
            with attnprobe.capture(model, keep=("stats",), rows="last:64", eviction=plan) as cap:
                model(input_ids=ids)
            profile = attnprobe.eviction_profile(cap)
            extra = {
                "stats_bytes": cap.nbytes,
                "kept": profile.groupby(["policy", "budget"])["kept"].mean().round(3).to_dict(),
            }
            extra["kept"] = {f"{p}@{b}": v for (p, b), v in extra["kept"].items()}
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"mode": mode, "T": T, "seconds": seconds, "peak_rss": peak, **extra}


def measure(mode: str, T: int, threads: int | None) -> dict:
    args = [sys.executable, __file__, "--one", mode, str(T)] + (["--threads", str(threads)] if threads else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def dense_fractions(weights, split: int, plan) -> dict:
    """{policy: (batch, head, row, budget)} float64 for rows ``split ..`` of ``weights`` (float64, every row), by
    sorting each head's keys; written from the definitions, not from attnprobe's pass."""
    import torch

    B, H, T, _ = weights.shape
    w = weights.double()
    before = w[:, :, :split, :split]  # (B, H, split, split)
    accumulated = before.sum(2)  # (B, H, split)
    rows = min(plan.window, split)
    window = before[:, :, split - rows :].sum(2)
    pad = plan.kernel // 2
    padded = torch.nn.functional.pad(window[..., : split - rows], (pad, pad))
    pooled = padded.unfold(-1, plan.kernel, 1).mean(-1)  # (B, H, split - rows)
    evaluated = w[:, :, split:]  # (B, H, n, T)
    total = evaluated.sum(-1)
    after = evaluated[..., split:].sum(-1)
    out = {p: torch.zeros(B, H, T - split, len(plan.budgets), dtype=torch.float64) for p in plan.policies}
    keys = torch.arange(split)
    for i, K in enumerate(plan.budgets):
        sets = {}
        sinks = min(plan.sinks, K)
        sets["streaming"] = ((keys < sinks) | (keys >= split - (K - sinks))).double().expand(B, H, split)
        for policy, scores, recent in (
            ("h2o", accumulated, min(int(plan.recent * K), split)),
            ("snapkv", torch.cat([pooled, torch.zeros(B, H, rows)], -1), min(K, rows)),
        ):
            keep = (keys >= split - recent).double().expand(B, H, split).clone()
            candidates = scores[..., : split - recent]
            order = torch.sort(candidates, dim=-1, descending=True, stable=True).indices
            chosen = order[..., : max(0, K - recent)] if policy == "h2o" or recent == rows else order[..., :0]
            keep.scatter_(-1, chosen, 1.0)
            sets[policy] = keep
        for policy in plan.policies:
            if policy == "oracle":
                kept = evaluated[..., :split].topk(min(K, split), -1).values.sum(-1)
            else:
                kept = (evaluated[..., :split] * sets[policy][:, :, None, :]).sum(-1)
            out[policy][..., i] = (kept + after) / total
    return out


def exactness(T: int = 2048) -> float:
    import torch

    import attnprobe

    model, ids = _llama(T)
    plan = attnprobe.EvictionPlan(budgets=BUDGETS)
    with torch.no_grad():
        with attnprobe.capture(model, keep=("stats",), rows="last:64", eviction=plan) as stats:
            model(input_ids=ids)
        with attnprobe.capture(model, keep=("weights",)) as full:
            model(input_ids=ids)
    worst = 0.0
    for s, f in zip(stats, full):
        want = dense_fractions(f.weights, T - 64, plan)
        for policy in plan.policies:
            worst = max(worst, float((s.stats[f"kept_{policy}"] - want[policy]).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", nargs=2, metavar=("MODE", "T"))
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.threads)))
        return
    print(f"exactness at 2048 tokens: max |stats - dense from full weights| = {exactness():.2e}")
    print(f"{'tokens':>7} {'plain s':>8} {'evict s':>8} {'time':>5} {'plain RSS':>10} {'evict RSS':>10} {'RSS':>5}")
    for T in args.lengths:
        p, e = measure("plain", T, args.threads), measure("evict", T, args.threads)
        print(
            f"{T:>7} {p['seconds']:>8.1f} {e['seconds']:>8.1f} {e['seconds'] / p['seconds']:>5.2f} "
            f"{p['peak_rss'] / 2**20:>8.0f}MB {e['peak_rss'] / 2**20:>8.0f}MB {e['peak_rss'] / p['peak_rss']:>5.2f}  "
            f"kept {e['kept']}"
        )


if __name__ == "__main__":
    main()
