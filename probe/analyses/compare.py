"""Compare two implementations of a model head by head: where they first diverge, and the likely cause.

``compare_captures(reference, candidate)`` lines up the attention calls of two captures (``alignment.py``),
compares every tensor both recorded, head by head, within a tolerance set by dtype, finds the first divergence
(the earliest call, then the earliest tensor in data-flow order, then the earliest position) and names its likely
cause from the numbers (``diagnoses.py``). ``attnprobe.compare`` (hooks/compare_models.py) runs two models first.

Which cells count, per tensor (padded query rows, known from either side, never count):

- ``q``, ``output``: every real query row; ``k``, ``v``: every key;
- ``scores``: the cells both sides allow (what the softmax never saw is no difference);
- ``weights``: every key of the rows either side lets attend something (weight where one side masks counts);
- statistics (``max_score``, ``entropy``, ...): the real query rows both captures hold statistics for.

A cell differs when ``|candidate - reference| > atol + rtol * scale``, ``scale`` being the largest ``|reference|``
of that head and tensor; a value non-finite on one side only is an infinite difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..errors import AttnprobeError
from ..record import AttentionRecord
from .alignment import (
    COMPARED_STATS,
    FLOW,
    KV_FIELDS,
    Pair,
    align_calls,
    aligned_record,
    match_heads,
    pair_up,
)
from .diagnoses import Diagnosis, diagnose
from .differences import block, differences, head_distances, mask_differs, per_head_cells, per_head_max, per_head_scale

#: ``(atol, rtol)`` by the coarser dtype of the two sides (the dtype attention ran in, or a tensor was stored in).
TOLERANCES: Mapping[torch.dtype, tuple[float, float]] = MappingProxyType(
    {
        torch.float64: (1e-9, 1e-9),
        torch.float32: (1e-5, 1e-4),
        torch.float16: (1e-3, 5e-3),
        torch.bfloat16: (1e-2, 3e-2),
    }
)
_COARSE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

#: Column -> dtype of ``Comparison.to_frame()``: one row per aligned call, head and tensor.
COMPARISON_SCHEMA: dict[str, str] = {
    "layer": "int64",  # the reference's layer number
    "call": "int64",  # the reference's call number of that layer
    "name": "object",  # the reference's module name
    "candidate_layer": "int64",
    "candidate_name": "object",
    "tensor": "object",  # q, k, v, scores, weights, output, or a statistic (max_score, entropy, ...)
    "head": "int64",  # reference head (a key/value head for k and v when axis == "kv_head")
    "candidate_head": "int64",  # the candidate's head compared with it (differs when heads were permuted)
    "axis": "object",  # "head", or "kv_head" (k and v compared per key/value head)
    "max_abs_diff": "float64",  # largest |candidate - reference| over the cells that count (inf: non-finite)
    "scale": "float64",  # largest |reference| over those cells
    "tolerance": "float64",  # atol + rtol * scale
    "exceeds": "bool",  # max_abs_diff > tolerance
    "cells": "int64",  # cells compared
    "mask_differs": "int64",  # (query, key) cells of real rows that one side allows and the other masks
    "dtype": "object",  # the dtype whose tolerance applies
}


class ComparisonError(AttnprobeError, ValueError):
    """Two captures that share nothing to compare; the message says what to capture."""


@dataclass(frozen=True)
class Divergence:
    """Where two implementations first differ beyond tolerance.

    ``query`` and ``key`` are positions (``key`` is None for q, output and statistics, ``query`` None for k and v);
    ``dim`` the ``d_head`` index for q, k, v and output; ``reference``/``candidate`` the two values there. ``head``
    is the reference's head number: a key/value head for k and v compared per key/value head (the frame's ``axis``).
    """

    layer: int
    head: int
    tensor: str
    query: int | None
    key: int | None
    reference: float
    candidate: float
    batch: int = 0
    dim: int | None = None
    call: int = 0
    name: str = ""
    candidate_layer: int = 0
    candidate_name: str = ""
    candidate_head: int = 0
    difference: float = 0.0
    tolerance: float = 0.0

    def describe(self) -> str:
        where = ", ".join(
            f"{k} {v}"
            for k, v in (("batch", self.batch), ("query", self.query), ("key", self.key), ("dim", self.dim))
            if v is not None
        )
        return (
            f"layer {self.layer} ({self.name or '<root>'}) head {self.head} {self.tensor} at {where}: reference "
            f"{self.reference:.6g}, candidate {self.candidate:.6g} "
            f"(|diff| {self.difference:.3g} > {self.tolerance:.3g})"
        )


@dataclass(frozen=True, eq=False)
class Comparison:
    """The result of ``attnprobe.compare``: per head and tensor differences, the first divergence and its likely
    cause. ``ok`` is True when every compared value agrees within tolerance; ``first`` is the first
    ``Divergence`` (None when they agree); ``diagnosis`` its likely cause, one of ``DIAGNOSES`` (None when they
    agree), with ``evidence`` (one sentence from the numbers) and ``details`` (the fitted numbers).
    ``permutations``: ``{layer: candidate head of each reference head}`` for layers whose heads were matched in
    another order. ``pairs`` holds the aligned calls (the reports draw them)."""

    rows: tuple[dict[str, Any], ...] = field(repr=False)
    first: Divergence | None
    diagnosis: str | None
    evidence: str
    details: Mapping[str, Any]
    permutations: Mapping[int, tuple[int, ...]]
    pairs: tuple[Pair, ...] = field(repr=False)
    tolerances: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    infos: tuple[Mapping[str, Any], Mapping[str, Any]] = field(default=({}, {}), repr=False)

    @property
    def ok(self) -> bool:
        return self.first is None

    def to_frame(self):
        """One row per aligned call, head and tensor (``COMPARISON_SCHEMA``), in data-flow order."""
        import pandas as pd

        return pd.DataFrame(list(self.rows), columns=list(COMPARISON_SCHEMA)).astype(COMPARISON_SCHEMA)

    def aligned(self):
        """Two ``Capture``s, reference and candidate, one record per compared call in one layout (the reference's
        layer numbers, names and heads; the candidate's heads in the matched order; heads unfolded from the batch):
        what ``attnprobe.reports.diff_html`` draws side by side."""
        from ..capture import Capture

        return tuple(
            Capture([aligned_record(p, side) for p in self.pairs], info)
            for side, info in zip(("ref", "cand"), self.infos)
        )

    def summary(self) -> str:
        """One line: agreement, or the first divergence and its diagnosis."""
        if self.first is None:
            return f"agree within tolerance: {len(self.pairs)} attention calls, {len(self.rows)} (head, tensor) pairs"
        return f"first divergence: {self.first.describe()}; diagnosis {self.diagnosis}: {self.evidence}"

    def __str__(self) -> str:
        return self.summary()


def _coarsest(dtypes) -> torch.dtype:
    found = [d for d in dtypes if d in TOLERANCES]
    return max(found, key=_COARSE.index) if found else torch.float32


def _pair_dtype(pair: Pair) -> torch.dtype:
    """The dtype whose tolerance applies: the coarsest in which either side's attention took its inputs (q, k, v as
    stored: a capture with ``dtype=`` stores every tensor in it), else the dtype the record says attention ran in.
    A softmax rounded to a coarser dtype than its inputs is then a difference (``softmax_dtype``), not noise."""
    dtypes: list[torch.dtype | None] = []
    for lay in (pair.ref, pair.cand):
        inputs = [lay.tensors[n].dtype for n in ("q", "k", "v") if n in lay.tensors]
        if inputs:
            dtypes += inputs
        else:
            dtypes.append(lay.record.dtype)
            dtypes += [t.dtype for t in (*lay.tensors.values(), *lay.stats.values()) if t.is_floating_point()]
    return _coarsest(dtypes)


def _mask_count(pair: Pair, i: int) -> int:
    if i not in pair.mask_counts:
        diff = mask_differs(pair, i)
        pair.mask_counts[i] = 0 if diff is None else int(diff.sum())
    return pair.mask_counts[i]


def _first_cell(exceeds: torch.Tensor, name: str, positions: torch.Tensor | None) -> dict[str, Any]:
    """The earliest differing cell: smallest position (query, or key for k/v), then batch row, then key or dim."""
    idx = exceeds.nonzero()
    order = idx[:, 1] * exceeds.shape[0] + idx[:, 0]
    if idx.shape[1] > 2:
        order = order * exceeds.shape[2] + idx[:, 2]
    b, p, *rest = idx[int(order.argmin())].tolist()
    cell: dict[str, Any] = {"batch": b, "query": None, "key": None, "dim": None}
    if name in COMPARED_STATS:
        cell["query"] = int(positions[p]) if positions is not None else p
    elif name in KV_FIELDS:
        cell["key"], cell["dim"] = p, rest[0]
    elif name in ("scores", "weights"):
        cell["query"], cell["key"] = p, rest[0]
    else:
        cell["query"], cell["dim"] = p, rest[0]
    cell["_index"] = (b, p)
    cell["_rest"] = tuple(rest)
    return cell


@dataclass
class _Settings:
    tensors: tuple[str, ...]
    atol: float | None
    rtol: float | None
    allow_permuted_heads: bool

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        atol, rtol = TOLERANCES[dtype]
        return (atol if self.atol is None else self.atol, rtol if self.rtol is None else self.rtol)


def _compared(pair: Pair, settings: _Settings) -> list[str]:
    out = []
    for name in FLOW:
        if name not in settings.tensors:
            continue
        if name in COMPARED_STATS:
            if name in pair.ref.stats and name in pair.cand.stats:
                out.append(name)
        elif name in pair.ref.tensors and name in pair.cand.tensors:
            if name in KV_FIELDS and not pair.kv_heads:
                continue
            out.append(name)
    return out


#: Memory target of one block of heads compared at once (their float32 copies and temporaries).
BLOCK_BYTES = 64 << 20


def _tensor_rows(pair: Pair, name: str, tol: tuple[float, float], dtype: torch.dtype, locate: bool):
    """The frame rows of every compared head of ``name``, and (``locate``) the earliest differing cell of each head
    that differs; heads in blocks of about ``BLOCK_BYTES``."""
    kv = name in KV_FIELDS
    n = len(pair.kv_heads) if kv else len(pair.heads)
    one = pair.pick("ref", name, 0)
    per_block = max(1, BLOCK_BYTES // max(one.numel() * 16, 1))
    rows, found = [], []
    for start in range(0, n, per_block):
        heads = range(start, min(n, start + per_block))
        c = block(pair, name, heads, precise=False)
        d = differences(c)  # (batch, head, ...)
        top, scales = per_head_max(d), per_head_scale(c)
        counts = per_head_cells(c)
        for k, i in enumerate(heads):
            scale = float(scales[k])
            tolerance = 0.5 if name == "allowed_keys" else tol[0] + tol[1] * scale
            row = _row(pair, name, i, kv, dtype)
            row.update(max_abs_diff=float(top[k]), scale=scale, tolerance=tolerance, cells=int(counts[k]))
            row["exceeds"] = bool(top[k] > tolerance)
            rows.append(row)
            if row["exceeds"] and locate:
                exceeds = d[:, k] > tolerance
                first = _first_cell(exceeds, name, c.positions)
                b, p = first.pop("_index")
                at = (b, k, p, *first.pop("_rest"))
                first.update(reference=float(c.ref[at]), candidate=float(c.cand[at]), difference=float(d[at]))
                found.append((first, row))
    return rows, found


def _row(pair: Pair, name: str, i: int, kv: bool, dtype: torch.dtype) -> dict[str, Any]:
    r, k = pair.ref.record, pair.cand.record
    return {
        "layer": r.layer,
        "call": r.call,
        "name": r.name,
        "candidate_layer": k.layer,
        "candidate_name": k.name,
        "tensor": name,
        "head": (pair.kv_heads if kv else pair.heads)[i],
        "candidate_head": (pair.cand_kv_heads if kv else pair.cand_heads)[i],
        "axis": pair.kv_axis if kv else "head",
        "mask_differs": _mask_count(pair, i) if name in ("scores", "weights") else 0,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _permute(pair: Pair, settings: _Settings, tol: tuple[float, float]) -> tuple[int, ...] | None:
    """With ``allow_permuted_heads``: match the candidate's heads to the reference's by the first query-head tensor
    both hold; the pair then compares matched heads. Returns the permutation when it is not the identity."""
    name = next((n for n in ("q", "scores", "weights", "output") if n in _compared(pair, settings)), None)
    if name is None or len(pair.heads) != pair.ref.num_heads or len(pair.cand.heads) != pair.cand.num_heads:
        return None
    perm = match_heads(head_distances(pair, name, tol))
    if perm is None or perm == list(range(len(perm))):
        return None
    pair.cand_heads = [pair.heads[j] for j in perm]
    if pair.kv_axis == "head" or pair.ref.num_kv_heads == pair.ref.num_heads:  # one key/value head per query head
        pair.cand_kv_heads = [pair.cand_heads[pair.heads.index(h)] for h in pair.kv_heads]
    elif "k" in _compared(pair, settings) and len(pair.kv_heads) == pair.ref.num_kv_heads:
        kv_perm = match_heads(head_distances(pair, "k", tol))  # grouped: the key heads matched on their own
        if kv_perm is not None:
            pair.cand_kv_heads = [pair.kv_heads[j] for j in kv_perm]
    pair.permuted = True
    return tuple(pair.cand_heads)


def _records(x, side: str) -> list[AttentionRecord]:
    records = list(x)
    stray = next((r for r in records if not isinstance(r, AttentionRecord)), None)
    if stray is not None:
        raise ComparisonError(
            f"the {side} must be a Capture (or AttentionRecords), got {type(stray).__name__} inside; "
            "pass two captures, or two models and inputs to attnprobe.compare"
        )
    if not records:
        raise ComparisonError(f"the {side} capture holds no attention call; check that it captured the model")
    return records


def compare_captures(
    reference,
    candidate,
    *,
    mapping: Mapping[int | str, int | str] | None = None,
    tensors: Sequence[str] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    allow_permuted_heads: bool = False,
    batch: int | None = None,
) -> Comparison:
    """``attnprobe.compare`` of two captures (see there)."""
    unknown = sorted(set(tensors or ()) - set(FLOW))
    if unknown:
        raise ComparisonError(f"tensors= names {unknown}, which are not compared; choose from {', '.join(FLOW)}")
    settings = _Settings(tuple(tensors or FLOW), atol, rtol, allow_permuted_heads)
    aligned = align_calls(_records(reference, "reference"), _records(candidate, "candidate"), mapping)
    pairs = [pair_up(i, r, c, batch) for i, (r, c) in enumerate(aligned)]
    rows: list[dict[str, Any]] = []
    permutations: dict[int, tuple[int, ...]] = {}
    first: tuple[Pair, str, dict] | None = None
    used: dict[str, tuple[float, float]] = {}
    for pair in pairs:
        dtype = _pair_dtype(pair)
        tol = settings.tolerance(dtype)
        used[str(dtype).removeprefix("torch.")] = tol
        if settings.allow_permuted_heads:
            perm = _permute(pair, settings, tol)
            if perm is not None:
                permutations[pair.ref.record.layer] = perm
        names = _compared(pair, settings)
        if not names:
            raise ComparisonError(
                f"layer {pair.ref.record.layer}: the captures share no tensor to compare (reference has "
                f"{_held(pair.ref)}, candidate {_held(pair.cand)}); capture the same quantities on both sides"
            )
        for name in names:
            rows_of, found = _tensor_rows(pair, name, tol, dtype, locate=first is None)
            rows += rows_of
            if first is None and found:
                cell, row = min(found, key=lambda f: _earliest(f[0]))
                first = (pair, name, {**cell, **row})
    result = _result(rows, first, permutations, pairs, used, settings)
    infos = (dict(getattr(reference, "info", None) or {}), dict(getattr(candidate, "info", None) or {}))
    return dataclasses.replace(result, infos=infos)


def _held(lay) -> list[str]:
    return sorted(lay.tensors) + sorted(lay.stats)


def _earliest(cell: dict) -> tuple:
    pos = cell["query"] if cell["query"] is not None else cell["key"]
    return (pos, cell["batch"], cell["key"] or 0, cell["dim"] or 0)


def _result(rows, first, permutations, pairs, used, settings: _Settings) -> Comparison:
    if first is None:
        return Comparison(tuple(rows), None, None, "", {}, MappingProxyType(permutations), tuple(pairs), used)
    pair, name, at = first
    fields = {f.name for f in dataclasses.fields(Divergence)} - {"tensor"}
    div = Divergence(tensor=name, **{k: at[k] for k in fields})
    tol = settings.tolerance(_pair_dtype(pair))
    cause: Diagnosis = diagnose(pair, name, div, tol)
    return Comparison(
        tuple(rows),
        div,
        cause.name,
        cause.evidence,
        MappingProxyType(dict(cause.details)),
        MappingProxyType(permutations),
        tuple(pairs),
        used,
    )
