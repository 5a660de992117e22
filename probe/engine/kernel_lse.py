"""The model's own attention kernel, and each row's logsumexp beside its output: ``sdpa_with_lse``.

``F.scaled_dot_product_attention`` picks a kernel (``torch._fused_sdp_choice``) and calls it; the fused kernels
compute each row's log-normaliser ``lse = logsumexp(logits)`` anyway, and sdpa drops it. ``sdpa_with_lse`` makes the
same choice and calls the same kernel the way sdpa does (the same mask conversion, padding and arguments), keeping
the lse: the output is sdpa's, bitwise. With the lse known every weight is ``exp(logit - lse)``, so the statistics
engine (``probe/engine/stats.py``) needs no pass to find each row's normaliser (``AttentionCall.lse``).

Where sdpa's own kernel is one that returns the lse:

- CPU, flash (sdpa's choice for float32, bfloat16 and float16 without dropout, any mask, grouped-query heads):
  ``aten._scaled_dot_product_flash_attention_for_cpu``, with a bool mask turned into a float one as sdpa turns it;
- CUDA, flash (no mask): ``aten._scaled_dot_product_flash_attention``, the head size padded to a multiple of 8 and
  the scale taken from the unpadded one, as sdpa does;
- CUDA, memory-efficient (a mask): ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``,
  the mask padded to an aligned stride and expanded as sdpa does.

Everywhere else (the math kernel, cuDNN, dropout, nested or subclassed tensors, a call inside a graph
``torch.compile`` traces) it calls sdpa itself and returns no lse. The first call of each kind (``_Signature``: device,
kernel, dtype, mask, causal, grouped heads, gradients) in a process is also run through sdpa (on its first 64 query
rows when it has more: the kernel and sdpa both) and the two outputs compared bit for bit: a kind whose outputs
differ (a torch release that changed sdpa's steps) is warned about once and never read this way again, so that a
capture never changes what the model computes.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import warn_user

_FLASH, _EFFICIENT = 1, 2  # torch.nn.attention.SDPBackend's values (FLASH_ATTENTION, EFFICIENT_ATTENTION)

#: Verdicts per kind of call (``_Signature``): True = this process saw the kernel's output equal sdpa's, bit for bit.
_VERDICTS: dict[_Signature, bool] = {}
_LOCK = threading.Lock()


class _Signature(NamedTuple):
    """What decides whether calling the kernel as sdpa does gives sdpa's output: a kind of call."""

    device: str
    backend: int
    dtype: torch.dtype
    mask: torch.dtype | None
    causal: bool
    grouped: bool
    grad: bool


def sdpa_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(output, lse)``: ``F.scaled_dot_product_attention(query, key, value, ...)``'s output, bitwise, and
    ``(batch, head, query)`` float32: each row's ``logsumexp`` of its scaled, masked logits as sdpa's kernel computed
    it; None where sdpa's kernel does not return one (see the module's docstring).

    Example::

        >>> q = k = v = torch.randn(1, 2, 5, 8)
        >>> out, lse = sdpa_with_lse(q, k, v, is_causal=True)
        >>> torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)), tuple(lse.shape)
        (True, (1, 2, 5))
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    backend = kernel_of(*args)
    if backend is None:
        return _sdpa(*args), None
    signature = _Signature(
        query.device.type,
        backend,
        query.dtype,
        None if attn_mask is None else attn_mask.dtype,
        bool(is_causal),
        query.shape[1] != key.shape[1],
        torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
    )
    verdict = _VERDICTS.get(signature)
    if verdict is False:
        return _sdpa(*args), None
    out, lse = _run(backend, query, key, value, attn_mask, is_causal, scale)
    if verdict is None and not _same_as_sdpa(signature, backend, out, args):
        return _sdpa(*args), None
    return out, lse


def kernel_of(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The kernel sdpa would run for this call (``torch.nn.attention.SDPBackend``'s value) when it is one whose lse
    ``sdpa_with_lse`` reads; None otherwise (the math kernel, cuDNN, dropout, tensors that are not plain dense 4-D
    tensors, inside a graph ``torch.compile`` traces)."""
    if torch.compiler.is_compiling() or dropout_p:
        return None
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if any(type(t) is not torch.Tensor or t.is_nested or t.dim() != 4 for t in tensors):
        return None
    if query.device.type not in ("cpu", "cuda"):
        return None
    try:
        choice = torch._fused_sdp_choice(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    except RuntimeError:  # no kernel takes the call: sdpa itself will say why
        return None
    if choice == _FLASH or (choice == _EFFICIENT and query.device.type == "cuda"):
        return int(choice)
    return None


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor:
    kwargs = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no enable_gqa (and never needs it here)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)


def _float_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as sdpa hands it to its fused kernels: 0 where True, ``-inf`` where False, in the query's dtype."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.full_like(attn_mask, -math.inf, dtype=dtype).masked_fill_(attn_mask, 0.0)


def _run(
    backend: int, query, key, value, attn_mask, is_causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel called as sdpa calls it: ``(output, lse)``."""
    aten = torch.ops.aten
    mask = _float_mask(attn_mask, query.dtype)
    if query.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return out, lse
    if backend == _FLASH:  # no mask reaches flash
        size = query.shape[-1]
        scale = 1.0 / math.sqrt(size) if scale is None else scale  # from the head size before padding
        q, k, v = (_pad_last(t, 8) for t in (query, key, value))
        got = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return got[0][..., :size], got[1]
    if mask is not None:
        mask = _aligned(mask, 8).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    got = aten._scaled_dot_product_efficient_attention(query, key, value, mask, True, 0.0, is_causal, scale=scale)
    return got[0], got[1][..., : query.shape[2]]  # the lse is padded along the queries


def _pad_last(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``t`` with its last axis padded with zeros to a multiple of ``alignment`` (as it is when it is one)."""
    size = t.shape[-1]
    return t if size % alignment == 0 else F.pad(t, (0, alignment - size % alignment))


def _aligned(mask: torch.Tensor, alignment: int) -> torch.Tensor:
    """A mask whose strides but the last are multiples of ``alignment`` and whose last is 1: as it is, else a view of
    a copy padded along the keys (what the memory-efficient kernel reads)."""
    strides = mask.stride()
    if all(s % alignment == 0 for s in strides[:-1]) and strides[-1] == 1:
        return mask
    size = mask.shape[-1]
    return F.pad(mask, (0, alignment - size % alignment))[..., :size]


#: Query rows the first call of a kind is compared on (``_same_as_sdpa``): the kernel and sdpa both run on them.
_CHECK_ROWS = 64


def _same_as_sdpa(signature: _Signature, backend: int, out: torch.Tensor, args: tuple) -> bool:
    """Whether the kernel, called as ``_run`` calls it, gives sdpa's output for ``args``, bit for bit (the first call
    of each ``_Signature``); the verdict is kept for the process, and a difference is warned about once.

    A long call is compared on its first ``_CHECK_ROWS`` query rows, against every key (rows of attention are
    independent, and sdpa's causal mask is counted from the first row): both the kernel and sdpa run on those rows,
    so the check costs a sliver of the call, not a second call (at 32k tokens that was a tenth of a statistics
    capture's time). The slice is taken only where sdpa picks the same kernel for it; else the whole call is."""
    sliced = _first_rows(args, _CHECK_ROWS)
    with torch.no_grad():
        if sliced is not None and kernel_of(*sliced) == backend:
            query, key, value, attn_mask, _, is_causal, scale, _ = sliced
            out = _run(backend, query, key, value, attn_mask, is_causal, scale)[0]
            args = sliced
        want = _sdpa(*args)
    same = out.shape == want.shape and out.dtype == want.dtype and torch.equal(_bits(out), _bits(want))
    with _LOCK:
        _VERDICTS[signature] = same
    if not same:
        warn_user(
            f"attnprobe: calling sdpa's kernel for its logsumexp ({signature}) gave an output that differs from "
            f"scaled_dot_product_attention's on torch {torch.__version__}; such calls run sdpa itself from now on, and "
            "their statistics take one more pass over the keys"
        )
    return same


def _first_rows(args: tuple, rows: int) -> tuple | None:
    """``args`` of sdpa with their first ``rows`` query rows (the mask's too where it has a query axis); None when
    the call has no more rows than that."""
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = args
    if query.shape[-2] <= rows:
        return None
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1:
        attn_mask = attn_mask[..., :rows, :]
    return (query[..., :rows, :], key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (NaN payloads compared too)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])
