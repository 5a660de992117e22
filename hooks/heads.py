"""``attnprobe.heads``: label what each head does (see ``probe/analyses/head_classes.py`` for the labels and
thresholds)."""

from __future__ import annotations

from collections.abc import Mapping

from ..probe.analyses.head_classes import PROBES, SCORES, THRESHOLDS, ClassifyError, head_means, induction_scores
from ..probe.analyses.head_roles import retrieval_scores, role_scores
from .api import capture

__all__ = [
    "PROBES",
    "SCORES",
    "THRESHOLDS",
    "ClassifyError",
    "classify",
    "head_means",
    "induction_scores",
    "retrieval_scores",
    "role_scores",
]


def classify(
    source=None,
    *,
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
    """Label heads from a scan folder or a capture; ``probe="induction"`` and/or ``"retrieval"`` with ``model=``
    add those probes' scores; ``special=`` (the special tokens' positions or mask) the ``sink`` role, ``local=`` the
    ``local`` window, ``budget=`` the ``streaming`` cache (see ``probe/analyses/head_roles.py``). A DataFrame, one
    row per (layer, head): each label's score and ``labels``.

    Example::

        >>> import attnprobe, torch
        >>> model = torch.nn.Sequential(attnprobe.MultiHeadAttention(8, num_heads=2, causal=True))
        >>> with attnprobe.capture(model, keep=("stats",)) as cap:
        ...     _ = model(torch.randn(1, 5, 8))
        >>> table = attnprobe.heads.classify(cap)
        >>> list(table.columns[:3]), len(table)
        (['layer', 'head', 'module'], 2)
    """
    from ..probe.analyses import head_classes as heads

    return heads.classify(
        source,
        capture=capture,
        model=model,
        probe=probe,
        thresholds=thresholds,
        vocab_size=vocab_size,
        seed=seed,
        special=special,
        local=local,
        budget=budget,
        probe_length=probe_length,
    )
