"""Capture cost over the kernels of issue 32: sdpa, flex attention and flash attention, one Llama from a config.

For each kernel the same weights run as a plain forward, a weights capture (``keep=("weights",)``) and a statistics
capture (``keep=("stats",)``), interleaved: each round runs every variant once in a shuffled order, and a ratio is the
median over rounds of that round's ratio to the same model's plain forward, so load from other processes hits both
sides of a ratio alike.

    sdpa:  torch's sdpa kernel (today's figures, as in bench_hf_capture.py but on this model)
    flex:  ``attn_implementation="flex_attention"``: the kernel torch.compile generates (compiled during warm-up)
    flash: ``flash_attention_2``: flash-attn on CUDA when it is installed, else the pure-torch stand-in of the tests
           (tests/flash_standin.py), whose plain forward is itself slow: its ratios say what attnprobe adds to it,
           not what it adds to the real kernel

Each capture's model outputs are checked bitwise against the plain forward before timing. There is no floor for the
flex and flash captures yet (a tool-free recomputation of their weights): the ratios are to the plain forward only.

Run:  python benchmarks/bench_kernels.py [--rounds 20] [--length 256] [--batch 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

import attnprobe

KERNELS = ("sdpa", "flex_attention", "flash_attention_2")


def build(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval().to(device)
    return model.to(torch.bfloat16) if device == "cuda" else model


def variants(model, batch: dict) -> dict:
    def plain():
        return model(**batch).logits

    def capture(keep):
        def run():
            with attnprobe.capture(model, keep=keep) as cap:
                out = model(**batch).logits
            return out, cap

        return run

    return {"plain": plain, "weights": capture(("weights",)), "stats": capture(("stats",))}


def measure(runs: dict, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of every variant, one entry per round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    rng = random.Random(1)
    with torch.no_grad():
        for r in range(warmup + rounds):
            rng.shuffle(names)
            for name in names:
                start = time.perf_counter()
                runs[name]()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if r >= warmup:
                    times[name].append(time.perf_counter() - start)
    return times


def ratio(times, name: str, baseline: str = "plain") -> float:
    return statistics.median(a / b for a, b in zip(times[name], times[baseline], strict=True))


def bench(kernel: str, model, batch: dict, rounds: int) -> None:
    if kernel == "flash_attention_2":
        model.config._attn_implementation_internal = kernel  # what from_pretrained(attn_implementation=) sets
    else:
        model.set_attn_implementation(kernel)
    runs = variants(model, batch)
    start = time.perf_counter()
    with torch.no_grad():
        plain = runs["plain"]()
        first = time.perf_counter() - start
        for keep in ("weights", "stats"):
            out, cap = runs[keep]()
            if not torch.equal(plain, out) or not len(cap):
                raise SystemExit(f"{kernel}: the {keep} capture changed the outputs or recorded nothing")
    times = measure(runs, rounds)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"  {kernel:<18} plain {ms['plain']:8.1f} ms (first call {first:5.1f} s)   "
        f"weights {ratio(times, 'weights'):5.3f}x   stats {ratio(times, 'stats'):5.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    real_flash = device == "cuda" and importlib.util.find_spec("flash_attn") is not None
    model = build(device)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, 1000, (args.batch, args.length), generator=g).to(device)}
    print(
        f"Llama (4 layers, 8 heads / 4 kv heads, d_head 32), batch {tuple(batch['input_ids'].shape)}, {device}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds; ratios to the same model's plain "
        "forward on the same kernel (absolute times depend on machine load):"
    )
    with pytest.MonkeyPatch.context() as m:
        if not real_flash:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            import flash_standin

            flash_standin.install(m, "flash_attention_2")
        for kernel in KERNELS:
            bench(kernel, model, batch, args.rounds)
    if not real_flash:
        print("  (flash_attention_2 ran the pure-torch stand-in of tests/flash_standin.py: no CUDA flash-attn here)")


if __name__ == "__main__":
    main()
