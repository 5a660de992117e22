"""Stitch the per-step records of a generation into one (query, key) matrix per layer.

Under ``model.generate`` a capture holds, per attention module, a prefill record (step 0) and one
record per decoding step (one query against the keys so far). ``stitch`` turns each run of steps
into a single record over the final sequence, as one forward over that sequence would give.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import AttnprobeError
from ..record import AttentionRecord

#: how to ask generate for a cache that keeps every key (the keyword changed in transformers 5.24)
_DYNAMIC_CACHE = (
    "a transformers.DynamicCache() as its cache (cache=... from transformers 5.24, past_key_values=... before)"
)


def _pad_keys(t: torch.Tensor, length: int, fill) -> torch.Tensor:
    """``t`` ``(..., key)`` with ``fill`` appended along the keys up to ``length``."""
    extra = length - t.shape[-1]
    if extra == 0:
        return t
    pad = torch.full((*t.shape[:-1], extra), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=-1)


def stitch_steps(steps: list[AttentionRecord]) -> AttentionRecord:
    """One record from the consecutive generation steps of one module (step 0 first).

    Keys never computed for an earlier step (positions generated later) get weight 0,
    ``allowed`` False and score NaN (not observed).
    """
    _check_run(steps)
    total = _check_positions(steps)  # the queries of every step, one after the other
    first, last = steps[0], steps[-1]
    # a cross-attention run reads the same keys at every step (none: no tensor with a key axis to pad)
    key_total = total if first.kind == "self" else (first.key_len or 0)

    def cat(field: str, fill):
        parts = [getattr(r, field) for r in steps]
        if any(p is None for p in parts):
            return None
        if field in ("scores", "weights", "allowed"):
            parts = [_pad_keys(p, key_total, fill) for p in parts]  # (batch, head, query, key_total) each
        return torch.cat(parts, dim=2 if field != "query_padding" else 1)

    allowed = None
    masks = [r.allowed for r in steps if r.allowed is not None]  # (batch, 1 or head, query, key) each
    if len(masks) == len(steps):
        width = max(m.shape[1] for m in masks)
        allowed = torch.cat([_pad_keys(m.expand(-1, width, -1, -1), key_total, False) for m in masks], dim=2)
    return replace(
        first,
        step=None,
        q=cat("q", 0),
        k=last.k,
        v=last.v,
        scores=cat("scores", float("nan")),
        weights=cat("weights", 0.0),
        output=cat("output", 0),
        allowed=allowed,
        query_padding=cat("query_padding", False),
        meta={**first.meta, "stitched_steps": len(steps)},
    )


def _check_run(steps: list[AttentionRecord]) -> None:
    """The steps are one run of one module: steps 0, 1, 2, ... with the same heads."""
    if not steps:
        raise AttnprobeError("nothing to stitch: no records with a generation step")
    first = steps[0]
    for i, r in enumerate(steps):
        if r.step != i:
            selected = (
                " (a selection of steps? stitch needs each run whole, from its prefill, step 0)" if i == 0 else ""
            )
            raise AttnprobeError(f"cannot stitch {first.name!r}: expected step {i}, found step {r.step}{selected}")
        if r.name != first.name or r.heads != first.heads:
            raise AttnprobeError(
                f"cannot stitch records of different modules or head selections ({first.name!r}, {r.name!r})"
            )


def _check_positions(steps: list[AttentionRecord]) -> int:
    """The queries of the steps follow each other, over keys that form one matrix (no beam reordering, no cache
    that pads or drops keys); returns where the last step's queries end."""
    expected = steps[0].query_offset
    for r in steps:
        q_len = r.query_len
        if q_len is None:
            raise AttnprobeError(f"cannot stitch {r.name!r}: step {r.step} holds no tensor with query rows")
        if r.query_offset != expected:
            rolled_back = (
                f"; the cache went back {expected - r.query_offset} position(s): assisted or prompt-lookup decoding "
                "drops the candidate tokens it rejects, whose rows the earlier step holds"
                if r.query_offset < expected
                else ""
            )
            raise AttnprobeError(
                f"cannot stitch {r.name!r}: step {r.step} starts at query position {r.query_offset}, expected "
                f"{expected}{rolled_back}"
            )
        expected += q_len
        if r.meta.get("reordered_rows"):
            raise AttnprobeError(
                f"cannot stitch {r.name!r}: before step {r.step} beam search reordered the batch rows (num_beams > 1), "
                "so a row's steps belong to different hypotheses and form no one matrix; read the steps one by one "
                "(capture.select(steps=[...])), or generate with num_beams=1 to stitch"
            )
        if r.kind == "self" and r.key_len is not None and r.key_len > expected:
            raise AttnprobeError(
                f"cannot stitch {r.name!r}: at step {r.step} the keys are {r.key_len} long but the queries reach only "
                f'position {expected}; a static cache (cache_implementation="static", '
                "StaticCache) pads the keys to its full length, so the steps do not form one matrix; generate with "
                f"{_DYNAMIC_CACHE} to stitch them"
            )
        if r.kind == "self" and r.key_len is not None and r.key_len != expected:
            raise AttnprobeError(
                f"cannot stitch {r.name!r}: at step {r.step} the keys are {r.key_len} long but the queries reach "
                f"position {expected}; a sliding-window or compressed cache drops keys, so "
                f"the steps do not form one matrix; generate with {_DYNAMIC_CACHE} (a cache that keeps every key) "
                "to stitch them"
            )
    return expected


def _runs(capture) -> list[tuple[int, list[AttentionRecord]]]:
    """The records with a ``step``, grouped per module and generation run (a run starts at step 0), with the
    run's number for that module."""
    runs: dict[tuple[str, int], list[AttentionRecord]] = {}
    counter: dict[str, int] = {}
    for r in capture:
        if r.step is None:
            continue
        if r.step == 0:
            counter[r.name] = counter.get(r.name, -1) + 1
        runs.setdefault((r.name, counter.get(r.name, 0)), []).append(r)
    return [(call, run) for (_, call), run in runs.items()]


def stitch(capture):
    """A Capture with one stitched record per module and generation run.

    Records without a ``step`` are left out; each run starts at step 0.

    Example::

        >>> # with attnprobe.capture(model) as cap: model.generate(**batch, max_new_tokens=5)
        >>> # full = attnprobe.stitch(cap); full.record(0).weights  # (batch, head, T, T)
    """
    runs = _runs(capture)
    if not runs:
        raise AttnprobeError(
            "this capture has no generation steps to stitch: capture around model.generate(...) "
            "with a model whose attention attnprobe reads through the Hugging Face adapter"
            + (
                " (generate(..., use_cache=False) has no steps: each of its calls is a whole forward over the "
                "sequence so far, so the records of its last call already hold the full matrix)"
                if len(capture)
                else ""
            )
        )
    return type(capture)(_stitched(runs), capture.info)  # a Capture (capture.py imports this module: no import back)


def _stitched(runs: list[tuple[int, list[AttentionRecord]]]) -> list[AttentionRecord]:
    stitched = [replace(stitch_steps(run), call=call) for call, run in runs]
    stitched.sort(key=lambda r: (r.call, r.layer))
    return stitched


def shown(records: list[AttentionRecord]) -> tuple[list[AttentionRecord], int]:
    """What a report draws: (records outside generation, then each whole run stitched; number stitched).

    Steps selected out of a run (``capture.select(steps=[3])``: the run does not start at step 0) are
    drawn one by one, as the steps they are.
    """
    runs = _runs(records)
    stitched = _stitched([(call, run) for call, run in runs if run[0].step == 0])
    parts = [r for _, run in runs if run[0].step != 0 for r in run]
    return [r for r in records if r.step is None] + parts + stitched, len(stitched)
