"""Scans over a data set, and capture on a dispatched model (accelerate), measured in one run.

    scan     MiniLM (bundled) over N lines, batch 16: inputs/s with 1 process and with 2 processes
             (`accelerate launch --multi_gpu --num_processes 2 -m attnprobe scan`: on a CPU-only machine that runs
             gloo), and the peak resident memory of each process at 500 and at 2,000 lines (flat in the number of
             inputs: no growth with N)
    dispatch a tiny Llama loaded with a device map that puts half its layers on "disk" (an offload folder):
             full capture / plain forward of the same dispatched model (interleaved rounds, median ratio)

Run:  python benchmarks/bench_scan.py [--lines 2000] [--small 500] [--rounds 15]
Every scan runs in its own process (`/usr/bin/time`-style peak RSS from the children's rusage).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = [
    "attention",
    "lets",
    "every",
    "token",
    "look",
    "at",
    "every",
    "other",
    "token",
    "and",
    "decide",
    "what",
    "matters",
    "the",
    "cat",
    "sat",
    "on",
    "the",
    "mat",
    "because",
    "it",
    "was",
    "tired",
    "and",
    "the",
    "model",
    "learned",
    "to",
    "copy",
    "what",
    "came",
    "before",
]


def lines_file(folder: Path, n: int) -> Path:
    rng = random.Random(0)
    path = folder / f"lines-{n}.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))) for _ in range(n)) + "\n")
    return path


def scan_figures(args, folder: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    common = ["scan", "--batch-size", "16", "--quiet"]
    rows = []
    for n in (args.small, args.lines):
        data = lines_file(folder, n)
        # each run in a fresh interpreter, so ru_maxrss of the children is this run's own peak
        probe = [
            sys.executable,
            "-c",
            "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True);"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
        ]
        for processes in (1, 2):
            out = folder / f"scan-{n}-{processes}"
            if processes == 1:
                cmd = [sys.executable, "-m", "attnprobe", *common, "--data", str(data), "--out", str(out)]
            else:
                cmd = [
                    str(Path(sys.executable).with_name("accelerate")),
                    "launch",
                    "--multi_gpu",
                    "--num_processes",
                    "2",
                    "--num_machines",
                    "1",
                    "--mixed_precision",
                    "no",
                    "--dynamo_backend",
                    "no",
                    "-m",
                    "attnprobe",
                    *common,
                    "--data",
                    str(data),
                    "--out",
                    str(out),
                ]
            threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes))}
            t0 = time.perf_counter()
            done = subprocess.run(probe + cmd, env={**env, **threads}, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if done.returncode:
                sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
            peak_mb = int(done.stdout.strip().splitlines()[-1]) / 1024
            rows.append((n, processes, n / seconds, peak_mb))
            shutil.rmtree(out)
    print(f"scan: bundled MiniLM, batch 16, {os.cpu_count()} CPU cores (one process: all threads; two: half each)")
    print(f"{'lines':>6} {'processes':>9} {'inputs/s':>9} {'peak RSS MB (largest process)':>30}")
    for n, p, rate, peak in rows:
        print(f"{n:>6} {p:>9} {rate:>9.1f} {peak:>30.0f}")
    by = {(n, p): peak for n, p, _, peak in rows}
    for p in (1, 2):
        print(
            f"peak RSS, {args.lines} / {args.small} lines, {p} process(es): "
            f"{by[(args.lines, p)] / by[(args.small, p)]:.2f}x"
        )


def dispatch_figures(args, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import attnprobe

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    LlamaForCausalLM(config).save_pretrained(folder / "llama")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.layers.2": "disk",
        "model.layers.3": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    model = AutoModelForCausalLM.from_pretrained(
        folder / "llama", device_map=device_map, offload_folder=folder / "offload"
    ).eval()
    ids = torch.randint(0, 1000, (4, 256))

    def plain():
        model(ids)

    def captured():
        with attnprobe.capture(model):
            model(ids)

    variants = {"plain": plain, "capture": captured}
    times = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()
        for _ in range(args.rounds):
            order = list(variants)
            random.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - t0)
    ratio = statistics.median(c / p for c, p in zip(times["capture"], times["plain"]))
    print(
        f"dispatch: tiny Llama (hidden 256, 4 layers, 2 on disk), batch 4 x 256, {args.rounds} rounds: plain "
        f"{statistics.median(times['plain']) * 1e3:.0f} ms, full capture / plain = {ratio:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--small", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", choices=["scan", "dispatch"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "dispatch":
            scan_figures(args, Path(tmp))
        if args.only != "scan":
            dispatch_figures(args, Path(tmp))


if __name__ == "__main__":
    main()
