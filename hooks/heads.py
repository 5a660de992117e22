"""``attnprobe.heads``: label what each head does (see ``probe/analyses/head_classes.py`` for the labels and
thresholds)."""

from __future__ import annotations

from collections.abc import Mapping

from ..probe.analyses.head_classes import SCORES, THRESHOLDS, ClassifyError, head_means, induction_scores
from .api import capture

__all__ = ["SCORES", "THRESHOLDS", "ClassifyError", "classify", "head_means", "induction_scores"]


def classify(
    source=None,
    *,
    model=None,
    probe: str | None = None,
    thresholds: Mapping[str, float] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
):
    """Label heads from a scan folder or a statistics capture; ``probe="induction"`` with ``model=`` adds
    the induction score. A DataFrame, one row per (layer, head): each label's score and ``labels``.

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
        source, capture=capture, model=model, probe=probe, thresholds=thresholds, vocab_size=vocab_size, seed=seed
    )
