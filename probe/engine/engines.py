"""Which statistics engine computes a call's statistics: ``capture(..., stats_engine="triton" | "torch" | "auto")``.

- ``"torch"``: the eager engine (``probe/engine/stats.py``: torch's ops over blocks of the logits), everywhere; the
  oracle the others are tested against.
- ``"triton"``: the Triton kernel (``probe/engine/triton_stats.py``: every statistic in one launch per call); calls it
  does not take (attention sinks, a flex ``score_mod`` or block-function mask, a key set (``image_mass``), overviews,
  float64, tensors on CPU, rows with a NaN or inf logit, additive rows that attend no key) go to the eager engine,
  and the first of each reason is warned about. Needs ``triton`` ``>= TRITON_MIN`` (``pip install
  "attnprobe[triton]"``).
- ``"native"``: the eager engine with its per-element work in the native row pass on CPUs
  (``probe/engine/native_rows.py``: one C loop per row, compiled on first use with the C compiler on the path; with
  the kernel's lse and no mask but a causal limit and padding, the products too, fused in cache-sized tiles);
  float32 blocks on the CPU without attention sinks take it, the others, and rows with a NaN or +inf logit, torch's
  ops. Refused in one line where it cannot be built here.
- ``"auto"`` (the default): the Triton kernel for calls on CUDA when a ``triton`` of at least ``TRITON_MIN`` imports;
  on CPUs the native row pass where it builds; else the eager engine. An older triton (torch 2.6 brings 3.2, which
  the kernel's tests fail on) is never picked.

A record whose statistics came from the kernel or the row pass says so: ``record.meta["stats_engine"]`` is
``"triton"`` or ``"native"``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from ..errors import warn_user
from .attention_math import AttentionCall
from .pooling import Overview
from .stats import DEFAULT_BLOCK_BYTES, attention_stats
from .triton_release import installed_triton, triton_release_proven

_WARNED: set[str] = set()


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernel imports here: ``triton`` of at least ``TRITON_MIN`` installed, with numpy."""
    version = installed_triton()
    if version is None or not triton_release_proven(version):
        return False
    try:
        from . import triton_stats  # noqa: F401
    except ImportError:
        return False
    return True


def statistics(
    call: AttentionCall,
    *,
    engine: str = "auto",
    diag_offset: int | None = None,
    query_padding: torch.Tensor | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    overview: Overview | None = None,
    rows: torch.Tensor | None = None,
    workspace: dict | None = None,
    key_set: torch.Tensor | None = None,
) -> tuple[Mapping[str, torch.Tensor], str]:
    """``(statistics, engine)``: ``attention_stats(call, ...)``'s statistics from the engine ``engine`` picks (see
    the module's docstring), and the engine that computed them (``"triton"``, ``"native"`` (some block took the row
    pass) or ``"torch"``)."""
    forced = engine == "triton"
    if engine != "torch" and (forced or call.q.device.type == "cuda") and triton_available():
        got = _from_kernel(call, forced, diag_offset, query_padding, overview, rows, key_set)
        if got is not None:
            return got, "triton"
    report: dict = {}
    got = attention_stats(
        call,
        diag_offset=diag_offset,
        query_padding=query_padding,
        block_bytes=block_bytes,
        overview=overview,
        rows=rows,
        workspace=workspace,
        key_set=key_set,
        native=engine in ("auto", "native"),
        report=report,
    )
    return got, "native" if report["native_blocks"] else "torch"


def _from_kernel(
    call, forced: bool, diag_offset, query_padding, overview, rows, key_set
) -> Mapping[str, torch.Tensor] | None:
    """The kernel's statistics, or None (a call it does not take: warned once per reason when it was asked for)."""
    from . import triton_stats

    reason = "an overview (pooled weights)" if overview is not None else triton_stats.unsupported(call, key_set)
    got = None
    if reason is None:
        got = triton_stats.triton_attention_stats(call, diag_offset=diag_offset, query_padding=query_padding, rows=rows)
        if got is None:
            reason = "rows with a NaN or inf logit, or additive-mask rows that attend no key"
    if got is None and forced and reason is not None and reason not in _WARNED:
        _WARNED.add(reason)
        warn_user(
            f"stats_engine='triton': the Triton kernel does not take calls with {reason}; the eager engine computes "
            "their statistics (the records without meta['stats_engine'] == 'triton')"
        )
    return got
