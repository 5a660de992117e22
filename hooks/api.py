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

from ..probe.analyses.extras import eviction_of, spans_of
from ..probe.capture import AttentionModule, Capture, CaptureSession
from ..probe.errors import SelectionError
from ..probe.interface import Adapter
from ..probe.selection import Selection
from ..probe.sharded_session import ShardedSession
from . import default_adapters


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
    ``keep``: which of ``q, k, v, scores, weights, output`` to store (None = all), and ``"stats"``: per-row
    statistics in ``record.stats``, computed blockwise without storing any (query x key) tensor
    (``block_bytes``: the memory target of one block); ``overview`` (with ``"stats"``: a number of cells, or a
    ``probe.pooling.Overview`` with exact windows) also keeps the weights pooled to at most that many cells a side
    (``record.stats["overview_max"]``/``["overview_mean"]``) and the windows' exact weights (``["window_<i>"]``).
    ``stats_rows`` (with ``"stats"``): the statistics of at most that many query rows per call, evenly spaced from
    the first row to the last (``probe.selection.sampled_rows``), as ``attnprobe.monitor(rows=)`` samples them;
    ``record.meta["stats_rows"]`` lists their positions (see the docs' "Watch attention while a model trains").
    ``rows``: only these query rows of each call: row numbers (negative from the end), a slice, ``"last"``,
    ``"last:N"`` or ``"generated"`` (the rows of ``generate``'s steps after the prompt; see ``probe/rows.py``). A
    capture that keeps (query x key) tensors stores one record per run of consecutive rows, placed by
    ``query_offset`` (memory grows as rows x keys); a statistics capture computes those rows' statistics only.
    ``eviction`` (with ``"stats"``): an ``attnprobe.EvictionPlan`` (or True): the kept fractions of KV-cache
    eviction policies, computed during the forward for the evaluated rows (``rows=``, else the plan's last
    ``observe`` rows; under ``generate`` the generated tokens), read with ``attnprobe.eviction_profile``.
    ``spans`` (with ``"stats"``): declared spans (``attnprobe.spans``) whose per-row masses are computed during the
    forward, read with ``attnprobe.spans.attention``.
    ``stats_engine`` (with ``"stats"``): ``"auto"`` (the Triton kernel for calls on CUDA when ``triton`` imports;
    on CPUs the eager engine with the native row pass where a C compiler builds it; else the eager engine),
    ``"torch"`` (the eager engine, torch's ops alone), ``"triton"`` (the kernel wherever it takes the call) or
    ``"native"`` (the row pass, refused where it cannot be built; see ``probe.engine.engines`` and the docs'
    "Long contexts").
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
    ``gather``: for a model split across processes (tensor or pipeline parallelism, e.g. ``from_pretrained(...,
    distributed_config=DistributedConfig(tp_size=2))`` under ``torchrun``): ``True`` gives every process the whole
    records of its model copy when the block ends, ``"main"`` only global rank 0; without it each process keeps the
    heads and layers it holds, labelled with the model's numbers (``record.meta["rank"]``; ``cap.info["layout"]``
    and ``["held_layers"]``). No effect on a model in one process.
    ``image_grid``: which positions are image patches (``attnprobe.locate_image_tokens(model, inputs,
    processor=, images=)``, or a hand declaration ``attnprobe.ImageGrid(...)`` or a list of them): the capture
    keeps them (``cap.image_tokens()``: overlays and the report's Image section read them), and with ``"stats"``
    each row's weight on the image patches is computed blockwise too (``record.stats["image_mass"]``).
    ``compiled``: True when ``model`` is called from code compiled outside it (``torch.compile(model)`` called in
    its place, or a training step compiled whole) and the capture is opened on ``model``: compiled code does not
    see hooks added after it was compiled, so the capture makes it compile once more with them (as it does for
    compiled modules it finds inside the model). Capturing the compiled module itself needs nothing.

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

    def __init__(
        self,
        model: nn.Module,
        *,
        layers=None,
        heads=None,
        keep=None,
        device=None,
        dtype=None,
        max_bytes=None,
        modules=None,
        block_bytes=None,
        store=None,
        overwrite: bool = False,
        overview=None,
        stats_rows=None,
        gather=False,
        image_grid=None,
        rows=None,
        eviction=None,
        spans=None,
        stats_engine="auto",
        compiled: bool = False,
    ):
        from .hf.sharding import shard_layout

        layout = shard_layout(model) if isinstance(model, nn.Module) else None
        sharded: dict[str, Any] = {} if layout is None else {"layout": layout, "gather": gather}
        if layout is None and gather not in (False, True):
            raise SelectionError(f"gather must be False or True (or 'main' for a sharded model), got {gather!r}")
        self._session = (CaptureSession if layout is None else ShardedSession)(
            model,
            Selection.build(
                layers=layers,
                heads=heads,
                keep=keep,
                device=device,
                dtype=dtype,
                max_bytes=max_bytes,
                block_bytes=block_bytes,
                overview=overview,
                stats_rows=stats_rows,
                rows=rows,
                eviction=eviction_of(eviction),
                spans=spans_of(spans),
                stats_engine=stats_engine,
            ),
            default_adapters(modules=modules),
            store=store,
            overwrite=overwrite,
            **sharded,
            image_grid=image_grid,
            compiled=compiled,
        )

    def __enter__(self) -> Capture:
        return self._session.__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._session.__exit__(exc_type, exc, tb)


def run(model: nn.Module, inputs, *, no_grad: bool = True, **options) -> tuple[Any, Capture]:
    """Run ``model`` once under capture and return ``(output, capture)``.

    ``inputs``: a mapping (e.g. a tokenizer's ``BatchEncoding``) is passed as keyword arguments,
    a tuple or list as positional arguments, anything else as the one argument. ``options`` are
    ``capture``'s (layers, heads, keep, device, dtype, max_bytes, modules, store, overwrite, image_grid, ...). With
    ``no_grad`` (the
    default) the forward runs under ``torch.no_grad()``.

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


def monitor(
    model: nn.Module,
    *,
    every: int = 100,
    rows: int | None = 64,
    layers=None,
    heads=None,
    log_dir=None,
    alerts=None,
    raise_on=(),
    block_bytes: int | None = None,
    hook: bool = True,
    compiled: bool | None = None,
):
    """Watch ``model``'s attention while it trains: per-head statistics on every ``every``-th forward call.

    A context manager (and an object with ``close()``). On forward calls 0, ``every``, ``2 * every``, ...
    the statistics of ``capture(keep=("stats",))`` are computed from the q and k the forward made (no grad,
    detached, no (query x key) tensor kept, the graph, gradients and random stream untouched) and added to
    ``mon.history`` (one row per step, layer and head: means over real query rows, plus ``entropy_min``,
    ``max_weight_max``, ``max_score_max``, ``nonfinite_rows``). Between sampled calls nothing is computed.

    ``rows``: the statistics of this many query rows per head on each sampled call, evenly spaced from the first
    row to the last (the same positions every step for the same length; every row when the sequence is shorter);
    None = every row. The history's ``rows`` column counts the sampled real rows.

    ``log_dir``: also write TensorBoard scalars ("attention/layer 03/head 05/entropy", needs tensorboard).
    ``alerts``: thresholds, e.g. ``{"entropy_below": 0.05, "max_score_above": 50.0, "nonfinite": True}``:
    each fires an ``AttnprobeWarning`` once per (layer, head, alert) and is kept in ``mon.alerts``;
    ``raise_on``: alert names that raise ``AttentionAlert`` instead (for CI jobs).
    Compiled models: monitor the compiled module, ``monitor(torch.compile(model))``; its hook runs before the graph.
    A monitored model called from compiled code samples nothing there (closing the monitor says so), unless the
    loop counts the calls itself: ``hook=False``, then ``mon.begin_call()`` before each forward call and
    ``mon.end_call()`` after it (or after its backward), outside the graph. ``compiled``: whether compiled code
    calls the model (each sampled call's capture is then ``capture(compiled=True)``); default: with ``hook=False``.

    Example::

        >>> import torch, attnprobe
        >>> model = torch.nn.Sequential(attnprobe.MultiHeadAttention(8, num_heads=2, causal=True))
        >>> with attnprobe.monitor(model, every=2, rows=3) as mon:
        ...     for _ in range(5):
        ...         _ = model(torch.randn(1, 10, 8))
        >>> sorted(mon.history["step"].unique().tolist()), len(mon.history), mon.history["rows"].tolist()
        ([0, 2, 4], 6, [3, 3, 3, 3, 3, 3])
    """
    from ..probe.analyses.monitor import Monitor

    return Monitor(
        capture,
        model,
        every=every,
        rows=rows,
        layers=layers,
        heads=heads,
        log_dir=log_dir,
        alerts=alerts,
        raise_on=raise_on,
        block_bytes=block_bytes,
        hook=hook,
        compiled=compiled,
    )
