"""Tensor provenance inside one module call, and the hand-written softmax attention read from it.

While a traced module runs, every torch function call it makes (seen through the capture's
``TorchFunctionMode``) becomes a ``Node``: the function, its arguments, its output, and the nodes that
produced its tensor inputs *at that moment* (so in-place ops keep their history). Calls of child modules
become one node each in the parent's scope; inside a child, a new scope records the child's own ops.
Torch's built-in layers (Linear, Dropout, Softmax, ...) and modules other adapters read are opaque:
one node, nothing recorded inside.

When the module returns, each softmax in its scope is read backwards and forwards (``analyze``):

    q ─(scale)─┐
               matmul/bmm/einsum ─(scale, bias)─ mask ─ softmax ─(dropout)─ matmul/bmm/einsum ─ output
    k ─(scale, transpose)─┘                                      v ─────────┘

- backwards from the softmax input: masks (``masked_fill``, ``where``, an added float mask), additive
  biases, scaling (``*``/``/`` by a number), casts and ``contiguous``, reshapes that keep the last two
  axes, up to the ``matmul``/``bmm``/``einsum``/``baddbmm`` producing the scores; its operands are Q and
  K (transposes of K's last two axes undone);
- forwards from the softmax output, through dropout and casts, to the product with V.
Heads folded into the batch for ``bmm`` (``(B*H, T, D)``) are unfolded by following Q back to the
reshape that merged ``B`` and ``H``. Whatever cannot be followed stays ``None``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..probe import lint as lint_rules
from .masks import MASKED_AT, compress_heads, forbids_future, is_masking_value

_T = torch.Tensor


def _op_table() -> dict:
    ops: dict = {}

    def put(name: str, *funcs) -> None:
        for f in funcs:
            if f is not None:
                ops[f] = name

    g = getattr
    put("softmax", F.softmax, torch.softmax, _T.softmax, g(torch.special, "softmax", None))
    put("matmul", torch.matmul, _T.matmul, _T.__matmul__, torch.bmm, _T.bmm)
    put("rmatmul", _T.__rmatmul__)
    put("einsum", torch.einsum)
    put("baddbmm", torch.baddbmm, _T.baddbmm)
    put("mul", torch.mul, _T.mul, _T.__mul__, _T.__rmul__, _T.mul_, g(torch, "multiply", None), g(_T, "multiply", None))
    put("div", torch.div, _T.div, _T.__truediv__, _T.div_, torch.true_divide, _T.true_divide, g(_T, "divide", None),
        g(torch, "divide", None))
    put("add", torch.add, _T.add, _T.__add__, _T.__radd__, _T.add_)
    put("sub", torch.sub, _T.sub, _T.__sub__, _T.sub_, g(torch, "subtract", None))
    put("masked_fill", torch.masked_fill, _T.masked_fill, _T.masked_fill_)
    put("where", torch.where, _T.where)
    put("transpose", torch.transpose, _T.transpose, _T.swapaxes, _T.swapdims, g(torch, "swapaxes", None),
        g(torch, "swapdims", None))
    put("permute", torch.permute, _T.permute)
    put("reshape", _T.view, _T.reshape, torch.reshape, _T.flatten, torch.flatten, _T.unflatten, torch.unflatten,
        _T.view_as, _T.reshape_as, _T.squeeze, _T.unsqueeze, torch.squeeze, torch.unsqueeze)
    put("pass", _T.contiguous, _T.float, _T.half, _T.double, _T.bfloat16, _T.to, _T.type_as, _T.clone, torch.clone,
        _T.type)
    put("dropout", F.dropout, torch.dropout)  # (input, p, training) in both
    put("split", _T.chunk, torch.chunk, _T.split, torch.split, _T.unbind, torch.unbind, _T.tensor_split,
        torch.tensor_split)
    put("getitem", _T.__getitem__)
    put("setitem", _T.__setitem__)
    put("cat", torch.cat, g(torch, "concat", None), g(torch, "concatenate", None))
    put("repeat", _T.expand, _T.expand_as, _T.repeat, _T.repeat_interleave, torch.repeat_interleave)
    return ops


_OPS = _op_table()
_SOFTMAX_FUNCS = frozenset(f for f, name in _OPS.items() if name == "softmax")
_WHERE_OPS = frozenset({"softmax", "masked_fill", "where", "reshape", "add", "sub", "setitem"})
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the attnprobe package
_INTERNAL_DIRS = (os.path.dirname(torch.__file__) + os.sep,) + tuple(
    os.path.join(_ROOT, d) + os.sep for d in ("hooks", "probe", "reports")
)
_INTERNAL_FILES = frozenset([*(os.path.join(_ROOT, f) for f in ("__init__.py", "cli.py")), contextlib.__file__])


def _internal(filename: str) -> bool:
    """Whether a frame belongs to torch or attnprobe (not to the user's code, tests included)."""
    return filename.startswith(_INTERNAL_DIRS) or filename in _INTERNAL_FILES


def op_name(func) -> str:
    name = _OPS.get(func)
    if name is not None:
        return name
    if getattr(func, "__name__", "") == "__get__":  # tensor properties: x.mT, x.T
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if prop in ("mT", "T"):
            return "mT"
    return "other"


def user_location(depth: int = 2) -> tuple[str, int]:
    """(file, line) of the innermost frame outside torch and attnprobe."""
    frame = sys._getframe(depth)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def user_stacklevel() -> int:
    """``warnings.warn`` stacklevel that points at the first frame outside torch and attnprobe."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def format_location(where: tuple[str, int] | None) -> str:
    if not where:
        return "?"
    return f"{os.path.basename(where[0])}:{where[1]}"


def _tensors_in(values) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(x for x in v if isinstance(x, torch.Tensor))
    return found


class Node:
    """One torch function call (or child-module call, or one item of a tuple result) in a scope."""

    __slots__ = ("op", "func", "args", "kwargs", "inputs", "parents", "out", "consumers", "where", "module", "index",
                 "before")

    def __init__(self, op, func, args, kwargs, inputs, parents, out, module=None, index=None):
        self.op, self.func, self.args, self.kwargs = op, func, args, kwargs
        self.inputs, self.parents, self.out = inputs, parents, out
        self.consumers: list[Node] = []
        self.where: tuple[str, int] | None = None
        self.module, self.index = module, index
        self.before: torch.Tensor | None = None  # an in-place op's input as it was before the op

    def parent_of(self, t: torch.Tensor) -> "Node | None":
        for x, p in zip(self.inputs, self.parents):
            if x is t:
                return p
        return None

    def __repr__(self) -> str:  # for debugging traces
        return f"<Node {self.op} {getattr(self.func, '__name__', self.func)!s}>"


class Scope:
    """What one module call did, while it runs."""

    __slots__ = ("module", "traced", "nodes", "producer", "softmaxes", "findings")

    def __init__(self, module: nn.Module, traced: bool) -> None:
        self.module, self.traced = module, traced
        self.nodes: list[Node] = []
        self.producer: dict[int, Node] = {}
        self.softmaxes: list[Node] = []
        self.findings: list[Finding] = []

    def add(self, op: str, func, args, kwargs, out, module=None) -> Node:
        inputs = _tensors_in(args) + _tensors_in(kwargs.values())
        parents = [self.producer.get(id(t)) for t in inputs]
        node = Node(op, func, args, kwargs, inputs, parents, out, module=module)
        for p in parents:
            if p is not None:
                p.consumers.append(node)
        if isinstance(out, torch.Tensor):
            self.producer[id(out)] = node
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    child = Node("item", None, (out, i), {}, [], [node], item, index=i)
                    node.consumers.append(child)
                    self.producer[id(item)] = child
        self.nodes.append(node)
        return node


#: In-place masking whose input is copied first, so the scores before the mask stay observable: masked_fill_,
#: and, when the tensor comes from a product, an added mask or bias (``scores += mask`` runs as add_) and
#: an assigned masking value (``scores[..., future] = -inf``).
SNAPSHOT_BEFORE = frozenset({_T.masked_fill_, _T.add_, _T.sub_, _T.__setitem__})


class Tracer:
    """The scope stack of one capture; the capture's TorchFunctionMode feeds ``before_op`` and ``on_op``."""

    def __init__(self) -> None:
        self.stack: list[Scope] = []

    def before_op(self, func, args) -> torch.Tensor | None:
        """A copy of an in-place mask's input, taken before the op runs (traced scopes only)."""
        if not self.stack or not self.stack[-1].traced or not args or not isinstance(args[0], torch.Tensor):
            return None
        scope = self.stack[-1]
        if func is _T.__setitem__ and (len(args) != 3 or not is_masking_value(args[2])):
            return None
        if func is not _T.masked_fill_ and not _reaches(args[0], scope.producer.get(id(args[0]))):
            return None  # an in-place add on something else (a residual, a counter): no copy
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return args[0].clone()

    def on_op(self, func, args, kwargs, out, before: torch.Tensor | None = None) -> None:
        scope = self.stack[-1] if self.stack else None
        if scope is None or not scope.traced:
            return
        if func is _T.__setitem__:  # returns None: recorded as the tensor it wrote to (a mask, a KV cache)
            if not args or not isinstance(args[0], torch.Tensor):
                return
            out = args[0]
        if not isinstance(out, torch.Tensor) and not (
            isinstance(out, (tuple, list)) and not isinstance(out, torch.Size) and any(isinstance(x, torch.Tensor) for x in out)
        ):
            return
        op = op_name(func)
        node = scope.add(op, func, args, kwargs, out)
        node.before = before
        if op in _WHERE_OPS:
            node.where = user_location(3)
        if op == "softmax":
            scope.softmaxes.append(node)

    def enter(self, module: nn.Module, traced: bool) -> None:
        self.stack.append(Scope(module, traced))

    def exit(self, module: nn.Module) -> Scope | None:
        """Pop ``module``'s scope (and any left open above it by an exception); None when it has none."""
        for at in range(len(self.stack) - 1, -1, -1):
            if self.stack[at].module is module:
                scope = self.stack[at]
                del self.stack[at:]
                return scope
        return None

    def current(self) -> Scope | None:
        return self.stack[-1] if self.stack else None


# ================================================================================================ analysis
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

    @property
    def identified(self) -> frozenset[str]:
        return frozenset(f for f in ("q", "k", "v", "scores", "weights", "output", "allowed") if getattr(self, f) is not None)


def _scalar(x) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_nested:
        return float(x.detach().reshape(()).item())
    return None


def _reaches(t: torch.Tensor, parent: Node | None, ops=("matmul", "rmatmul", "einsum", "baddbmm"), depth: int = 12) -> bool:
    """Whether ``t`` derives from a product (the scores side of a binary op)."""
    frontier, seen = [parent], 0
    while frontier and seen < depth:
        node = frontier.pop()
        seen += 1
        if node is None:
            continue
        if node.op in ops:
            return True
        frontier.extend(node.parents)
    return False


def _chain_operand(node: Node, candidates: list) -> tuple[torch.Tensor, Node | None] | None:
    """Which tensor operand of a binary op carries the scores."""
    tensors = [c for c in candidates if isinstance(c, torch.Tensor)]
    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0], node.parent_of(tensors[0])
    reaching = [t for t in tensors if _reaches(t, node.parent_of(t))]
    if len(reaching) == 1:
        return reaching[0], node.parent_of(reaching[0])
    shaped = [t for t in tensors if isinstance(node.out, torch.Tensor) and t.shape == node.out.shape]
    pick = shaped[0] if shaped else tensors[0]
    return pick, node.parent_of(pick)


@dataclass
class _Step:
    kind: str  # "pass", "relayout", "scale", "bias", "mask"
    node: Node
    inp: torch.Tensor  # the chain tensor entering the op
    parent: Node | None  # its producer
    factor: float = 1.0
    allowed: torch.Tensor | None = None  # bool, broadcastable to the op's output
    bias: torch.Tensor | None = None  # added to the scores (broadcastable)


def _additive_step(node: Node, other: torch.Tensor, factor: float, inp, parent) -> _Step:
    """A float tensor added to the scores (times ``factor``): a mask where it is very negative, else a bias."""
    values = other if factor == 1 else other * factor
    values = values.detach()
    masked = values <= MASKED_AT
    if bool(masked.any()):
        bias = values.masked_fill(masked, 0.0)
        return _Step("mask", node, inp, parent, allowed=~masked, bias=bias if bool(bias.any()) else None)
    return _Step("bias", node, inp, parent, bias=values)


def _chain_step(node: Node, out: torch.Tensor) -> _Step | None:
    """What ``node`` did to the scores flowing through it, or None when attnprobe cannot tell."""
    op, args = node.op, node.args
    if op in ("pass",) or (op == "module" and isinstance(node.module, nn.Identity)):
        src = node.inputs[0] if node.inputs else None
        return None if src is None else _Step("pass", node, src, node.parent_of(src))
    if op == "reshape":
        src = args[0]
        if isinstance(src, torch.Tensor) and src.shape[-2:] == out.shape[-2:]:
            return _Step("relayout", node, src, node.parent_of(src))
        return None
    if op in ("mul", "div"):
        if len(args) < 2 and "other" not in node.kwargs:
            return None
        a, b = args[0], args[1] if len(args) > 1 else node.kwargs["other"]
        sa, sb = _scalar(a), _scalar(b)
        if isinstance(a, torch.Tensor) and a.numel() > 1 and sb is not None:
            if op == "div" and node.kwargs.get("rounding_mode") is not None:
                return None
            factor = sb if op == "mul" else 1.0 / sb
            return _Step("scale", node, a, node.parent_of(a), factor=factor)
        if op == "mul" and isinstance(b, torch.Tensor) and b.numel() > 1 and sa is not None:
            return _Step("scale", node, b, node.parent_of(b), factor=sa)
        return None
    if op in ("add", "sub"):
        if len(args) < 2:
            return None
        picked = _chain_operand(node, [args[0], args[1]])
        if picked is None:
            return None
        inp, parent = picked
        other = args[1] if inp is args[0] else args[0]
        if inp is args[0] and node.before is not None:  # scores += mask overwrote the scores: the copy before it
            inp = node.before
        if not isinstance(other, torch.Tensor) or other.is_nested or not other.is_floating_point():
            return None
        if op == "sub" and inp is not args[0]:
            return None  # mask - scores: not attention as attnprobe knows it
        alpha = node.kwargs.get("alpha", 1)
        if not isinstance(alpha, (int, float)):
            return None
        return _additive_step(node, other, -alpha if op == "sub" else alpha, inp, parent)
    if op == "masked_fill":
        if len(args) < 3 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
            return None
        if not is_masking_value(args[2]):
            return None
        inp = node.before if node.before is not None else args[0]  # masked_fill_ overwrote args[0]
        return _Step("mask", node, inp, node.parent_of(args[0]), allowed=~args[1].detach().bool())
    if op == "setitem":  # scores[index] = -inf: whatever the index, the assigned entries are the masked ones
        if node.before is None:  # not a masking value on scores (see Tracer.before_op)
            return None
        allowed = torch.ones(args[0].shape, dtype=torch.bool, device=args[0].device)
        try:
            allowed[args[1]] = False
        except (IndexError, RuntimeError, TypeError):
            return None
        return _Step("mask", node, node.before, node.parent_of(args[0]), allowed=allowed)
    if op == "where":
        if node.func is torch.where and len(args) == 3:
            cond, a, b = args
        elif node.func is _T.where and len(args) == 3:
            a, cond, b = args
        else:
            return None
        if not isinstance(cond, torch.Tensor):
            return None
        cond = cond.detach().bool()
        for chain, fill, allowed in ((a, b, cond), (b, a, ~cond)):
            if isinstance(chain, torch.Tensor) and chain.is_floating_point() and _reaches(chain, node.parent_of(chain)):
                if is_masking_value(fill) or (isinstance(fill, torch.Tensor) and bool((fill <= MASKED_AT).all())):
                    return _Step("mask", node, chain, node.parent_of(chain), allowed=allowed)
        return None
    return None


def _strip(t: torch.Tensor, parent: Node | None, transposes: bool = False) -> tuple[torch.Tensor, Node | None, float, int]:
    """Walk back through casts, scaling by a number and (optionally) swaps of the last two axes.

    Returns (tensor, its producer, product of the scale factors, number of last-two swaps).
    """
    factor, swaps = 1.0, 0
    for _ in range(16):
        if parent is None:
            break
        in_place = getattr(parent.func, "__name__", "").endswith("_")  # q.mul_(s): the unscaled q is gone
        step = _chain_step(parent, t) if parent.op in ("pass", "mul", "div") and not in_place else None
        if step is not None and step.kind in ("pass", "scale"):
            factor *= step.factor
            t, parent = step.inp, step.parent
            continue
        if transposes and _swaps_last_two(parent, t):
            src = parent.inputs[0]
            t, parent = src, parent.parent_of(src)
            swaps += 1
            continue
        break
    return t, parent, factor, swaps


def _swaps_last_two(node: Node, out: torch.Tensor) -> bool:
    if not node.inputs or node.inputs[0].dim() != out.dim() or out.dim() < 2:
        return False
    nd = out.dim()
    if node.op == "mT" or (node.op == "mT" and nd == 2):
        return True
    if node.op == "transpose":
        dims = [d for d in node.args[1:3] if isinstance(d, int)]
        return len(dims) == 2 and {d % nd for d in dims} == {nd - 2, nd - 1}
    if node.op == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = [d % nd for d in dims]
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _unfolded_heads(t: torch.Tensor, parent: Node | None, n: int) -> tuple[int, int] | None:
    """(batch, heads) when axis 0 of ``t`` (size ``n``) was made by merging batch and heads, as for bmm."""
    axis = 0
    for _ in range(24):
        if parent is None:
            return None
        op = parent.op
        if op == "item":
            split = parent.parents[0]
            if split is None or split.op != "split" or not split.inputs:
                return None
            src = split.inputs[0]
            if src.dim() != t.dim() or src.shape[axis] != t.shape[axis]:
                return None
            t, parent = src, split.parent_of(src)
            continue
        if not parent.inputs:
            return None
        src = parent.inputs[0]
        if op in ("pass", "mul", "div", "dropout"):
            if src.shape != t.shape:
                return None
        elif op == "transpose":
            a, b = (d % t.dim() for d in parent.args[1:3])
            axis = b if axis == a else a if axis == b else axis
        elif op == "mT":
            nd = t.dim()
            axis = nd - 1 if axis == nd - 2 else nd - 2 if axis == nd - 1 else axis
        elif op == "permute":
            dims = parent.args[1] if len(parent.args) == 2 and isinstance(parent.args[1], (list, tuple)) else parent.args[1:]
            axis = list(dims)[axis] % src.dim()
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


_REPEAT_INTERLEAVE = frozenset({_T.repeat_interleave, torch.repeat_interleave})
_EXPAND = frozenset({_T.expand, _T.expand_as})


def _unrepeated_heads(t: torch.Tensor, parent: Node | None) -> tuple[torch.Tensor, Node | None] | None:
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
        if parent is None or not parent.inputs:
            return None
        src, op, nd = parent.inputs[0], parent.op, t.dim()
        if op == "pass" and src.shape == t.shape:
            pass
        elif op in ("transpose", "permute", "mT"):
            if op == "mT":
                dims = list(range(nd - 2)) + [nd - 1, nd - 2]
            elif op == "transpose":
                a, b = (d % nd for d in parent.args[1:3])
                dims = list(range(nd))
                dims[a], dims[b] = b, a
            else:
                raw = parent.args[1] if len(parent.args) == 2 and isinstance(parent.args[1], (list, tuple)) else parent.args[1:]
                dims = [d % nd for d in raw]
            moves.append(dims)
            axis = dims[axis]
        elif op == "repeat" and parent.func in _REPEAT_INTERLEAVE:
            repeats = parent.args[1] if len(parent.args) > 1 else parent.kwargs.get("repeats")
            dim = parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim")
            if not isinstance(repeats, int) or not isinstance(dim, int) or dim % nd != axis:
                return None
            base, base_parent = src, parent.parent_of(src)
            break
        elif op == "repeat" and parent.func in _EXPAND and src.dim() == nd and src.shape[axis] == 1:
            base, base_parent = src, parent.parent_of(src)  # one key/value head for all (multi-query)
            break
        elif op == "reshape" and src.dim() == nd + 1 and src.shape[:axis] == t.shape[:axis] \
                and src.shape[axis + 2:] == t.shape[axis + 1:]:
            expand = parent.parent_of(src)  # (…, KV, n, …) merged into (…, KV * n, …): n made by expand?
            if expand is None or expand.func not in _EXPAND or not expand.inputs:
                return None
            grown = expand.inputs[0]
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


def _source(parent: Node | None, memo: dict | None = None) -> torch.Tensor | None:
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
        if parent.op in ("matmul", "rmatmul"):
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
            found = {id(s): s for s in (_source(p, memo) for p in produced) if s is not None}
            memo[id(parent)] = next(iter(found.values())) if len(found) == 1 else None
        return memo[id(parent)]
    return None


def _reshapes_nothing(node: Node) -> bool:
    """Whether a child-module call keeps its input's shape and has no matrix parameter (a norm, ``Identity``,
    dropout): it transforms q or k in place rather than projecting them from a source."""
    module = node.module
    return (isinstance(module, nn.Module) and isinstance(node.out, torch.Tensor) and node.inputs[0].shape == node.out.shape
            and all(p.dim() <= 1 for p in module.parameters()))


def _einsum_parts(node: Node):
    """(equation, [operand, ...]) of an einsum call with explicit output and no ellipsis, else None."""
    args = node.args
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = args[0].replace(" ", "")
    if "->" not in eq or "." in eq or len(operands) != 2:
        return None
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or any(len(set(s)) != len(s) for s in (*ins, out)):
        return None
    return ins, out, operands


def _permuted(t: torch.Tensor, letters: str, order: str) -> torch.Tensor:
    return t.permute([letters.index(c) for c in order])


@dataclass
class _Product:
    """The product that made the scores: Q, K (…, key, d) and extra factor."""

    q: torch.Tensor
    q_parent: Node | None
    k: torch.Tensor
    k_parent: Node | None
    factor: float
    additive: torch.Tensor | None = None  # baddbmm's input term


def _scores_product(node: Node, out: torch.Tensor) -> _Product | None:
    op, args = node.op, node.args
    if op in ("matmul", "rmatmul"):
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return None
        a, b = (args[0], args[1]) if op == "matmul" else (args[1], args[0])
        if a.dim() < 2 or b.dim() < 2 or out.dim() < 2:
            return None
        q, qp, fq, _ = _strip(a, node.parent_of(a))
        k, kp, fk, swaps = _strip(b, node.parent_of(b), transposes=True)
        k, kp = _unrepeated_heads(k, kp) or (k, kp)
        if swaps % 2 == 0:
            k = k.transpose(-2, -1)
        return _Product(q, qp, k, kp, fq * fk)
    if op == "baddbmm":  # baddbmm(input, batch1, batch2), also input.baddbmm(batch1=..., batch2=...) as Bloom calls it
        named = (node.kwargs.get("input"), node.kwargs.get("batch1"), node.kwargs.get("batch2"))
        extra, a, b = (args[i] if len(args) > i else named[i] for i in range(3))
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return None
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        q, qp, fq, _ = _strip(a, node.parent_of(a))
        k, kp, fk, swaps = _strip(b, node.parent_of(b), transposes=True)
        k, kp = _unrepeated_heads(k, kp) or (k, kp)
        if swaps % 2 == 0:
            k = k.transpose(-2, -1)
        # beta=0 ignores the input, NaN and -inf included (GPT-2 passes an uninitialised torch.empty buffer)
        additive = extra * beta if isinstance(extra, torch.Tensor) and beta != 0 else None
        return _Product(q, qp, k, kp, fq * fk * float(alpha), additive=additive)
    if op == "einsum":
        parts = _einsum_parts(node)
        if parts is None:
            return None
        (sa, sb), so, (a, b) = parts
        lead = [c for c in so if c in sa and c in sb]
        own = [c for c in so if c not in lead]
        contracted = [c for c in sa if c in sb and c not in so]
        if len(own) != 2 or so[-2:] != "".join(own) or len(contracted) != 1:
            return None
        ql, kl = own
        if ql not in sa or kl not in sb:  # operands given as (k, q)
            (sa, a), (sb, b) = (sb, b), (sa, a)
        if ql not in sa or kl not in sb or set(sa) != set(lead) | {ql, contracted[0]} or set(sb) != set(lead) | {kl, contracted[0]}:
            return None
        d = contracted[0]
        q = _permuted(a, sa, "".join(lead) + ql + d)
        k = _permuted(b, sb, "".join(lead) + kl + d)
        return _Product(q, node.parent_of(a), k, node.parent_of(b), 1.0)
    return None


def _output_product(softmax: Node, weights: torch.Tensor):
    """(node of weights @ V, V (…, key, dv), output (…, query, dv), dropout p, and for an einsum
    (its output letters, the same letters as lead + query + d_head) else None)."""
    frontier = [(softmax, weights)]
    dropout = 0.0
    for _ in range(6):
        following = []
        for node, t in frontier:
            for c in node.consumers:
                if c.op == "matmul" and c.args and c.args[0] is t and len(c.args) > 1 and isinstance(c.args[1], torch.Tensor):
                    return c, c.args[1], c.out, None, dropout
                if c.op == "rmatmul" and len(c.args) > 1 and c.args[1] is t:
                    return c, c.args[0], c.out, None, dropout
                if c.op == "einsum":
                    parts = _einsum_parts(c)
                    if parts is None or not any(x is t for x in parts[2]):
                        continue
                    (sa, sb), so, (a, b) = parts
                    if b is t:
                        (sa, a), (sb, b) = (sb, b), (sa, a)
                    if a is not t or len(sa) != t.dim():
                        continue
                    k_letter, q_letter = sa[-1], sa[-2]
                    lead = sa[:-2]
                    rest = [c_ for c_ in sb if c_ not in sa]
                    if k_letter in so or k_letter not in sb or len(rest) != 1 or set(so) != set(lead) | {q_letter, rest[0]}:
                        continue
                    v = _permuted(b, sb, lead + k_letter + rest[0])
                    return c, v, _permuted(c.out, so, lead + q_letter + rest[0]), (so, lead + q_letter + rest[0]), dropout
                if c.op == "reshape" and c.inputs and c.inputs[0] is t and isinstance(c.out, torch.Tensor) \
                        and c.out.shape[-2:] == t.shape[-2:]:  # (B, H, T, T) viewed (B*H, T, T) for a bmm
                    following.append((c, c.out))
                elif c.op in ("pass", "dropout") and c.inputs and c.inputs[0] is t and isinstance(c.out, torch.Tensor):
                    if c.op == "dropout":
                        p = c.args[1] if len(c.args) > 1 else c.kwargs.get("p", 0.5)
                        training = c.args[2] if len(c.args) > 2 else c.kwargs.get("training", c.kwargs.get("train", True))
                        dropout = float(p) if training else dropout
                    following.append((c, c.out))
                elif c.op == "module" and isinstance(c.module, (nn.Dropout, nn.Identity)) and c.inputs and c.inputs[0] is t:
                    if isinstance(c.module, nn.Dropout) and c.module.training:
                        dropout = float(c.module.p)
                    if isinstance(c.out, torch.Tensor):
                        following.append((c, c.out))
        frontier = following
    return None


def _to_record(t: torch.Tensor, lead: int, unfold: tuple[int, int] | None, grouped: bool = False) -> torch.Tensor:
    """(*lead, a, b) -> (batch, head, a, b); ``grouped``: lead (batch, kv_head, group), query head = kv_head * group."""
    if grouped and lead == 3:
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


def _fit_lead(t: torch.Tensor, lead_shape: torch.Size) -> torch.Tensor:
    if t.dim() == 3 and len(lead_shape) == 2 and t.shape[0] == lead_shape.numel() > 1:
        return t.unflatten(0, lead_shape)  # (B*H, T, D) from a bmm whose scores were viewed (B, H, T, T)
    if t.dim() - 2 < len(lead_shape):
        return t.expand(*lead_shape, *t.shape[-2:])
    return t


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


def _softmax_dim(node: Node, nd: int) -> int:
    if node.op == "module":
        dim = getattr(node.module, "dim", None)
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None:  # legacy implicit dim, as F.softmax chooses it
        dim = 0 if nd in (0, 1, 3) else 1
    return int(dim) % max(nd, 1)


def _head_merge_lint(out_node: Node, out: torch.Tensor, axes: list[list[tuple[str, int]]]) -> tuple[str, str] | None:
    """Follow the attention output to the reshape that merges the heads and judge it.

    ``axes``: for each axis of ``out``, its atoms (label, size) in memory order, e.g. ``[[("b", 2), ("h", 4)],
    [("q", 5)], [("d", 8)]]`` for a bmm output ``(B*H, T, D)``.
    """
    node, t = out_node, out
    for _ in range(8):
        nxt = None
        for c in node.consumers:
            if c.inputs and c.inputs[0] is t and isinstance(c.out, torch.Tensor) and c.op in ("transpose", "permute", "mT", "pass", "reshape", "einsum"):
                nxt = c
                break
        if nxt is None:
            return None
        nd = t.dim()
        if nxt.op == "einsum":
            order = _einsum_permutation(nxt, nd)
            if order is None:  # a product with another tensor: axes are matched by letter, not by memory order
                return None
            axes = [axes[d] for d in order]
        elif nxt.op == "transpose":
            a, b = (d % nd for d in nxt.args[1:3])
            axes[a], axes[b] = axes[b], axes[a]
        elif nxt.op == "mT":
            axes[-1], axes[-2] = axes[-2], axes[-1]
        elif nxt.op == "permute":
            dims = nxt.args[1] if len(nxt.args) == 2 and isinstance(nxt.args[1], (list, tuple)) else nxt.args[1:]
            axes = [axes[d % nd] for d in dims]
        elif nxt.op == "reshape":
            atoms = [atom for axis in axes for atom in axis]
            verdict = lint_rules.head_merge_problem(atoms, tuple(nxt.out.shape))
            if verdict:
                order = ", ".join(label for label, _ in atoms)
                return (
                    lint_rules.LINT_HEAD_MERGE,
                    f"heads merged by a reshape {tuple(t.shape)} -> {tuple(nxt.out.shape)} at {format_location(nxt.where)} "
                    f"while the axes are ({order}) (b=batch, h=head, q=query, d=d_head): the head axis is not next to "
                    "d_head, so values of different queries are mixed; move it first, e.g. "
                    "out.transpose(1, 2).reshape(B, T, H * D)",
                )
            if verdict is False:
                return None
            regrouped = lint_rules.regroup_atoms(atoms, tuple(nxt.out.shape))
            if regrouped is None:
                return None
            axes = regrouped
        node, t = nxt, nxt.out
    return None


def _einsum_permutation(node: Node, nd: int) -> list[int] | None:
    """The axis order of a one-operand einsum that only moves axes (``"bhqd->bqhd"``), else None."""
    args = node.args
    if len(args) != 2 or not isinstance(args[0], str):
        return None
    eq = args[0].replace(" ", "")
    operand = args[1][0] if isinstance(args[1], (list, tuple)) and len(args[1]) == 1 else args[1]
    if not isinstance(operand, torch.Tensor) or "->" not in eq or "." in eq or "," in eq:
        return None
    src, out = eq.split("->")
    if len(src) != nd or len(set(src)) != nd or sorted(src) != sorted(out):
        return None
    return [src.index(c) for c in out]


def _unused_masks(scope: Scope, chain: set[int], returned: set[int]) -> list[tuple[str, str]]:
    found = []
    for n in scope.nodes:
        if n.op not in ("masked_fill", "where", "add", "sub") or id(n) in chain or n.consumers:
            continue
        if getattr(n.func, "__name__", "").endswith("_") or not isinstance(n.out, torch.Tensor) or id(n.out) in returned:
            continue
        step = _chain_step(n, n.out)
        if step is None or step.kind != "mask" or step.parent is None or id(step.parent) not in chain:
            continue
        name = getattr(n.func, "__name__", n.op)
        found.append((
            lint_rules.LINT_UNUSED_MASK,
            f"the result of {name}(...) at {format_location(n.where)} is never used, so its mask is not applied to the "
            f"scores; assign it (scores = scores.{name}(...))" + (" or use masked_fill_" if n.op == "masked_fill" else ""),
        ))
    return found


def analyze(scope: Scope, softmax: Node, returned: set[int]) -> Finding | None:
    """Read the attention around one softmax of ``scope`` (see the module docstring)."""
    if not softmax.inputs or not isinstance(softmax.out, torch.Tensor):
        return None
    x, w = softmax.inputs[0], softmax.out
    nd = x.dim()
    if nd < 2 or x.is_nested:
        return None
    dim = _softmax_dim(softmax, nd)

    # -- backwards: softmax input -> ... -> the product that made the scores
    steps: list[_Step] = []
    t, parent = x, softmax.parent_of(x)
    product_node = None
    for _ in range(32):
        if parent is None:
            break
        if parent.op in ("matmul", "rmatmul", "einsum", "baddbmm"):
            product_node = parent
            break
        step = _chain_step(parent, t)
        if step is None:
            break
        steps.append(step)
        t, parent = step.inp, step.parent
    product = _scores_product(product_node, t) if product_node is not None else None
    if product is None:
        product_node = None
    chain_ids = {id(s.node) for s in steps} | ({id(product_node)} if product_node is not None else set())

    forward = steps[::-1]  # from the product to the softmax input
    if product is not None and product.additive is not None:
        extra = _additive_step(product_node, product.additive, 1.0, t, None)
        forward.insert(0, extra)
    first_mask = next((i for i, s in enumerate(forward) if s.kind == "mask"), None)

    def to_x(m: torch.Tensor, shape) -> torch.Tensor:
        m = m.expand(shape)
        return m if tuple(shape) == tuple(x.shape) else m.reshape(x.shape)

    with torch.no_grad():
        if first_mask is None:
            scores = x.detach()
        else:
            start = forward[first_mask]
            if start.node is product_node:  # baddbmm: the scores before its mask term are computed here
                scores = (product.q @ product.k.transpose(-2, -1)) * product.factor
            else:
                scores = start.inp.detach()
            for s in forward[first_mask:]:
                if s.kind == "scale":
                    scores = scores * s.factor
                elif s.kind in ("bias", "mask") and s.bias is not None:
                    scores = scores + s.bias
                elif s.kind == "relayout":
                    scores = scores.reshape(s.node.out.shape)
            scores = scores.reshape(x.shape)
        allowed = None
        masks = [s for s in forward if s.kind == "mask"]
        if masks:
            allowed = to_x(masks[0].allowed, masks[0].node.out.shape)
            for s in masks[1:]:
                allowed = allowed & to_x(s.allowed, s.node.out.shape)
        elif product is not None:
            allowed = torch.ones((1,) * (nd - 2) + tuple(x.shape[-2:]), dtype=torch.bool, device=x.device).expand(x.shape)

    lead = nd - 2
    lead_shape = x.shape[:-2]
    unfold = None
    if product is not None and lead == 1:
        unfold = _unfolded_heads(product.q, product.q_parent, x.shape[0]) or _unfolded_heads(product.k, product.k_parent, x.shape[0])

    # grouped-query attention kept grouped: q (B, KV, G, T, D) against k (B, KV, 1, T, D) broadcast over the group
    grouped = (product is not None and lead == 3 and product.q.dim() == 5 and product.k.dim() == 5
               and product.k.shape[2] == 1 and product.q.shape[2] == x.shape[2] > 1)

    finding = Finding(
        key=softmax.where or ("?", 0),
        module=scope.module,
        heads=1,
        kv_heads=1,
        dtype=x.dtype,
        weights=_to_record(w.detach(), lead, unfold, grouped),
        scores=_to_record(scores, lead, unfold, grouped),
    )
    finding.heads = finding.weights.shape[1]
    finding.kv_heads = finding.heads
    finding.meta["softmax_at"] = format_location(softmax.where)
    if lead > 2 and not grouped:
        finding.meta["folded"] = (f"scores of shape {tuple(x.shape)}: axis 1 read as the heads, the axes "
                                  f"{tuple(x.shape[2:-2])} after it folded into the batch axis "
                                  f"(batch = {x.shape[0]} x {math.prod(x.shape[2:-2])})")
    if allowed is not None:
        finding.allowed = compress_heads(_to_record(allowed, lead, unfold, grouped))

    if dim != nd - 1:
        axis = "query axis" if dim == nd - 2 else f"axis {dim}"
        finding.lints.append((
            lint_rules.LINT_SOFTMAX_AXIS,
            f"softmax at {format_location(softmax.where)} normalizes over dim={dim} (the {axis}) of scores shaped "
            f"{tuple(x.shape)}, but the keys are on dim={nd - 1}: each query's weights must sum to 1 over the keys "
            "(use dim=-1)",
        ))

    if product is not None:
        scaling = product.factor
        for s in forward:
            scaling *= s.factor
        finding.scaling = scaling
        q = _to_record(_fit_lead(product.q.detach(), lead_shape), lead, unfold, grouped)
        k = product.k.detach()[:, :, 0] if grouped else _to_record(_fit_lead(product.k.detach(), lead_shape), lead, unfold)
        if k.shape[0] == 1 and q.shape[0] > 1:
            k = k.expand(q.shape[0], *k.shape[1:])
        if k.shape[1] not in (q.shape[1], 1) and q.shape[1] % k.shape[1]:
            k = None
        finding.q, finding.k = q, k
        if k is not None:
            finding.kv_heads = k.shape[1]
        src_q, src_k = _source(product.q_parent), _source(product.k_parent)
        if src_q is not None and src_k is not None:
            finding.kind = "self" if src_q is src_k else "cross"
            finding.meta["kind_from"] = "sources"
        else:  # a source could not be followed: fall back to the lengths
            finding.kind = "self" if x.shape[-1] == x.shape[-2] else "cross"
            finding.meta["kind_from"] = "lengths"
    else:
        finding.kind = "self" if x.shape[-1] == x.shape[-2] else "cross"
        finding.meta["kind_from"] = "lengths"
    if finding.kind == "self" and x.shape[-1] > x.shape[-2]:  # KV cache: the queries are the latest keys
        finding.query_offset = x.shape[-1] - x.shape[-2]
    if finding.allowed is not None:
        offset = finding.query_offset if finding.kind == "self" and x.shape[-1] >= x.shape[-2] else None
        # a decode step needs no mask: its one query is the latest key
        finding.causal = forbids_future(finding.allowed, offset) if masks or offset else False

    # -- forwards: weights -> (dropout) -> weights @ V
    found = _output_product(softmax, w)
    if found is not None and product is not None:
        out_node, v, out, out_letters, dropout = found
        finding.dropout = dropout  # as applied: F.dropout(training=True) drops whatever the module's mode is
        finding.meta["dropout_in_eval"] = dropout > 0 and not scope.module.training
        if not grouped and finding.k is not None and finding.k.shape[1] < finding.heads:  # v repeated like k?
            fewer = _unrepeated_heads(v, out_node.parent_of(v))
            if fewer is not None and fewer[0].shape[1] == finding.k.shape[1]:
                v = fewer[0]
            else:  # keep k and v alike: k repeated back as the code repeated it
                finding.k = finding.k.repeat_interleave(finding.heads // finding.k.shape[1], dim=1)
                finding.kv_heads = finding.heads
        if grouped and v.dim() == 5 and v.shape[2] == 1:
            vr = v.detach()[:, :, 0]
        elif grouped:  # v has a value per query head: k repeated to match
            vr = _to_record(v.detach(), lead, unfold, grouped)
            if finding.k is not None:
                finding.k = finding.k.repeat_interleave(finding.heads // finding.k.shape[1], dim=1)
                finding.kv_heads = finding.heads
        else:
            vr = _to_record(_fit_lead(v.detach(), lead_shape), lead, unfold)
        if vr.shape[0] == 1 and finding.weights.shape[0] > 1:
            vr = vr.expand(finding.weights.shape[0], *vr.shape[1:])
        finding.v = vr
        out_rec = out
        if out.dim() == 3 and lead == 2 and out.shape[0] == lead_shape.numel():  # weights viewed (B*H, T, T) for bmm
            out_rec = out.unflatten(0, lead_shape)
        finding.output = _to_record(out_rec.detach(), lead, unfold, grouped) if out_rec.dim() == nd else None
        if finding.k is not None and _same_tensor(finding.k, finding.v):
            finding.lints.append((
                lint_rules.LINT_SAME_KV,
                "the same tensor is used as keys and as values (weights @ K): values need their own projection",
            ))
        if finding.heads > 1 and out.dim() == nd and lead in (1, 2):
            tail = [[("q", out.shape[-2])], [("d", out.shape[-1])]]
            if lead == 2:
                axes = [[("b", out.shape[0])], [("h", out.shape[1])], *tail]
            else:  # (B*H, T, D) from bmm
                axes = [[("b", unfold[0]), ("h", unfold[1])], *tail]
            merged_from = out
            if out_letters is not None:  # an einsum: its own output axes, in its letters' order
                letters, order = out_letters
                by_letter = dict(zip(order, axes))
                axes, merged_from = [by_letter[c] for c in letters], out_node.out
            lint = _head_merge_lint(out_node, merged_from, axes)
            if lint is not None:
                finding.lints.append(lint)
        chain_ids.add(id(out_node))
    finding.lints.extend(_unused_masks(scope, chain_ids | {id(softmax)}, returned))
    return finding
