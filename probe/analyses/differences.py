"""The cells of one head that count in a comparison, and their differences (see ``compare.py``'s docstring).

Memory: one head of one tensor at a time, in float64 on the CPU; never a float64 copy of a whole record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def working(t: torch.Tensor, precise: bool) -> torch.Tensor:
    """``t`` on the CPU in float64 (``precise``: what the diagnoses fit in), else in float32 unless it is float64 (a
    difference of two float32 values is exact in float32 when they are close, and half the memory traffic)."""
    dtype = torch.float64 if precise or t.dtype == torch.float64 else torch.float32
    return t.detach().to("cpu", dtype)


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


def attended_keys(pair: Pair) -> torch.Tensor | None:
    """``(batch, key)`` bool: keys some real row of either side may attend, in any head; None when neither side has
    a mask. A key no real row attends (padding) holds what its layer made of a padded token, which each
    implementation makes as it likes (eager and sdpa differ on fully masked rows) and no real output reads."""
    masks = [lay.allowed for lay in (pair.ref, pair.cand) if lay.allowed is not None]
    if not masks:
        return None
    real = real_rows(pair)  # (batch, query) or None
    attended = None
    for a in masks:  # (batch, 1 or head, query, key)
        rows = a.detach().cpu().bool().any(1)  # (batch, query, key)
        if real is not None and real.shape == rows.shape[:2]:
            rows = rows & real[:, :, None]
        keys = rows.any(1)  # (batch, key)
        attended = keys if attended is None else attended | keys
    return attended


def _rows(pair: Pair, name: str, shape: torch.Size) -> torch.Tensor:
    """The rows that count, broadcastable to a ``(batch, head, position, ...)`` block of ``name`` (for k and v: the
    keys a real row may attend)."""
    real = real_rows(pair)
    if name in KV_FIELDS:
        keys = attended_keys(pair)
        if keys is None or keys.shape[-1] != shape[2]:
            return torch.ones((1,) * len(shape), dtype=torch.bool)
        return keys[:, None, :, None]  # (batch, 1, key, 1)
    if real is None:
        return torch.ones((1,) * len(shape), dtype=torch.bool)
    if name in COMPARED_STATS:
        return real[:, None, stat_positions(pair)]  # (batch, 1, rows)
    return real[:, None, :, None]  # (batch, 1, query, 1)


def block(pair: Pair, name: str, heads: Sequence[int], precise: bool = True) -> Cells:
    """Compared heads ``heads`` of ``name`` on both sides, ``(batch, head, ...)`` (views where the heads sit in
    order), in float64 when ``precise``, with the cells that count (broadcastable)."""
    x = working(pair.pick_block("ref", name, heads), precise)
    y = working(pair.pick_block("cand", name, heads), precise)
    counts = _rows(pair, name, x.shape)
    positions = stat_positions(pair) if name in COMPARED_STATS else None
    if name in ("scores", "weights"):
        a_ref, a_cand = (pair.allowed_block(side, heads) for side in ("ref", "cand"))
        if name == "scores":
            for a in (a_ref, a_cand):
                counts = counts if a is None else counts & a.cpu().bool()
        elif a_ref is not None and a_cand is not None:  # weights: every key of a row that attends
            counts = counts & (a_ref.cpu().bool() | a_cand.cpu().bool()).any(-1, keepdim=True)
    return Cells(x, y, counts, positions)


def cells(pair: Pair, name: str, i: int, precise: bool = True) -> Cells:
    """Compared head ``i`` of ``name`` on both sides, ``(batch, ...)``, with the cells that count."""
    c = block(pair, name, [i], precise)
    return Cells(c.ref[:, 0], c.cand[:, 0], c.counts[:, 0], c.positions)


def differences(c: Cells) -> torch.Tensor:
    """``|cand - ref|`` with non-finite values handled: equal non-finite values agree, a non-finite value on one side
    only is an infinite difference; 0 where the cell does not count."""
    x, y = c.ref, c.cand
    d = (y - x).abs_()
    if d.numel() and not math.isfinite(float(d.max())):  # rare: the slow path for NaN and infinities
        same = (x == y) | (x.isnan() & y.isnan())
        d = torch.where(same, torch.zeros_like(d), d.nan_to_num(nan=math.inf, posinf=math.inf))
    return d if bool(c.counts.all()) else d.masked_fill_(~c.counts, 0.0)


def scale_of(c: Cells) -> float:
    """The largest finite ``|reference|`` over the cells that count."""
    return float(per_head_scale(Cells(c.ref[:, None], c.cand[:, None], c.counts[:, None])).max())


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
    k and v), in units of the tolerance. Pairs whose norms alone put them apart (the largest difference is at least
    the difference of the norms over the square root of the cells) are not compared: ``inf``."""
    kv = name in KV_FIELDS
    heads = pair.kv_heads if kv else pair.heads
    n = len(heads)
    attr = "cand_kv_heads" if kv else "cand_heads"
    saved = list(getattr(pair, attr))
    norms = torch.empty(2, n, dtype=torch.float64)
    bound = torch.empty(n, dtype=torch.float64)  # tolerance x sqrt(cells) of reference head i
    dist = torch.full((n, n), math.inf, dtype=torch.float64)
    try:
        setattr(pair, attr, list(heads))
        for i in range(n):
            c = cells(pair, name, i, precise=False)
            counting = c.counting()
            norms[0, i] = float(c.ref[counting].double().norm())
            norms[1, i] = float(c.cand[counting].double().norm())
            bound[i] = (tol[0] + tol[1] * scale_of(c)) * math.sqrt(max(int(counting.sum()), 1))
        for j in range(n):
            setattr(pair, attr, [heads[j]] * n)
            for i in range(n):
                if abs(float(norms[0, i] - norms[1, j])) > bound[i]:
                    continue
                c = cells(pair, name, i, precise=False)
                dist[i, j] = float(differences(c).max()) / (tol[0] + tol[1] * scale_of(c))
    finally:
        setattr(pair, attr, saved)
    return dist


def stacked(pair: Pair, name: str) -> Cells:
    """Every compared head of ``name`` at once: ``(batch, head, ...)`` (for the diagnoses, which fit one model to a
    whole call). q, k, v, output and statistics (O(T) a head) in float64; scores and weights, (query x key), in their
    float32 working copy (a view of what the capture holds where it can be), never a float64 copy of them."""
    n = len(pair.kv_heads) if name in KV_FIELDS else len(pair.heads)
    return block(pair, name, range(n), precise=name not in ("scores", "weights"))


def per_head_max(x: torch.Tensor) -> torch.Tensor:
    """``(head,)``: the largest value of each head of ``x`` ``(batch, head, ...)`` (0 for an empty one)."""
    if not x.numel():
        return torch.zeros(x.shape[1], dtype=x.dtype)
    return x.amax(dim=[d for d in range(x.dim()) if d != 1])


def per_head_scale(c: Cells) -> torch.Tensor:
    """``(head,)``: the largest finite ``|reference|`` of each head over the cells that count."""
    x = c.ref.abs()
    if not bool(c.counts.all()):
        x.masked_fill_(~c.counts, 0.0)
    top = per_head_max(x)
    if not bool(top.isfinite().all()):
        top = per_head_max(x.masked_fill_(~x.isfinite(), 0.0))
    return top


def per_head_cells(c: Cells) -> torch.Tensor:
    """``(head,)``: how many cells count in each head."""
    counts = torch.broadcast_to(c.counts, c.ref.shape)
    return counts.sum(dim=[d for d in range(counts.dim()) if d != 1])
