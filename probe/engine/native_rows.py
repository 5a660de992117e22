"""The native row pass: the statistics engine's per-element work on CPUs in one C loop per row.

The eager engine (``probe/engine/stats.py``) takes each block of logits through a dozen of torch's ops (the max and
its key, ``exp2``, the sums, the smallest weight, the entropy's sum, the first and last key above the threshold),
each a full pass over the block. ``native_rows.c`` does them in one call, row by row while the row is in the cache,
with an ``exp2`` the compiler vectorises inline, and the output's scale and the per-key sums with them; torch still
does the products ``q @ k`` and ``e @ v``. Blocks whose rows have the model kernel's lse and no mask but an interval
of keys per row (causal, a sliding window, packed documents) and padding take ``fused`` instead: the products too, in
tiles of keys that stay in the cache, so that no block of logits or weights is written to memory; ``intervals`` reads
a boolean mask's rows in that form (``benchmarks/bench_long.py``; docs/long-context.md has the figures).

It is compiled on first use with the C compiler on the path (``$CC``, else ``cc``/``gcc``), into the user's cache
(``$XDG_CACHE_HOME/attnprobe/native``, else ``~/.cache/attnprobe/native``), keyed by the source, the flags, the
compiler and the CPU, and checked against torch's ops on a small block before it is used. Each load marks its library
as used (its modification time); building a new one removes the libraries no process has loaded for ``_STALE_DAYS``
(an upgrade's new source, a compiler's new version, a home folder shared by machines with other CPUs). A compiler
that refuses ``-fopenmp`` (Apple's clang) or ``-march=native`` builds it without (``_FALLBACKS``): without OpenMP its
passes run on one thread (``threaded()``). Where it cannot be built or the check fails, ``capture(stats_engine="auto")``
uses the eager engine alone (the same statistics, more time) and ``stats_engine="native"`` refuses in one line saying
why. Rows holding a NaN or +inf logit go through torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

_SOURCE = Path(__file__).with_name("native_rows.c")
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
#: where a compiler refuses the build before, the next build's changes to ``_FLAGS``' entries (None: left out): OpenMP's
#: loop pragmas without its runtime (Apple's clang has no ``-fopenmp``: the passes run on one thread), then
#: ``-mcpu=native`` (AArch64 compilers that refuse ``-march=native``), then no tuning for this CPU
_FALLBACKS: tuple[dict[str, str | None], ...] = (
    {"-fopenmp": "-fopenmp-simd"},
    {"-fopenmp": "-fopenmp-simd", "-march=native": "-mcpu=native"},
    {"-fopenmp": "-fopenmp-simd", "-march=native": None},
)
#: a library in the cache that no process has loaded for this many days goes when another is built
_STALE_DAYS = 30
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


def _builds() -> list[tuple[str, ...]]:
    """The flags of each build tried, in order: ``_FLAGS``, then ``_FALLBACKS`` applied to them (each once)."""
    builds: list[tuple[str, ...]] = [_FLAGS]
    for change in _FALLBACKS:
        flags = tuple(f for f in (change.get(f, f) for f in _FLAGS) if f is not None)
        if flags not in builds:
            builds.append(flags)
    return builds


def _compile(cc: str, out: Path) -> None:
    """``native_rows.c`` into ``out`` with the first of ``_builds()`` the compiler takes, atomically: processes
    building at once each put a whole library. Where none builds, the first build's error is named."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        for flags in _builds():
            done = subprocess.run([cc, *flags, str(_SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(built, out)
                return
            errors.append((done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1])
    also = f" (and {len(errors) - 1} builds without OpenMP or -march=native)" if len(errors) > 1 else ""
    raise NativeUnavailable(f"{cc} could not build {_SOURCE.name}: {errors[0]}{also}")


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    tried = " | ".join(" ".join(flags) for flags in _builds())
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), tried, version, _cpu_signature()]).encode())
    return _cache_dir() / f"native_rows-{key.hexdigest()[:20]}.so"


def _mark_used(path: Path) -> bool:
    """Whether the library at ``path`` exists; where it does, it is marked as loaded now (``_prune`` reads the mark).
    A cache this process may not write is read as it is."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except OSError:
        return path.exists()
    return True


def _prune(keep: Path) -> None:
    """Removes the libraries beside ``keep`` that no process has loaded for ``_STALE_DAYS`` (one a process is
    about to load was marked just before: ``_mark_used``)."""
    stale = time.time() - _STALE_DAYS * 86400
    for old in keep.parent.glob("native_rows-*.so"):
        try:
            if old != keep and old.stat().st_mtime < stale:
                old.unlink()
        except OSError:  # gone already (another process pruned it), or not ours to remove
            continue


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or why there is none (the reason is kept: one attempt per process)."""
    try:
        cc = _compiler()
        path = _library_path(cc)
        if not _mark_used(path):
            _compile(cc, path)
            _prune(path)
        lib = ctypes.CDLL(str(path))
        lib.attnprobe_row_pass.restype = _LONG
        lib.attnprobe_row_pass.argtypes = _ARGTYPES
        lib.attnprobe_fused.restype = _LONG
        lib.attnprobe_fused.argtypes = [ctypes.POINTER(_FusedArgs)]
        lib.attnprobe_intervals.restype = _LONG
        lib.attnprobe_intervals.argtypes = [_P, *([_LONG] * 5), *([_P] * 4), ctypes.c_int]
        lib.attnprobe_openmp.restype = ctypes.c_int
        lib.attnprobe_openmp.argtypes = []
        _self_check(lib)
    except (NativeUnavailable, OSError) as err:
        return str(err)
    return lib


def available() -> bool:
    """Whether the native row pass is built and agrees with torch's ops here."""
    return not isinstance(_library(), str)


def threaded() -> bool:
    """Whether the library was built with OpenMP, so that its passes take torch's thread count (False: one thread,
    where the compiler has no OpenMP runtime, e.g. Apple's clang; False where it is not built)."""
    lib = _library()
    return not isinstance(lib, str) and bool(lib.attnprobe_openmp())


def _threads(lib: ctypes.CDLL) -> int:
    return torch.get_num_threads() if lib.attnprobe_openmp() else 1


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
    the caller may use was written), without the library, or for rows of 2^31 keys or more."""
    lib = _library()
    *heads_shape, n, K = s.shape
    if isinstance(lib, str) or K >= 2**31 - 1:  # (the C loop counts a row's keys in 32 bits)
        return None
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
        _threads(lib),
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
    """The library against torch's ops on a small block with forbidden keys and a given shift, and its refusal of a
    row with a NaN or +inf logit."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 300, generator=g) * 4  # (head, query, key)
    s[..., 250:] = -torch.inf
    shift = torch.logsumexp(s * 0.6931471805599453, -1) * 1.4426950408889634  # (head, query), base 2
    e = torch.empty_like(s)
    f32 = [torch.zeros(3, 5) for _ in range(5)]  # max, sum, min, dot, scale
    i64 = [torch.zeros(3, 5, dtype=torch.int64) for _ in range(4)]  # arg, finite, first, last
    vmax, rw, col = torch.rand(3, 300, generator=g), torch.rand(3, 5, generator=g), torch.zeros(3, 300)

    def run(s: torch.Tensor) -> int:
        return lib.attnprobe_row_pass(
            *(s.data_ptr(), e.data_ptr(), 15, 300, 5, shift.data_ptr(), 1e-3, 1, vmax.data_ptr(), 300),
            *(rw.data_ptr(), col.data_ptr(), 300),
            *(t.data_ptr() for t in (f32[0], i64[0], f32[1], f32[2], f32[3], f32[4], i64[1], i64[2], i64[3])),
            1,
        )

    odd = []
    for bad in (math.nan, math.inf):
        hit = s.clone()
        hit[1, 2, 7] = bad
        odd.append(run(hit))
    col.zero_()
    refused = odd == [1, 1] and run(s) == 0  # a row with a NaN or +inf logit is refused (and only it)
    want = torch.exp2(s - shift[..., None])  # (head, query, key)
    dot = torch.where(want > 0, want * (s - shift[..., None]), 0.0).sum(-1)  # (head, query)
    agree = (
        refused
        and torch.allclose(f32[3], dot, rtol=1e-4, atol=1e-5)
        and torch.allclose(e, want, rtol=1e-5, atol=1e-7)
        and torch.equal(f32[0], s.amax(-1))
        and torch.equal(i64[0], s.argmax(-1))
        and torch.allclose(f32[1], want.sum(-1), rtol=1e-5)
        and torch.allclose(f32[4], (want * vmax[:, None]).sum(-1), rtol=1e-5)
        and torch.allclose(col, (want / want.sum(-1, keepdim=True) * rw[..., None]).sum(-2), rtol=1e-5, atol=1e-7)
        and bool((i64[1] == 250).all())
    )
    if not agree or not _fused_agrees(lib) or not _intervals_agree(lib):
        raise NativeUnavailable("the compiled row pass disagreed with torch's ops on its check (a miscompile)")


def _intervals_agree(lib: ctypes.CDLL) -> bool:
    """The mask scan against torch's ops: two items of 70 causal rows over 5,000 keys (chunks of keys and their tail)
    in a window of 300, the second item's first 20 keys padding, 5 more cut from every row and one row empty; then a
    hole in one row."""
    key, own = torch.arange(5000), torch.arange(4930, 5000)[:, None]  # (key,), (query, 1)
    allowed = ((key <= own) & (key > own - 300)).expand(2, 70, 5000).clone()  # (item, query, key)
    allowed[1, :, :20], allowed[1, :, 4900:4905], allowed[1, 3] = False, False, False  # padding, a gap, an empty row
    got = _intervals(lib, allowed)
    some = allowed.any(-1)  # (item, query)
    start = torch.where(some, allowed.to(torch.uint8).argmax(-1), 5000)
    agree = (
        got.fits
        and torch.equal(got.start, start)
        and torch.equal(got.limit, torch.where(some, own.view(1, 70) + 1, 5000))
        and torch.equal(got.counts, allowed.sum(-1))
        and torch.equal(got.keep, allowed.any(1))
    )
    allowed[0, 5, 4800] = False
    return agree and not _intervals(lib, allowed).fits


def _fused_agrees(lib: ctypes.CDLL) -> bool:
    """The fused pass against torch's ops: 2 heads of 6 causal rows over 150 keys (vectors and their tails), in a
    window of 40 keys (the tiles below it left out) with 5 keys of the second head's item padding."""
    g = torch.Generator().manual_seed(1)
    G, n, D, K, Dv = 2, 6, 20, 150, 40
    q, k, v = torch.randn(G, n, D, generator=g), torch.randn(G, K, D, generator=g), torch.randn(G, K, Dv, generator=g)
    limit = torch.arange(n) + K - n + 1  # (query,): causal, the last rows
    keep = torch.ones(G, K, dtype=torch.bool)  # (item, key): one head per item
    keep[1, 120:125] = False
    key = torch.arange(K)
    allowed = (key >= limit[:, None] - 40) & (key < limit[:, None]) & keep[:, None, :]  # (head, query, key)
    s = (q @ k.transpose(1, 2)).masked_fill(~allowed, -torch.inf)  # (head, query, key)
    shift = torch.logsumexp(s * 0.6931471805599453, -1) * 1.4426950408889634  # (head, query) base 2
    # (item, head, key, d): the keys and values strided as a (key, head, d) projection's are
    strided_k = torch.stack([k, k], 2).view(G, 1, K, 2, D)[..., 0, :]
    strided_v = torch.stack([v, v], 2).view(G, 1, K, 2, Dv)[..., 0, :]
    keys = FusedKeys.of(strided_k, v=strided_v, first_key=torch.zeros(G).long())
    want = torch.exp2(s - shift[..., None])  # (head, query, key)
    output = want @ v / want.sum(-1, keepdim=True)  # (head, query, d_v)
    output[1, 3, 7] += 0.5  # one row's output off by 0.5
    got = _run_fused(
        *(lib, (q / 2).view(G, 1, n, D), keys, shift), q_scale=2.0, start=limit - 40, limit=limit, keep=keep,
        diag=None, row_weight=torch.ones(G, n), K=K, threshold=1e-3, poison=True,
        output=torch.stack([output, output], 2).view(G, 1, n, 2, Dv)[..., 0, :],
    )  # fmt: skip
    if got is None:
        return False
    rows, err = got
    off = torch.zeros(G, n)
    off[1, 3] = 0.5
    return (
        err is not None
        and torch.allclose(err, off, atol=1e-5)
        and torch.allclose(rows.sum, want.sum(-1), rtol=1e-5)
        and torch.equal(rows.arg, s.argmax(-1))
        and rows.col is not None
        and torch.allclose(rows.col, (want / want.sum(-1, keepdim=True)).sum(1), rtol=1e-5, atol=1e-6)
    )


class _FusedArgs(ctypes.Structure):
    """``struct fused_args`` of ``native_rows.c``."""

    _fields_ = [
        *((name, _P) for name in ("q", "k", "v")),
        *((name, _LONG) for name in ("q_sb", "q_sh", "q_st", "k_sb", "k_sh", "k_st", "v_sb", "v_sh", "v_st", "h")),
        ("kv_group", _LONG),
        ("q_scale", ctypes.c_float),
        *((name, _P) for name in ("shift", "start", "limit", "keep")),
        *((name, _LONG) for name in ("H", "keep_stride", "row_stride")),
        *((name, _P) for name in ("diag", "firstkey", "rw")),
        *((name, _LONG) for name in ("G", "n", "D", "Dv", "Tk", "K")),
        ("thr", ctypes.c_float),
        *((name, _P) for name in ("max", "sum", "min", "dot", "scale")),
        *((name, _P) for name in ("arg", "finite", "first", "last", "o")),
        *((name, _LONG) for name in ("o_sb", "o_sh", "o_st")),
        *((name, _P) for name in ("err", "col", "work")),
        ("work_floats", _LONG),
        ("threads", ctypes.c_int),
        *((name, _P) for name in ("final_f", "final_i", "final_b", "count")),
        ("fit", ctypes.c_float),
    ]


#: The rows' statistics the fused pass writes with ``final=`` (``FinalStats``), in the order of native_rows.c's enums
#: (float32, int64, bool).
FINAL_FLOATS = (
    "entropy", "max_weight", "min_weight", "first_key_mass", "diagonal_mass", "previous_mass", "masked_mass",
    "masked_max", "row_sum_error", "max_score", "output_error", "output_scale",
)  # fmt: skip
FINAL_LONGS = ("argmax_key", "first_key", "last_key", "allowed_keys", "first_allowed", "last_allowed")
FINAL_BOOLS = ("finite", "diagonal_allowed")


class FinalStats(NamedTuple):
    """Where the fused pass writes each row's statistics as the statistics engine gives them (``fused(...,
    final=)``): ``floats`` ``(FINAL_FLOATS, heads, n)``, ``longs`` ``(FINAL_LONGS, heads, n)``, ``bools``
    ``(FINAL_BOOLS, heads, n)``."""

    floats: torch.Tensor
    longs: torch.Tensor
    bools: torch.Tensor

    @classmethod
    def empty(cls, heads: int, n: int) -> FinalStats:
        return cls(
            torch.empty(len(FINAL_FLOATS), heads, n),
            torch.empty(len(FINAL_LONGS), heads, n, dtype=torch.int64),
            torch.empty(len(FINAL_BOOLS), heads, n, dtype=torch.bool),
        )

    def named(self, *shape: int) -> dict[str, torch.Tensor]:
        """Each statistic by name, a view of ``shape`` (the heads and rows, e.g. ``(batch, head, query)``)."""
        named: dict[str, torch.Tensor] = {}
        for names, block in ((FINAL_FLOATS, self.floats), (FINAL_LONGS, self.longs), (FINAL_BOOLS, self.bools)):
            named.update(zip(names, block.view(len(names), *shape).unbind(0), strict=True))
        return named


_PANEL = 64  # keys per panel of the fused pass's keys (``PANEL`` of native_rows.c)


@dataclass
class FusedKeys:
    """What the fused pass reads of a call's keys, made once per call (``of``): ``k`` ``(batch, heads / group, keys,
    d)`` and ``v`` ``(batch, heads / group, keys, d_v)`` (None without an output check), float32 with their last axis
    contiguous (the C loop reads them through their strides, and each thread lays out the keys of the head it takes in
    panels of 64, and takes each key's largest ``|v|``); head ``i`` of q reads head ``i // group`` of them;
    ``first_key`` ``(batch x heads,)`` the first key any row may attend, contiguous."""

    k: torch.Tensor
    v: torch.Tensor | None
    first_key: torch.Tensor
    group: int = 1

    @classmethod
    def of(cls, k: torch.Tensor, *, v: torch.Tensor | None, first_key: torch.Tensor, group: int = 1) -> FusedKeys:
        """From ``k`` and ``v`` as they are (a copy only where not float32 or the last axis is strided)."""
        return cls(k=_rows_of(k), v=None if v is None else _rows_of(v), first_key=first_key, group=group)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(batch, heads, n, d)`` in float32 with ``d`` contiguous (a copy only where needed)."""
    t = t.to(torch.float32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else (t.stride(0), t.stride(1), t.stride(2))


class Intervals(NamedTuple):
    """A boolean mask ``(items, n, d)`` read row by row (``intervals``): ``start`` and ``limit`` ``(items, n)`` each
    row's first allowed key and the key past its last (``d`` and ``d``: a row that allows none), ``counts`` ``(items,
    n)`` how many keys it allows, ``keep`` ``(items, d)`` the keys some row of the item allows, and ``fits``: whether
    every row allows exactly the keys of ``keep`` in ``[start, limit)``."""

    start: torch.Tensor
    limit: torch.Tensor
    counts: torch.Tensor
    keep: torch.Tensor
    fits: bool


def intervals(allowed: torch.Tensor) -> Intervals | None:
    """``allowed`` ``(items, n, d)`` bool (any strides; a copy where the keys are not contiguous) in two passes of one
    C loop per row; None without the library or off the CPU."""
    lib = _library()
    return None if isinstance(lib, str) or allowed.device.type != "cpu" else _intervals(lib, allowed.to(torch.bool))


def _intervals(lib: ctypes.CDLL, allowed: torch.Tensor) -> Intervals:
    if allowed.stride(-1) != 1:
        allowed = allowed.contiguous()
    items, n, d = allowed.shape
    start, limit, count = (torch.empty(items, n, dtype=torch.int64) for _ in range(3))
    keep = torch.empty(items, d, dtype=torch.bool)
    fits = lib.attnprobe_intervals(
        *(allowed.data_ptr(), items, n, d, allowed.stride(0), allowed.stride(1)),
        *(t.data_ptr() for t in (start, limit, count, keep)),
        _threads(lib),
    )  # fmt: skip
    return Intervals(start, limit, count, keep, bool(fits))


def fused(*args, **kwargs) -> tuple[RowPass, torch.Tensor | None] | None:
    """``_run_fused`` with the library (its arguments after ``lib``); None without the library."""
    lib = _library()
    return None if isinstance(lib, str) else _run_fused(lib, *args, **kwargs)


def _work_floats(keys: FusedKeys, K: int, D: int) -> int:
    """The fused pass's work space a thread, in floats (even: each thread's space starts with K doubles): the per-key
    sums in double, E, those of a few rows, q (RB = 4 rows), their sum e * v, the head's panels, each key's largest
    ``|v|``, and the values where their rows are not ``d_v`` apart."""
    Dv = 0 if keys.v is None else keys.v.shape[-1]
    copied = keys.v is not None and keys.v.stride(2) != Dv
    values = 0 if keys.v is None else 4 * Dv + K + (K * Dv if copied else 0)
    floats = 7 * max(K, 1) + 4 * D + -(-max(K, 1) // _PANEL) * _PANEL * D + values
    return floats + floats % 2


def _run_fused(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    keys: FusedKeys,
    shift: torch.Tensor,
    *,
    q_scale: float,
    limit: torch.Tensor | None,
    diag: torch.Tensor | None,
    row_weight: torch.Tensor,
    K: int,
    threshold: float,
    keep: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    final: FinalStats | None = None,
    fit: float = math.inf,
    poison: bool = False,
) -> tuple[RowPass, torch.Tensor | None] | None:
    """``q @ k``, the row pass and ``e @ v`` of rows ``q`` ``(batch, heads, n, d)`` (times ``q_scale``: the scaling and
    log2(e)) over keys ``0:K``, in tiles that stay in the cache; ``shift`` ``(batch x heads, n)`` the kernel's lse (base
    2); ``start`` and ``limit`` ``(n,)`` or ``(batch, n)`` (both the same), the first key each row may attend and the
    first past those (None: 0, K); ``diag`` ``(n,)`` each row's own key (None: none); ``keep`` ``(1 or batch, K)`` bool,
    False at keys no row of the batch item may attend (padding; None: none). ``final``: also every row's statistics as
    the engine gives them (``FinalStats``: the masses at the row's own key, the one before it and the first key among
    them), the keys each row may attend counted from ``start`` and ``limit`` (and ``keep``: ``counts``, as ``start``,
    how many it allows); None is returned then where some row's ``sum e`` is off 1 by more than ``fit`` (the lse is not
    these logits'). ``output`` ``(batch, heads, n, d_v)``: what the call returned for the rows (required with
    ``keys.v``). Returns the row sums (the threshold times each row's sum; per-key sums of ``e / sum e`` times
    ``row_weight``) and the output check, ``(batch x heads, n)`` the largest difference of each row's ``sum e * v / sum
    e`` from ``output`` (None without ``keys.v``; no ``(n, d_v)`` block of its own is written); None where a row holds a
    NaN or +inf logit. ``poison``: the C loop's scratch memory starts as NaN (the self-check: nothing unwritten is
    read)."""
    q = _rows_of(q)
    B, h, n, D = q.shape
    G, Tk, Dv = B * h, keys.k.shape[2], 0 if keys.v is None else keys.v.shape[-1]
    if K >= 2**31 - 1:
        raise ValueError(f"the fused pass takes fewer than 2^31 keys a row, not {K}")
    if keys.k.shape[1] * keys.group != h:
        raise ValueError(f"{h} heads of q read {keys.k.shape[1]} heads of k in groups of {keys.group}: not one each")
    f32 = torch.empty(5, G, n).unbind(0)  # max, sum, min, dot, scale
    i64 = torch.empty(4, G, n, dtype=torch.int64).unbind(0)  # arg, finite, first, last
    if keys.v is not None and output is None:
        raise ValueError("the fused pass checks the output against the call's: pass output= with keys.v")
    obs = None if keys.v is None or output is None else _rows_of(output)  # (batch, heads, n, d_v)
    err = None if obs is None else torch.empty(G, n)  # (batch x heads, n)
    col = torch.zeros(G, K)  # (batch x heads, key)
    threads = min(_threads(lib), G)  # a thread takes whole heads: scratch for no more threads than heads
    per_thread = _work_floats(keys, K, D)
    work = torch.full((threads * per_thread,), math.nan) if poison else torch.empty(threads * per_thread)
    rw = row_weight.to(torch.float32).contiguous()
    keep8 = None if keep is None else keep.to(torch.uint8).contiguous()  # (1 or batch, K)
    # (1 or batch, n) each
    start, limit, counts = (None if t is None else t.to(torch.int64).contiguous() for t in (start, limit, counts))
    per_item = any(t is not None and t.numel() > n for t in (start, limit, counts))  # else one set for every item
    items = max([1] + [t.numel() // m for t, m in ((keep8, K), (start, n), (limit, n)) if t is not None])
    assert G % items == 0, (G, items)
    args = _FusedArgs(
        *(_ptr(t) for t in (q, keys.k, keys.v)),
        *_strides(q), *_strides(keys.k), *_strides(keys.v), h, keys.group, q_scale,
        *(_ptr(t) for t in (shift, start, limit, keep8)),
        G // items, 0 if keep8 is None or keep8.shape[0] == 1 else K, n if per_item else 0,
        *(_ptr(t) for t in (diag, keys.first_key, rw)),
        G, n, D, Dv, Tk, K, threshold,
        *(t.data_ptr() for t in f32),
        *(t.data_ptr() for t in i64), _ptr(obs), *_strides(obs), _ptr(err), col.data_ptr(), work.data_ptr(),
        per_thread, threads, *(_ptr(t) for t in (final or (None, None, None))), _ptr(counts), fit,
    )  # fmt: skip
    if lib.attnprobe_fused(ctypes.byref(args)):
        return None
    got = RowPass(
        max=f32[0], arg=i64[0], sum=f32[1], min=f32[2], dot=f32[3], scale=f32[4], finite=i64[1], first=i64[2],
        last=i64[3], col=col,
    )  # fmt: skip
    return got, err
