"""What the user declares to ``check`` (``causal=``, ``attention_mask=``), validated once, with clear errors."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import warn_user
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


def validate_declarations(causal, attention_mask) -> None:
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


def declared_layers_exist(causal, attention_mask, records: list[AttentionRecord]) -> None:
    """Warn when ``{layer: ...}`` declarations name layers no record has (a typo, or another numbering)."""
    layers = {r.layer for r in records}
    for what, value in (("causal", causal), ("attention_mask", attention_mask)):
        if isinstance(value, Mapping) and records:
            unknown = sorted(set(value) - layers)
            if unknown:
                warn_user(
                    f"{what} was declared for layer(s) {unknown} but the records have layers {sorted(layers)}: "
                    "those declarations were not used (layers are record.layer, counted over every attention "
                    "module of the model; a capture of some layers keeps the model's numbers)"
                )
