"""An attention function's sdpa call, with the logsumexp of sdpa's own kernel kept beside its output.

A model's attention function (transformers' ``sdpa_attention_forward``) calls ``F.scaled_dot_product_attention``
once. ``call_with_lse(fn, ...)`` runs the function with a torch function mode that answers that call with
``probe.engine.kernel_lse.sdpa_with_lse``: the same kernel sdpa would run, called as sdpa calls it, so the output is
sdpa's bit for bit; each row's lse comes back beside the function's result. The statistics engine then needs no pass
to find each row's normaliser (``AttentionCall.lse``). Statistics captures only: recomputed weights stay torch's
softmax of eager's logits (as fast on CPU, and eager's to the bit; ``hooks/hf/recompute.py``).

Only for the modules a capture asked it for (``want_lse``), outside compiled graphs (a mode inside a traced forward
would change its graph), and only when the function calls sdpa exactly once.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..probe.engine.kernel_lse import sdpa_with_lse
from .calls import bind_arguments

_SDPA = F.scaled_dot_product_attention
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

_WANTED: dict[int, int] = {}  # id(module) -> how many open captures want the lse of its sdpa call
_LOCK = threading.Lock()


def want_lse(module: nn.Module, stack: ExitStack) -> None:
    """Ask for the lse of ``module``'s sdpa calls until ``stack`` closes."""
    key = id(module)
    with _LOCK:
        _WANTED[key] = _WANTED.get(key, 0) + 1
    stack.callback(_release, key)


def _release(key: int) -> None:
    with _LOCK:
        left = _WANTED.get(key, 0) - 1
        if left > 0:
            _WANTED[key] = left
        else:
            _WANTED.pop(key, None)


def wants_lse(module: nn.Module) -> bool:
    """Whether some open capture asked for the lse of ``module``'s sdpa call (never inside a compiled graph)."""
    return not torch.compiler.is_compiling() and id(module) in _WANTED


class _KernelLse(TorchFunctionMode):
    """Answers ``F.scaled_dot_product_attention`` with ``sdpa_with_lse`` and keeps the lse; every other call runs as
    called."""

    def __init__(self) -> None:
        super().__init__()
        self.lse: torch.Tensor | None = None
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            bound = bind_arguments(_PARAMS, _DEFAULTS, args, kwargs, required=3)
            if bound is not None:
                self.calls += 1
                out, self.lse = sdpa_with_lse(**bound)
                return out
        return func(*args, **kwargs)


def call_with_lse(fn, module, query: torch.Tensor, *args, **kwargs) -> tuple[object, torch.Tensor | None]:
    """``(fn(module, query, *args, **kwargs), lse)``: the attention function's own result (its sdpa call answered by
    sdpa's kernel, bit for bit) and the lse of that call, ``(batch, head, query)`` as ``query`` is laid out; None when
    the kernel gives none, the function called sdpa other than once, or laid the rows out in a way not read here."""
    mode = _KernelLse()
    with mode:
        result = fn(module, query, *args, **kwargs)
    lse = mode.lse if mode.calls == 1 else None
    return result, None if lse is None else _as_rows(lse, tuple(query.shape[:3]))


def _as_rows(lse: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor | None:
    """The lse ``(batch, head, query)`` of ``rows``: as it is, or, for one query whose heads the function folded onto
    their key/value heads (transformers' ``pack_gqa``: ``(batch, kv_head, group)``), unfolded; None otherwise."""
    if tuple(lse.shape) == rows:
        return lse
    batch, heads, queries = rows
    if queries == 1 and lse.dim() == 3 and lse.shape[0] == batch and lse.shape[1] * lse.shape[2] == heads:
        return lse.reshape(batch, heads, 1)  # head kv * group + g is row g of kv head kv
    return None
