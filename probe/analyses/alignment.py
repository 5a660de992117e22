"""Line up two captures of two implementations: which attention calls pair up, and which heads.

Calls pair up in forward order (the order of the captures' records), or by a ``mapping`` of module names or layer
numbers. Heads pair up across layouts:

- **(batch x head) folded**: a record whose batch axis holds ``batch * m`` rows of ``h`` heads (attention written
  on ``(B * H, T, D)`` tensors, as direct ``scaled_dot_product_attention`` calls on 3-D inputs record it) is seen
  as ``batch`` rows of ``m * h`` heads (row ``b * m + j``, head ``i`` is head ``j * h + i``: what
  ``(B, H, T, D).reshape(B * H, T, D)`` gives);
- **grouped vs expanded key/value heads**: when the two sides keep different numbers of key/value heads, both are
  brought to one per query head the way Hugging Face's ``repeat_kv`` and ``repeat_interleave`` do (query head
  ``h`` reads key/value head ``h // group``), and compared per query head;
- **heads in another order**: found by matching (``match_heads``), reported as a permutation.

Shapes in ``probe/record.py``'s notation: q ``(batch, head, query, d_head)``, k/v ``(batch, kv_head, key, d_head)``,
scores/weights ``(batch, head, query, key)``; statistics ``(batch, head, query)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AttnprobeError
from ..record import TENSOR_FIELDS, AttentionRecord


class AlignmentError(AttnprobeError, ValueError):
    """Two captures whose attention calls or heads cannot be lined up. ``reference`` and ``candidate`` describe
    what each side holds (counts, or the two calls that do not fit); the message says what to do."""

    def __init__(self, message: str, *, reference: object = None, candidate: object = None) -> None:
        super().__init__(message)
        self.reference = reference
        self.candidate = candidate


#: Per-row statistics compared between statistics captures, each in its place in the data flow.
COMPARED_STATS: tuple[str, ...] = (
    "allowed_keys",
    "max_score",
    "entropy",
    "max_weight",
    "min_weight",
    "first_key_mass",
    "diagonal_mass",
    "previous_mass",
    "masked_mass",
)

#: Data-flow order: the first divergence is the earliest of these (full tensors and statistics interleaved).
FLOW: tuple[str, ...] = (
    ("q", "k", "v", "allowed_keys", "scores", "max_score", "weights") + COMPARED_STATS[2:] + ("output",)
)
KV_FIELDS = ("k", "v")


def describe(r: AttentionRecord) -> str:
    return f"layer {r.layer} call {r.call} {r.name or '<root>'!r} ({r.batch_size}x{r.query_len}x{r.key_len})"


def _describe_all(records: Sequence[AttentionRecord]) -> str:
    shown = ", ".join(f"{r.layer}:{r.name or '<root>'}" for r in records[:6])
    return shown + (", ..." if len(records) > 6 else "")


def _select(records: Sequence[AttentionRecord], key: int | str, side: str) -> list[AttentionRecord]:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise AlignmentError(f"mapping keys and values are layer numbers or module names, got {key!r}")
    found = [r for r in records if (r.layer == key if isinstance(key, int) else r.name == key)]
    if not found:
        raise AlignmentError(
            f"mapping names {key!r}, which is no attention call of the {side} (it holds {_describe_all(records)})",
            **{side: key},
        )
    return found


def align_calls(
    reference: Sequence[AttentionRecord],
    candidate: Sequence[AttentionRecord],
    mapping: Mapping[int | str, int | str] | None = None,
) -> list[tuple[AttentionRecord, AttentionRecord]]:
    """The pairs of records to compare, in the reference's forward order."""
    if mapping is None:
        if len(reference) != len(candidate):
            raise AlignmentError(
                f"the reference made {len(reference)} attention calls and the candidate {len(candidate)} "
                f"(reference: {_describe_all(reference)}; candidate: {_describe_all(candidate)}); pass "
                "mapping={reference layer or module name: candidate layer or module name} to say which calls "
                "correspond",
                reference=len(reference),
                candidate=len(candidate),
            )
        return list(zip(reference, candidate))
    pairs = []
    for ref_key, cand_key in mapping.items():
        refs, cands = _select(reference, ref_key, "reference"), _select(candidate, cand_key, "candidate")
        if len(refs) != len(cands):
            raise AlignmentError(
                f"mapping {ref_key!r} -> {cand_key!r}: the reference made {len(refs)} calls there and the candidate "
                f"{len(cands)}; map layers that run equally often",
                reference=len(refs),
                candidate=len(cands),
            )
        pairs += list(zip(refs, cands))
    order = {id(r): i for i, r in enumerate(reference)}
    return sorted(pairs, key=lambda p: order[id(p[0])])


@dataclass
class Layout:
    """One record with its batch axis unfolded: every tensor in the notation above, ``stats`` likewise."""

    record: AttentionRecord
    tensors: dict[str, torch.Tensor]
    stats: dict[str, torch.Tensor]
    allowed: torch.Tensor | None  # (batch, 1 or head, query, key)
    padding: torch.Tensor | None  # (batch, query) bool, True = padding
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    folded: int = 1  # how many heads each batch row of the record held folded (1: none)

    @property
    def group(self) -> int:
        return max(self.num_heads // max(self.num_kv_heads, 1), 1)


def _batch_of(r: AttentionRecord) -> int:
    b = r.batch_size
    if b is None:
        raise AlignmentError(f"{describe(r)} holds no tensor and no statistics to compare", reference=describe(r))
    return b


def _unfold_tensor(t: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``(batch * m, h, ...)`` -> ``(batch, m * h, ...)`` (a view where the storage allows); a mask of one batch row
    (broadcast over the batch) stays as it is."""
    if t is None or t.shape[0] in (batch, 1):
        return t
    return t.reshape(batch, -1, *t.shape[2:])


def layout(r: AttentionRecord, batch: int) -> Layout:
    """``r`` seen with ``batch`` batch rows (its own, or fewer when heads were folded into its batch axis)."""
    b = _batch_of(r)
    m = b // batch
    if m > 1 and (len(r.heads) != r.num_heads or len(r.kv_heads) != r.num_kv_heads):
        raise AlignmentError(
            f"{describe(r)} folds heads into its batch axis and stores only heads {list(r.heads)}: capture every head "
            "of such a call (heads=None)",
            reference=describe(r),
        )
    tensors = {name: _unfold_tensor(getattr(r, name), batch) for name in TENSOR_FIELDS}
    stats = {name: _unfold_tensor(r.stats[name], batch) for name in COMPARED_STATS if r.stats and name in r.stats}
    padding = r.query_padding
    if padding is not None and m > 1:
        padding = padding.reshape(batch, m, -1)[:, 0]  # (batch, query): the same for every head folded in
    m_kv = _batch_of_kv(r) // batch if r.k is not None or r.v is not None else 1
    return Layout(
        record=r,
        tensors={k: v for k, v in tensors.items() if v is not None},
        stats={k: v for k, v in stats.items() if v is not None},
        allowed=_unfold_tensor(r.allowed, batch),
        padding=padding,
        heads=tuple(range(m * r.num_heads)) if m > 1 else r.heads,
        kv_heads=tuple(range(m_kv * r.num_kv_heads)) if m_kv > 1 else r.kv_heads,
        num_heads=m * r.num_heads,
        num_kv_heads=m_kv * r.num_kv_heads,
        folded=m,
    )


def _batch_of_kv(r: AttentionRecord) -> int:
    t = r.k if r.k is not None else r.v
    assert t is not None
    return int(t.shape[0])


def _check_shapes(ref: AttentionRecord, cand: AttentionRecord, batch_hint: int | None) -> int:
    """The batch both are seen with: the smaller one, or ``batch_hint`` (the input's batch) where both sides hold
    one head per row of more rows (heads folded into the batch on both sides). Refuses calls whose shapes cannot
    describe the same attention."""
    same_len = (ref.query_len, ref.key_len) == (cand.query_len, cand.key_len)
    rb, cb = _batch_of(ref), _batch_of(cand)
    batch = min(rb, cb)
    if batch_hint and batch > batch_hint and batch % batch_hint == 0 and ref.num_heads == cand.num_heads == 1:
        batch = batch_hint
    folds = max(rb, cb) % batch == 0
    if not same_len or not folds:
        raise AlignmentError(
            f"reference {describe(ref)} and candidate {describe(cand)} cannot be the same attention call (batch, "
            "queries and keys must agree, or the batch axis hold heads folded in); check the inputs and the mapping",
            reference=describe(ref),
            candidate=describe(cand),
        )
    return batch


@dataclass
class Pair:
    """Two aligned calls: ``ref`` and ``cand`` in one layout; ``heads`` the reference head numbers compared and
    ``cand_heads`` the candidate's head each is compared with; likewise for key/value heads (``kv_axis`` says
    whether k/v are compared per key/value head or, when the sides group them differently, per query head)."""

    index: int
    ref: Layout
    cand: Layout
    heads: list[int]
    cand_heads: list[int]
    kv_axis: str = "kv_head"
    kv_heads: list[int] = field(default_factory=list)
    cand_kv_heads: list[int] = field(default_factory=list)
    permuted: bool = False
    mask_counts: dict[int, int] = field(default_factory=dict)  # compared head -> cells one side masks (cached)

    def pick(self, side: str, name: str, i: int) -> torch.Tensor:
        """Head ``i`` of the compared heads (``kv`` heads for k/v) of tensor ``name``: ``(batch, ...)``."""
        lay = self.ref if side == "ref" else self.cand
        if name in KV_FIELDS:
            head = (self.kv_heads if side == "ref" else self.cand_kv_heads)[i]
            return kv_head(lay, name, head, self.kv_axis)
        head = (self.heads if side == "ref" else self.cand_heads)[i]
        src = lay.stats[name] if name in lay.stats and name not in lay.tensors else lay.tensors[name]
        return src[:, lay.heads.index(head)]

    def positions(self, side: str, name: str, heads: Sequence[int]) -> list[int]:
        """Where compared heads ``heads`` (key/value heads for k and v) sit on ``side``'s head axis of ``name``."""
        lay = self.ref if side == "ref" else self.cand
        if name in KV_FIELDS:
            numbers = self.kv_heads if side == "ref" else self.cand_kv_heads
            grouped = self.kv_axis == "head" and lay.num_kv_heads != lay.num_heads
            return [lay.kv_heads.index(numbers[i] // lay.group if grouped else numbers[i]) for i in heads]
        numbers = self.heads if side == "ref" else self.cand_heads
        return [lay.heads.index(numbers[i]) for i in heads]

    def pick_block(self, side: str, name: str, heads: Sequence[int]) -> torch.Tensor:
        """Compared heads ``heads`` of ``name``: ``(batch, head, ...)``, a view when they sit in order."""
        lay = self.ref if side == "ref" else self.cand
        src = lay.stats[name] if name in lay.stats and name not in lay.tensors else lay.tensors[name]
        return _take(src, self.positions(side, name, heads))

    def allowed_block(self, side: str, heads: Sequence[int]) -> torch.Tensor | None:
        """``(batch, 1 or head, query, key)`` bool of compared heads ``heads``; None when the record has no mask."""
        lay = self.ref if side == "ref" else self.cand
        a = lay.allowed
        if a is None or a.shape[1] == 1:
            return a
        return _take(a, self.positions(side, "weights", heads))

    def allowed(self, side: str, i: int) -> torch.Tensor | None:
        """``(batch, query, key)`` bool for compared head ``i``; None when the record has no mask."""
        lay = self.ref if side == "ref" else self.cand
        if lay.allowed is None:
            return None
        head = (self.heads if side == "ref" else self.cand_heads)[i]
        a = lay.allowed
        return a[:, 0] if a.shape[1] == 1 else a[:, lay.heads.index(head)]


def _take(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``t[:, index]``, as a view when ``index`` is a run of consecutive positions."""
    if index == list(range(index[0], index[0] + len(index))):
        return t[:, index[0] : index[0] + len(index)]
    return t[:, index]


def aligned_record(pair: Pair, side: str) -> AttentionRecord:
    """One side of ``pair`` as a record in the shared layout: the reference's layer, name and head numbers, the
    candidate's heads in the matched order, heads unfolded from the batch, key/value heads as compared (``kv_head``
    axis: their own; ``head``: one per query head). For drawing both sides with one page (the diff report)."""
    lay = pair.ref if side == "ref" else pair.cand
    r, ref = lay.record, pair.ref.record
    values: dict[str, Any] = {}
    for name in ("q", "scores", "weights", "output"):
        if name in lay.tensors:
            values[name] = torch.stack([pair.pick(side, name, i) for i in range(len(pair.heads))], 1)
    for name in KV_FIELDS:
        if name in lay.tensors and pair.kv_heads:
            values[name] = torch.stack([pair.pick(side, name, i) for i in range(len(pair.kv_heads))], 1)
    if lay.allowed is not None:
        values["allowed"] = torch.stack([pair.allowed(side, i) for i in range(len(pair.heads))], 1)  # type: ignore[misc]
    kv_heads = tuple(pair.kv_heads) if pair.kv_axis == "kv_head" else tuple(pair.heads)
    return AttentionRecord(
        name=ref.name,
        layer=ref.layer,
        call=ref.call,
        kind=ref.kind,
        num_heads=lay.num_heads,
        num_kv_heads=lay.num_kv_heads if pair.kv_axis == "kv_head" else lay.num_heads,
        heads=tuple(pair.heads),
        kv_heads=kv_heads,
        query_padding=lay.padding,
        causal=r.causal,
        scaling=r.scaling,
        backend=r.backend,
        dtype=r.dtype,
        weights_source=r.weights_source,
        query_offset=ref.query_offset,
        softcap=r.softcap,
        meta={
            "aligned_from": r.name,
            "aligned_layer": r.layer,
            "aligned_heads": tuple(pair.heads if side == "ref" else pair.cand_heads),
        },
        **values,
    )


def kv_head(lay: Layout, name: str, head: int, axis: str) -> torch.Tensor:
    """Key/value head ``head`` (``axis="kv_head"``), or the key/value head query head ``head`` reads
    (``axis="head"``): ``(batch, key, d_head)``."""
    t = lay.tensors[name]
    kv = head // lay.group if axis == "head" and lay.num_kv_heads != lay.num_heads else head
    return t[:, lay.kv_heads.index(kv)]


def pair_up(index: int, ref: AttentionRecord, cand: AttentionRecord, batch: int | None = None) -> Pair:
    """Bring two aligned calls into one layout and pair their heads by number (no permutation yet); ``batch``: the
    input's batch size, if known."""
    batch = _check_shapes(ref, cand, batch)
    r, c = layout(ref, batch), layout(cand, batch)
    if r.num_heads != c.num_heads:
        raise AlignmentError(
            f"reference {describe(ref)} has {r.num_heads} heads and candidate {describe(cand)} {c.num_heads}; "
            "compare implementations of the same attention",
            reference=r.num_heads,
            candidate=c.num_heads,
        )
    heads = [h for h in r.heads if h in c.heads]
    if not heads:
        raise AlignmentError(
            f"reference {describe(ref)} stores heads {list(r.heads)} and candidate {describe(cand)} heads "
            f"{list(c.heads)}: no head to compare; capture the same heads on both sides",
            reference=r.heads,
            candidate=c.heads,
        )
    pair = Pair(index, r, c, heads, list(heads))
    if r.num_kv_heads == c.num_kv_heads:
        pair.kv_heads = [h for h in r.kv_heads if h in c.kv_heads]
    else:
        pair.kv_axis = "head"
        pair.kv_heads = [h for h in heads if h // r.group in r.kv_heads and h // c.group in c.kv_heads]
    pair.cand_kv_heads = list(pair.kv_heads)
    return pair


def match_heads(dist: torch.Tensor) -> list[int] | None:
    """A permutation ``p`` with ``dist[i, p[i]] <= 1`` for every ``i`` (``dist``: ``(n, n)`` distances in units of
    the tolerance), preferring the identity where it fits; None when there is none (Kuhn's augmenting paths)."""
    n = dist.shape[0]
    ok = (dist <= 1).tolist()
    owner = [-1] * n  # owner[j]: the reference head matched to candidate head j

    def augment(i: int, seen: list[bool]) -> bool:
        for j in [i] + [j for j in range(n) if j != i]:
            if ok[i][j] and not seen[j]:
                seen[j] = True
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(n):
        if not augment(i, [False] * n):
            return None
    perm = [0] * n
    for j, i in enumerate(owner):
        perm[i] = j
    return perm
