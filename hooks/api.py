"""The public entry points that need the adapters: ``capture``, ``run`` and ``attention_modules``.

This is where the rooms meet: the capture session of ``probe/`` receives the adapters registered in ``hooks/``
(``hooks.default_adapters``). probe/ never imports hooks/; the adapters reach the session through the
interface of ``probe/interface.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from . import default_adapters
from ..probe.capture import AttentionModule, Capture, CaptureSession
from ..probe.interface import Adapter
from ..probe.selection import Selection


def attention_modules(model: nn.Module, adapters: Sequence[Adapter] | None = None) -> list[AttentionModule]:
    """The attention modules attnprobe finds in ``model``, numbered as a capture numbers layers.

    Nothing is attached; the model is not run. Attention found only while the model runs
    (direct ``scaled_dot_product_attention`` calls, hand-written softmax) is not listed.

    Example::

        >>> import attnprobe, torch
        >>> model = torch.nn.Sequential(attnprobe.MultiHeadAttention(8, num_heads=2))
        >>> [(m.layer, m.name, m.num_heads) for m in attnprobe.attention_modules(model)]
        [(0, '0', 2)]
    """
    session = CaptureSession(model, Selection.build(), default_adapters() if adapters is None else adapters)
    sites = session.discover()
    return [
        AttentionModule(
            layer=s.layer,
            name=s.name,
            module_class=type(s.module).__name__,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            adapter=s.adapter.name,
            strategy=s.info.get("strategy", s.adapter.name),
            backend=s.info.get("backend"),
        )
        for s in sites
    ]


class capture:
    """Capture attention from ``model`` while the ``with`` block runs.

    ``layers``: attention layer numbers (ints, negative from the end; None = all, [] = none).
    ``heads``: head numbers for every selected layer, or ``{layer: heads}``.
    ``keep``: which of ``q, k, v, scores, weights, output`` to store (None = all), and ``"stats"`` for per-row
    statistics (``record.stats``, ``attnprobe.probe.stats``) computed blockwise without a (query, key) tensor;
    ``block_bytes`` is the memory target of one block (default ``probe.stats.DEFAULT_BLOCK_BYTES``);
    ``overview`` (with ``"stats"``: a number of cells, or a ``probe.stats.Overview`` with exact windows) also keeps
    the weights pooled to at most that many cells a side (``record.stats["overview_max"]``/``["overview_mean"]``).
    ``device``/``dtype``: where and as what to store (default: CPU, the dtype attention ran in, e.g. bfloat16
    under autocast; ``dtype`` may be named, e.g. ``"bfloat16"``).
    ``max_bytes``: fail with ``CaptureBudgetError`` before storing more than this many bytes (an int, or a size
    such as ``"500MB"``; every stored tensor counts, masks included).
    ``modules``: hand-written softmax attention to read: modules of the model (or their names from
    ``named_modules()``), or ``"auto"`` to trace every module (slower; see the docs, "Code attnprobe has
    never seen").
    ``store``: a directory to write the records to as they are made (safetensors files plus a JSON index, see
    ``Capture.save``), for captures larger than memory: at most one record's tensors are in memory at a time, the
    Capture's tensors are memory-mapped from the files. The folder appears when the ``with`` block ends (it is
    written under a temporary name); if the block raises, nothing is left on disk (the records in the Capture stay
    usable: ``cap.save(path)`` keeps them). ``overwrite=True`` replaces an existing capture directory there.

    Nothing unselected is ever copied. Every hook is removed on exit, also when the forward
    raises; captures may nest (a new ``capture`` each: one object runs one ``with`` block).

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True)
        >>> with attnprobe.capture(attn, heads=[0, 2], keep=["weights"]) as cap:
        ...     y = attn(torch.randn(2, 6, 16))
        >>> rec = cap[0]
        >>> rec.heads, rec.q is None, tuple(rec.weights.shape)
        ((0, 2), True, (2, 2, 6, 6))
    """

    def __init__(self, model: nn.Module, *, layers=None, heads=None, keep=None, device=None, dtype=None, max_bytes=None,
                 modules=None, store=None, overwrite: bool = False, block_bytes=None,
                 overview=None):
        self._session = CaptureSession(
            model,
            Selection.build(layers=layers, heads=heads, keep=keep, device=device, dtype=dtype, max_bytes=max_bytes,
                            block_bytes=block_bytes, overview=overview),
            default_adapters(modules=modules),
            store=store,
            overwrite=overwrite,
        )

    def __enter__(self) -> Capture:
        return self._session.__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._session.__exit__(exc_type, exc, tb)


def run(model: nn.Module, inputs, *, no_grad: bool = True, **options) -> tuple[Any, Capture]:
    """Run ``model`` once under capture and return ``(output, capture)``.

    ``inputs``: a mapping (e.g. a tokenizer's ``BatchEncoding``) is passed as keyword arguments,
    a tuple or list as positional arguments, anything else as the one argument. ``options`` are
    ``capture``'s (layers, heads, keep, device, dtype, max_bytes, modules, store, overwrite). With ``no_grad`` (the default)
    the forward runs under ``torch.no_grad()``.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 4, 8), layers=[0])
        >>> out.shape, len(cap)
        (torch.Size([1, 4, 8]), 1)
    """
    with capture(model, **options) as cap:
        with torch.no_grad() if no_grad else nullcontext():
            if isinstance(inputs, Mapping):
                output = model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                output = model(*inputs)
            else:
                output = model(inputs)
    return output, cap
