"""What ``attnprobe compare`` needs beyond the public API: the candidate fed the reference's very inputs, the
``--mapping`` option, and the result as data for ``--format json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from .loading import InputError, Workload, check_fits, fit_forward, move_workload


def parse_mapping(text: str | None) -> dict[int | str, int | str] | None:
    """``--mapping "0=0,3=5"`` or ``"model.layers.0.self_attn=blocks.0.attn"``: reference -> candidate, each a
    layer number or a module name."""
    if text is None:
        return None
    mapping: dict[int | str, int | str] = {}
    for item in (part.strip() for part in text.split(",")):
        ref, sep, cand = item.partition("=")
        if not sep or not ref.strip() or not cand.strip():
            raise InputError(
                f"--mapping {text!r}: each item is REFERENCE=CANDIDATE (layer numbers or module names), "
                f"e.g. 0=0,1=2; got {item!r}"
            )
        mapping[_layer_or_name(ref)] = _layer_or_name(cand)
    return mapping


def _layer_or_name(text: str) -> int | str:
    text = text.strip()
    return int(text) if text.isdigit() else text


def candidate_workload(reference: Workload, model, tokenizer, source: str, device: str | None) -> Workload:
    """The candidate on exactly the reference's inputs (the same token ids, padding and mask), fitted to how its
    forward takes them (``fit_forward``: a nanoGPT-style ``forward(idx)`` gets the ids alone)."""
    work = Workload(
        model=model,
        source=source,
        tokenizer=tokenizer,
        inputs=dict(reference.inputs),
        tokens=reference.tokens,
        decoder_tokens=reference.decoder_tokens,
        texts=list(reference.texts),
    )
    fit_forward(work)
    check_fits(model, work.inputs, from_tokenizer=bool(work.texts))
    if device is not None:
        move_workload(work, device)
    return work


def comparison_json(result, reference: str, candidate: str) -> dict[str, Any]:
    """``compare --format json``: the result as data."""
    first = None if result.first is None else dataclasses.asdict(result.first)
    return {
        "reference": reference,
        "candidate": candidate,
        "ok": result.ok,
        "first": first,
        "diagnosis": result.diagnosis,
        "evidence": result.evidence,
        "details": dict(result.details),
        "permutations": {str(k): list(v) for k, v in result.permutations.items()},
        "tolerances": {k: list(v) for k, v in result.tolerances.items()},
        "compared": len(result.rows),
    }
