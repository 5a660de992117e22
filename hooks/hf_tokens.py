"""Token strings per position, for frames (``to_frame(tokens=...)``) and reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..probe.errors import AttnprobeError


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
    if isinstance(ids, torch.Tensor):
        if ids.dim() not in (1, 2) or ids.dtype.is_floating_point:
            raise AttnprobeError(f"token ids must be an integer tensor (batch, position) or (position,), got "
                                 f"{ids.dtype} of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise AttnprobeError(
            "token_strings() takes a tokenizer's BatchEncoding or input_ids (a tensor or lists), "
            f"got {type(batch).__name__}"
        )
    if ids and all(isinstance(i, int) for i in ids):
        return [list(ids)]
    rows = []
    for row in ids:
        row = row.tolist() if isinstance(row, torch.Tensor) else row
        if not isinstance(row, Sequence) or not all(isinstance(i, int) for i in row):
            raise AttnprobeError("token ids must be integers, one list (or tensor row) per batch row")
        rows.append(list(row))
    return rows


def token_strings(tokenizer, batch, *, style: str = "tokens") -> list[list[str]]:
    """One list of strings per batch row, one string per position (padding included).

    ``batch``: a tokenizer's ``BatchEncoding`` (or any mapping with ``input_ids``), a tensor
    ``(batch, position)`` or ``(position,)``, or lists of ids. ``style="tokens"`` gives the
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
