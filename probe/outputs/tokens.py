"""Token labels: which token strings name a record's query rows and key columns.

``tokens`` name the query sequence (and the keys of self-attention); ``key_tokens`` name the context
that cross-attention reads (an encoder's input). Either is one list of strings for every batch row or
one list per batch row. A self-attention layer of an encoder runs over the context, so it is labelled
with ``key_tokens``: known from ``record.meta["stack"] == "encoder"`` (Hugging Face encoder-decoder
models), else when the record is as long as ``key_tokens`` and not as ``tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import AttnprobeError
from ..record import AttentionRecord


def token_rows(tokens, batch_size: int, what: str) -> list[list[str]] | None:
    """``tokens`` (one list of strings, or one list per batch row) as one list per batch row."""
    if tokens is None:
        return None
    if isinstance(tokens, (str, bytes)):
        raise AttnprobeError(f"{what} must be a list of token strings (or one list per batch row), not one string")
    if not isinstance(tokens, Iterable):
        raise TypeError(
            f"{what} must be a list of token strings (or one list per batch row), got {type(tokens).__name__}"
        )
    rows = list(tokens)
    if not rows or all(isinstance(t, str) for t in rows):
        return [list(rows)] * batch_size
    if not all(isinstance(r, Sequence) and not isinstance(r, str) for r in rows):
        raise AttnprobeError(f"{what} must be a list of strings or a list of lists of strings")
    if len(rows) != batch_size:
        raise AttnprobeError(
            f"{what} has {len(rows)} rows but the capture has batch size {batch_size}; give one list per batch row "
            "or a single list for all rows"
        )
    out = []
    for row in rows:
        bad = [t for t in row if not isinstance(t, str)]
        if bad:
            raise AttnprobeError(f"{what} must hold strings, got {bad[0]!r} ({type(bad[0]).__name__})")
        out.append(list(row))
    return out


def record_token_rows(record: AttentionRecord, tokens, key_tokens):
    """(query rows, key rows) for ``record``: lists per batch row, or None where no tokens apply.

    The rows are checked to be long enough for the record's query and key positions.
    """
    size = record.batch_size or 1
    q_rows = token_rows(tokens, size, "tokens")
    context = token_rows(key_tokens, size, "key_tokens")
    q_name = "tokens"
    if record.kind == "self" and context is not None:
        need = record.query_offset + (record.query_len or 0)
        stack = record.meta.get("stack")
        fits = all(len(r) == need for r in context) and (q_rows is None or any(len(r) != need for r in q_rows))
        if stack == "encoder" or (stack is None and fits):
            q_rows, q_name = context, "key_tokens"
    k_rows, k_name = (q_rows, q_name) if record.kind == "self" else (context, "key_tokens")
    where = f"layer {record.layer} ({record.name!r}, call {record.call})"
    for rows, name, length, what in (
        (q_rows, q_name, record.query_offset + (record.query_len or 0), "query"),
        (k_rows, k_name, record.key_start + (record.key_len or 0), "key"),
    ):
        short = [len(r) for r in rows or () if len(r) < length]
        if short:
            raise AttnprobeError(
                f"{name} has {short[0]} entries but {where} has {length} {what} positions; give one token per position"
                + (
                    " (key_tokens name the context of cross-attention and of an encoder)"
                    if name == "key_tokens"
                    else ""
                )
            )
    return q_rows, k_rows
