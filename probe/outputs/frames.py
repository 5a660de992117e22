"""Tidy pandas frames from a Capture. pandas is imported here only, when a frame is asked for.

``to_frame``: one row per (layer, call, head, batch, query_pos, key_pos), typed by ``FRAME_SCHEMA``.
``summary``: one row per (layer, head), typed by ``SUMMARY_SCHEMA``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..engine.sinks import sink_mass
from ..errors import AttnprobeError, warn_user
from ..files import atomic_open
from ..record import AttentionRecord
from .tokens import record_token_rows

#: Column -> dtype of ``Capture.to_frame()``: the one schema, defined here only.
FRAME_SCHEMA: dict[str, str] = {
    "layer": "int64",
    "name": "category",  # module path
    "call": "int64",
    "head": "int64",
    "batch": "int64",
    "query_pos": "int64",  # position of the query in its sequence (query_offset + row)
    "key_pos": "int64",
    "score": "float32",  # pre-softmax; NaN when scores were not captured
    "weight": "float32",  # post-softmax; NaN when weights were not captured
    "allowed": "boolean",  # True = the query may attend the key; <NA> when the mask is unknown
    "query_padding": "boolean",  # True = the query row is padding ("don't care"); <NA> when the record does not say
}
#: Column -> dtype of ``Capture.to_frame()`` for a statistics capture (``keep=("stats",)`` without scores or
#: weights): one row per (layer, call, head, batch, query_pos), a column per statistic (``probe.stats.ROW_STATS``).
STATS_FRAME_SCHEMA: dict[str, str] = {
    "layer": "int64",
    "name": "category",
    "call": "int64",
    "head": "int64",
    "batch": "int64",
    "query_pos": "int64",
    "entropy": "float32",
    "max_weight": "float32",
    "min_weight": "float32",
    "argmax_key": "int64",
    "first_key_mass": "float32",
    "diagonal_mass": "float32",
    "previous_mass": "float32",
    "masked_mass": "float32",
    "masked_max": "float32",
    "row_sum_error": "float32",
    "max_score": "float32",
    "finite": "bool",
    "output_error": "float32",
    "output_scale": "float32",
    "first_key": "int64",
    "last_key": "int64",
    "allowed_keys": "int64",
    "diagonal_allowed": "bool",
    "query_padding": "boolean",  # as in FRAME_SCHEMA: a padded query row, <NA> when the record does not say
}

#: Added by ``to_frame(tokens=...)``.
TOKEN_SCHEMA: dict[str, str] = {"query_token": "category", "key_token": "category"}

#: Column -> dtype of ``Capture.summary()``.
SUMMARY_SCHEMA: dict[str, str] = {
    "layer": "int64",
    "name": "category",
    "head": "int64",
    "rows": "int64",  # real query rows the means are over (padded, empty excluded; with stats_rows= the sampled ones)
    "entropy": "float32",  # mean entropy of a row, in nats
    "max_weight": "float32",  # mean of each row's largest weight
    "first_key_mass": "float32",  # mean weight on the first key that is not padding
    "diagonal_mass": "float32",  # mean weight on the query's own position (self-attention only)
    "previous_mass": "float32",  # mean weight on the position before the query (self-attention only)
    "masked_mass": "float32",  # mean weight on keys that were not allowed (should be 0)
    "row_sum_error": "float32",  # worst |row sum - expected|: 1, or 1 - sink mass with attention sinks
}


class _Vocab:
    """Token strings -> category codes, shared by every record of one frame."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def codes(self, rows: list[Sequence[str]]) -> np.ndarray:
        width = max((len(r) for r in rows), default=0)
        out = np.full((len(rows), width), -1, dtype=np.int64)
        for b, row in enumerate(rows):
            out[b, : len(row)] = [self.index.setdefault(str(t), len(self.index)) for t in row]
        return out


def _warn_left_out(records: list, what: str, needs: str, fix: str) -> None:
    """Say which records a frame left out and why (instead of dropping them silently)."""
    if not records:
        return
    shown = ", ".join(f"layer {r.layer} call {r.call} ({r.name!r})" for r in records[:5])
    more = f" and {len(records) - 5} more" if len(records) > 5 else ""
    warn_user(f"{what} left out {len(records)} record(s) without {needs}: {shown}{more}; {fix}")


def _values(t: torch.Tensor | None, n: int) -> np.ndarray:
    if t is None:
        return np.full(n, np.nan, dtype=np.float32)
    return t.detach().to("cpu", torch.float32).numpy().reshape(-1)


def to_frame(cap, tokens=None, key_tokens=None, *, drop_padding: bool = False):
    """The tidy frame of ``cap`` (see ``FRAME_SCHEMA``; plus ``TOKEN_SCHEMA`` columns with tokens).

    ``tokens`` name the query sequence, ``key_tokens`` the context of cross-attention and of an encoder
    (see ``attnprobe.probe.outputs.tokens``). ``query_padding`` marks the rows of padded queries (their weights
    mean nothing; ``summary()`` leaves them out); ``drop_padding=True`` leaves them out of the frame too
    (rows whose padding is unknown, <NA>, stay).
    """
    if not isinstance(drop_padding, bool):
        raise TypeError(f"drop_padding must be True or False, got {type(drop_padding).__name__}")
    records = list(cap)
    if records and all(r.weights is None and r.scores is None and r.stats is not None for r in records):
        if tokens is not None or key_tokens is not None:
            raise AttnprobeError(
                "to_frame(tokens=...) names (query, key) cells; a statistics capture has one row per "
                "query: join tokens on query_pos yourself"
            )
        return stats_frame(records, drop_padding=drop_padding)
    with_tokens = tokens is not None or key_tokens is not None
    vocab = _Vocab()
    names: dict[str, int] = {}  # module path -> category code, in order of first appearance
    parts: dict[str, list[np.ndarray]] = {c: [] for c in (*FRAME_SCHEMA, "allowed_known", "padding_known")}
    token_parts: dict[str, list[np.ndarray]] = {c: [] for c in TOKEN_SCHEMA}
    left_out = []
    for r in records:
        columns = _cell_columns(r, names)
        if columns is None:
            left_out.append(r)
            continue
        for col, values in columns.items():
            parts[col].append(values)
        if with_tokens:
            for col, values in _token_columns(r, tokens, key_tokens, vocab, columns).items():
                token_parts[col].append(values)
    _warn_left_out(
        left_out,
        "to_frame()",
        "scores or weights (one row per query and key needs one of them)",
        "capture with keep= including 'weights' or 'scores' to have them in the frame",
    )
    frame = _cells_frame(parts, names, token_parts, vocab if with_tokens else None)
    if drop_padding:
        frame = frame[~frame["query_padding"].fillna(False).to_numpy(dtype=bool)].reset_index(drop=True)
    return frame


def _cell_columns(r, names: dict[str, int]) -> dict[str, np.ndarray] | None:
    """The columns of one record's rows, one per (head, batch, query, key) cell, in ``FRAME_SCHEMA``'s order (plus
    whether its mask and padding are known); None without scores or weights. ``names``: module path -> category
    code, added to."""
    t = r.weights if r.weights is not None else r.scores
    if t is None:
        return None
    B, H, Tq, Tk = t.shape
    n = B * H * Tq * Tk
    allowed = r.allowed_for_heads()  # (batch, 1 or head, query, key) or None
    padding = r.query_padding  # (batch, query) or None
    return {
        "layer": np.full(n, r.layer, dtype=np.int64),
        "name": np.full(n, names.setdefault(r.name, len(names)), dtype=np.int64),
        "call": np.full(n, r.call, dtype=np.int64),
        "head": np.tile(np.repeat(np.asarray(r.heads, dtype=np.int64), Tq * Tk), B),
        "batch": np.repeat(np.arange(B, dtype=np.int64), H * Tq * Tk),
        "query_pos": np.tile(np.repeat(np.arange(Tq, dtype=np.int64) + r.query_offset, Tk), B * H),
        "key_pos": np.tile(np.arange(Tk, dtype=np.int64) + r.key_start, B * H * Tq),  # positions, not cache slots
        "score": _values(r.scores, n),
        "weight": _values(r.weights, n),
        "allowed": (
            np.zeros(n, dtype=bool) if allowed is None else allowed.expand(B, H, Tq, Tk).cpu().numpy().reshape(-1)
        ),
        "query_padding": (
            np.zeros(n, dtype=bool)
            if padding is None
            else padding.cpu().bool()[:, None, :, None].expand(B, H, Tq, Tk).numpy().reshape(-1)
        ),
        "allowed_known": np.full(n, allowed is not None),
        "padding_known": np.full(n, padding is not None),
    }


def _token_columns(r, tokens, key_tokens, vocab: _Vocab, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The query and key token of each cell of ``columns`` (one record's), as codes of ``vocab`` (-1: none)."""
    q_rows, k_rows = record_token_rows(r, tokens, key_tokens)
    batch, n = columns["batch"], len(columns["batch"])
    out = {}
    for col, rows, pos in (("query_token", q_rows, columns["query_pos"]), ("key_token", k_rows, columns["key_pos"])):
        out[col] = np.full(n, -1, dtype=np.int64) if rows is None else vocab.codes(rows)[batch, pos]
    return out


def _cells_frame(
    parts: dict[str, list[np.ndarray]],
    names: dict[str, int],
    token_parts: dict[str, list[np.ndarray]],
    vocab: _Vocab | None,
):
    """The frame of the records' columns (``FRAME_SCHEMA``, and ``TOKEN_SCHEMA`` with a ``vocab``)."""
    import pandas as pd

    def cat(col, dtype):
        return np.concatenate(parts[col]) if parts[col] else np.zeros(0, dtype=dtype)

    known = cat("allowed_known", bool)
    data = {
        "layer": cat("layer", np.int64),
        "name": pd.Categorical.from_codes(cat("name", np.int64), categories=list(names)),
        "call": cat("call", np.int64),
        "head": cat("head", np.int64),
        "batch": cat("batch", np.int64),
        "query_pos": cat("query_pos", np.int64),
        "key_pos": cat("key_pos", np.int64),
        "score": cat("score", np.float32),
        "weight": cat("weight", np.float32),
        "allowed": pd.arrays.BooleanArray(cat("allowed", bool), ~known),
        "query_padding": pd.arrays.BooleanArray(cat("query_padding", bool), ~cat("padding_known", bool)),
    }
    if vocab is not None:
        categories = list(vocab.index)
        for col in TOKEN_SCHEMA:
            codes = np.concatenate(token_parts[col]) if token_parts[col] else np.zeros(0, dtype=np.int64)
            data[col] = pd.Categorical.from_codes(codes, categories=categories)
    return pd.DataFrame(data, copy=False)


def stats_frame(records, *, drop_padding: bool = False):
    """One row per (layer, call, head, batch, query_pos) of records with ``stats`` (``STATS_FRAME_SCHEMA``);
    ``drop_padding=True`` leaves padded query rows out.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn, keep=("stats",)) as cap:
        ...     _ = attn(torch.randn(1, 4, 8))
        >>> frame = cap.to_frame()
        >>> len(frame), frame["last_key"].tolist()[:4]
        (8, [0, 1, 2, 3])
    """
    import pandas as pd

    names: dict[str, int] = {}
    columns = [
        c
        for c in STATS_FRAME_SCHEMA
        if c not in ("layer", "name", "call", "head", "batch", "query_pos", "query_padding")
    ]
    parts: dict[str, list[np.ndarray]] = {c: [] for c in STATS_FRAME_SCHEMA}
    known: list[np.ndarray] = []
    for r in records:
        if r.stats is None:
            continue
        B, H, Tq = r.stats["entropy"].shape
        n = B * H * Tq
        parts["layer"].append(np.full(n, r.layer, dtype=np.int64))
        parts["name"].append(np.full(n, names.setdefault(r.name, len(names)), dtype=np.int64))
        parts["call"].append(np.full(n, r.call, dtype=np.int64))
        parts["head"].append(np.tile(np.repeat(np.asarray(r.heads, dtype=np.int64), Tq), B))
        parts["batch"].append(np.repeat(np.arange(B, dtype=np.int64), H * Tq))
        positions = r.stats_positions.numpy()  # every row, or the rows capture(stats_rows=) sampled
        parts["query_pos"].append(np.tile(positions + r.query_offset, B * H))
        for c in columns:
            parts[c].append(r.stats[c].detach().cpu().numpy().reshape(-1).astype(STATS_FRAME_SCHEMA[c]))
        padding = None if r.query_padding is None else r.query_padding.cpu()[:, r.stats_positions]
        parts["query_padding"].append(
            np.zeros(n, dtype=bool)
            if padding is None
            else padding.cpu().bool()[:, None, :].expand(B, H, Tq).numpy().reshape(-1)
        )
        known.append(np.full(n, padding is not None))
    data = {}
    for c, dtype in STATS_FRAME_SCHEMA.items():
        if c == "query_padding":
            flags = np.concatenate(parts[c]) if parts[c] else np.zeros(0, dtype=bool)
            data[c] = pd.arrays.BooleanArray(flags, ~(np.concatenate(known) if known else np.zeros(0, dtype=bool)))
            continue
        values = np.concatenate(parts[c]) if parts[c] else np.zeros(0, dtype="int64" if c == "name" else dtype)
        data[c] = pd.Categorical.from_codes(values, categories=list(names)) if c == "name" else values
    frame = pd.DataFrame(data, copy=False).astype({c: d for c, d in STATS_FRAME_SCHEMA.items() if c != "name"})
    if drop_padding:
        frame = frame[~frame["query_padding"].fillna(False).to_numpy(dtype=bool)].reset_index(drop=True)
    return frame


def _summary_from_stats(r, acc: dict) -> None:
    """Add a statistics-only record to the per-(layer, head) sums of ``summary`` (the same means, from the
    per-row statistics instead of the weights)."""
    st = {k: v.detach().to("cpu") for k, v in r.stats.items()}
    real = st["allowed_keys"] > 0  # (B, H, Tq): rows with at least one allowed key
    if r.query_padding is not None:  # of the rows the statistics describe (all, or those stats_rows= sampled)
        real &= ~r.query_padding.cpu()[:, r.stats_positions][:, None, :]
    counts = real.sum(dim=(0, 2))
    sums = {
        col: torch.where(real, st[col].float(), 0.0).sum(dim=(0, 2))
        for col in ("entropy", "max_weight", "first_key_mass", "masked_mass")
    }
    if r.kind == "self":
        for col in ("diagonal_mass", "previous_mass"):
            ok = real & ~torch.isnan(st[col])
            sums[col] = torch.where(ok, st[col].float(), 0.0).sum(dim=(0, 2))
            sums[col + "_rows"] = ok.sum(dim=(0, 2))
    row_err = torch.where(real, st["row_sum_error"].float(), 0.0).amax(dim=(0, 2))
    for i, head in enumerate(r.heads):
        a = acc.setdefault((r.layer, head), {"name": r.name, "rows": 0, "row_sum_error": math.nan})
        a["rows"] += int(counts[i])
        err = float(row_err[i])
        a["row_sum_error"] = err if math.isnan(a["row_sum_error"]) else max(a["row_sum_error"], err)
        for col, v in sums.items():
            a[col] = a.get(col, 0.0) + float(v[i])


def summary(cap: Iterable[AttentionRecord]):
    """Per-(layer, head) statistics of ``cap`` (see ``SUMMARY_SCHEMA``)."""
    import pandas as pd

    acc: dict[tuple[int, int], dict] = {}
    left_out = []
    for r in cap:
        if r.weights is None and r.stats is not None:
            _summary_from_stats(r, acc)
        elif r.weights is None:
            left_out.append(r)
        else:
            _summary_from_weights(r, r.weights, acc)
    _warn_left_out(left_out, "summary()", "weights", "capture with keep= including 'weights' to summarize them")
    rows = []
    for (layer, head), a in sorted(acc.items()):
        n = a["rows"]
        row = {"layer": layer, "name": a["name"], "head": head, "rows": n}
        for col in ("entropy", "max_weight", "first_key_mass", "masked_mass"):
            row[col] = a[col] / n if n else math.nan
        for col in ("diagonal_mass", "previous_mass"):
            m = a.get(col + "_rows", 0)
            row[col] = a[col] / m if m else math.nan
        row["row_sum_error"] = a["row_sum_error"] if n else math.nan
        rows.append(row)
    frame = pd.DataFrame(rows, columns=list(SUMMARY_SCHEMA))
    return frame.astype(SUMMARY_SCHEMA)


def _summary_from_weights(r: AttentionRecord, weights: torch.Tensor, acc: dict) -> None:
    """Add a record's ``weights`` ``(batch, head, query, key)`` to the per-(layer, head) sums of ``summary``."""
    w = weights.detach().to("cpu", torch.float32)
    B, H, Tq, Tk = w.shape
    allowed = r.allowed_for_heads()
    allowed = torch.ones_like(w, dtype=torch.bool) if allowed is None else allowed.cpu().expand(B, H, Tq, Tk)
    real = allowed.any(-1)  # (B, H, Tq): rows with at least one allowed key
    if r.query_padding is not None:
        real &= ~r.query_padding.cpu()[:, None, :]
    counts = real.sum(dim=(0, 2))  # (H,)

    def row_mean(x: torch.Tensor) -> torch.Tensor:  # (B, H, Tq) -> (H,): the sum over real rows, per head
        return torch.where(real, x, 0.0).sum(dim=(0, 2))

    entropy = -torch.where(w > 0, w * w.clamp_min(1e-30).log(), 0.0).sum(-1)  # (B, H, Tq)
    key_real = allowed.any(-2)  # (B, H, Tk): keys some query may attend
    first = key_real.float().argmax(-1)  # first such key
    first_mass = w.gather(-1, first[:, :, None, None].expand(B, H, Tq, 1)).squeeze(-1)  # (B, H, Tq)
    masked = torch.where(allowed, 0.0, w).sum(-1)  # (B, H, Tq)
    expected_sum = _expected_row_sum(r, allowed)  # (B, H, Tq), None when it cannot be known
    if expected_sum is None:
        row_err = torch.full((H,), math.nan)
    else:
        row_err = torch.where(real, (w.sum(-1) - expected_sum).abs(), 0.0).amax(dim=(0, 2))
    stats = {
        "entropy": row_mean(entropy),
        "max_weight": row_mean(w.amax(-1)),
        "first_key_mass": row_mean(first_mass),
        "masked_mass": row_mean(masked),
    }
    if r.kind == "self":
        pos = torch.arange(Tq) + r.query_offset - r.key_start  # key index (cache slot) of each query
        for col, shift in (("diagonal_mass", 0), ("previous_mass", 1)):
            idx = pos - shift
            ok = (idx >= 0) & (idx < Tk)
            vals = w.gather(-1, idx.clamp(0, Tk - 1)[None, None, :, None].expand(B, H, Tq, 1)).squeeze(-1)
            stats[col] = torch.where(real & ok, vals, 0.0).sum(dim=(0, 2))
            stats[col + "_rows"] = (real & ok).sum(dim=(0, 2))
    for i, head in enumerate(r.heads):
        a = acc.setdefault((r.layer, head), {"name": r.name, "rows": 0, "row_sum_error": math.nan})
        a["rows"] += int(counts[i])
        err = float(row_err[i])
        if not math.isnan(err):  # records whose expected row sum is unknown do not count
            a["row_sum_error"] = err if math.isnan(a["row_sum_error"]) else max(a["row_sum_error"], err)
        for col, v in stats.items():
            a[col] = a.get(col, 0.0) + float(v[i])


def _expected_row_sum(r, allowed: torch.Tensor):
    """What each query row of ``r.weights`` should sum to, ``(batch, head, query)`` or a float: 1 without
    attention sinks, ``1 - sink mass`` with them (the rule ``row_sum`` checks, probe/engine/sinks.py), None when
    the scores needed for the sink mass were not kept."""
    if r.sinks is None:
        return 1.0
    if r.scores is None:
        return None
    return 1.0 - sink_mass(r.scores.detach().to("cpu", torch.float32), allowed, r.sinks.detach().cpu())


#: First characters that make a spreadsheet evaluate a text cell as a formula (=HYPERLINK(...), +cmd, ...).
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def formula_safe_text(text):
    """``text`` with a leading ``'`` when a spreadsheet would evaluate it (it starts with ``=``, ``+``, ``-``,
    ``@``, tab or CR); other values unchanged. ``formula_safe_text("=1+2") == "'=1+2"``."""
    if isinstance(text, str) and text.startswith(FORMULA_PREFIXES):
        return "'" + text
    return text


def formula_safe_frame(frame):
    """A copy of ``frame`` whose text cells (object, string and categorical columns) are ``formula_safe_text``;
    numeric columns are untouched (a negative number is a number, not a formula)."""
    import pandas as pd

    out = frame.copy(deep=False)
    for i in range(frame.shape[1]):
        column = frame.iloc[:, i]
        if isinstance(column.dtype, pd.CategoricalDtype):
            categories = [formula_safe_text(c) for c in column.cat.categories]
            if len(set(categories)) == len(categories):
                out.isetitem(i, column.cat.rename_categories(categories))
            else:  # "=x" and "'=x" both occur and now read the same: no longer unique categories, plain text
                codes = column.cat.codes.to_numpy()
                values = np.asarray(categories + [None], dtype=object)
                out.isetitem(i, pd.Series(values[codes], index=frame.index, dtype=object))
        elif column.dtype == object or isinstance(column.dtype, pd.StringDtype):
            out.isetitem(i, column.map(formula_safe_text))
    return out


def frame_csv(frame, file=None, *, formula_safe: bool = True):
    """``frame`` as CSV text (or written to the open text ``file``): every text cell quoted, so carriage
    returns, line feeds, quotes and commas inside tokens stay inside their cell; with ``formula_safe``
    (the default) text a spreadsheet would evaluate gets a leading ``'`` (see ``formula_safe_text``)."""
    import csv
    import io
    import re

    if formula_safe:
        frame = formula_safe_frame(frame)
        frame.columns = [formula_safe_text(str(c)) for c in frame.columns]
    out = io.StringIO() if file is None else file
    header = True
    if all(re.fullmatch(r"[\w .]+", str(c)) for c in frame.columns):  # plain names (the schemas): as they are
        out.write(",".join(str(c) for c in frame.columns) + "\n")
        header = False
    # QUOTE_MINIMAL would leave a bare CR unquoted when lines end in LF: readers then split the row
    frame.to_csv(out, index=False, header=header, quoting=csv.QUOTE_NONNUMERIC, lineterminator="\n")
    return out.getvalue() if file is None else None


def write_frame(frame, path, *, format: str | None = None, overwrite: bool = False, formula_safe: bool = True):
    """Write ``frame`` as Parquet or CSV (by ``format`` or the suffix). CSV with ``path=None`` returns text.

    The file appears complete or not at all (``attnprobe.probe.files``); an existing file (or symlink) is
    never replaced unless ``overwrite`` is True. CSV quotes every text cell and, unless
    ``formula_safe=False``, prefixes text that a spreadsheet would evaluate (``=``, ``+``, ``-``, ``@``,
    tab, CR) with ``'``; Parquet stores every value exactly.
    """
    if path is None:
        if format not in (None, "csv"):
            raise AttnprobeError("only CSV can be returned as text; give a path to write Parquet")
        return frame_csv(frame, formula_safe=formula_safe)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a file path (str or os.PathLike), or None for CSV text, got {type(path).__name__}"
        )
    path = Path(os.fspath(path))
    fmt = format or {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}.get(path.suffix.lower())
    if fmt not in ("parquet", "csv"):
        raise AttnprobeError(f"cannot tell the format of {str(path)!r}: name it .parquet or .csv, or pass format=")
    if fmt == "parquet":
        with atomic_open(path, "wb", overwrite=overwrite) as f:
            frame.to_parquet(f, index=False)
    else:
        with atomic_open(path, "w", overwrite=overwrite, encoding="utf-8", newline="") as f:
            frame_csv(frame, f, formula_safe=formula_safe)
    return path
