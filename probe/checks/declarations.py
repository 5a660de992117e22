"""What the user declares to ``check``, validated once, with clear errors.

``causal=`` and ``attention_mask=`` hold the record to causality and padding. The others say what the attention
should be, each a shorthand for one FlexAttention-style predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool``
(``probe/checks/predicate.py`` evaluates them block by block):

- ``documents``: per-token document ids ``(batch, seq)`` (each contiguous run of one id is one document), or
  ``"position_ids"``: the documents the position ids the model received restart at;
- ``prefix_length``: prefix-LM, the first ``n`` tokens see each other (an int, or one per batch row);
- ``bidirectional``: per-token block ids ``(batch, seq)``, 0 = none, each contiguous run of one nonzero id a block
  whose tokens see each other (Gemma 3's ``token_type_ids`` work as they are), or ``[(start, end), ...]`` spans;
- ``sliding_window``: a key more than ``W - 1`` positions before the query is masked (``q - kv < W``);
- ``chunk_size``: Llama 4-style chunked attention (a query sees the keys of its own chunk);
- ``mask_fn``: any ``mask_mod(b, h, q_idx, kv_idx) -> bool``, the universal form;
- ``scale``: the softmax scale the model should use.

Each is given for every layer, or as ``{layer: value}``. ``Declared`` holds them validated; ``declarations_fit``
checks them against the records (batch sizes, lengths) before any check runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..errors import DeclarationError, warn_user
from ..record import AttentionRecord


def declared_for(value, record: AttentionRecord):
    """A declaration given for every layer, or as ``{layer: value}``."""
    if isinstance(value, Mapping):
        return value.get(record.layer)
    return value


_MASK_FORM = "the input padding mask (batch, key) with 1 = real token and 0 = padding (the Hugging Face convention)"


def mask_tensor(mask, what: str) -> torch.Tensor:
    """A declared padding mask as bool ``(batch, key)``, True = real token; a clear error for anything else."""
    if isinstance(mask, Mapping):
        hint = (
            " (this looks like a tokenizer's output: pass inputs['attention_mask'])"
            if "attention_mask" in mask or "input_ids" in mask
            else ""
        )
        raise TypeError(f"{what} must be {_MASK_FORM}, got a {type(mask).__name__}{hint}")
    if not isinstance(mask, torch.Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what} must be {_MASK_FORM}, got a {type(mask).__name__}") from exc
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if mask.dim() != 2:
        raise ValueError(
            f"{what} must be {_MASK_FORM}, got shape {tuple(mask.shape)}; a 4-D mask is the model's own "
            "business: checks read it from the record"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or not (mask.is_floating_point() or mask.dtype in _INTEGER_DTYPES):
        raise TypeError(f"{what} must be {_MASK_FORM}, got dtype {mask.dtype}")
    values = torch.unique(mask)
    if not bool(((values == 0) | (values == 1)).all()):
        shown = ", ".join(f"{x:g}" for x in values[:6].tolist()) + (", ..." if len(values) > 6 else "")
        raise ValueError(
            f"{what} must hold 1 for real tokens and 0 for padding (or True/False), got values {shown}: pass "
            "the tokenizer's attention_mask (not input_ids, nor an additive mask of 0 and -inf)"
        )
    return mask != 0


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

#: What each declaration takes, in the words its errors use.
EXPECTED: dict[str, str] = {
    "documents": "per-token document ids (batch, seq) of integers, or 'position_ids'",
    "prefix_length": "a whole number >= 0, or one per batch row (batch,)",
    "bidirectional": "per-token block ids (batch, seq) of integers >= 0 (0 = none), or a list of (start, end) spans "
    "with 0 <= start < end",
    "sliding_window": "a whole number >= 1 (a key more than W - 1 positions before the query is masked)",
    "chunk_size": "a whole number >= 1",
    "mask_fn": "a callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor (FlexAttention's signature)",
    "scale": "a positive finite number (the factor applied to q @ k)",
}


def _refuse(name: str, layer, got: str) -> DeclarationError:
    where = "" if layer is None else f"[{layer}]"
    expected = EXPECTED[name]
    return DeclarationError(
        f"{name}{where} must be {expected}; got {got}",
        declaration=name,
        expected=expected,
        layer=layer,
        problem=f"{name}{where}: got {got}",
    )


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(name: str, layer, value, *, nonnegative: bool) -> torch.Tensor:
    """Per-token ids ``(batch, seq)`` as a long CPU tensor (a 1-D one is one batch row)."""
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise _refuse(name, layer, _described(value)) from None
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] == 0 or not (t.dtype == torch.bool or t.dtype in _INTEGER_DTYPES):
        raise _refuse(name, layer, _described(t))
    t = t.detach().to("cpu", torch.long)
    if nonnegative and bool((t < 0).any()):
        raise _refuse(name, layer, f"negative ids ({int(t.min())})")
    return t


def _documents(layer, value):
    if isinstance(value, str):
        if value != "position_ids":
            raise _refuse("documents", layer, f"the string {value!r}")
        return value
    return _ids("documents", layer, value, nonnegative=False)


def _prefix(layer, value):
    if _whole(value):
        if value < 0:
            raise _refuse("prefix_length", layer, str(value))
        return int(value)
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise _refuse("prefix_length", layer, _described(value)) from None
    if t.dim() != 1 or t.dtype not in _INTEGER_DTYPES or bool((t < 0).any()):
        raise _refuse("prefix_length", layer, _described(t))
    return t.detach().to("cpu", torch.long)


def _spans(value) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(s, tuple) and len(s) == 2 and all(_whole(x) for x in s) for s in value)
    )


def _bidirectional(layer, value):
    if _spans(value):
        spans = tuple(sorted((int(s), int(e)) for s, e in value))
        for (s, e), nxt in zip(spans, spans[1:] + ((math.inf, math.inf),)):
            if not 0 <= s < e or e > nxt[0]:
                raise _refuse("bidirectional", layer, f"the spans {list(spans)} (empty, negative or overlapping)")
        return spans
    return _ids("bidirectional", layer, value, nonnegative=True)


def _positive_whole(name: str):
    def one(layer, value):
        if not _whole(value) or value < 1:
            raise _refuse(name, layer, _described(value))
        return int(value)

    return one


def _scale(layer, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _refuse("scale", layer, _described(value))
    return float(value)


def _mask_fn(layer, value):
    if not callable(value):
        raise _refuse("mask_fn", layer, _described(value))
    index = torch.zeros(1, 1, 1, 1, dtype=torch.long)  # b, h, q_idx, kv_idx: broadcastable, one each
    try:
        out = value(index, index, index, index)
    except Exception as exc:  # a mask_fn that raises is refused with what it raised
        raise _refuse("mask_fn", layer, f"a function that raised {type(exc).__name__}: {exc} at (0, 0, 0, 0)") from exc
    if not (isinstance(out, bool) or (isinstance(out, torch.Tensor) and out.dtype == torch.bool)):
        raise _refuse("mask_fn", layer, f"a function that returned {_described(out)} at (0, 0, 0, 0)")
    return value


_ONE: dict[str, Callable[[Any, Any], Any]] = {
    "documents": _documents,
    "prefix_length": _prefix,
    "bidirectional": _bidirectional,
    "sliding_window": _positive_whole("sliding_window"),
    "chunk_size": _positive_whole("chunk_size"),
    "mask_fn": _mask_fn,
    "scale": _scale,
}


@dataclass(frozen=True)
class Declared:
    """Everything declared to one ``check``, validated: each value is for every layer, or ``{layer: value}``."""

    causal: Any = None
    attention_mask: Any = None
    documents: Any = None
    prefix_length: Any = None
    bidirectional: Any = None
    sliding_window: Any = None
    chunk_size: Any = None
    mask_fn: Any = None
    scale: Any = None

    def of(self, name: str, record: AttentionRecord):
        """The value of declaration ``name`` for ``record``'s layer (None: not declared there). A ``mask_fn`` for
        every layer concerns self-attention only (as ``causal=`` does); ``{layer: fn}`` concerns that layer."""
        value = getattr(self, name)
        if name == "mask_fn" and not isinstance(value, Mapping) and record.kind != "self":
            return None
        return declared_for(value, record)

    def shapes(self, record: AttentionRecord) -> tuple[str, ...]:
        """The declarations beyond ``causal``/``attention_mask``/``scale`` given for ``record``'s layer: those that
        state which keys a query must see (``reach`` holds the record to all of them)."""
        return tuple(n for n in STRUCTURAL if self.of(n, record) is not None)

    def given(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)


#: Declarations that say which keys a query sees (beyond causal and padding).
STRUCTURAL = ("documents", "prefix_length", "bidirectional", "sliding_window", "chunk_size", "mask_fn")


def validate_declarations(causal, attention_mask, **others) -> Declared:
    """All declarations validated (``others``: ``documents=``, ``prefix_length=``, ... as ``check`` takes them);
    a ``DeclarationError`` (or, for ``causal``/``attention_mask``, the ``TypeError``/``ValueError`` they always
    raised) naming what was expected."""
    items = causal.items() if isinstance(causal, Mapping) else [(None, causal)]
    for layer, value in items:
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise TypeError(f"causal={{layer: bool}} needs integer layer numbers (record.layer), got {layer!r}")
        if value is not None and not isinstance(value, bool):
            where = "" if layer is None else f" for layer {layer!r}"
            raise TypeError(f"causal{where} must be True, False or None (not declared), got {value!r}")
    if isinstance(attention_mask, Mapping) and not (
        "attention_mask" in attention_mask or "input_ids" in attention_mask
    ):
        for layer, mask in attention_mask.items():
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise TypeError(
                    f"attention_mask={{layer: mask}} needs integer layer numbers (record.layer), got {layer!r}"
                )
            if mask is not None:
                mask_tensor(mask, f"attention_mask[{layer}]")
    elif attention_mask is not None:
        mask_tensor(attention_mask, "attention_mask")
    checked = {name: _per_layer(name, others.get(name)) for name in _ONE}
    return Declared(causal=causal, attention_mask=attention_mask, **checked)


def _per_layer(name: str, value):
    """``value`` validated: one for every layer, or ``{layer: value}`` (None inside: not declared there)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for layer in value:
            if isinstance(layer, bool) or not isinstance(layer, int):
                looks = " (this looks like a tokenizer's output: pass one tensor of it)" if "input_ids" in value else ""
                raise DeclarationError(
                    f"{name}={{layer: value}} needs integer layer numbers (record.layer), got {layer!r}{looks}",
                    declaration=name,
                    expected=EXPECTED[name],
                )
        return {layer: None if v is None else _ONE[name](layer, v) for layer, v in value.items()}
    return _ONE[name](None, value)


def _values(value) -> list[tuple[Any, Any]]:
    """(layer or None, value) pairs of one declaration."""
    if isinstance(value, Mapping):
        return [(layer, v) for layer, v in value.items() if v is not None]
    return [] if value is None else [(None, value)]


def declarations_fit(declared: Declared, records: list[AttentionRecord]) -> None:
    """Refuse per-token declarations whose batch fits none of the records they concern, and ``"position_ids"``
    documents when no record knows the position ids the model received: before any check runs."""
    for name in ("documents", "bidirectional", "prefix_length"):
        for layer, value in _values(getattr(declared, name)):
            if not isinstance(value, torch.Tensor):
                continue
            concerned = [r for r in records if r.kind == "self" and (layer is None or r.layer == layer)]
            batches = sorted({r.batch_size for r in concerned if r.batch_size is not None})
            if batches and int(value.shape[0]) not in batches:
                where = "" if layer is None else f"[{layer}]"
                raise DeclarationError(
                    f"{name}{where} has batch {int(value.shape[0])} but the records it concerns have batch "
                    f"{', '.join(map(str, batches))}: declare one row per batch row of the captured inputs",
                    declaration=name,
                    expected=f"batch {', '.join(map(str, batches))}",
                    layer=layer,
                )
    for layer, value in _values(declared.documents):
        concerned = [r for r in records if layer is None or r.layer == layer]
        if value == "position_ids" and concerned and not any(_position_ids(r) is not None for r in concerned):
            raise DeclarationError(
                "documents='position_ids' reads the position ids the model received, and no record has them (the "
                "Hugging Face adapter records position_ids passed to the model's forward): pass documents=ids, "
                "(batch, seq) document ids",
                declaration="documents",
                expected=EXPECTED["documents"],
                layer=layer,
            )


def _position_ids(record: AttentionRecord):
    inputs = record.meta.get("inputs") or {}
    return inputs.get("position_ids") if isinstance(inputs, Mapping) else None


def declared_layers_exist(declared: Declared, records: list[AttentionRecord]) -> None:
    """Warn when ``{layer: ...}`` declarations name layers no record has (a typo, or another numbering)."""
    layers = {r.layer for r in records}
    for f in fields(declared):
        value = getattr(declared, f.name)
        if isinstance(value, Mapping) and records and not (f.name == "attention_mask" and "input_ids" in value):
            unknown = sorted(set(value) - layers)
            if unknown:
                warn_user(
                    f"{f.name} was declared for layer(s) {unknown} but the records have layers {sorted(layers)}: "
                    "those declarations were not used (layers are record.layer, counted over every attention "
                    "module of the model; a capture of some layers keeps the model's numbers)"
                )
