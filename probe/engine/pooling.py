"""Pooled overviews and exact windows of attention weights, block by block: never a ``(query x key)`` tensor.

A long input's weights do not fit a report: ``Pooler`` folds blocks of exact weights (query rows ``a:``, keys
``c:``, in any order and any block shape) into at most ``cells x cells`` cells (max and mean over each cell's
entries) and copies the entries of a few windows ``(q0, q1, k0, k1)``. The statistics engine
(``probe.stats.attention_stats(call, overview=...)``) feeds it the weights it computes from q and k
(``probe.attention_math``); ``pool_weights`` feeds it a full weight tensor (a full capture's, the reference).

Cells: an axis of length ``T`` is cut into ``ceil(T / size)`` cells of ``size = ceil(T / cells)`` entries (the
last may be shorter); the mean divides by the entries a cell really has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Overview", "Pooler", "cell_size", "pool_weights"]


@dataclass(frozen=True)
class Overview:
    """What a statistics capture also keeps of the weights, still without a ``(query x key)`` tensor:
    the weights pooled (max and mean) to at most ``cells`` x ``cells`` cells (``OVERVIEW_STATS``), and the exact
    weights of a few ``windows`` ``(q0, q1, k0, k1)`` (query rows ``q0:q1`` x keys ``k0:k1``, as
    ``window_<i>``). Both are computed block by block from the engine's exact weights (``pooling.py``)."""

    cells: int | None = 512
    windows: tuple[tuple[int, int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.cells is not None and (
            isinstance(self.cells, bool) or not isinstance(self.cells, int) or self.cells < 1
        ):
            raise ValueError(f"Overview cells must be a positive int, got {self.cells!r}")
        windows = []
        for given in self.windows:
            w = tuple(given)
            if (
                len(w) != 4
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in w)
                or w[0] >= w[1]
                or w[2] >= w[3]
            ):
                raise ValueError(
                    f"an Overview window is (q0, q1, k0, k1) with 0 <= q0 < q1 and 0 <= k0 < k1, got {w!r}"
                )
            windows.append(w)
        object.__setattr__(self, "windows", tuple(windows))


def cell_size(length: int, cells: int | None) -> int:
    """Entries per cell along an axis of ``length`` pooled to at most ``cells`` cells (None: 1, no pooling).

    Example::

        >>> cell_size(32768, 512), cell_size(100, 512), cell_size(1000, 512)
        (64, 1, 2)
    """
    return 1 if cells is None or length <= cells else math.ceil(length / cells)


def _pool_axis(t: torch.Tensor, start: int, size: int, dim: int, op: str) -> tuple[int, torch.Tensor]:
    """Pool ``t`` (whose index 0 along ``dim`` is global position ``start``) into cells of ``size``:
    ``(first cell, pooled)``. A cell cut by the block's edge is pooled over the part inside (weights are >= 0: the
    max and the sum over the whole cell come out right once every block is folded in). No copy of ``t`` is made."""
    if size == 1:
        return start, t
    dim = dim % t.dim()
    n, off = t.shape[dim], start % size

    def pool(x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.amax(axis) if op == "max" else x.sum(axis)

    pieces, i = [], 0
    if off:  # the end of a cell the previous block began
        i = min(size - off, n)
        pieces.append(pool(t.narrow(dim, 0, i), dim).unsqueeze(dim))
    whole = (n - i) // size * size
    if whole:
        pieces.append(pool(t.narrow(dim, i, whole).unflatten(dim, (whole // size, size)), dim + 1))
        i += whole
    if i < n:  # the start of a cell the next block ends
        pieces.append(pool(t.narrow(dim, i, n - i), dim).unsqueeze(dim))
    return start // size, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


class Pooler:
    """Accumulates exact weight blocks into ``overview_max``/``overview_mean`` and ``window_<i>`` tensors.

    ``overview``: an ``Overview`` (``cells``, ``windows``). Windows are clipped to ``(Tq, Tk)``
    (``windows`` holds the clipped bounds).
    """

    def __init__(self, overview, B: int, h: int, Tq: int, Tk: int, device, dtype=torch.float32) -> None:
        self.B, self.h, self.Tq, self.Tk, self.dtype = B, h, Tq, Tk, dtype
        self.cells = overview.cells
        self.rq, self.rk = cell_size(Tq, self.cells), cell_size(Tk, self.cells)
        self.nq, self.nk = math.ceil(Tq / self.rq), math.ceil(Tk / self.rk)
        if self.cells is not None:
            self.max = torch.zeros(B, h, self.nq, self.nk, device=device, dtype=dtype)
            self.sum = torch.zeros(B, h, self.nq, self.nk, device=device, dtype=dtype)
        self.windows = [(min(q0, Tq), min(q1, Tq), min(k0, Tk), min(k1, Tk)) for q0, q1, k0, k1 in overview.windows]
        self.window = [
            torch.zeros(B, h, q1 - q0, k1 - k0, device=device, dtype=dtype) for q0, q1, k0, k1 in self.windows
        ]

    def add(self, w: torch.Tensor, a: int, c: int, row_scale: torch.Tensor | None = None) -> None:
        """Fold in exact weights ``w`` ``(B, h, rows, keys)`` of query rows ``a:`` and keys ``c:`` (each entry once);
        with ``row_scale`` ``(B, h, rows)`` the weights are ``w * row_scale[..., None]`` (the engine's ``e`` and
        ``1 / sum``: applied after pooling over keys, so no block-sized product is made)."""
        n, kn = w.shape[-2], w.shape[-1]
        w = w.to(self.dtype)
        scale = None if row_scale is None else row_scale.to(self.dtype)[..., None]
        for (q0, q1, k0, k1), out in zip(self.windows, self.window):
            r0, r1, s0, s1 = max(a, q0), min(a + n, q1), max(c, k0), min(c + kn, k1)
            if r0 < r1 and s0 < s1:
                part = w[:, :, r0 - a : r1 - a, s0 - c : s1 - c]
                out[:, :, r0 - q0 : r1 - q0, s0 - k0 : s1 - k0] = (
                    part if scale is None else part * scale[:, :, r0 - a : r1 - a]
                )
        if self.cells is None:
            return
        ck, kmax = _pool_axis(w, c, self.rk, -1, "max")
        _, ksum = _pool_axis(w, c, self.rk, -1, "sum")
        if scale is not None:
            kmax, ksum = kmax * scale, ksum * scale
        cq, qmax = _pool_axis(kmax, a, self.rq, -2, "max")
        _, qsum = _pool_axis(ksum, a, self.rq, -2, "sum")
        region = (slice(None), slice(None), slice(cq, cq + qmax.shape[-2]), slice(ck, ck + qmax.shape[-1]))
        self.max[region] = torch.maximum(self.max[region], qmax)
        self.sum[region] += qsum

    def add_uniform(self, rows: torch.Tensor, a: int, weight: float) -> None:
        """Rows ``a:`` where ``rows`` ``(B, h, n)`` is True have ``weight`` at every key (empty rows of an
        additive mask); their weights were not in any block given to ``add``."""
        if not bool(rows.any()):
            return
        for (q0, q1, k0, k1), out in zip(self.windows, self.window):
            r0, r1 = max(a, q0), min(a + rows.shape[-1], q1)
            if r0 < r1:
                sel = rows[:, :, r0 - a : r1 - a, None].expand(-1, -1, -1, k1 - k0)
                out[:, :, r0 - q0 : r1 - q0] = torch.where(
                    sel, torch.as_tensor(weight, dtype=self.dtype), out[:, :, r0 - q0 : r1 - q0]
                )
        if self.cells is None:
            return
        cq, count = _pool_axis(rows.to(self.dtype), a, self.rq, -1, "sum")  # (B, h, cells): uniform rows per cell
        keys = torch.full((self.nk,), float(self.rk), dtype=self.dtype, device=count.device)
        keys[-1] = self.Tk - self.rk * (self.nk - 1)
        region = (slice(None), slice(None), slice(cq, cq + count.shape[-1]))
        self.sum[region] += count[..., None] * keys * weight
        self.max[region] = torch.where(count[..., None] > 0, self.max[region].clamp(min=weight), self.max[region])

    def result(self) -> dict[str, torch.Tensor]:
        out = {f"window_{i}": t for i, t in enumerate(self.window)}
        if self.cells is not None:
            rows = torch.full((self.nq,), float(self.rq), dtype=self.dtype, device=self.sum.device)
            rows[-1] = self.Tq - self.rq * (self.nq - 1)
            keys = torch.full((self.nk,), float(self.rk), dtype=self.dtype, device=self.sum.device)
            keys[-1] = self.Tk - self.rk * (self.nk - 1)
            out["overview_max"] = self.max
            out["overview_mean"] = self.sum / (rows[:, None] * keys[None, :])
        return out


def pool_weights(weights: torch.Tensor, overview, *, rows_per_block: int | None = None) -> dict[str, torch.Tensor]:
    """``Pooler`` over a full weight tensor ``(batch, head, query, key)``, a block of query rows at a time: the
    reference for the engine's overviews, and how a full capture gets them.

    Example::

        >>> w = torch.arange(16.0).view(1, 1, 4, 4)
        >>> out = pool_weights(w, Overview(cells=2, windows=((1, 2, 0, 4),)))
        >>> out["overview_max"][0, 0].tolist(), out["overview_mean"][0, 0].tolist(), out["window_0"][0, 0].tolist()
        ([[5.0, 7.0], [13.0, 15.0]], [[2.5, 4.5], [10.5, 12.5]], [[4.0, 5.0, 6.0, 7.0]])
    """
    B, h, Tq, Tk = weights.shape
    dtype = torch.promote_types(weights.dtype, torch.float32)
    pool = Pooler(overview, B, h, Tq, Tk, weights.device, dtype)
    step = rows_per_block or max(1, (1 << 24) // max(1, B * h * Tk))
    with torch.no_grad():
        for a in range(0, Tq, step):
            pool.add(weights[:, :, a : a + step], a, 0)
    return pool.result()
