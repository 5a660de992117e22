"""Report generation: time and file size for the issue's two shapes, and what the options change.

    python benchmarks/bench_reports.py            # generation time and size
    python benchmarks/bench_reports.py --browser  # also open each report in Debian's Chromium

Shapes: 6 layers x 12 heads x 128 tokens, and 1 layer x 12 heads x 1024 tokens (causal, batch 1,
weights and scores kept). Timings on a shared 2-core machine are noisy: compare the ratios printed
in one run. Nothing is written outside a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

import attnprobe
from attnprobe.reports import to_html


class Stack(nn.Module):
    def __init__(self, layers: int, d_model: int = 192, heads: int = 12):
        super().__init__()
        self.layers = nn.ModuleList(
            [attnprobe.MultiHeadAttention(d_model, num_heads=heads, causal=True) for _ in range(layers)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def make_capture(layers: int, tokens: int):
    torch.manual_seed(0)
    model = Stack(layers).eval()
    started = time.perf_counter()
    _, cap = attnprobe.run(model, torch.randn(1, tokens, 192), keep=["scores", "weights"])
    return cap, time.perf_counter() - started


def best_of(n, fn):
    times, result = [], None
    for _ in range(n):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


def open_in_browser(path: Path) -> dict[str, float]:
    """Seconds until the grid is drawn, and until the first head's detail view is drawn."""
    from playwright.sync_api import sync_playwright

    args = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        started = time.perf_counter()
        page.goto(path.as_uri())
        page.evaluate("window.attnprobe.ready")
        loaded = time.perf_counter() - started
        started = time.perf_counter()
        page.evaluate("window.attnprobe.openHead(0, 0)")
        opened = time.perf_counter() - started
        started = time.perf_counter()
        page.evaluate("window.attnprobe.openHead(0, 1)")
        second = time.perf_counter() - started
        browser.close()
    return {"load + grid": loaded, "open head": opened, "next head": second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--browser", action="store_true", help="also time opening the reports in /usr/bin/chromium")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement (the fastest is printed)")
    args = parser.parse_args()
    print(f"attnprobe {attnprobe.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        warm, _ = make_capture(1, 8)
        to_html(warm)  # imports (jinja2, pandas) and template compilation are not part of the figures
        for layers, tokens in ((6, 128), (1, 1024)):
            cap, capture_s = make_capture(layers, tokens)
            heads = layers * 12
            values = heads * tokens * tokens * 2
            raw = values * 4
            print(
                f"\n== {layers} layer(s) x 12 heads x {tokens} tokens: {heads} heads, {values:,} values "
                f"(weights + scores), {raw / 2**20:.1f} MiB as float32; capture took {capture_s:.2f} s"
            )
            baseline = None
            for label, options in (
                ("exact (default)", {}),
                ("exact, masked scores kept", {"masked_scores": True}),
                ("bfloat16", {"precision": "bfloat16"}),
            ):
                path = Path(tmp) / f"r{layers}x{tokens}-{len(label)}.html"
                seconds, _ = best_of(args.repeat, partial(to_html, cap, path, overwrite=True, **options))
                size = path.stat().st_size
                baseline = baseline or (seconds, size)
                print(
                    f"  {label:28s} {seconds:6.2f} s  {size / 2**20:7.2f} MiB  ({size / values:.2f} bytes/value, "
                    f"{size / raw:.0%} of raw float32; time x{seconds / baseline[0]:.2f}, "
                    f"size x{size / baseline[1]:.2f} vs default)"
                )
                if args.browser and label.startswith("exact (default)"):
                    figures = open_in_browser(path)
                    print("    chromium: " + ", ".join(f"{k} {v:.2f} s" for k, v in figures.items()))


if __name__ == "__main__":
    main()
