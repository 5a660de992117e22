"""The torch calls the hand-written attention tracer follows, each read by its own signature.

A call reaches the tracer as ``(func, args, kwargs)`` in whatever form the user wrote it: ``s.masked_fill(m, v)``,
``s.masked_fill(mask=m, value=v)``, ``torch.masked_fill(s, m, v)``, ``torch.Tensor.masked_fill_(s, m, v)``,
``q @ k``, ``torch.bmm(q, k, out=buf)``, ``torch.einsum("...", [q, k])``. ``read_call`` turns every form into one
``Call``: the op's canonical name and its arguments by canonical parameter name (defaults filled, reflected
operators such as ``__rmatmul__`` put back in reading order, ``out=`` and in-place writes noted), so the analysis
reads ``call.params["mask"]`` and never a position.

Adding an op is one ``_op(...)`` line below: its name, the functions that spell it and their parameters in
positional order. The canonical vocabulary (parameter names as in torch's documentation):

=================  ============================================  ==================================================
op                 parameters                                    spelled
=================  ============================================  ==================================================
softmax            input, dim, dtype                             F.softmax, torch.softmax, Tensor.softmax,
                                                                 torch.special.softmax
matmul             input, other                                  @, matmul, mm, bmm, mv (and their methods)
einsum             equation, operands                            torch.einsum (operands spread or in one list)
baddbmm            input, batch1, batch2, beta, alpha            torch.baddbmm, Tensor.baddbmm(_)
mul / div          input, other (div: rounding_mode)             *, /, mul(_), multiply, div(_), divide, true_divide
add / sub          input, other, alpha                           +, -, add(_), sub(_), subtract, ``s += m``
masked_fill        input, mask, value                            torch.masked_fill, Tensor.masked_fill(_)
where              condition, input, other                       torch.where, Tensor.where (self is ``input``)
setitem            input, index, value                           ``s[index] = value``
permute            input, dims (a full permutation)              permute, transpose, swapaxes, swapdims, movedim,
                                                                 .T, .mT, .H, .mH, a one-operand einsum ``"bhqd->bqhd"``
reshape            input                                         view, reshape, flatten, unflatten, (un)squeeze, ...
pass               input                                         contiguous, casts, to, type_as, clone
dropout            input, p, training                            F.dropout, torch.dropout (``train``)
expand, tile,      input (repeat_interleave: repeats, dim)       expand(_as), repeat, repeat_interleave
repeat_interleave
split, getitem,    input / tensors                               chunk, split, unbind, tensor_split, ``x[i]``, cat
cat
=================  ============================================  ==================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_T = torch.Tensor


@dataclass(frozen=True)
class Signature:
    """How one function spells an op: its parameters in positional order, in the op's canonical names."""

    op: str
    positional: tuple[str, ...]  # canonical names, in this function's positional order (``input`` is self)
    varargs: str | None = None  # the last parameter takes the remaining positional arguments (``x.permute(0, 2, 1)``)
    renamed: tuple[tuple[str, str], ...] = ()  # this function's keyword names -> canonical names
    defaults: tuple[tuple[str, object], ...] = ()
    reflected: bool = False  # ``x.__rmatmul__(y)`` is ``y @ x``: input and other swap
    inplace: bool = False  # writes its result into ``input``


@dataclass
class Call:
    """One torch call read by its signature. ``params`` holds canonical names only (see the module docstring)."""

    op: str
    params: dict
    inplace: bool = False  # the result was written into params["input"] (``x.add_(m)``, ``torch.add(x, m, out=x)``)
    out: torch.Tensor | None = None  # the ``out=`` tensor, when one was given

    @property
    def input(self):
        return self.params.get("input")


_SIGNATURES: dict = {}
#: Functions that write into their input, with their op (``s.masked_fill_``: ``"masked_fill"``).
INPLACE_OPS: dict = {}


def _op(
    op: str,
    positional: tuple[str, ...],
    *funcs,
    varargs=None,
    renamed=None,
    defaults=None,
    reflected: bool = False,
    inplace: bool = False,
) -> None:
    sig = Signature(
        op, positional, varargs, tuple((renamed or {}).items()), tuple((defaults or {}).items()), reflected, inplace
    )
    for f in funcs:
        if f is not None:
            _SIGNATURES[f] = sig
            if inplace:
                INPLACE_OPS[f] = op


def _maybe(owner, name: str):
    """``owner.name``, or None where this torch release has no such function (``_op`` skips None)."""
    return getattr(owner, name, None)


def _products() -> None:
    """softmax, and the products that make the scores or read the values."""
    softmax = _maybe(torch.special, "softmax")
    _op("softmax", ("input", "dim", "dtype"), torch.softmax, softmax, _T.softmax, defaults={"dim": None})
    _op("softmax", ("input", "dim", "_stacklevel", "dtype"), F.softmax, defaults={"dim": None})

    binary = ("input", "other")
    _op("matmul", binary, torch.matmul, _T.matmul, _T.__matmul__)
    _op("matmul", binary, torch.mm, _T.mm, torch.bmm, _T.bmm, renamed={"mat2": "other"})
    _op("matmul", binary, torch.mv, _T.mv, renamed={"vec": "other"})
    _op("matmul", binary, _T.__rmatmul__, reflected=True)
    _op("einsum", ("equation", "operands"), torch.einsum, varargs="operands")
    baddbmm = ("input", "batch1", "batch2")
    _op("baddbmm", baddbmm, torch.baddbmm, _T.baddbmm, defaults={"beta": 1, "alpha": 1})
    _op("baddbmm", baddbmm, _maybe(_T, "baddbmm_"), defaults={"beta": 1, "alpha": 1}, inplace=True)


def _arithmetic() -> None:
    """Scales and biases: mul, div, add, sub, with their operators, reflected operators and in-place forms."""
    binary = ("input", "other")
    _op("mul", binary, torch.mul, _T.mul, _T.__mul__, _maybe(torch, "multiply"), _maybe(_T, "multiply"))
    _op("mul", binary, _T.__rmul__, reflected=True)
    # ``s *= c`` and the like: torch dispatches them as mul_, div_, add_, sub_; the operators are listed too, in case
    # a release hands them over as they are
    _op("mul", binary, _T.mul_, _maybe(_T, "multiply_"), _maybe(_T, "__imul__"), inplace=True)
    div = ("input", "other", "rounding_mode")
    no_rounding = {"rounding_mode": None}
    divides = (torch.div, _T.div, _T.__truediv__, _maybe(torch, "divide"), _maybe(_T, "divide"))
    _op("div", div, *divides, torch.true_divide, _T.true_divide, defaults=no_rounding)
    _op("div", div, _T.__rtruediv__, _maybe(_T, "__rdiv__"), reflected=True, defaults=no_rounding)
    in_place = (_T.div_, _maybe(_T, "divide_"), _maybe(_T, "true_divide_"), _maybe(_T, "__itruediv__"))
    _op("div", div, *in_place, _maybe(_T, "__idiv__"), defaults=no_rounding, inplace=True)
    additive = ("input", "other", "alpha")
    for name, funcs, reflected, inplace in (
        ("add", (torch.add, _T.add, _T.__add__), None, (_T.add_, _maybe(_T, "__iadd__"))),
        (
            "sub",
            (torch.sub, _T.sub, _T.__sub__, _maybe(torch, "subtract"), _maybe(_T, "subtract")),
            _T.__rsub__,
            (_T.sub_, _maybe(_T, "subtract_"), _maybe(_T, "__isub__")),
        ),
    ):
        _op(name, additive, *funcs, defaults={"alpha": 1})
        _op(name, additive, *inplace, defaults={"alpha": 1}, inplace=True)
        if reflected is not None:
            _op(name, additive, reflected, defaults={"alpha": 1}, reflected=True)
    _op("add", additive, _T.__radd__, defaults={"alpha": 1}, reflected=True)


def _masks_and_axes() -> None:
    """Masks (masked_fill, where, item assignment), indexing, and the calls that move axes."""
    _op("masked_fill", ("input", "mask", "value"), torch.masked_fill, _T.masked_fill)
    _op("masked_fill", ("input", "mask", "value"), _T.masked_fill_, inplace=True)
    _op("where", ("condition", "input", "other"), torch.where)
    _op("where", ("input", "condition", "other"), _T.where)
    _op("setitem", ("input", "index", "value"), _T.__setitem__, inplace=True)
    _op("getitem", ("input", "index"), _T.__getitem__)

    dims = ("input", "dim0", "dim1")
    _op("transpose", dims, torch.transpose, _T.transpose, _maybe(torch, "swapdims"), _maybe(_T, "swapdims"))
    swapaxes = (_maybe(torch, "swapaxes"), _maybe(_T, "swapaxes"))
    _op("transpose", dims, *swapaxes, renamed={"axis0": "dim0", "axis1": "dim1"})
    _op("permute", ("input", "dims"), torch.permute, _T.permute, varargs="dims")
    moves = (torch.movedim, _T.movedim, _maybe(torch, "moveaxis"), _maybe(_T, "moveaxis"))
    _op("movedim", ("input", "source", "destination"), *moves)


def _shaping() -> None:
    """Calls read by their input alone (the shape they give comes from their output; their other arguments are kept
    as they came, in ``args``), dropout, and the calls that split, join or repeat tensors."""
    shaping = ("input", "args")
    views = (_T.view, _T.reshape, torch.reshape, _T.flatten, torch.flatten, _T.unflatten, torch.unflatten)
    squeezes = (_T.squeeze, _T.unsqueeze, torch.squeeze, torch.unsqueeze)
    _op("reshape", shaping, *views, _T.view_as, _T.reshape_as, *squeezes, varargs="args")
    casts = (_T.float, _T.half, _T.double, _T.bfloat16, _T.to, _T.type_as)
    _op("pass", shaping, _T.contiguous, *casts, _T.clone, torch.clone, _T.type, varargs="args")
    splits = (_T.chunk, torch.chunk, _T.split, torch.split, _T.unbind, torch.unbind, _T.tensor_split)
    _op("split", shaping, *splits, torch.tensor_split, varargs="args")
    _op("expand", shaping, _T.expand, _T.expand_as, varargs="args")
    _op("tile", shaping, _T.repeat, _maybe(torch, "tile"), _maybe(_T, "tile"), varargs="args")
    _op("dropout", ("input", "p", "training", "inplace"), F.dropout, defaults={"p": 0.5, "training": True})
    _op("dropout", ("input", "p", "training"), torch.dropout, renamed={"train": "training"})
    cats = (torch.cat, _maybe(torch, "concat"), _maybe(torch, "concatenate"))
    _op("cat", ("tensors", "dim"), *cats, defaults={"dim": 0})
    repeats = (_T.repeat_interleave, torch.repeat_interleave)
    _op("repeat_interleave", ("input", "repeats", "dim"), *repeats, defaults={"dim": None})


def _build_table() -> None:
    """Every op the tracer reads, family by family (the module docstring's table)."""
    _products()
    _arithmetic()
    _masks_and_axes()
    _shaping()


_build_table()
_AXIS_PROPERTIES = {"mT": "mT", "mH": "mT", "T": "T", "H": "T"}  # conjugation changes no real value


def _property_name(func) -> str | None:
    if getattr(func, "__name__", "") == "__get__":  # tensor properties: x.mT, x.T
        return _AXIS_PROPERTIES.get(getattr(getattr(func, "__self__", None), "__name__", ""))
    return None


def read_call(func, args: tuple, kwargs: dict) -> Call:
    """``func(*args, **kwargs)`` in canonical form; op ``"other"`` (no params) for what the tracer does not read."""
    sig = _SIGNATURES.get(func)
    out = kwargs.get("out")
    if sig is None:
        prop = _property_name(func)
        if prop is not None and args and isinstance(args[0], torch.Tensor):
            return _axis_property(prop, args[0])
        return Call("other", {}, out=out if isinstance(out, torch.Tensor) else None)
    params = _bind(sig, args, kwargs)
    if params is None:
        return Call("other", {}, out=out if isinstance(out, torch.Tensor) else None)
    if sig.reflected:
        params["input"], params["other"] = params.get("other"), params.get("input")
    out = out if isinstance(out, torch.Tensor) else None
    call = Call(sig.op, params, sig.inplace or (out is not None and out is params.get("input")), out)
    return _as_permutation(call) if sig.op in ("transpose", "permute", "movedim", "einsum") else call


def _bind(sig: Signature, args: tuple, kwargs: dict) -> dict | None:
    names = sig.positional
    if sig.varargs is not None:
        fixed = len(names) - 1
        params = dict(zip(names[:fixed], args[:fixed]))
        rest: Sequence = args[fixed:]
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = rest[0]  # x.permute((0, 2, 1)), torch.einsum(eq, [a, b])
        if rest:
            params[sig.varargs] = tuple(rest)
    else:
        if len(args) > len(names):
            return None
        params = dict(zip(names, args))
    renamed = dict(sig.renamed)
    for name, value in kwargs.items():
        if name == "out":
            continue
        name = renamed.get(name, name)
        if name == sig.varargs and isinstance(value, (list, tuple)):
            value = tuple(value)
        params.setdefault(name, value)
    for name, value in sig.defaults:
        params.setdefault(name, value)
    return params


def _axis_property(name: str, t: torch.Tensor) -> Call:
    nd = t.dim()
    if name == "T" or nd < 2:  # x.T reverses every axis (x.mT swaps the last two)
        dims = tuple(range(nd))[::-1]
    else:
        dims = (*range(nd - 2), nd - 1, nd - 2)
    return Call("permute", {"input": t, "dims": dims})


def _as_permutation(call: Call) -> Call:
    """transpose, movedim and a one-operand einsum that only moves axes, read as ``permute`` with every axis named;
    a malformed call (it will raise in torch) or an einsum of two operands stays as it is."""
    p = call.params
    if call.op == "einsum":
        dims = _einsum_permutation(p.get("equation"), p.get("operands") or ())
        if dims is None:
            return call
        src = p["operands"][0]
        return Call("permute", {"input": src, "dims": tuple(dims)}, call.inplace, call.out)
    t = p.get("input")
    if not isinstance(t, torch.Tensor):
        return Call("other", {}, call.inplace, call.out)
    nd = max(t.dim(), 1)
    try:
        if call.op == "transpose":
            a, b = int(p["dim0"]) % nd, int(p["dim1"]) % nd
            dims = list(range(nd))
            dims[a], dims[b] = dims[b], dims[a]
        elif call.op == "movedim":
            dims = _movedim_order(p["source"], p["destination"], nd)
        else:
            dims = [int(d) % nd for d in p.get("dims", ())]
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError):
        return Call("other", {}, call.inplace, call.out)
    if sorted(dims) != list(range(t.dim())):
        return Call("other", {}, call.inplace, call.out)
    return Call("permute", {"input": t, "dims": tuple(dims)}, call.inplace, call.out)


def _movedim_order(source, destination, nd: int) -> list[int]:
    src = [int(source) % nd] if isinstance(source, int) else [int(d) % nd for d in source]
    dst = [int(destination) % nd] if isinstance(destination, int) else [int(d) % nd for d in destination]
    order: list = [None] * nd
    for s, d in zip(src, dst, strict=True):
        order[d] = s
    rest = iter(i for i in range(nd) if i not in src)
    return [next(rest) if o is None else o for o in order]


def _einsum_permutation(equation, operands) -> list[int] | None:
    """The axis order of a one-operand einsum that only moves axes (``"bhqd->bqhd"``), else None."""
    if not isinstance(equation, str) or len(operands) != 1 or not isinstance(operands[0], torch.Tensor):
        return None
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq or "," in eq:
        return None
    src, out = eq.split("->")
    nd = operands[0].dim()
    if len(src) != nd or len(set(src)) != nd or sorted(src) != sorted(out):
        return None
    return [src.index(c) for c in out]


def einsum_operands(params: dict) -> tuple[list[str], str, list] | None:
    """(input letters per operand, output letters, operands) of a two-operand einsum (its ``Call.params``) with an
    explicit output and no ellipsis, else None."""
    eq, operands = params.get("equation"), list(params.get("operands") or ())
    if not isinstance(eq, str) or len(operands) != 2:
        return None
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or any(len(set(s)) != len(s) for s in (*ins, out)):
        return None
    if any(not isinstance(t, torch.Tensor) or t.dim() != len(s) for t, s in zip(operands, ins)):
        return None
    return ins, out, operands
