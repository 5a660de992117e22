"""``attnprobe.compare``: two implementations of one model, head by head (the engine is probe/analyses/compare.py;
this entry point lives in hooks/ because it runs the models under capture)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..probe.analyses.compare import Comparison, ComparisonError, compare_captures
from ..probe.errors import warn_user
from .api import run


def _run_side(model: nn.Module, inputs, options: Mapping[str, Any], side: str):
    if model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        warn_user(
            f"the {side} is in training mode with dropout: its attention is random and will not match; call .eval()"
        )
    _, cap = run(model, inputs, **options)
    if not len(cap):
        hint = (
            "" if "modules" in options else f"; for attention written by hand pass {side}_options={{'modules': 'auto'}}"
        )
        raise ComparisonError(f"capturing the {side} ({type(model).__name__}) recorded no attention call{hint}")
    return cap


def _batch_size(inputs) -> int | None:
    """The batch size of the first tensor among ``inputs`` (a tensor, a mapping or a sequence)."""
    values = (
        inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    )
    first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    return None if first is None else int(first.shape[0])


def compare(
    reference,
    candidate,
    inputs=None,
    *,
    mapping: Mapping[int | str, int | str] | None = None,
    tensors: Sequence[str] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    allow_permuted_heads: bool = False,
    batch: int | None = None,
    candidate_inputs=None,
    reference_options: Mapping[str, Any] | None = None,
    candidate_options: Mapping[str, Any] | None = None,
    **options,
) -> Comparison:
    """Compare two implementations of one model head by head: where they first diverge, and the likely cause.

    ``reference``, ``candidate``: two models, run on ``inputs`` as ``attnprobe.run`` takes them (``candidate_inputs``
    when the candidate takes its input another way); or two captures (``Capture`` or lists of ``AttentionRecord``)
    with ``inputs`` omitted. ``options`` go to both captures (``layers``, ``heads``, ``keep``, ``dtype``, ...;
    ``keep=("stats",)`` compares per-row statistics without any (query x key) tensor); ``reference_options`` and
    ``candidate_options`` to one side only (``{"modules": "auto"}`` for attention written by hand).

    ``mapping``: ``{reference layer or module name: candidate layer or module name}`` to say which calls correspond
    (default: forward order, refused when the two made different numbers of calls); unmapped calls are not compared.
    ``tensors``: which of q, k, v, scores, weights, output and the statistics to compare (default: all that both
    recorded). ``atol``/``rtol``: a cell differs when ``|candidate - reference| > atol + rtol * scale`` (``scale``:
    the head's largest ``|reference|``; defaults by dtype, ``probe.analyses.compare.TOLERANCES``).
    ``allow_permuted_heads``: heads found in another order are compared as matched (``Comparison.permutations``)
    instead of being the divergence (diagnosed ``head_order``). ``batch``: the input's batch size, for when both sides
    fold heads into the batch axis (attention on ``(batch * heads, T, d)``); inferred from ``inputs``.

    Returns a ``Comparison``: ``ok``, ``first`` (layer, head, tensor, query, key and both values), ``diagnosis``
    (``scale``, ``mask``, ``rope_layout``, ``rope_base``, ``positions``, ``head_order``, ``kv_repeat``, ``softcap``,
    ``softmax_dtype`` or ``unknown``) with its ``evidence``, and ``to_frame()`` (one row per layer, head and tensor).

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True).eval()
        >>> x = torch.randn(1, 5, 8)
        >>> result = attnprobe.compare(attn, attn, x)
        >>> result.ok, result.first, result.diagnosis
        (True, None, None)
    """
    if inputs is None:
        if isinstance(reference, nn.Module) or isinstance(candidate, nn.Module):
            raise ComparisonError(
                "compare(reference, candidate) got a model without inputs: pass inputs= to run the two models, "
                "or two captures"
            )
        ref_cap, cand_cap = reference, candidate
    else:
        for side, model in (("reference", reference), ("candidate", candidate)):
            if not isinstance(model, nn.Module):
                raise ComparisonError(
                    f"with inputs, the {side} must be a model (torch.nn.Module), got {type(model).__name__}; "
                    "to compare two captures, leave inputs out"
                )
        batch = batch or _batch_size(inputs)
        ref_cap = _run_side(reference, inputs, {**options, **(reference_options or {})}, "reference")
        cand_inputs = inputs if candidate_inputs is None else candidate_inputs
        cand_cap = _run_side(candidate, cand_inputs, {**options, **(candidate_options or {})}, "candidate")
    return compare_captures(
        ref_cap,
        cand_cap,
        mapping=mapping,
        tensors=tensors,
        atol=atol,
        rtol=rtol,
        allow_permuted_heads=allow_permuted_heads,
        batch=batch,
    )
