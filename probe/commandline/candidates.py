"""Modules whose code holds a softmax: the hand-written attention a capture can read when asked
(``capture(model, modules=[...])``, ``attnprobe ... --modules NAME``).

Read from the source of each module's ``forward`` and of the functions it calls by name (one level:
the Annotated Transformer's ``attention(q, k, v)`` helper); nothing is run. torch's own layers and
attnprobe's modules are left out (other adapters read those, or they are not attention).

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Attn(nn.Module):
    ...     def forward(self, q, k):
    ...         return torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    >>> model = nn.Sequential(nn.Linear(4, 4), Attn())
    >>> [(c.name, c.module_class) for c in softmax_modules(model)]
    [('1', 'Attn')]
"""

from __future__ import annotations

import inspect
import re
import types
from dataclasses import dataclass

from torch import nn

from ..intent import library_code

_SOFTMAX = re.compile(r"\bsoftmax\s*\(|\.softmax\b|nn\.Softmax\b")
_CALLED = re.compile(r"(?<![.\w])([A-Za-z_]\w*)\s*\(")


@dataclass(frozen=True)
class Candidate:
    """A module whose code (or a function it calls) computes a softmax."""

    name: str  # from named_modules(); "" is the model itself
    module_class: str
    where: str  # "file.py:LINE" of the first softmax in that code


def _softmax_line(fn) -> str | None:
    """'file.py:LINE' of the first softmax in ``fn``'s source, or None (also when the source is unavailable)."""
    try:
        lines, start = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or "?"
    except (OSError, TypeError):
        return None
    for offset, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if _SOFTMAX.search(code):
            return f"{filename.rsplit('/', 1)[-1]}:{start + offset}"
    return None


def _forward_softmax(forward) -> str | None:
    found = _softmax_line(forward)
    if found is not None:
        return found
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    namespace = getattr(forward, "__globals__", {})
    for called in dict.fromkeys(_CALLED.findall(source)):  # functions called by bare name, in order
        fn = namespace.get(called)
        if isinstance(fn, types.FunctionType) and not library_code(fn):
            found = _softmax_line(fn)
            if found is not None:
                return found
    return None


def softmax_modules(model: nn.Module, *, exclude=()) -> list[Candidate]:
    """Modules of ``model`` whose ``forward`` (or a function it calls by name) computes a softmax.

    ``exclude``: modules to leave out (e.g. those another adapter already reads). A module of a class
    already listed is listed too (each is a layer of its own); torch, transformers and attnprobe classes
    are skipped.
    """
    skip = {id(m) for m in exclude}
    memo: dict[type, str | None] = {}
    out = []
    for name, module in model.named_modules():
        cls = type(module)
        if id(module) in skip or library_code(cls):
            continue
        if cls not in memo:
            forward = getattr(cls, "forward", None)
            memo[cls] = None if forward is None else _forward_softmax(forward)
        where = memo[cls]
        if where is not None:
            out.append(Candidate(name=name, module_class=cls.__name__, where=where))
    return out
