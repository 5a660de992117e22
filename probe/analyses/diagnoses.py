"""The likely cause of the first divergence, named from the numbers of the call where it happens.

Each diagnosis is a hypothesis about how the candidate's tensor was made from the reference's; it is named only when
that model reproduces the candidate within ``max(tolerance, 1% of the largest difference)`` (the hypothesis explains
at least 99% of the difference), and comes with its evidence (one sentence) and the fitted numbers (``details``).
The hypotheses tried depend on the tensor that diverged first, in this order:

- q: ``head_order``, ``scale``, then the rotary ones (``rope_layout``, ``rope_base``, ``positions``: ``rotary.py``)
- k, v: ``kv_repeat``, ``head_order``, ``scale``, then (k) the rotary ones
- scores: ``head_order``, ``scale``, ``softcap``
- weights: ``head_order``, ``mask``, ``softmax_dtype``; output: ``head_order``, ``mask``, ``scale``
- statistics: ``mask`` (the number of keys each row may attend differs), ``scale`` (``max_score``)

and ``unknown`` when none fits (its evidence says what was ruled out).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .alignment import COMPARED_STATS, KV_FIELDS, Pair, kv_head, match_heads
from .differences import Cells, differences, f64, head_distances, mask_differs, scale_of, stacked
from .rotary import explain_rotation

#: Every diagnosis ``Comparison.diagnosis`` can name, with what it means.
DIAGNOSES: Mapping[str, str] = MappingProxyType(
    {
        "scale": "the candidate's values are the reference's times one constant (scores: a wrong softmax scale)",
        "mask": "the two sides allow different (query, key) cells, and the values differ where they do",
        "rope_layout": "q/k rotate different pairs of dimensions: interleaved (2i, 2i+1) vs half-rotated (i, i+d/2)",
        "rope_base": "q/k rotation angles differ by a factor that depends on the pair: other RoPE frequencies",
        "positions": "q/k are rotated by the same frequencies at other positions (shifted or scaled)",
        "head_order": "the candidate's heads are the reference's in another order (a permutation)",
        "kv_repeat": "grouped key/value heads repeated in the other order (repeat vs repeat_interleave)",
        "softcap": "scores equal where small and bent towards a cap above it: a logit softcap on one side only",
        "softmax_dtype": "weights differ by the rounding of a half-precision softmax while the scores agree",
        "unknown": "no diagnosis above reproduces the difference",
    }
)


@dataclass(frozen=True)
class Diagnosis:
    name: str
    evidence: str
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class _Case:
    """What a diagnosis looks at: the pair, the tensor, every compared head of it, and the bar to clear."""

    pair: Pair
    name: str
    tol: tuple[float, float]
    data: Cells
    diff: float
    bar: float

    def explained(self, residual: float) -> bool:
        return residual <= self.bar


def _case(pair: Pair, name: str, tol: tuple[float, float]) -> _Case:
    data = stacked(pair, name)
    diff = float(differences(data).max())
    bar = max(tol[0] + tol[1] * scale_of(data), 0.01 * diff) if math.isfinite(diff) else math.inf
    return _Case(pair, name, tol, data, diff, bar)


def _counted(c: _Case) -> tuple[torch.Tensor, torch.Tensor]:
    keep = c.data.counting() & c.data.ref.isfinite() & c.data.cand.isfinite()
    return c.data.ref[keep], c.data.cand[keep]


@functools.cache
def _simple_factors() -> tuple[tuple[str, float], ...]:
    forms = (("1/sqrt({})", lambda n: n**-0.5), ("1/{}", lambda n: 1 / n), ("sqrt({})", lambda n: n**0.5))
    return tuple((form.format(n), f(n)) for form, f in forms for n in range(2, 8193))


def _describe_factor(x: float, d_head: int | None) -> str:
    """`` = 1/sqrt(d_head)`` and the like, when ``x`` is such a simple factor."""
    named: list[tuple[str, float]] = []
    if d_head:
        named += [("1/sqrt(d_head)", d_head**-0.5), ("1/d_head", 1 / d_head), ("sqrt(d_head)", d_head**0.5)]
        named += [("d_head", float(d_head))]
    for form, value in (*named, *_simple_factors()):
        if abs(x - value) <= 1e-6 * abs(value):
            return f" = {form}"
    return ""


def _scale(c: _Case) -> Diagnosis | None:
    x, y = _counted(c)
    denom = float((x * x).sum(dtype=torch.float64))
    if denom == 0 or x.numel() == 0:
        return None
    factor = float((x * y).sum(dtype=torch.float64)) / denom
    q = c.pair.ref.tensors.get("q")
    d_head = None if q is None else int(q.shape[-1])
    residual = float((y - factor * x).abs().max())
    if not c.explained(residual) or abs(factor - 1) * float(x.abs().max()) <= c.tol[0]:
        return None
    text = (
        f"the candidate's {c.name} are {factor:.6g}{_describe_factor(factor, d_head)} times the reference's at every "
        f"cell that counts (largest residual {residual:.2g}, largest difference {c.diff:.2g})"
    )
    r, k = c.pair.ref.record.scaling, c.pair.cand.record.scaling
    if c.name == "scores" and r is not None and k is not None:
        text += (
            f"; the recorded scaling is {r:.6g}{_describe_factor(r, d_head)} (reference) and "
            f"{k:.6g}{_describe_factor(k, d_head)} (candidate)" + (f", d_head {d_head}" if d_head else "")
        )
    return Diagnosis("scale", text, {"factor": factor, "residual": residual})


def _softcap_fit(raw: torch.Tensor, capped: torch.Tensor, known: float | None) -> tuple[float, float] | None:
    """The cap with ``capped = cap * tanh(raw / cap)`` and its residual; None when no cap bends ``raw``."""
    if known is None:
        i = int(raw.abs().argmax())
        x, y = abs(float(raw[i])), abs(float(capped[i]))
        if not 0 < y < x:
            return None
        lo, hi = math.log(y), math.log(max(x, y) * 1e6)
        for _ in range(100):  # cap * tanh(x / cap) grows with cap: bisect on log(cap)
            mid = (lo + hi) / 2
            cap = math.exp(mid)
            lo, hi = (mid, hi) if cap * math.tanh(x / cap) < y else (lo, mid)
        known = math.exp((lo + hi) / 2)
    residual = float((capped - known * torch.tanh(raw / known)).abs().max())
    return known, residual


def _softcap(c: _Case) -> Diagnosis | None:
    x, y = _counted(c)
    if x.numel() == 0:
        return None
    sides = (
        ("candidate", "reference", y, x, c.pair.ref.record.softcap),
        ("reference", "candidate", x, y, c.pair.cand.record.softcap),
    )
    for lacking, having, raw, capped, known in sides:
        fit = _softcap_fit(raw, capped, known)
        if fit is None or not c.explained(fit[1]):
            continue
        cap, residual = fit
        recorded = f" (the {having} records softcap={known:g})" if known is not None else " (cap fitted)"
        return Diagnosis(
            "softcap",
            f"the {having}'s scores are {cap:.4g} * tanh({lacking} scores / {cap:.4g}) at every allowed cell (largest "
            f"residual {residual:.2g}): equal where |scores| is small, bent towards +-{cap:.4g} above: the {lacking} "
            f"lacks the logit softcap{recorded}",
            {"cap": cap, "lacking": lacking, "residual": residual},
        )
    return None


def _causal_offset(allowed: torch.Tensor, query_offset: int) -> int | None:
    """``o`` when ``allowed`` ``(batch, query, key)`` is exactly "key <= query + o" on every row, else None."""
    q = torch.arange(allowed.shape[1])[:, None] + query_offset
    k = torch.arange(allowed.shape[2])[None, :]
    for o in range(-allowed.shape[2], allowed.shape[2] + 1):
        if bool((allowed == (k <= q + o)).all()):
            return o
    return None


def _mask_words(o: int | None) -> str:
    if o is None:
        return "another pattern"
    return "keys <= i" + (f" {'+' if o > 0 else '-'} {abs(o)}" if o else "")


def _mask(c: _Case) -> Diagnosis | None:
    p = c.pair
    n = len(p.heads)
    found = [mask_differs(p, i) for i in range(n)]
    diffs = [d for d in found if d is not None]
    if len(diffs) < n or not any(bool(d.any()) for d in diffs):
        return _stats_mask(c) if c.name in COMPARED_STATS else None
    count = sum(int(d.sum()) for d in diffs)
    i = next(i for i, d in enumerate(diffs) if bool(d.any()))
    ra, ca = p.allowed("ref", i), p.allowed("cand", i)
    assert ra is not None and ca is not None
    ro = _causal_offset(ra.cpu().bool(), p.ref.record.query_offset)
    co = _causal_offset(ca.cpu().bool(), p.cand.record.query_offset)
    text = f"the two sides allow different cells ({count} (query, key) cells of real rows)"
    if ro is not None or co is not None:
        text += f": the reference lets query i attend {_mask_words(ro)}, the candidate {_mask_words(co)}"
        if ro is not None and co is not None and abs(ro - co) == 1:
            text += " (a causal mask off by one)"
    rows_differ = torch.stack([d.any(-1) for d in diffs], 1)  # (batch, head, query)
    d = differences(c.data)
    elsewhere = d.flatten(3).amax(-1) if d.dim() > 3 else d  # (batch, head, query)
    outside = float(torch.where(rows_differ, torch.zeros_like(elsewhere), elsewhere).max())
    tol = c.tol[0] + c.tol[1] * scale_of(c.data)
    text += (
        "; the "
        + c.name
        + (
            " agree in every row where the masks agree"
            if outside <= tol
            else f" also differ where the masks agree ({outside:.2g})"
        )
    )
    return Diagnosis("mask", text, {"cells": count, "reference_offset": ro, "candidate_offset": co})


def _stats_mask(c: _Case) -> Diagnosis | None:
    p = c.pair
    if "allowed_keys" not in p.ref.stats or "allowed_keys" not in p.cand.stats:
        return None
    data = stacked(p, "allowed_keys")
    differ = (data.ref != data.cand) & data.counting()
    if not bool(differ.any()):
        return None
    pos = data.positions if data.positions is not None else torch.arange(data.ref.shape[-1])
    extra = (data.cand - data.ref)[differ]
    text = f"the number of keys a row may attend differs in {int(differ.sum())} rows"
    if bool((extra == extra[0]).all()):
        text += f": the candidate's rows attend {int(extra[0]):+d} keys each"
        if abs(int(extra[0])) == 1:
            text += " (a mask off by one)"
    return Diagnosis("mask", text, {"rows": int(differ.sum()), "first_row": int(pos[differ.nonzero()[0, -1]])})


def _softmax_dtype(c: _Case) -> Diagnosis | None:
    x, y = _counted(c)
    if x.numel() == 0:
        return None
    size = torch.maximum(x.abs(), y.abs())
    for dtype, bits in ((torch.float16, 10), (torch.bfloat16, 7)):
        ulp = torch.pow(2.0, torch.floor(torch.log2(size.clamp_min(2.0**-24))) - bits)
        ulps = float(((y - x).abs() / ulp).max())
        if ulps <= 2.0:
            where = int(((y - x).abs()).argmax())
            name = str(dtype).removeprefix("torch.")
            return Diagnosis(
                "softmax_dtype",
                f"the weights differ by at most {ulps:.2g} units in the last place of {name} at their values "
                f"(largest difference {c.diff:.2g}, at a weight of {float(x[where]):.3g}) while the scores agree: the "
                f"softmax, or the weights after it, were rounded to {name} (the records say "
                f"{_dtype_name(c.pair.ref)} and {_dtype_name(c.pair.cand)})",
                {"dtype": name, "ulps": ulps},
            )
    return None


def _dtype_name(lay) -> str:
    return str(lay.record.dtype).removeprefix("torch.") if lay.record.dtype is not None else "no dtype"


def _head_order(c: _Case) -> Diagnosis | None:
    p = c.pair
    kv = c.name in KV_FIELDS
    heads = p.kv_heads if kv else p.heads
    full = len(heads) == (p.ref.num_kv_heads if kv and p.kv_axis == "kv_head" else p.ref.num_heads)
    if len(heads) < 2 or not full:
        return None
    perm = match_heads(head_distances(p, c.name, c.tol))
    if perm is None or perm == list(range(len(perm))):
        return None
    mapping = [heads[j] for j in perm]
    return Diagnosis(
        "head_order",
        f"the candidate's {c.name} of head {mapping} equals the reference's of head {list(heads)} (each within "
        "tolerance): the heads are in another order",
        {"permutation": mapping},
    )


def _kv_repeat(c: _Case) -> Diagnosis | None:
    p = c.pair
    if c.name not in KV_FIELDS:
        return None
    if p.kv_axis == "head":  # one side grouped, the other repeated: does the repeated one tile?
        grouped, expanded = (p.ref, p.cand) if p.ref.group > 1 else (p.cand, p.ref)
        which = "candidate" if expanded is p.cand else "reference"
        kv, g = grouped.num_kv_heads, grouped.group
        other = "reference" if which == "candidate" else "candidate"
        tiled = {h: h % kv for h in range(grouped.num_heads)}
        residual = _kv_residual(c, grouped, expanded, tiled)
        if residual is None or not c.explained(residual):
            return None
        return Diagnosis(
            "kv_repeat",
            f"the {which}'s {grouped.num_heads} {c.name} heads are the {other}'s {kv} repeated as "
            f".repeat(1, {g}, 1, 1) (head h reads key/value head h % {kv}) instead of repeat_interleave({g}) "
            f"(h // {g}; largest residual {residual:.2g})",
            {"repeated_by": "repeat", "expected": "repeat_interleave", "side": which, "groups": g},
        )
    return _kv_repeat_expanded(c)


def _kv_residual(c: _Case, grouped, expanded, reads: dict[int, int]) -> float | None:
    worst = 0.0
    for h, kvh in reads.items():
        if h not in expanded.kv_heads or kvh not in grouped.kv_heads:
            return None
        a = f64(kv_head(grouped, c.name, kvh, "kv_head"))
        b = f64(kv_head(expanded, c.name, h, "kv_head"))
        worst = max(worst, float((a - b).abs().max()))
    return worst


def _kv_repeat_expanded(c: _Case) -> Diagnosis | None:
    """Both sides hold one key/value head per query head: one side interleaves groups, the other tiles them."""
    p = c.pair
    h = p.ref.num_kv_heads
    if p.ref.num_heads != h or len(p.kv_heads) != h:
        return None
    for g in (g for g in range(2, h + 1) if h % g == 0):
        kv = h // g
        for which, reads in (
            ("candidate", {j: (j % kv) * g for j in range(h)}),
            ("reference", {j: j // g for j in range(h)}),
        ):
            residual = _kv_residual(c, p.ref, p.cand, reads)
            if residual is not None and c.explained(residual):
                wrong = "repeat" if which == "candidate" else "repeat_interleave"
                return Diagnosis(
                    "kv_repeat",
                    f"the candidate's {c.name} heads are the reference's {kv} key/value heads repeated by {wrong} "
                    f"where the reference uses the other order ({g} query heads per key/value head; largest residual "
                    f"{residual:.2g})",
                    {"repeated_by": wrong, "groups": g},
                )
    return None


def _rotary(c: _Case) -> Diagnosis | None:
    if c.name not in ("q", "k"):
        return None
    rec = c.pair.ref.record
    length = c.data.ref.shape[2]
    start = rec.query_offset if c.name == "q" else rec.key_start
    found = explain_rotation(c.data.ref, c.data.cand, torch.arange(length) + start, c.bar)
    if found is None:
        return None
    name, text, details = found
    at_zero = (
        int(start) == 0
        and float(differences(Cells(c.data.ref[:, :, :1], c.data.cand[:, :, :1], c.data.counts[:, :, :1])).max())
        <= c.bar
    )
    if at_zero and not details.get("permuted"):
        text += "; the two agree at position 0, where every rotation is the identity"
    return Diagnosis(name, text, details)


_TESTS: dict[str, tuple[Callable[[_Case], Diagnosis | None], ...]] = {
    "q": (_head_order, _scale, _rotary),
    "k": (_kv_repeat, _head_order, _scale, _rotary),
    "v": (_kv_repeat, _head_order, _scale),
    "scores": (_head_order, _scale, _softcap),
    "weights": (_head_order, _mask, _softmax_dtype),
    "output": (_head_order, _mask, _scale),
    "max_score": (_mask, _scale),
}


def _unknown(c: _Case, tried) -> Diagnosis:
    names = ", ".join(t.__name__.strip("_").replace("rotary", "rope_layout, rope_base, positions") for t in tried)
    text = f"none of {names} reproduces the candidate's {c.name} (largest difference {c.diff:.2g})"
    if c.name in ("q", "k", "v") and c.data.ref.shape[2] > 0:
        first = Cells(c.data.ref[:, :, :1], c.data.cand[:, :, :1], c.data.counts[:, :, :1])
        if float(differences(first).max()) > c.bar:
            text += (
                f"; {c.name} differ at the first position too, where a rotary embedding changes nothing: what goes "
                "into this attention differs (look at its projections, or before it: embeddings, norms, the previous "
                "layer)"
            )
    return Diagnosis("unknown", text, {"difference": c.diff})


def diagnose(pair: Pair, name: str, first, tol: tuple[float, float]) -> Diagnosis:
    """The likely cause of ``first`` (a ``Divergence`` in tensor ``name`` of ``pair``)."""
    c = _case(pair, name, tol)
    tried = _TESTS.get(name, (_mask,))
    for test in tried:
        found = test(c)
        if found is not None:
            return found
    return _unknown(c, tried)
