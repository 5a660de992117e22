"""What rows of attention weights sum to when a model has attention sinks (GPT-OSS ``s_aux``).

A sink is one extra logit per head that takes part in the softmax and is then dropped, so each row of
``weights`` sums to ``1 - sink mass``. The checks (``row_sum``) and anything that reports row-sum errors
(frames) should measure against the same expectation; this is it.
"""

from __future__ import annotations

import math

import torch

from ..record import AttentionRecord


def sink_mass(scores: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``(batch, head, query)``: the softmax share of each head's sink logit.

    ``scores`` ``(batch, head, query, key)`` pre-softmax, ``allowed`` ``(batch, 1 or head, query, key)``
    bool, ``sinks`` ``(head,)``. Computed in the dtype of ``scores`` (pass float32 or float64).

    Example::

        >>> import torch
        >>> mass = sink_mass(torch.zeros(1, 1, 1, 3), torch.ones(1, 1, 1, 3, dtype=torch.bool), torch.zeros(1))
        >>> round(float(mass), 4)   # the sink is one of four equal logits
        0.25
    """
    logits = torch.where(allowed, scores, -math.inf)
    sink = sinks.to(scores.device, scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., -1]


def expected_row_sums(record: AttentionRecord) -> float | torch.Tensor | None:
    """What each row of ``record.weights`` sums to: 1.0 without sinks, else ``1 - sink_mass`` as a
    float32 ``(batch, head, query)`` tensor; None when the record has sinks but no scores or mask to
    compute their mass from."""
    if record.sinks is None:
        return 1.0
    if record.scores is None or record.allowed is None:
        return None
    return 1.0 - sink_mass(record.scores.float(), record.allowed, record.sinks)
