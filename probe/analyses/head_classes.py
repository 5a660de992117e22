"""What each head does: labels from aggregated per-head statistics, each with its score and threshold.

A head gets a label when its score reaches the label's threshold (``THRESHOLDS``; pass ``thresholds=`` to
change them). Scores are averages over the real query rows of every input (padding left out):

=============  ===============================  ================================================================
label          score                            meaning
=============  ===============================  ================================================================
``previous``   ``previous_mass`` >= 0.5         most weight on the key just before the query (previous-token)
``first``      ``first_key_mass`` >= 0.5        most weight on key 0 (first-token / attention sink)
``self``       ``diagonal_mass`` >= 0.5         most weight on the query's own key (self / diagonal)
``broad``      ``entropy_ratio`` >= 0.9         entropy near its maximum ``log(allowed keys)``: weight spread out
``induction``  ``induction`` >= 0.4             on repeated random tokens, weight on the token after the current
                                                token's earlier occurrence (Olsson et al., 2022, "In-context
                                                learning and induction heads"); only with ``probe="induction"``
=============  ===============================  ================================================================

Four long-context roles come beside them (``probe/analyses/head_roles.py`` defines their scores): ``retrieval``
(the needle probe, ``probe="retrieval"``), ``streaming`` (little lost with sinks + a recent window; needs a capture
made with ``eviction=``, or one that kept the weights), ``local`` (the heaviest key 2 to ``local`` positions back)
and ``sink`` (most weight on the special tokens ``special=`` names, the first key aside).

A head may get several labels (a first-token head of a one-token input is also a self head) or none;
``streaming`` only where no more specific label (first, previous, self, local, sink) explains the head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..errors import AttnprobeError
from .head_roles import ROLE_SCORES, ROLE_THRESHOLDS, retrieval_scores, role_labels, role_scores

THRESHOLDS: Mapping[str, float] = {
    "previous": 0.5,
    "first": 0.5,
    "self": 0.5,
    "broad": 0.9,
    "induction": 0.4,
    **ROLE_THRESHOLDS,
}
SCORES: Mapping[str, str] = {
    "previous": "previous_mass",
    "first": "first_key_mass",
    "self": "diagonal_mass",
    "broad": "entropy_ratio",
    "induction": "induction",
    **ROLE_SCORES,
}
#: What ``classify(probe=...)`` runs: each probe runs the model once.
PROBES = ("induction", "retrieval")


class ClassifyError(AttnprobeError, ValueError):
    """What ``classify`` was given cannot be classified; the message says what to do."""


def entropy_ratio(entropy: torch.Tensor, allowed_keys: torch.Tensor) -> torch.Tensor:
    """``entropy / log(allowed keys)`` per row (1 = uniform over the keys it may attend); NaN where a row
    may attend at most one key (its entropy says nothing)."""
    allowed = allowed_keys.double()
    return torch.where(allowed > 1, entropy.double() / allowed.clamp_min(2).log(), torch.nan)


def head_means(cap) -> list[dict]:
    """One dict per (layer, head) of a statistics capture: the statistics' means over real query rows."""
    from ..engine.stats import record_stats

    rows = []
    for rec in cap:
        stats = getattr(rec, "stats", None) or (record_stats(rec) if rec.weights is not None else None)
        if not stats:
            raise ClassifyError(f"{rec.name} has no statistics: capture with keep=('stats',) (or scan a data set)")
        real = rec.stats_real_rows  # every query row the statistics describe, less padding
        values = {
            name: stats[name].detach().double().cpu() for name in ("previous_mass", "first_key_mass", "diagonal_mass")
        }
        values["entropy_ratio"] = entropy_ratio(stats["entropy"].detach().cpu(), stats["allowed_keys"].cpu())
        for h, head in enumerate(rec.heads):
            row = {"layer": rec.layer, "head": int(head), "module": rec.name}
            for name, v in values.items():
                row[name] = float(v[:, h][real[:, h]].nanmean())
            rows.append(row)
    return rows


def induction_scores(
    capture: Callable,
    model,
    *,
    vocab_size: int | None = None,
    length: int = 24,
    batch: int = 8,
    seed: int = 0,
    layers=None,
    heads=None,
) -> dict[tuple[int, int], float]:
    """(layer, head) -> mean weight from each query of the second copy of a random token sequence to the
    key just after its token's first occurrence (the induction target), over ``batch`` sequences."""
    vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        raise ClassifyError(
            "the induction probe draws random tokens: give vocab_size= (the model has no config.vocab_size)"
        )
    if length < 2 or 2 * length > 100_000:
        raise ClassifyError(f"length must be between 2 and 50000 tokens, not {length}")
    generator = torch.Generator().manual_seed(seed)
    # distinct tokens within one copy, so each query has exactly one earlier occurrence to follow
    half = torch.stack([torch.randperm(vocab, generator=generator)[:length] for _ in range(batch)])
    ids = torch.cat([half, half], dim=1)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    ids = ids.to(device)
    with torch.no_grad(), capture(model, keep=("weights",), layers=layers, heads=heads) as cap:
        if getattr(model, "config", None) is not None:
            model(input_ids=ids)
        else:
            model(ids)
    scores = {}
    queries = torch.arange(length, 2 * length)
    targets = queries - length + 1
    for rec in cap:
        if rec.weights is None or rec.kind != "self":
            continue
        w = rec.weights.double()[:, :, queries, targets]  # (batch, head, length)
        for h, head in enumerate(rec.heads):
            scores[(rec.layer, int(head))] = float(w[:, h].mean())
    return scores


def classify(
    source=None,
    *,
    capture: Callable | None = None,
    model=None,
    probe=None,
    thresholds: Mapping[str, float] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    special=None,
    local: int = 8,
    budget: int | None = None,
    probe_length: int | None = None,
):
    """A DataFrame, one row per (layer, head): each label's score, and ``labels`` (those reaching their
    threshold, comma-separated). ``source``: a scan folder (``attnprobe.scan``) or a capture (statistics, or
    weights). ``probe``: ``"induction"``, ``"retrieval"`` or both (a list), with ``model=``: runs the model on
    that probe's random tokens (``probe_length``: each induction copy's tokens, the retrieval haystack's; None: the
    probe's default). ``special`` (positions or a bool mask of the captured tokens), ``local`` and
    ``budget``: the long-context roles' (``head_roles.role_scores``)."""
    import pandas as pd

    limits = _limits(thresholds)
    probes = _probes(probe, model, capture, source)
    if isinstance(source, (str, Path)):
        frame = _from_scan(Path(source))
    elif source is not None:
        frame = pd.DataFrame(head_means(source))
        roles = pd.DataFrame(role_scores(source, special=special, local=local, budget=budget))
        frame = frame.merge(roles.drop(columns=["module"]), on=["layer", "head"], how="left")
    else:
        frame = None
    for name in probes:
        assert capture is not None  # _probes refused probes without it
        options = {} if probe_length is None else {"length": probe_length}
        found = (induction_scores if name == "induction" else retrieval_scores)(
            capture, model, vocab_size=vocab_size, seed=seed, **options
        )
        scores = pd.DataFrame([{"layer": layer, "head": h, name: s} for (layer, h), s in sorted(found.items())])
        frame = scores if frame is None else frame.merge(scores, on=["layer", "head"], how="left")
    assert frame is not None  # _probes refused a call with neither a source nor a probe
    roles = set(ROLE_THRESHOLDS)
    scored = [label for label in THRESHOLDS if SCORES[label] in frame.columns]

    def labels(row) -> str:
        found = [
            label
            for label in scored
            if label not in roles and not math.isnan(row[SCORES[label]]) and row[SCORES[label]] >= limits[label]
        ]
        return ",".join(found + role_labels(row, limits, ",".join(found)))

    frame = frame.sort_values(["layer", "head"]).reset_index(drop=True)
    frame["labels"] = frame.apply(labels, axis=1) if len(frame) else []
    frame.attrs["thresholds"] = {label: limits[label] for label in scored}
    return frame


def _limits(thresholds: Mapping[str, float] | None) -> dict[str, float]:
    limits = dict(THRESHOLDS)
    for name, value in (thresholds or {}).items():
        if name not in THRESHOLDS:
            raise ClassifyError(f"no label {name!r}; the labels are {', '.join(THRESHOLDS)}")
        limits[name] = float(value)
    return limits


def _probes(probe, model, capture, source) -> tuple[str, ...]:
    """``probe=`` as a tuple of ``PROBES``, checked against what running them needs."""
    probes = () if probe is None else (probe,) if isinstance(probe, str) else tuple(probe)
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        raise ClassifyError(f"probe must be one of {PROBES}, a list of them, or None, not {probe!r}")
    if probes and model is None:
        raise ClassifyError(f"probe={probe!r} runs the model: pass model=")
    if probes and capture is None:
        raise ClassifyError(f"probe={probe!r} runs the model under a capture: pass capture= (attnprobe.capture)")
    if source is None and not probes:
        raise ClassifyError(
            "give a scan folder or a capture, and/or model= with probe='induction' or probe='retrieval'"
        )
    return probes


def _from_scan(folder: Path):
    import pandas as pd

    parts = sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []
    if not parts:
        raise ClassifyError(f"{folder} holds no scan (part-*.parquet): run attnprobe.scan first")
    data = pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)
    columns = ["previous_mass", "first_key_mass", "diagonal_mass", "entropy_ratio"]
    missing = [c for c in columns if c not in data.columns]
    if missing:
        raise ClassifyError(f"{folder}: the scan has no {', '.join(missing)} (written by an older attnprobe?)")
    # every input weighs by its real rows, as a capture's mean over rows does
    weighted = data[columns].multiply(data["rows"], axis=0)
    grouped = weighted.assign(layer=data["layer"], head=data["head"], rows=data["rows"]).groupby(["layer", "head"])
    sums = grouped.sum(numeric_only=True)
    means = sums[columns].divide(sums["rows"], axis=0).reset_index()
    modules = data.groupby(["layer", "head"])["module"].first().reset_index()
    return means.merge(modules, on=["layer", "head"])
