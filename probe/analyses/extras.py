"""What a statistics capture computes beside the engine's statistics, when asked: the kept fractions of KV-cache
eviction policies (``capture(..., eviction=EvictionPlan(...))``) and the per-row masses of declared spans
(``capture(..., spans=...)``). One pass over blocks of exact weights per call (``probe/engine/kept_mass.py``); under
``generate``, the prompt's key sets carry over to the later steps of the same layer."""

from __future__ import annotations

from typing import Any

import torch

from ..engine.kept_mass import EvictionPlan, EvictionState, evaluate_call, span_mass
from ..errors import SelectionError
from .spans import SpanSet


def eviction_of(eviction) -> EvictionPlan | None:
    """``capture(eviction=)``: None, True (the default plan) or an ``EvictionPlan``."""
    if eviction is None or eviction is False:
        return None
    plan = EvictionPlan() if eviction is True else eviction
    if not isinstance(plan, EvictionPlan):
        raise SelectionError(
            f"eviction= takes an attnprobe.EvictionPlan (or True for the default one), got {eviction!r}",
            argument="eviction",
            value=eviction,
        )
    return plan


def spans_of(spans) -> SpanSet | None:
    """``capture(spans=)``: None or declared spans (``attnprobe.spans``)."""
    if spans is not None and not isinstance(spans, SpanSet):
        raise SelectionError(
            "spans= takes declared spans (attnprobe.spans.ranges, sentences, chat_turns or labels), "
            f"got {type(spans).__name__}",
            argument="spans",
        )
    return spans


class CaptureExtras:
    """Per capture: the plan, the spans and the eviction state of each layer (its last prompt's key sets)."""

    def __init__(self, eviction: EvictionPlan | None = None, spans: SpanSet | None = None) -> None:
        self.eviction, self.spans = eviction, spans
        self.states: dict[int, EvictionState | None] = {}

    def __bool__(self) -> bool:
        return self.eviction is not None or self.spans is not None

    def compute(
        self,
        layer: int,
        source,
        *,
        kind: str,
        step: int | None,
        query_offset: int,
        rows: torch.Tensor | None,
        query_padding: torch.Tensor | None,
        reordered: bool = False,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(stats, meta)`` to add to one record: ``kept_<policy>`` ``(batch, head, row, budget)`` and
        ``span_mass`` ``(batch, head, row, span)`` for the selected ``rows`` (None: all), with their meta."""
        stats: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        if kind != "self":
            return stats, meta
        if self.eviction is not None:
            counted = None if query_padding is None else (~query_padding.bool()).double().cpu()
            if step == 0:
                self.states[layer] = None
            if reordered:  # beam search moved batch rows: the prompt's key sets no longer belong to these rows
                self.states[layer] = None
            fractions, info, state = evaluate_call(
                source,
                self.eviction,
                step=step,
                query_offset=query_offset,
                rows=rows,
                state=self.states.get(layer),
                counted=counted,
            )
            if step is not None:
                self.states[layer] = state
            meta["eviction"] = info
            for policy, values in (fractions or {}).items():
                stats[f"kept_{policy}"] = values
        if self.spans is not None:
            B, _, Tq, Tk = source.shape
            taken = source if rows is None else source.take(rows)
            stats["span_mass"] = span_mass(taken, self.spans.for_keys(B, Tk), len(self.spans.labels))
            meta["spans"] = self.spans.describe()
            meta["span_rows"] = list(range(Tq)) if rows is None else rows.tolist()
        return stats, meta
