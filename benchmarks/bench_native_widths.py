"""The native statistics pass built for each x86-64 vector width: what ``keep=("stats",)`` adds per attended element.

``probe/engine/native_rows.c`` is compiled with ``-march=native``, so a user's machine gets the vectors of its own CPU:
16 floats with AVX-512, 8 with AVX2 (most laptops and desktops, AMD Zen 2 and 3), 4 with SSE. This machine builds the
same C for the narrower levels too (``-march=x86-64-v3``: AVX2 and FMA; ``-march=x86-64-v2``: SSE 4.2) and runs each
build, so the widths a user may have are measured side by side. Each build runs in a process of its own (the library
is loaded once a process), on a module that calls sdpa itself:

    short   batch 8 x 12 heads x 128 tokens x 32 dims, no mask (MiniLM's attention shapes)
    long    batch 1 x 8 heads x 4,096 tokens x 64 dims, causal

Printed per build and shape: the plain forward and the capture (medians of interleaved rounds), what the capture adds
per attended (query, key) element, and the ratio. torch's own kernels are the same in every row (they pick their
vectors at run time, from this CPU): on a machine that has only AVX2, sdpa is slower too, and the ratio lower.

Run:  python benchmarks/bench_native_widths.py [--rounds 15] [--levels native x86-64-v3 x86-64-v2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {"short": (8, 12, 128, 32, False), "long": (1, 8, 4096, 64, True)}


def child(level: str, shape: str, rounds: int) -> dict:
    """One build and one shape, in this process: the medians of plain and captured forwards."""
    import torch
    import torch.nn.functional as F

    from attnprobe.probe.engine import native_rows

    native_rows._FLAGS = tuple(f"-march={level}" if f == "-march=native" else f for f in native_rows._FLAGS)
    if not native_rows.available():
        return {"error": native_rows.why_unavailable()}
    import attnprobe

    B, H, T, D, causal = SHAPES[shape]

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    module, g = Attention(), torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))  # (batch, head, tokens, d) each

    def captured():
        with attnprobe.capture(module, keep=("stats",), stats_engine="native") as cap:
            module(q, k, v)
        return cap

    times: dict = {"plain": [], "captured": []}
    with torch.no_grad():
        captured()  # builds nothing more: the library is loaded; warms the engine
        for r in range(rounds + 1):
            for name, run in (("plain", lambda: module(q, k, v)), ("captured", captured)):
                start = time.perf_counter()
                run()
                if r:
                    times[name].append(time.perf_counter() - start)
    elements = B * H * T * ((T + 1) / 2 if causal else T)
    plain, cap = (statistics.median(times[n]) for n in ("plain", "captured"))
    return {"plain": plain, "captured": cap, "ns": (cap - plain) / elements * 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--levels", nargs="+", default=["native", "x86-64-v3", "x86-64-v2"])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.rounds)))
        return
    import torch

    print(
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds; time / plain forward of the same shape"
    )
    with tempfile.TemporaryDirectory() as cache:  # the builds go here, not into the user's cache
        table(args, dict(os.environ, XDG_CACHE_HOME=cache))


def table(args, env: dict) -> None:
    print(f"  {'build':<11} {'shape':<6} {'plain ms':>9} {'capture ms':>11} {'added ns/el':>12} {'ratio':>6}")
    for level in args.levels:
        for shape in SHAPES:
            done = subprocess.run(
                [sys.executable, __file__, "--rounds", str(args.rounds), "--child", level, shape],
                capture_output=True,
                text=True,
                check=False,
                env=env,
            )
            lines = done.stdout.strip().splitlines()
            got = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr.strip()[-300:]}
            if "error" in got:
                print(f"  {level:<11} {shape:<6} not built here: {got['error']}")
                continue
            ratio = got["captured"] / got["plain"]
            print(
                f"  {level:<11} {shape:<6} {got['plain'] * 1e3:9.1f} {got['captured'] * 1e3:11.1f} "
                f"{got['ns']:12.2f} {ratio:6.2f}"
            )


if __name__ == "__main__":
    main()
