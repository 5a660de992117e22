"""Size, time and peak memory of a long-input report (statistics mode, pooled overviews, windows).

Tiny Llama (random init: hidden 256, 4 layers x 8 heads, 2 kv heads) at T tokens (default 32768): each case runs
in its own process (peak RSS is per process): a plain sdpa forward, then capture(keep=("stats",), overview=...)
+ check + the HTML report + the PNG grid. Prints the HTML size, the time of each phase and the peak RSS; a full
capture's weights alone would be 4 x 8 x T^2 x 4 bytes (128 GiB at 32k).

    python benchmarks/bench_long_report.py [--tokens 32768] [--cells 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def model(tokens: int):
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
        max_position_embeddings=tokens,
    )
    net = transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (1, tokens))
    return net, ids


def child(case: str, tokens: int, cells: int, out: str) -> dict:
    import torch

    import attnprobe
    from attnprobe.probe.engine.stats import Overview

    net, ids = model(tokens)
    result: dict = {"case": case}
    t = time.perf_counter()
    if case == "plain":
        with torch.no_grad():
            net(input_ids=ids)
        result["forward_s"] = time.perf_counter() - t
    else:
        n = min(128, tokens)
        overview = Overview(cells=cells, windows=((0, n, 0, n), (tokens - n, tokens, tokens - n, tokens)))
        with torch.no_grad(), attnprobe.capture(net, keep=("stats",), overview=overview) as cap:
            net(input_ids=ids)
        result["capture_s"] = time.perf_counter() - t
        result["capture_mib"] = cap.nbytes / 2**20
        t = time.perf_counter()
        checks = attnprobe.check(cap, causal=True)
        result["check_s"] = time.perf_counter() - t
        result["check_ok"] = checks.ok
        t = time.perf_counter()
        html = attnprobe.reports.to_html(cap, os.path.join(out, "long.html"), checks=checks, overwrite=True)
        result["html_s"] = time.perf_counter() - t
        result["html_mb"] = os.path.getsize(html) / 1e6
        t = time.perf_counter()
        png = attnprobe.reports.save_grid(cap, os.path.join(out, "long.png"), overwrite=True)
        result["png_s"] = time.perf_counter() - t
        result["png_kb"] = os.path.getsize(png) / 1e3
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cells", type=int, default=128)
    parser.add_argument("--out", default=None, help="folder for long.html and long.png (default: a temporary one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="attnprobe-long-report-")
    os.makedirs(out, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.cells, out)))
        return
    print(f"tiny Llama, 4 layers x 8 heads, {args.tokens} tokens, overview cells {args.cells}; output in {out}")
    print(f"(a full capture's weights alone: {4 * 8 * args.tokens**2 * 4 / 2**30:.1f} GiB)")
    results = {}
    for case in ("plain", "report"):
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                case,
                "--tokens",
                str(args.tokens),
                "--cells",
                str(args.cells),
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            sys.exit(f"{case} failed:\n{proc.stderr}")
        results[case] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[case]))
    r, p = results["report"], results["plain"]
    total = r["capture_s"] + r["check_s"] + r["html_s"] + r["png_s"]
    print(
        f"HTML {r['html_mb']:.1f} MB; capture {r['capture_s']:.1f} s ({r['capture_s'] / p['forward_s']:.1f}x the plain "
        f"forward's {p['forward_s']:.1f} s), check {r['check_s']:.1f} s, HTML {r['html_s']:.1f} s, "
        f"PNG {r['png_s']:.1f} s, "
        f"total {total:.1f} s; peak RSS {r['peak_rss_mib']:.0f} MiB (plain forward {p['peak_rss_mib']:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
