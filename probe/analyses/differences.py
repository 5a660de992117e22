"""The cells of one head that count in a comparison, and their differences (see ``compare.py``'s docstring).

Memory: one head of one tensor at a time, in float64 on the CPU; never a float64 copy of a whole record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .alignment import COMPARED_STATS, KV_FIELDS, AlignmentError, Pair


@dataclass
class Cells:
    """One head of one tensor, both sides in float64 with the cells that count: ``(batch, position, ...)``."""

    ref: torch.Tensor
    cand: torch.Tensor
    counts: torch.Tensor  # bool, broadcastable to ref
    positions: torch.Tensor | None = None  # statistics: the query position of each row

    def counting(self) -> torch.Tensor:
        return self.counts.expand_as(self.ref)


def real_rows(pair: Pair) -> torch.Tensor | None:
    """``(batch, query)`` bool: rows neither side calls padding; None when neither knows."""
    pads = [p.detach().cpu().bool() for p in (pair.ref.padding, pair.cand.padding) if p is not None]
    if not pads:
        return None
    real = ~pads[0]
    for p in pads[1:]:
        real = real & ~p
    return real


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def stat_positions(pair: Pair) -> torch.Tensor:
    """The query positions both statistics captures describe (the same rows, or an error)."""
    pos = [lay.record.stats_positions for lay in (pair.ref, pair.cand)]
    if pos[0] is None or pos[1] is None or not torch.equal(pos[0], pos[1]):
        raise AlignmentError(
            f"layer {pair.ref.record.layer}: the two statistics captures describe different query rows; capture both "
            "with the same stats_rows",
            reference=pos[0],
            candidate=pos[1],
        )
    return pos[0]


def allowed_pair(pair: Pair, i: int, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides' ``allowed`` of compared head ``i`` as ``(batch, query, key)`` bool (all True where unknown)."""
    out = []
    for side in ("ref", "cand"):
        a = pair.allowed(side, i)
        out.append(torch.ones(shape, dtype=torch.bool) if a is None else a.cpu().bool().expand(shape))
    return out[0], out[1]


def cells(pair: Pair, name: str, i: int) -> Cells:
    """Head ``i`` of tensor ``name`` on both sides, with the cells that count."""
    x, y = f64(pair.pick("ref", name, i)), f64(pair.pick("cand", name, i))
    real = real_rows(pair)
    if name in KV_FIELDS:
        return Cells(x, y, torch.ones(1, 1, 1, dtype=torch.bool))
    if name in COMPARED_STATS:
        pos = stat_positions(pair)
        rows = torch.ones(x.shape, dtype=torch.bool) if real is None else real[:, pos]
        return Cells(x, y, rows, pos)
    rows = torch.ones(x.shape[:2], dtype=torch.bool) if real is None else real
    if name in ("q", "output"):
        return Cells(x, y, rows[..., None])
    a_ref, a_cand = allowed_pair(pair, i, x.shape)
    if name == "scores":
        return Cells(x, y, a_ref & a_cand & rows[..., None])
    return Cells(x, y, ((a_ref | a_cand).any(-1) & rows)[..., None])  # weights: every key of a row that attends


def differences(c: Cells) -> torch.Tensor:
    """``|cand - ref|`` with non-finite values handled: equal non-finite values agree, a non-finite value on one side
    only is an infinite difference; 0 where the cell does not count."""
    x, y = c.ref, c.cand
    d = (y - x).abs()
    same = (x == y) | (x.isnan() & y.isnan())
    d = torch.where(same, torch.zeros_like(d), d.nan_to_num(nan=math.inf, posinf=math.inf))
    return torch.where(c.counting(), d, torch.zeros_like(d))


def scale_of(c: Cells) -> float:
    """The largest finite ``|reference|`` over the cells that count."""
    x = c.ref.abs()
    x = torch.where(c.counting() & x.isfinite(), x, torch.zeros_like(x))
    return float(x.max()) if x.numel() else 0.0


def mask_differs(pair: Pair, i: int) -> torch.Tensor | None:
    """``(batch, query, key)`` bool: real-row cells of compared head ``i`` one side allows and the other masks; None
    when a side has no mask."""
    a, b = pair.allowed("ref", i), pair.allowed("cand", i)
    if a is None or b is None:
        return None
    a, b = torch.broadcast_tensors(a.cpu().bool(), b.cpu().bool())
    diff = a != b
    real = real_rows(pair)
    return diff if real is None else diff & real[..., None]


def head_distances(pair: Pair, name: str, tol: tuple[float, float]) -> torch.Tensor:
    """``(n, n)``: the largest difference of reference head i and candidate head j of ``name`` (key/value heads for
    k and v), in units of the tolerance."""
    kv = name in KV_FIELDS
    heads = pair.kv_heads if kv else pair.heads
    n = len(heads)
    dist = torch.empty(n, n, dtype=torch.float64)
    saved = list(pair.cand_kv_heads if kv else pair.cand_heads)
    try:
        for j in range(n):
            if kv:
                pair.cand_kv_heads = [heads[j]] * n
            else:
                pair.cand_heads = [heads[j]] * n
            for i in range(n):
                c = cells(pair, name, i)
                dist[i, j] = float(differences(c).max()) / (tol[0] + tol[1] * scale_of(c))
    finally:
        if kv:
            pair.cand_kv_heads = saved
        else:
            pair.cand_heads = saved
    return dist


def stacked(pair: Pair, name: str) -> Cells:
    """Every compared head of ``name`` at once: ``(batch, head, ...)`` (for the diagnoses, which fit one model to a
    whole layer; q/k/v and statistics are O(T) a head, scores and weights are what the capture already holds)."""
    n = len(pair.kv_heads) if name in KV_FIELDS else len(pair.heads)
    parts = [cells(pair, name, i) for i in range(n)]
    return Cells(
        torch.stack([p.ref for p in parts], 1),
        torch.stack([p.cand for p in parts], 1),
        torch.stack([p.counting() for p in parts], 1),
        parts[0].positions,
    )
