"""What a capture keeps, and where: layer/head/tensor selection, storage device and dtype, byte budget.

Selection happens before anything is copied: an adapter asks ``Selection.wants(layer)`` and
``heads_for(...)`` first, and ``Store.put`` slices the selected heads out of a live tensor before
the one copy that lands in a record. The budget is checked on the planned size, before the copy.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import operator
import re
from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from .errors import CaptureBudgetError, SelectionError, UnsupportedModelError
from .record import KEEP_NAMES, TENSOR_FIELDS

if TYPE_CHECKING:
    from .engine.pooling import Overview
    from .rows import RowSelection


def _as_int(item, what: str, value) -> int:
    """``item`` as an int: Python, numpy and 0-d integer tensor numbers are accepted, bools are not."""
    if isinstance(item, bool) or not hasattr(item, "__index__"):
        raise SelectionError(f"{what} must be integers, got {item!r} in {value!r}")
    try:
        return operator.index(item)
    except TypeError:
        raise SelectionError(f"{what} must be integers, got {item!r} in {value!r}") from None


#: The most numbers one ``layers=`` or ``heads=`` selection may name: far more attention layers or heads
#: than any model has, few enough that a slip such as ``range(2_000_000_000)`` fails at once instead of
#: allocating gigabytes before the model is even looked at.
MAX_SELECTED = 1 << 16


def too_many(what: str, count: int | None, shown) -> SelectionError:
    """The error for a selection that names more than ``MAX_SELECTED`` numbers."""
    size = f"{count:,}" if count is not None else f"more than {MAX_SELECTED:,}"
    problem = (
        f"{what} {shown} names {size} numbers; no model has that many attention layers or heads "
        f"(at most {MAX_SELECTED:,} are accepted)"
    )
    hint = "name the ones the model has"
    return SelectionError(f"{problem}: {hint}", problem=problem, hint=hint, argument=what, value=shown)


def int_list(value, what: str) -> tuple[int, ...]:
    """An int or an iterable of ints (numpy and torch integers too) as a tuple, duplicates dropped."""
    if isinstance(value, (bool, str, bytes, Mapping)):
        raise SelectionError(f"{what} must be an int or a list of ints, got {value!r}")
    if getattr(value, "ndim", None) == 0 or (hasattr(value, "__index__") and not isinstance(value, Iterable)):
        items: tuple = (value,)
    elif isinstance(value, range):  # its length is known without building it
        if len(value) > MAX_SELECTED:
            raise too_many(what, len(value), f"{value!r}")
        items = tuple(value)
    elif isinstance(value, Iterable):
        items = tuple(itertools.islice(value, MAX_SELECTED + 1))  # never more than that in memory
        if len(items) > MAX_SELECTED:
            raise too_many(what, len(value) if isinstance(value, Sized) else None, f"({type(value).__name__})")
    else:
        raise SelectionError(f"{what} must be an int or a list of ints, got {value!r}")
    return tuple(dict.fromkeys(_as_int(item, what, value) for item in items))  # dedupe, keep order


def _keep_set(keep) -> frozenset[str]:
    if keep is None:
        return frozenset(TENSOR_FIELDS)
    if isinstance(keep, str):
        items: tuple = (keep,)
    elif isinstance(keep, Iterable) and not isinstance(keep, (bytes, Mapping)):
        items = tuple(keep)
    else:
        raise SelectionError(
            f"keep must be a tensor name or a list of them, e.g. keep=['weights'] or keep=('q', 'k'), "
            f"got {keep!r}; choose from {list(KEEP_NAMES)} (None keeps all tensors)"
        )
    unknown = [k for k in items if k not in KEEP_NAMES]
    if unknown:
        raise SelectionError(f"keep= got unknown tensor name(s) {unknown}; choose from {list(KEEP_NAMES)}")
    return frozenset(items)


def _storage_device(device) -> torch.device:
    """The device records are stored on, checked to exist on this machine before anything runs."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise SelectionError(f"device={device!r} is not a torch device (try 'cpu' or 'cuda:0')") from exc
    if dev.type == "meta":
        raise SelectionError("device='meta' would store no data; store on 'cpu' (the default) or an accelerator")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SelectionError(
            f"device={device!r}: CUDA is not available here (torch.cuda.is_available() is False); "
            "store records on the CPU (device=None or 'cpu'), or install a CUDA build of torch on a machine with a GPU"
        )
    if dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception as exc:
            raise SelectionError(
                f"device={device!r} cannot hold tensors on this machine ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'no message'}); store records on the CPU "
                "(device=None or 'cpu')"
            ) from exc
    return dev


def parse_bytes(text: str | int) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1e6"`` or an int to a number of bytes (for the CLI)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in units:
        raise SelectionError(f"cannot read {text!r} as a size; write e.g. 500MB, 2GiB or 1000000")
    value = float(m.group(1)) * units[m.group(2)]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise SelectionError(
            f"size {text!r} is beyond any memory (at most 2**60 bytes, 1 EiB); "
            "write e.g. 500MB or 2GiB, or leave the budget out for none"
        )
    if value < 1:
        raise SelectionError(
            f"max_bytes must be a positive size: {text!r} is less than one byte; write e.g. 500MB, 2GiB or 1000000"
        )
    return int(value)


#: The largest byte budget accepted (an exbibyte): a larger figure is a typo, not a memory.
MAX_BYTES = 2**60


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def overview_of(overview, keep) -> Overview | None:
    """``capture(overview=)``: None, a number of cells, or a ``probe.engine.pooling.Overview``; needs ``"stats"`` in
    keep."""
    if overview is None:
        return None
    from .engine.pooling import Overview

    if isinstance(overview, int) and not isinstance(overview, bool):
        overview = Overview(cells=overview)
    if not isinstance(overview, Overview):
        raise SelectionError(
            f"overview= takes a number of cells (such as 512) or a probe.pooling.Overview, got {overview!r}"
        )
    if "stats" not in keep:
        raise SelectionError('overview= is computed by the statistics engine: add "stats" to keep=')
    return overview


#: The statistics engines ``capture(stats_engine=...)`` names (``probe.engine.engines``).
STATS_ENGINES: tuple[str, ...] = ("auto", "torch", "triton", "native")


def stats_engine_of(engine) -> str:
    """``capture(stats_engine=)`` checked: one of ``STATS_ENGINES``; ``"triton"`` only where triton (and the numpy
    its interpreter needs) is installed, at least the release the kernel is proven on
    (``engine.triton_release.TRITON_MIN``); ``"native"`` only where the native row pass builds
    (``engine.native_rows``)."""
    if engine not in STATS_ENGINES:
        raise SelectionError(
            f"stats_engine must be one of {', '.join(repr(e) for e in STATS_ENGINES)}, got {engine!r}",
            argument="stats_engine",
            value=engine,
        )
    if engine == "triton" and any(importlib.util.find_spec(name) is None for name in ("triton", "numpy")):
        raise SelectionError(
            "stats_engine='triton' needs triton, which is not installed here; install it with "
            "pip install 'attnprobe[triton]', or use stats_engine='torch'",
            argument="stats_engine",
            value=engine,
        )
    if engine == "native":
        from .engine import native_rows

        why = native_rows.why_unavailable()
        if why is not None:
            raise SelectionError(
                f"stats_engine='native' needs the native row pass, which cannot be used here: {why}. Use "
                "stats_engine='torch' (the same statistics with torch's ops alone)",
                argument="stats_engine",
                value=engine,
            )
    if engine == "triton":
        from .engine.triton_release import TRITON_MIN, installed_triton, triton_release_proven

        version = installed_triton()
        if version is not None and not triton_release_proven(version):
            raise SelectionError(
                f"stats_engine='triton' needs triton>={TRITON_MIN}, the oldest release the kernel is tested on; "
                f"triton {version} is installed. Upgrade it (pip install 'attnprobe[triton]') or use "
                "stats_engine='torch'",
                argument="stats_engine",
                value=engine,
            )
    return engine


def stats_rows_of(stats_rows, keep, overview) -> int | None:
    """``capture(stats_rows=)``: None (every query row) or a positive whole number of rows; needs ``"stats"`` in
    keep and no overview (an overview pools every row)."""
    if stats_rows is None:
        return None
    if isinstance(stats_rows, bool) or not hasattr(stats_rows, "__index__") or operator.index(stats_rows) < 1:
        raise SelectionError(
            f"stats_rows must be a positive whole number of query rows (such as 64), or None for "
            f"every row, got {stats_rows!r}"
        )
    if "stats" not in keep:
        raise SelectionError('stats_rows= samples the rows of the statistics engine: add "stats" to keep=')
    if overview is not None:
        raise SelectionError(
            "stats_rows= cannot be combined with overview=: an overview pools every query row; leave one of them out"
        )
    return operator.index(stats_rows)


def rows_of(rows, keep, overview, stats_rows) -> RowSelection | None:
    """``capture(rows=)`` (see ``probe/rows.py``): not with ``stats_rows=`` (one way to choose rows) nor with an
    overview (which pools every row)."""
    from .rows import row_selection

    selection = row_selection(rows)
    if selection is not None and stats_rows is not None:
        raise SelectionError(
            "give stats_rows= or rows=, not both: stats_rows samples evenly, rows names the rows",
            argument="rows",
            value=rows,
        )
    if selection is not None and overview is not None:
        raise SelectionError(
            "rows= cannot be combined with overview=: an overview pools every query row; leave one of them out",
            argument="rows",
            value=rows,
        )
    return selection


def _needs_stats(value, name: str, keep) -> Any:
    """``value`` (None or an object ``probe.analyses.extras`` validated) when ``"stats"`` is kept, else an error: what
    the statistics pass computes beside the statistics."""
    if value is not None and "stats" not in keep:
        raise SelectionError(
            f'{name}= is computed during the forward by a statistics capture: add "stats" to keep= (from a capture '
            f"that keeps the weights, attnprobe.{'eviction_profile' if name == 'eviction' else 'spans.attention'} "
            "computes it afterwards)",
            argument=name,
        )
    return value


def sampled_rows(length: int, count: int | None) -> torch.Tensor | None:
    """The query rows ``stats_rows=count`` samples from a call of ``length`` rows: ``count`` positions evenly spaced
    from the first row to the last (both included), the same ones for the same length; None (every row) when
    ``count`` is None or not less than ``length``.

    Example::

        >>> sampled_rows(10, 4).tolist(), sampled_rows(10, 1).tolist(), sampled_rows(3, 4)
        ([0, 3, 6, 9], [9], None)
    """
    if count is None or count >= length:
        return None
    if count == 1:
        return torch.tensor([length - 1])
    return torch.arange(count) * (length - 1) // (count - 1)  # a step >= 1: ascending, no repeats


def _heads_of(heads) -> tuple[tuple[int, ...] | None, dict[int, tuple[int, ...] | None] | None]:
    """``capture(heads=)``: ``(heads for every layer, {layer: heads})``, one of them None (both when ``heads`` is)."""
    head_tuple, by_layer = None, None
    if isinstance(heads, Mapping):
        by_layer = {}
        for layer, hs in heads.items():
            if isinstance(layer, bool) or not hasattr(layer, "__index__"):
                raise SelectionError(
                    f"the keys of heads={{layer: heads}} must be layer numbers (int), got {layer!r}; "
                    "e.g. heads={0: [1, 2], -1: None}"
                )
            layer = _as_int(layer, "the keys of heads={layer: heads}", heads)
            by_layer[layer] = None if hs is None else int_list(hs, f"heads for layer {layer}")
    elif heads is not None:
        head_tuple = int_list(heads, "heads")
    for h in (head_tuple or ()) + tuple(h for hs in (by_layer or {}).values() for h in (hs or ())):
        if h < 0:
            raise SelectionError(f"heads must be non-negative head numbers, got {h}")
    if head_tuple == () or any(hs == () for hs in (by_layer or {}).values()):
        raise SelectionError(
            "heads=[] selects no head, so its layers would store empty tensors; to capture nothing use "
            "layers=[], to leave a layer out do not list it (heads={layer: None} keeps all its heads)"
        )
    return head_tuple, by_layer


def _dtype_of(dtype) -> torch.dtype | None:
    """``capture(dtype=)``: None, a floating torch dtype, or its name (``"float16"``, ``"torch.bfloat16"``)."""
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise SelectionError(f"dtype must be a floating torch dtype such as torch.float16, got {dtype!r}")
    return dtype


def _max_bytes_of(max_bytes) -> int | None:
    """``capture(max_bytes=)``: None (no budget), a whole number of bytes (``5e8`` too) or a size (``"500MB"``)."""
    if isinstance(max_bytes, str):
        max_bytes = parse_bytes(max_bytes)  # "500MB", "2GiB"
    elif isinstance(max_bytes, float) and not math.isfinite(max_bytes):
        raise SelectionError(
            f"max_bytes={max_bytes!r} is not a number of bytes; give e.g. 5e8 or '500MB', or None for no budget"
        )
    elif isinstance(max_bytes, float) and max_bytes.is_integer():
        max_bytes = int(max_bytes)  # 1e9
    return _whole_bytes(
        max_bytes,
        "max_bytes must be a positive whole number of bytes (such as 500_000_000 or 5e8) or a size "
        "such as '500MB' or '2GiB'",
    )


def _block_bytes_of(block_bytes) -> int | None:
    """``capture(block_bytes=)``: None (the engine's default) or a positive number of bytes or a size."""
    if isinstance(block_bytes, str):
        block_bytes = parse_bytes(block_bytes)
    return _whole_bytes(
        block_bytes, "block_bytes must be a positive number of bytes (such as 32_000_000) or a size such as '32MB'"
    )


def _whole_bytes(value, need: str) -> int | None:
    """``value`` as a positive int, or None; else a SelectionError saying ``need`` and what was given."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) <= 0:
        raise SelectionError(f"{need}, got {value!r}")
    return operator.index(value)


#: Where records are stored unless the caller says otherwise.
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Selection:
    """A validated capture request. Build it with ``Selection.build(...)``."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    heads_by_layer: Mapping[int, tuple[int, ...] | None] | None = None
    keep: frozenset[str] = frozenset(TENSOR_FIELDS)
    device: torch.device = _CPU
    dtype: torch.dtype | None = None
    max_bytes: int | None = None
    block_bytes: int | None = None
    """Memory target of one block of the statistics engine (``keep=("stats",)``); None = its default."""
    overview: Overview | None = None
    """``probe.engine.pooling.Overview``: pooled weights and exact windows a statistics capture also keeps; None =
    none."""
    stats_rows: int | None = None
    """Statistics of at most this many query rows per call (``sampled_rows``: evenly spaced, the last one
    included); None = every row."""
    rows: RowSelection | None = None
    """The query rows kept (``probe/rows.py``); None = every row."""
    eviction: Any = None
    """An ``EvictionPlan``: KV-cache eviction fractions computed during the forward (``probe/engine/kept_mass.py``;
    validated by ``probe.analyses.extras.eviction_of``); None = none."""
    spans: Any = None
    """A ``SpanSet``: declared spans whose per-row masses are computed during the forward (validated by
    ``probe.analyses.extras.spans_of``); None = none."""
    stats_engine: str = "auto"
    """Which engine computes statistics (``probe.engine.engines``): ``"auto"``, ``"torch"`` or ``"triton"``."""

    @classmethod
    def build(
        cls,
        *,
        layers=None,
        heads=None,
        keep=None,
        device=None,
        dtype=None,
        max_bytes=None,
        block_bytes=None,
        overview=None,
        stats_rows=None,
        rows=None,
        eviction=None,
        spans=None,
        stats_engine="auto",
    ) -> Selection:
        # each argument checked in the order of the signature, so that the first wrong one is the one reported
        layer_tuple = None if layers is None else int_list(layers, "layers")
        head_tuple, by_layer = _heads_of(heads)
        if layer_tuple is None and by_layer is not None:
            layer_tuple = tuple(by_layer)  # heads={layer: heads} selects those layers
        keep_set = _keep_set(keep)
        dev, dtype, max_bytes, block_bytes = (
            _storage_device(device),
            _dtype_of(dtype),
            _max_bytes_of(max_bytes),
            _block_bytes_of(block_bytes),
        )
        overview = overview_of(overview, keep_set)
        stats_rows = stats_rows_of(stats_rows, keep_set, overview)
        return cls(
            layer_tuple,
            head_tuple,
            by_layer,
            keep_set,
            dev,
            dtype,
            max_bytes,
            block_bytes,
            overview,
            stats_rows,
            rows_of(rows, keep_set, overview, stats_rows),
            _needs_stats(eviction, "eviction", keep_set),
            _needs_stats(spans, "spans", keep_set),
            stats_engine_of(stats_engine),
        )

    def resolve_layers(self, n_layers: int, *, may_grow: bool = False) -> Selection:
        """Check layer numbers against the model (negative numbers count from the end).

        With ``may_grow`` (attention may also be found while the model runs), numbers past the layers
        found so far are accepted, and negative numbers count from the end of the layers found before the run.
        """
        if self.layers is None:
            return self

        def resolve(layer: int, what: str) -> int:
            number = layer + n_layers if layer < 0 else layer
            if number < 0 or (number >= n_layers and not may_grow):
                if not n_layers:
                    raise SelectionError(
                        f"{what} {layer} cannot count from the end: no attention layer was found before the run "
                        "(attention found while the model runs is numbered from 0 as it appears); use layers >= 0"
                    )
                problem = (
                    f"{what} {layer} is out of range: the model has {n_layers} attention layer(s), numbered 0 to "
                    f"{n_layers - 1}, or -1 to {-n_layers} from the end"
                )
                hint = "attnprobe.attention_modules(model) lists them"
                raise SelectionError(f"{problem}; {hint}", problem=problem, hint=hint, argument="layers", value=layer)
            return number

        by_layer = self.heads_by_layer
        if by_layer is not None:
            resolved_heads: dict[int, tuple[int, ...] | None] = {}
            for layer, hs in by_layer.items():
                number = resolve(layer, "layer")
                if number in resolved_heads and resolved_heads[number] != hs:
                    raise SelectionError(
                        f"heads={{...}} names layer {number} twice with different heads "
                        f"({list(resolved_heads[number] or ())} and {list(hs or ())}); give each layer once"
                    )
                resolved_heads[number] = hs
            by_layer = resolved_heads
        resolved = tuple(dict.fromkeys(resolve(layer, "layer") for layer in self.layers))
        if by_layer is not None:
            unselected = [layer for layer in by_layer if layer not in resolved]
            if unselected:
                raise SelectionError(
                    f"heads={{...}} names layer(s) {unselected} that layers={list(self.layers)} does not select; "
                    "add them to layers=, or leave layers out (the keys of heads={...} then choose the layers)"
                )
        return replace(self, layers=resolved, heads_by_layer=by_layer)

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def heads_for(self, layer: int, num_heads: int, *, where: str = "") -> tuple[int, ...]:
        """The model head numbers to store for ``layer`` (validated against ``num_heads``)."""
        heads = self.heads
        if self.heads_by_layer is not None and layer in self.heads_by_layer:
            heads = self.heads_by_layer[layer]
        if heads is None:
            return tuple(range(num_heads))
        bad = [h for h in heads if h >= num_heads]
        if bad:
            raise SelectionError(
                f"head(s) {bad} out of range for layer {layer}{' ' + where if where else ''}, "
                f"which has {num_heads} head(s) numbered 0 to {num_heads - 1}"
            )
        return heads

    @property
    def idle(self) -> bool:
        """True when nothing at all will be stored."""
        return self.layers == ()


def kv_of_heads(heads: tuple[int, ...], num_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """For each query head of ``heads``, the key/value head it reads (grouped-query attention: each key/value head
    serves a group of ``num_heads // num_kv_heads`` consecutive query heads). Head counts that do not divide are
    refused: no group size maps them, and a guess would pair query heads with the wrong keys."""
    kv = max(num_kv_heads, 1)
    if num_heads % kv:
        raise UnsupportedModelError(
            f"an attention call had {num_heads} query heads and {num_kv_heads} key/value heads, which do not divide: "
            "attnprobe reads grouped-query attention, each key/value head serving a group of query heads, so it "
            "cannot tell which key head a query head read. Exclude the module with layers=[...]",
            problem=f"{num_heads} query heads and {num_kv_heads} key/value heads do not divide",
            hint="exclude the module with layers=[...]",
        )
    group = num_heads // kv
    return tuple(h // group for h in heads)


def kv_heads_for(heads: tuple[int, ...], num_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """The key/value heads that query heads ``heads`` read under grouped-query attention, each once, in order."""
    return tuple(dict.fromkeys(kv_of_heads(heads, num_heads, num_kv_heads)))


def index_heads(t: torch.Tensor, index: tuple[int, ...] | None, axis: int = 1) -> tuple[torch.Tensor, bool]:
    """Select ``index`` along ``axis``: a view for a contiguous run, a copy (``index_select``) otherwise.

    Returns the tensor and whether it is already a fresh copy.
    """
    if index is None or index == tuple(range(t.shape[axis])):
        return t, False
    if index and index == tuple(range(index[0], index[0] + len(index))):
        return t.narrow(axis, index[0], len(index)), False
    return t.index_select(axis, torch.tensor(index, dtype=torch.long, device=t.device)), True


@functools.lru_cache(maxsize=256)  # read for every stored tensor of every call: the same few head selections
def _runs(index: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``index`` as runs of consecutive numbers: (position in index, first number, length)."""
    runs: list[tuple[int, int, int]] = []
    for pos, i in enumerate(index):
        if runs and runs[-1][1] + runs[-1][2] == i:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, i, 1))
    return tuple(runs)


class Store:
    """Copies selected tensors into storage and keeps the byte budget."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.used = 0

    def target_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` is stored as (only floating tensors are converted)."""
        return self.selection.dtype if (self.selection.dtype is not None and dtype.is_floating_point) else dtype

    def planned_bytes(self, shape, dtype: torch.dtype, index: tuple[int, ...] | None = None, axis: int = 1) -> int:
        """Exact bytes ``put`` will store for a tensor of ``shape`` and ``dtype`` restricted to ``index``."""
        shape = list(shape)
        if index is not None:
            shape[axis] = len(index)
        return math.prod(shape) * _element_size(self.target_dtype(dtype))

    def reserve(self, nbytes: int, what: str, *, fields=None, dtypes=(), heads: int | None = None) -> None:
        """Fail before spending memory when ``nbytes`` more would pass ``max_bytes``.

        ``fields`` (the tensors kept), ``dtypes`` (the dtypes of the tensors to store) and ``heads`` (how many are
        stored) let the message suggest only what would make the record smaller; unknown ones are suggested.
        """
        limit = self.selection.max_bytes
        if limit is not None and self.used + nbytes > limit:
            problem = (
                f"capture budget exceeded: storing {what} needs {format_bytes(nbytes)} more, "
                f"{format_bytes(self.used)} is already stored and max_bytes is {format_bytes(limit)}"
            )
            hint = self._advice(fields, dtypes, heads)
            raise CaptureBudgetError(
                f"{problem}. {hint}",
                problem=problem,
                hint=hint,
                what=what,
                needed=nbytes,
                stored=self.used,
                limit=limit,
            )
        self.used += nbytes

    def _advice(self, fields, dtypes, heads: int | None) -> str:
        sel = self.selection
        tensors = [f for f in TENSOR_FIELDS if f in (sel.keep if fields is None else fields)]
        dtypes = [self.target_dtype(d) for d in dtypes] or [sel.dtype or torch.float32]
        options = []
        if sel.layers is None or len(sel.layers) > 1:
            options.append("select fewer layers (layers=[...])")
        if heads is None or heads > 1:
            options.append("fewer heads (heads=[...])")
        if len(tensors) > 1:
            example = ("weights",) if "weights" in tensors else (tensors[0],)
            options.append(f"keep fewer tensors (keep={example!r})")
        if any(d.is_floating_point and d.itemsize > 2 for d in dtypes):
            options.append("store a smaller dtype (dtype=torch.float16)")
        options.append("raise max_bytes")
        text = ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1] + "."
        return text[0].upper() + text[1:]

    def put(self, t: torch.Tensor, index: tuple[int, ...] | None = None, axis: int = 1) -> torch.Tensor:
        """One detached copy of ``t`` restricted to ``index`` on ``axis`` (budget already reserved).

        Exactly one new tensor is allocated, also for scattered heads stored on another device or dtype.
        """
        t = t.detach()
        device, dtype = self.selection.device, self.target_dtype(t.dtype)
        if index is None or len(_runs(tuple(index))) == 1:  # all heads or one run of them: a view, then the one copy
            return index_heads(t, index, axis)[0].to(device=device, dtype=dtype, copy=True)
        if t.device == device and t.dtype == dtype:
            return t.index_select(axis, torch.tensor(index, dtype=torch.long, device=t.device))
        shape = list(t.shape)
        shape[axis] = len(index)
        out = torch.empty(shape, dtype=dtype, device=device)
        for pos, first, length in _runs(tuple(index)):  # copy_ converts dtype and device on the way
            out.narrow(axis, pos, length).copy_(t.narrow(axis, first, length))
        return out

    def put_fresh(self, fresh: torch.Tensor, declared: torch.dtype, planned: int, what: str) -> torch.Tensor:
        """Store a tensor an adapter computed for the record (a ``Lazy``): moved/converted, copied only if needed.

        It is stored in the dtype the budget planned for. Should it be larger than planned, the difference is
        reserved (and may fail) so ``used`` never under-counts.
        """
        # inference tensors keep no view information: one may be a view of what the model returned
        view = fresh._is_view() or fresh.is_inference()
        fresh = fresh.detach()
        dtype = self.target_dtype(declared)
        actual = fresh.numel() * _element_size(dtype)
        if actual > planned:
            self.reserve(actual - planned, what)
        else:
            self.used -= planned - actual
        # a view may share memory with a tensor the model returned: copy it rather than keep the whole base
        # (a copy made here, in emit, is also an ordinary tensor, usable after an inference_mode block)
        return fresh.to(device=self.selection.device, dtype=dtype, copy=view)


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize
