"""The one record type: what a single attention call did.

Shape notation, used on every field and everywhere else in attnprobe:

    q                (batch, head, query, d_head)
    k, v             (batch, kv_head, key, d_head)
    scores, weights  (batch, head, query, key)
    output           (batch, head, query, d_head)
    allowed          (batch, 1 or head, query, key)   bool, True = this query may attend this key
    query_padding    (batch, query)                    bool, True = this query row is padding

The ``head`` axis holds the heads listed in ``record.heads`` (model head numbers, in that order),
the ``kv_head`` axis those in ``record.kv_heads``. A quantity the adapter could not observe is
``None``, never zeros.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

import torch

from .errors import NotCapturedError

#: The tensors a capture can keep, in the vocabulary used everywhere: ``scores`` are pre-softmax,
#: ``weights`` post-softmax.
TENSOR_FIELDS: tuple[str, ...] = ("q", "k", "v", "scores", "weights", "output")

#: What ``capture(keep=...)`` accepts: the tensors, and ``"stats"`` (per-row statistics, ``record.stats``).
KEEP_NAMES: tuple[str, ...] = TENSOR_FIELDS + ("stats",)

#: Self-attention (keys from the queries' own sequence) or cross-attention (``AttentionRecord.kind``).
RecordKind = Literal["self", "cross"]

#: How a record's weights were obtained (``AttentionRecord.weights_source``).
WEIGHTS_SOURCES = (
    "observed",  # read from the attention code itself (hook point, softmax output)
    "recomputed",  # recomputed by attnprobe from the q, k, mask and kwargs the attention received
    "output_attentions",  # the model's own ``output_attentions`` weights (old-style models)
    "none",  # not obtained
)


@dataclass(frozen=True, eq=False, repr=False)
class AttentionRecord:
    """One attention call, as captured.

    Example::

        >>> import torch, attnprobe
        >>> mha = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(mha) as cap:
        ...     _ = mha(torch.randn(1, 5, 8))
        >>> rec = cap[0]
        >>> tuple(rec.weights.shape)   # (batch, head, query, key)
        (1, 2, 5, 5)
        >>> bool(rec.allowed[0, 0, 0, 1])  # causal: query 0 may not attend key 1
        False
    """

    name: str
    """Module path as in ``model.named_modules()`` ("" for the model itself)."""
    layer: int
    """Index of the attention module among all attention modules of the model, in module order."""
    call: int
    """How many times this module had been called before in this capture (0 for the first call)."""
    kind: RecordKind
    """``"cross"`` when keys and values come from another sequence than the queries."""
    num_heads: int
    """Query heads of the module (all of them, not only the stored ones)."""
    num_kv_heads: int
    """Key/value heads of the module (fewer than ``num_heads`` under grouped-query attention)."""
    heads: tuple[int, ...]
    """Model head numbers stored along the ``head`` axis, in order."""
    kv_heads: tuple[int, ...]
    """Model key/value head numbers stored along the ``kv_head`` axis, in order."""

    q: torch.Tensor | None = None
    """Queries ``(batch, head, query, d_head)``, after any rotary embedding, before scaling."""
    k: torch.Tensor | None = None
    """Keys ``(batch, kv_head, key, d_head)``, after any rotary embedding and KV-cache update."""
    v: torch.Tensor | None = None
    """Values ``(batch, kv_head, key, d_head)``."""
    scores: torch.Tensor | None = None
    """Pre-softmax logits ``(batch, head, query, key)``: scaled ``q @ k``, plus any position bias
    and softcapping, *before* the mask. Entries where ``allowed`` is False are what the logit would
    have been; the softmax never saw them."""
    weights: torch.Tensor | None = None
    """Post-softmax attention weights ``(batch, head, query, key)``, before dropout."""
    output: torch.Tensor | None = None
    """Attention output per head ``(batch, head, query, d_head)`` (``weights @ v`` as the code
    computed it), before the heads are merged and projected."""
    allowed: torch.Tensor | None = None
    """Boolean mask ``(batch, 1 or head, query, key)``: True where the query may attend the key
    (padding, causality, sliding window and any custom mask combined)."""
    query_padding: torch.Tensor | None = None
    """Boolean ``(batch, query)``: True for query rows that are padding ("don't care" rows)."""

    causal: bool | None = None
    """The effective causal flag of this call (None when unknown)."""
    scaling: float | None = None
    """Factor applied to ``q @ k`` (``1/sqrt(d_head)`` in the textbook formulation)."""
    backend: str = "unknown"
    """What computed the attention: ``"attnprobe"`` (own modules), ``"sdpa"``, ``"eager"``, ..."""
    dtype: torch.dtype | None = None
    """dtype the attention ran in (stored tensors may have another dtype, see ``capture(dtype=)``)."""
    weights_source: str = "none"
    """How ``weights`` were obtained: one of ``WEIGHTS_SOURCES``."""
    dropout: float = 0.0
    """Dropout probability active on the weights during this call (0.0 in eval mode)."""
    step: int | None = None
    """Generation step (0 = prefill) when captured under ``generate``; None otherwise."""
    query_offset: int = 0
    """Key index of the first query (cached keys before it, e.g. during generation)."""
    sinks: torch.Tensor | None = None
    """Per-head sink logits ``(head,)`` where the model has attention sinks; rows of ``weights``
    then sum to one minus the sink mass."""
    softcap: float | None = None
    """Logit softcapping value (``tanh(s / cap) * cap``) already applied to ``scores``."""
    sliding_window: int | None = None
    """Sliding-window size already folded into ``allowed``, when the model uses one."""
    identified: frozenset[str] = frozenset()
    """Names of the fields the adapter actually observed or derived (the rest are None)."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Adapter-specific details (read-only), e.g. the model class or the base backend."""
    stats: Mapping[str, torch.Tensor] | None = None
    """Per-row statistics (read-only mapping, ``capture(keep=("stats",))``): ``attnprobe.probe.engine.stats.ROW_STATS``
    ``(batch, head, query)`` and ``KEY_STATS`` ``(batch, head, key)``, computed blockwise from q and k without
    a ``(query, key)`` tensor; None when not asked for. With ``capture(stats_rows=)`` the row statistics are those
    of a sample of query rows, ``(batch, head, sample)``: ``meta["stats_rows"]`` lists their positions among the
    call's queries (``stats_positions``) and ``meta["stats_query_len"]`` how many queries the call had."""

    def __post_init__(self) -> None:
        if self.kind not in ("self", "cross"):
            raise ValueError(f"kind must be 'self' or 'cross', got {self.kind!r}")
        if self.weights_source not in WEIGHTS_SOURCES:
            raise ValueError(f"weights_source must be one of {WEIGHTS_SOURCES}, got {self.weights_source!r}")
        if not isinstance(self.meta, MappingProxyType):
            object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))
        if self.stats is not None and not isinstance(self.stats, MappingProxyType):
            object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))
        if not self.identified:
            present = {f for f in TENSOR_FIELDS + ("allowed", "query_padding") if getattr(self, f) is not None}
            object.__setattr__(self, "identified", frozenset(present))

    def __reduce__(self):
        # pickle (torch.save, multiprocessing) cannot store the read-only meta view: store a dict
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["meta"] = dict(self.meta)
        state["stats"] = None if self.stats is None else dict(self.stats)
        return (_rebuild_record, (state,))

    # ------------------------------------------------------------------ derived facts
    @property
    def batch_size(self) -> int | None:
        t = self._first_tensor(("weights", "scores", "q", "output", "k", "v", "allowed"))
        if t is None and self.stats is not None:
            t = self.stats["entropy"]
        return None if t is None else int(t.shape[0])

    @property
    def query_len(self) -> int | None:
        t = self._first_tensor(("weights", "scores", "q", "output", "allowed"))
        if t is None and self.stats is not None:
            if "stats_query_len" in self.meta:  # statistics of sampled rows (capture(stats_rows=))
                return int(self.meta["stats_query_len"])
            t = self.stats["entropy"]
        return None if t is None else int(t.shape[2])

    @property
    def stats_positions(self) -> torch.Tensor | None:
        """``(n,)`` long: the query rows (indices among the call's queries) that ``stats``' row statistics describe,
        in order; None when there are no statistics. Every row unless captured with ``stats_rows=``."""
        if self.stats is None:
            return None
        if "stats_rows" in self.meta:
            return torch.as_tensor(list(self.meta["stats_rows"]), dtype=torch.long)
        return torch.arange(int(self.stats["entropy"].shape[2]))

    @property
    def stats_real_rows(self) -> torch.Tensor | None:
        """``(batch, head, n)`` bool, on the CPU: which rows of ``stats``' row statistics are real query rows (not
        padding), what averages over a record's rows take; None when there are no statistics."""
        stats, positions = self.stats, self.stats_positions
        if stats is None or positions is None:
            return None
        batch, heads, rows = stats["entropy"].shape
        real = (
            torch.ones(batch, rows, dtype=torch.bool)
            if self.query_padding is None
            else ~self.query_padding.detach().cpu().bool()[:, positions]
        )
        return real[:, None, :].expand(batch, heads, rows)

    @property
    def key_len(self) -> int | None:
        for f, axis in (("weights", 3), ("scores", 3), ("allowed", 3), ("k", 2), ("v", 2)):
            t = getattr(self, f)
            if t is not None:
                return int(t.shape[axis])
        if self.stats is not None:
            return int(self.stats["key_weight"].shape[2])
        return None

    @property
    def key_start(self) -> int:
        """Position of the first key: 0, except for a generation step whose sliding-window cache dropped
        older keys (the keys are then the latest positions, up to the last query: key slot ``i`` holds
        position ``key_start + i``)."""
        q_len, k_len = self.query_len, self.key_len
        if self.kind != "self" or q_len is None or k_len is None or k_len < q_len:
            return 0
        return max(self.query_offset + q_len - k_len, 0)

    @property
    def nbytes(self) -> int:
        """Bytes held by this record's tensors."""
        total = 0
        for f in TENSOR_FIELDS + ("allowed", "query_padding", "sinks"):
            t = getattr(self, f)
            if t is not None:
                total += t.numel() * t.element_size()
        for t in (self.stats or {}).values():
            total += t.numel() * t.element_size()
        return total

    def head_index(self, head: int) -> int:
        """Position of model head ``head`` along this record's ``head`` axis."""
        try:
            return self.heads.index(head)
        except ValueError:
            raise NotCapturedError(
                f"head {head} of {(self.name or '<root>')!r} was not captured (layer {self.layer}; stored heads: "
                f"{list(self.heads)}); capture it with heads=None or include it in heads=[...]"
            ) from None

    def allowed_for_heads(self) -> torch.Tensor | None:
        """``allowed`` broadcast to ``(batch, head, query, key)`` (a view, no copy)."""
        if self.allowed is None:
            return None
        b, h, tq, tk = self.allowed.shape
        return self.allowed.expand(b, len(self.heads), tq, tk) if h == 1 else self.allowed

    def _first_tensor(self, names):
        for f in names:
            t = getattr(self, f)
            if t is not None:
                return t
        return None

    def _repr_html_(self) -> str | None:
        """Notebook view: the HTML report's own page in a frame, bounded in size (see ``attnprobe.reports.inline``)."""
        from .display import repr_html

        return repr_html(self)

    def __repr__(self) -> str:
        parts = [f"name={self.name!r}", f"layer={self.layer}", f"call={self.call}", f"kind={self.kind!r}"]
        if self.step is not None:
            parts.append(f"step={self.step}")
        parts.append(f"heads={len(self.heads)}/{self.num_heads}")
        if self.num_kv_heads != self.num_heads:
            parts.append(f"kv_heads={len(self.kv_heads)}/{self.num_kv_heads}")
        for f in TENSOR_FIELDS:
            t = getattr(self, f)
            if t is not None:
                parts.append(f"{f}={tuple(t.shape)}")
        if self.stats is not None:
            parts.append(f"stats={tuple(self.stats['entropy'].shape)}")
        parts.append(f"backend={self.backend!r}")
        return f"AttentionRecord({', '.join(parts)})"


def _rebuild_record(state: dict) -> AttentionRecord:
    return AttentionRecord(**state)
