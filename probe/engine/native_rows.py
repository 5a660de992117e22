"""The native row pass: the statistics engine's per-element work on CPUs in one C loop per row.

The eager engine (``probe/engine/stats.py``) takes each block of logits through a dozen of torch's ops (the max and
its key, ``exp2``, the sums, the smallest weight, the entropy's sum, the first and last key above the threshold),
each a full pass over the block. ``native_rows.c`` does them in one call, row by row while the row is in the cache,
with glibc's vectorised ``exp2f`` where it links; torch still does the products (``q @ k``, ``e @ v``, the per-key
sums). On a 2-core CPU that makes the statistics of a tiny Llama at 4k tokens about twice as fast
(``benchmarks/bench_long.py``; docs/long-context.md has the figures).

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
#: s, e, R, K, shift, thr, relative, the eight outputs, threads
_ARGTYPES: list = [_P, _P, _LONG, _LONG, _P, ctypes.c_float, ctypes.c_int, *([_P] * 8), ctypes.c_int]


@dataclass
class RowPass:
    """What ``row_pass`` found for each row, ``(...)`` each: base-2 max and its key, ``sum e``, ``min e``, the
    entropy's base-2 ``sum e * (s - shift)``, the keys above ``-inf``, the first and last key above the threshold."""

    max: torch.Tensor
    arg: torch.Tensor
    sum: torch.Tensor
    min: torch.Tensor
    dot: torch.Tensor
    finite: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor


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
    """``native_rows.c`` into ``out``: with glibc's vector ``exp2f`` (libmvec) where it links, else without."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (("-DATTNPROBE_MVEC", "-lmvec", "-lm"), ("-lm",)):
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            built = Path(tmp) / out.name
            cmd = [cc, *_FLAGS, str(_SOURCE), "-o", str(built), *extra]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                os.replace(built, out)  # atomic: processes building at once each put a whole library
                return
            errors.append(done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"])
    raise NativeUnavailable(f"{cc} could not build {_SOURCE.name}: {errors[-1][0]}")


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
    s: torch.Tensor, e: torch.Tensor, shift: torch.Tensor | None, threshold: float, *, relative: bool
) -> RowPass | None:
    """One call over ``s`` ``(..., K)`` float32 contiguous on the CPU (base-2 logits, ``-inf`` where forbidden):
    writes ``e = exp2(s - shift)`` into ``e`` (same shape) and returns the rows' sums; ``shift`` ``(...)`` or None
    (each row's max). ``threshold``: a key is a hit where ``e > threshold`` (times ``sum e`` when ``relative``).
    None where a row holds a NaN or +inf logit (nothing the caller may use was written), or without the library."""
    lib = _library()
    if isinstance(lib, str):
        return None
    rows_shape, K = s.shape[:-1], s.shape[-1]
    R = s.numel() // max(K, 1)
    f32 = [torch.empty(rows_shape, dtype=torch.float32) for _ in range(4)]  # max, sum, min, dot
    i64 = [torch.empty(rows_shape, dtype=torch.int64) for _ in range(4)]  # arg, finite, first, last
    ptrs = [t.data_ptr() for t in (f32[0], i64[0], f32[1], f32[2], f32[3], i64[1], i64[2], i64[3])]
    shift = None if shift is None else shift.to(torch.float32).contiguous()  # (...), alive through the call
    shift_ptr = None if shift is None else shift.data_ptr()
    odd = lib.attnprobe_row_pass(
        s.data_ptr(), e.data_ptr(), R, K, shift_ptr, threshold, int(relative), *ptrs, torch.get_num_threads()
    )
    if odd:
        return None
    return RowPass(max=f32[0], arg=i64[0], sum=f32[1], min=f32[2], dot=f32[3], finite=i64[1], first=i64[2], last=i64[3])


def usable(s: torch.Tensor, e: torch.Tensor) -> bool:
    """Whether ``row_pass`` takes these buffers: float32, contiguous, on the CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in (s, e))


def _self_check(lib: ctypes.CDLL) -> None:
    """The library against torch's ops on a small block with forbidden keys and a given shift."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 300, generator=g) * 4  # (rows..., key)
    s[..., 250:] = -torch.inf
    shift = torch.logsumexp(s * 0.6931471805599453, -1) * 1.4426950408889634  # (rows...) base 2
    e = torch.empty_like(s)
    rows = s.numel() // s.shape[-1]
    outs = [torch.empty(s.shape[:-1], dtype=t) for t in [torch.float32, torch.int64, *[torch.float32] * 3]]
    outs += [torch.empty(s.shape[:-1], dtype=torch.int64) for _ in range(3)]
    lib.attnprobe_row_pass(
        s.data_ptr(), e.data_ptr(), rows, s.shape[-1], shift.data_ptr(), 1e-3, 1, *[o.data_ptr() for o in outs], 1
    )
    want = torch.exp2(s - shift[..., None])  # (rows..., key)
    agree = (
        torch.allclose(e, want, rtol=1e-5, atol=1e-7)
        and torch.equal(outs[0], s.amax(-1))
        and torch.equal(outs[1], s.argmax(-1))
        and torch.allclose(outs[2], want.sum(-1), rtol=1e-5)
        and bool((outs[5] == 250).all())
    )
    if not agree:
        raise NativeUnavailable("the compiled row pass disagreed with torch's ops on its check (a miscompile)")
