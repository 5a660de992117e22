"""Declarations against per-row statistics: what a statistics-only record (``record.stats``) says about each row's keys.

A statistics capture keeps no ``(query, key)`` tensor, only per-row facts: the first and last key with weight
(``first_key``, ``last_key``), the first and last key the call's mask allows (``first_allowed``, ``last_allowed``),
how many it allows (``allowed_keys``), and per key whether any query may attend it (``key_allowed``). Since every
shorthand declaration confines a row to one interval of keys (less padded keys), these decide each verdict exactly:

- weight outside a declared interval ``[lo, hi]``: ``first_key < lo`` or ``last_key > hi``;
- the call's allowed keys are ``[first_allowed, last_allowed]`` less a set of holes shared by the rows (padding, or
  keys no query may attend) exactly when their count matches ``allowed_keys``; then whether every declared key is
  allowed is a difference of counts (``reach``). Rows whose mask has other holes are decided where the counts
  allow it (fewer allowed keys than declared ones, a declared key outside the allowed span), and counted as
  undecided otherwise (said in ``CheckResult.skipped``).

A ``mask_fn`` is evaluated on blocks of (rows, keys) against the same reconstruction. Everything here is
``(batch, head, rows)`` per row; ``cum`` tensors are ``(batch or 1, 1 or head, key + 1)`` running counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: A mask_fn block of a statistics record holds at most this many (batch, head, rows, key) cells.
BLOCK_ELEMENTS = 1 << 22


def running_count(keep: torch.Tensor) -> torch.Tensor:
    """``(..., key) bool -> (..., key + 1)`` long: how many kept keys come before each key index (and in all)."""
    zero = torch.zeros(*keep.shape[:-1], 1, dtype=torch.long, device=keep.device)
    return torch.cat([zero, keep.long().cumsum(-1)], dim=-1)


def count_in(cum: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Kept keys with index in ``[lo, hi]`` per row: ``cum`` ``(B or 1, H or 1, key + 1)``, ``lo``/``hi``
    ``(B or 1, H or 1, rows)`` (clamped to the keys; an empty interval counts 0)."""
    n = cum.shape[-1] - 1
    a = lo.clamp(0, n)
    b = (hi + 1).clamp(0, n)
    b = torch.maximum(a, b)
    shape = tuple(max(x, y) for x, y in zip(cum.shape[:-1], a.shape[:-1]))  # both (B or 1, H or 1)
    cum = cum.expand(*shape, cum.shape[-1])
    a, b = a.expand(*shape, a.shape[-1]), b.expand(*shape, b.shape[-1])
    return cum.gather(-1, b) - cum.gather(-1, a)


def keys_of(pad: torch.Tensor | None, B: int, Tk: int, device: torch.device) -> torch.Tensor:
    """``(B, 1, key)`` bool: the keys a declaration may hold a row to (not padding)."""
    if pad is None:
        return torch.ones(B, 1, Tk, dtype=torch.bool, device=device)
    return ~pad.to(device, torch.bool)[:, None, :]


class Allowed:
    """The call's allowed keys per row, from statistics: ``[first_allowed, last_allowed]`` less the holes that make
    the count match ``allowed_keys`` (the padding, then the keys no query may attend, then none), where one does."""

    def __init__(self, st, pad: torch.Tensor | None) -> None:
        self.fa, self.la, self.n = st["first_allowed"], st["last_allowed"], st["allowed_keys"]  # (B, H, rows)
        B, H, _ = self.fa.shape
        Tk = st["key_allowed"].shape[-1]
        holes = [torch.zeros(1, 1, Tk, dtype=torch.bool, device=self.fa.device)]
        if pad is not None:
            holes.insert(0, pad.to(self.fa.device, torch.bool)[:, None, :])
        holes.insert(len(holes) - 1, ~st["key_allowed"].to(self.fa.device, torch.bool))
        self.exact = torch.zeros_like(self.n, dtype=torch.bool)  # (B, H, rows)
        self.hole = torch.zeros(B, H, self.fa.shape[-1], dtype=torch.long, device=self.fa.device)  # which holes
        self.holes = holes
        for i, h in enumerate(holes):
            fits = (self.n == count_in(running_count(~h), self.fa, self.la)) & ~self.exact
            self.hole = torch.where(fits, i, self.hole)
            self.exact |= fits

    def block(self, rows: slice, Tk: int) -> torch.Tensor:
        """``(B, H, rows, key)`` bool for exactly reconstructed rows (others: their allowed span)."""
        keys = torch.arange(Tk, device=self.fa.device)
        fa, la = self.fa[..., rows, None], self.la[..., rows, None]
        span = (keys >= fa) & (keys <= la)  # (B, H, rows, key)
        hole = torch.zeros_like(span)
        for i, h in enumerate(self.holes):
            pick = (self.hole[..., rows] == i) & self.exact[..., rows]  # (B, H, rows)
            hole |= pick[..., None] & h[:, :, None, :]
        return span & ~hole


def missing_in_interval(
    allowed: Allowed, keep: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(missing, undecided)`` ``(B, H, rows)``: how many declared keys (``keep`` ``(B, 1, key)`` in ``[lo, hi]``,
    ``(B or 1, 1, rows)``) the call masked, and the rows the statistics cannot decide."""
    fa, la = allowed.fa, allowed.la
    declared = count_in(running_count(keep), lo, hi)  # (B, H or 1, rows)
    inside = count_in(running_count(keep), torch.maximum(lo, fa), torch.minimum(hi, la))  # in the allowed span
    missing = torch.zeros_like(allowed.n)
    for i, h in enumerate(allowed.holes):
        pick = allowed.exact & (allowed.hole == i)
        kept = count_in(running_count(keep & ~h), torch.maximum(lo, fa), torch.minimum(hi, la))
        missing = torch.where(pick, declared - kept, missing)
    outside = declared - inside  # declared keys outside the allowed span: masked whatever the holes
    sure = torch.maximum(outside, declared - allowed.n)
    missing = torch.where(allowed.exact, missing, sure.clamp(min=0))
    undecided = ~allowed.exact & (missing == 0) & (declared > 0)
    return missing, undecided


def missing_in_blocks(
    allowed: Allowed, declared_block: Callable[[int, int], torch.Tensor], keep: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(missing, undecided)`` as ``missing_in_interval`` for a declaration given as blocks of rows
    (``declared_block(a, b)`` ``(B or 1, H or 1, b - a, key)``), a few rows at a time."""
    B, H, _ = allowed.n.shape
    Tk = keep.shape[-1]
    missing, undecided = torch.zeros_like(allowed.n), torch.zeros_like(allowed.exact)
    step = max(1, BLOCK_ELEMENTS // max(1, B * H * Tk))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        want = declared_block(a, b) & keep[:, :, None, :]  # (B, H or 1, rows, key)
        span = allowed.block(slice(a, b), Tk)  # (B, H, rows, key)
        exact = allowed.exact[..., a:b]
        got = (want & ~span).sum(-1)  # (B, H, rows): declared keys outside what the call allows
        short = want.sum(-1) - allowed.n[..., a:b]  # (B, H, rows): more declared keys than allowed ones
        missing[..., a:b] = torch.where(~exact & (got == 0) & (short > 0), short, got)
        undecided[..., a:b] = ~exact & (got == 0) & (short <= 0) & want.any(-1)
    return missing, undecided


def leaks_in_blocks(
    st, allowed: Allowed, declared_block: Callable[[int, int], torch.Tensor], rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(leak, undecided)`` ``(B, H, rows)`` bool: rows that put weight where a declaration given as blocks forbids.
    Sure where the first or last key with weight is forbidden; else where the call allows a forbidden key between
    them (its weight is positive unless it rounds below the threshold: what the mask lets the row attend);
    undecided where neither the declaration nor the reconstruction tells."""
    first, last = st["first_key"], st["last_key"]  # (B, H, rows)
    B, H, _ = first.shape
    Tk = st["key_allowed"].shape[-1]
    leak, undecided = torch.zeros_like(allowed.exact), torch.zeros_like(allowed.exact)
    keys = torch.arange(Tk, device=first.device)
    step = max(1, BLOCK_ELEMENTS // max(1, B * H * Tk))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        want = declared_block(a, b).expand(B, H, b - a, Tk)  # (B, H, rows, key)
        f, l_ = first[..., a:b], last[..., a:b]
        hit = f >= 0
        between = (keys >= f[..., None]) & (keys <= l_[..., None])  # (B, H, rows, key)
        ends = (
            ~want.gather(-1, f.clamp(min=0)[..., None])[..., 0] | ~want.gather(-1, l_.clamp(min=0)[..., None])[..., 0]
        )
        inner = (between & ~want).any(-1)
        open_ = (between & ~want & allowed.block(slice(a, b), Tk)).any(-1)  # a forbidden key the call allows
        exact = allowed.exact[..., a:b]
        leak[..., a:b] = hit & (ends | (inner & exact & open_))
        undecided[..., a:b] = hit & ~ends & inner & ~exact
    return leak, undecided
