"""Every GPU check and figure of attnprobe in one run, one table: ``python benchmarks/gpu.py``.

Checks (each passes, fails with the reason, or is skipped with one):

- bf16 and fp16 captures of a tiny Llama on the GPU: full and statistics captures, outputs bitwise the uncaptured
  ones, ``check(causal=True)`` clean, the statistics those of the full capture's weights;
- records kept on the GPU (``capture(device="cuda")``) or moved to the CPU (the default);
- generation with a static cache (``cache_implementation="static"``) under a capture: the same tokens, every step;
- accelerate with layers on ``cuda:0`` and ``cpu`` (``dispatch_model``): the same outputs, every layer recorded;
- ``torch.compile`` with inductor: the compiled model under a capture, outputs equal, every layer recorded;
- the monitor on a training step: the loss and gradients unchanged, a history row per (layer, head);
- sdpa's own kernels with their logsumexp (``probe.engine.kernel_lse``): the output bitwise sdpa's for each kernel the
  device runs (flash, memory-efficient), the lse the logits';
- the Triton statistics kernel against the eager engine: random shapes, masks and dtypes, atomic and deterministic
  per-key sums.

Figures (ratios measured in one run, medians of ``--rounds``): a Llama-3-8B-shaped stack (hidden 4096, 32 heads, 8
key/value heads, head size 128, bf16, random weights, ``--layers`` layers) at ``--tokens`` (8k, 32k, 128k): the
plain sdpa (flash) forward against the forward with per-row statistics (the kernel without its per-key sums) and with
the full set (``capture(keep=("stats",), stats_engine="triton")``), time and peak memory; the full set against the
eager engine's at the shortest length (largest difference per statistic, within bf16's tolerance); a weights-only
capture at 4k against the eager model's ``output_attentions``.

``--smoke``: everything on the CPU at tiny sizes, the Triton kernel under its interpreter (``TRITON_INTERPRET=1``),
inductor replaced by ``aot_eager`` (no compiler needed): what ``tests/test_gpu_smoke.py`` runs, to keep the script
working where no GPU is. Exit status 1 when a check fails.

Usage: ``python benchmarks/gpu.py [--smoke] [--tokens 8192 32768 131072] [--layers 2] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

if "--smoke" in sys.argv:  # Triton reads it when a kernel is defined, before attnprobe imports its kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch


class Skip(Exception):
    """A check that cannot run here, with the reason."""


@dataclass
class Context:
    device: torch.device
    smoke: bool
    rows: list[tuple[str, str, float, str]] = field(default_factory=list)

    def run(self, name: str, fn: Callable[[Context], str]) -> None:
        start = time.perf_counter()
        try:
            detail, status = fn(self), "ok"
        except Skip as skip:
            detail, status = str(skip), "skip"
        except Exception as exc:  # a failed check is a row of the table, and the exit status
            detail, status = f"{type(exc).__name__}: {exc}"[:300], "FAIL"
            traceback.print_exc(file=sys.stderr)
        self.rows.append((name, status, time.perf_counter() - start, detail))
        print(f"[{status:>4}] {name}: {detail}", flush=True)


# ------------------------------------------------------------------------------------------------- tiny models
def tiny_llama(device, dtype=torch.float32, *, attn: str = "sdpa", layers: int = 2):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(device).eval()


def tiny_batch(device, T: int = 24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> float:
    """The largest difference of two statistics (NaN where both are NaN counts 0); raises above ``atol``."""
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.equal(a.isnan(), b.isnan()):
        raise AssertionError("NaN at different places")
    diff = float((a - b).abs().nan_to_num(0.0).max()) if a.numel() else 0.0
    if diff > atol:
        raise AssertionError(f"differs by {diff:.2e} > {atol:.0e}")
    return diff


# --------------------------------------------------------------------------------------------------- the checks
def check_dtype(dtype: torch.dtype) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        import attnprobe
        from attnprobe.probe.engine.stats import ROW_STATS, record_stats

        model, batch = tiny_llama(ctx.device, dtype), tiny_batch(ctx.device)
        with torch.no_grad():
            plain = model(**batch).logits
            with attnprobe.capture(model) as full:
                got = model(**batch).logits
            with attnprobe.capture(model, keep=("stats",)) as stats:
                got_stats = model(**batch).logits
        assert torch.equal(plain, got) and torch.equal(plain, got_stats), "the capture changed the model's output"
        result = attnprobe.check(full, causal=True, attention_mask=batch["attention_mask"])
        assert result.ok, result.headline()
        worst = 0.0
        for a, b in zip(stats, full):
            want = record_stats(b)
            assert want is not None
            for name in ("entropy", "max_weight", "row_sum_error", "key_weight"):
                rows = a.stats["finite"].cpu() if name in ROW_STATS else slice(None)
                worst = max(worst, _close(a.stats[name].cpu()[rows], want[name].cpu()[rows], 5e-3))
        return f"{len(full)} records, outputs bitwise, check clean, statistics within {worst:.1e} of the weights'"

    return run


def check_devices(ctx: Context) -> str:
    import attnprobe

    model, batch = tiny_llama(ctx.device), tiny_batch(ctx.device)
    with torch.no_grad(), attnprobe.capture(model, device=ctx.device) as here:
        model(**batch)
    with torch.no_grad(), attnprobe.capture(model) as cpu:
        model(**batch)
    assert all(r.weights.device.type == ctx.device.type for r in here), "records not kept where asked"
    assert all(r.weights.device.type == "cpu" for r in cpu), "records not moved to the CPU"
    assert all(torch.equal(a.weights.cpu(), b.weights) for a, b in zip(here, cpu))
    return f"records on {ctx.device.type} and on cpu, equal"


def check_static_cache(ctx: Context) -> str:
    import attnprobe

    model, batch = tiny_llama(ctx.device), tiny_batch(ctx.device, 12)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        plain = model.generate(**batch, **kw)
        with attnprobe.capture(model, keep=("stats",)) as cap:
            got = model.generate(**batch, **kw)
    assert torch.equal(plain, got), "the capture changed the generated tokens"
    steps = sorted({r.step for r in cap})
    assert steps == [0, 1, 2, 3], steps
    return f"same tokens, {len(cap)} records over steps {steps}"


def check_accelerate(ctx: Context) -> str:
    try:
        from accelerate import dispatch_model
    except ImportError as exc:
        raise Skip("accelerate is not installed") from exc
    import attnprobe

    first = 0 if ctx.device.type == "cuda" else "cpu"
    device_map = {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first}
    device_map.update({"model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"})
    model = dispatch_model(tiny_llama("cpu"), device_map=device_map)
    batch = tiny_batch("cpu")
    with torch.no_grad():
        plain = model(**batch).logits
        with attnprobe.capture(model) as cap:
            got = model(**batch).logits
    assert torch.equal(plain, got) and [r.layer for r in cap] == [0, 1]
    return f"layer 0 on {first}, layer 1 on cpu: outputs bitwise, both layers recorded"


def check_compile(ctx: Context) -> str:
    import attnprobe

    backend = "aot_eager" if ctx.smoke else "inductor"
    model, batch = tiny_llama(ctx.device), tiny_batch(ctx.device)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        plain = compiled(**batch).logits
        with attnprobe.capture(compiled, keep=("stats",)) as cap:
            got = compiled(**batch).logits
    assert torch.allclose(plain, got, atol=1e-5), "the capture changed the compiled model's output"
    assert len(cap) == 2, len(cap)
    return f"backend {backend}: outputs equal, {len(cap)} records"


def check_monitor(ctx: Context) -> str:
    import attnprobe

    def step(model, batch):
        model.zero_grad()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model, batch = tiny_llama(ctx.device).train(), tiny_batch(ctx.device)
    plain_loss, plain_grads = step(model, batch)
    with attnprobe.monitor(model, every=1) as mon:
        loss, grads = step(model, batch)
    assert torch.equal(plain_loss, loss) and all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
    rows = len(mon.history)
    assert rows == 2 * 4, rows  # layers x heads
    return f"loss and gradients unchanged, {rows} history rows"


def check_kernel_lse(ctx: Context) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnprobe.probe.engine.kernel_lse import _bits, kernel_of, sdpa_with_lse

    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(2, 8, 300, 64, device=ctx.device, dtype=dtype) for _ in range(3))
    mask = torch.rand(2, 1, 300, 300, device=ctx.device) > 0.2
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    proven = []
    for name, backend in backends.items():
        for kind, kw in (("causal", {"is_causal": True}), ("mask", {"attn_mask": mask})):
            with sdpa_kernel(backend):
                if kernel_of(q, k, v, **kw) is None:
                    continue
                out, lse = sdpa_with_lse(q, k, v, **kw)
                want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
            assert lse is not None and torch.equal(_bits(out), _bits(want)), f"{name} {kind}: not bitwise sdpa's"
            s = (q.float() @ k.float().transpose(-1, -2)) / 8.0
            allowed = torch.ones(300, 300, dtype=torch.bool, device=q.device).tril() if kind == "causal" else mask
            ref = torch.logsumexp(s.masked_fill(~allowed, -torch.inf), -1)
            _close(lse[ref.isfinite()], ref[ref.isfinite()], 1e-3)
            proven.append(f"{name}/{kind}")
    if not proven:
        raise Skip(f"no kernel with an lse runs on {ctx.device.type}")
    return "bitwise sdpa, lse within 1e-3: " + ", ".join(proven)


def check_triton(ctx: Context) -> str:
    _need_triton()
    from attnprobe.probe.engine.attention_math import AttentionCall
    from attnprobe.probe.engine.stats import KEY_STATS, ROW_STATS, attention_stats
    from attnprobe.probe.engine.triton_stats import triton_attention_stats

    rng, worst, cases = random.Random(0), 0.0, 3 if ctx.smoke else 24
    for case in range(cases):
        dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
        B, H, D = rng.randint(1, 2), rng.randint(1, 4), rng.choice((16, 64, 128))
        Tk = rng.randint(1, 24 if ctx.smoke else 700)
        Tq = Tk if rng.random() < 0.7 else rng.randint(1, Tk)
        q, k, v = (torch.randn(B, H, T, D, device=ctx.device).to(dtype) for T in (Tq, Tk, Tk))
        rows, keys = torch.arange(Tq, device=ctx.device)[:, None] + Tk - Tq, torch.arange(Tk, device=ctx.device)
        mask = (keys <= rows) & (keys > rows - rng.randint(1, Tk)) if rng.random() < 0.5 else None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        call = AttentionCall(q, k, scaling=D**-0.5, v=v, output=out, mask=mask, causal=mask is None)
        got = triton_attention_stats(call, diag_offset=Tk - Tq, deterministic=bool(case % 2))
        want = attention_stats(call, diag_offset=Tk - Tq)
        assert got is not None, f"case {case}: the kernel handed the call back"
        atol = 1e-4 if dtype == torch.float32 else 4e-3
        finite = want["finite"]
        for name in ROW_STATS + KEY_STATS:
            a, b = got[name], want[name]
            if not a.dtype.is_floating_point:
                assert torch.equal(a[finite] if name in ROW_STATS else a, b[finite] if name in ROW_STATS else b), name
                continue
            worst = max(
                worst, _close(a[finite] if name in ROW_STATS else a, b[finite] if name in ROW_STATS else b, atol)
            )
    return f"{cases} random calls (dtypes, masks, shapes, both per-key sums): within {worst:.1e} of the eager engine"


# -------------------------------------------------------------------------------------------------- the figures
def llama8b_stack(device, layers: int, smoke: bool):
    import transformers

    torch.manual_seed(0)
    size = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    if not smoke:  # Llama-3-8B's attention: 32 heads, 8 key/value heads, head size 128
        size = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    config = transformers.LlamaConfig(
        **size, num_hidden_layers=layers, vocab_size=1024, max_position_embeddings=1 << 18
    )
    dtype = torch.float32 if smoke else torch.bfloat16
    return transformers.LlamaModel._from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).eval()


def _timed(fn, device, rounds: int) -> tuple[float, int]:
    """(median seconds, peak bytes allocated) of ``fn()`` over ``rounds`` runs after one warm-up."""
    fn()
    times, peak = [], 0
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak


def _need_triton() -> None:
    from attnprobe.probe.engine.engines import triton_available

    if not triton_available():
        raise Skip("triton is not installed (pip install 'attnprobe[triton]')")


def figures_long(ctx: Context, tokens: list[int], layers: int, rounds: int) -> None:
    _need_triton()
    import attnprobe
    from attnprobe.probe.engine import triton_stats

    model = llama8b_stack(ctx.device, layers, ctx.smoke)
    real = triton_stats.triton_attention_stats

    def per_row(call, **kw):  # the kernel without its per-key sums: what "per-row statistics" cost
        return real(call, **{**kw, "key_sums": False})

    for T in tokens:
        ids = torch.randint(0, 1024, (1, T), device=ctx.device)

        def plain(ids=ids):
            with torch.no_grad():
                model(input_ids=ids)

        def stats(ids=ids):
            with torch.no_grad(), attnprobe.capture(model, keep=("stats",), stats_engine="triton"):
                model(input_ids=ids)

        base, base_peak = _timed(plain, ctx.device, rounds)
        full, full_peak = _timed(stats, ctx.device, rounds)
        triton_stats.triton_attention_stats = per_row  # read by engines.statistics at each call
        try:
            rows, _ = _timed(stats, ctx.device, rounds)
        finally:
            triton_stats.triton_attention_stats = real
        memory = f", peak memory {full_peak / base_peak:.2f}x (target <= 1.1)" if base_peak else ""
        ctx.rows.append(
            (
                f"figure: {T:,} tokens",
                "fig",
                base,
                f"plain {base:.3f} s; per-row statistics {rows / base:.2f}x (target <= 1.3); full set "
                f"{full / base:.2f}x (target <= 1.8){memory}",
            )
        )
        print(ctx.rows[-1][3], flush=True)


def figure_against_eager(ctx: Context, T: int, layers: int) -> str:
    _need_triton()
    import attnprobe
    from attnprobe.probe.engine.stats import KEY_STATS, ROW_STATS

    model = llama8b_stack(ctx.device, layers, ctx.smoke)
    ids = torch.randint(0, 1024, (1, T), device=ctx.device)
    caps = {}
    for engine in ("triton", "torch"):
        with torch.no_grad(), attnprobe.capture(model, keep=("stats",), stats_engine=engine) as cap:
            model(input_ids=ids)
        caps[engine] = cap
    assert all(r.meta.get("stats_engine") == "triton" for r in caps["triton"]), "the kernel did not run"
    worst: dict[str, float] = {}
    atol = 1e-4 if ctx.smoke else 1.6e-2  # bf16's tolerance (probe/checks/tolerances.py)
    for a, b in zip(caps["triton"], caps["torch"]):
        finite = b.stats["finite"]
        for name in ROW_STATS + KEY_STATS:
            x, y = a.stats[name], b.stats[name]
            if name in ROW_STATS:
                x, y = x[finite], y[finite]
            if x.dtype.is_floating_point:
                worst[name] = max(worst.get(name, 0.0), _close(x, y, atol))
            else:
                assert torch.equal(x, y), name
    top = sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    return f"{T:,} tokens: every statistic within {atol:.0e} of the eager engine's; largest " + ", ".join(
        f"{n} {d:.1e}" for n, d in top
    )


def figure_weights(ctx: Context, T: int, rounds: int) -> str:
    import attnprobe

    model = llama8b_stack(ctx.device, 1, ctx.smoke)
    eager = llama8b_stack(ctx.device, 1, ctx.smoke)
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    ids = torch.randint(0, 1024, (1, T), device=ctx.device)

    def captured():
        with torch.no_grad(), attnprobe.capture(model, keep=("weights",), device=ctx.device):
            model(input_ids=ids)

    def output_attentions():
        with torch.no_grad():
            eager(input_ids=ids, output_attentions=True)

    ours, ours_peak = _timed(captured, ctx.device, rounds)
    theirs, theirs_peak = _timed(output_attentions, ctx.device, rounds)
    memory = f", peak memory {ours_peak / max(theirs_peak, 1):.2f}x" if theirs_peak else ""
    return f"{T:,} tokens: weights-only capture {ours:.3f} s = {ours / theirs:.2f}x eager + output_attentions{memory}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton's interpreter")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke (CPU, tiny sizes) or on a GPU", file=sys.stderr)
        return 2
    ctx = Context(torch.device("cpu" if args.smoke else "cuda"), args.smoke)
    # smoke: one short length, one layer, one round (the interpreter runs each kernel program in numpy)
    tokens = args.tokens or ([32] if args.smoke else [8192, 32768, 131072])
    layers, rounds = (1, 1) if args.smoke else (args.layers, args.rounds)
    if args.smoke:
        warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy's notes on -inf inside the interpreter
    for name, fn in (
        ("bf16 capture", check_dtype(torch.bfloat16)),
        ("fp16 capture", check_dtype(torch.float16)),
        ("records on the device / on the cpu", check_devices),
        ("generation, static cache", check_static_cache),
        ("accelerate, cuda:0 + cpu", check_accelerate),
        ("torch.compile", check_compile),
        ("monitor, training step", check_monitor),
        ("sdpa kernels with their lse", check_kernel_lse),
        ("Triton kernel vs eager engine", check_triton),
    ):
        ctx.run(name, fn)
    ctx.run("figure: statistics vs eager engine", lambda c: figure_against_eager(c, tokens[0], layers))
    ctx.run("figures: statistics by length", lambda c: figures_long(c, tokens, layers, rounds) or "one row per length")
    ctx.run("figure: weights-only", lambda c: figure_weights(c, 64 if c.smoke else 4096, rounds))
    print(f"\n{'check':<40} {'status':<6} {'seconds':>8}  detail")
    for name, status, seconds, detail in ctx.rows:
        print(f"{name:<40} {status:<6} {seconds:>8.2f}  {detail}")
    device = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu (smoke)"
    print(f"device: {device}; torch {torch.__version__}")
    return 1 if any(status == "FAIL" for _, status, _, _ in ctx.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
