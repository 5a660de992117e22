"""Attention invariants: ``check`` re-derives the math of every record and names what breaks.

Each check has a stable name (``CHECKS``) and returns ``Violation`` records, one per
(record, head, batch row) that breaks it, with the offending query and key positions:

- ``finite``: no NaN or inf in weights and outputs, nor in scores at allowed positions. This one also
  looks at padded and fully masked query rows: a NaN there reaches the real rows of the next layer
  through ``0 * NaN`` (the naive ``-inf`` softmax bug), so it is never "don't care".
- ``range``: weights within [0, 1].
- ``row_sum``: every real query row sums to 1 (1 minus the sink mass where ``record.sinks`` exist).
- ``causal``: no weight on keys after the query's position (``record.query_offset`` places the queries
  of a KV-cache step; a sliding-window cache that dropped old keys holds the latest ones, and keys are
  reported by position, not cache slot; ``record.sliding_window`` also forbids keys older than the
  window), and a causal mask lets each real query attend its own position (a right-padded query whose
  own key is padding is padding, not a shifted mask). With ``causal=False`` declared, a model that
  masks every later key is reported.
- ``padding``: no weight on padded keys, from the declared ``attention_mask`` or the record's own.
- ``mask``: no weight where the record's own ``allowed`` mask disallows.
- ``softmax_match``: weights equal the softmax of the masked scores (sinks included).
- ``output_match``: the per-head output equals ``weights @ v``, grouped-query heads mapped to their
  kv head. This catches a kernel that computes something else than its scores say: a mask dropped
  inside a fused kernel, a wrong grouped-query head mapping, a doubled scale, dropout left on in eval.
- ``empty_rows`` (info): real query rows with no allowed key. Such rows, and padded query rows
  (``record.query_padding`` or the declared mask), are left out of every other check but ``finite``.

A statistics-only record (``capture(keep=("stats",))``: ``record.stats``, no weights) is checked as one block of
per-row statistics by the same registered functions: every check but ``softmax_match`` (which needs the weights
and the scores, and says so in ``skipped``) gives the verdict it gives on the full record, with offending rows
named per row (``causal`` and ``padding`` from the first and last key each row gives weight, ``padding`` also
from the weight per key).

Tolerances depend on the coarsest dtype involved (``DEFAULT_TOLERANCES``); matches also allow for the
rounding of the scores (relative error ``expm1(2 * eps * max|score|)``). A weight on a forbidden key counts
when it exceeds ``FORBIDDEN_WEIGHT`` (correct masking gives exact zeros in every dtype) or ``atol``
when given. A check that needs a field the record lacks is skipped and says so in
``CheckResult.skipped``; it never passes silently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..errors import SelectionError, warn_user
from ..record import AttentionRecord
from . import builtin as _builtin  # registers the built-in checks
from .blocks import RecordFacts, RowBlock, record_shapes
from .declarations import declarations_fit, declared_layers_exist, mask_tensor, validate_declarations
from .findings import MAX_GROUPS, CheckRun, records_of
from .lint import attribute_causes
from .registry import REGISTRY, CheckSpec, register
from .tolerances import DEFAULT_TOLERANCES, FORBIDDEN_WEIGHT, Tolerance, tolerance
from .violations import CheckResult, InvariantError, Violation  # InvariantError: re-exported

#: Built-in checks, in the order they run and are reported (``REGISTRY`` holds them with severity and docs).
CHECKS: tuple[str, ...] = tuple(REGISTRY)

#: One line per check (docs, CLI help).
CHECK_DESCRIPTIONS: dict[str, str] = {name: spec.doc for name, spec in REGISTRY.items()}

#: Query rows are checked in blocks so that no (batch, head, rows, key) temporary passes this many
#: elements (16 MiB in float32): checking a long-context capture needs a bounded amount of extra memory.
CHUNK_ELEMENTS = 1 << 22


def _lint(run: CheckRun, rec: AttentionRecord, index: int) -> None:
    """Findings an adapter recorded at capture time (``record.meta["lint"]``), as selected."""
    selected = run.lint_names  # "all", a set of lint names, or None
    if selected is None:
        return
    for v in rec.meta.get("lint", ()):
        if not isinstance(v, Violation):
            reason = f"a lint finding is not a Violation ({type(v).__name__})"
            run.skips.setdefault(("lint", reason), {})[index] = rec.layer
            continue
        if selected == "all" or v.check in selected:
            run.lint.append(v)
            if v.check not in run.lint_seen:
                run.lint_seen.append(v.check)


# --------------------------------------------------------------------------- public API
def check(
    capture_or_record,
    *,
    causal=None,
    attention_mask=None,
    documents=None,
    prefix_length=None,
    bidirectional=None,
    sliding_window=None,
    chunk_size=None,
    mask_fn=None,
    scale=None,
    checks=None,
    atol=None,
    rtol=None,
) -> CheckResult:
    """Check attention invariants on a ``Capture``, one ``AttentionRecord`` or a list of records.

    ``causal``: declare the self-attention causal (True) or bidirectional (False), for every layer
    or as ``{layer: bool}``; None uses each record's own flag. ``attention_mask``: the input padding
    mask ``(batch, key)``, 1 = real token (Hugging Face convention), for every layer or as
    ``{layer: mask}`` (encoder-decoder models: the encoder mask for the encoder and cross-attention
    layers). For a capture of ``generate``, declare the mask of the whole sequence (the prompt's mask
    followed by ones for the generated tokens): each KV-cache step reads the positions of its own keys,
    also when a sliding-window cache kept only the latest ones. Without declarations each record's own
    mask is the reference. Reported key positions are positions in the sequence, not cache slots.

    What the attention should be, each a shorthand for one FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``,
    for every layer or as ``{layer: value}`` (see ``attnprobe.probe.checks.declarations``): ``documents`` (per-token
    document ids ``(batch, seq)``, or ``"position_ids"``), ``prefix_length`` (prefix-LM), ``bidirectional`` (block
    ids ``(batch, seq)``, 0 = none, or ``[(start, end), ...]``), ``sliding_window`` (``q - kv < W``),
    ``chunk_size``, ``mask_fn`` (any ``mask_mod``) and ``scale`` (the softmax scale). ``declared`` reports weight
    where they forbid, ``reach`` keys they allow that the record masked; ``scale`` compares the effective scale.
    What the model declares itself (its config's layer types and windows, the inputs' image blocks and packed
    position ids) is checked unasked and listed in ``CheckResult.declarations``. ``checks``: names from
    ``CHECKS``, ``"lint"`` or ``lint_*`` names (None = all). ``atol``/``rtol`` override the dtype
    defaults (``DEFAULT_TOLERANCES``).

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn) as cap:
        ...     _ = attn(torch.randn(2, 5, 8), attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
        >>> result = attnprobe.check(cap, causal=True)
        >>> result.ok, len(result.errors)
        (True, 0)
    """
    declared = validate_declarations(
        causal,
        attention_mask,
        documents=documents,
        prefix_length=prefix_length,
        bidirectional=bidirectional,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        mask_fn=mask_fn,
        scale=scale,
    )
    _check_tolerances(atol=atol, rtol=rtol)
    records, keep = records_of(capture_or_record)
    declarations_fit(declared, records)
    declared_layers_exist(declared, records)
    run = CheckRun(declared=declared, checks=checks, atol=atol, rtol=rtol)
    weightless: dict[int, str] = {}  # layer -> backend of records asked for weights that came without
    prepared = 0
    with torch.no_grad():
        for index, rec in enumerate(records):
            _lint(run, rec, index)
            if run.selected and _check_record(run, rec, index):
                prepared += 1
                if rec.weights is None and keep is not None and "weights" in keep:
                    weightless[rec.layer] = rec.backend
    if attention_mask is not None and not isinstance(attention_mask, Mapping) and prepared and not run.mask_fitted:
        _mask_fits_nothing(attention_mask, records)
    _warn(run, records, weightless)
    return _result(run, records)


def _check_tolerances(*, atol, rtol) -> None:
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
        ):
            raise ValueError(
                f"{name} must be a non-negative finite number (or None for the dtype's default, "
                f"see DEFAULT_TOLERANCES), got {value!r}"
            )


def _check_record(run: CheckRun, rec: AttentionRecord, index: int) -> bool:
    """Run the selected checks over the row blocks of one record; False when it has nothing to check (said in
    ``skipped``)."""
    record_shapes(rec, index)
    if rec.weights is None and rec.stats is not None and "stats_rows" in rec.meta:
        raise SelectionError(
            f"record {index} ({rec.name!r}, layer {rec.layer}) has the statistics of "
            f"{len(rec.meta['stats_rows'])} sampled query rows of {rec.query_len} (capture(stats_rows=), "
            "attnprobe.monitor(rows=)): the checks need every row. Capture without stats_rows= "
            "(keep=('stats',) checks every row in O(T) memory), or with rows=None in the monitor"
        )
    if rec.batch_size is None or rec.query_len is None or rec.key_len is None:
        for c in run.selected:
            run.skips.setdefault((c, "the record has no tensors"), {})[index] = rec.layer
        return False
    facts = RecordFacts(run, rec, index)
    for a, b in facts.chunks(CHUNK_ELEMENTS):
        rows = RowBlock(facts, a, b)
        for name in run.selected:
            REGISTRY[name].run(run, rows)
    return True


def _mask_fits_nothing(attention_mask, records: list[AttentionRecord]) -> None:
    """Raise: the one declared ``attention_mask`` fits none of the records (by batch, then by shape)."""
    shape = tuple(mask_tensor(attention_mask, "attention_mask").shape)
    batches = sorted({r.batch_size for r in records if r.batch_size is not None})
    if shape[0] not in batches:
        raise ValueError(
            f"attention_mask has batch {shape[0]} but the records have batch {', '.join(map(str, batches))}: "
            "declare the mask of the inputs that were captured (generate with num_return_sequences or beam "
            "search repeats each row: torch.repeat_interleave(mask, n, dim=0))"
        )
    raise ValueError(
        f"attention_mask of shape {shape} fits none of the {len(records)} record(s) "
        f"(batch, key) shapes {sorted({(r.batch_size, r.key_len) for r in records})}; pass the input "
        "padding mask (batch, key), or {layer: mask} for models whose layers see different sequences"
    )


def _result(run: CheckRun, records: list[AttentionRecord]) -> CheckResult:
    """What the run found, skipped and covered, as a ``CheckResult``."""
    skipped = tuple(
        f"{c}: {reason} ({_layer_list(list(layers.values()))})"
        for (c, reason), layers in sorted(run.skips.items(), key=lambda kv: _order(kv[0][0]))
    )
    coverage = {c: len(indices) for c, indices in run.ran_on.items()}
    for name in run.lint_seen:
        coverage[name] = sum(
            1 for r in records if any(getattr(v, "check", None) == name for v in r.meta.get("lint", ()))
        )
    violations = sorted(
        run.violations() + run.lint, key=lambda v: (v.layer if v.layer is not None else -1, v.call, _order(v.check))
    )
    return CheckResult(
        violations=tuple(attribute_causes(violations)),  # a lint that explains failures first, they under it
        checks=run.selected + tuple(run.lint_seen),
        records=len(records),
        skipped=skipped,
        coverage=coverage,
        declarations=tuple(
            f"{what} in layer(s) " + ", ".join(f"{layer} ({name})" for layer, name in sorted(where.items()))
            for what, where in run.declarations.items()
        ),
    )


def _order(check: str) -> int:
    order = tuple(REGISTRY)
    return order.index(check) if check in order else len(order)


def _layers_only(layers) -> str:
    unique = sorted(set(layers))
    shown = ", ".join(map(str, unique[:12])) + (", ..." if len(unique) > 12 else "")
    return f"layer{'s' if len(unique) > 1 else ''} {shown}"


def _layer_list(layers: list[int]) -> str:
    return f"{len(layers)} record(s), {_layers_only(layers)}"


def _warn(run: CheckRun, records: list[AttentionRecord], weightless: dict[int, str]) -> None:
    if not records:
        warn_user(
            "nothing to check: the capture holds no attention records (the model was not called inside the "
            "`with attnprobe.capture(...)` block, or the selected layers never ran)"
        )
    if weightless:
        backends = ", ".join(sorted(set(weightless.values())))
        warn_user(
            f"weights were asked for but {_layers_only(weightless)} came without them "
            f"(backend: {backends}), so range, row_sum, mask, softmax_match and output_match could not run "
            "there: that backend returns no weights. Capture through an adapter that recomputes them (the "
            "Hugging Face adapter does for sdpa) or switch the model to eager attention "
            "(model.set_attn_implementation('eager'))"
        )
    if run.dropout_layers:
        ps = ", ".join(sorted({f"{p:g}" for p in run.dropout_layers.values()}))
        warn_user(
            f"dropout (p={ps}) was active in {_layers_only(run.dropout_layers)}: weights and outputs "
            "after dropout cannot sum to one or match, so those failures were not reported. Call model.eval() "
            "(and pass dropout_p=0 to scaled_dot_product_attention outside training) before capturing to check them"
        )


def assert_invariants(capture_or_record, **options) -> CheckResult:
    """``check`` and raise ``InvariantError`` (an AssertionError whose message is the violation table)
    when an invariant is broken, or when nothing at all could be verified. Returns the result. ``options``: those
    of ``check`` (``causal=``, ``attention_mask=``, ``documents=``, ..., ``checks=``, ``atol=``, ``rtol=``).

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn) as cap:
        ...     _ = attn(torch.randn(1, 4, 8))
        >>> attnprobe.assert_invariants(cap, causal=True).ok
        True
    """
    __tracebackhide__ = True  # pytest shows the caller's line
    result = check(capture_or_record, **options)
    return result.raise_if_failed()


__all__ = [
    "CHECKS",
    "CHECK_DESCRIPTIONS",
    "DEFAULT_TOLERANCES",
    "FORBIDDEN_WEIGHT",
    "MAX_GROUPS",
    "REGISTRY",
    "CheckSpec",
    "RecordFacts",
    "RowBlock",
    "Tolerance",
    "assert_invariants",
    "check",
    "register",
    "tolerance",
]
