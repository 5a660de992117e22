"""Capture sessions: ``with attnprobe.capture(model) as cap:`` and its functional twin ``run``."""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NamedTuple, cast, overload

import torch
from torch import nn

from . import threads
from .errors import NoAttentionError, NotCapturedError, SelectionError, UnsupportedModelError, warn_user
from .intent import Intent, module_intent
from .interface import Adapter, Lazy, Site
from .outputs.image_tokens import as_image_tokens
from .record import KEEP_NAMES, TENSOR_FIELDS, AttentionRecord, RecordKind
from .rows import runs
from .selection import Selection, Store, index_heads, int_list, kv_heads_for, kv_of_heads, sampled_rows
from .walk import ModuleWalk


class Capture(Sequence):
    """The records of one capture, in call order. Read-only; holds no reference to the model.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        >>> with attnprobe.capture(attn) as cap:
        ...     _ = attn(torch.randn(3, 5, 8))
        >>> len(cap), cap.layers
        (1, (0,))
        >>> cap.select(heads=[1])[0].weights.shape
        torch.Size([3, 1, 5, 5])
    """

    def __init__(self, records: Iterable[AttentionRecord] = (), info: Mapping[str, Any] | None = None) -> None:
        self._records: list[AttentionRecord] = list(records)
        stray = next(((i, r) for i, r in enumerate(self._records) if not isinstance(r, AttentionRecord)), None)
        if stray is not None:
            raise TypeError(
                f"Capture() takes AttentionRecords (e.g. records of another capture), got "
                f"{type(stray[1]).__name__} at position {stray[0]}"
            )
        self._info = MappingProxyType(dict(info or {}))

    def __reduce__(self):
        # pickle (torch.save, multiprocessing) cannot store the read-only info view: store a dict
        return (Capture, (self._records, dict(self._info)))

    # -- sequence protocol ---------------------------------------------------------------
    @overload
    def __getitem__(self, index: int) -> AttentionRecord: ...
    @overload
    def __getitem__(self, index: slice) -> Capture: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return Capture(self._records[index], self._info)
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise TypeError(
                f"index a Capture with an int or a slice, got {type(index).__name__}; "
                "use cap.select(layers=..., heads=...) or cap.record(layer) to pick by layer"
            )
        return self._records[operator.index(index)]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self):
        return iter(self._records)

    def _append(self, record: AttentionRecord) -> None:  # session only
        self._records.append(record)

    # -- facts -----------------------------------------------------------------------------
    @property
    def info(self) -> Mapping[str, Any]:
        """What was captured from: model class, attention layers found, the selection (read-only)."""
        return self._info

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer numbers present, sorted."""
        return tuple(sorted({r.layer for r in self._records}))

    @property
    def nbytes(self) -> int:
        """Bytes held by all records."""
        return sum(r.nbytes for r in self._records)

    # -- selection -------------------------------------------------------------------------
    def select(self, *, layers=None, heads=None, kind: str | None = None, calls=None, steps=None) -> Capture:
        """A new Capture with the matching records.

        ``layers`` are the model's layer numbers, negative ones counted from the end of the model's attention
        layers (as in ``capture``). ``heads`` (model head numbers) restricts the tensors: a view for a run of
        consecutive stored heads, one copy otherwise.
        """
        layer_set = None if layers is None else {self._layer_number(n) for n in int_list(layers, "layers")}
        call_set = None if calls is None else set(int_list(calls, "calls"))
        step_set = None if steps is None else set(int_list(steps, "steps"))
        head_tuple = None if heads is None else int_list(heads, "heads")
        if kind not in (None, "self", "cross"):
            raise SelectionError(f"kind must be 'self', 'cross' or None, got {kind!r}")
        out = []
        for r in self._records:
            if layer_set is not None and r.layer not in layer_set:
                continue
            if kind is not None and r.kind != kind:
                continue
            if call_set is not None and r.call not in call_set:
                continue
            if step_set is not None and r.step not in step_set:
                continue
            if head_tuple is not None:
                r = select_record_heads(r, head_tuple)
            out.append(r)
        return Capture(out, self._info)

    def _layer_number(self, layer: int) -> int:
        if layer >= 0:
            return layer
        n = len(self._info.get("attention_modules", ()))
        if not n or layer + n < 0:
            raise SelectionError(
                f"layer {layer} cannot count from the end: "
                + (f"the model has {n} attention layer(s)" if n else "this Capture does not know the model's layers")
                + f"; captured layers: {list(self.layers)}"
            )
        return layer + n

    def record(self, layer: int, *, call: int = 0) -> AttentionRecord:
        """The one record of ``layer`` at call number ``call`` (negative layers count from the end)."""
        layer = self._layer_number(layer)
        for r in self._records:
            if r.layer == layer and r.call == call:
                return r
        raise NotCapturedError(
            f"no record for layer {layer}, call {call}; captured layers: {list(self.layers)}"
            + (
                f", calls of that layer: {[r.call for r in self._records if r.layer == layer]}"
                if any(r.layer == layer for r in self._records)
                else ""
            )
        )

    # -- frames (pandas is imported only here) ----------------------------------------------
    def to_frame(self, tokens=None, key_tokens=None, *, drop_padding: bool = False):
        """Tidy long frame: one row per (layer, call, head, batch, query_pos, key_pos). See ``frames.FRAME_SCHEMA``.

        ``query_padding`` marks padded query rows; ``drop_padding=True`` leaves them out."""
        from .outputs.frames import to_frame

        return to_frame(self, tokens=tokens, key_tokens=key_tokens, drop_padding=drop_padding)

    def image_tokens(self):
        """Which positions are image patches: an ``ImageTokens``, one ``ImageGrid`` per picture and stream of layers
        (positions, ``rows x cols`` grid, each patch's region of the picture), as given to ``capture(...,
        image_grid=)`` (``attnprobe.locate_image_tokens`` finds them from a processor's outputs; see the docs'
        "Attention on pictures"). ``ImageTokenError`` when the capture holds none."""
        from .outputs.image_tokens import capture_image_tokens

        return capture_image_tokens(self)

    def summary(self):
        """One row per (layer, head): entropy, max weight, mass on first key / diagonal / previous token,
        mass on keys that were not allowed, worst row-sum error; padded and empty query rows excluded."""
        from .outputs.frames import summary

        return summary(self)

    def to_parquet(self, path, *, tokens=None, key_tokens=None, overwrite: bool = False, drop_padding: bool = False):
        """Write ``to_frame()`` to a Parquet file (refuses an existing file unless ``overwrite``)."""
        from .outputs.frames import write_frame

        frame = self.to_frame(tokens, key_tokens, drop_padding=drop_padding)
        return write_frame(frame, path, format="parquet", overwrite=overwrite)

    def to_csv(
        self,
        path=None,
        *,
        tokens=None,
        key_tokens=None,
        overwrite: bool = False,
        formula_safe: bool = True,
        drop_padding: bool = False,
    ):
        """Write ``to_frame()`` as CSV; returns the text when ``path`` is None. Text a spreadsheet would
        evaluate (``=``, ``+``, ``-``, ``@``, tab, CR first) gets a leading ``'`` unless ``formula_safe=False``."""
        from .outputs.frames import write_frame

        frame = self.to_frame(tokens, key_tokens, drop_padding=drop_padding)
        return write_frame(frame, path, format="csv", overwrite=overwrite, formula_safe=formula_safe)

    # -- other viewers (bertviz, circuitsvis; neither is imported) ------------------------------
    def to_bertviz(self, batch: int = 0, *, tokens=None, key_tokens=None, call: int = 0) -> dict[str, Any]:
        """Keyword arguments for ``bertviz.head_view`` / ``model_view``: ``bertviz.head_view(**cap.to_bertviz())``.
        See ``attnprobe.probe.outputs.interop.to_bertviz``."""
        from .outputs.interop import to_bertviz

        return to_bertviz(self, batch, tokens=tokens, key_tokens=key_tokens, call=call)

    def to_circuitsvis(
        self, layer: int, batch: int = 0, *, tokens=None, call: int = 0, head_names: bool = False
    ) -> dict[str, Any]:
        """Keyword arguments for ``circuitsvis.attention.attention_patterns`` for one layer (negative counts from
        the end). See ``attnprobe.probe.outputs.interop.to_circuitsvis``."""
        from .outputs.interop import to_circuitsvis

        return to_circuitsvis(self, self._layer_number(layer), batch, tokens=tokens, call=call, head_names=head_names)

    # -- files (safetensors + JSON index; never pickle) -----------------------------------------
    def save(self, path, *, overwrite: bool = False):
        """Write this capture to the directory ``path`` (safetensors files plus a JSON index); returns the path.

        ``attnprobe.load(path)`` reads it back with memory-mapped tensors; nothing is pickled. An existing
        capture directory is replaced only with ``overwrite=True``, a folder of other files never. The folder is
        written under a temporary name and renamed into place when complete.
        """
        from .outputs.disk import save

        return save(self, path, overwrite=overwrite)

    def _repr_html_(self) -> str | None:
        """Notebook view: the HTML report's own page in a frame, bounded in size (see ``attnprobe.reports.inline``)."""
        from .display import repr_html

        return repr_html(self)

    def __repr__(self) -> str:
        model = self._info.get("model_class", "?")
        return f"<Capture of {model}: {len(self)} record(s), layers {list(self.layers)}, {self.nbytes:,} bytes>"


def load(path) -> Capture:
    """The ``Capture`` saved in directory ``path`` (by ``Capture.save`` or ``capture(..., store=path)``).

    Tensors are memory-mapped from the safetensors files: nothing is read until a tensor is used, so a
    capture larger than memory opens at once. Nothing is unpickled (see ``probe/outputs/disk.py`` for the format).

    Example::

        >>> import torch, attnprobe, tempfile, os
        >>> out, cap = attnprobe.run(attnprobe.MultiHeadAttention(8, num_heads=2), torch.randn(1, 4, 8))
        >>> folder = cap.save(os.path.join(tempfile.mkdtemp(), "cap"))
        >>> torch.equal(attnprobe.load(folder)[0].weights, cap[0].weights)
        True
    """
    from .outputs.disk import read

    records, info = read(path)
    return Capture(records, info)


def select_record_heads(record: AttentionRecord, heads: tuple[int, ...]) -> AttentionRecord:
    """The same record restricted to model heads ``heads`` (views where possible)."""
    positions = tuple(record.head_index(h) for h in heads)
    kv = kv_heads_for(heads, record.num_heads, record.num_kv_heads)
    missing = [h for h in kv if h not in record.kv_heads]
    kv_positions = tuple(record.kv_heads.index(h) for h in kv if h in record.kv_heads)
    changes: dict[str, Any] = {"heads": heads, "kv_heads": tuple(h for h in kv if h not in missing)}
    for f in ("q", "scores", "weights", "output"):
        t = getattr(record, f)
        if t is not None:
            changes[f] = index_heads(t, positions)[0]
    for f in ("k", "v"):
        t = getattr(record, f)
        if t is not None:
            changes[f] = index_heads(t, kv_positions)[0]
    if record.allowed is not None and record.allowed.shape[1] > 1:
        changes["allowed"] = index_heads(record.allowed, positions)[0]
    if record.sinks is not None:
        changes["sinks"] = index_heads(record.sinks, positions, axis=0)[0]
    if record.stats is not None:  # every statistic is (batch, head, ...)
        changes["stats"] = {name: index_heads(t, positions)[0] for name, t in record.stats.items()}
    return replace(record, **changes)


class CaptureSession:
    """Finds attention in a model, attaches every adapter's hooks, and turns calls into records.

    ``adapters`` are tried in order (a module claimed by one is not offered to the next); ``attnprobe.capture``
    passes ``hooks.default_adapters()``. Adapters use the session as a ``probe.interface.Session``.
    ``store``: a directory the records are written to as they are made (``disk.RecordWriter``).
    ``image_grid``: the image tokens of the input (``probe.outputs.image_tokens.as_image_tokens`` takes it).
    ``compiled``: the model is called from code compiled outside it (``capture(compiled=True)``).
    """

    def __init__(
        self,
        model: nn.Module,
        selection: Selection,
        adapters: Sequence[Adapter],
        *,
        store=None,
        overwrite: bool = False,
        image_grid=None,
        compiled: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UnsupportedModelError(
                f"capture() needs a torch.nn.Module, got {type(model).__name__}; pass the model itself, "
                "not its output or a pipeline (for a pipeline use pipeline.model)"
            )
        self.model_class = type(model).__name__
        self.stats_missing: list[int] = []  # layers whose statistics could not be computed (keep=("stats",))
        self._workspace: dict = {}  # the statistics engine's block buffers, reused by every record; freed on exit
        self._extras_state: Any = None  # capture(eviction=, spans=): the plan, the spans and each layer's prompt state
        self._model: nn.Module | None = model  # dropped on exit; the Capture never holds it
        self._compiled: list[str] = []  # read from the walk when the capture opens
        if not isinstance(compiled, bool):
            raise SelectionError(f"compiled must be True or False, got {compiled!r}")
        self._called_compiled = compiled  # the whole model runs in code compiled outside it
        self.selection = selection
        self.store = Store(selection)
        self.adapters = list(adapters)
        self.sites: list[Site] = []
        self.capture = Capture()
        self.static_sites = 0  # sites found before the run; adapters may add more while it runs
        self._named: ModuleWalk | None = None  # (name, module) of the model, walked once per discover()
        self._intents: dict[int, Intent | None] = {}  # id(site) -> what its module declares, read once
        self._stack: ExitStack | None = None
        self.thread = threads.current()  # the thread that opened the capture: only its calls are recorded
        self.disk = None  # a RecordWriter when records go to a directory (store=)
        # which positions are image patches (capture(image_grid=)): kept in the info; statistics get image_mass
        self.image_tokens = None if image_grid is None else as_image_tokens(image_grid)
        if store is not None:
            from .outputs.disk import RecordWriter

            self.disk = RecordWriter(store, overwrite=overwrite)  # refuses an existing target before the run

    @property
    def walk(self) -> ModuleWalk | None:
        """The model's modules as walked when the capture opened (None before and after): adapters read the tree
        from it rather than walking it again."""
        return self._named

    @property
    def compiled(self) -> list[str]:
        """Names of the model's modules compiled with ``torch.compile`` (adapters make their hooks reach them)."""
        return self._compiled

    # -- lifecycle -------------------------------------------------------------------------
    def discover(self) -> list:
        """Ask every adapter for its sites; number them in module order. Attaches nothing."""
        model = self._require_model()
        named = self._named = ModuleWalk(model)  # walked once, shared by the adapters and what they derive
        self._compiled = compiled_modules(model, named) or (["<root>"] if self._called_compiled else [])
        order = {id(m): i for i, (_, m) in enumerate(named)}
        claimed: set[int] = set()
        self._found = []
        for adapter in self.adapters:
            sites = adapter.find_named(model, named, claimed)
            claimed.update(id(s.module) for s in sites)
            self._found.append((adapter, sites))
        self.sites = sorted(
            (s for _, sites in self._found for s in sites), key=lambda s: order.get(id(s.module), 1 << 30)
        )
        for layer, site in enumerate(self.sites):
            site.layer = layer
        return self.sites

    def _require_model(self) -> nn.Module:
        if self._model is None:
            raise SelectionError(
                "this capture has already run and let go of its model (its records stay on the Capture it "
                "returned); start a new one: `with attnprobe.capture(model, ...) as cap:`"
            )
        return self._model

    def __enter__(self) -> Capture:
        if self._stack is not None:
            raise SelectionError(
                "this capture is already active: a `with` block cannot enter the same capture again. "
                "For a second, nested capture of the same model create another one: "
                "`with attnprobe.capture(model, ...) as inner:`"
            )
        model = self._require_model()
        self.discover()
        found = self._found
        claimed = {id(s.module) for s in self.sites}
        may_grow = any(a.dynamic and a.may_find_more(model, claimed) for a in self.adapters)
        scripted = scripted_modules(model, self._named)
        if scripted and not self.sites and not may_grow:
            raise UnsupportedModelError(
                f"{self.model_class} runs TorchScript ({', '.join(map(repr, scripted[:3]))} made with "
                "torch.jit.script/trace): its code runs inside the TorchScript interpreter, where no hook or torch "
                "function mode can see attention. Capture the Python module before scripting it (outputs are the same)"
            )
        if scripted:
            warn_user(
                f"{', '.join(map(repr, scripted[:3]))} in {self.model_class} run TorchScript "
                "(torch.jit.script/trace): attention inside them cannot be seen and is not recorded; capture the "
                "Python modules before scripting"
            )
        if not self.sites and not may_grow:
            raise NoAttentionError(
                f"no attention found in {self.model_class}. attnprobe reads its own MultiHeadAttention, Hugging Face "
                "attention modules, torch.nn.MultiheadAttention, and F.scaled_dot_product_attention calls it can see "
                "in the model's code. A call reached indirectly (through a function kept in a dict or an attribute, "
                "e.g. self.attn_fn) is found only with capture(model, modules='auto'), which intercepts every call "
                "(slower). For hand-written softmax(q @ k) attention, name the modules that compute it: "
                "capture(model, modules=[...]), or use modules='auto'",
                model_class=self.model_class,
            )
        self.static_sites = len(self.sites)
        self.selection = self.selection.resolve_layers(self.layer_count(), may_grow=may_grow)
        self.store.selection = self.selection
        for site in self.sites:
            self.select_site(site)
        self.capture = Capture(info=self._info())

        self._stack = ExitStack()
        try:
            self.thread = threads.current()  # hooks let other threads' calls pass (threads.elsewhere)
            held = threads.claim([model, *(s.module for s in self.sites)], self.model_class)
            self._stack.callback(threads.release, held)
            if self.disk is not None:
                self.disk.open()
            for adapter, sites in found:
                if sites or adapter.dynamic:
                    adapter.attach(self, model, sites, self._stack)
        except BaseException:
            self._stack.close()
            if self.disk is not None:
                self.disk.abort()
            raise
        return self.capture

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._stack is not None:  # reverse order, also when the forward raised; the undo steps see the
                self._stack.__exit__(exc_type, exc, tb)  # exception (torch runs no hook for a Ctrl-C)
        finally:
            self._stack = None
            self._model = None
            self._named = None
            self._workspace = {}
        if len(self.sites) != len(self.capture.info["attention_modules"]):  # sites found while the model ran
            self.capture._info = MappingProxyType(self._info())
        if self.disk is not None:
            if exc_type is None:
                self.disk.close(self.capture.info)  # the index, then the folder renamed into place
            else:  # nothing half-written is left (a previous capture there stays); the records in memory stay usable
                self.disk.abort()
        n = self.layer_count()
        missing = sorted(layer for layer in (self.selection.layers or ()) if layer >= n)
        if exc_type is None and missing:  # layer numbers past the model's, accepted only in case they appeared
            raise SelectionError(
                f"layer {missing[0]} is out of range: the model has {n} attention layer(s), numbered 0 to {n - 1} "
                f"({self.static_sites} found before the run, {n - self.static_sites} while it ran); "
                "negative numbers count from the end of the layers found before the run"
            )
        if exc_type is None and self.stats_missing:
            layers = sorted(set(self.stats_missing))
            warn_user(
                f"keep=('stats',) could not compute statistics for layer(s) {layers[:12]}: their adapter observed "
                "neither q and k nor the weights (record.stats is None there, and check() says so). Statistics are "
                "computed from q and k for Hugging Face attention and scaled_dot_product_attention calls, and from the "
                "weights for own modules, nn.MultiheadAttention, hand-written softmax and output_attentions models",
            )
        if exc_type is None and not self.selection.idle and self._compiled:
            silent = [s.name or "<root>" for s in self.sites[: self.static_sites] if s.selected and not s.calls]
            if not len(self.capture) or silent:
                what = "nothing was recorded" if not len(self.capture) else f"no call of {silent[:5]} was recorded"
                warn_user(
                    f"{self.model_class} is compiled with torch.compile ({', '.join(self._compiled[:3])}) and {what}: "
                    "compiled code may run without attnprobe's hooks and function mode (its outputs are not "
                    "changed). Capture and call the module before compilation (`compiled._orig_mod`, or the "
                    "module before `.compile()`)"
                )
                return
        if exc_type is None and not self.selection.idle and not self.sites:
            warn_user(
                f"no attention found in {self.model_class} while the capture was open (was the model called inside "
                "the `with` block?). attnprobe reads its own MultiHeadAttention, Hugging Face attention modules, "
                "torch.nn.MultiheadAttention and F.scaled_dot_product_attention calls it can see in the model's code; "
                "a call reached indirectly (a function kept in a dict or an attribute) needs capture(model, "
                "modules='auto'), and hand-written softmax attention is read when you ask for it: "
                "capture(model, modules=[...]) or modules='auto'"
            )
        elif (
            exc_type is None
            and not self.selection.idle
            and len(self.capture) == 0
            and any(s.selected for s in self.sites)
        ):
            warn_user(
                f"the capture of {self.model_class} saw no attention call: the model was not called inside "
                "the `with` block, or the selected layers never ran"
                + (
                    ", or it was called through code compiled before the capture (torch.compile(model) in its "
                    "place): capture the compiled module, or pass capture(..., compiled=True)"
                    if "torch._dynamo" in sys.modules and not self._compiled
                    else ""
                )
            )

    def _info(self) -> dict[str, Any]:
        sel = self.selection
        images = {} if self.image_tokens is None else {"image_tokens": self.image_tokens.to_json()}
        return {
            **images,
            "model_class": self.model_class,
            "attention_modules": tuple(s.name for s in self.sites),
            "num_heads": tuple(s.num_heads for s in self.sites),
            "num_kv_heads": tuple(s.num_kv_heads for s in self.sites),
            "adapters": tuple(sorted({s.adapter.name for s in self.sites})),
            "selection": {
                "layers": sel.layers,
                "heads": sel.heads if sel.heads_by_layer is None else dict(sel.heads_by_layer),
                "keep": tuple(f for f in KEEP_NAMES if f in sel.keep),
                "device": str(sel.device),
                "dtype": None if sel.dtype is None else str(sel.dtype).replace("torch.", ""),
                "max_bytes": sel.max_bytes,
            },
        }

    def layer_count(self) -> int:
        """How many attention layers the model has (the sites found so far; a sharded session counts every
        process's)."""
        return len(self.sites)

    def label(self, record: AttentionRecord) -> AttentionRecord:
        """The record as the Capture keeps it (a sharded session puts the model's head numbers on it)."""
        return record

    def select_site(self, site) -> None:
        site.selected = self.selection.wants(site.layer)
        if site.selected and site.num_heads is not None:
            site.heads = self.selection.heads_for(site.layer, site.num_heads, where=f"({site.name!r})")
            site.kv_heads = kv_heads_for(site.heads, site.num_heads, site.num_kv_heads or site.num_heads)

    def add_site(self, site) -> None:
        """Register a site found while the model runs (dynamic adapters); it gets the next layer number."""
        site.layer = len(self.sites)
        self.sites.append(site)
        self.select_site(site)

    def intent_of(self, site) -> Intent | None:
        """What ``site``'s module declares about causality (``probe.intent``), read once per site."""
        if id(site) not in self._intents:
            self._intents[id(site)] = None if site.module is None else module_intent(site.module)
        return self._intents[id(site)]

    # -- recording -------------------------------------------------------------------------
    def wants(self, site, field: str | None = None) -> bool:
        """Whether ``site`` is selected (and, with ``field``, whether that tensor is kept). ``"stats"``: whether the
        adapter's ``AttentionCall`` is wanted: for the statistics, and for a full capture of selected rows, whose
        scores and weights are computed from it for those rows alone."""
        if field == "stats" and self.selection.rows is not None and {"scores", "weights"} & self.selection.keep:
            return site.selected
        return site.selected and (field is None or field in self.selection.keep)

    def emit(
        self,
        site,
        *,
        kind: str,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        preselected: Iterable[str] = (),
        **values: Any,
    ) -> AttentionRecord | None:
        """Build, budget and store one record for ``site``.

        Tensor values (q, k, v, scores, weights, output, allowed) come in full-head layout unless
        named in ``preselected`` or given as ``Lazy`` (both already restricted to ``site.heads`` /
        ``site.kv_heads``). Other keyword values are record fields. Returns None for unselected sites, and for calls
        made while autograd runs backward (activation checkpointing recomputes calls the forward recorded).
        """
        if threads.in_backward():
            return None
        call = site.calls
        site.calls += 1
        if not site.selected:
            return None
        if num_heads is not None and site.num_heads is None:
            site.num_heads, site.num_kv_heads = num_heads, num_kv_heads or num_heads
            self.select_site(site)
        if site.heads is None or site.kv_heads is None or site.num_heads is None:
            raise UnsupportedModelError(f"adapter {site.adapter.name!r} did not say how many heads {site.name!r} has")
        layout = _Heads(site.num_heads, site.num_kv_heads or site.num_heads, site.heads, site.kv_heads)
        tensors = {f: values.pop(f, None) for f in TENSOR_FIELDS}
        masks = {f: values.pop(f, None) for f in ("allowed", "query_padding", "sinks")}
        identified = values.pop("identified", None)
        if identified is None:
            named = (*tensors.items(), ("allowed", masks["allowed"]), ("query_padding", masks["query_padding"]))
            identified = frozenset(f for f, t in named if t is not None)
        stats_call = values.pop("stats", None)
        adapter_allowed = masks["allowed"]
        if self.stats_only:  # (batch, head, query, key): what a statistics capture never holds; stats hold its facts
            masks["allowed"] = None
        rows = self._selected_rows(tensors, masks, stats_call, values)
        extras = self._extras(site, layout, kind, stats_call, tensors, values, masks["query_padding"], rows)
        if rows is not None and self.stats_only and rows.numel() == 0:
            return None  # none of this call's rows is selected (the prompt of rows="generated"): no record
        if rows is not None and not self.stats_only:  # a full capture: one record per run of selected rows
            # cut one run at a time, as it is stored
            parts: Iterable = (
                (_cut_rows(tensors, masks, values, stats_call, a, b), torch.arange(a, b)) for a, b in runs(rows)
            )
        else:
            parts = [((tensors, masks, values), rows)]
        record = None
        for part, stats_rows in parts:
            record = self._store_record(
                site,
                call,
                layout,
                part,
                kind=kind,
                identified=identified,
                preselected=set(preselected),
                stats_call=stats_call,
                stats_rows=stats_rows,
                adapter_allowed=adapter_allowed,
                extras=extras,
                call_context=(values.get("query_offset", 0), masks["query_padding"]),
            )
        return record

    def _store_record(
        self,
        site: Site,
        call: int,
        layout: _Heads,
        part: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
        *,
        kind: str,
        identified,
        preselected: set[str],
        stats_call,
        stats_rows: torch.Tensor | None,
        adapter_allowed,
        extras: tuple[dict, dict],
        call_context: tuple[int, Any],
    ) -> AttentionRecord:
        """Plan, budget and copy one record's tensors (every row, or one run of selected rows), with its statistics.
        ``stats_rows``: the call's rows the statistics describe (None: every row); ``call_context``: the whole call's
        query offset and query padding (a run's own are cut)."""
        tensors, masks, values = part
        # plan every copy first, with its exact stored size, so the budget fails before any memory is spent
        plan = self._plan(site, tensors, masks, preselected)
        self._reserve(site, call, plan, tensors, values.get("step"))
        stored = self._copy(site, call, plan)
        if "stats" in self.selection.keep:
            stored["stats"] = self._stats(
                site,
                call,
                layout=layout,
                stats_call=stats_call,
                tensors=tensors,
                stored=stored,
                kind=kind,
                values=values,
                query_padding=masks["query_padding"],
                allowed=adapter_allowed,
                sinks=masks["sinks"],
                rows=stats_rows,
                extras=extras,
                call_context=call_context,
            )
        return self._record(site, call, layout, kind=kind, identified=identified, stored=stored, values=values)

    def _selected_rows(self, tensors, masks, stats_call, values) -> torch.Tensor | None:
        """The call's query rows ``capture(rows=)`` selects (ascending), or None for every row."""
        selection = self.selection.rows
        if selection is None:
            return None
        if stats_call is not None:
            q_len = stats_call.shape[2]
        else:
            shaped = [t for f in ("weights", "scores", "q", "output") if (t := tensors.get(f)) is not None]
            if not shaped and masks.get("query_padding") is None:
                return None
            q_len = int(shaped[0].shape[2]) if shaped else int(masks["query_padding"].shape[1])
        return selection.resolve(q_len, step=values.get("step"))

    def _plan(
        self, site: Site, tensors: dict[str, Any], masks: dict[str, Any], preselected: set[str]
    ) -> list[tuple[str, Any, tuple[int, ...] | None, int, int]]:
        """Every copy a record needs: ``(field, tensor or Lazy, head index or None, head axis, stored bytes)``."""
        plan = []
        for f, t in (*tensors.items(), *masks.items()):
            if t is None or (f in tensors and f not in self.selection.keep):
                continue
            if isinstance(t, Lazy) or f in preselected or f == "query_padding":
                index, axis = None, 1
            elif f == "sinks":
                index, axis = site.heads, 0
            elif f == "allowed":
                index, axis = (site.heads if t.shape[1] > 1 else None), 1
            else:
                index, axis = (site.kv_heads if f in ("k", "v") else site.heads), 1
            plan.append((f, t, index, axis, self.store.planned_bytes(t.shape, t.dtype, index, axis)))
        return plan

    def _reserve(self, site: Site, call: int, plan: list, tensors: dict[str, Any], step: int | None) -> None:
        """Take the plan's bytes from the budget (an error naming the layer, call and fields when they do not fit)."""
        self.store.reserve(
            sum(p[4] for p in plan),
            f"layer {site.layer} ({site.name or type(site.module).__name__!r}, call {call}"
            + ("" if step is None else f", generation step {step}")
            + f": {', '.join(p[0] for p in plan) or 'nothing'})",
            fields={p[0] for p in plan if p[0] in tensors},
            dtypes=[p[1].dtype for p in plan],
            heads=len(site.heads or ()),
        )

    def _copy(self, site: Site, call: int, plan: list) -> dict[str, Any]:
        """The planned copies, made: the selected heads of each tensor, in the storage device and dtype."""
        stored: dict[str, Any] = {}
        with ExitStack() as modes:
            if torch.is_inference_mode_enabled():  # records hold ordinary tensors, usable after the block
                modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.no_grad())  # copies (and Lazy math) never join the model's graph
            for f, t, index, axis, planned in plan:
                if isinstance(t, Lazy):
                    stored[f] = self.store.put_fresh(t.fn(), t.dtype, planned, f"layer {site.layer}, call {call}: {f}")
                else:
                    stored[f] = self.store.put(t, index, axis)
        return stored

    def _record(
        self,
        site: Site,
        call: int,
        layout: _Heads,
        *,
        kind: str,
        identified,
        stored: dict[str, Any],
        values: dict[str, Any],
    ) -> AttentionRecord:
        """The record of one call, appended to the capture (written to disk first with ``store=``)."""
        intent = self.intent_of(site)
        if intent is not None and intent.causal:  # what the module's own code declares (probe/intent.py)
            values["meta"] = {**values.get("meta", {}), "declared_causal": intent.source}
        record: AttentionRecord = AttentionRecord(
            name=site.name,
            layer=site.layer,
            call=call,
            kind=cast(RecordKind, kind),  # AttentionRecord refuses anything but "self" and "cross"
            num_heads=layout.num_heads,
            num_kv_heads=layout.num_kv_heads,
            heads=layout.heads,
            kv_heads=layout.kv_heads,
            identified=frozenset(identified),
            **stored,
            **values,
        )
        record = self.label(record)
        if self.disk is not None:  # written now; the Capture keeps the memory-mapped copy, this one is dropped
            record = self.disk.write(record)
        self.capture._append(record)
        return record

    @property
    def stats_only(self) -> bool:
        """A statistics capture that keeps no (query, key) tensor (``keep=("stats", ...)`` without scores/weights)."""
        keep = self.selection.keep
        return "stats" in keep and not ({"scores", "weights"} & keep)

    def _stats(
        self,
        site: Site,
        call: int,
        *,
        layout: _Heads,
        stats_call,
        tensors,
        stored,
        kind,
        values,
        query_padding,
        allowed,
        sinks,
        rows: torch.Tensor | None = None,
        extras: tuple[dict, dict] = ({}, {}),
        call_context: tuple[int, Any] = (0, None),
    ) -> dict[str, torch.Tensor] | None:
        """The per-row statistics of one record: blockwise from the adapter's ``AttentionCall`` (q, k and the
        call's own mask, bias, softcapping, sinks and scaling), or, from an adapter that hands over only full
        weights, from those (said in ``meta["stats_source"]``). None when neither exists. ``rows``: the call's rows
        they describe (``capture(rows=)``; None: every row, or ``stats_rows=``'s sample); ``extras``: what
        ``eviction=``/``spans=`` computed for the call (added as they are)."""
        own_rows = rows is not None and not self.stats_only  # a run of a full capture: the record's own rows
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if stats_call is not None:
                offset, padding = call_context
                image_keys = functools.partial(self._image_keys, site.name, call, kind, offset)
                got = self._stats_blockwise(stats_call, kind, offset, padding, rows, image_keys, values)
            else:
                image_keys = functools.partial(self._image_keys, site.name, call, kind, values.get("query_offset", 0))
                got = self._stats_of_weights(
                    layout,
                    tensors,
                    stored,
                    kind,
                    values,
                    query_padding,
                    allowed,
                    sinks,
                    None if own_rows else rows,
                    image_keys,
                )
        meta = dict(values.get("meta") or {})
        if got is None:
            values["meta"] = {**meta, "stats_source": "none"}
            self.stats_missing.append(site.layer)
            return None
        stats, source, described, (q_len, k_len) = got
        from .engine.stats import KEY_SET_STAT

        if KEY_SET_STAT in stats:  # each row's weight on the image patches
            stats = {("image_mass" if name == KEY_SET_STAT else name): t for name, t in stats.items()}
        meta["stats_source"] = source
        if described is not None and not own_rows:  # statistics of some of the call's rows: which, and of how many
            meta.update(stats_rows=described.tolist(), stats_query_len=q_len)
        overview = self.selection.overview
        if overview is not None and overview.windows:
            clip = [
                [min(q0, q_len), min(q1, q_len), min(k0, k_len), min(k1, k_len)] for q0, q1, k0, k1 in overview.windows
            ]
            meta["stats_windows"] = clip
        stats = {**stats, **extras[0]}
        values["meta"] = {**meta, **extras[1]}
        nbytes = sum(t.numel() * self.store.target_dtype(t.dtype).itemsize for t in stats.values())
        self.store.reserve(nbytes, f"layer {site.layer}, call {call}: stats")
        return {name: t.to(self.selection.device) for name, t in stats.items()}

    def _image_keys(self, name: str, call: int, kind: str, query_offset: int, shape) -> torch.Tensor | None:
        """``(batch, key)`` bool: the keys of a call of ``shape`` ``(batch, head, query, key)`` that are image patches
        (``capture(image_grid=)``); None without image tokens there."""
        if self.image_tokens is None:
            return None
        batch, _, q_len, k_len = shape
        key_start = max(query_offset + q_len - k_len, 0) if kind == "self" and k_len >= q_len else 0  # record.key_start
        return self.image_tokens.key_mask(name, call, batch, k_len, key_start)

    def _stats_blockwise(self, stats_call, kind: str, offset: int, query_padding, rows, image_keys, values) -> _Stats:
        """The engine's statistics of the adapter's ``AttentionCall`` (``capture(stats_engine=)`` picks it: the eager
        engine block by block, its native row pass, or the Triton kernel, said in ``values["meta"]["stats_engine"]``;
        ``rows``: of those only; None: every row, or ``stats_rows=``'s sample; ``image_keys(shape)``: the image
        patches among the keys, for ``image_mass``)."""
        from .engine.engines import statistics

        _, _, q_len, k_len = stats_call.shape
        kwargs = {} if self.selection.block_bytes is None else {"block_bytes": self.selection.block_bytes}
        rows = sampled_rows(q_len, self.selection.stats_rows) if rows is None else rows
        stats, engine = statistics(
            stats_call,
            engine=self.selection.stats_engine,
            diag_offset=_diag_offset(kind, offset, q_len, k_len),
            query_padding=query_padding,
            overview=self.selection.overview,
            rows=rows,
            workspace=self._workspace,
            key_set=image_keys(stats_call.shape),
            **kwargs,
        )
        if engine != "torch":
            values["meta"] = {**(values.get("meta") or {}), "stats_engine": engine}
        return stats, "blockwise", rows, (q_len, k_len)

    def _stats_of_weights(
        self, layout: _Heads, tensors, stored, kind: str, values, query_padding, allowed, sinks, rows, image_keys
    ):
        """The statistics of the full weights an adapter handed over (stored, given, or computed now from a
        ``Lazy``); None without weights. ``rows``: of those rows only (None: every row, or ``stats_rows=``'s)."""
        from .engine.pooling import pool_weights
        from .engine.stats import stats_from_weights

        heads = layout.heads
        weights = _selected(tensors, stored, "weights", heads)  # (batch, head, query, key)
        if weights is None:
            return None
        _, _, q_len, k_len = weights.shape
        al = allowed if allowed is None or allowed.shape[1] == 1 else index_heads(allowed, heads)[0]
        v_heads = kv_of_heads(heads, layout.num_heads, layout.num_kv_heads)
        v = _selected(tensors, stored, "v", v_heads) if tensors.get("v") is not None else None
        output = _selected(tensors, stored, "output", heads)
        rows = sampled_rows(q_len, self.selection.stats_rows) if rows is None else rows
        stats = stats_from_weights(
            weights,
            scores=_selected(tensors, stored, "scores", heads),
            allowed=al,
            v=v,
            output=None if v is None else output,
            diag_offset=_diag_offset(kind, values.get("query_offset", 0), q_len, k_len),
            query_padding=query_padding,
            rows=rows,
            sinks=None if sinks is None else index_heads(sinks, heads, 0)[0],
            key_set=image_keys(weights.shape),
        )
        if self.selection.overview is not None:
            stats = MappingProxyType({**stats, **pool_weights(weights, self.selection.overview)})
        return stats, "weights", rows, (q_len, k_len)

    def _extras(self, site: Site, layout: _Heads, kind: str, stats_call, tensors, values, query_padding, rows):
        """``(stats, meta)`` of ``capture(eviction=, spans=)`` for one call (empty without them)."""
        if self.selection.eviction is None and self.selection.spans is None:
            return {}, {}
        from .analyses.extras import CaptureExtras
        from .engine.kept_mass import CallRows, TensorRows

        if self._extras_state is None:
            self._extras_state = CaptureExtras(self.selection.eviction, self.selection.spans)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if stats_call is not None:
                source: Any = CallRows(stats_call)
            else:
                weights = _selected(tensors, {}, "weights", layout.heads)
                if weights is None:
                    return {}, {"eviction": {"skipped": "the adapter handed over neither q and k nor weights"}}
                source = TensorRows(weights)
            return self._extras_state.compute(
                site.layer,
                source,
                kind=kind,
                step=values.get("step"),
                query_offset=values.get("query_offset", 0),
                rows=rows,
                query_padding=query_padding,
                reordered=bool((values.get("meta") or {}).get("reordered_rows")),
            )


def _selected(tensors, stored, name: str, index):
    """Tensor ``name`` of the selected heads ``index``: the stored copy, or the adapter's (a ``Lazy`` computed now)."""
    t = stored.get(name) if name != "v" else None  # a stored v is per kv head
    if t is None:
        t = tensors.get(name)
        if isinstance(t, Lazy):
            t = t.fn()
        elif t is not None:
            t = index_heads(t.detach(), index)[0]
    return t


#: Fields with a query axis, and that axis (``query_padding`` is ``(batch, query)``).
QUERY_AXIS = {"q": 2, "scores": 2, "weights": 2, "output": 2, "allowed": 2, "query_padding": 1}


def cut_rows(t, a: int, b: int, axis: int):
    """Rows ``a:b`` along ``axis`` of a tensor (a view), of a ``Lazy`` (computed whole, then cut: the record keeps a
    copy of the rows), or None; a tensor of size 1 along the axis (a mask the same for every row) as it is."""
    if t is None:
        return None
    if isinstance(t, Lazy):
        shape = list(t.shape)
        shape[axis] = b - a
        whole = t.fn
        return Lazy(tuple(shape), t.dtype, lambda: whole().narrow(axis, a, b - a))
    return t if t.shape[axis] == 1 else t.narrow(axis, a, b - a)


def from_call(call, field: str, a: int, b: int, dtype: torch.dtype) -> Lazy:
    """``scores`` or ``weights`` of rows ``a:b`` as a ``Lazy`` computed from the adapter's ``AttentionCall`` for
    those rows alone: memory grows as rows x keys, not as the whole matrix."""
    from .engine.kept_mass import rows_scores, rows_weights

    B, h, _, Tk = call.shape
    fn = rows_weights if field == "weights" else rows_scores
    return Lazy((B, h, b - a, Tk), dtype, lambda: fn(call, a, b).to(dtype))


def _cut_rows(tensors, masks, values, stats_call, a: int, b: int):
    """``(tensors, masks, values)`` of query rows ``a:b`` of one call: every field with a query axis cut (recomputed
    scores and weights computed for those rows alone from the adapter's ``AttentionCall``), the record placed at
    ``query_offset + a``."""
    cut_tensors = {}
    for f, t in tensors.items():
        if f in QUERY_AXIS and isinstance(t, Lazy) and stats_call is not None and f in ("scores", "weights"):
            cut_tensors[f] = from_call(stats_call, f, a, b, t.dtype)
        else:
            cut_tensors[f] = cut_rows(t, a, b, QUERY_AXIS[f]) if f in QUERY_AXIS else t
    cut_masks = {f: cut_rows(t, a, b, QUERY_AXIS[f]) if f in QUERY_AXIS else t for f, t in masks.items()}
    return cut_tensors, cut_masks, {**values, "query_offset": values.get("query_offset", 0) + a}


class _Heads(NamedTuple):
    """The head layout of a site whose heads are known: what every record of it carries."""

    num_heads: int
    num_kv_heads: int
    heads: tuple[int, ...]
    """The selected query heads."""
    kv_heads: tuple[int, ...]
    """The kv heads they read."""


#: What a way to the statistics gives: (statistics, where they came from, the sampled rows or None, (query, key)).
_Stats = tuple[Mapping[str, torch.Tensor], str, torch.Tensor | None, tuple[int, int]]


def _diag_offset(kind: str, query_offset: int, q_len: int, k_len: int) -> int | None:
    """Key index of query 0's own key (self-attention), as the checks place queries; None otherwise."""
    if kind != "self":
        return None
    offset = query_offset if query_offset + q_len <= k_len else k_len - q_len
    return offset if offset >= 0 else None


def compiled_modules(model: nn.Module, named: list | None = None) -> list[str]:
    """Names of ``model``'s modules compiled with ``torch.compile`` (wrapped, or ``module.compile()``); ``named``:
    its ``named_modules()``, if walked already."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported here: no compile, no dynamo
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return [
        name or "<root>"
        for name, m in (model.named_modules() if named is None else named)
        if (wrapper is not None and isinstance(m, wrapper)) or getattr(m, "_compiled_call_impl", None) is not None
    ]


def scripted_modules(model: nn.Module, named: list | None = None) -> list[str]:
    """Names of the outermost TorchScript modules in ``model`` (their code is opaque to hooks and modes)."""
    found: list[str] = []
    for name, m in model.named_modules() if named is None else named:
        if isinstance(m, torch.jit.ScriptModule) and not any(name.startswith(f + ".") or f == "<root>" for f in found):
            found.append(name or "<root>")
    return found


@dataclass(frozen=True)
class AttentionModule:
    """One attention module a capture would read (see ``attention_modules``)."""

    layer: int
    name: str
    module_class: str
    num_heads: int | None
    num_kv_heads: int | None
    adapter: str
    strategy: str
    """How the capture reads it, e.g. "hook points" or "wraps the sdpa attention function"."""
    backend: str | None = None
