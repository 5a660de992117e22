"""The native row pass: the statistics engine's per-element work on CPUs in one C loop per row.

The eager engine (``probe/engine/stats.py``) takes each block of logits through a dozen of torch's ops (the max and
its key, ``exp2``, the sums, the smallest weight, the entropy's sum, the first and last key above the threshold),
each a full pass over the block. ``native_rows.c`` does them in one call, row by row while the row is in the cache,
with an ``exp2`` the compiler vectorises inline, and the output's scale and the per-key sums with them; torch still
does the products ``q @ k`` and ``e @ v``. Blocks whose rows have the model kernel's lse and no mask but a causal limit
per row and padding take ``fused`` instead: the products too, in tiles of keys that stay in the cache, so that no
block of logits or weights is written to memory (``benchmarks/bench_long.py``; docs/long-context.md has the figures).

It is compiled on first use with the C compiler on the path (``$CC``, else ``cc``/``gcc``), into the user's cache
(``$XDG_CACHE_HOME/attnprobe/native``, else ``~/.cache/attnprobe/native``), keyed by the source, the flags, the
compiler and the CPU, and checked against torch's ops on a small block before it is used. Where it cannot be built
or the check fails, ``capture(stats_engine="auto")`` uses the eager engine alone (the same statistics, more time) and
``stats_engine="native"`` refuses in one line saying why. Rows holding a NaN or +inf logit go through torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("native_rows.c")
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
_P, _LONG = ctypes.c_void_p, ctypes.c_long
#: s, e, R, K, n, shift, thr, whole, vmax, vstride, rw, col, cstride, the nine outputs, threads
_ARGTYPES: list = [_P, _P, _LONG, _LONG, _LONG, _P, ctypes.c_float, ctypes.c_int, _P, _LONG, _P, _P, _LONG]
_ARGTYPES += [*([_P] * 9), ctypes.c_int]


@dataclass
class RowPass:
    """What ``row_pass`` found for each row, ``(...)`` each: base-2 max and its key, ``sum e``, ``min e``, the
    entropy's base-2 ``sum e * (s - shift)``, ``sum e * vmax``, the keys above ``-inf``, the first and last key above
    the threshold; and ``col`` ``(heads, K)``, the per-key sums of the weighted rows (None without row weights)."""

    max: torch.Tensor
    arg: torch.Tensor
    sum: torch.Tensor
    min: torch.Tensor
    dot: torch.Tensor
    scale: torch.Tensor
    finite: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    col: torch.Tensor | None


class NativeUnavailable(RuntimeError):
    """The native row pass cannot be built or did not agree with torch's ops here; the message says why."""


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "attnprobe" / "native"


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags (a cache shared by two machines keeps both)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    raise NativeUnavailable("no C compiler on the path (set CC, or install gcc)")


def _compile(cc: str, out: Path) -> None:
    """``native_rows.c`` into ``out``, atomically: processes building at once each put a whole library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        done = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise NativeUnavailable(f"{cc} could not build {_SOURCE.name}: {last[0]}")
        os.replace(built, out)


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_signature()]).encode())
    return _cache_dir() / f"native_rows-{key.hexdigest()[:20]}.so"


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or why there is none (the reason is kept: one attempt per process)."""
    try:
        cc = _compiler()
        path = _library_path(cc)
        if not path.exists():
            _compile(cc, path)
        lib = ctypes.CDLL(str(path))
        lib.attnprobe_row_pass.restype = _LONG
        lib.attnprobe_row_pass.argtypes = _ARGTYPES
        lib.attnprobe_fused.restype = _LONG
        lib.attnprobe_fused.argtypes = [ctypes.POINTER(_FusedArgs)]
        _self_check(lib)
    except (NativeUnavailable, OSError) as err:
        return str(err)
    return lib


def available() -> bool:
    """Whether the native row pass is built and agrees with torch's ops here."""
    return not isinstance(_library(), str)


def why_unavailable() -> str | None:
    got = _library()
    return got if isinstance(got, str) else None


def row_pass(
    s: torch.Tensor,
    e: torch.Tensor,
    shift: torch.Tensor | None,
    threshold: float,
    *,
    whole: bool,
    vmax: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
) -> RowPass | None:
    """One call over ``s`` ``(heads..., n, K)`` float32 contiguous on the CPU (base-2 logits, ``-inf`` where
    forbidden): writes ``e = exp2(s - shift)`` into ``e`` (same shape) and returns the rows' sums; ``shift``
    ``(heads..., n)`` or None (each row's max). ``whole``: the rows' keys are all here, so a key is a hit where
    ``e > threshold * sum e`` and the per-key sums take ``e / sum e`` (else ``e > threshold`` and ``e``). ``vmax``
    ``(heads..., K)``: each key's largest ``|v|`` (a view with unit stride along keys). ``row_weight`` ``(heads...,
    n)``: what each row's weights count for in the per-key sums. None where a row holds a NaN or +inf logit (nothing
    the caller may use was written), or without the library."""
    lib = _library()
    if isinstance(lib, str):
        return None
    *heads_shape, n, K = s.shape
    rows_shape, R = s.shape[:-1], s.numel() // max(K, 1)
    f32 = [torch.empty(rows_shape, dtype=torch.float32) for _ in range(5)]  # max, sum, min, dot, scale
    i64 = [torch.empty(rows_shape, dtype=torch.int64) for _ in range(4)]  # arg, finite, first, last
    shift = None if shift is None else shift.to(torch.float32).contiguous()  # alive through the call
    rw = None if row_weight is None else row_weight.to(torch.float32).expand(rows_shape).contiguous()
    col = None if rw is None else torch.zeros((*heads_shape, K), dtype=torch.float32)  # (heads..., K)
    vstride = 0
    if vmax is not None:
        vmax = vmax.expand((*heads_shape, vmax.shape[-1]))
        assert vmax.stride(-1) == 1 and vmax.shape[-1] == K
        vstride = vmax.stride(-2) if vmax.dim() > 1 else 0
    odd = lib.attnprobe_row_pass(
        *(s.data_ptr(), e.data_ptr(), R, K, max(n, 1), _ptr(shift), threshold, int(whole), _ptr(vmax), vstride),
        *(_ptr(rw), _ptr(col), K),
        *(t.data_ptr() for t in (f32[0], i64[0], f32[1], f32[2], f32[3], f32[4], i64[1], i64[2], i64[3])),
        torch.get_num_threads(),
    )
    if odd:
        return None
    return RowPass(
        max=f32[0],
        arg=i64[0],
        sum=f32[1],
        min=f32[2],
        dot=f32[3],
        scale=f32[4],
        finite=i64[1],
        first=i64[2],
        last=i64[3],
        col=col,
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def usable(s: torch.Tensor, e: torch.Tensor) -> bool:
    """Whether ``row_pass`` takes these buffers: float32, contiguous, on the CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in (s, e))


def _self_check(lib: ctypes.CDLL) -> None:
    """The library against torch's ops on a small block with forbidden keys and a given shift."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 300, generator=g) * 4  # (head, query, key)
    s[..., 250:] = -torch.inf
    shift = torch.logsumexp(s * 0.6931471805599453, -1) * 1.4426950408889634  # (head, query), base 2
    e = torch.empty_like(s)
    f32 = [torch.zeros(3, 5) for _ in range(5)]  # max, sum, min, dot, scale
    i64 = [torch.zeros(3, 5, dtype=torch.int64) for _ in range(4)]  # arg, finite, first, last
    vmax, rw, col = torch.rand(3, 300, generator=g), torch.rand(3, 5, generator=g), torch.zeros(3, 300)
    lib.attnprobe_row_pass(
        *(s.data_ptr(), e.data_ptr(), 15, 300, 5, shift.data_ptr(), 1e-3, 1, vmax.data_ptr(), 300),
        *(rw.data_ptr(), col.data_ptr(), 300),
        *(t.data_ptr() for t in (f32[0], i64[0], f32[1], f32[2], f32[3], f32[4], i64[1], i64[2], i64[3])),
        1,
    )
    want = torch.exp2(s - shift[..., None])  # (head, query, key)
    agree = (
        torch.allclose(e, want, rtol=1e-5, atol=1e-7)
        and torch.equal(f32[0], s.amax(-1))
        and torch.equal(i64[0], s.argmax(-1))
        and torch.allclose(f32[1], want.sum(-1), rtol=1e-5)
        and torch.allclose(f32[4], (want * vmax[:, None]).sum(-1), rtol=1e-5)
        and torch.allclose(col, (want / want.sum(-1, keepdim=True) * rw[..., None]).sum(-2), rtol=1e-5, atol=1e-7)
        and bool((i64[1] == 250).all())
    )
    if not agree or not _fused_agrees(lib):
        raise NativeUnavailable("the compiled row pass disagreed with torch's ops on its check (a miscompile)")


def _fused_agrees(lib: ctypes.CDLL) -> bool:
    """The fused pass against torch's ops: 2 heads of 6 causal rows over 150 keys (vectors and their tails)."""
    g = torch.Generator().manual_seed(1)
    G, n, D, K, Dv = 2, 6, 20, 150, 40
    q, k, v = torch.randn(G, n, D, generator=g), torch.randn(G, K, D, generator=g), torch.randn(G, K, Dv, generator=g)
    limit = torch.arange(n) + K - n + 1  # (query,): causal, the last rows
    s = (q @ k.transpose(1, 2)).masked_fill(torch.arange(K) >= limit[:, None], -torch.inf)  # (head, query, key)
    shift = torch.logsumexp(s * 0.6931471805599453, -1) * 1.4426950408889634  # (head, query) base 2
    keys = FusedKeys.of(k, v=v, vmax=v.abs().amax(-1), first_key=torch.zeros(G).long())
    gathered = (torch.zeros(G, n), torch.zeros(G, n), torch.zeros(G, n))
    got = _run_fused(
        lib, q, keys, shift, limit=limit, diag=None, row_weight=torch.ones(G, n), K=K, threshold=1e-3, gathered=gathered
    )
    if got is None:
        return False
    rows, out = got
    want = torch.exp2(s - shift[..., None])  # (head, query, key)
    return (
        out is not None
        and torch.allclose(out, want @ v, rtol=1e-4, atol=1e-5)
        and torch.allclose(rows.sum, want.sum(-1), rtol=1e-5)
        and torch.equal(rows.arg, s.argmax(-1))
        and rows.col is not None
        and torch.allclose(rows.col, (want / want.sum(-1, keepdim=True)).sum(1), rtol=1e-5, atol=1e-6)
    )


class _FusedArgs(ctypes.Structure):
    """``struct fused_args`` of ``native_rows.c``."""

    _fields_ = [
        *((name, _P) for name in ("q", "kP", "v", "vmax", "shift", "limit", "keep")),
        *((name, _LONG) for name in ("H", "keep_stride")),
        *((name, _P) for name in ("diag", "firstkey", "rw")),
        *((name, _LONG) for name in ("G", "n", "D", "Dv", "Tk", "K")),
        ("thr", ctypes.c_float),
        *((name, _P) for name in ("max", "sum", "min", "dot", "scale", "diag_e", "prev_e", "first_e")),
        *((name, _P) for name in ("arg", "finite", "first", "last", "out", "col", "work")),
        ("threads", ctypes.c_int),
    ]


_PANEL = 64  # keys per panel of the fused pass's keys (``PANEL`` of native_rows.c)


@dataclass
class FusedKeys:
    """What the fused pass reads of a call's keys, made once per call (``of``): ``panels`` ``(heads, panels, d, 64)``
    the keys in panels of 64, each transposed (zeros past the last key), ``keys`` how many there are, ``v``
    ``(heads, keys, d_v)`` and ``vmax`` ``(heads, keys)`` (None without an output check), and ``first_key``
    ``(heads,)`` the first key any row may attend; float32, contiguous."""

    panels: torch.Tensor
    keys: int
    v: torch.Tensor | None
    vmax: torch.Tensor | None
    first_key: torch.Tensor

    @classmethod
    def of(
        cls, k: torch.Tensor, *, v: torch.Tensor | None, vmax: torch.Tensor | None, first_key: torch.Tensor
    ) -> FusedKeys:
        """From ``k`` ``(heads, keys, d)``."""
        G, Tk, D = k.shape
        P = -(-Tk // _PANEL)
        padded = torch.nn.functional.pad(k.to(torch.float32), (0, 0, 0, P * _PANEL - Tk))  # (heads, P * 64, d)
        panels = padded.view(G, P, _PANEL, D).transpose(-1, -2).contiguous()  # (heads, P, d, 64)
        return cls(panels=panels, keys=Tk, v=v, vmax=vmax, first_key=first_key)


def fused(*args, **kwargs) -> tuple[RowPass, torch.Tensor | None] | None:
    """``_run_fused`` with the library (its arguments after ``lib``); None without the library."""
    lib = _library()
    return None if isinstance(lib, str) else _run_fused(lib, *args, **kwargs)


def _run_fused(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    keys: FusedKeys,
    shift: torch.Tensor,
    *,
    limit: torch.Tensor | None,
    diag: torch.Tensor | None,
    row_weight: torch.Tensor,
    K: int,
    threshold: float,
    gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    keep: torch.Tensor | None = None,
) -> tuple[RowPass, torch.Tensor | None] | None:
    """``q @ k``, the row pass and ``e @ v`` of rows ``q`` ``(heads, n, d)`` (times the scaling and log2(e)) over
    keys ``0:K``, in tiles that stay in the cache; ``shift`` ``(heads, n)`` the kernel's lse (base 2); ``limit``
    ``(n,)`` the first key each row may not attend (None: none); ``diag`` ``(n,)`` each row's own key (None: none);
    ``keep`` ``(1 or batch, K)`` bool, False at keys no row of the batch item may attend (padding; None: none), the
    heads of ``q`` being ``batch x heads``.
    Writes ``e`` at the row's own key, the one before it and the first key into ``gathered`` (``(heads, n)`` each,
    where those keys lie below ``K``). Returns the row sums (the threshold times each row's sum; per-key sums of
    ``e / sum e`` times ``row_weight``) and ``sum e * v`` ``(heads, n, d_v)``; None where a row holds a NaN or +inf
    logit."""
    G, n, D = q.shape
    f32 = [torch.empty(G, n) for _ in range(5)]  # max, sum, min, dot, scale
    i64 = [torch.empty(G, n, dtype=torch.int64) for _ in range(4)]  # arg, finite, first, last
    out = None if keys.v is None else torch.empty(G, n, keys.v.shape[-1])  # (heads, n, d_v)
    col = torch.zeros(G, K)  # (heads, key)
    threads = torch.get_num_threads()
    work = torch.empty(threads * 4 * max(K, 1))  # RB rows of weights per thread
    rw = row_weight.to(torch.float32).contiguous()
    keep8 = None if keep is None else keep.to(torch.uint8).contiguous()  # (1 or batch, K)
    H = G if keep8 is None else G // keep8.shape[0]  # heads per batch item (all of them: one row for every item)
    args = _FusedArgs(
        *(_ptr(t) for t in (q, keys.panels, keys.v, keys.vmax, shift, limit, keep8)), H, K,
        *(_ptr(t) for t in (diag, keys.first_key, rw)),
        G, n, D, 0 if keys.v is None else keys.v.shape[-1], keys.keys, K, threshold,
        *(t.data_ptr() for t in (f32[0], f32[1], f32[2], f32[3], f32[4], *gathered)),
        *(t.data_ptr() for t in i64), _ptr(out), col.data_ptr(), work.data_ptr(), threads,
    )  # fmt: skip
    if lib.attnprobe_fused(ctypes.byref(args)):
        return None
    got = RowPass(
        max=f32[0], arg=i64[0], sum=f32[1], min=f32[2], dot=f32[3], scale=f32[4], finite=i64[1], first=i64[2],
        last=i64[3], col=col,
    )  # fmt: skip
    return got, out
