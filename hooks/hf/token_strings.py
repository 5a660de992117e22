"""Token strings per position, for frames (``to_frame(tokens=...)``) and reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral

import torch

from ...probe.errors import AttnprobeError


def _as_lists(ids, what: str = "token ids"):
    """A tensor or numpy array of ids as nested lists of ints; anything else unchanged."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() not in (1, 2) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise AttnprobeError(
                f"{what} must be an integer tensor (batch, position) or (position,), got "
                f"{ids.dtype} of shape {tuple(ids.shape)}"
            )
        return ids.tolist()
    dtype = getattr(ids, "dtype", None)
    kind = getattr(dtype, "kind", None)
    if kind is not None and hasattr(ids, "ndim") and hasattr(ids, "tolist"):  # numpy
        if ids.ndim not in (0, 1, 2) or kind not in "iu":
            raise AttnprobeError(
                f"{what} must be an integer array (batch, position) or (position,), got "
                f"{dtype} of shape {tuple(ids.shape)}"
            )
        return ids.tolist()
    return ids


def _ints(row) -> list[int] | None:
    row = _as_lists(row, "a row of token ids")
    if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
        return None
    if not all(isinstance(i, Integral) and not isinstance(i, bool) for i in row):
        return None
    return [int(i) for i in row]


def _rows(batch) -> list[list[int]]:
    ids = batch
    if isinstance(batch, Mapping):  # a BatchEncoding is a Mapping too
        data = batch
        for key in ("input_ids", "decoder_input_ids"):
            if key in data:
                ids = data[key]
                break
        else:
            raise AttnprobeError(
                f"token_strings() needs token ids; the batch has {sorted(data)[:6]} but no 'input_ids'"
            )
    ids = _as_lists(ids)
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise AttnprobeError(
            "token_strings() takes a tokenizer's BatchEncoding or input_ids (a tensor, a numpy array or lists), "
            f"got {type(batch).__name__}"
        )
    if ids and all(isinstance(i, Integral) and not isinstance(i, bool) for i in ids):
        return [[int(i) for i in ids]]
    rows = []
    for row in ids:
        ints = _ints(row)
        if ints is None:
            raise AttnprobeError("token ids must be integers, one list (or tensor or array row) per batch row")
        rows.append(ints)
    return rows


def token_strings(tokenizer, batch, *, style: str = "tokens") -> list[list[str]]:
    """One list of strings per batch row, one string per position (padding included).

    ``batch``: a tokenizer's ``BatchEncoding`` (or any mapping with ``input_ids``; tensors, numpy
    arrays or lists inside), a tensor or numpy array ``(batch, position)`` or ``(position,)``, or
    lists of ids (rows may be tensors or arrays). ``style="tokens"`` gives the
    tokenizer's own token names (``'##ing'``, ``'Ġthe'``, ``'[PAD]'``); ``style="text"`` gives what
    each token reads as on its own (``' the'``).

    Example::

        >>> # tokens = attnprobe.token_strings(tokenizer, batch)
        >>> # cap.to_frame(tokens=tokens)   # adds query_token / key_token columns
    """
    if style not in ("tokens", "text"):
        raise AttnprobeError(f"style must be 'tokens' or 'text', got {style!r}")
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise AttnprobeError(
            "token_strings() needs a Hugging Face tokenizer (with convert_ids_to_tokens), "
            f"got {type(tokenizer).__name__}"
        )
    rows = _rows(batch)
    if style == "tokens":
        return [[str(t) for t in tokenizer.convert_ids_to_tokens(row)] for row in rows]
    return [[tokenizer.decode([i]) for i in row] for row in rows]
