"""Long-context head roles: ``retrieval``, ``streaming``, ``local``, ``sink`` (labels of ``attnprobe.heads.classify``).

=============  ====================================  ============================================================
label          score (default threshold)             meaning
=============  ====================================  ============================================================
``retrieval``  ``retrieval`` >= 0.1                  copies from a long context: on the needle probe, the share of
                                                     the needle's tokens whose copy the head's heaviest key points
                                                     at (Wu et al., 2024, "Retrieval Head Mechanistically Explains
                                                     Long-Context Factuality"; 0.1 is their threshold); only with
                                                     ``probe="retrieval"``
``streaming``  ``streaming_kept`` >= 0.9             loses little when its cache keeps only sinks and a recent
                                                     window (DuoAttention's streaming heads, Xiao et al., 2024): the
                                                     ``streaming`` eviction policy's kept fraction at ``budget``
                                                     keys; given only to heads that no more specific label (first,
                                                     previous, self, local, sink) explains
``local``      ``local_share`` >= 0.5                the heaviest key lies 2 to ``local`` positions before the
                                                     query (a window beyond the previous and the own token)
``sink``       ``sink_mass`` >= 0.5                  most weight on special tokens (``special=``: [SEP], [CLS],
                                                     BOS, ...) other than the first key (which ``first`` covers)
=============  ====================================  ============================================================

Each score is a mean over real query rows (padding left out). ``local_share`` and ``sink_mass`` come from any
statistics capture (the rows' ``argmax_key``, the keys' ``key_weight``) or from weights; ``streaming_kept`` from a
statistics capture made with ``eviction=`` (its smallest budget) or from weights (``budget`` keys, default 64, over
the last ``EvictionPlan().observe`` rows); ``retrieval`` from running the model on the needle probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from ..engine.kept_mass import EvictionPlan
from ..errors import AttnprobeError, warn_user
from .eviction import EvictionError, eviction_parts

ROLE_THRESHOLDS: Mapping[str, float] = {"retrieval": 0.1, "streaming": 0.9, "local": 0.5, "sink": 0.5}
ROLE_SCORES: Mapping[str, str] = {
    "retrieval": "retrieval",
    "streaming": "streaming_kept",
    "local": "local_share",
    "sink": "sink_mass",
}
#: Labels more specific than ``streaming``: a head that has one of them is not called streaming too.
SPECIFIC = ("first", "previous", "self", "local", "sink")
#: Default keys of the streaming cache (sinks + window) when scored from weights.
STREAMING_BUDGET = 64


class RoleError(AttnprobeError, ValueError):
    """Head roles that cannot be scored from what was given; the message says what to do."""


def _positions(record) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, real)``: each described row's position ``(n,)`` and which rows are real ``(batch, n)``."""
    if record.weights is not None:
        rows = torch.arange(record.weights.shape[2])
    else:
        rows = record.stats_positions
    real = torch.ones(record.batch_size, len(rows), dtype=torch.bool)
    if record.query_padding is not None:
        real = ~record.query_padding.bool().cpu()[:, rows]
    return rows + record.query_offset, real


def _first_keys(record) -> torch.Tensor:
    """``(batch,)``: the first key some query may attend (padding is not a key)."""
    if record.weights is None:
        allowed = record.stats["key_allowed"].cpu().any(1)  # (B, Tk)
    elif record.allowed is not None:
        allowed = record.allowed.cpu().any(1).any(1)  # (B, Tk)
    else:
        return torch.zeros(record.batch_size, dtype=torch.long)
    return torch.where(allowed.any(1), allowed.to(torch.uint8).argmax(1), 0)


def _special_mask(special, batch: int, keys: int) -> torch.Tensor:
    """``special`` (positions, or a bool ``(tokens,)`` / ``(batch, tokens)`` mask) as ``(batch, keys)`` bool."""
    t = torch.as_tensor(special)
    if t.dtype != torch.bool:
        mask = torch.zeros(keys, dtype=torch.bool)
        mask[t.long()[t.long() < keys]] = True
        t = mask
    t = t[None] if t.dim() == 1 else t
    if t.shape[0] not in (1, batch):
        raise RoleError(f"special= has {t.shape[0]} rows for a batch of {batch}")
    t = t.expand(batch, -1)[:, :keys]
    return torch.cat([t, torch.zeros(batch, keys - t.shape[1], dtype=torch.bool)], 1) if t.shape[1] < keys else t


def _record_scores(record, *, local: int, special) -> dict[str, torch.Tensor]:
    """``{score: (head,)}`` sums over real rows (``rows``: their count) of one self-attention record."""
    positions, real = _positions(record)  # (n,), (B, n)
    if record.weights is not None:
        w = record.weights.detach().double().cpu()  # (B, h, n, Tk)
        argmax = w.argmax(-1)
    elif record.stats is not None:
        w, argmax = None, record.stats["argmax_key"].cpu()  # (B, h, n)
    else:
        raise RoleError(f"layer {record.layer} has neither weights nor statistics: capture keep=('stats',)")
    realf = real[:, None, :].double()  # (B, 1, n)
    distance = positions.view(1, 1, -1) - argmax
    out = {"rows": realf.sum((0, 2)).expand(len(record.heads)).clone()}
    out["local_share"] = (((distance >= 2) & (distance <= local)).double() * realf).sum((0, 2))
    if special is not None:
        B, Tk = record.batch_size, record.key_len
        mask = _special_mask(special, B, Tk)
        mask[torch.arange(B), _first_keys(record)] = False  # the first key is ``first``'s
        if w is not None:
            mass = (w * mask[:, None, None, :]).sum(-1)  # (B, h, n)
            out["sink_mass"] = (mass * realf).sum((0, 2))
        else:  # key_weight: each key's weight summed over the counted rows
            out["sink_mass"] = (record.stats["key_weight"].double().cpu() * mask[:, None, :]).sum((0, 2))
    return out


def role_scores(
    cap,
    *,
    special=None,
    local: int = 8,
    budget: int | None = None,
    plan: EvictionPlan | None = None,
) -> list[dict]:
    """One dict per (layer, head) of the self-attention records of ``cap``: ``local_share``, ``sink_mass`` (with
    ``special=``) and ``streaming_kept`` (see the module docstring), means over real rows."""
    if local < 2:
        raise RoleError(f"local is the window's far end, at least 2 positions back: not {local}")
    sums: dict[tuple[int, int], dict[str, float]] = {}
    for r in cap:
        if r.kind != "self":
            continue
        scores = _record_scores(r, local=local, special=special)
        for i, head in enumerate(r.heads):
            acc = sums.setdefault((r.layer, int(head)), {"module": r.name})
            for name, values in scores.items():
                acc[name] = acc.get(name, 0.0) + float(values[i])
    try:
        streaming = _streaming(cap, budget, plan)
    except EvictionError as exc:
        warn_user(f"no streaming score: {exc}")
        streaming = None
    rows = []
    for (layer, head), acc in sorted(sums.items()):
        n = acc.pop("rows")
        row = {"layer": layer, "head": head, "module": acc.pop("module")}
        row.update({name: (value / n if n else math.nan) for name, value in acc.items()})
        if streaming is not None:
            row["streaming_kept"] = streaming.get((layer, head), math.nan)
        rows.append(row)
    return rows


def _streaming(cap, budget: int | None, plan: EvictionPlan | None) -> dict[tuple[int, int], float] | None:
    """(layer, head) -> mean kept fraction of the ``streaming`` policy; None when the capture cannot say (a statistics
    capture made without ``eviction=``)."""
    captured = next((r.meta["eviction"] for r in cap if "eviction" in r.meta), None)
    if captured is not None:
        if "streaming" not in captured["policies"]:
            return None
        chosen = budget if budget is not None else min(captured["budgets"])
        parts = eviction_parts(cap, ["streaming"], [chosen])
    elif all(r.weights is not None for r in cap if r.kind == "self"):
        plan = plan or EvictionPlan()
        chosen = STREAMING_BUDGET if budget is None else budget
        parts = eviction_parts(cap, ["streaming"], [chosen], plan=plan)
    else:
        return None
    sums: dict[tuple[int, int], list[float]] = {}
    for record, fractions, rows, _ in parts:
        values = fractions["streaming"][..., 0]  # (B, h, n)
        real = torch.ones(values.shape[0], len(rows), dtype=torch.bool)
        if record.query_padding is not None:
            real = ~record.query_padding.bool().cpu()[:, rows]
        for i, head in enumerate(record.heads):
            v = values[:, i][real & values[:, i].isfinite()]
            acc = sums.setdefault((record.layer, int(head)), [0.0, 0.0])
            acc[0] += float(v.sum())
            acc[1] += v.numel()
    return {key: (s / n if n else math.nan) for key, (s, n) in sums.items()}


def retrieval_scores(
    capture: Callable,
    model,
    *,
    vocab_size: int | None = None,
    length: int = 512,
    needle: int = 16,
    batch: int = 4,
    seed: int = 0,
    layers=None,
    heads=None,
) -> dict[tuple[int, int], float]:
    """(layer, head) -> the needle probe's retrieval score (Wu et al., 2024): ``batch`` sequences of ``length`` random
    tokens (the haystack) hold ``needle`` distinct tokens, drawn from a part of the vocabulary the haystack never uses,
    at a random depth; a marker token and the needle again follow (the answer, read teacher-forced). Each answer row
    ``i`` (the needle's token ``i``, whose next token is the needle's ``i + 1``) counts when the head's heaviest key
    is the needle's token ``i + 1``; the score is the share of such rows. Runs a statistics capture: memory grows as
    the sequence, not its square."""
    vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        raise RoleError(
            "the retrieval probe draws random tokens: give vocab_size= (the model has no config.vocab_size)"
        )
    if needle < 2 or vocab < needle + 3 or length < needle + 2:
        raise RoleError(
            f"the needle probe needs needle >= 2 tokens, a vocabulary of more than needle + 2 tokens and a haystack "
            f"longer than the needle: needle={needle}, vocab_size={vocab}, length={length}"
        )
    g = torch.Generator().manual_seed(seed)
    ids, starts = [], []
    for _ in range(batch):
        order = torch.randperm(vocab, generator=g)
        needle_ids, marker, rest = order[:needle], order[needle], order[needle + 1 :]
        hay = rest[torch.randint(0, len(rest), (length - needle,), generator=g)]
        depth = int(torch.randint(1, length - needle, (1,), generator=g))
        ids.append(torch.cat([hay[:depth], needle_ids, hay[depth:], marker.view(1), needle_ids]))
        starts.append(depth)
    inputs = torch.stack(ids)  # (batch, length + 1 + needle)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    with torch.no_grad(), capture(model, keep=("stats",), layers=layers, heads=heads) as cap:
        if getattr(model, "config", None) is not None:
            model(input_ids=inputs.to(device))
        else:
            model(inputs.to(device))
    answer = length + 1  # position of the answer's first token
    rows = torch.arange(answer, answer + needle - 1)  # answer token i, predicting needle token i + 1
    targets = torch.tensor(starts)[:, None] + torch.arange(1, needle)[None, :]  # (batch, needle - 1)
    scores = {}
    for r in cap:
        if r.kind != "self" or r.stats is None:
            continue
        argmax = r.stats["argmax_key"].cpu()[:, :, rows]  # (batch, head, needle - 1)
        hits = (argmax == targets[:, None, :]).double().mean((0, 2))
        for i, head in enumerate(r.heads):
            scores[(r.layer, int(head))] = float(hits[i])
    return scores


def role_labels(row: Mapping, limits: Mapping[str, float], other: str = "") -> list[str]:
    """The role labels ``row`` (a classify row) reaches, ``streaming`` only where no label of ``SPECIFIC`` (among
    ``other``'s comma-separated labels and the roles found) is there."""
    found = []
    for label in ("retrieval", "local", "sink"):
        value = row.get(ROLE_SCORES[label], math.nan)
        if value is not None and not math.isnan(value) and value >= limits[label]:
            found.append(label)
    value = row.get(ROLE_SCORES["streaming"], math.nan)
    specific = set(filter(None, other.split(","))) | set(found)
    if value is not None and not math.isnan(value) and value >= limits["streaming"] and not specific & set(SPECIFIC):
        found.append("streaming")
    return found
