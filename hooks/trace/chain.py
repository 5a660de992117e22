"""From a softmax's input back to the product that made the scores, and from its operands back to Q and K.

    q ─(scale)─┐
               matmul/bmm/einsum ─(scale, bias)─ mask ─ softmax
    k ─(scale, transpose, repeat)─┘

``read_scores_chain`` walks back from the softmax input through the steps ``chain_step`` reads: masks
(``masked_fill``, ``where``, an added float mask, ``scores[index] = -inf``), additive biases, scaling (``*``/``/``
by a number), casts and ``contiguous``, reshapes that keep the query and key axes; up to the ``matmul`` / ``bmm`` /
``einsum`` / ``baddbmm`` producing the scores. ``scores_product`` reads that product's operands as Q and K
(scaling, transposes of K's last two axes and repeated key heads undone; a 1-D query vector is one query).
Where the walk stops, it says at which call and why (``ScoresChain.lost``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...probe.checks import lint as lint_rules
from ..masks import MASKED_AT, is_masking_value
from .ops import einsum_operands
from .recorder import PRODUCT_OPS, Node, format_location, reaches_product

_MAX_STEPS = 32


def _scalar(x) -> float | None:
    """A plain number, or the value of a one-element tensor; None for anything else (bools included)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_nested:
        return float(x.detach().reshape(()).item())
    return None


def _query_rows(t: torch.Tensor) -> int:
    """Size of the query axis of scores shaped (…, query, key); a 1-D row of scores is one query."""
    return t.shape[-2] if t.dim() >= 2 else 1


@dataclass
class ChainStep:
    """What one call did to the scores on their way from the product to the softmax."""

    kind: str  # "pass", "relayout", "scale", "bias", "mask"
    node: Node
    inp: torch.Tensor  # the chain tensor entering the op
    parent: Node | None  # its producer
    factor: float = 1.0
    allowed: torch.Tensor | None = None  # bool, broadcastable to the op's output
    bias: torch.Tensor | None = None  # added to the scores (broadcastable)


def additive_step(node: Node, other: torch.Tensor, factor: float, inp, parent) -> ChainStep:
    """A float tensor added to the scores (times ``factor``): a mask where it is very negative, else a bias."""
    values = other if factor == 1 else other * factor
    values = values.detach()
    masked = values <= MASKED_AT
    if bool(masked.any()):
        bias = values.masked_fill(masked, 0.0)
        return ChainStep("mask", node, inp, parent, allowed=~masked, bias=bias if bool(bias.any()) else None)
    return ChainStep("bias", node, inp, parent, bias=values)


def _chain_operand(node: Node, candidates: list) -> tuple[torch.Tensor, Node | None] | None:
    """Which tensor operand of a binary op carries the scores."""
    tensors = [c for c in candidates if isinstance(c, torch.Tensor)]
    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0], node.parent_of(tensors[0])
    reaching = [t for t in tensors if reaches_product(t, node.parent_of(t))]
    if len(reaching) == 1:
        return reaching[0], node.parent_of(reaching[0])
    shaped = [t for t in tensors if isinstance(node.out, torch.Tensor) and t.shape == node.out.shape]
    pick = shaped[0] if shaped else tensors[0]
    return pick, node.parent_of(pick)


def _scale_step(node: Node) -> ChainStep | None:
    p = node.params
    a, b = p.get("input"), p.get("other")
    if node.op == "div" and p.get("rounding_mode") is not None:
        return None
    sa, sb = _scalar(a), _scalar(b)
    if isinstance(a, torch.Tensor) and a.numel() > 1 and sb is not None:
        if node.op == "div" and sb == 0:
            return None
        return ChainStep("scale", node, a, node.parent_of(a), factor=sb if node.op == "mul" else 1.0 / sb)
    if node.op == "mul" and isinstance(b, torch.Tensor) and b.numel() > 1 and sa is not None:
        return ChainStep("scale", node, b, node.parent_of(b), factor=sa)
    return None


def _additive_chain_step(node: Node) -> ChainStep | None:
    p = node.params
    a, b = p.get("input"), p.get("other")
    picked = _chain_operand(node, [a, b])
    if picked is None:
        return None
    inp, parent = picked
    scores_first = inp is a
    other = b if scores_first else a
    if scores_first and node.before is not None:  # scores += mask overwrote the scores: the copy before it
        inp = node.before
    if not isinstance(other, torch.Tensor) or other.is_nested or not other.is_floating_point():
        return None
    if node.op == "sub" and not scores_first:
        return None  # mask - scores: not attention as attnprobe knows it
    alpha = p.get("alpha", 1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return None
    return additive_step(node, other, -alpha if node.op == "sub" else alpha, inp, parent)


def _masked_fill_step(node: Node) -> ChainStep | None:
    p = node.params
    scores, mask = p.get("input"), p.get("mask")
    if (
        not isinstance(scores, torch.Tensor)
        or not isinstance(mask, torch.Tensor)
        or not is_masking_value(p.get("value"))
    ):
        return None
    inp = node.before if node.before is not None else scores  # masked_fill_ overwrote the scores
    return ChainStep("mask", node, inp, node.parent_of(scores), allowed=~mask.detach().bool())


def _setitem_step(node: Node) -> ChainStep | None:
    """scores[index] = -inf: whatever the index, the assigned entries are the masked ones."""
    if node.before is None:  # not a masking value on scores (see Tracer.before_op)
        return None
    scores = node.input
    allowed = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    try:
        allowed[node.params.get("index")] = False
    except (IndexError, RuntimeError, TypeError):
        return None
    return ChainStep("mask", node, node.before, node.parent_of(scores), allowed=allowed)


def _where_step(node: Node) -> ChainStep | None:
    p = node.params
    cond, a, b = p.get("condition"), p.get("input"), p.get("other")
    if not isinstance(cond, torch.Tensor):
        return None
    cond = cond.detach().bool()
    for chain, fill, allowed in ((a, b, cond), (b, a, ~cond)):
        if not (
            isinstance(chain, torch.Tensor)
            and chain.is_floating_point()
            and reaches_product(chain, node.parent_of(chain))
        ):
            continue  # not the scores
        if is_masking_value(fill) or (isinstance(fill, torch.Tensor) and bool((fill <= MASKED_AT).all())):
            inp = node.before if node.before is not None and chain is a else chain  # where(..., out=scores)
            return ChainStep("mask", node, inp, node.parent_of(chain), allowed=allowed)
    return None


def chain_step(node: Node, out: torch.Tensor) -> ChainStep | None:
    """What ``node`` did to the scores flowing through it, or None when attnprobe cannot tell."""
    op = node.op
    if op == "pass" or (op == "module" and isinstance(node.module, nn.Identity)):
        src = node.input
        return ChainStep("pass", node, src, node.parent_of(src)) if isinstance(src, torch.Tensor) else None
    if op == "reshape":
        src = node.input
        if isinstance(src, torch.Tensor) and src.shape[-1:] == out.shape[-1:] and _query_rows(src) == _query_rows(out):
            return ChainStep("relayout", node, src, node.parent_of(src))
        return None
    readers = {
        "mul": _scale_step,
        "div": _scale_step,
        "add": _additive_chain_step,
        "sub": _additive_chain_step,
        "masked_fill": _masked_fill_step,
        "setitem": _setitem_step,
        "where": _where_step,
    }
    reader = readers.get(op)
    return reader(node) if reader is not None else None


def strip(
    t: torch.Tensor, parent: Node | None, transposes: bool = False
) -> tuple[torch.Tensor, Node | None, float, int]:
    """Walk back through casts, scaling by a number and (optionally) swaps of the last two axes.

    Returns (tensor, its producer, product of the scale factors, number of last-two swaps).
    """
    factor, swaps = 1.0, 0
    for _ in range(16):
        if parent is None:
            break
        # q.mul_(s): the unscaled q is gone
        step = chain_step(parent, t) if parent.op in ("pass", "mul", "div") and not parent.inplace else None
        if step is not None and step.kind in ("pass", "scale"):
            factor *= step.factor
            t, parent = step.inp, step.parent
            continue
        if transposes and _swaps_last_two(parent, t):
            src = parent.input
            t, parent = src, parent.parent_of(src)
            swaps += 1
            continue
        break
    return t, parent, factor, swaps


def _swaps_last_two(node: Node, out: torch.Tensor) -> bool:
    nd = out.dim()
    if node.op != "permute" or nd < 2 or not isinstance(node.input, torch.Tensor) or node.input.dim() != nd:
        return False
    return list(node.params["dims"]) == [*range(nd - 2), nd - 1, nd - 2]


def unfolded_heads(t: torch.Tensor, parent: Node | None, n: int) -> tuple[int, int] | None:
    """(batch, heads) when axis 0 of ``t`` (size ``n``) was made by merging batch and heads, as for bmm."""
    axis = 0
    for _ in range(24):
        if parent is None:
            return None
        op = parent.op
        if op == "item":
            split = parent.parents[0]
            if split is None or split.op != "split" or not isinstance(split.input, torch.Tensor):
                return None
            src = split.input
            if src.dim() != t.dim() or src.shape[axis] != t.shape[axis]:
                return None
            t, parent = src, split.parent_of(src)
            continue
        src = parent.input
        if not isinstance(src, torch.Tensor):
            return None
        if op in ("pass", "mul", "div", "dropout"):
            if src.shape != t.shape:
                return None
        elif op == "permute":
            axis = parent.params["dims"][axis]
        elif op == "reshape":
            groups = lint_rules.reshape_groups(tuple(src.shape), tuple(t.shape))
            if groups is None:
                return None
            for g_in, g_out in groups:
                if axis not in g_out:
                    continue
                if g_out == [axis] and len(g_in) == 1:
                    axis = g_in[0]
                    break
                b = src.shape[g_in[0]]
                if g_out[0] == axis and len(g_in) >= 2 and 1 < b < n and n % b == 0:
                    return b, n // b
                return None
            else:
                return None
        else:
            return None
        t, parent = src, parent.parent_of(src)
    return None


def unrepeated_heads(t: torch.Tensor, parent: Node | None) -> tuple[torch.Tensor, Node | None] | None:
    """Keys or values ``(B, H, T, D)`` repeated from fewer heads (grouped-query attention) -> the tensor before the
    repeat ``(B, KV, T, D)`` and its producer, else None. Read: ``repeat_interleave(n, dim=<head axis>)`` and
    ``expand`` of a single head (multi-query) or of a new axis after the head axis then merged into it (Llama's
    ``repeat_kv``), also before a transpose: all give query head ``h`` the key/value head ``h // n``, the grouping
    records use.
    ``repeat``/``tile`` (head ``h`` reads ``h % KV``) is left as it is."""
    if t.dim() != 4:
        return None
    axis, moves = 1, []  # the head axis where the walk is; axis moves walked through, to replay on the result
    for _ in range(12):
        if parent is None or not isinstance(parent.input, torch.Tensor):
            return None
        src, op, nd = parent.input, parent.op, t.dim()
        if op == "pass" and src.shape == t.shape:
            pass
        elif op == "permute":
            dims = list(parent.params["dims"])
            moves.append(dims)
            axis = dims[axis]
        elif op == "repeat_interleave":
            repeats, dim = parent.params.get("repeats"), parent.params.get("dim")
            if not isinstance(repeats, int) or not isinstance(dim, int) or dim % nd != axis:
                return None
            base, base_parent = src, parent.parent_of(src)
            break
        elif op == "expand" and src.dim() == nd and src.shape[axis] == 1:
            base, base_parent = src, parent.parent_of(src)  # one key/value head for all (multi-query)
            break
        elif (
            op == "reshape"
            and src.dim() == nd + 1
            and src.shape[:axis] == t.shape[:axis]
            and src.shape[axis + 2 :] == t.shape[axis + 1 :]
        ):
            expand = parent.parent_of(src)  # (…, KV, n, …) merged into (…, KV * n, …): n made by expand?
            if expand is None or expand.op != "expand" or not isinstance(expand.input, torch.Tensor):
                return None
            grown = expand.input
            if grown.dim() != src.dim() or grown.shape[axis + 1] != 1 or grown.shape[axis] != src.shape[axis]:
                return None
            base, base_parent = grown.squeeze(axis + 1), expand.parent_of(grown)
            break
        else:
            return None
        t, parent = src, parent.parent_of(src)
    else:
        return None
    for dims in reversed(moves):
        base = base.permute(dims)
    return base, base_parent


def source(parent: Node | None, memo: dict | None = None) -> torch.Tensor | None:
    """The tensor a projection was computed from (the module input behind q, k or v): the input of the module
    (e.g. an ``nn.Linear``) or of the product with a parameter that made it. Other ops (reshapes, scaling,
    rotary embeddings, a KV cache concatenated or written in place) are walked through their inputs computed in
    this call. None when it cannot be followed, or when those inputs come from different sources."""
    memo = {} if memo is None else memo
    for _ in range(32):
        if parent is None:
            return None
        if parent.op == "module":
            if not parent.inputs:
                return None
            if _reshapes_nothing(parent):  # qk-norm, Identity, dropout: not where q and k part ways
                parent = parent.parent_of(parent.inputs[0])
                continue
            return parent.inputs[0]
        if parent.op == "item":
            split = parent.parents[0]
            if split is None or not split.inputs:
                return None
            parent = split.parent_of(split.inputs[0])
            continue
        if parent.op == "matmul":
            operands = [x for x in parent.inputs if not isinstance(x, nn.Parameter)]
            if len(operands) == 1 and len(parent.inputs) == 2:
                return operands[0]
            return None
        produced = list({id(p): p for p in parent.parents if p is not None}.values())
        if len(produced) == 1:
            parent = produced[0]
            continue
        if id(parent) not in memo:  # q * cos + rotate_half(q) * sin, cat([past_k, k]): one source or none
            memo[id(parent)] = None
            found = {id(s): s for s in (source(p, memo) for p in produced) if s is not None}
            memo[id(parent)] = next(iter(found.values())) if len(found) == 1 else None
        return memo[id(parent)]
    return None


def _reshapes_nothing(node: Node) -> bool:
    """Whether a child-module call keeps its input's shape and has no matrix parameter (a norm, ``Identity``,
    dropout): it transforms q or k in place rather than projecting them from a source."""
    module = node.module
    return (
        isinstance(module, nn.Module)
        and isinstance(node.out, torch.Tensor)
        and node.inputs[0].shape == node.out.shape
        and all(p.dim() <= 1 for p in module.parameters())
    )


def permuted(t: torch.Tensor, letters: str, order: str) -> torch.Tensor:
    """``t`` with axes named by ``letters``, reordered to ``order``."""
    return t.permute([letters.index(c) for c in order])


@dataclass
class Product:
    """The product that made the scores: Q ``(…, query, d)``, K ``(…, key, d)`` and an extra factor.

    ``vector``: the query is one vector ``(…, d)`` and the scores ``(…, key)`` have no query axis
    (``q @ K.T`` with a 1-D ``q``, ``K @ q``, ``einsum("d,td->t", q, K)``)."""

    q: torch.Tensor
    q_parent: Node | None
    k: torch.Tensor
    k_parent: Node | None
    factor: float
    additive: torch.Tensor | None = None  # baddbmm's input term
    vector: bool = False

    @property
    def q_rows(self) -> torch.Tensor:
        """Q with its query axis, one row for a query vector."""
        return self.q.unsqueeze(-2) if self.vector else self.q


def _keys(b: torch.Tensor, node: Node, transposed: bool) -> tuple[torch.Tensor, Node | None, float]:
    """K ``(…, key, d)`` from a product operand that holds K (``transposed=False``) or K^T."""
    k, kp, fk, swaps = strip(b, node.parent_of(b), transposes=True)
    k, kp = unrepeated_heads(k, kp) or (k, kp)
    if (swaps % 2 == 0) == transposed:
        k = k.transpose(-2, -1)
    return k, kp, fk


def _matmul_product(node: Node, out: torch.Tensor) -> Product | None:
    a, b = node.params.get("input"), node.params.get("other")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or out.dim() < 1:
        return None
    if a.dim() >= 2 and b.dim() >= 2:  # Q @ K^T
        q, qp, fq, _ = strip(a, node.parent_of(a))
        k, kp, fk = _keys(b, node, transposed=True)
        return Product(q, qp, k, kp, fq * fk)
    if a.dim() == 1 and b.dim() >= 2:  # q @ K^T, one query vector
        q, qp, fq, _ = strip(a, node.parent_of(a))
        k, kp, fk = _keys(b, node, transposed=True)
        return Product(q, qp, k, kp, fq * fk, vector=True)
    if b.dim() == 1 and a.dim() >= 2:  # K @ q
        q, qp, fq, _ = strip(b, node.parent_of(b))
        k, kp, fk = _keys(a, node, transposed=False)
        return Product(q, qp, k, kp, fq * fk, vector=True)
    return None


def _baddbmm_product(node: Node) -> Product | None:
    p = node.params
    extra, a, b = p.get("input"), p.get("batch1"), p.get("batch2")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    beta, alpha = p.get("beta", 1), p.get("alpha", 1)
    q, qp, fq, _ = strip(a, node.parent_of(a))
    k, kp, fk = _keys(b, node, transposed=True)
    # beta=0 ignores the input, NaN and -inf included (GPT-2 passes an uninitialised torch.empty buffer)
    additive = extra * beta if isinstance(extra, torch.Tensor) and beta != 0 else None
    return Product(q, qp, k, kp, fq * fk * float(alpha), additive=additive)


def _einsum_product(node: Node) -> Product | None:
    parts = einsum_operands(node.params)
    if parts is None:
        return None
    (sa, sb), so, (a, b) = parts
    lead = [c for c in so if c in sa and c in sb]
    own = [c for c in so if c not in lead]
    contracted = [c for c in sa if c in sb and c not in so]
    if len(contracted) != 1 or so[-len(own) :] != "".join(own) or len(own) not in (1, 2):
        return None
    d, kl = contracted[0], own[-1]
    ql = own[0] if len(own) == 2 else ""  # "" for a query vector: "d,td->t", "bhd,bhtd->bht"
    if kl not in sb:  # operands given as (k, q)
        (sa, a), (sb, b) = (sb, b), (sa, a)
    if kl not in sb or set(sa) != set(lead) | {d, *ql} or set(sb) != set(lead) | {kl, d}:
        return None
    lead_letters = "".join(lead)
    q = permuted(a, sa, lead_letters + ql + d)
    k = permuted(b, sb, lead_letters + kl + d)
    return Product(q, node.parent_of(a), k, node.parent_of(b), 1.0, vector=not ql)


def _column_product(node: Node, out: torch.Tensor) -> tuple[Product, Node] | None:
    """Scores of query vectors made as a column, then squeezed: ``torch.bmm(keys, query.unsqueeze(2)).squeeze(2)``,
    ``(K @ q[..., None]).squeeze(-1)`` (Luong's dot attention): the product with its node, else None."""
    src = node.input
    if (
        node.op != "reshape"
        or not isinstance(src, torch.Tensor)
        or src.dim() < 2
        or src.shape[-1] != 1
        or src.shape[:-1] != out.shape
    ):
        return None
    product = node.parent_of(src)
    if product is None or product.op != "matmul":
        return None
    a, b = product.params.get("input"), product.params.get("other")
    if (
        not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)
        or a.dim() < 2
        or b.dim() < 2
        or b.shape[-1] != 1
    ):
        return None
    q, qp, fq, _ = strip(b, product.parent_of(b))
    k, kp, fk = _keys(a, product, transposed=False)
    return Product(q.squeeze(-1), qp, k, kp, fq * fk, vector=True), product


def scores_product(node: Node, out: torch.Tensor) -> Product | None:
    """Q and K of the product ``node`` that made the scores ``out``, None when its form is not read."""
    if node.op == "matmul":
        return _matmul_product(node, out)
    if (
        node.op == "baddbmm"
    ):  # baddbmm(input, batch1, batch2), also input.baddbmm(batch1=..., batch2=...) as Bloom calls it
        return _baddbmm_product(node)
    if node.op == "einsum":
        return _einsum_product(node)
    return None


@dataclass
class ScoresChain:
    """The softmax input read backwards: what was done to the scores, and the product that made them."""

    steps: list[ChainStep] = field(default_factory=list)  # from the product to the softmax input, in order
    product: Product | None = None
    product_node: Node | None = None
    start: torch.Tensor | None = None  # the tensor the steps start from (the product's output)
    lost: str | None = None  # where and why the walk stopped short of a product, for messages

    @property
    def node_ids(self) -> set[int]:
        ids = {id(s.node) for s in self.steps}
        return ids | ({id(self.product_node)} if self.product_node is not None else set())


def read_scores_chain(softmax: Node, x: torch.Tensor) -> ScoresChain:
    """Walk back from ``x``, the softmax input, to the product that made the scores."""
    steps: list[ChainStep] = []
    t, parent = x, softmax.parent_of(x)
    chain = ScoresChain()
    for _ in range(_MAX_STEPS):
        if parent is None:
            chain.lost = (
                f"the scores reach softmax at {format_location(softmax.where)} from outside the traced calls"
                if not steps
                else f"the scores entering {steps[-1].node.name} at "
                f"{format_location(steps[-1].node.where)} were made outside the traced calls"
            )
            break
        if parent.op in PRODUCT_OPS:
            product = scores_product(parent, t)
            if product is None:
                chain.lost = (
                    f"{parent.name} at {format_location(parent.where)} is a product attnprobe cannot read as q @ k^T"
                )
            else:
                chain.product, chain.product_node = product, parent
            break
        column = _column_product(parent, t)
        if column is not None:
            chain.product, chain.product_node = column
            break
        step = chain_step(parent, t)
        if step is None:
            chain.lost = _unread(parent)
            break
        steps.append(step)
        t, parent = step.inp, step.parent
    else:
        chain.lost = f"more than {_MAX_STEPS} steps between the product and softmax at {format_location(softmax.where)}"
    chain.steps, chain.start = steps[::-1], t
    product, node = chain.product, chain.product_node
    if product is not None and node is not None and product.additive is not None:  # baddbmm's input term
        chain.steps.insert(0, additive_step(node, product.additive, 1.0, t, None))
    return chain


def _unread(node: Node) -> str:
    """Why the walk back stopped at ``node``, for the user."""
    at = format_location(node.where)
    if node.op == "module":
        return f"the scores come from a call of {node.name} at {at}, whose inside is not traced"
    if node.op == "other":
        return f"the scores come from {node.name}(...) at {at}, a call attnprobe does not follow"
    return f"{node.name}(...) at {at} is not read as a scale, mask or bias of the scores"
