"""Tensor provenance inside one module call: what the hand-written attention tracer records while a model runs.

While a traced module runs, every torch function call it makes (seen through the capture's
``TorchFunctionMode``) becomes a ``Node``: the call read by its signature (``hooks/trace/ops.py``: the op's
canonical name and arguments, whatever the calling form), its output, and the nodes that produced its tensor
inputs *at that moment* (so in-place ops keep their history), and the user's line that made it. Calls of child
modules become one node each in the parent's scope; inside a child, a new scope records the child's own ops.
Torch's built-in layers (Linear, Dropout, Softmax, ...) and modules other adapters read are opaque: one node,
nothing recorded inside.

When the module returns, each softmax in its scope is read into a ``Finding`` (``hooks/trace/read.py``), going
backwards to the product that made the scores (``hooks/trace/chain.py``) and forwards to the product with V.

The modules, in reading order:

- ``trace_ops.py``: every calling form of every op followed, normalised into one ``Call``;
- ``trace.py`` (this one): ``Node``, ``Scope``, ``Tracer``: the graph of one module call, and user locations;
- ``trace_chain.py``: from the softmax input back to Q and K (scale, masks, biases, transposes, repeats);
- ``trace_read.py``: ``analyze``: one softmax -> one ``Finding`` in the record layout, in named steps;
- ``trace_lints.py``: the code mistakes found on the way (unused mask, head merge).
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import FrameType

import torch
from torch import nn

from ..masks import is_masking_value
from .ops import INPLACE_OPS, Call, read_call

_T = torch.Tensor
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the attnprobe package: hooks/trace/../..
_INTERNAL_DIRS = (os.path.dirname(torch.__file__) + os.sep,) + tuple(
    os.path.join(_ROOT, d) + os.sep for d in ("hooks", "probe", "reports")
)
_INTERNAL_FILES = frozenset([*(os.path.join(_ROOT, f) for f in ("__init__.py", "cli.py")), contextlib.__file__])
#: Products the scores are made by.
PRODUCT_OPS = frozenset({"matmul", "einsum", "baddbmm"})
#: In-place ops whose input is copied first when it may hold scores, so the scores before a mask stay
#: observable: masked_fill_, ``scores += mask`` (add_), ``scores[..., future] = -inf``, and the same ops
#: written with ``out=`` their input (see ``Tracer.before_op``).
SNAPSHOT_OPS = frozenset({"masked_fill", "add", "sub", "setitem", "where"})
#: Functions for which ``before_op`` may copy the input (a call with ``out=`` is looked at whatever its function).
SNAPSHOT_BEFORE = frozenset(f for f, op in INPLACE_OPS.items() if op in SNAPSHOT_OPS)


def _internal(filename: str) -> bool:
    """Whether a frame belongs to torch or attnprobe (not to the user's code, tests included)."""
    return filename.startswith(_INTERNAL_DIRS) or filename in _INTERNAL_FILES


_INTERNAL_CODE: dict = {}  # code object -> whether it is torch's or attnprobe's (user_location runs on every op)


def user_location(depth: int = 2) -> tuple[str, int]:
    """(file, line) of the innermost frame outside torch and attnprobe."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:
            internal = _INTERNAL_CODE[code] = _internal(code.co_filename)
        if not internal:
            break
        frame = frame.f_back
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def user_stacklevel() -> int:
    """``warnings.warn`` stacklevel that points at the first frame outside torch and attnprobe."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
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
    """One torch function call (or child-module call, or one item of a tuple result) in a scope.

    ``params``: the call's arguments by canonical name (``trace_ops.py``); ``inputs``: every tensor it was given
    (``out=`` excluded), with ``parents`` their producers in this scope (None: made outside it)."""

    __slots__ = (
        "before",
        "consumers",
        "func",
        "index",
        "inplace",
        "inputs",
        "module",
        "op",
        "out",
        "params",
        "parents",
        "where",
    )

    def __init__(self, call: Call, func, inputs, parents, out, module=None, index=None):
        self.op, self.func, self.params, self.inplace = call.op, func, call.params, call.inplace
        self.inputs, self.parents, self.out = inputs, parents, out
        self.consumers: list[Node] = []
        self.where: tuple[str, int] | None = None  # the user's line that made the call
        self.module, self.index = module, index
        self.before: torch.Tensor | None = None  # an in-place op's input as it was before the op

    @property
    def input(self):
        """The tensor the op works on (``self`` of a method), None when it has none."""
        return self.params.get("input")

    @property
    def name(self) -> str:
        """The function as the user called it, for messages: ``masked_fill``, ``matmul``, ``Linear``."""
        if self.module is not None:
            return type(self.module).__name__
        return getattr(self.func, "__name__", None) or self.op

    def parent_of(self, t: torch.Tensor) -> Node | None:
        for x, p in zip(self.inputs, self.parents):
            if x is t:
                return p
        return None

    def __repr__(self) -> str:  # for debugging traces
        return f"<Node {self.op} {self.name}>"


class Scope:
    """What one module call did, while it runs."""

    __slots__ = ("findings", "module", "nodes", "producer", "softmaxes", "traced")

    def __init__(self, module: nn.Module, traced: bool) -> None:
        self.module, self.traced = module, traced
        self.nodes: list[Node] = []
        self.producer: dict[int, Node] = {}
        self.softmaxes: list[Node] = []
        self.findings: list = []  # trace_read.Finding of this scope's layer, from its own softmaxes and children's

    def add(self, call: Call, func, inputs: list[torch.Tensor], out, module=None) -> Node:
        parents = [self.producer.get(id(t)) for t in inputs]
        node = Node(call, func, inputs, parents, out, module=module)
        for p in parents:
            if p is not None:
                p.consumers.append(node)
        if isinstance(out, torch.Tensor):
            self.producer[id(out)] = node
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    child = Node(Call("item", {}), None, [], [node], item, index=i)
                    node.consumers.append(child)
                    self.producer[id(item)] = child
        self.nodes.append(node)
        return node

    def add_module_call(self, module: nn.Module, args, kwargs, out) -> Node:
        """A child module's call, one opaque node; its first tensor argument is its ``input``. An ``nn.Softmax``
        is a softmax like ``F.softmax``."""
        inputs = _tensors_in(args) + _tensors_in(kwargs.values())
        first = inputs[0] if inputs else None
        softmax = isinstance(module, nn.Softmax)
        call = Call("softmax", {"input": first, "dim": module.dim}) if softmax else Call("module", {"input": first})
        node = self.add(call, module, inputs, out, module=module)
        node.where = user_location(2)
        if softmax:
            self.softmaxes.append(node)
        return node


def reaches_product(t: torch.Tensor, parent: Node | None, ops=PRODUCT_OPS, depth: int = 12) -> bool:
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


class Tracer:
    """The scope stack of one capture; the capture's TorchFunctionMode feeds ``before_op`` and ``on_op``."""

    def __init__(self) -> None:
        self.stack: list[Scope] = []

    def before_op(self, func, args, kwargs) -> torch.Tensor | None:
        """A copy of the scores an op is about to overwrite (a mask or bias applied in place, or ``out=`` its
        input), taken before the op runs (traced scopes only)."""
        if func not in SNAPSHOT_BEFORE and not (kwargs and "out" in kwargs):
            return None
        if not self.stack or not self.stack[-1].traced:
            return None
        call = read_call(func, args, kwargs)
        target = call.input
        if not call.inplace or call.op not in SNAPSHOT_OPS or not isinstance(target, torch.Tensor):
            return None
        scope = self.stack[-1]
        if call.op == "setitem" and not is_masking_value(call.params.get("value")):
            return None
        if call.op != "masked_fill" and not reaches_product(target, scope.producer.get(id(target))):
            return None  # an in-place add on something else (a residual, a counter): no copy
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return target.clone()

    def on_op(self, func, args, kwargs, out, before: torch.Tensor | None = None) -> None:
        scope = self.stack[-1] if self.stack else None
        if scope is None or not scope.traced:
            return
        call = read_call(func, args, kwargs)
        if call.op == "setitem":  # returns None: recorded as the tensor it wrote to (a mask, a KV cache)
            out = call.input
        if call.out is not None:
            out = call.out
        if not isinstance(out, torch.Tensor) and not (
            isinstance(out, (tuple, list))
            and not isinstance(out, torch.Size)
            and any(isinstance(x, torch.Tensor) for x in out)
        ):
            return
        inputs = _tensors_in(args) + _tensors_in(v for k, v in kwargs.items() if k != "out")
        node = scope.add(call, func, inputs, out)
        node.before = before
        node.where = user_location(3)
        if call.op == "softmax":
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
