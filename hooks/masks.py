"""Masks as attention code writes them, turned into attnprobe's one form: ``allowed`` (bool, True = may attend)
plus the part of an additive mask that is a bias on the scores.

Hand-written and torch code masks in three ways: a bool mask (whose meaning of True depends on the API), a
float mask added to the scores, and ``masked_fill`` with a very negative value. An additive entry or a fill
value at or below ``MASKED_AT`` (or ``-inf``) means "masked": exp() of it relative to real scores is 0 in every
floating dtype. Anything above it is a bias (ALiBi, relative positions) that belongs to the scores.
"""

from __future__ import annotations

import torch

from ..probe.engine.attention_math import masked_softmax

#: Additive mask entries and ``masked_fill`` values at or below this count as masking (-1e4, -1e9, finfo.min, -inf).
MASKED_AT = -1e4


def is_masking_value(value) -> bool:
    """Whether a ``masked_fill`` / ``where`` fill value masks (``-inf``, ``-1e9``, ``finfo.min``, ...)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return False
        value = value.item()
    try:
        return float(value) <= MASKED_AT
    except (TypeError, ValueError):
        return False


def split_additive(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float mask added to the scores -> (allowed, bias or None). ``allowed`` is True where the entry masks
    nothing."""
    allowed = mask > MASKED_AT
    return allowed, additive_bias(mask, allowed)


def additive_bias(mask: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor | None:
    """The part of a float mask that is a bias on the scores (masked entries 0), None when there is none."""
    allowed = mask > MASKED_AT if allowed is None else allowed
    if bool(allowed.all()) and not bool(mask.any()):
        return None
    bias = mask.masked_fill(~allowed, 0.0)
    return bias if bool(bias.any()) else None


def has_masked_entries(mask: torch.Tensor) -> bool:
    """Whether a float mask would mask anything."""
    return bool((mask <= MASKED_AT).any())


def compress_heads(allowed: torch.Tensor) -> torch.Tensor:
    """``(batch, head, query, key)`` -> ``(batch, 1, query, key)`` when every head has the same mask (a view)."""
    if allowed.shape[1] > 1 and torch.equal(allowed, allowed[:, :1].expand_as(allowed)):
        return allowed[:, :1]
    return allowed


def forbids_future(allowed: torch.Tensor, query_offset: int | None = None) -> bool:
    """True when no query may attend a later key (the mask is causal); needs as many queries as keys, or
    ``query_offset``: the key index of the first query (cached keys before it)."""
    tq, tk = allowed.shape[-2:]
    if query_offset is None and tq != tk:
        return False
    future = torch.ones(tq, tk, dtype=torch.bool, device=allowed.device).triu(1 + (query_offset or 0))
    return not bool((allowed & future).any())


class Recomputed:
    """Scores and weights an adapter recomputes for a record, each only when first asked for.

    ``compute_scores()`` returns new scores the caller owns, ``allowed()`` the mask for them. When the record
    keeps no scores (``keep_scores`` False), the weights mask the scores in place and drop them: one (query,
    key) tensor per selected head less. Runs without autograd and without torch function modes (the capture's
    own mode must not see its recomputation).
    """

    def __init__(self, compute_scores, allowed, *, keep_scores: bool) -> None:
        self._compute, self._allowed, self._keep = compute_scores, allowed, keep_scores
        self._scores: torch.Tensor | None = None

    def scores(self) -> torch.Tensor:
        if self._scores is None:
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self._scores = self._compute()  # (batch, head, query, key)
        return self._scores

    def weights(self) -> torch.Tensor:
        s = self.scores()
        if not self._keep:
            self._scores = None  # masked in place below: no record reads these scores
        with torch.no_grad(), torch._C.DisableTorchFunction():  # (batch, head, query, key), masked by (b, 1 or h, q, k)
            return masked_softmax(s, self._allowed(), in_place=not self._keep)
