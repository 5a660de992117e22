"""One softmax of a traced module call, read into a ``Finding`` in attnprobe's record layout.

    q ─(scale)─┐
               matmul/bmm/einsum ─(scale, bias)─ mask ─ softmax ─(dropout)─ matmul/bmm/einsum ─ output
    k ─(scale, transpose)─┘                                      v ─────────┘

``analyze`` reads it in named steps:

1. ``read_scores_chain`` (``trace_chain.py``): backwards from the softmax input to the product and its Q and K;
2. ``ScoresLayout.of``: how the scores' axes map onto (batch, head, query, key): ``(query, key)``,
   ``(batch or head, query, key)``, ``(batch, head, query, key)``, heads folded into the batch for ``bmm``
   (``(B*H, T, T)``, unfolded by following Q back to the reshape that merged ``B`` and ``H``), extra axes after
   the heads (windows: more batch), grouped-query ``(B, KV, G, T, T)``, and a query vector ``(…, key)`` recorded
   as one query row;
3. ``_read_scores``: the scores before the first mask, the weights and ``allowed``;
4. ``_read_queries_and_keys``: Q, K, the scaling, self- or cross-attention, causality;
5. ``_read_values``: forwards from the weights through dropout and casts to the product with V;
6. lints on the way, and ``Finding.missing``: which fields could not be identified, and where the trail was lost.
Whatever cannot be followed stays ``None``, and says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ...probe.checks import lint as lint_rules
from ...probe.engine.attention_math import attention_logits
from ..masks import compress_heads, forbids_future
from .chain import Product, ScoresChain, permuted, read_scores_chain, source, unfolded_heads, unrepeated_heads
from .mistakes import head_merge_lint, unused_masks
from .ops import einsum_operands
from .recorder import Node, Scope, format_location

#: Fields a traced record normally identifies; a Finding missing one says why (``Finding.missing``).
EXPECTED = ("q", "k", "v", "output", "allowed")


@dataclass
class Finding:
    """One softmax attention read from a scope, in attnprobe's record layout (see ``probe/record.py``)."""

    key: tuple[str, int]  # where the softmax was called
    module: nn.Module  # the module whose forward called it
    heads: int
    kv_heads: int
    dtype: torch.dtype
    weights: torch.Tensor
    scores: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    output: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    scaling: float | None = None
    causal: bool | None = None
    kind: str = "self"
    query_offset: int = 0  # cached keys before the first query (self-attention with a KV cache)
    dropout: float = 0.0
    lints: list[tuple[str, str]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    #: why fields of ``EXPECTED`` are None: one sentence per cause, with the user's line where the trail was lost
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def identified(self) -> frozenset[str]:
        return frozenset(
            f for f in ("q", "k", "v", "scores", "weights", "output", "allowed") if getattr(self, f) is not None
        )


# ------------------------------------------------------------------------------------------- layout
@dataclass
class ScoresLayout:
    """The softmax input's axes in the record's terms. ``shape``: the scores with a query axis, (*lead, query,
    key); for a query vector (scores ``(…, key)``) a query axis of 1 is added before the keys."""

    shape: torch.Size
    vector: bool = False
    unfold: tuple[int, int] | None = None  # (batch, heads) merged into axis 0 for bmm
    grouped: bool = False  # (batch, kv_head, group, query, key): query head = kv_head * group

    @classmethod
    def of(cls, x: torch.Tensor, chain: ScoresChain) -> ScoresLayout:
        product = chain.product
        start = chain.start
        vector = x.dim() == 1 or (
            product is not None and product.vector and start is not None and x.dim() == start.dim()
        )
        layout = cls(x.unsqueeze(-2).shape if vector else x.shape, vector)
        if product is None:
            return layout
        if layout.lead == 1:
            n = layout.shape[0]
            layout.unfold = unfolded_heads(product.q, product.q_parent, n) or unfolded_heads(
                product.k, product.k_parent, n
            )
        # grouped-query attention kept grouped: q (B, KV, G, T, D) against k (B, KV, 1, T, D) broadcast over the group
        q = product.q_rows
        layout.grouped = (
            layout.lead == 3
            and q.dim() == 5
            and product.k.dim() == 5
            and product.k.shape[2] == 1
            and q.shape[2] == layout.shape[2] > 1
        )
        return layout

    @property
    def lead(self) -> int:
        return len(self.shape) - 2

    @property
    def lead_shape(self) -> torch.Size:
        return self.shape[:-2]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor laid out like the softmax input, with its query axis."""
        return t.unsqueeze(-2) if self.vector else t

    def record(self, t: torch.Tensor, *, grouped: bool | None = None) -> torch.Tensor:
        """(*lead, a, b) -> (batch, head, a, b); grouped: lead (batch, kv_head, group), query head = kv_head * group."""
        lead, unfold = self.lead, self.unfold
        if (self.grouped if grouped is None else grouped) and lead == 3:
            return t.flatten(1, 2)
        if lead == 0:
            return t[None, None]
        if lead == 1:
            if unfold is not None and t.shape[0] == unfold[0] * unfold[1]:
                return t.unflatten(0, unfold)
            return t[:, None]
        if lead == 2:
            return t
        # (batch, head, *extra, a, b): windows, chunks or mask units are more batch, not more heads
        return t.movedim(1, -3).flatten(0, lead - 2)

    def fit(self, t: torch.Tensor) -> torch.Tensor:
        """An operand (q, k, v) broadcast or unfolded to the scores' lead axes."""
        lead_shape = self.lead_shape
        if t.dim() == 3 and len(lead_shape) == 2 and t.shape[0] == lead_shape.numel() > 1:
            return t.unflatten(0, lead_shape)  # (B*H, T, D) from a bmm whose scores were viewed (B, H, T, T)
        if t.dim() - 2 < len(lead_shape):
            return t.expand(*lead_shape, *t.shape[-2:])
        return t


# ------------------------------------------------------------------------------------------- analysis
def analyze(scope: Scope, softmax: Node, returned: set[int]) -> Finding | None:
    """Read the attention around one softmax of ``scope`` (see the module docstring); None when its input is not
    scores at all (no tensor, a nested tensor, a 0-d value)."""
    x, w = softmax.input, softmax.out
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() < 1 or x.is_nested:
        return None
    chain = read_scores_chain(softmax, x)
    _drop_reshaped_vector(chain, x)
    layout = ScoresLayout.of(x, chain)
    finding = _read_scores(scope, softmax, x, w, chain, layout)
    _lint_softmax_axis(finding, softmax, x)
    if chain.product is not None:
        _read_queries_and_keys(finding, chain.product, chain, layout)
    _read_kind(finding, chain.product, layout)
    _read_causal(finding, chain)
    used = _read_values(finding, scope, softmax, w, chain, layout)
    finding.lints.extend(unused_masks(scope, chain.node_ids | used | {id(softmax)}, returned))
    _explain_missing(finding, chain, softmax)
    return finding


def _drop_reshaped_vector(chain: ScoresChain, x: torch.Tensor) -> None:
    """The scores of one query vector reshaped on their way to softmax: their product is not read."""
    product, node, start = chain.product, chain.product_node, chain.start
    if product is None or node is None or start is None or not product.vector or x.dim() == start.dim():
        return
    chain.lost = (
        f"the scores of one query vector from {node.name} at {format_location(node.where)} are reshaped on their "
        "way to softmax"
    )
    chain.product = chain.product_node = None


def _read_scores(
    scope: Scope, softmax: Node, x: torch.Tensor, w: torch.Tensor, chain: ScoresChain, layout: ScoresLayout
) -> Finding:
    """The finding's weights (as observed), scores (before the first mask) and ``allowed`` (the masks on the way)."""
    with torch.no_grad():
        scores, allowed = _scores_before_masks(x, chain), _allowed(x, chain)
    finding = Finding(
        key=softmax.where or ("?", 0),
        module=scope.module,
        heads=1,
        kv_heads=1,
        dtype=x.dtype,
        weights=layout.record(layout.rows(w.detach())),
        scores=layout.record(layout.rows(scores)),
    )
    finding.heads = finding.kv_heads = finding.weights.shape[1]
    finding.meta["softmax_at"] = format_location(softmax.where)
    shape = layout.shape
    if layout.lead > 2 and not layout.grouped:
        finding.meta["folded"] = (
            f"scores of shape {tuple(shape)}: axis 1 read as the heads, the axes "
            f"{tuple(shape[2:-2])} after it folded into the batch axis "
            f"(batch = {shape[0]} x {math.prod(shape[2:-2])})"
        )
    if layout.vector:
        finding.meta["query_vector"] = (
            f"scores of shape {tuple(x.shape)} without a query axis: one query vector, recorded as one query row"
        )
    if allowed is not None:
        finding.allowed = compress_heads(layout.record(layout.rows(allowed)))
    return finding


def _scores_before_masks(x: torch.Tensor, chain: ScoresChain) -> torch.Tensor:
    """The softmax input without its masks: from the tensor entering the first mask, the later steps replayed
    (scales, biases, relayouts) without the masking entries."""
    steps = chain.steps
    first_mask = next((i for i, s in enumerate(steps) if s.kind == "mask"), None)
    if first_mask is None:
        return x.detach()
    start, product = steps[first_mask], chain.product
    if product is not None and start.node is chain.product_node:  # baddbmm: the scores before its mask term
        # (*lead, query, d) x (*lead, key, d) -> (*lead, query, key), as the product laid them out
        scores = attention_logits(product.q, product.k, scaling=product.factor)
    else:
        scores = start.inp.detach()  # (*lead, query, key) as the code laid the scores out at that step
    for s in steps[first_mask:]:
        if s.kind == "scale":
            scores = scores * s.factor
        elif s.kind in ("bias", "mask") and s.bias is not None:
            scores = scores + s.bias  # the bias (0 where a mask masks) broadcast to the scores
        elif s.kind == "relayout":
            scores = scores.reshape(s.node.out.shape)  # the step's own output shape
    return scores.reshape(x.shape)  # laid out like the softmax input


def _allowed(x: torch.Tensor, chain: ScoresChain) -> torch.Tensor | None:
    """Every mask on the way combined, laid out like ``x``; all True when the path from a product has none; None
    when the path was not followed to a product and had no mask."""

    def like_x(m: torch.Tensor, shape) -> torch.Tensor:
        m = m.expand(shape)  # the mask as its step's output is laid out
        return m if tuple(shape) == tuple(x.shape) else m.reshape(x.shape)  # laid out like the softmax input

    masks = [(s.allowed, s.node.out.shape) for s in chain.steps if s.kind == "mask" and s.allowed is not None]
    if masks:
        allowed = like_x(*masks[0])
        for mask, shape in masks[1:]:
            allowed = allowed & like_x(mask, shape)
        return allowed
    if chain.product is not None:  # (1, ..., 1, key) expanded like the softmax input: every key allowed
        return torch.ones((1,) * (x.dim() - 1) + tuple(x.shape[-1:]), dtype=torch.bool, device=x.device).expand(x.shape)
    return None


def _softmax_dim(node: Node, nd: int) -> int:
    dim = node.params.get("dim")
    if dim is None:  # legacy implicit dim, as F.softmax chooses it
        dim = 0 if nd in (0, 1, 3) else 1
    return int(dim) % max(nd, 1)


def _lint_softmax_axis(finding: Finding, softmax: Node, x: torch.Tensor) -> None:
    nd = x.dim()
    dim = _softmax_dim(softmax, nd)
    if dim != nd - 1:
        axis = "query axis" if dim == nd - 2 else f"axis {dim}"
        finding.lints.append(
            (
                lint_rules.LINT_SOFTMAX_AXIS,
                f"softmax at {format_location(softmax.where)} normalizes over dim={dim} (the {axis}) of scores shaped "
                f"{tuple(x.shape)}, but the keys are on dim={nd - 1}: each query's weights must sum to 1 over the keys "
                "(use dim=-1)",
            )
        )


def _read_queries_and_keys(finding: Finding, product: Product, chain: ScoresChain, layout: ScoresLayout) -> None:
    """Q and K in the record layout, the scaling applied between the product and the softmax."""
    finding.scaling = product.factor * math.prod(s.factor for s in chain.steps)
    q = layout.record(layout.fit(product.q_rows.detach()))
    if layout.grouped:
        k = product.k.detach()[:, :, 0]
    else:
        k = layout.record(layout.fit(product.k.detach()), grouped=False)
    if k.shape[0] == 1 and q.shape[0] > 1:
        k = k.expand(q.shape[0], *k.shape[1:])
    finding.q = q
    if k.shape[1] not in (q.shape[1], 1) and q.shape[1] % k.shape[1]:
        finding.missing["k"] = (
            f"keys with {k.shape[1]} heads do not divide the {q.shape[1]} query heads "
            f"(k {tuple(k.shape)}, q {tuple(q.shape)})"
        )
        return
    finding.k = k
    finding.kv_heads = k.shape[1]


def _read_kind(finding: Finding, product: Product | None, layout: ScoresLayout) -> None:
    """Self- or cross-attention: from the sources of Q and K when both can be followed, else from the lengths."""
    queries, keys = layout.shape[-2], layout.shape[-1]
    src_q = source(product.q_parent) if product is not None else None
    src_k = source(product.k_parent) if product is not None else None
    if src_q is not None and src_k is not None:
        finding.kind = "self" if src_q is src_k else "cross"
        finding.meta["kind_from"] = "sources"
    else:  # a source could not be followed: fall back to the lengths
        finding.kind = "self" if keys == queries else "cross"
        finding.meta["kind_from"] = "lengths"
    if finding.kind == "self" and keys > queries:  # KV cache: the queries are the latest keys
        finding.query_offset = keys - queries


def _read_causal(finding: Finding, chain: ScoresChain) -> None:
    if finding.allowed is None:
        return
    queries, keys = finding.weights.shape[-2:]
    offset = finding.query_offset if finding.kind == "self" and keys >= queries else None
    # a decode step needs no mask: its one query is the latest key
    masked = any(s.kind == "mask" for s in chain.steps)
    finding.causal = forbids_future(finding.allowed, offset) if masked or offset else False


# ------------------------------------------------------------------------------------------- values
@dataclass
class _ValueProduct:
    node: Node  # weights @ V
    v: torch.Tensor  # (…, key, d_v)
    out: torch.Tensor  # (…, query, d_v), or (…, d_v) for a query vector
    letters: tuple[str, str] | None  # an einsum's output letters, and the same letters as lead + query + d_v
    dropout: float


def _value_product(softmax: Node, weights: torch.Tensor, vector: bool) -> _ValueProduct | None:
    """Forwards from the weights, through dropout, casts and relayouts, to their product with V."""
    frontier = [(softmax, weights, vector)]  # vector: the weights of one query vector have no query axis yet
    dropout = 0.0
    for _ in range(6):
        following = []
        for node, t, vec in frontier:
            for c in node.consumers:
                found = _as_value_product(c, t, vec, dropout)
                if found is not None:
                    if vec != vector:  # a query axis of 1 was added on the way: its output has it too
                        found.out = found.out.squeeze(-2)
                    return found
                if c.input is not t or not isinstance(c.out, torch.Tensor):
                    continue
                if vec and c.op == "reshape" and c.out.shape == (*t.shape[:-1], 1, t.shape[-1]):
                    following.append((c, c.out, False))  # w.unsqueeze(1) for torch.bmm(w.unsqueeze(1), values)
                elif (
                    c.op == "reshape" and c.out.shape[-2:] == t.shape[-2:]
                ) or c.op == "pass":  # (B, H, T, T) viewed (B*H, T, T) for bmm
                    following.append((c, c.out, vec))
                elif c.op == "dropout":
                    dropout = float(c.params.get("p", 0.5)) if c.params.get("training", True) else dropout
                    following.append((c, c.out, vec))
                elif c.op == "module" and isinstance(c.module, (nn.Dropout, nn.Identity)):
                    if isinstance(c.module, nn.Dropout) and c.module.training:
                        dropout = float(c.module.p)
                    following.append((c, c.out, vec))
        frontier = following
    return None


def _as_value_product(c: Node, t: torch.Tensor, vector: bool, dropout: float) -> _ValueProduct | None:
    """``c`` as weights ``t`` @ V, or None."""
    if c.op == "matmul" and c.input is t and isinstance(c.params.get("other"), torch.Tensor):
        v = c.params["other"]
        return _ValueProduct(c, v, c.out, None, dropout) if v.dim() >= 2 else None
    if (
        c.op == "matmul"
        and c.params.get("other") is t
        and t.dim() == 1
        and isinstance(c.input, torch.Tensor)
        and c.input.dim() >= 2
    ):  # V^T @ w, torch.mv(V.T, w): the same as w @ V for one query vector
        return _ValueProduct(c, c.input.transpose(-2, -1), c.out, None, dropout)
    if c.op != "einsum":
        return None
    parts = einsum_operands(c.params)
    if parts is None or not any(x is t for x in parts[2]):
        return None
    (sa, sb), so, (a, b) = parts
    if b is t:
        (sa, a), (sb, b) = (sb, b), (sa, a)
    if a is not t:
        return None
    k_letter, q_letter, lead = sa[-1], ("" if vector else sa[-2]), sa[:-1] if vector else sa[:-2]
    rest = [x for x in sb if x not in sa]
    if k_letter in so or k_letter not in sb or len(rest) != 1 or set(so) != set(lead) | {*q_letter, rest[0]}:
        return None
    v = permuted(b, sb, lead + k_letter + rest[0])
    order = lead + q_letter + rest[0]
    return _ValueProduct(c, v, permuted(c.out, so, order), (so, order), dropout)


def _read_values(
    finding: Finding, scope: Scope, softmax: Node, w: torch.Tensor, chain: ScoresChain, layout: ScoresLayout
) -> set[int]:
    """V, the output and the dropout applied to the weights; the lints on the way (same tensor as keys and values,
    heads merged wrongly). Returns the ids of the nodes read (the product with V)."""
    if chain.product is None:  # v and output are read once q and k are: the reason is the scores' (chain.lost)
        return set()
    found = _value_product(softmax, w, layout.vector)
    if found is None:
        finding.missing["v"] = finding.missing["output"] = _unfollowed_weights(softmax)
        return set()
    finding.dropout = found.dropout  # as applied: F.dropout(training=True) drops whatever the module's mode is
    finding.meta["dropout_in_eval"] = found.dropout > 0 and not scope.module.training
    finding.v = _values_record(finding, found, layout)
    lead_shape = layout.lead_shape
    out = layout.rows(found.out)
    if out.dim() == 3 and layout.lead == 2 and out.shape[0] == lead_shape.numel():  # weights viewed (B*H, T, T) for bmm
        out = out.unflatten(0, lead_shape)
    if out.dim() == len(layout.shape):
        finding.output = layout.record(out.detach())
    else:
        finding.missing["output"] = (
            f"the output of {found.node.name} at {format_location(found.node.where)} has "
            f"shape {tuple(found.out.shape)}, not laid out like the weights {tuple(w.shape)}"
        )
    # keys computed in the call and used again as values (weights @ K); keys taken as they came in (an encoder's
    # outputs in Luong or Bahdanau attention, attention pooling) are keys and values by design
    if finding.k is not None and chain.product.k_parent is not None and _same_tensor(finding.k, finding.v):
        finding.lints.append(
            (
                lint_rules.LINT_SAME_KV,
                "the same tensor is used as keys and as values (weights @ K): values need their own projection",
            )
        )
    lint = _lint_head_merge(finding, found, layout)
    if lint is not None:
        finding.lints.append(lint)
    return {id(found.node)}


def _values_record(finding: Finding, found: _ValueProduct, layout: ScoresLayout) -> torch.Tensor:
    """V in the record layout, with K's head count (K repeated back when V was repeated another way)."""
    v = found.v
    if not layout.grouped and finding.k is not None and finding.k.shape[1] < finding.heads:  # v repeated like k?
        fewer = unrepeated_heads(v, found.node.parent_of(v))
        if fewer is not None and fewer[0].shape[1] == finding.k.shape[1]:
            v = fewer[0]
        else:  # keep k and v alike: k repeated back as the code repeated it
            finding.k = finding.k.repeat_interleave(finding.heads // finding.k.shape[1], dim=1)
            finding.kv_heads = finding.heads
    if layout.grouped and v.dim() == 5 and v.shape[2] == 1:
        vr = v.detach()[:, :, 0]
    elif layout.grouped:  # v has a value per query head: k repeated to match
        vr = layout.record(v.detach())
        if finding.k is not None:
            finding.k = finding.k.repeat_interleave(finding.heads // finding.k.shape[1], dim=1)
            finding.kv_heads = finding.heads
    else:
        vr = layout.record(layout.fit(v.detach()), grouped=False)
    if vr.shape[0] == 1 and finding.weights.shape[0] > 1:
        vr = vr.expand(finding.weights.shape[0], *vr.shape[1:])
    return vr


def _lint_head_merge(finding: Finding, found: _ValueProduct, layout: ScoresLayout) -> tuple[str, str] | None:
    out, lead = found.out, layout.lead
    if finding.heads <= 1 or layout.vector or out.dim() != len(layout.shape) or lead not in (1, 2):
        return None
    tail = [[("q", out.shape[-2])], [("d", out.shape[-1])]]
    if lead == 2:
        axes = [[("b", out.shape[0])], [("h", out.shape[1])], *tail]
    elif layout.unfold is not None:  # (B*H, T, D) from bmm
        axes = [[("b", layout.unfold[0]), ("h", layout.unfold[1])], *tail]
    else:  # (N, T, D) whose heads are not known: nothing merged them here
        return None
    merged_from = out
    if found.letters is not None:  # an einsum: its own output axes, in its letters' order
        letters, order = found.letters
        by_letter = dict(zip(order, axes))
        axes, merged_from = [by_letter[c] for c in letters], found.node.out
    return head_merge_lint(found.node, merged_from, axes)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    # equal values from two computations: one projection applied twice, unless every value is the same (a zero
    # input gives zero keys and zero values through any two bias-free projections: nothing tells them apart)
    flat = a.detach().flatten()
    return bool(torch.equal(a, b)) and flat.numel() > 1 and not bool((flat == flat[0]).all())


# ------------------------------------------------------------------------------------------- what is missing
def _unfollowed_weights(softmax: Node) -> str:
    uses = softmax.consumers
    at = format_location(softmax.where)
    if not uses:
        return f"the weights of softmax at {at} are not used by a traced call"
    described = ", ".join(f"{c.name}(...) at {format_location(c.where)}" for c in uses[:3])
    return (
        f"the weights of softmax at {at} do not reach a product with values through calls attnprobe reads "
        f"(used by {described})"
    )


def _explain_missing(finding: Finding, chain: ScoresChain, softmax: Node) -> None:
    """``finding.missing``: a reason for every field of ``EXPECTED`` left None."""
    lost = chain.lost or f"the scores of softmax at {format_location(softmax.where)} could not be followed"
    for name in EXPECTED:
        if getattr(finding, name) is None:
            finding.missing.setdefault(name, lost)
